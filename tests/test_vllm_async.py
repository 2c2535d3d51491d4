"""VLLMAsyncBackend on a real vLLM engine (vLLM for CPU, a tiny random Llama, float32).

One engine for the whole module (it takes ~15 s to start); each test syncs the weights it
needs first. Greedy decoding in float32 makes every claim exact: the engine's tokens are
compared with a plain transformers forward of the same weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from vllm_helpers import (  # first: it sets the environment vLLM reads at import
    NO_FORWARD_DURING,
    World,
    check_greedy_output_equals_transformers,
    corrupted_in_transit,
    running_world,
    writes_by,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync import (
    PauseTimeout,
    SpanKind,
    TornWeightsError,
    WeightMismatchError,
    weight_sync_bracket,
)
from rollout_sync.backends.vllm import KVCachePolicy, VLLMAsyncBackend, greedy_params
from rollout_sync.errors import WeightsNotLandedError
from rollout_sync.trace import find_overlaps

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World[VLLMAsyncBackend]]:
    def observe(w: World[VLLMAsyncBackend]) -> None:
        w.first_sync["parked_inside"] = w.backend.parked
        w.first_sync["in_flight"] = w.backend.requests_in_flight

    # The first sync starts the engine lazily, inside the bracket: it must start parked.
    with running_world(
        VLLMAsyncBackend,
        tmp_path_factory.mktemp("tiny_llama"),
        model_seed=0,
        weights_seed=1000,
        first_sync=observe,
        pause_timeout=30.0,
        rpc_timeout=60.0,
    ) as w:
        w.first_sync["parked_after"] = w.backend.parked
        yield w


def _long_request_through_sync(
    world: World,
    *,
    max_tokens: int = 120,
    lead: int = 12,
    during: Callable[[], None] | None = None,
) -> tuple[list[int], list[int], int, int, object]:
    """Start a long greedy request, sync once it has ``lead`` tokens; return what happened."""
    backend = world.backend
    old_version = world.version
    prompt = [1, 17, 42, 99, 7]
    request = backend.submit(prompt, greedy_params(max_tokens))
    seen_before = len(request.wait_for_tokens(lead, timeout=60))
    new_version = world.sync(during)
    result = request.result(timeout=120)
    assert result.ok, result.error
    return prompt, list(result.token_ids), old_version, new_version, (seen_before, result)


# -- start-up ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_lazy_start_inside_a_sync_begins_parked_and_resumes(world: World) -> None:
    assert world.first_sync == {"parked_inside": True, "in_flight": 0, "parked_after": False}
    assert world.backend.weight_version >= 1
    assert len(world.backend.weight_specs()) == len(world.shapes)


# -- exactness ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_greedy_output_equals_transformers(world: World) -> None:
    check_greedy_output_equals_transformers(world)


@pytest.mark.timeout(180)
def test_long_request_continues_with_the_new_weights_after_a_keep_mode_sync(world: World) -> None:
    """Old tokens before the pause, the new weights' exact continuation after it (recompute),
    and a request submitted during the pause runs entirely on the new weights."""
    backend = world.backend
    queued: dict[str, object] = {}

    def during() -> None:
        assert backend.parked
        queued["request"] = backend.submit([3, 4, 5, 6], greedy_params(16))

    prompt, tokens, old_v, new_v, (seen_before, result) = _long_request_through_sync(
        world, during=during
    )
    assert len(tokens) == 120
    split = world.sync_split(prompt, tokens, old_v, new_v, at_least=seen_before)
    assert split is not None, "tokens after the sync are not the new weights' continuation"
    assert seen_before <= split < len(tokens)
    assert (result.admitted_version, result.completed_version) == (old_v, new_v)
    assert result.straddled

    late = queued["request"].result(timeout=60)  # type: ignore[attr-defined]
    assert late.ok
    assert list(late.token_ids) == world.reference(world.weights_of(new_v), [3, 4, 5, 6], 16)
    assert (late.admitted_version, late.completed_version, late.straddled) == (new_v, new_v, False)


@pytest.mark.timeout(240)
def test_a_fast_park_delivers_every_earlier_output_and_versions_every_token(world: World) -> None:
    """Two parks (by the park flag) while one long request decodes: when each sync's body
    starts, every token the engine produced under the old weights has reached the request
    (vLLM's own version labels end exactly there), nothing is lost or reordered, the tokens
    are the old weights' up to the first park and each new version's exact continuation after,
    and each token's version is the one that produced it."""
    backend = world.backend
    assert backend.park_flag and backend._flag is not None  # the flag parks this engine
    prompt = [1, 23, 45, 67, 89]
    request = backend.submit(prompt, greedy_params(160))
    versions = [world.version]
    seen_in_body: list[int] = []

    def during() -> None:
        seen_in_body.append(len(request.tokens()))

    for lead in (10, 60):
        request.wait_for_tokens(lead, timeout=60)
        versions.append(world.sync(during))
    result = request.result(timeout=120)
    assert result.ok, result.error
    tokens = list(result.token_ids)
    assert len(tokens) == 160
    k1, k2 = seen_in_body
    assert 10 <= k1 < k2 < 160
    v0, v1, v2 = versions
    assert result.weight_versions == ((str(v0), 0, k1), (str(v1), k1, k2), (str(v2), k2, 160))
    assert result.token_weight_versions == (v0,) * k1 + (v1,) * (k2 - k1) + (v2,) * (160 - k2)
    # The stamps taken as tokens arrived agree with vLLM's labels: exact under the pause.
    assert result.arrival_versions == result.token_weight_versions
    assert tokens[:k1] == world.reference(world.weights_of(v0), prompt, k1)
    assert tokens[k1:k2] == world.reference(world.weights_of(v1), prompt + tokens[:k1], k2 - k1)
    assert tokens[k2:] == world.reference(world.weights_of(v2), prompt + tokens[:k2], 160 - k2)


@pytest.mark.timeout(120)
def test_the_park_flag_alone_parks_the_engine_and_undoes_a_foreign_resume(world: World) -> None:
    """Raised, the flag stops decoding at the next step without any pause message, and a
    resume from someone else is undone before another forward; lowered, decoding goes on."""
    backend = world.backend
    flag = backend._flag
    assert flag is not None
    engine = backend.engine

    def engine_paused() -> bool:
        return bool(backend.run_on_loop(engine.is_paused(), 30, "is_paused"))

    request = backend.submit([5, 6, 7], greedy_params(120))
    request.wait_for_tokens(4, timeout=60)
    flag.raise_()
    try:
        wait_until(engine_paused, timeout=30, what="the scheduler parked on the flag")
        held = len(request.tokens())  # is_paused's reply came after every earlier output
        assert 4 <= held < 120
        backend.run_on_loop(engine.resume_generation(), 30, "a foreign resume")
        wait_until(engine_paused, timeout=30, what="the scheduler parked again")
        assert len(request.tokens()) == held  # re-parked before another forward
        assert not request.done
    finally:
        flag.lower()
        backend.run_on_loop(engine.resume_generation(), 30, "resume")
    result = request.result(timeout=120)
    assert result.ok and len(result.token_ids) == 120
    assert list(result.token_ids) == world.reference(
        world.weights_of(world.version), [5, 6, 7], 120
    )


@pytest.mark.timeout(180)
def test_keep_stale_kv_mixes_versions(world: World) -> None:
    """The KV policy matters: keeping stale KV, no split explains the tokens (this is what
    RECOMPUTE prevents, and the check above would catch it)."""
    world.backend.kv_cache_policy = KVCachePolicy.KEEP_STALE
    try:
        prompt, tokens, old_v, new_v, (seen_before, _) = _long_request_through_sync(world)
    finally:
        world.backend.kv_cache_policy = KVCachePolicy.RECOMPUTE
    assert world.sync_split(prompt, tokens, old_v, new_v, at_least=seen_before) is None


@pytest.mark.timeout(60)
def test_a_request_that_ends_before_a_sync_is_not_straddled(world: World) -> None:
    version = world.version
    result = world.backend.generate([[8, 9, 10]], greedy_params(8), timeout=60)[0]
    world.sync()
    assert (result.admitted_version, result.completed_version, result.straddled) == (
        version,
        version,
        False,
    )


# -- no forward overlaps the write -------------------------------------------------------------


def _wait_for_forwards(backend: VLLMAsyncBackend, more_than: int, timeout: float) -> int:
    wait_until(
        lambda: backend.engine_forward_count() > more_than, timeout, "the engine to run a forward"
    )
    return backend.engine_forward_count()


def _two_part_sync(world: World, *, guarded: bool) -> None:
    """One sync written in two calls (as a bucketed transfer does), a request in flight.

    Unguarded, the test waits between the two parts until the engine has run a forward, so
    that forward demonstrably reads layer 0 new and layer 1 old.
    """
    backend, timeline = world.backend, world.timeline
    version = world.version + 1
    weights = world.weights_of(version)
    first = {n: t for n, t in weights.items() if ".layers.0." in n}
    second = {n: t for n, t in weights.items() if n not in first}
    request = backend.submit([5, 6, 7], greedy_params(120))
    request.wait_for_tokens(4, timeout=60)
    with weight_sync_bracket(
        backend if guarded else None, name="two-part sync", timeline=timeline, timeout=60
    ):
        backend.load_weights(first, require_all=False)
        if not guarded:
            _wait_for_forwards(backend, backend.engine_forward_count(), timeout=60)
        backend.load_weights(second, require_all=False)
        backend.commit_weight_version(version)
    world.version = version
    assert request.result(timeout=120).ok


@pytest.mark.timeout(180)
def test_no_forward_overlaps_a_write_or_a_sync(world: World) -> None:
    backend = world.backend
    with world.spans_recorded() as spans:
        request = backend.submit([11, 12, 13], greedy_params(150))
        request.wait_for_tokens(4, timeout=60)
        for _ in range(3):
            world.sync()
        _two_part_sync(world, guarded=True)
        assert request.result(timeout=120).ok
    forwards = [s for s in spans if s.kind == SpanKind.FORWARD]
    writes = [s for s in spans if s.kind == SpanKind.WEIGHT_WRITE]
    syncs = [s for s in spans if s.kind == SpanKind.SYNC]
    assert len(writes) == 5 and len(syncs) == 4
    assert len(forwards) > 100
    # Forwards ran between the syncs, so "no overlap" is not "no forwards".
    assert any(f.start_ns > syncs[0].end_ns and f.end_ns < syncs[-1].start_ns for f in forwards)
    assert find_overlaps(spans, NO_FORWARD_DURING) == []


@pytest.mark.timeout(180)
def test_without_the_pause_a_forward_reads_a_half_written_sync(world: World) -> None:
    """The same two-part sync, unguarded: the checker finds the forward inside the sync."""
    with world.spans_recorded() as spans:
        _two_part_sync(world, guarded=False)
    overlaps = find_overlaps(spans, [(SpanKind.FORWARD, SpanKind.SYNC)])
    assert overlaps, "expected a forward between the two parts of the unguarded sync"


# -- writes that do not land, bad writes -------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_copy_write_that_does_not_land_is_detected_and_raised(world: World) -> None:
    """On vLLM for CPU ``lm_head`` computes from a packed copy: ``param.data.copy_`` is
    silently ignored there. The read-back catches it; generation stays parked until a good
    sync lands."""
    backend = world.backend
    version = world.sync()
    new_head = {"lm_head.weight": world.weights_of(version + 1)["lm_head.weight"]}
    with writes_by(backend, write_method="copy"):  # "auto" resolves to the rpc path for copy
        with pytest.raises(WeightsNotLandedError, match="lm_head") as caught, backend.paused(30):
            backend.load_weights(new_head, require_all=False)
        assert caught.value.torn
        assert backend.weights_torn and backend.parked
        with pytest.raises(TornWeightsError):
            backend.submit([1, 2, 3], greedy_params(4))

        # The full set through copy: the repacked linear weights are refused before writing.
        with pytest.raises(WeightsNotLandedError, match="repacked") as refused, backend.paused(30):
            backend.load_weights(world.weights_of(version))
        assert not refused.value.torn
    recovered = world.sync()
    assert not backend.weights_torn and not backend.parked
    result = backend.generate([[4, 4, 4]], greedy_params(12), timeout=60)[0]
    assert list(result.token_ids) == world.reference(world.weights_of(recovered), [4, 4, 4], 12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["unknown name", "shape", "dtype", "missing", "split group"])
def test_bad_weights_are_refused_and_outputs_stay_unchanged(world: World, damage: str) -> None:
    backend = world.backend
    prompt = [21, 22, 23]
    before = backend.generate([prompt], greedy_params(12), timeout=60)[0].token_ids
    writes = backend.statistics().writes
    bad = dict(world.weights_of(world.version + 1))
    require_all = True
    if damage == "unknown name":
        bad["model.layers.9.mlp.gate_proj.weight"] = bad["model.layers.0.mlp.gate_proj.weight"]
    elif damage == "shape":
        bad["lm_head.weight"] = bad["lm_head.weight"][:, :32].contiguous()
    elif damage == "dtype":
        bad["model.norm.weight"] = bad["model.norm.weight"].to(torch.bfloat16)
    elif damage == "missing":
        del bad["model.layers.1.mlp.down_proj.weight"]
    else:
        bad = {
            "model.layers.0.self_attn.q_proj.weight": bad["model.layers.0.self_attn.q_proj.weight"]
        }
        require_all = False
    with pytest.raises(WeightMismatchError), backend.paused(30):
        backend.load_weights(bad, require_all=require_all)
    assert backend.statistics().writes == writes
    assert not backend.weights_torn and not backend.parked
    after = backend.generate([prompt], greedy_params(12), timeout=60)[0].token_ids
    assert after == before


@pytest.mark.timeout(180)
def test_a_native_write_corrupted_mid_load_is_torn_and_parked_until_a_good_sync(
    world: World,
) -> None:
    """``load_weights`` goes through vLLM's native weight transfer (the default engine config):
    a bucket corrupted in transit fails the engine's checksum after the reload started, so the
    layers are not servable; the backend says torn and stays parked until a complete sync."""
    backend = world.backend
    world.sync()
    native = backend._writer._native
    assert backend.native_writes and native is not None and native.transfer is not None
    with (
        corrupted_in_transit(native.transfer),
        pytest.raises(WeightsNotLandedError, match="mid-load") as caught,
        backend.paused(30),
    ):
        backend.load_weights(world.weights_of(world.version + 1))
    assert caught.value.torn and backend.weights_torn and backend.parked
    recovered = world.sync()
    assert not backend.weights_torn and not backend.parked
    result = backend.generate([[8, 9]], greedy_params(12), timeout=60)[0]
    assert list(result.token_ids) == world.reference(world.weights_of(recovered), [8, 9], 12)
    assert result.weight_versions == ((str(recovered), 0, 12),)


@pytest.mark.timeout(120)
def test_file_transport_writes_and_cleans_up(world: World, tmp_path: Path) -> None:
    backend = world.backend
    writer = backend._writer
    seen: list[str] = []
    encode = writer._encode

    def recording_encode(weights: object) -> object:
        payload, cleanup = encode(weights)  # type: ignore[arg-type]
        seen.append(str(payload))
        return payload, cleanup

    writer._encode = recording_encode  # type: ignore[assignment,method-assign]
    try:
        # The rpc path (the engine's default path is native), its payload as a file.
        with writes_by(backend, write_path="rpc", payload_transport="file", payload_dir=tmp_path):
            version = world.sync()
    finally:
        del writer._encode
    assert len(seen) == 1 and seen[0].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    result = backend.generate([[7, 7]], greedy_params(10), timeout=60)[0]
    assert list(result.token_ids) == world.reference(world.weights_of(version), [7, 7], 10)


# -- the pause contract ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_pause_timeout_raises_clearly_and_leaves_the_engine_running(
    world: World, tmp_path: Path
) -> None:
    """Hold the engine between steps (a stalling engine call), then ask for a short pause."""
    backend = world.backend
    started, release = tmp_path / "started", tmp_path / "release"
    engine = backend.engine

    async def stall() -> object:
        return await engine.collective_rpc(
            "rollout_sync_stall", args=(str(started), str(release), 60.0)
        )

    stalled: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: stalled.setdefault("released", backend.run_on_loop(stall(), 90, "stall"))
    )
    thread.start()
    try:
        # The engine process touches the file: there is no event to wait on across it.
        wait_until(started.exists, 30, "the engine to start the stall")
        with pytest.raises(PauseTimeout, match=r"did not park within 0\.3 s"), backend.paused(0.3):
            pytest.fail("the body must not run without a parked engine")
    finally:
        release.touch()
        thread.join(60)
    assert stalled == {"released": [True]}
    assert not backend.parked
    result = backend.generate([[9, 9, 9]], greedy_params(6), timeout=60)[0]
    assert result.ok and len(result.token_ids) == 6

    async def is_paused() -> bool:
        return bool(await engine.is_paused())

    assert backend.run_on_loop(is_paused(), 30, "is_paused") is False


