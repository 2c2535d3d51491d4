"""VLLMBlockingBackend (vllm.LLM, in-process) on vLLM for CPU, tiny random Llama, float32.

One engine for the module. ``paused()`` is the base no-op here; the step-hook case (a sync run
between two engine steps inside a ``generate`` call) is made safe by the write itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from vllm_helpers import (  # first: it sets the environment vLLM reads at import
    NO_FORWARD_DURING,
    World,
    check_greedy_output_equals_transformers,
    running_world,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync import SpanKind
from rollout_sync.backends.vllm import KVCachePolicy, VLLMBlockingBackend, greedy_params
from rollout_sync.backends.vllm.client import GuardedWeightSyncClient, LLMWeightSyncClient
from rollout_sync.testing.tiny_llama import tiny_llama
from rollout_sync.trace import find_overlaps

pytestmark = pytest.mark.vllm

SYNC_STEP = 20


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World[VLLMBlockingBackend]]:
    # The first sync starts the engine lazily, inside the bracket.
    with running_world(
        VLLMBlockingBackend,
        tmp_path_factory.mktemp("tiny_llama_blocking"),
        model_seed=3,
        weights_seed=2000,
        # Sampled tokens' log-probabilities after temperature (the greedy tests ask for none).
        logprobs_mode="processed_logprobs",
    ) as w:
        yield w


def _sync_at_step(world: World, step: int, action: Callable[[], None]) -> Callable[[], None]:
    """A step hook that runs ``action`` once, after engine step ``step``."""
    count = 0

    def hook() -> None:
        nonlocal count
        count += 1
        if count == step:
            action()

    return hook


@pytest.mark.timeout(120)
def test_greedy_output_equals_transformers(world: World) -> None:
    check_greedy_output_equals_transformers(world)


@pytest.mark.timeout(120)
def test_sampled_tokens_carry_their_log_probabilities_after_temperature(world: World) -> None:
    """``processed_logprobs``: each sampled token's log-probability is ``log_softmax(logits /
    T)`` of a transformers forward of the same weights; at ``T != 1`` the raw ones differ."""
    from vllm import SamplingParams

    version = world.sync()
    reference = tiny_llama()
    reference.load_state_dict(dict(world.weights_of(version)))
    temperature, prompts = 1.7, [[1, 5, 9, 33, 7], [3, 4, 5]]
    params = SamplingParams(
        temperature=temperature, max_tokens=12, logprobs=0, seed=7, ignore_eos=True
    )
    results = world.backend.generate(prompts, params, timeout=60)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.ok and len(result.token_logprobs) == len(result.token_ids) == 12
        with torch.no_grad():
            ids = torch.tensor([prompt + list(result.token_ids)])
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        sampled = torch.tensor(result.token_ids).unsqueeze(1)
        processed = torch.log_softmax(logits / temperature, -1).gather(1, sampled).squeeze(1)
        raw = torch.log_softmax(logits, -1).gather(1, sampled).squeeze(1)
        got = torch.tensor(result.token_logprobs)
        assert torch.allclose(got, processed, atol=1e-3), (got, processed)
        assert (got - raw).abs().max() > 0.05
    # A request that asks for none gets none.
    assert world.backend.generate([[3, 4, 5]], greedy_params(4))[0].token_logprobs == ()


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
    # One token per step (the first from the prefill): the sync came after token SYNC_STEP.
    assert world.sync_split(prompt, tokens, old_v, new_v, at_least=SYNC_STEP) == SYNC_STEP


@pytest.mark.timeout(180)
def test_keeping_stale_kv_in_a_step_hook_mixes_versions(world: World) -> None:
    """What the step-hook write's KV handling prevents: without it the tokens are a mix."""
    world.backend.kv_cache_policy = KVCachePolicy.KEEP_STALE
    try:
        prompt, tokens, old_v, new_v = _generate_through_a_step_hook_sync(world)
    finally:
        world.backend.kv_cache_policy = KVCachePolicy.RECOMPUTE
    assert world.sync_split(prompt, tokens, old_v, new_v, at_least=SYNC_STEP) is None


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
    result = world.backend.generate(
        [prompt], greedy_params(30), step_hook=_sync_at_step(world, 5, write_from_elsewhere)
    )[0]
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "step_hook" in str(errors[0])
    assert not world.backend.weights_torn
    assert list(result.token_ids) == world.reference(world.weights_of(version), prompt, 30)
    assert not result.straddled


@pytest.mark.timeout(120)
def test_no_forward_overlaps_a_write_in_the_step_hook_case(world: World) -> None:
    hooks = [_sync_at_step(world, n, world.sync) for n in (5, 10, 15)]
    with world.spans_recorded() as spans:
        world.backend.generate(
            [[2, 3, 4]], greedy_params(40), step_hook=lambda: [h() for h in hooks]
        )
    assert len([s for s in spans if s.kind == SpanKind.WEIGHT_WRITE]) == 3
    assert len([s for s in spans if s.kind == SpanKind.FORWARD]) >= 40
    assert find_overlaps(spans, NO_FORWARD_DURING) == []


class _NothingToPause:
    """``vllm.LLM`` generates on its caller's thread: between two ``generate`` calls there is
    nothing to pause."""

    def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        pass

    def resume_generation(self) -> None:
        pass


@pytest.mark.timeout(60)
def test_the_llm_client_reports_the_engine_state_a_guard_over_it_reads(world: World) -> None:
    """``LLMWeightSyncClient`` reads the ``"rollout_sync"`` engine's state, so a guard over it
    (no ``rollout=``) tells an update the engine refused before loading anything from a torn
    one (docs/vllm.md); the AsyncLLM client's end to end is in tests/test_vllm_native.py."""
    client = LLMWeightSyncClient(world.backend.llm, timeout_s=30)
    state = client.native_transfer_state()
    assert state is not None and state["torn"] is None and state["updates"] >= 1
    assert state == world.backend.native_transfer_state()
    guard = GuardedWeightSyncClient(client, pauser=_NothingToPause())
    assert guard.engine_state == client.native_transfer_state
