"""LoRA adapters on the embedded LM, served per request: an adapter refreshed mid-request through
a RolloutWorker gives exact tokens (the old version's up to the install, the new version's
after), requests on the base model or on other adapters are untouched and keep decoding during
the wire, a bad set is refused whole, and the same refresh without the guard tears a read."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import wait_until
from test_staged import WireTransfer as AdapterWire  # an in-process wire
from torch_lm_helpers import (  # noqa: F401 - one_torch_thread is an autouse fixture
    ForwardCounter,
    Runner,
    greedy_continuation,
    greedy_lora_continuation,
    one_torch_thread,
    tiny_config,
    weights_of,
)

from rollout_sync import SyncMode
from rollout_sync.backends.torch_lm import (
    TorchLMBackend,
    TorchLMStreamBackend,
    tiny_lm_lora_shapes,
)
from rollout_sync.backends.torch_lm.tensor_parallel import TensorParallel
from rollout_sync.errors import (
    StagedCommitAborted,
    TornWeightsError,
    WeightMismatchError,
)
from rollout_sync.lora import ALPHA_KEY, LoRAConfig, SupportsLoRA, random_adapter
from rollout_sync.scheduler import GenerationRequest
from rollout_sync.trace import SpanKind, Timeline
from rollout_sync.worker import P2R, RolloutWorker

CONFIG = tiny_config()
SHAPES = tiny_lm_lora_shapes(CONFIG)
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=tuple(SHAPES), dtype=torch.float64)
ATTN_ONLY = LoRAConfig(
    rank=2, alpha=4.0, target_modules=("blocks.0.qkv", "blocks.1.qkv"), dtype=torch.float64
)


def adapter_of(version: int, config: LoRAConfig = LORA) -> dict[str, torch.Tensor]:
    """The set a trainer sends as ``version`` of an adapter of ``config`` (large enough a
    scale that every version changes the greedy tokens)."""
    return random_adapter(config, SHAPES, seed=100 + version, scale=0.2)


def _sync(worker: RolloutWorker, wire: AdapterWire, adapter: str | None = None) -> Any:
    worker.p2r = wire
    result = worker.handle(P2R(step=wire.version, adapter=adapter))
    if not result.ok:
        raise result.exception  # type: ignore[misc]
    return result


def _served(backend: TorchLMBackend, name: str) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.served_adapter(name).items()}


# -- the slot and the request ------------------------------------------------------------------


def test_an_adapter_slot_is_zeros_at_version_0_and_changes_only_its_requests() -> None:
    backend = TorchLMBackend(CONFIG)
    assert isinstance(backend, SupportsLoRA)
    backend.add_adapter("a", LORA)  # before the engine is built
    assert not backend.is_initialized and backend.adapter_names() == ["a"]
    assert backend.adapter_config("a") is LORA and backend.adapter_version("a") == 0
    served = backend.served_adapter("a")
    assert list(served)[-1] == ALPHA_KEY and served[ALPHA_KEY].shape == ()
    assert served["blocks.0.qkv.lora_A"].shape == (4, 32)
    assert served["blocks.1.fc2.lora_B"].shape == (32, 4)
    assert all(not t.any() for t in served.values())
    prompt = [1, 2, 3]
    base = greedy_continuation(CONFIG, weights_of(CONFIG, 0), prompt, 12)
    (zero,) = backend.generate([prompt], max_new_tokens=12, adapter="a")
    assert zero.tokens == base and zero.token_adapter_versions == (0,) * 12

    backend.load_adapter("a", adapter_of(1))
    backend.commit_adapter_version("a", 1)
    backend.add_adapter("b", ATTN_ONLY)
    backend.load_adapter("b", adapter_of(1, ATTN_ONLY))
    backend.commit_adapter_version("b", 7)
    on_a, on_base, on_b = backend.generate(
        [
            GenerationRequest(tuple(prompt), 12, adapter="a"),
            GenerationRequest(tuple(prompt), 12),
            GenerationRequest(tuple(prompt), 12, adapter="b"),
        ]
    )
    assert on_base.tokens == base and on_base.adapter is None
    assert on_base.token_adapter_versions == ()
    lora_a = greedy_lora_continuation(
        CONFIG, weights_of(CONFIG, 0), LORA, adapter_of(1), prompt, 12
    )
    assert on_a.tokens == lora_a != base
    assert on_a.adapter == "a" and on_a.token_adapter_versions == (1,) * 12
    lora_b = greedy_lora_continuation(
        CONFIG, weights_of(CONFIG, 0), ATTN_ONLY, adapter_of(1, ATTN_ONLY), prompt, 12
    )
    assert on_b.tokens == lora_b and on_b.token_adapter_versions == (7,) * 12
    assert backend.statistics().adapter_writes == 2 and backend.torn_forwards == 0


def test_requests_and_adapters_that_cannot_be_served_are_refused() -> None:
    backend = TorchLMStreamBackend(CONFIG)
    with pytest.raises(ValueError, match=r"adapter 'nope' is not served.*add_adapter"):
        backend.put([1, 2], adapter="nope")
    with pytest.raises(ValueError, match="not linear layers of the model"):
        backend.add_adapter("x", LoRAConfig(rank=2, alpha=1.0, target_modules=("blocks.0.ln1",)))
    backend.add_adapter("a", LORA)
    with pytest.raises(ValueError, match="served already"):
        backend.add_adapter("a", LORA)
    with pytest.raises(KeyError, match="add it first"):
        backend.served_adapter("nope")
    tp = TorchLMBackend(tiny_config(), tp=TensorParallel(None, rank=0, size=2))
    with pytest.raises(ValueError, match=r"tensor parallelism.*tp=2"):
        tp.add_adapter("a", LORA)
    assert backend.adapter_names() == ["a"] and tp.adapter_names() == []


def test_a_wrong_set_is_refused_whole_and_nothing_is_written() -> None:
    backend = TorchLMBackend(CONFIG)
    backend.add_adapter("a", LORA)
    backend.load_adapter("a", adapter_of(1))
    backend.commit_adapter_version("a", 1)
    before = _served(backend, "a")
    wrong_rank = random_adapter(
        LoRAConfig(rank=2, alpha=8.0, target_modules=LORA.target_modules, dtype=torch.float64),
        SHAPES,
        seed=3,
    )
    missing = adapter_of(2)
    del missing["blocks.1.fc1.lora_A"], missing["blocks.1.fc1.lora_B"]
    for bad, why in ((wrong_rank, r"lora_A: shape \[2, 32\]"), (missing, "blocks.1.fc1.lora_A")):
        with pytest.raises(WeightMismatchError, match=why):
            backend.load_adapter("a", bad)
    assert all(torch.equal(backend.served_adapter("a")[n], t) for n, t in before.items())
    assert backend.adapter_version("a") == 1 and backend.statistics().adapter_writes == 1

    # Through the worker (staged: the wire checks the set against the staging copy).
    worker = RolloutWorker(backend, mode=SyncMode.SYNC, weight_sync_timeout=20)
    try:
        for bad in (wrong_rank, missing):
            with pytest.raises(StagedCommitAborted, match=r"adapter 'a'.*keeps serving version 1"):
                _sync(worker, AdapterWire(2, bad), adapter="a")
        assert all(torch.equal(backend.served_adapter("a")[n], t) for n, t in before.items())
        assert backend.adapter_version("a") == 1 and not backend.weights_torn
        _sync(worker, AdapterWire(3, adapter_of(3)), adapter="a")
        assert backend.adapter_version("a") == 3
        assert torch.equal(
            backend.served_adapter("a")["blocks.0.fc2.lora_B"], adapter_of(3)["blocks.0.fc2.lora_B"]
        )
    finally:
        worker.close(20)


def test_a_load_that_fails_part_way_tears_the_adapter_until_a_complete_version() -> None:
    backend = TorchLMBackend(CONFIG)
    backend.add_adapter("a", LORA)
    broken = adapter_of(1)
    name = "blocks.1.fc1.lora_A"
    broken[name] = torch.empty(broken[name].shape, dtype=torch.float64, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        backend.load_adapter("a", broken)
    # The adapter is torn; the model's weights serve on.
    assert not backend.weights_torn
    with pytest.raises(ValueError, match="adapter 'a' is torn"):
        backend.validate_request(GenerationRequest((1,), 2, adapter="a"))
    with pytest.raises(TornWeightsError, match="adapter 'a'"):
        backend.check_adapter_servable("a")
    assert backend.generate([[1, 2]], max_new_tokens=2)[0].ok
    backend.load_adapter("a", adapter_of(2))
    backend.commit_adapter_version("a", 2)
    backend.check_adapter_servable("a")
    assert backend.generate([[1, 2]], max_new_tokens=2, adapter="a")[0].ok


# -- a refresh mid-request, through the worker -------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [SyncMode.STAGED, SyncMode.SYNC])
def test_an_adapter_refresh_mid_request_gives_exact_tokens(mode: SyncMode) -> None:
    """Both modes stage an adapter: the stream LM keeps decoding during its wire and parks only
    for the install. The request on the adapter has version 1's greedy tokens up to the install
    and version 2's continuation after; the requests on the base model and on another adapter
    are exactly their own greedy tokens, their caches kept."""
    backend = TorchLMStreamBackend(CONFIG, timeline=Timeline())
    backend.add_adapter("a", LORA)
    backend.add_adapter("b", ATTN_ONLY)
    worker = RolloutWorker(backend, mode=mode, weight_sync_timeout=20)
    base = weights_of(CONFIG, 1)
    n = 56
    prompts = {"a": (1, 2, 3), None: (4, 5, 6, 7), "b": (8,)}
    try:
        _sync(worker, AdapterWire(1, base))  # starts the engine
        _sync(worker, AdapterWire(1, adapter_of(1)), adapter="a")
        _sync(worker, AdapterWire(1, adapter_of(1, ATTN_ONLY)), adapter="b")
        forwards = ForwardCounter(backend)
        ids = {backend.put(p, max_new_tokens=n, adapter=a): a for a, p in prompts.items()}
        assert forwards.wait_for(3, 20), "decoding did not start"
        during: list[int] = []

        def midway() -> None:
            start = forwards.count
            forwards.wait_for(start + 3, 2.0)  # runs out (on purpose) only if generation parked
            during.append(forwards.count - start)

        wire = AdapterWire(2, adapter_of(2))
        wire.midway = midway
        _sync(worker, wire, adapter="a")
        results = {ids[r.request_id]: r for r in (backend.scheduler.get(30) for _ in ids)}
    finally:
        worker.close(20)
    assert during[0] >= 3, "generation went on while the adapter's wire was busy"
    assert wire.targets[0] is worker.adapter_staging("a").tensors  # type: ignore[union-attr]
    assert backend.adapter_version("a") == 2 and backend.weight_version == 1

    on_a = results["a"]
    assert on_a.ok and len(on_a.tokens) == n
    n_old = on_a.token_adapter_versions.count(1)
    assert on_a.token_adapter_versions == (1,) * n_old + (2,) * (n - n_old)
    assert 3 <= n_old < n and on_a.straddled_sync and on_a.recomputes == 1
    assert on_a.token_weight_versions == (1,) * n
    old = greedy_lora_continuation(CONFIG, base, LORA, adapter_of(1), prompts["a"], n_old)
    context = [*prompts["a"], *on_a.tokens[:n_old]]
    new = greedy_lora_continuation(CONFIG, base, LORA, adapter_of(2), context, n - n_old)
    assert on_a.tokens[:n_old] == old and on_a.tokens[n_old:] == new
    stayed = greedy_lora_continuation(CONFIG, base, LORA, adapter_of(1), context, n - n_old)
    assert new != stayed, "the refresh changed the tokens: the test can tell the versions apart"

    on_base = results[None]
    assert on_base.tokens == greedy_continuation(CONFIG, base, prompts[None], n)
    assert not on_base.straddled_sync and on_base.recomputes == 0
    on_b = results["b"]
    assert on_b.tokens == greedy_lora_continuation(
        CONFIG, base, ATTN_ONLY, adapter_of(1, ATTN_ONLY), prompts["b"], n
    )
    assert not on_b.straddled_sync and on_b.recomputes == 0
    assert on_b.token_adapter_versions == (1,) * n
    assert backend.torn_forwards == 0
    assert backend.timeline is not None and backend.timeline.overlaps() == []


# -- the hazard ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_an_adapter_install_inside_a_forward_tears_it_unless_guarded(guarded: bool) -> None:
    """A forward on the adapter is held between its two blocks while the adapter's install
    runs. Guarded, the install waits for that forward to end (the pause), and the tokens are
    exact; unguarded, it lands inside the forward: a torn read, seen by the slot's seqlock and
    by the timeline."""
    timeline = Timeline()
    backend = TorchLMStreamBackend(CONFIG, timeline=timeline)
    backend.add_adapter("a", LORA)
    worker = RolloutWorker(backend, mode=SyncMode.STAGED, weight_sync_timeout=20, guarded=guarded)
    base = weights_of(CONFIG, 1)
    prompt, n = (1, 2, 3), 24
    armed, in_forward, written = threading.Event(), threading.Event(), threading.Event()

    def hold_between_blocks(index: int) -> None:
        if index == 1 and armed.is_set():
            armed.clear()
            in_forward.set()
            assert written.wait(20)

    try:
        _sync(worker, AdapterWire(1, base))
        _sync(worker, AdapterWire(1, adapter_of(1)), adapter="a")
        forwards = ForwardCounter(backend, inner=hold_between_blocks)
        rid = backend.put(prompt, max_new_tokens=n, adapter="a")
        assert forwards.wait_for(3, 20), "decoding did not start"
        armed.set()
        assert in_forward.wait(20)
        install = Runner(lambda: _sync(worker, AdapterWire(2, adapter_of(2)), adapter="a"))
        if guarded:
            wait_until(
                lambda: backend.generation_gate.statistics().exclusive_waiting == 1,
                20,
                "the install's pause to wait for the forward",
            )
            assert not install.done.is_set()
        else:
            install.join(20)  # it did not wait for the held forward
        written.set()
        install.join(20)
        result = backend.scheduler.get(30)
    finally:
        written.set()
        worker.close(20)
    assert result.request_id == rid and result.ok and backend.adapter_version("a") == 2
    forward_writes = [o for o in timeline.overlaps() if o.first.kind == SpanKind.FORWARD]
    if not guarded:
        assert backend.torn_forwards == 1, "the write inside the forward was not seen"
        assert forward_writes
        return
    assert backend.torn_forwards == 0 and forward_writes == []
    n_old = result.token_adapter_versions.count(1)
    assert result.token_adapter_versions == (1,) * n_old + (2,) * (n - n_old)
    old = greedy_lora_continuation(CONFIG, base, LORA, adapter_of(1), prompt, n_old)
    context = [*prompt, *result.tokens[:n_old]]
    new = greedy_lora_continuation(CONFIG, base, LORA, adapter_of(2), context, n - n_old)
    assert result.tokens == old + new
