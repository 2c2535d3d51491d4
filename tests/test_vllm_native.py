"""vLLM's native weight-transfer API with the ``"rollout_sync"`` engines, guarded (vLLM for CPU).

One engine for the module (``AsyncLLM`` behind a ``VLLMAsyncBackend``, a tiny random Llama in
float32), updated by the trainer engine through vLLM's own factory and a
``GuardedWeightSyncClient``. Greedy float32 decoding makes every claim exact: tokens are
compared with a plain transformers forward of the same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from vllm_helpers import (  # first: it sets the environment vLLM reads
    NO_FORWARD_DURING,
    ForwardingClient,
    TrainerWeights,
    corrupted_in_transit,
    native_backend,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from rollout_sync import SpanKind, Timeline, TornWeightsError
from rollout_sync.backends.vllm import VLLMAsyncBackend, greedy_params
from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
from rollout_sync.backends.vllm.trainer import (
    MappingSource,
    RolloutSyncTrainerEngine,
    RolloutSyncTrainerInitInfo,
)
from rollout_sync.errors import ChecksumMismatchError, ManifestRejected
from rollout_sync.testing import (
    build_tiny_llama,
    find_free_port,
    find_sync_split,
    greedy_reference,
    random_llama_weights,
)
from rollout_sync.trace import Span, find_overlaps
from rollout_sync.transfer.delta_sync import DeltaEncoder, EncodedDelta, WholeReason

pytestmark = pytest.mark.vllm

PROMPT = [1, 5, 9, 33, 7]


class Native(TrainerWeights):
    """The module's engine, the guarded client, the trainer engine and its weights."""

    engine: RolloutSyncTrainerEngine
    """Set by the fixture: built by vLLM's factory over a source that reads ``current``."""

    def __init__(
        self,
        backend: VLLMAsyncBackend,
        client: GuardedWeightSyncClient,
        timeline: Timeline,
        model_dir: Any,
        initial: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__(initial, seed=500)
        self.backend, self.client, self.timeline = backend, client, timeline
        self.reference = greedy_reference(model_dir)

    def push(self, weights: Mapping[str, torch.Tensor] | None = None) -> int:
        """Push the next version (its random weights, or ``weights``) natively; returns it."""
        return self.send(self.engine, self.engine.version + 1, weights)

    def greedy(self, version: int, prompt: list[int], n: int) -> list[int]:
        return self.reference(self.weights_of(version), prompt, n)

    def spans_since(self, start_ns: int) -> list[Span]:
        self.backend.collect_engine_spans()
        return [s for s in self.timeline.spans() if s.start_ns >= start_ns]


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Native]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_native")
    initial = build_tiny_llama(model_dir, seed=21)
    timeline = Timeline()
    backend = native_backend(model_dir, "rollout_sync", timeline=timeline)
    client = GuardedWeightSyncClient(
        backend.weight_sync_client(), rollout=backend, timeline=timeline
    )
    # 64 KiB buckets: layers span several buckets, as they do in a real model.
    info = RolloutSyncTrainerInitInfo.on_this_host(bucket_bytes=64 << 10, timeout_s=30.0)
    world = Native(backend, client, timeline, model_dir, initial)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=MappingSource(world.current)
    )
    assert isinstance(engine, RolloutSyncTrainerEngine)
    world.engine = engine
    try:
        world.push()
        yield world
    finally:
        engine.shutdown()
        backend.shutdown()


def _served_version(world: Native) -> str:
    version: str = world.backend.run_on_loop(
        world.backend.engine.get_weight_version(), 30, "get_weight_version"
    )
    return version


