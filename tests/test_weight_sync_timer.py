"""WeightSyncTimer: the deferred CUDA-event state machine (on a fake device) and perf_counter."""

from __future__ import annotations

import time

import pytest

from rollout_sync import WeightSyncTimer
from rollout_sync.errors import HarvestTimeout
from rollout_sync.metrics import TimedSample, TimerClock
from rollout_sync.testing import FakeCudaStream


def _fake_timer(stream: FakeCudaStream, **kwargs: int) -> WeightSyncTimer:
    return WeightSyncTimer(TimerClock.CUDA_EVENTS, event_factory=stream.event, **kwargs)


def test_the_fake_refuses_an_early_elapsed_time() -> None:
    """The fake has teeth: reading a pair before the device ran past it raises, as CUDA does.

    So a timer that read its samples eagerly would fail the lag tests below.
    """
    stream = FakeCudaStream()
    start, end = stream.event(), stream.event()
    start.record()
    stream.work(3.0)
    end.record()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    assert stream.early_elapsed_time_calls == 1
    stream.complete_all()
    assert start.elapsed_time(end) == 3.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lag", [0, 1, 3, 7])
@pytest.mark.parametrize("pool_size", [1, 4])
def test_harvest_waits_for_the_end_event_and_loses_nothing(lag: int, pool_size: int) -> None:
    """The end event stays incomplete for ``lag`` steps: samples come out late, exact, in order."""
    stream = FakeCudaStream()
    timer = _fake_timer(stream, pool_size=pool_size)
    steps = 25
    durations = [0.25 + 1.5 * i for i in range(steps)]
    recorded_after: list[int] = []
    harvested: list[TimedSample] = []

    for step, duration in enumerate(durations):
        with timer.measure(step, nbytes=100 + step) as m:
            assert m.timed
            stream.work(duration)
        # Work between two syncs (the next training step) does not belong to any sample.
        stream.work(1000.0)
        recorded_after.append(stream.recorded)
        if step - lag >= 0:
            stream.complete_until(recorded_after[step - lag])
        got = timer.harvest()
        # Exactly the syncs the device has run past, no more, no fewer.
        assert [s.tag for s in got] == ([step - lag] if step >= lag else [])
        assert timer.pending == min(step + 1, lag)
        harvested += got

    stream.complete_all()
    harvested += timer.harvest()

    assert [s.tag for s in harvested] == list(range(steps))
    assert [s.elapsed_ms for s in harvested] == durations
    assert [s.nbytes for s in harvested] == [100 + i for i in range(steps)]
    assert stream.early_elapsed_time_calls == 0
    assert stream.waits == 0
    stats = timer.statistics()
    assert (stats.measured, stats.harvested, stats.pending, stats.skipped) == (steps, steps, 0, 0)
    if lag + 1 <= pool_size:
        # Pairs are reused: one per sync in flight, never more.
        assert stream.events_created == 2 * (lag + 1)


@pytest.mark.timeout(30)
def test_harvest_never_blocks_and_never_synchronizes() -> None:
    """With the device stuck, harvest returns at once, every time, with nothing."""
    stream = FakeCudaStream()
    timer = _fake_timer(stream)
    for step in range(5):
        with timer.measure(step):
            stream.work(1.0)
    started = time.perf_counter()
    for _ in range(100):
        assert timer.harvest() == []
    assert time.perf_counter() - started < 1.0
    assert timer.pending == 5
    assert stream.waits == 0 and stream.early_elapsed_time_calls == 0


def test_a_pair_is_read_only_when_both_events_are_complete() -> None:
    """The body may switch streams; then the end completing says nothing of the start."""
    stream, other = FakeCudaStream(), FakeCudaStream()
    events = iter([other.event(), stream.event()])
    timer = WeightSyncTimer(TimerClock.CUDA_EVENTS, event_factory=lambda: next(events))
    with timer.measure(7):
        stream.work(2.0)
    stream.complete_all()
    assert timer.harvest() == []
    assert stream.early_elapsed_time_calls == other.early_elapsed_time_calls == 0
    other.complete_all()
    assert [s.tag for s in timer.harvest()] == [7]


