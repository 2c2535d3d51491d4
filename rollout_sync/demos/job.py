"""The main job's configuration, and how it builds the engines its replicas run, by name.

:class:`DistributedDemoConfig` is every knob of the multi-process demo
(:mod:`rollout_sync.demos.distributed`). Engines are registered by name in
:mod:`rollout_sync.backends` (:func:`~rollout_sync.backends.register_engine`; ``--backend
name``); :func:`build_engine` and :func:`trainer_model` are how the job reaches the one its
config names. Modules that register engines build on this one and the job imports them; this
module imports neither.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..backends import (
    AdapterModel,
    EngineHandle,
    EngineRequest,
    TrainerModel,
    register_engine,
    registered_engine,
)
from ..backends.torch_lm import TinyLMConfig
from ..learn import LearnConfig
from ..lora import ALPHA_KEY, random_adapter
from ..payload import PayloadSender
from ..sync.mode import SyncMode
from ..trace import Timeline
from ..transfer.layout import Layout, region_of

__all__ = [
    "DELTA_LR",
    "DEMO_ADAPTER",
    "VLLM_LEARN_LR",
    "VLLM_START_S",
    "DistributedDemoConfig",
    "build_engine",
    "drift_each_step",
    "drift_shards_each_step",
    "register_demo_backend",
    "trainer_adapter",
    "trainer_model",
]


@dataclass(frozen=True)
class DistributedDemoConfig:
    """Knobs of the multi-process demo. The defaults finish in ~15 s on two cores."""

    replicas: int = 3
    steps: int = 30
    trainer_ranks: int = 1
    """Processes of the trainer. Above 1, each holds only its FSDP-style shard of the model
    (every tensor cut along dim 0) and sends only its own regions (a sharded P2R)."""
    tp: int = 1
    """Processes of each replica (tensor parallel: each serves its slice of the model). With
    ``trainer_ranks`` or ``tp`` above 1 the job is sharded (torch_lm, sync mode only); with both
    at 1 it is the plain job."""
    backend: str = "torch_lm"
    """The engine, by the name it is registered under
    (:func:`~rollout_sync.backends.registered_engines`)."""
    mode: SyncMode = SyncMode.SYNC
    guarded: bool = True
    model: TinyLMConfig = field(default_factory=TinyLMConfig)
    """torch_lm: the replicas' engine and the trainer's weights (same architecture)."""
    max_concurrent: int = 8
    """torch_lm: sequences decoded together; the queue is kept at twice this."""
    min_new_tokens: int = 4
    max_new_tokens: int = 48
    """torch_lm: generations are of mixed length, uniform in [min_new_tokens, max_new_tokens]."""
    num_tensors: int = 32
    numel: int = 65536
    """torn_read: elements (float32) per tensor: 32 x 65536 x 4 B = 8 MiB by default."""
    bucket_bytes: int = 4 << 20
    checksums: bool = False
    pipelined_relay: bool = False
    """The first replica passes each bucket on to the others as it arrives (``P2R(relay=True)``;
    the two hops overlap) instead of an R2R after the P2R."""
    step_interval_s: float = 0.1
    """The trainer's training step: it takes the payloads that arrive for this long."""
    payload_capacity: int = 256
    """Payloads a replica may have registered and not yet sent (backpressure beyond)."""
    payload_window: int = 64
    """Payloads the trainer grants each replica credit for at once."""
    timeout_s: float = 30.0
    """Limit of every collective, pause, hold, fence and payload wait."""
    check_every_step: bool = True
    """Compare every version every replica received with the trainer's (a digest each)."""
    seed: int = 0
    lora: bool = False
    """The trainer trains a LoRA adapter (:data:`DEMO_ADAPTER`) on the replicas' own base
    model: every step ships only the adapter, which the replicas receive into its slot
    (``P2R(adapter=...)``), and half the generations run on it. Needs an engine registered
    with an ``adapter``."""
    lora_rank: int = 8
    """``lora``: the adapter's rank (its alpha is twice the rank)."""
    learn: LearnConfig | None = None
    """The trainer learns (:mod:`rollout_sync.demos.learning`): an fp32 master of the model the
    engine's registration names (its ``learner``) and AdamW on the task's rollouts the replicas
    generate. On torch_lm that is ``model`` and it pushes ``model.dtype`` (give ``model``
    bfloat16 to serve bf16, as ``rollout-sync demo --learn`` does); on vllm the tiny Llama,
    pushed in bf16. The plain job, sync or staged."""
    delta: bool = False
    """The trainer sends each version as its changes against the last one the replicas
    committed (``TransferWeightPusher(delta=True)``; the first sync, a keyframe or a delta no
    smaller than the whole version go whole). Without ``learn`` the trainer then takes real
    AdamW steps at ``delta_lr`` instead of adding noise
    (:class:`~rollout_sync.demos.learning.NextTokenTrainer`: the master of the engine's
    ``learner``, a next-token loss on random tokens) and pushes the learner's served dtype,
    which the replicas serve (give ``model`` bfloat16 on torch_lm, as ``rollout-sync demo
    --delta`` does). Needs an engine registered with a learner; the plain job only, no
    ``lora``."""
    full_every: int | None = None
    """With ``delta``: every ``full_every``-th sync goes whole (a keyframe); ``None``: only the
    fallbacks do."""
    delta_lr: float = 1e-6
    """With ``delta`` and no ``learn``: AdamW's learning rate (:data:`DELTA_LR`, a realistic
    one for a large model: 1-4 % of bf16 elements change a step)."""

    @property
    def sharded(self) -> bool:
        """Several trainer ranks or tensor-parallel replicas: the sharded job."""
        return self.trainer_ranks > 1 or self.tp > 1