@pytest.mark.timeout(240)
def test_a_guarded_native_update_mid_generation_splits_old_then_exactly_new(
    native: Native,
) -> None:
    old = native.engine.version
    start_ns = time.monotonic_ns()
    request = native.backend.submit(PROMPT, greedy_params(300))
    request.wait_for_tokens(12, timeout=60)
    new = native.push()
    result = request.result(timeout=120)
    assert result.ok and len(result.token_ids) == 300
    tokens = list(result.token_ids)
    split = find_sync_split(
        tokens,
        native.greedy(old, PROMPT, len(tokens)),
        lambda k: native.greedy(new, PROMPT + tokens[:k], len(tokens) - k),
        at_least=12,
    )
    # Old weights' tokens up to the pause, then exactly the new weights' continuation.
    assert split is not None and 12 <= split < len(tokens), "the update did not split the request"
    # vLLM's own per-token labels agree, and so does the served version.
    assert result.weight_versions == ((str(old), 0, split), (str(new), split, len(tokens)))
    assert (result.admitted_version, result.completed_version) == (old, new)
    assert _served_version(native) == str(new)
    # No forward ran while the update was open (start .. finish).
    spans = native.spans_since(start_ns)
    assert [s for s in spans if s.kind == SpanKind.SYNC]
    assert len([s for s in spans if s.kind == SpanKind.FORWARD]) > 50
    assert find_overlaps(spans, NO_FORWARD_DURING) == []
    report = native.client.reports[-1]
    assert report.error is None and report.paused and report.park_s < 30


@pytest.mark.timeout(180)
def test_a_wrong_manifest_is_refused_and_the_model_keeps_serving_the_old_weights(
    native: Native,
) -> None:
    served = native.engine.version
    bad = dict(native.weights_of(served + 1))
    name = "model.layers.0.mlp.down_proj.weight"
    bad[name] = bad[name][:, :-1].contiguous()  # a wrong shape
    with pytest.raises(ManifestRejected) as caught:
        native.push(bad)
    assert caught.value.rejected_by == (1,)
    assert "does not match served" in str(caught.value.__cause__)  # the worker's reason
    # Nothing was loaded: the reload never started; the engine says so, so the guard resumed
    # generation on the version it served, which it still generates exactly.
    assert native.backend.native_transfer_state()["torn"] is None
    assert native.client.torn is None and native.client.reports[-1].error
    assert not native.backend.weights_torn and not native.backend.parked
    result = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(result.token_ids) == native.greedy(served, PROMPT, 16)
    assert _served_version(native) == str(served)
    # A complete update lands after it, exactly.
    version = native.push()
    assert not native.backend.weights_torn and not native.backend.parked
    result = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(result.token_ids) == native.greedy(version, PROMPT, 16)


@pytest.mark.timeout(180)
def test_part_of_a_fused_module_is_refused_before_anything_is_loaded(native: Native) -> None:
    served = native.engine.version
    partial = {
        "model.layers.0.self_attn.q_proj.weight": native.weights_of(served + 1)[
            "model.layers.0.self_attn.q_proj.weight"
        ]
    }
    native.engine.init_info.require_all = False
    try:
        with pytest.raises(ManifestRejected):
            native.push(partial)
    finally:
        native.engine.init_info.require_all = True
    assert native.backend.native_transfer_state()["torn"] is None
    assert not native.backend.parked  # refused before anything was loaded: still serving
    result = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(result.token_ids) == native.greedy(served, PROMPT, 16)
    version = native.push()
    result = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(result.token_ids) == native.greedy(version, PROMPT, 16)


@pytest.mark.timeout(240)
def test_a_bucket_failing_mid_update_leaves_the_replica_parked_and_torn_then_recovers(
    native: Native,
) -> None:
    transfer = native.engine.transfer
    assert transfer is not None
    with corrupted_in_transit(transfer, bucket=3), pytest.raises(ChecksumMismatchError):
        native.push()
    # Parked and torn: the engine's layers were on the meta device when it failed.
    state = native.backend.native_transfer_state()
    assert state["torn"] and "mid-load" in state["torn"]
    assert native.backend.parked and native.backend.weights_torn and native.client.torn
    with pytest.raises(TornWeightsError):
        native.backend.submit(PROMPT, greedy_params(4))
    # The next complete update recovers bit-exactly.
    version = native.push()
    assert native.backend.native_transfer_state()["torn"] is None
    assert not native.backend.parked and native.client.torn is None
    result = native.backend.generate([PROMPT, [3, 4, 5]], greedy_params(20), timeout=60)
    assert list(result[0].token_ids) == native.greedy(version, PROMPT, 20)
    assert list(result[1].token_ids) == native.greedy(version, [3, 4, 5], 20)


