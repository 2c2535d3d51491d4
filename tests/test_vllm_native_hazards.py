"""What vLLM's native weight update does wrong, shown on a real engine, and caught.

One engine runs ``rollout_sync.testing.vllm_engines.FlawedWeightTransferEngine``: the
production ``"rollout_sync"`` engine with one step done as vLLM's built-in engines may do it
(a reused receive buffer; a load outside the layerwise reload). The read-back after ``finish``
must catch each, on the same harness where the correct engine lands bit-exactly. Last, the
update without the guard: a forward between ``update_weights`` and ``finish_weight_update``
meets layers on the meta device and kills the engine (bounded, not a hang), while the same
steps through the guard keep a request in flight intact. That test kills the module's engine,
so it runs last.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import pytest
import torch
from vllm_helpers import (  # first: it sets the environment vLLM reads
    ForwardingClient,
    TrainerWeights,
    native_backend,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync.backends.vllm import VLLMAsyncBackend, greedy_params
from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
from rollout_sync.backends.vllm.engine import RolloutSyncUpdateInfo
from rollout_sync.backends.vllm.trainer import (
    MappingSource,
    RolloutSyncTrainerEngine,
    RolloutSyncTrainerInitInfo,
)
from rollout_sync.testing import (
    build_tiny_llama,
    greedy_reference,
)
from rollout_sync.testing.vllm_engines import FLAWED_ENGINE_NAME

pytestmark = pytest.mark.vllm

PROMPT = [1, 5, 9, 33, 7]
SMALL_BUCKETS = 16 << 10
"""Every 64 x 64 projection a bucket of its own: each layer spans many buckets."""


class _WithFlaw(ForwardingClient):
    """vLLM's client protocol, adding the test engine's ``flaw`` to the init info."""

    def __init__(self, inner: Any, flaw: str) -> None:
        super().__init__(inner)
        self.flaw = flaw

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine({**init_info, "flaw": self.flaw})

    def native_transfer_state(self) -> Any:
        return None  # the guard then takes every failure as torn


class Harness(TrainerWeights):
    def __init__(
        self, backend: VLLMAsyncBackend, model_dir: Any, initial: Mapping[str, torch.Tensor]
    ) -> None:
        super().__init__(initial, seed=900)
        self.backend = backend
        self.reference = greedy_reference(model_dir)
        self.version = 0

    def trainer(
        self, flaw: str, *, guarded: bool = True, timeout_s: float = 30.0, **fields: Any
    ) -> tuple[RolloutSyncTrainerEngine, Any]:
        inner = _WithFlaw(self.backend.weight_sync_client(), flaw)
        client: Any = GuardedWeightSyncClient(inner, rollout=self.backend) if guarded else inner
        info = RolloutSyncTrainerInitInfo.on_this_host(
            bucket_bytes=SMALL_BUCKETS, timeout_s=timeout_s, **fields
        )
        engine = RolloutSyncTrainerEngine.trainer_init(
            info, client=client, source=MappingSource(self.current)
        )
        return engine, client

    def push(self, engine: RolloutSyncTrainerEngine) -> int:
        self.version += 1
        return self.send(engine, self.version)

    def greedy_is(self, version: int, n: int = 16) -> bool:
        result = self.backend.generate([PROMPT], greedy_params(n), timeout=60)[0]
        return list(result.token_ids) == self.reference(self.weights_of(version), PROMPT, n)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_flawed")
    initial = build_tiny_llama(model_dir, seed=31)
    backend = native_backend(model_dir, FLAWED_ENGINE_NAME)
    try:
        yield Harness(backend, model_dir, initial)
    finally:
        try:
            backend.shutdown(timeout=30.0)
        except Exception:  # the last test kills the engine on purpose
            pass


def _torn_then_recovers(harness: Harness, failed: GuardedWeightSyncClient, where: str) -> None:
    """The failed update left the guard torn (failing in ``where``) and generation parked;
    an update through the production engine lands bit-exactly and resumes it."""
    assert failed.torn is not None and where in failed.torn
    assert harness.backend.parked and harness.backend.weights_torn
    engine, client = harness.trainer("")
    try:
        version = harness.push(engine)
        assert client.torn is None and not harness.backend.parked
        assert harness.greedy_is(version)
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
def test_a_reused_receive_buffer_corrupts_silently_and_the_read_back_catches_it(
    harness: Harness,
) -> None:
    engine, client = harness.trainer("reuse_buffer")
    try:
        with pytest.raises(Exception, match="still computes with other weights"):
            harness.push(engine)
    finally:
        engine.shutdown()
    # The flawed load "succeeded" in vLLM's eyes; only the read-back saw the wrong weights.
    # Then, same bucket size, the production engine (a buffer per bucket): bit-exact.
    _torn_then_recovers(harness, client, "update_weights")


@pytest.mark.timeout(240)
def test_a_load_outside_the_layerwise_reload_is_refused_or_caught(harness: Harness) -> None:
    engine, client = harness.trainer("no_reload")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the engine's own error, from an RPC
            harness.push(engine)
    finally:
        engine.shutdown()
    _torn_then_recovers(harness, client, "update_weights")


@pytest.mark.timeout(240)
def test_an_unexpected_error_reading_back_a_delta_leaves_it_torn_and_the_host_copy_unclaimed(
    harness: Harness,
) -> None:
    """A delta was written into the host copy and loaded, then the read-back fails with an
    error of a type nobody raises on purpose: the engine is torn naming it, and the host copy
    claims no version (the next sync goes whole)."""
    engine, client = harness.trainer("delta_read_back_error", delta=True)
    try:
        version = harness.push(engine)  # the first: whole, read back as ever
        step = {n: t.clone() for n, t in harness.weights_of(version).items()}
        for tensor in step.values():
            tensor.view(-1)[:4] += 1.0  # a training step's change: sent by delta
        harness.version += 1
        with pytest.raises(Exception, match="a read-back bug"):
            harness.send(engine, harness.version, step)
        state = harness.backend.native_transfer_state()
        assert state is not None and state["last_sync_kind"] == "delta"
        assert state["torn"] is not None and "RuntimeError" in state["torn"]
        assert state["host_copy_version"] is None
    finally:
        engine.shutdown()
    _torn_then_recovers(harness, client, "update_weights")


@pytest.mark.timeout(240)
def test_a_trainer_whose_group_was_replaced_is_refused_at_once_and_told_why(
    harness: Harness,
) -> None:
    """An engine serves one trainer: a second ``init_weight_transfer_engine`` replaces the
    group. The first trainer's next update is refused by the engine at once (its send still
    waits out its own timeout: the engine left that group), naming why."""
    first, _ = harness.trainer("", guarded=False, timeout_s=5.0)
    second, _ = harness.trainer("", guarded=False)
    try:
        with pytest.raises(Exception) as caught:  # noqa: B017 - the send's own error type
            harness.push(first)
        assert "replaced the group" in str(caught.value.__cause__)
        version = harness.push(second)
        assert harness.greedy_is(version)
    finally:
        first.shutdown()
        second.shutdown()


def _open_update(harness: Harness, engine: RolloutSyncTrainerEngine, client: Any) -> None:
    """``start_weight_update`` and one whole ``update_weights`` chunk, not finished: the
    window in which vLLM's layers are on the meta device."""
    harness.version += 1
    weights = harness.weights_of(harness.version)
    client.start_weight_update()
    update = asdict(RolloutSyncUpdateInfo())
    failure: list[BaseException] = []

    def receive() -> None:
        try:
            client.update_weights(update)
        except BaseException as exc:  # reported by the assertion below
            failure.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    assert engine.transfer is not None
    engine.transfer.send(weights, version=harness.version)
    thread.join(60)
    assert not thread.is_alive() and not failure