@pytest.mark.timeout(120)
def test_an_exception_inside_the_bracket_resumes_generation(world: World) -> None:
    backend = world.backend
    request = backend.submit([31, 32, 33], greedy_params(60))
    request.wait_for_tokens(4, timeout=60)

    def fail() -> None:
        raise RuntimeError("barrier peer died")

    with pytest.raises(RuntimeError, match="barrier peer died"):
        world.worker.receive_weights(world.weights_of(world.version + 1), world.version + 1, fail)
    assert world.worker.reports[-1].error is not None
    assert not backend.parked and not backend.weights_torn
    result = request.result(timeout=60)
    assert result.ok and len(result.token_ids) == 60
    assert not result.straddled


@pytest.mark.timeout(60)
def test_pause_is_reentrant_and_a_second_thread_times_out(world: World) -> None:
    backend = world.backend
    pauses = backend.statistics().pauses
    errors: list[BaseException] = []
    with backend.paused(30):
        with backend.paused(30):
            assert backend.parked
        assert backend.parked

        def other() -> None:
            try:
                with backend.paused(0.2):
                    pass
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
    assert not backend.parked
    assert backend.statistics().pauses == pauses + 1
    assert len(errors) == 1 and isinstance(errors[0], PauseTimeout)
    assert "another thread holds the pause" in str(errors[0])


