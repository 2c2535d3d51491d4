"""Shared pieces of the vLLM engine tests: one engine per module, a sync worker, exact checks.

Importing this module sets the environment vLLM reads when it is imported, so a test module
imports it before anything imports vLLM (``pytest.importorskip("vllm")`` included).
"""

from __future__ import annotations

import os

# In-process engine: a fast start, and plain-object collective_rpc arguments. No CPU binding:
# the machine is shared.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch

from rollout_sync import SpanKind, SyncReport, Timeline, weight_sync_handler
from rollout_sync.backends.vllm import (
    VLLMAsyncBackend,
    VLLMBlockingBackend,
    VLLMEngineConfig,
    VLLMWritePlan,
    greedy_params,
)
from rollout_sync.testing import STALLING_WORKER_EXTENSION
from rollout_sync.testing.tiny_llama import (
    build_tiny_llama,
    find_sync_split,
    greedy_reference,
    random_llama_weights,
)
from rollout_sync.trace import Span
from rollout_sync.transfer import TransferHooks, WeightTransfer

Weights = Mapping[str, torch.Tensor]
B = TypeVar("B", VLLMAsyncBackend, VLLMBlockingBackend)

NO_FORWARD_DURING = [(SpanKind.FORWARD, SpanKind.WEIGHT_WRITE), (SpanKind.FORWARD, SpanKind.SYNC)]
"""The span pairs that must never overlap: a forward against a weight write, or a whole sync."""


class Worker(Generic[B]):
    """A rollout worker reduced to its P2R handler; the guard finds ``rollout`` and ``timeline``."""

    def __init__(self, rollout: B, timeline: Timeline) -> None:
        self.rollout = rollout
        self.timeline = timeline
        self.weight_sync_timeout = 60.0
        self.reports: list[SyncReport] = []

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self.reports.append(report)

    @weight_sync_handler
    def receive_weights(
        self, weights: Weights, version: int, during: Callable[[], None] | None = None
    ) -> None:
        self.rollout.ensure_initialized()
        if during is not None:
            during()
        self.rollout.load_weights(weights)
        self.rollout.commit_weight_version(version)


@dataclass
class World(Generic[B]):
    """A module's engine, the model it serves, and the weights of every version synced to it."""

    backend: B
    worker: Worker[B]
    timeline: Timeline
    reference: greedy_reference
    shapes: dict[str, tuple[int, ...]]
    weights_seed: int
    """Version ``v`` is drawn with seed ``weights_seed + v``."""
    version: int = 0
    weights: dict[int, Weights] = field(default_factory=dict)
    first_sync: dict[str, object] = field(default_factory=dict)

    def weights_of(self, version: int) -> Weights:
        if version not in self.weights:
            self.weights[version] = random_llama_weights(
                self.shapes, seed=self.weights_seed + version
            )
        return self.weights[version]

    def sync(self, during: Callable[[], None] | None = None) -> int:
        """A guarded sync to a new version; returns it."""
        version = self.version + 1
        self.worker.receive_weights(self.weights_of(version), version, during)
        self.version = version
        return version

    def sync_split(
        self,
        prompt: list[int],
        tokens: list[int],
        old_version: int,
        new_version: int,
        *,
        at_least: int,
    ) -> int | None:
        """Where ``tokens`` switch from ``old_version``'s greedy continuation of ``prompt`` to
        ``new_version``'s continuation of the tokens so far; None if no such point exists."""
        old = self.reference(self.weights_of(old_version), prompt, len(tokens))
        return find_sync_split(
            tokens,
            old,
            lambda k: self.reference(
                self.weights_of(new_version), prompt + tokens[:k], len(tokens) - k
            ),
            at_least=at_least,
        )

    @contextmanager
    def spans_recorded(self) -> Iterator[list[Span]]:
        """Yield a list that, once the ``with`` body has ended, holds every span (the engine's
        forwards and writes included) that started inside it."""
        self.backend.collect_engine_spans()
        start_ns = time.monotonic_ns()
        spans: list[Span] = []
        yield spans
        self.backend.collect_engine_spans()
        spans.extend(s for s in self.timeline.spans() if s.start_ns >= start_ns)


