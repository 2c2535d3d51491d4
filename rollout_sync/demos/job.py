"""The main job's configuration, and the engines its replicas can run, by name.

:class:`DistributedDemoConfig` is every knob of the multi-process demo
(:mod:`rollout_sync.demos.distributed`). An engine is registered under a name with
:func:`register_demo_backend` (``--backend name``): the replicas' side (:data:`EngineFactory`,
returning a :class:`DemoEngine`) and the trainer's weights (:data:`TrainerModel`). Modules that
register engines build on this one and the job imports them; this module imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..backend import RolloutBase
from ..backends.torch_lm import TinyLMConfig
from ..guard import SyncMode
from ..lora import ALPHA_KEY, LoRAConfig, random_adapter
from ..payload import PayloadSender
from ..trace import Timeline
from ..transfer.layout import Layout, region_of

__all__ = [
    "DEMO_ADAPTER",
    "DEMO_BACKENDS",
    "AdapterModel",
    "DemoBackend",
    "DemoEngine",
    "DistributedDemoConfig",
    "EngineFactory",
    "TrainerModel",
    "drift_each_step",
    "drift_shards_each_step",
    "register_demo_backend",
    "trainer_adapter",
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
    """A key of :data:`DEMO_BACKENDS`."""
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
    with an ``adapter`` model."""
    lora_rank: int = 8
    """``lora``: the adapter's rank (its alpha is twice the rank)."""

    @property
    def sharded(self) -> bool:
        """Several trainer ranks or tensor-parallel replicas: the sharded job."""
        return self.trainer_ranks > 1 or self.tp > 1


@dataclass
class DemoEngine:
    """What a demo engine factory returns: the engine, and how to read its counters."""

    rollout: RolloutBase
    """A :class:`~rollout_sync.worker.BackgroundEngine`: the worker starts it inside the first
    sync and stops it on close; it ships its results through the sender it was given."""
    counters: Callable[[], dict[str, int]]
    """``forwards``, ``torn_forwards`` (what the engine's own detector saw),
    ``generation_pauses`` and ``installs``; engine-specific extras are reported as they are."""
    close: Callable[[], None] = lambda: None
    """Release what the engine holds (an engine process), after the replica's report is taken."""


EngineFactory = Callable[[DistributedDemoConfig, Timeline, PayloadSender], DemoEngine]
"""Builds a replica's engine (not started) that ships payloads through the sender."""

TrainerModel = Callable[
    [DistributedDemoConfig], tuple[dict[str, torch.Tensor], Callable[[int], None]]
]
"""The trainer's weights (named like the engine's served tensors) and ``advance(step)``, which
moves them in place to the version of that step."""

AdapterModel = Callable[[DistributedDemoConfig], tuple[LoRAConfig, dict[str, tuple[int, int]]]]
"""``--lora``: the adapter's manifest on this engine and the (in, out) of its target modules."""

DEMO_ADAPTER = "policy"
"""The name of the adapter the ``--lora`` demo trains and serves."""


@dataclass(frozen=True)
class DemoBackend:
    """An engine the demo can run: the replicas' side and the trainer's weights."""

    engine: EngineFactory
    trainer_model: TrainerModel
    modes: frozenset[SyncMode]
    """The sync modes the engine supports (async modes need a weight-buffer backend)."""
    start_s: float = 0.0
    """How long starting the engine may take (inside the first sync): added to the run's
    limit, and to the ``timeout_s`` the command line gives the run."""
    starts_processes: bool = False
    """The engine starts processes of its own: the replicas must not be daemonic."""
    adapter: AdapterModel | None = None
    """``--lora``: what adapter the engine serves (``None``: it serves none)."""


DEMO_BACKENDS: dict[str, DemoBackend] = {}
"""Engines the demo can run, by name."""


def register_demo_backend(
    name: str,
    engine: EngineFactory,
    trainer_model: TrainerModel,
    *,
    modes: Iterable[SyncMode] = (SyncMode.SYNC,),
    start_s: float = 0.0,
    starts_processes: bool = False,
    adapter: AdapterModel | None = None,
) -> None:
    """Make an engine available as ``--backend name``.

    Register at import time of a module that the demo imports, since the processes are
    spawned and look the backend up by name. ``start_s``, ``starts_processes`` and
    ``adapter``: see :class:`DemoBackend`.
    """
    DEMO_BACKENDS[name] = DemoBackend(
        engine, trainer_model, frozenset(modes), start_s, starts_processes, adapter
    )


def trainer_adapter(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """``--lora``: the trainer's adapter on the engine's target modules (drawn from the
    config's seed) and an ``advance`` that moves its ``A`` and ``B`` every step (alpha stays)."""
    adapter_model = DEMO_BACKENDS[config.backend].adapter
    if adapter_model is None:
        raise ValueError(f"demo backend {config.backend!r} serves no LoRA adapter")
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