# -- a Fast-LLM trainer drives this engine -----------------------------------------------------


@pytest.mark.timeout(180)
def test_a_fast_llm_trainer_drives_the_vllm_backend_through_its_native_path(
    world: World,
) -> None:
    """Fast-LLM's stream (a trainer written from the protocol, a real redis-server) lands in
    the engine through the backend's native weight-transfer path, guarded, while a request
    decodes: the version committed is documents_seen and greedy output is exactly the new
    weights'."""
    pytest.importorskip("redis")
    from rollout_sync.integrations.fast_llm import FastLLMReceiver
    from rollout_sync.testing import find_free_port
    from rollout_sync.testing.fast_llm_trainer import FastLLMTrainerStandIn
    from rollout_sync.testing.redis_server import RedisServer, require_redis_server

    try:
        require_redis_server()
    except ImportError as exc:
        pytest.skip(str(exc))
    backend = world.backend
    assert backend.native_writes
    new_version = world.version + 1
    weights = world.weights_of(new_version)
    with RedisServer() as server:
        client = server.client()
        port = find_free_port()
        trainer = FastLLMTrainerStandIn(client, host="127.0.0.1", port=port, timeout_s=60)
        receiver = FastLLMReceiver(
            backend, redis=client, group_address=("127.0.0.1", port), timeout_s=60
        )
        connecting = threading.Thread(target=trainer.connect)
        connecting.start()
        receiver.connect()
        connecting.join(60)
        request = backend.submit([7, 8, 9], greedy_params(200))
        request.wait_for_tokens(8, timeout=60)
        pushing = threading.Thread(target=lambda: trainer.push(3, new_version, weights))
        pushing.start()
        event = receiver.next_event(60)
        assert event is not None and event.version == new_version  # type: ignore[union-attr]
        receiver.take(event)  # type: ignore[arg-type]
        pushing.join(60)
        trainer.close()
        receiver.close()
    world.version = new_version
    assert backend.weight_version == new_version and not backend.weights_torn
    result = request.result(timeout=120)
    assert result.ok and result.straddled
    assert new_version in result.token_weight_versions
    prompt = [1, 5, 9, 33, 7]
    (fresh,) = backend.generate([prompt], greedy_params(24), timeout=60)
    assert list(fresh.token_ids) == world.reference(weights, prompt, 24)


# -- the demo, on this module's engine ---------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_vllm_demo_reports_no_hazards_when_guarded(world: World) -> None:
    from rollout_sync.demos.vllm import VLLMDemoConfig, run_vllm_demo

    report = run_vllm_demo(
        VLLMDemoConfig(syncs=8, interval_s=0.01, max_tokens=24), backend=world.backend
    )
    world.version = world.backend.weight_version
    assert report["mode"] == "vllm" and report["guarded"] is True
    assert report["syncs"] == 8
    assert report["forwards"] > 0 and report["generations"] > 0
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0
    assert report["generations_failed"] == 0
    assert report["payloads_sent"] == report["generations"]
    for key in ("time_to_park_ms_p50", "time_to_park_ms_p99", "sync_ms_p50", "sync_ms_p99"):
        assert report[key] >= 0
