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
(:func:`check_sharded_config`), the trainer's announcements turned into every replica rank's
commands (:class:`ShardedCommandChannel`), the P2R barrier of the sharded group
(:class:`ShardedP2RBarrier`), and the digests every trainer rank and every replica rank must
hold at each version (:func:`expected_digests`, replayed from the trainer model's seed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._deadline import deadline_after, remaining
from ..backends.torch_lm import tiny_lm_weights
from ..backends.torch_lm.tensor_parallel import tiny_lm_layout
from ..distributed import GroupCollectives, wait_work
from ..errors import ManifestRejected
from ..guard import SyncMode
from ..launch import JobLayout
from ..testing import weights_digest
from ..trainer import WeightSyncCommand
from ..transfer import Layout
from ..weights import WeightSpec, specs_of
from ..worker import CommandSink, WorkerCommandChannel
from .job import DEMO_BACKENDS, DistributedDemoConfig

__all__ = [
    "SHARDED_BACKEND",
    "ExpectedDigests",
    "ShardedCommandChannel",
    "ShardedP2RBarrier",
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


# -- commands ----------------------------------------------------------------------------------


class ShardedCommandChannel:
    """The trainer's :class:`~rollout_sync.trainer.CommandChannel` for replicas of several
    ranks: each announcement becomes a command on every replica rank's queue.

    A sharded sync runs per position ``k`` within a replica exactly as a plain job's runs per
    replica: the first replica's ``k``-th rank takes the P2R (with the other first-replica
    ranks, in one :class:`~rollout_sync.transfer.ShardedTransfer`) and is the source of the
    R2R group of the ``k``-th ranks. So this is one
    :class:`~rollout_sync.worker.WorkerCommandChannel` per position over the ``k``-th ranks:
    ``P2R`` to every rank of the first replica, then, with more than one replica, ``R2R`` to
    every replica rank; with ``pipelined_relay``, ``P2R(relay=True)`` to the first replica's
    ranks (each passes its slice on once it has it: a sharded relay is not pipelined by the
    bucket) and ``R2R`` to the other replicas' ranks; ``STOP``: ``Stop()`` to every rank.

    Args:
        queues: replica rank -> its command queue (every rank of every replica).
        replicas: each replica's ranks, the first replica first, each in its tensor-parallel
            order (:attr:`~rollout_sync.launch.JobLayout.replica_groups`).
        pipelined_relay: see above.
    """

    def __init__(
        self,
        queues: Mapping[int, CommandSink],
        replicas: Sequence[Sequence[int]],
        *,
        pipelined_relay: bool = False,
    ) -> None:
        groups = tuple(tuple(r) for r in replicas)
        if not groups or len({len(r) for r in groups}) != 1 or not groups[0]:
            raise ValueError(f"replicas must be of one size, at least one rank: {groups}")
        self.replicas = groups
        self.pipelined_relay = pipelined_relay
        self.positions = tuple(
            WorkerCommandChannel(
                queues, [replica[k] for replica in groups], pipelined_relay=pipelined_relay
            )
            for k in range(len(groups[0]))
        )

    def commands_for(self, announcement: WeightSyncCommand) -> list[tuple[int, object]]:
        """The ``(replica rank, command)`` pairs one announcement becomes."""
        return [pair for channel in self.positions for pair in channel.commands_for(announcement)]

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        """Put the commands ``command`` becomes on the replica ranks' queues (every put of it
        within ``timeout``; see :meth:`~rollout_sync.worker.WorkerCommandChannel.announce`)."""
        deadline = deadline_after(timeout)
        for channel in self.positions:
            channel.announce(command, remaining(deadline))

    def receive(self, timeout: float) -> WeightSyncCommand:
        raise TypeError(
            "a ShardedCommandChannel only announces: the replica ranks take their commands from "
            "their queues (RolloutWorker(commands=...))"
        )

    def __repr__(self) -> str:
        relay = ", pipelined relay" if self.pipelined_relay else ""
        return f"<ShardedCommandChannel replicas={[list(r) for r in self.replicas]}{relay}>"


# -- the barrier -------------------------------------------------------------------------------

_BARRIER_MAGIC = 0x5253_4241_5252  # "RSBARR"


class ShardedP2RBarrier:
    """The CPU-side P2R barrier of a sharded job: every trainer rank and every rank of the first
    replica meet here before each sharded P2R.

    The one-source job's barrier (:meth:`~rollout_sync.worker.SyncGroups.p2r_barrier`) for a
    P2R group of many ranks: the trainer ranks take it in their pusher
    (``TransferWeightPusher(barrier=...)``), the first replica's ranks inside their P2R bracket,
    paused, payload egress held (``RolloutWorker(p2r_barrier=...)``). Once past it, the trainer
    rank that receives payloads may hold its receives: the replica that is about to receive
    can no longer be waiting for it to receive (docs/transport.md).

    Every rank of the group takes it, or none: it is one all-gather on the P2R group (gloo),
    which the transfer's own collectives follow in the same order on every rank.

    Args:
        group: the P2R group (:attr:`~rollout_sync.sharded_groups.ShardedSyncGroups.p2r`), on
            gloo.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.collectives = GroupCollectives(group)
        if self.collectives.backend != "gloo":
            raise ValueError(
                f"the sharded P2R barrier runs on a gloo group, not {self.collectives.backend}"
            )

    def __call__(self, timeout: float) -> None:
        """Meet the others (each collective bounded by ``timeout`` seconds).

        Raises:
            ManifestRejected: a rank took part in something else (not this barrier).
            CollectiveTimeout / CollectiveError: a rank did not arrive in time, or died.
        """
        ranks = self.collectives.ranks
        op = f"sharded P2R barrier of ranks {list(ranks)}"
        mine = torch.tensor([_BARRIER_MAGIC], dtype=torch.int64)
        rows = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        work = self.collectives.all_gather(rows, mine)
        wait_work(work, operation=op, timeout_s=timeout, group=self.group, ranks=ranks)
        votes = torch.cat(rows).tolist()
        odd = [r for r, v in zip(ranks, votes, strict=True) if v != _BARRIER_MAGIC]
        if odd:
            raise ManifestRejected(
                f"{op}: rank(s) {odd} met it with something else (every rank of the P2R group "
                "takes the barrier, or none does); nothing was sent",
                operation=op,
                version=None,
                rejected_by=odd,
            )

    def __repr__(self) -> str:
        return f"<ShardedP2RBarrier ranks={list(self.collectives.ranks)}>"


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
    """Replay the trainer's whole model (the backend's trainer model, seeded, advanced step by
    step) and cut, at every version ``1 .. steps``, each trainer rank's shards
    (:func:`trainer_layout`) and each replica rank's slice (:func:`replica_layout`)."""
    weights, advance = DEMO_BACKENDS[config.backend].trainer_model(config)
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
