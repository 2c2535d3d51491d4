"""The tiny torch LM backend: a real model, deterministic, with in-place, validated weight writes
and a torn-read detector that fires on a real unguarded write."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch_lm_helpers import (  # noqa: F401 - one_torch_thread is an autouse fixture
    Runner,
    full_forward_argmax,
    one_torch_thread,
    tiny_config,
    wait_until,
    weights_of,
)

from rollout_sync import (
    GenerationRequest,
    PauseTimeout,
    SamplingParams,
    SpanKind,
    Timeline,
    TornWeightsError,
    WeightMismatchError,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.scheduler import FinishReason


def test_weights_are_deterministic_per_seed_and_differ_everywhere_between_seeds() -> None:
    config = tiny_config()
    a, again, b = (tiny_lm_weights(config, s) for s in (3, 3, 4))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], again[name])
        assert not torch.equal(a[name], b[name]), f"{name} does not depend on the seed"


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    TorchLMBackend(tiny_config()).ensure_initialized()
    assert torch.equal(state, torch.random.get_rng_state())


def test_config_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="divisible by n_heads"):
        TinyLMConfig(d_model=30, n_heads=4)


@pytest.mark.timeout(60)
def test_greedy_generate_matches_an_uncached_forward_and_is_batch_independent() -> None:
    config = tiny_config()
    backend = TorchLMBackend(config)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12], [5]]
    batched = backend.generate(prompts, max_new_tokens=8)
    for prompt, result in zip(prompts, batched, strict=True):
        assert result.ok and result.finish_reason is FinishReason.LENGTH
        (alone,) = backend.generate([prompt], max_new_tokens=8)
        assert alone.tokens == result.tokens
        context = [*prompt, *result.tokens]
        predicted = full_forward_argmax(config, 0, context)
        assert tuple(predicted[len(prompt) - 1 : -1]) == result.tokens
        assert result.token_weight_versions == (0,) * 8
        assert not result.straddled_sync


def test_sampling_is_reproducible_and_seeded() -> None:
    backend = TorchLMBackend(tiny_config())
    sampling = SamplingParams(temperature=1.0, top_k=10)
    first = backend.generate([[1, 2, 3]] * 3, max_new_tokens=12, sampling=sampling)
    again = backend.generate([[1, 2, 3]] * 3, max_new_tokens=12, sampling=sampling)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert len({r.tokens for r in first}) > 1, "each request draws its own stream"
    seeded = SamplingParams(temperature=1.0, seed=42)
    one = backend.generate([GenerationRequest((4, 5), 12, seeded)])[0]
    other = backend.generate([[9], GenerationRequest((4, 5), 12, seeded)])[1]
    assert one.tokens == other.tokens
    assert all(lp <= 0 for lp in one.logprobs)


def test_stop_token_ends_a_sequence_and_is_kept() -> None:
    backend = TorchLMBackend(tiny_config())
    (free,) = backend.generate([[1, 2, 3]], max_new_tokens=6)
    stop = free.tokens[2]
    (stopped,) = backend.generate([[1, 2, 3]], max_new_tokens=6, stop_token_ids=[stop])
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.tokens == free.tokens[: free.tokens.index(stop) + 1]


@pytest.mark.parametrize(
    ("request_kwargs", "match"),
    [
        ({"prompt": ()}, "prompt is empty"),
        ({"prompt": (1, 999)}, "outside the vocabulary"),
        ({"prompt": (1,), "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt": (1,) * 60, "max_new_tokens": 10}, "exceeds max_seq_len 64"),
        ({"prompt": (1,), "sampling": SamplingParams(temperature=-1.0)}, "temperature"),
    ],
)
def test_bad_requests_are_refused_before_anything_runs(
    request_kwargs: dict[str, Any], match: str
) -> None:
    backend = TorchLMBackend(tiny_config())
    with pytest.raises(ValueError, match=match):
        backend.generate([GenerationRequest(**request_kwargs)])
    assert backend.statistics().forwards == 0


def test_float_token_ids_are_an_error_not_truncated() -> None:
    with pytest.raises(TypeError):
        GenerationRequest((1.7,))  # type: ignore[arg-type]


def test_load_weights_validates_before_writing_anything() -> None:
    config = tiny_config()
    timeline = Timeline()
    backend = TorchLMBackend(config, timeline=timeline)
    before = {n: t.clone() for n, t in backend.served_weights().items()}
    bad = weights_of(config, 1)
    bad["lm_head.weight"] = bad["lm_head.weight"][:, :-1].clone()
    del bad["ln_f.bias"]
    with pytest.raises(WeightMismatchError) as info:
        backend.load_weights(bad)
    assert any("lm_head.weight: shape" in p for p in info.value.problems)
    assert any("ln_f.bias: missing" in p for p in info.value.problems)
    for name, tensor in backend.served_weights().items():
        assert torch.equal(tensor, before[name]), f"{name} was written by a rejected sync"
    assert backend.statistics().weight_writes == 0
    assert timeline.spans(SpanKind.WEIGHT_WRITE) == []


def test_load_weights_writes_in_place_and_generation_follows_the_new_weights() -> None:
    config = tiny_config()
    timeline = Timeline()
    backend = TorchLMBackend(config, timeline=timeline)
    pointers = {n: t.data_ptr() for n, t in backend.served_weights().items()}
    new = weights_of(config, 1)
    with backend.paused():
        backend.load_weights(new)
        backend.commit_weight_version(1)
    for name, tensor in backend.served_weights().items():
        assert tensor.data_ptr() == pointers[name], f"{name} was replaced, not written in place"
        assert torch.equal(tensor, new[name])
    (result,) = backend.generate([[3, 1, 4]], max_new_tokens=5)
    predicted = full_forward_argmax(config, 1, [3, 1, 4, *result.tokens])
    assert tuple(predicted[2:-1]) == result.tokens
    assert result.token_weight_versions == (1,) * 5
    (write,) = timeline.spans(SpanKind.WEIGHT_WRITE)
    assert write.args["tensors"] == len(new)


def test_a_write_that_fails_part_way_marks_the_weights_torn_until_a_complete_sync() -> None:
    config = tiny_config()
    backend = TorchLMBackend(config)

    weights = weights_of(config, 1)
    # Right names, shapes and dtypes (validation passes), but one tensor half-way through the
    # set cannot be read: the copy fails after earlier tensors were already written.
    name = "blocks.1.fc1.weight"
    weights[name] = torch.empty(weights[name].shape, dtype=config.dtype, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        backend.load_weights(weights)
    assert backend.weights_torn
    with pytest.raises(TornWeightsError, match="torn"):
        backend.generate([[1, 2]])
    backend.load_weights(weights_of(config, 2))
    backend.commit_weight_version(2)
    assert backend.generate([[1, 2]], max_new_tokens=2)[0].ok


@pytest.mark.timeout(30)
def test_the_torn_read_detector_fires_on_a_write_inside_a_forward() -> None:
    """An unguarded write lands between two blocks of one forward: the detector and the
    timeline both see it. (This is what every guarded test asserts the absence of.)"""
    config = tiny_config()
    timeline = Timeline()
    backend = TorchLMBackend(config, timeline=timeline)
    new = weights_of(config, 1)

    def write_between_blocks(index: int) -> None:
        if index == 1 and backend.statistics().weight_writes == 0:
            backend.load_weights(new)

    backend.layer_hook = write_between_blocks
    backend.generate([[1, 2, 3]], max_new_tokens=2)
    assert backend.torn_forwards == 1
    overlaps = timeline.overlaps()
    assert [(o.first.kind, o.second.kind) for o in overlaps] == [
        (SpanKind.FORWARD, SpanKind.WEIGHT_WRITE)
    ]


@pytest.mark.timeout(30)
def test_paused_parks_a_blocking_generate_running_on_another_thread() -> None:
    """Idle by construction only holds on the caller's thread; from another thread the gate
    still parks generate between two steps, and the pause times out clearly while a step is
    stuck."""
    config = tiny_config()
    backend = TorchLMBackend(config)
    in_step, release = threading.Event(), threading.Event()
    calls = {"n": 0}

    def hold_second_step(index: int) -> None:
        if index == 0:
            calls["n"] += 1
            if calls["n"] == 2:
                in_step.set()
                assert release.wait(10)

    backend.layer_hook = hold_second_step
    generating = Runner(lambda: backend.generate([[5, 6, 7]], max_new_tokens=6), "generate")
    assert in_step.wait(10)
    with (
        pytest.raises(PauseTimeout, match=r"did not park within 0\.2 s \(1 decode step still"),
        backend.paused(timeout=0.2),
    ):
        pass
    pausing = Runner(lambda: _pause_and_write(backend, config), "pause")
    wait_until(
        lambda: backend.generation_gate.statistics().exclusive_waiting == 1,
        10,
        "the pause to wait for the step",
    )
    release.set()
    pausing.join()
    (result,) = generating.join()
    assert result.ok and len(result.tokens) == 6
    assert backend.torn_forwards == 0
    assert result.token_weight_versions[:2] == (0, 0) and result.token_weight_versions[-1] == 1
    assert result.recomputes == 1 and result.straddled_sync


def _pause_and_write(backend: TorchLMBackend, config: TinyLMConfig) -> None:
    with backend.paused(timeout=10):
        backend.load_weights(weights_of(config, 1))
        backend.commit_weight_version(1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_on_cuda_the_same_engine_matches_the_cpu_one() -> None:
    cpu, gpu = TorchLMBackend(tiny_config()), TorchLMBackend(tiny_config(device="cuda"))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert [r.tokens for r in gpu.generate(prompts, max_new_tokens=6)] == [
        r.tokens for r in cpu.generate(prompts, max_new_tokens=6)
    ]
    new = weights_of(tiny_config(), 1)  # CPU tensors, written into CUDA served weights
    for backend in (cpu, gpu):
        with backend.paused():
            backend.load_weights(new)
            backend.commit_weight_version(1)
    sampling = SamplingParams(temperature=0.0)
    assert (
        gpu.generate(prompts, sampling=sampling)[1].tokens
        == cpu.generate(prompts, sampling=sampling)[1].tokens
    )
