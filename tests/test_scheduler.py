"""RolloutTaskScheduler: step-boundary park, drain, the admission race, nothing lost, version
stamps; on the tiny torch LM, driven by hand (exact interleavings) and on its own thread."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import pytest
import torch
from torch_lm_helpers import (  # noqa: F401 - one_torch_thread is an autouse fixture
    Runner,
    SyncWorker,
    greedy_continuation,
    one_torch_thread,
    tiny_config,
    wait_until,
    weights_of,
)

from rollout_sync import (
    GenerationRequest,
    GenerationResult,
    KVCachePolicy,
    PauseTimeout,
    RolloutTaskScheduler,
    SamplingParams,
    SpanKind,
    Timeline,
)
from rollout_sync.backends.torch_lm import TorchLMStreamBackend
from rollout_sync.errors import SchedulerTimeout, WouldBlock
from rollout_sync.scheduler import FinishReason, ParkReport, SchedulerStatistics, SequenceState
from rollout_sync.testing import CheckThenActScheduler


def _by_id(results: Sequence[GenerationResult]) -> dict[int, GenerationResult]:
    by_id = {r.request_id: r for r in results}
    assert len(by_id) == len(results), "a request produced two results"
    return by_id


def _drive_until_idle(scheduler: RolloutTaskScheduler, limit: int = 500) -> None:
    for _ in range(limit):
        s = scheduler.statistics()
        if not s.active and not s.queued:
            return
        scheduler.step(timeout=10)
    raise AssertionError(f"{scheduler!r} still busy after {limit} steps")


# -- in-flight sequences across a sync ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_in_flight_sequences_survive_a_sync_and_recompute_under_the_new_weights() -> None:
    config = tiny_config()
    backend = TorchLMStreamBackend(config)
    scheduler = backend.scheduler
    worker = SyncWorker(backend)
    prompts = {
        scheduler.put([3, 1, 4, 1, 5], max_new_tokens=8): (3, 1, 4, 1, 5),
        scheduler.put([9, 2, 6], max_new_tokens=8): (9, 2, 6),
    }
    for _ in range(3):
        scheduler.step()
    seen_inside: list[int] = []
    worker.inside = lambda: seen_inside.append(scheduler.statistics().active)
    worker.receive_weights(1, weights_of(config, 1))
    assert worker.reports[-1].paused
    assert seen_inside == [2], "both sequences stay in flight across the sync"
    _drive_until_idle(scheduler)

    results = _by_id(scheduler.get_all())
    assert results.keys() == prompts.keys()
    for rid, prompt in prompts.items():
        r = results[rid]
        assert r.ok and len(r.tokens) == 8
        assert r.tokens[:3] == greedy_continuation(config, weights_of(config, 0), prompt, 3)
        assert r.tokens[3:] == greedy_continuation(
            config, weights_of(config, 1), [*prompt, *r.tokens[:3]], 5
        )
        assert r.token_weight_versions == (0, 0, 0, 1, 1, 1, 1, 1)
        assert (r.admitted_weight_version, r.completed_weight_version) == (0, 1)
        assert r.straddled_sync and r.oldest_weight_version == 0
        assert (r.recomputes, r.stale_cache_tokens) == (1, 0)
    assert backend.torn_forwards == 0


@pytest.mark.timeout(60)
def test_keep_stale_policy_continues_on_the_old_cache_and_says_so() -> None:
    config = tiny_config()
    runs = {}
    for policy in (KVCachePolicy.RECOMPUTE, KVCachePolicy.KEEP_STALE):
        backend = TorchLMStreamBackend(config, kv_policy=policy)
        rid = backend.put([3, 1, 4, 1, 5], max_new_tokens=8)
        for _ in range(3):
            backend.scheduler.step()
        with backend.paused() as park:
            # The backend's pause is the scheduler's: it reports the park like the scheduler.
            assert isinstance(park, ParkReport)
            assert park.in_flight == 1 and not park.drained
            backend.load_weights(weights_of(config, 1))
            backend.commit_weight_version(1)
        _drive_until_idle(backend.scheduler)
        (runs[policy],) = backend.get_all()
        assert runs[policy].request_id == rid
        assert backend.statistics().recomputed_tokens == (
            7 if policy is KVCachePolicy.RECOMPUTE else 0
        )
    stale, fresh = runs[KVCachePolicy.KEEP_STALE], runs[KVCachePolicy.RECOMPUTE]
    assert stale.tokens[:3] == fresh.tokens[:3]
    assert (stale.recomputes, stale.stale_cache_tokens) == (0, 5)
    # The first token after the sync attends to keys and values of the old weights: a different
    # distribution from the recomputed one.
    assert stale.logprobs[3] != fresh.logprobs[3]
    assert stale.token_weight_versions == fresh.token_weight_versions


@pytest.mark.timeout(60)
def test_on_the_scheduler_thread_the_guard_parks_at_a_step_boundary() -> None:
    config = tiny_config()
    timeline = Timeline()
    backend = TorchLMStreamBackend(config, timeline=timeline)
    worker = SyncWorker(backend, timeline)
    prompts = {backend.put(p, max_new_tokens=30): tuple(p) for p in ([1, 2, 3], [4, 5, 6, 7], [8])}
    blocker = _Blocker(n=5)
    backend.layer_hook = blocker
    in_flight: list[int] = []
    worker.inside = lambda: in_flight.append(backend.scheduler.statistics().active)
    backend.start()
    try:
        # The sync arrives while the 5th decode step is inside its forward.
        assert blocker.holding.wait(10)
        syncing = Runner(lambda: worker.receive_weights(1, weights_of(config, 1)), "sync")
        wait_until(
            lambda: backend.generation_gate.statistics().exclusive_waiting == 1,
            10,
            "the sync to wait for the step in progress",
        )
        blocker.release.set()
        syncing.join()
        backend.scheduler.wait_idle(30)
    finally:
        blocker.release.set()
        backend.stop()
    report = worker.reports[-1]
    assert report.paused and report.error is None
    assert in_flight == [3], "the sync neither aborted nor waited out the generations"
    results = _by_id(backend.get_all())
    for rid, prompt in prompts.items():
        r = results[rid]
        assert r.ok and len(r.tokens) == 30 and r.straddled_sync
        n_old = r.token_weight_versions.count(0)
        assert n_old == 5, "parked right after the step in progress, not later"
        assert r.token_weight_versions == (0,) * n_old + (1,) * (30 - n_old)
        assert r.tokens[:n_old] == greedy_continuation(config, weights_of(config, 0), prompt, n_old)
        assert r.tokens[n_old:] == greedy_continuation(
            config, weights_of(config, 1), [*prompt, *r.tokens[:n_old]], 30 - n_old
        )
    assert backend.torn_forwards == 0
    assert timeline.overlaps() == []
    (pause,) = timeline.spans(SpanKind.PAUSE)
    assert pause.args["in_flight"] == 3 and not pause.args["drained"]


# -- not started, drain, timeouts --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_paused_before_start_is_a_no_op_and_a_start_inside_begins_parked() -> None:
    config = tiny_config()
    backend = TorchLMStreamBackend(config)
    rid = backend.put([1, 2, 3], max_new_tokens=3)
    started = time.monotonic()
    with backend.scheduler.paused(timeout=1.0, wait_for_active_tasks=True) as park:
        assert park.in_flight == 0
    assert time.monotonic() - started < 0.5
    assert backend.scheduler.statistics().queued == 1

    # The first sync lazily starts the engine inside the bracket: nothing may decode until the
    # sync is done, so the queued request runs entirely under the synced version.
    worker = SyncWorker(backend)
    worker.inside = backend.start
    try:
        worker.receive_weights(1, weights_of(config, 1))
        result = backend.scheduler.get(timeout=20)
    finally:
        backend.stop()
    assert result.request_id == rid and result.ok
    assert result.admitted_weight_version == 1
    assert result.token_weight_versions == (1, 1, 1) and not result.straddled_sync


@pytest.mark.timeout(60)
def test_drain_stops_admission_waits_out_active_tasks_then_parks() -> None:
    config = tiny_config()
    backend = TorchLMStreamBackend(config, max_concurrent=4)
    scheduler = backend.scheduler
    first = {backend.put([1, 2], max_new_tokens=10), backend.put([3, 4, 5], max_new_tokens=20)}
    # Both tasks are held in their second step until the late request is in, so the drain
    # cannot finish before admission is seen closed.
    blocker = _Blocker(n=2)
    backend.layer_hook = blocker
    backend.start()
    try:
        assert blocker.holding.wait(10)
        inside: dict[str, object] = {}

        def drain_and_sync() -> None:
            with scheduler.paused(timeout=30, wait_for_active_tasks=True) as park:
                inside["park"] = park
                inside["stats"] = scheduler.statistics()
                inside["results"] = scheduler.get_all()
                backend.load_weights(weights_of(config, 1))
                backend.commit_weight_version(1)

        draining = Runner(drain_and_sync, "drain")
        wait_until(lambda: not scheduler.statistics().admission_open, 20, "admission to close")
        late = backend.put([6, 7], max_new_tokens=3)
        blocker.release.set()
        draining.join(30)
        late_result = scheduler.get(timeout=20)
    finally:
        blocker.release.set()
        backend.stop()
    park = inside["park"]
    assert park.drained and park.in_flight == 0  # type: ignore[attr-defined]
    stats = inside["stats"]
    assert (stats.active, stats.queued, stats.admission_open) == (0, 1, False)  # type: ignore[attr-defined]
    drained = _by_id(inside["results"])  # type: ignore[arg-type]
    assert drained.keys() == first
    for r in drained.values():
        assert r.ok and r.completed_weight_version == 0 and not r.straddled_sync
    assert late_result.request_id == late
    assert late_result.token_weight_versions == (1, 1, 1)
    assert scheduler.statistics().drains == 1


class _Blocker:
    """A layer hook that holds the ``n``-th forward at its first block until released."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.forwards = 0
        self.holding = threading.Event()
        self.release = threading.Event()

    def __call__(self, index: int) -> None:
        if index != 0:
            return
        self.forwards += 1
        if self.forwards == self.n:
            self.holding.set()
            assert self.release.wait(20), "the test never released the held forward"