@pytest.mark.timeout(120)
def test_each_push_is_timed_into_weight_sync_time_ms(native: Native) -> None:
    native.engine.metrics()  # drop what earlier tests left
    native.push()
    native.push()
    metrics = native.engine.metrics()
    assert metrics is not None and metrics["weight_sync_count"] == 2
    assert metrics["weight_sync_time_ms"] > 0
    assert metrics["weight_sync_version"] == native.engine.version
    assert metrics["weight_sync_bytes"] == 2 * sum(
        t.numel() * t.element_size() for t in native.current.values()
    )


@pytest.mark.timeout(240)
def test_payload_sends_are_held_for_each_update_and_released_after_a_failed_one(
    native: Native,
) -> None:
    """A payload packer sends all along (a thread feeding it); the guarded update holds its
    egress from start to finish: no send overlaps an update. The packer's hold is bound to the
    thread that took it, and a failed update fails on the trainer's side thread: egress must
    still be released (sends go on), with the weights torn."""
    from rollout_sync.testing import RecordingPacker

    timeline = native.timeline
    packer = RecordingPacker(capacity=4, send_s=0.002, timeline=timeline).start()
    guarded = GuardedWeightSyncClient(
        native.client.inner, rollout=native.backend, egress=[packer], timeline=timeline
    )
    native.engine.client = guarded
    stop = threading.Event()

    def produce() -> None:
        n = 0
        while not stop.is_set():
            packer.submit(n, timeout=60)
            n += 1

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    start_ns = time.monotonic_ns()
    transfer = native.engine.transfer
    assert transfer is not None
    try:
        packer.wait_sent(20, timeout=60)
        native.push()
        native.push()
        with corrupted_in_transit(transfer, bucket=2), pytest.raises(ChecksumMismatchError):
            native.push()
        assert guarded.torn and native.backend.parked
        sent = len(packer.sent)
        packer.wait_sent(sent + 20, timeout=60)  # egress released: sends go on while torn
        native.push()
        assert guarded.torn is None and not native.backend.parked
    finally:
        stop.set()
        producer.join(60)
        packer.stop(30)
        native.engine.client = native.client
    spans = [s for s in timeline.spans() if s.start_ns >= start_ns]
    assert len([s for s in spans if s.kind == SpanKind.PAYLOAD_SEND]) > 40
    assert len([s for s in spans if s.kind == SpanKind.SYNC]) == 3  # the failed one has none
    assert find_overlaps(spans, [(SpanKind.PAYLOAD_SEND, SpanKind.SYNC)]) == []
    assert [r.egress_held for r in guarded.reports] == [1, 1, 1, 1]
    assert [r.error is None for r in guarded.reports] == [True, True, False, True]


@pytest.mark.timeout(180)
def test_through_the_asyncllm_client_alone_a_refused_manifest_resumes_on_the_served_version(
    native: Native,
) -> None:
    """No ``rollout=``: the guard pauses through the ``AsyncLLMWeightSyncClient`` and reads the
    engine's state through it (docs/vllm.md). A manifest the engine refuses loads nothing, so
    generation resumes on the served version: a request in flight across the refused update
    ends exactly as one with no update does, every token labelled with the served version."""
    inner = native.backend.weight_sync_client()
    guard = GuardedWeightSyncClient(inner)
    assert guard.pauser is inner
    served = native.engine.version
    bad = dict(native.weights_of(served + 1))
    name = "model.layers.1.self_attn.o_proj.weight"
    bad[name] = bad[name].to(torch.float16)  # a wrong dtype: refused whole
    n = 200
    request = native.backend.submit(PROMPT, greedy_params(n))
    native.engine.client = guard
    try:
        request.wait_for_tokens(8, timeout=60)
        with pytest.raises(ManifestRejected):
            native.push(bad)
        assert len(request.tokens()) < n  # still in flight when the refused update ended
        assert guard.torn is None and not guard.parked, guard.torn
        result = request.result(timeout=120)
    finally:
        native.engine.client = native.client
        if guard.parked:  # the failure shown: the engine left paused, for nothing
            inner.resume_generation()
    assert native.backend.native_transfer_state()["torn"] is None
    assert guard.reports[-1].error is not None and guard.reports[-1].paused
    undisturbed = native.backend.generate([PROMPT], greedy_params(n), timeout=60)[0]
    assert result.ok and result.token_ids == undisturbed.token_ids
    assert list(result.token_ids[:16]) == native.greedy(served, PROMPT, 16)
    assert result.weight_versions == ((str(served), 0, n),)
    assert _served_version(native) == str(served)