DEMO_ADAPTER = "policy"
"""The name of the adapter the ``--lora`` demo trains and serves."""

VLLM_START_S = 150.0
"""Allowance for starting the vLLM replicas' engines (inside the first sync) on a busy machine:
the ``vllm`` engine's ``start_s``."""


DELTA_LR = DistributedDemoConfig.delta_lr
"""``rollout-sync demo --delta``'s default learning rate without ``--learn``."""


VLLM_LEARN_LR = 5e-3
"""AdamW's default learning rate for the tiny Llama under ``--learn``: measured, it learns the
512-token task in the default 40 steps (3e-3, the tiny torch LM's, is slower; 1e-2 climbs
faster but falls back)."""


def build_engine(
    config: DistributedDemoConfig, timeline: Timeline, sender: PayloadSender
) -> EngineHandle:
    """A replica's engine (not started): the factory registered as ``config.backend``, called
    with the config, the replica's timeline and its payload sender.

    Raises:
        KeyError: no engine is registered under that name (the message lists those that are).
    """
    return registered_engine(config.backend).factory(EngineRequest(config, timeline, sender))


def trainer_model(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """The trainer's weights for ``config.backend`` (named like its served tensors) and the
    ``advance(step)`` that moves them.

    Raises:
        KeyError: no engine is registered under that name.
        ValueError: the engine was registered without a ``trainer_model``.
    """
    model = registered_engine(config.backend).trainer_model
    if model is None:
        raise ValueError(
            f"engine {config.backend!r} was registered without a trainer_model: the demo's "
            "trainer needs one (register_engine(..., trainer_model=...))"
        )
    return model(config)


def register_demo_backend(
    name: str,
    engine: Callable[[DistributedDemoConfig, Timeline, PayloadSender], EngineHandle],
    trainer_model: TrainerModel,
    *,
    modes: Iterable[SyncMode] = (SyncMode.SYNC,),
    start_s: float = 0.0,
    starts_processes: bool = False,
    adapter: AdapterModel | None = None,
) -> None:
    """Deprecated: :func:`rollout_sync.backends.register_engine` (whose factory takes one
    :class:`~rollout_sync.backends.EngineRequest`). Registers ``engine(config, timeline,
    sender)`` under ``name``, replacing an engine of that name, as it always did."""
    warnings.warn(
        "rollout_sync.demos.job.register_demo_backend is deprecated: register with "
        "rollout_sync.backends.register_engine(name, factory, trainer_model=..., ...), whose "
        "factory takes one EngineRequest (request.config, request.timeline, request.sender)",
        DeprecationWarning,
        stacklevel=2,
    )

    def factory(request: EngineRequest) -> EngineHandle:
        return engine(request.config, request.timeline, request.sender)

    register_engine(
        name,
        factory,
        trainer_model=trainer_model,
        modes=modes,
        start_s=start_s,
        starts_processes=starts_processes,
        adapter=adapter,
        replace=True,
    )


def trainer_adapter(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """``--lora``: the trainer's adapter on the engine's target modules (drawn from the
    config's seed) and an ``advance`` that moves its ``A`` and ``B`` every step (alpha stays)."""
    adapter_model = registered_engine(config.backend).adapter
    if adapter_model is None:
        raise ValueError(f"engine {config.backend!r} serves no LoRA adapter")
    lora, shapes = adapter_model(config)
    weights = random_adapter(lora, shapes, seed=config.seed + 3)
    trained = {n: t for n, t in weights.items() if n != ALPHA_KEY}
    return weights, drift_each_step(trained, seed=config.seed + 4)


def drift_each_step(weights: Mapping[str, torch.Tensor], *, seed: int) -> Callable[[int], None]:
    """A trainer model's ``advance``: every step adds seeded noise (std 0.01) to every tensor in
    place, so every version differs.

    The noise is scaled, then added: two roundings each of which any kernel does alike, so a
    region of a tensor moves bit for bit as the whole tensor's region does
    (:func:`drift_shards_each_step`; an ``add_(..., alpha=)`` may fuse the multiply-add in its
    vectorized loop and not in its tail)."""
    noise = torch.Generator().manual_seed(seed)

    def advance(step: int) -> None:
        with torch.no_grad():
            for tensor in weights.values():
                tensor.add_(
                    torch.randn(tensor.shape, generator=noise, dtype=tensor.dtype).mul_(1e-2)
                )

    return advance


def drift_shards_each_step(
    shards: Mapping[str, torch.Tensor], layout: Layout, rank: int, *, seed: int
) -> Callable[[int], None]:
    """:func:`drift_each_step` on one rank's shards: rank ``rank`` of ``layout`` holds
    ``shards`` (its local tensors), and each step moves them exactly as
    ``drift_each_step(whole, seed=seed)`` moves the whole tensors they were cut from (the same
    noise, drawn whole, one tensor at a time in ``layout.specs`` order, of which each shard adds
    its own region: an element-wise add, so bit for bit). The rank holds its shards and one
    tensor's noise at a time, never the whole model."""
    noise = torch.Generator().manual_seed(seed)
    placed: dict[str, list[tuple[torch.Tensor, tuple[tuple[int, int], ...]]]] = {}
    for local in layout.ranks[rank]:
        for piece, offset in local.placed():
            if any(start == stop for start, stop in piece.box):
                continue  # an empty shard (more ranks than rows)
            view = region_of(shards[local.name], local.local_box(piece, offset, piece.box))
            placed.setdefault(piece.tensor, []).append((view, piece.box))

    def advance(step: int) -> None:
        with torch.no_grad():
            for spec in layout.specs:
                whole = torch.randn(spec.shape, generator=noise, dtype=spec.dtype).mul_(1e-2)
                for view, box in placed.get(spec.name, ()):
                    view.add_(region_of(whole, box))

    return advance