@pytest.mark.timeout(30)
def test_step_boundary_pause_times_out_clearly_and_leaves_nothing_held() -> None:
    backend = TorchLMStreamBackend(tiny_config())
    blocker = _Blocker()
    backend.layer_hook = blocker
    backend.put([1, 2, 3], max_new_tokens=5)
    backend.start()
    try:
        assert blocker.holding.wait(10)
        with (
            pytest.raises(
                PauseTimeout, match=r"did not park within 0\.2 s \(1 decode step still running\)"
            ),
            backend.paused(timeout=0.2),
        ):
            pytest.fail("the body of a timed-out pause ran")
        gate = backend.generation_gate.statistics()
        assert (gate.holders, gate.exclusive_waiting) == (0, 0)
        blocker.release.set()
        result = backend.scheduler.get(timeout=20)
        with backend.scheduler.paused(timeout=10) as park:
            assert park.in_flight == 0
    finally:
        blocker.release.set()
        backend.stop()
    assert result.ok and len(result.tokens) == 5


@pytest.mark.timeout(30)
def test_drain_times_out_clearly_and_reopens_admission() -> None:
    backend = TorchLMStreamBackend(tiny_config())
    blocker = _Blocker()
    backend.layer_hook = blocker
    backend.put([1, 2, 3], max_new_tokens=5)
    backend.start()
    try:
        assert blocker.holding.wait(10)
        with (
            pytest.raises(PauseTimeout, match=r"did not drain within 0\.2 s \(1 active task"),
            backend.paused(timeout=0.2, wait_for_active_tasks=True),
        ):
            pytest.fail("the body of a timed-out drain ran")
        assert backend.scheduler.statistics().admission_open
        blocker.release.set()
        assert backend.scheduler.get(timeout=20).ok
        late = backend.put([4], max_new_tokens=2)
        assert backend.scheduler.get(timeout=20).request_id == late
    finally:
        blocker.release.set()
        backend.stop()