class _FinishAfterTokens:
    """vLLM's plain client, unguarded, that lets a request in flight decode ``extra`` more
    tokens between the update landing (``update_weights``) and ``finish_weight_update`` (which
    sets vLLM's version label): the window every unguarded update has, made wide enough to
    see."""

    def __init__(self, inner: Any, request: Any, extra: int) -> None:
        self.inner, self.request, self.extra = inner, request, extra
        self.tokens_at_update = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        self.tokens_at_update = len(self.request.tokens())

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request.wait_for_tokens(self.tokens_at_update + self.extra, timeout=60)
        self.inner.finish_weight_update(weight_version)


@pytest.mark.timeout(240)
def test_unguarded_the_rollout_sync_engine_survives_a_mid_generation_update_silently_wrong(
    native: Native,
) -> None:
    """What docs/vllm.md says of the ``"rollout_sync"`` engine without the guard: the engine
    survives (the trainer engine's one chunk is final: loaded and finalized in one RPC, so no
    forward meets a layer on the meta device), and the damage is silent: tokens the new
    weights computed carry the old version's label until finish, and the sequence in flight
    continues from KV the old weights computed (no split "old, then exactly new" explains
    its tokens; the guarded update of the first test has one)."""
    old = native.engine.version
    n = 200
    request = native.backend.submit(PROMPT, greedy_params(n))
    request.wait_for_tokens(12, timeout=60)
    plain = _FinishAfterTokens(native.client.inner, request, extra=24)
    native.engine.client = plain
    try:
        new = native.push()
    finally:
        native.engine.client = native.client
    result = request.result(timeout=120)
    assert result.ok and len(result.token_ids) == n  # the engine survived
    assert native.backend.native_transfer_state()["torn"] is None
    assert result.weight_versions is not None
    (label, _, end), (next_label, _, _) = result.weight_versions
    assert (label, next_label) == (str(old), str(new))
    assert plain.tokens_at_update + plain.extra <= end
    tokens = list(result.token_ids)
    old_greedy = native.greedy(old, PROMPT, end)
    diverged = next(i for i in range(end) if tokens[i] != old_greedy[i])
    assert 12 <= diverged < end  # tokens of other weights, labelled with the old version
    # A split "old, then exactly new" would lie at or before the first token that leaves
    # the old weights' continuation; at none of them do the next 8 tokens follow the new
    # weights' own continuation: the old weights' KV under the new weights.
    for k in range(12, diverged + 1):
        assert tokens[k : k + 8] != native.greedy(new, PROMPT + tokens[:k], 8), k
    # The prefix cache still holds blocks the old weights computed: a guarded update (which
    # clears it, and commits the backend's version) before the tests that follow.
    version = native.push()
    result = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(result.token_ids) == native.greedy(version, PROMPT, 16)


# -- delta syncs: rebuilt from the worker's host copy, loaded as a whole update ----------------

UNCHANGED = {  # parts of fused modules no delta below changes: they come from the host copy
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
}


def _step(weights: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with 2 % of the elements of every tensor but ``UNCHANGED`` moved (a
    training step's change)."""
    generator = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in weights.items()}
    for name, tensor in out.items():
        if name in UNCHANGED:
            continue
        flat = tensor.view(-1)
        changed = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 50)]
        flat[changed] = flat[changed] * 1.01 + 1e-3
    return out


class _WrongDigest(DeltaEncoder):
    """The trainer's encoder, whose next delta claims a wrong new digest for one tensor (what
    a corrupted or hostile sender sends): the worker's proof must refuse it."""

    armed = True

    def encode(
        self, weights: Mapping[str, torch.Tensor], version: int
    ) -> EncodedDelta | WholeReason:
        out = super().encode(weights, version)
        if not isinstance(out, EncodedDelta) or not self.armed:
            return out
        self.armed = False
        entries = list(out.header.entries)
        a, b = entries[3].digest
        entries[3] = dataclasses.replace(entries[3], digest=(a, (b + 1) % 997))
        header = dataclasses.replace(out.header, entries=tuple(entries))
        return dataclasses.replace(out, header=header)


