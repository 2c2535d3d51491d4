"""The sharded main job's parts: who is where, what each rank holds, the commands, the barrier,
and what every rank must end up holding.

``rollout-sync demo --trainer-ranks N --tp T`` runs the main job
(:mod:`rollout_sync.demos.distributed`) sharded: ranks ``0 .. N-1`` are the trainer, each
holding its FSDP-style shard of the tiny LM (every tensor cut along dim 0:
:func:`trainer_layout`); then each replica is ``T`` consecutive ranks serving the model with
tensor parallelism (:func:`replica_layout`; its first rank, the leader, schedules and ships the
payloads). A sync is a :class:`~rollout_sync.transfer.ShardedTransfer` from the trainer ranks
to the first replica's ranks along a :class:`~rollout_sync.transfer.TransferPlan` between the
two layouts (each region straight from the trainer rank that owns it to the replica rank that
serves it), then an R2R per position ``k``: the first replica's ``k``-th rank to every other
replica's ``k``-th rank (:func:`~rollout_sync.sharded_groups.build_sharded_sync_groups`).

This module is the part of that job that does not run an engine: the layouts
(:func:`demo_layout`, :func:`trainer_layout`, :func:`replica_layout`), the refusals
(:func:`check_sharded_config`), and the digests every trainer rank and every replica rank must
hold at each version (:func:`expected_digests`, replayed from the trainer model's seed). The
commands and the P2R barrier are the library's
(:meth:`~rollout_sync.sharded_groups.ShardedSyncGroups.command_channel`,
:meth:`~rollout_sync.sharded_groups.ShardedSyncGroups.p2r_barrier`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..backends.torch_lm import tiny_lm_weights
from ..backends.torch_lm.tensor_parallel import tiny_lm_layout
from ..launch import JobLayout
from ..sync.mode import SyncMode
from ..testing import weights_digest
from ..transfer import Layout
from ..weights import WeightSpec, specs_of
from .job import DistributedDemoConfig, trainer_model

__all__ = [
    "SHARDED_BACKEND",
    "ExpectedDigests",
    "check_sharded_config",
    "demo_layout",
    "expected_digests",
    "replica_layout",
    "trainer_layout",
]

SHARDED_BACKEND = "torch_lm"
"""The one engine the sharded job runs (its tensor-parallel layout is the tiny LM's)."""


def demo_layout(config: DistributedDemoConfig) -> JobLayout:
    """The job's ranks: the plain ``replicas + 1`` processes, or, sharded, ``trainer_ranks``
    trainer ranks then ``replicas`` replicas of ``tp`` ranks each."""
    if config.sharded:
        return JobLayout.sharded(config.trainer_ranks, config.replicas, config.tp)
    return JobLayout(config.replicas + 1)


def check_sharded_config(config: DistributedDemoConfig) -> None:
    """Refuse a sharded config the job cannot run (a plain one passes).

    Raises:
        ValueError: ``trainer_ranks`` or ``tp`` below 1, an engine other than torch_lm, a sync
            mode other than sync, or a ``tp`` the model's heads or MLP do not split over.
    """
    if config.trainer_ranks < 1 or config.tp < 1:
        raise ValueError(
            f"trainer_ranks (--trainer-ranks) and tp (--tp) must be at least 1, got "
            f"trainer_ranks={config.trainer_ranks}, tp={config.tp}"
        )
    if not config.sharded:
        return
    if config.backend != SHARDED_BACKEND:
        raise ValueError(
            f"the sharded job (trainer_ranks={config.trainer_ranks}, tp={config.tp}) runs the "
            f"{SHARDED_BACKEND} engine only, not {config.backend!r} (--backend {SHARDED_BACKEND})"
        )
    if config.mode is not SyncMode.SYNC:
        raise ValueError(
            f"the sharded job (trainer_ranks={config.trainer_ranks}, tp={config.tp}) runs the "
            f"sync mode only, not {config.mode.value!r} (--mode sync)"
        )
    heads = config.model.n_heads
    try:
        if heads % config.tp:
            raise ValueError(f"{heads} heads do not split evenly over {config.tp} ranks")
        replica_layout(config)
    except ValueError as exc:
        raise ValueError(
            f"tp={config.tp} does not divide the model ({heads} heads, d_ff "
            f"{config.model.d_ff}): {exc}; choose a --tp that divides {heads}"
        ) from None


def trainer_layout(
    weights: Sequence[WeightSpec] | Mapping[str, torch.Tensor], ranks: int
) -> Layout:
    """The trainer's FSDP-style layout of the whole tensors ``weights`` (or their specs, in the
    model's order): every tensor with a dimension cut along dim 0 into ``ranks`` contiguous
    parts (as ``torch.chunk`` cuts, FSDP2's ``Shard(0)``); a scalar is replicated."""
    specs = specs_of(weights) if isinstance(weights, Mapping) else list(weights)
    return Layout.build(specs, ranks, shard={s.name: 0 for s in specs if len(s.shape)})


def replica_layout(config: DistributedDemoConfig) -> Layout:
    """How a replica of ``config.tp`` ranks serves the tiny LM (Megatron's split): the layout
    of :func:`~rollout_sync.backends.torch_lm.tiny_lm_tp_layout`, from the specs of a model
    built for them (``tiny_lm_tp_layout`` builds one on the meta device, whose first use
    imports ``torch._dynamo``: a second or more per process, which the trainer ranks and the
    controller need not pay)."""
    specs = specs_of(tiny_lm_weights(config.model, config.model.seed))
    return tiny_lm_layout(specs, config.model.n_layers, config.tp)


# -- what every rank must hold -----------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedDigests:
    """The digest (:func:`~rollout_sync.testing.weights_digest`) of what each rank must hold at
    each version, replayed from the trainer model's seed: ``trainer[version][i]`` of trainer
    rank ``i``'s shards, ``replica[version][k]`` of a replica's ``k``-th rank's slice."""

    trainer: dict[int, tuple[str, ...]]
    replica: dict[int, tuple[str, ...]]
    model_nbytes: int


def expected_digests(config: DistributedDemoConfig) -> ExpectedDigests:
    """Replay the trainer's whole model (the engine's trainer model, seeded, advanced step by
    step) and cut, at every version ``1 .. steps``, each trainer rank's shards
    (:func:`trainer_layout`) and each replica rank's slice (:func:`replica_layout`)."""
    weights, advance = trainer_model(config)
    trainers = trainer_layout(weights, config.trainer_ranks)
    replicas = replica_layout(config)
    trainer: dict[int, tuple[str, ...]] = {}
    replica: dict[int, tuple[str, ...]] = {}
    for step in range(1, config.steps + 1):
        advance(step)
        trainer[step] = tuple(
            weights_digest(trainers.shard(weights, i)) for i in range(config.trainer_ranks)
        )
        replica[step] = tuple(weights_digest(replicas.shard(weights, k)) for k in range(config.tp))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return ExpectedDigests(trainer, replica, nbytes)