@contextmanager
def running_world(
    backend_class: type[B],
    model_dir: Path,
    *,
    model_seed: int,
    weights_seed: int,
    first_sync: Callable[[World[B]], None] | None = None,
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs",
    **backend_kwargs: Any,
) -> Iterator[World[B]]:
    """A tiny random Llama (float32) in ``model_dir``, served by ``backend_class`` (reporting
    log-probabilities in ``logprobs_mode``).

    The engine starts lazily in a first guarded sync (``first_sync`` runs inside it, after the
    start) and is shut down when the ``with`` block ends.
    """
    initial = build_tiny_llama(model_dir, seed=model_seed)
    timeline = Timeline()
    backend = backend_class(
        VLLMEngineConfig(
            model_dir,
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            logprobs_mode=logprobs_mode,
            # The production extension plus a stall RPC, for the pause-timeout test.
            engine_kwargs={"worker_extension_cls": STALLING_WORKER_EXTENSION},
        ),
        timeline=timeline,
        **backend_kwargs,
    )
    world = World(
        backend,
        Worker(backend, timeline),
        timeline,
        greedy_reference(model_dir),
        {name: tuple(t.shape) for name, t in initial.items()},
        weights_seed,
        weights={0: initial},
    )
    try:
        world.sync(None if first_sync is None else lambda: first_sync(world))
        yield world
    finally:
        backend.shutdown()


@contextmanager
def corrupted_in_transit(transfer: WeightTransfer, bucket: int = 0) -> Iterator[None]:
    """For the ``with`` body, flip bytes of ``bucket`` after its source checksummed it: a bucket
    damaged in transit, which every receiver's checksum catches (after the reload started)."""

    def corrupt(index: int, flat: torch.Tensor) -> None:
        if index == bucket:
            flat[:16] ^= 0x5A

    transfer.hooks = TransferHooks(after_pack=corrupt)
    try:
        yield
    finally:
        transfer.hooks = TransferHooks()


def check_greedy_output_equals_transformers(world: World[Any]) -> None:
    """Sync a new version, generate greedily, compare every token with transformers."""
    version = world.sync()
    prompts = [[1, 5, 9, 33, 7], [3, 4, 5], [200, 100, 50, 25, 12, 6]]
    results = world.backend.generate(prompts, greedy_params(24), timeout=60)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.ok and result.finish_reason == "length"
        assert list(result.token_ids) == world.reference(world.weights_of(version), prompt, 24)
        assert (result.admitted_version, result.completed_version) == (version, version)
        assert not result.straddled


# -- native weight-transfer tests --------------------------------------------------------------


@contextmanager
def writes_by(backend: VLLMAsyncBackend | VLLMBlockingBackend, **options: Any) -> Iterator[None]:
    """For the block, ``backend`` writes by the plan ``options`` make (checked as the
    constructor checks them), so one started engine serves the tests of several write options.
    A test's seam: the production backend fixes its plan when it is built."""
    writer = backend._writer
    kept = writer.plan
    writer.plan = VLLMWritePlan.for_engine(backend.config, **options)
    try:
        yield
    finally:
        writer.plan = kept


def native_backend(
    model_dir: Path, transfer_engine: str, *, timeline: Timeline | None = None
) -> VLLMAsyncBackend:
    """A started :class:`VLLMAsyncBackend` on the tiny Llama in ``model_dir``, running vLLM's
    weight-transfer engine ``transfer_engine`` (and the stalling worker extension)."""
    backend = VLLMAsyncBackend(
        VLLMEngineConfig(
            model_dir,
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            weight_transfer_config={"backend": transfer_engine},
            engine_kwargs={"worker_extension_cls": STALLING_WORKER_EXTENSION},
        ),
        timeline=timeline,
        pause_timeout=30.0,
        rpc_timeout=60.0,
    )
    backend.ensure_initialized()
    return backend


class ForwardingClient:
    """vLLM's weight-sync client protocol passed on to ``inner`` call for call: a test's
    client subclasses it and overrides the one call it changes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


class TrainerWeights:
    """A native-update test's trainer side: ``current`` (what its ``MappingSource`` reads) and
    the random weights of every version (seeded ``seed + version``; version 0 is ``initial``)."""

    def __init__(self, initial: Mapping[str, torch.Tensor], seed: int) -> None:
        self.shapes = {n: tuple(t.shape) for n, t in initial.items()}
        self.current: dict[str, torch.Tensor] = dict(initial)
        self.seed = seed
        self._versions: dict[int, Mapping[str, torch.Tensor]] = {0: dict(initial)}

    def weights_of(self, version: int) -> Mapping[str, torch.Tensor]:
        if version not in self._versions:
            self._versions[version] = random_llama_weights(self.shapes, seed=self.seed + version)
        return self._versions[version]

    def send(
        self, engine: Any, version: int, weights: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        """Make ``weights`` (default: ``version``'s) current and send them through ``engine``."""
        self.current.clear()
        self.current.update(self.weights_of(version) if weights is None else weights)
        engine.send_weights(version)
        return version