class _LostFinishReply(ForwardingClient):
    """The guarded client, whose ``finish_weight_update`` reply is lost once after the update
    landed: the trainer's push fails, so its encoder keeps the old base while the worker
    serves (and its host copy holds) the new version."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)
        raise TimeoutError("the reply to finish_weight_update was lost (test)")


@contextmanager
def _delta_trainer(native: Native, **fields: Any) -> Iterator[RolloutSyncTrainerEngine]:
    """A trainer engine with ``fields`` (``delta=True`` ...) in place of the module's, which is
    put back afterwards (a new group: the worker serves one trainer at a time) with a version
    of its own pushed, so the tests after this one find what they expect."""
    old = native.engine
    info = RolloutSyncTrainerInitInfo.on_this_host(bucket_bytes=64 << 10, timeout_s=30.0, **fields)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=native.client, source=MappingSource(native.current)
    )
    assert isinstance(engine, RolloutSyncTrainerEngine)
    old.shutdown()
    native.engine = engine
    try:
        yield engine
    finally:
        engine.shutdown()
        info = dataclasses.replace(old.init_info, master_port=find_free_port())
        plain = WeightTransferTrainerFactory.trainer_init(
            info, client=native.client, source=MappingSource(native.current)
        )
        assert isinstance(plain, RolloutSyncTrainerEngine)
        plain.callback.version = engine.version
        native.engine = plain
        native.push()


def _landed(native: Native, weights: Mapping[str, torch.Tensor], version: int) -> None:
    """The worker serves ``weights`` as ``version``: verified by its read-back, and greedy
    tokens exactly the transformers forward of ``weights``."""
    state = native.backend.native_transfer_state()
    assert state["torn"] is None and not native.backend.parked
    assert _served_version(native) == str(version)
    out = native.backend.generate([PROMPT, [3, 4, 5]], greedy_params(20), timeout=60)
    assert list(out[0].token_ids) == native.reference(weights, PROMPT, 20)
    assert list(out[1].token_ids) == native.reference(weights, [3, 4, 5], 20)


@pytest.mark.timeout(300)
def test_delta_syncs_rebuild_from_the_host_copy_and_fall_back_whole(native: Native) -> None:
    full = sum(t.numel() * t.element_size() for t in native.current.values())
    state = native.backend.native_transfer_state
    with _delta_trainer(native, delta=True) as engine:
        assert engine.encoder is not None
        v = engine.version
        a = dict(native.weights_of(v + 1))
        native.send(engine, v + 1, a)  # no base yet: whole
        stats = engine.last_stats
        assert stats is not None and (stats.sync_kind, stats.whole_reason) == (
            "whole",
            WholeReason.FIRST.value,
        )
        assert state()["host_copy_version"] == v + 1
        assert state()["host_copy_mb"] == pytest.approx(full / 1e6)
        _landed(native, a, v + 1)

        # A training step's change goes by delta: only its packed bytes on the wire, the
        # worker rebuilds whole tensors from its host copy (and the unchanged parts of fused
        # modules), loads them through vLLM's reload and reads them back.
        b = _step(a, seed=1)
        expected = DeltaEncoder()
        expected.committed(a, v + 1, None)
        delta = expected.encode(b, v + 2)
        assert isinstance(delta, EncodedDelta) and not UNCHANGED & set(delta.packed)
        updates = state()["updates"]
        native.send(engine, v + 2, b)
        stats = engine.last_stats
        assert stats is not None and stats.sync_kind == "delta", stats
        assert stats.nbytes == delta.nbytes < 0.1 * full and stats.full_nbytes == full
        worker = state()
        assert worker["last_sync_kind"] == "delta" and worker["updates"] == updates + 1
        assert worker["host_copy_version"] == v + 2
        _landed(native, b, v + 2)

        # Staged: only the packed delta is staged; the install rebuilds from the host copy.
        c = _step(b, seed=2)
        native.current.clear()
        native.current.update(c)
        engine.push(c, version=v + 3, label=str(v + 3), timeout=60, staged=True)
        assert engine.last_stats is not None and engine.last_stats.sync_kind == "delta"
        assert state()["last_stage_mb"] < 0.1 * full / 1e6
        _landed(native, c, v + 3)
        metrics = engine.metrics()
        assert metrics is not None and metrics["weight_sync_delta_count"] == 1  # send_weights'

        # The worker lands v + 4 but the trainer never hears so: its base stays v + 3, the
        # worker's host copy holds v + 4, another base: the worker asks for the whole version.
        d = _step(c, seed=3)
        engine.client = _LostFinishReply(native.client)
        try:
            with pytest.raises(TimeoutError):
                native.send(engine, v + 4, d)
        finally:
            engine.client = native.client
        assert state()["host_copy_version"] == v + 4
        e = _step(d, seed=4)
        native.send(engine, v + 5, e)
        assert engine.last_stats is not None
        assert (engine.last_stats.sync_kind, engine.last_stats.whole_reason) == (
            "whole",
            WholeReason.RECEIVER.value,
        )
        _landed(native, e, v + 5)
        f = _step(e, seed=5)
        native.send(engine, v + 6, f)  # and then by delta again
        assert engine.last_stats is not None and engine.last_stats.sync_kind == "delta"
        _landed(native, f, v + 6)

    # Without the host copy a worker takes every version whole.
    with _delta_trainer(native, delta=True, delta_host_copy=False) as engine:
        v = engine.version
        a = dict(native.weights_of(v + 1))
        native.send(engine, v + 1, a)
        native.send(engine, v + 2, _step(a, seed=6))
        assert engine.last_stats is not None
        assert (engine.last_stats.sync_kind, engine.last_stats.whole_reason) == (
            "whole",
            WholeReason.RECEIVER.value,
        )
        assert state()["host_copy_version"] is None
        _landed(native, _step(a, seed=6), v + 2)


@pytest.mark.timeout(240)
def test_a_delta_with_a_wrong_digest_is_refused_with_nothing_loaded(native: Native) -> None:
    state = native.backend.native_transfer_state
    with _delta_trainer(native, delta=True) as engine:
        v = engine.version
        a = dict(native.weights_of(v + 1))
        native.send(engine, v + 1, a)
        hostile = _WrongDigest()
        assert engine.encoder is not None
        hostile.__dict__.update(engine.encoder.__dict__)
        engine.encoder = hostile
        # A guard of its own: it counts the engine's updates from its first start (the
        # module's guard did not see the updates other tests sent through other guards, and
        # takes a failure then as torn: its safe side).
        guard = GuardedWeightSyncClient(native.client.inner, rollout=native.backend)
        engine.client = guard
        before = state()
        with pytest.raises(ChecksumMismatchError) as caught:
            native.send(engine, v + 2, _step(a, seed=7))
        assert caught.value.failed_ranks == (1,)
        # Refused at the proof, before the reload started: nothing loaded, not torn, the
        # host copy untouched; the guard resumed generation on the version served.
        after = state()
        assert after["torn"] is None and after["updates"] == before["updates"]
        assert after["host_copy_version"] == v + 1
        assert guard.torn is None and "refused the delta" in str(guard.reports[-1].error)
        _landed(native, a, v + 1)
        # The next delta on the same base lands.
        b = _step(a, seed=8)
        native.send(engine, v + 2, b)
        assert engine.last_stats is not None and engine.last_stats.sync_kind == "delta"
        _landed(native, b, v + 2)


def test_the_host_copy_claims_only_bits_it_holds() -> None:
    """A version number sent again whole with other bits is digested anew, and a staged
    delta whose write stops part-way (of any error type) empties the copy, so that nothing
    claims a version over what it left behind until a whole update refilled it."""
    from rollout_sync.backends.vllm.host_copy import HostCopy

    served = {"w": torch.zeros(4)}
    host = HostCopy()
    host.refresh(["w"], [torch.zeros(4)])
    host.commit(None, 3, served)
    host.digests.get("w", host.tensors["w"], 3)
    host.refresh(["w"], [torch.ones(4)])  # version 3 again, other bits (a restarted trainer)
    host.commit(None, 3, served)
    fresh = HostCopy()
    fresh.refresh(["w"], [torch.ones(4)])
    assert host.digests.get("w", host.tensors["w"], 3) == fresh.digests.get(
        "w", fresh.tensors["w"], 3
    )

    class _Interrupted(BaseException):
        pass

    class _Unwritable:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def apply(self, cache: Any) -> int:
            host.tensors["w"][0] = 7.0  # written, not put back
            raise self.error

    for error in (RuntimeError("the write failed (test)"), _Interrupted()):
        host.refresh(["w"], [torch.zeros(4)])
        host.commit(None, 3, served)
        with contextlib.suppress(_Interrupted):
            host.commit(_Unwritable(error), 4, served)  # type: ignore[arg-type]
        assert host.version is None, error
        # Emptied, not only unversioned: a later update that refreshes nothing (a subset
        # without "w") claims no version over the half-written tensor, and no delta is taken.
        assert host.tensors == {}, error
        host.commit(None, 5, served)
        assert host.version is None and host.target(served, apply=True) is None, error


# -- the trainer in a process of its own -------------------------------------------------------


class _BridgeClient:
    """vLLM's client protocol, forwarded to the process that hosts the engine (the parent)."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        from multiprocessing.connection import Client

        self._conn = Client(address, authkey=authkey)

    def _call(self, method: str, *args: Any) -> None:
        self._conn.send((method, args))
        if not self._conn.poll(120):
            raise TimeoutError(f"the engine host did not answer {method} within 120 s")
        error = self._conn.recv()
        if error is not None:
            raise RuntimeError(f"{method} failed in the engine host: {error}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def close(self) -> None:
        self._conn.send(("close", ()))


def _serve_bridge(listener: Any, client: GuardedWeightSyncClient) -> None:
    """Answer one trainer's calls on the guarded client (the update_weights call comes on a
    second connection, so it can run beside the trainer's send)."""

    def serve(conn: Any) -> None:
        while True:
            method, args = conn.recv()
            if method == "close":
                return
            try:
                getattr(client, method)(*args)
                conn.send(None)
            except Exception as exc:  # sent back to the trainer, which raises it
                conn.send(f"{type(exc).__name__}: {exc}")

    threads = []
    for _ in range(2):  # the trainer's main connection, and its update_weights connection
        conn = listener.accept()
        thread = threading.Thread(target=serve, args=(conn,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(300)


class _TwoConnectionClient:
    """The trainer's client: update_weights on a connection of its own (it runs in a thread
    beside the send, while the main connection waits for nothing)."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self.main = _BridgeClient(address, authkey)
        self.updates = _BridgeClient(address, authkey)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.main.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.main.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.updates.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.main.finish_weight_update(weight_version)

    def close(self) -> None:
        self.main.close()
        self.updates.close()


def _trainer_process(
    rank: int, address: tuple[str, int], authkey: bytes, port: int, model_dir: str, seeds: list[int]
) -> dict[str, Any]:
    import transformers
    from vllm.distributed.weight_transfer.base import ModuleSource

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    client = _TwoConnectionClient(address, authkey)
    info = RolloutSyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=2, rank=0, timeout_s=30.0
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    for version, seed in enumerate(seeds, start=100):
        model.load_state_dict(random_llama_weights(shapes, seed=seed))
        engine.send_weights(version)
    metrics = engine.metrics()
    engine.shutdown()
    client.close()
    return {"engine": type(engine).__name__, "metrics": metrics}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_trainer_engine_in_a_second_process_through_vllms_factory(
    native: Native, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from multiprocessing.connection import Listener

    from rollout_sync.testing import run_processes

    authkey = b"rollout_sync-test"
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    server = threading.Thread(target=_serve_bridge, args=(listener, native.client), daemon=True)
    server.start()
    model_dir = str(native.backend.config.model)
    native.engine.shutdown()  # the host's own trainer leaves; the engine joins the new group
    try:
        result = run_processes(
            _trainer_process,
            1,
            (listener.address, authkey, find_free_port(), model_dir, [701, 702]),
            timeout_s=240,
        )[0]
    finally:
        server.join(30)
        listener.close()
    assert result["engine"] == "RolloutSyncTrainerEngine"
    assert result["metrics"]["weight_sync_count"] == 2
    assert result["metrics"]["weight_sync_time_ms"] > 0
    assert _served_version(native) == "101"
    assert native.backend.weight_version == 101
    expected = random_llama_weights(native.shapes, seed=702)
    out = native.backend.generate([PROMPT], greedy_params(16), timeout=60)[0]
    assert list(out.token_ids) == native.reference(expected, PROMPT, 16)
    assert native.client.reports[-1].error is None
