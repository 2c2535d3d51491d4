"""VLLMBlockingBackend (vllm.LLM, in-process) on vLLM for CPU, tiny random Llama, float32.

One engine for the module. ``paused()`` is the base no-op here; the step-hook case (a sync run
between two engine steps inside a ``generate`` call) is made safe by the write itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync import (
    RolloutBase,
    SpanKind,
    Timeline,
    find_overlaps,
    weight_sync_handler,
)
from rollout_sync.backends.tiny_llama import (
    build_tiny_llama,
    find_sync_split,
    greedy_reference,
    random_llama_weights,
)
from rollout_sync.backends.vllm import (
    KVCachePolicy,
    VLLMBlockingBackend,
    VLLMEngineConfig,
    greedy_params,
)

pytestmark = pytest.mark.vllm

Weights = Mapping[str, torch.Tensor]

SYNC_STEP = 20


class Worker:
    def __init__(self, rollout: VLLMBlockingBackend, timeline: Timeline) -> None:
        self.rollout = rollout
        self.timeline = timeline
        self.weight_sync_timeout = 60.0

    @weight_sync_handler
    def receive_weights(self, weights: Weights, version: int) -> None:
        self.rollout.ensure_initialized()
        self.rollout.load_weights(weights)
        self.rollout.commit_weight_version(version)


@dataclass
class World:
    backend: VLLMBlockingBackend
    worker: Worker
    timeline: Timeline
    reference: greedy_reference
    shapes: dict[str, tuple[int, ...]]
    version: int = 0
    weights: dict[int, Weights] = field(default_factory=dict)

    def weights_of(self, version: int) -> Weights:
        if version not in self.weights:
            self.weights[version] = random_llama_weights(self.shapes, seed=2000 + version)
        return self.weights[version]

    def sync(self) -> int:
        version = self.version + 1
        self.worker.receive_weights(self.weights_of(version), version)
        self.version = version
        return version


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_blocking")
    initial = build_tiny_llama(model_dir, seed=3)
    timeline = Timeline()
    backend = VLLMBlockingBackend(
        VLLMEngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20),
        timeline=timeline,
    )
    w = World(backend, Worker(backend, timeline), timeline, greedy_reference(model_dir),
              {n: tuple(t.shape) for n, t in initial.items()}, weights={0: initial})
    try:
        w.sync()  # starts the engine lazily inside the bracket
        yield w
    finally:
        backend.shutdown()


def _sync_at_step(world: World, step: int, action: Callable[[], None]) -> Callable[[], None]:
    """A step hook that runs ``action`` once, after engine step ``step``."""
    count = 0

    def hook() -> None:
        nonlocal count
        count += 1
        if count == step:
            action()

    return hook


@pytest.mark.timeout(60)
def test_paused_is_the_base_no_op(world: World) -> None:
    assert type(world.backend).paused is RolloutBase.paused
    with world.backend.paused(0.01), world.backend.paused(0.01):
        pass


@pytest.mark.timeout(120)
def test_greedy_output_equals_transformers(world: World) -> None:
    version = world.sync()
    prompts = [[1, 5, 9, 33, 7], [3, 4, 5], [200, 100, 50, 25, 12, 6]]
    results = world.backend.generate(prompts, greedy_params(24))
    for prompt, result in zip(prompts, results):
        assert result.ok
        assert list(result.token_ids) == world.reference(world.weights_of(version), prompt, 24)
        assert (result.admitted_version, result.completed_version) == (version, version)


def _generate_through_a_step_hook_sync(world: World) -> tuple[list[int], list[int], int, int]:
    old_version = world.version
    prompt = [1, 17, 42, 99, 7]
    hook = _sync_at_step(world, SYNC_STEP, world.sync)
    result = world.backend.generate([prompt], greedy_params(60), step_hook=hook)[0]
    assert result.ok and len(result.token_ids) == 60
    assert (result.admitted_version, result.completed_version) == (old_version, world.version)
    return prompt, list(result.token_ids), old_version, world.version


@pytest.mark.timeout(180)
def test_a_sync_from_a_step_hook_recomputes_sequences_in_flight(world: World) -> None:
    prompt, tokens, old_v, new_v = _generate_through_a_step_hook_sync(world)
    old = world.reference(world.weights_of(old_v), prompt, len(tokens))
    split = find_sync_split(
        tokens, old,
        lambda k: world.reference(world.weights_of(new_v), prompt + tokens[:k], len(tokens) - k),
        at_least=SYNC_STEP,
    )
    # One token per step (the first from the prefill): the sync came after token SYNC_STEP.
    assert split == SYNC_STEP


@pytest.mark.timeout(180)
def test_keeping_stale_kv_in_a_step_hook_mixes_versions(world: World) -> None:
    """What the step-hook write's KV handling prevents: without it the tokens are a mix."""
    world.backend.kv_cache_policy = KVCachePolicy.KEEP_STALE
    try:
        prompt, tokens, old_v, new_v = _generate_through_a_step_hook_sync(world)
    finally:
        world.backend.kv_cache_policy = KVCachePolicy.RECOMPUTE
    old = world.reference(world.weights_of(old_v), prompt, len(tokens))
    split = find_sync_split(
        tokens, old,
        lambda k: world.reference(world.weights_of(new_v), prompt + tokens[:k], len(tokens) - k),
        at_least=SYNC_STEP,
    )
    assert split is None


@pytest.mark.timeout(120)
def test_a_write_from_another_thread_during_generate_is_refused(world: World) -> None:
    version = world.version
    errors: list[BaseException] = []

    def write_from_elsewhere() -> None:
        def target() -> None:
            try:
                world.backend.load_weights(world.weights_of(version + 1))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join(60)

    prompt = [6, 6, 6]
    result = world.backend.generate([prompt], greedy_params(30),
                                    step_hook=_sync_at_step(world, 5, write_from_elsewhere))[0]
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "step_hook" in str(errors[0])
    assert not world.backend.weights_torn
    assert list(result.token_ids) == world.reference(world.weights_of(version), prompt, 30)
    assert not result.straddled


@pytest.mark.timeout(120)
def test_no_forward_overlaps_a_write_in_the_step_hook_case(world: World) -> None:
    backend, timeline = world.backend, world.timeline
    backend.collect_engine_spans()
    start_ns = time.monotonic_ns()
    hooks = [_sync_at_step(world, n, world.sync) for n in (5, 10, 15)]
    backend.generate([[2, 3, 4]], greedy_params(40), step_hook=lambda: [h() for h in hooks])
    backend.collect_engine_spans()
    spans = [s for s in timeline.spans() if s.start_ns >= start_ns]
    assert len([s for s in spans if s.kind == SpanKind.WEIGHT_WRITE]) == 3
    assert len([s for s in spans if s.kind == SpanKind.FORWARD]) >= 40
    pairs = [(SpanKind.FORWARD, SpanKind.WEIGHT_WRITE), (SpanKind.FORWARD, SpanKind.SYNC)]
    assert find_overlaps(spans, pairs) == []