def test_pauses_nest_and_a_drain_inside_a_held_pause_is_refused() -> None:
    backend = TorchLMStreamBackend(tiny_config())
    scheduler = backend.scheduler
    backend.put([1, 2], max_new_tokens=5)
    scheduler.step()
    with scheduler.paused(timeout=1):
        with scheduler.paused(timeout=1) as inner:
            assert inner.in_flight == 1
        assert scheduler.statistics().parked
        with (
            pytest.raises(RuntimeError, match="cannot finish while parked"),
            scheduler.paused(timeout=1, wait_for_active_tasks=True),
        ):
            pass
    assert not scheduler.statistics().parked
    assert scheduler.statistics().admission_open


# -- the admission race ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("unsafe", [False, True], ids=["gated", "check_then_act"])
def test_no_task_starts_inside_a_pause(unsafe: bool) -> None:
    """Force the window between "decided to admit" and "admitted" with an event-controlled hook,
    and pause inside it. Gated admission: the pause waits for the admission's step, and nothing
    starts inside it. The check-then-act variant (the classic bug) starts the task inside."""
    config = tiny_config()
    backend = TorchLMStreamBackend(config)
    in_window, proceed, body_release = threading.Event(), threading.Event(), threading.Event()

    def hook(request_id: int) -> None:
        in_window.set()
        assert proceed.wait(10)

    scheduler_class = CheckThenActScheduler if unsafe else RolloutTaskScheduler
    scheduler = scheduler_class(backend, gate=backend.generation_gate, admission_hook=hook)
    entered = threading.Event()

    def pause_body() -> tuple[int, int, int]:
        with scheduler.paused(timeout=10):
            entered.set()
            before = scheduler.statistics().admitted
            assert body_release.wait(10)
            after = scheduler.statistics().admitted
            backend.load_weights(weights_of(config, 1))
            backend.commit_weight_version(1)
            return before, after, scheduler.statistics().steps

    scheduler.put([1, 2, 3], max_new_tokens=2)
    scheduler.start()
    try:
        assert in_window.wait(10)
        pausing = Runner(pause_body, "pause")
        wait_until(
            lambda: entered.is_set() or backend.generation_gate.statistics().exclusive_waiting > 0,
            10,
            "the pause to be entered or waiting",
        )
        proceed.set()
        wait_until(lambda: scheduler.statistics().admitted == 1, 10, "the admission")
        body_release.set()
        before, after, steps_inside = pausing.join()
        result = scheduler.get(timeout=20)
    finally:
        proceed.set()
        body_release.set()
        scheduler.stop()
    if unsafe:
        assert (before, after) == (0, 1), "the race did not reproduce"
        assert steps_inside == 0, "the task started, but its forward still waited for the gate"
        # Its version stamp is the old weights', yet every token came from the new ones.
        assert result.admitted_weight_version == 0
        assert result.token_weight_versions == (1, 1)
    else:
        assert (before, after) == (1, 1), "a task was admitted inside the pause"
        assert steps_inside == 1, "the admitting step finished before the pause parked"
        assert result.admitted_weight_version == 0
        assert result.token_weight_versions == (0, 1) and result.straddled_sync