@pytest.mark.timeout(240)
def test_a_read_back_failing_in_finish_leaves_vllm_ready_for_the_next_update(
    harness: Harness,
) -> None:
    """Chunks not marked final are read back in ``finish_weight_update``; vLLM's worker keeps
    an update whose finish raised open. The guard closes it, so the next update can start."""
    engine, client = harness.trainer("reuse_buffer")
    try:
        _open_update(harness, engine, client)  # one chunk, final=False: loaded, not verified
        with pytest.raises(Exception, match="still computes with other weights"):
            client.finish_weight_update(str(harness.version))
    finally:
        engine.shutdown()
    _torn_then_recovers(harness, client, "finish_weight_update")


@pytest.mark.timeout(300)
def test_without_the_guard_a_forward_mid_update_kills_the_engine_with_it_none_does(
    harness: Harness,
) -> None:
    # Guarded: a request in flight across start .. update .. finish continues intact.
    engine, client = harness.trainer("")
    try:
        request = harness.backend.submit(PROMPT, greedy_params(1500))
        request.wait_for_tokens(8, timeout=60)
        _open_update(harness, engine, client)
        assert harness.backend.parked  # nothing steps while the layers are on meta
        client.finish_weight_update(str(harness.version))
        result = request.result(timeout=120)
        assert result.ok and len(result.token_ids) == 1500
    finally:
        engine.shutdown()
    assert harness.greedy_is(harness.version)

    # The same steps through vLLM's plain client: the engine keeps stepping the request in
    # flight, onto layers on the meta device. The failure is bounded: the request ends with
    # an error, and the engine refuses what follows.
    engine, plain = harness.trainer("", guarded=False)
    request = harness.backend.submit(PROMPT, greedy_params(1500))
    request.wait_for_tokens(8, timeout=60)
    _open_update(harness, engine, plain)
    result = request.result(timeout=120)
    assert not result.ok, "a forward on meta-device layers should have failed"
    with pytest.raises(Exception):  # noqa: B017 - vLLM's EngineDeadError or an RPC error
        plain.finish_weight_update(str(harness.version))