def test_past_max_pending_a_sync_runs_untimed_and_is_counted() -> None:
    stream = FakeCudaStream()
    timer = _fake_timer(stream, pool_size=2, max_pending=3)
    timed = []
    for step in range(5):
        with timer.measure(step) as m:
            stream.work(1.0)
        timed.append(m.timed)
    assert timed == [True, True, True, False, False]
    stats = timer.statistics()
    assert (stats.measured, stats.skipped, stats.event_pairs) == (3, 2, 3)
    # A skipped body that raises is a failure, not a skip.
    with pytest.raises(ValueError, match="boom"), timer.measure(5) as m:
        assert not m.timed
        raise ValueError("boom")
    stats = timer.statistics()
    assert (stats.measured, stats.skipped, stats.failed) == (3, 2, 1)
    stream.complete_all()
    assert [s.tag for s in timer.harvest()] == [0, 1, 2]
    # Harvested pairs beyond pool_size are dropped, not kept.
    assert timer.statistics().event_pairs == 2


def test_a_body_that_raises_discards_its_sample_and_returns_the_pair() -> None:
    stream = FakeCudaStream()
    timer = _fake_timer(stream, pool_size=1)
    with pytest.raises(ValueError, match="boom"), timer.measure(0):
        raise ValueError("boom")
    with timer.measure(1):
        stream.work(4.0)
    stream.complete_all()
    assert [(s.tag, s.elapsed_ms) for s in timer.harvest()] == [(1, 4.0)]
    stats = timer.statistics()
    assert (stats.failed, stats.measured, stats.event_pairs) == (1, 1, 1)
    assert stream.events_created == 2


@pytest.mark.timeout(30)
def test_drain_polls_query_until_complete() -> None:
    stream = FakeCudaStream()
    timer = _fake_timer(stream)
    for step in range(3):
        with timer.measure(step):
            stream.work(float(step + 1))
    stream.complete_after_queries = stream.queries + 10
    samples = timer.drain(timeout=10.0)
    assert [(s.tag, s.elapsed_ms) for s in samples] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert stream.waits == 0 and stream.early_elapsed_time_calls == 0


@pytest.mark.timeout(30)
def test_drain_is_bounded_and_says_what_is_pending() -> None:
    stream = FakeCudaStream()
    timer = _fake_timer(stream)
    with timer.measure(0):
        stream.work(1.0)
    started = time.monotonic()
    with pytest.raises(HarvestTimeout, match=r"1 sample\(s\) still pending after 0\.1 s") as info:
        timer.drain(timeout=0.1)
    assert time.monotonic() - started < 5.0
    assert info.value.pending == 1 and info.value.timeout == 0.1
    stream.complete_all()
    assert [s.tag for s in timer.harvest()] == [0]


def test_nothing_is_constructed_before_the_first_measurement() -> None:
    stream = FakeCudaStream()
    timer = _fake_timer(stream)
    assert timer.harvest() == []
    assert stream.events_created == 0
    assert "0 pending" in repr(timer)


def test_perf_counter_clock_is_ready_at_once() -> None:
    timer = WeightSyncTimer(TimerClock.PERF_COUNTER)
    with timer.measure(3, nbytes=64) as m:
        # The body being measured: a known lower bound for the sample.
        time.sleep(0.02)  # on purpose: the measured body, a known lower bound
        m.nbytes = 128
    (sample,) = timer.harvest()
    assert sample.tag == 3 and sample.nbytes == 128
    assert 20.0 <= sample.elapsed_ms < 5000.0
    assert timer.pending == 0 and timer.statistics().event_pairs == 0


def test_for_backend_picks_the_clock() -> None:
    assert WeightSyncTimer.for_backend("nccl").clock is TimerClock.CUDA_EVENTS
    assert WeightSyncTimer.for_backend("gloo").clock is TimerClock.PERF_COUNTER
    assert WeightSyncTimer.for_backend(None).clock is TimerClock.PERF_COUNTER


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="pool_size"):
        WeightSyncTimer(TimerClock.CUDA_EVENTS, pool_size=8, max_pending=4)
    with pytest.raises(ValueError, match="event_factory"):
        WeightSyncTimer(TimerClock.PERF_COUNTER, event_factory=FakeCudaStream().event)


class _EagerTimer(WeightSyncTimer):
    """The timer with its guard removed: reads every pending pair without asking query()."""

    def _collect_locked(self) -> None:
        while self._pending:
            oldest = self._pending.popleft()
            elapsed = oldest.pair.start.elapsed_time(oldest.pair.end)
            self._ready.append(TimedSample(oldest.tag, elapsed, oldest.nbytes))


def test_without_the_query_guard_the_lag_test_fails() -> None:
    """The state machine's query() check is what the lag test exercises: remove it, it breaks."""
    stream = FakeCudaStream()
    timer = _EagerTimer(TimerClock.CUDA_EVENTS, event_factory=stream.event)
    with timer.measure(0):
        stream.work(1.0)
    with pytest.raises(RuntimeError, match="not ready"):
        timer.harvest()
    assert stream.early_elapsed_time_calls == 1