@pytest.mark.timeout(10)
def test_pausing_from_the_stepping_thread_is_refused_and_the_request_is_kept() -> None:
    backend = TorchLMStreamBackend(tiny_config())

    def hook(request_id: int) -> None:
        with scheduler.paused(timeout=1):
            pass

    scheduler = RolloutTaskScheduler(backend, gate=backend.generation_gate, admission_hook=hook)
    scheduler.put([1, 2], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="own stepping thread"):
        scheduler.step()
    stats = scheduler.statistics()
    assert (stats.queued, stats.active, stats.parked) == (1, 0, False)


# -- nothing lost ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pausing_while_nobody_collects_results_completes_and_loses_nothing() -> None:
    config = tiny_config()
    backend = TorchLMStreamBackend(config, max_concurrent=3)
    worker = SyncWorker(backend)
    rng = random.Random(7)
    backend.start()
    try:
        early = backend.put([5, 5, 5], max_new_tokens=2)
        wait_until(
            lambda: backend.scheduler.statistics().results_waiting == 1, 20, "the early result"
        )
        ids = {early} | {
            backend.put(
                [rng.randrange(48) for _ in range(rng.randint(1, 6))],
                max_new_tokens=rng.randint(1, 25),
            )
            for _ in range(8)
        }
        for version in range(1, 6):
            worker.receive_weights(version, weights_of(config, version))
        backend.scheduler.wait_idle(30)
    finally:
        backend.stop()
    results = _by_id(backend.get_all())
    assert results.keys() == ids
    assert all(r.ok for r in results.values())
    assert results[early].completed_weight_version == 0 and not results[early].straddled_sync
    assert backend.torn_forwards == 0


@pytest.mark.timeout(30)
def test_a_failing_task_is_a_failed_result_and_its_batch_carries_on() -> None:
    def reward_model_hook(context: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(context) >= 5:
            raise ValueError("logits processor exploded")
        return logits

    backend = TorchLMStreamBackend(tiny_config())
    scheduler = backend.scheduler
    bad = scheduler.put(
        GenerationRequest((1, 2, 3), 6, SamplingParams(logits_processor=reward_model_hook))
    )
    good = scheduler.put([1, 2, 3], max_new_tokens=6)
    _drive_until_idle(scheduler)
    results = _by_id(scheduler.get_all())
    failed, ok = results[bad], results[good]
    assert failed.finish_reason is FinishReason.ERROR and not failed.ok
    assert failed.error == "ValueError: logits processor exploded"
    assert isinstance(failed.exception, ValueError)
    assert len(failed.tokens) == 2, "tokens made before the failure are kept"
    assert ok.ok and len(ok.tokens) == 6
    assert ok.tokens[:2] == failed.tokens
    assert scheduler.statistics().failed == 1


class _FlakyEngine:
    """A DecodeEngine whose second batched forward dies (a lost device, say)."""

    weight_version = 0
    weights_epoch = 0
    weights_torn = False

    def __init__(self) -> None:
        self.steps = 0

    def validate_request(self, request: GenerationRequest) -> None:
        pass

    def decode_step(self, sequences: Sequence[SequenceState]) -> None:
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("device lost")
        for seq in sequences:
            seq.append_token(7, 0.0, self.weight_version)


def test_a_batch_wide_failure_fails_each_task_with_the_error() -> None:
    scheduler = RolloutTaskScheduler(_FlakyEngine())
    ids = {scheduler.put([1], max_new_tokens=5), scheduler.put([2], max_new_tokens=5)}
    scheduler.step()
    report = scheduler.step()
    assert report.finished == 2
    results = _by_id(scheduler.get_all())
    assert results.keys() == ids
    for r in results.values():
        assert r.finish_reason is FinishReason.ERROR
        assert r.error == "RuntimeError: device lost" and r.tokens == (7,)


@pytest.mark.timeout(30)
def test_stop_turns_unfinished_work_into_cancelled_results() -> None:
    backend = TorchLMStreamBackend(tiny_config(), max_concurrent=2)
    ids = {backend.put([1, 2], max_new_tokens=50) for _ in range(3)}
    blocker = _Blocker(n=3)
    backend.layer_hook = blocker
    backend.start()
    assert blocker.holding.wait(10)
    stopping = Runner(backend.stop, "stop")
    wait_until(lambda: not backend.scheduler.statistics().admission_open, 10, "stop to begin")
    blocker.release.set()
    stopping.join(30)
    results = _by_id(backend.get_all())
    assert results.keys() == ids
    cancelled = [r for r in results.values() if r.finish_reason is FinishReason.CANCELLED]
    assert cancelled and all(r.error and "stopped" in r.error for r in cancelled)
    assert any(r.tokens for r in cancelled), "partial tokens are kept"
    with pytest.raises(RuntimeError, match="stopped"):
        backend.put([1])
    with pytest.raises(RuntimeError, match="already started"):
        backend.scheduler.start()


@pytest.mark.timeout(30)
def test_stop_with_finish_active_completes_everything_first() -> None:
    backend = TorchLMStreamBackend(tiny_config(), max_concurrent=2)
    ids = {backend.put([1, 2], max_new_tokens=8) for _ in range(4)}
    backend.start()
    backend.stop(timeout=20, finish_active=True)
    results = _by_id(backend.get_all())
    assert results.keys() == ids and all(r.ok for r in results.values())


@pytest.mark.timeout(30)
def test_a_stop_that_gives_up_on_a_parked_thread_still_strands_nothing() -> None:
    backend = TorchLMStreamBackend(tiny_config())
    scheduler = backend.scheduler
    rid = backend.put([1, 2], max_new_tokens=50)
    backend.start()
    try:
        wait_until(lambda: scheduler.statistics().tokens >= 1, 20, "decoding")
        with (
            scheduler.paused(timeout=10),
            pytest.raises(SchedulerTimeout, match="parked by a pause"),
        ):
            scheduler.stop(timeout=0.2)
        result = scheduler.get(timeout=20)
    finally:
        scheduler.stop()
    assert result.request_id == rid and result.finish_reason is FinishReason.CANCELLED
    assert not scheduler.running


@pytest.mark.timeout(30)
def test_drain_on_pause_makes_the_guard_drain() -> None:
    config = tiny_config()
    backend = TorchLMStreamBackend(config, drain_on_pause=True)
    worker = SyncWorker(backend)
    first = backend.put([1, 2, 3], max_new_tokens=12)
    backend.start()
    try:
        wait_until(lambda: backend.scheduler.statistics().tokens >= 1, 20, "decoding")
        inside: list[SchedulerStatistics] = []
        worker.inside = lambda: inside.append(backend.scheduler.statistics())
        worker.receive_weights(1, weights_of(config, 1))
        result = backend.scheduler.get(timeout=20)
    finally:
        backend.stop()
    assert worker.reports[-1].paused
    assert [s.active for s in inside] == [0]
    assert result.request_id == first and not result.straddled_sync
    assert result.token_weight_versions == (0,) * 12
    assert backend.scheduler.statistics().drains == 1


def test_stop_before_start_cancels_the_queue_and_result_waits_are_bounded() -> None:
    scheduler = RolloutTaskScheduler(_FlakyEngine())
    rid = scheduler.put([1])
    with pytest.raises(WouldBlock):
        scheduler.get_nowait()
    with pytest.raises(SchedulerTimeout, match=r"no generation result within 0\.2 s"):
        scheduler.get(timeout=0.2)
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.wait_idle(timeout=0.2)
    scheduler.stop()
    (result,) = scheduler.get_all()
    assert result.request_id == rid and result.finish_reason is FinishReason.CANCELLED
    assert "stopped" in repr(scheduler)


def test_bad_requests_are_refused_at_put() -> None:
    backend = TorchLMStreamBackend(tiny_config())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.put([1, 4800])
    assert backend.scheduler.statistics().queued == 0


def test_statistics_and_repr_summarise_live_state() -> None:
    backend = TorchLMStreamBackend(tiny_config(), max_concurrent=1)
    scheduler = backend.scheduler
    scheduler.put([1], max_new_tokens=3)
    scheduler.put([2], max_new_tokens=3)
    scheduler.step()
    assert repr(scheduler) == (
        "<RolloutTaskScheduler 'generation' not started: 1 active, 1 queued, 0 results waiting>"
    )
    with scheduler.paused():
        assert "parked" in repr(scheduler)
    s = scheduler.statistics()
    assert (s.admitted, s.steps, s.tokens, s.pauses, s.max_concurrent) == (1, 1, 1, 1, 1)


# -- real threads, guard on and off ------------------------------------------------------------


def _wait_for_step_after(backend: TorchLMStreamBackend, steps: int) -> None:
    wait_until(
        lambda: backend.scheduler.statistics().steps > steps, 10, "a decode step between two syncs"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_stream_generation_racing_syncs_on_real_threads(guarded: bool) -> None:
    config = tiny_config()
    timeline = Timeline()
    backend = TorchLMStreamBackend(config, max_concurrent=4, timeline=timeline)

    def widen(index: int) -> None:
        time.sleep(50e-6)  # widens the race window between blocks on purpose

    backend.layer_hook = widen
    worker = SyncWorker(backend, timeline)
    sync = worker.receive_weights if guarded else worker.receive_weights_unguarded
    weight_sets = [weights_of(config, 1), weights_of(config, 2)]
    rng = random.Random(3)
    backend.start()
    try:
        for version in range(1, 151):
            if backend.scheduler.statistics().queued < 4:
                for _ in range(4):
                    backend.put(
                        [rng.randrange(48) for _ in range(rng.randint(1, 8))],
                        max_new_tokens=rng.randint(4, 40),
                    )
            steps = backend.scheduler.statistics().steps
            sync(version, weight_sets[version % 2])
            if not guarded and backend.torn_forwards:
                break
            # Let generation take at least one step before the next sync: back-to-back syncs
            # would otherwise keep the gate closed and the race would never be exercised.
            _wait_for_step_after(backend, steps)
    finally:
        backend.stop(timeout=30, finish_active=guarded)
    forward_writes = [o for o in timeline.overlaps() if o.first.kind == SpanKind.FORWARD]
    if guarded:
        results = backend.get_all()
        assert backend.torn_forwards == 0 and forward_writes == []
        assert results and all(r.ok for r in results)
        assert any(r.straddled_sync for r in results)
    else:
        assert backend.torn_forwards > 0, "the unguarded run never tore a read: harness too weak"
        assert forward_writes
