"""Measuring weight syncs: timers that never stall the host, and summaries for reports.

* :class:`WeightSyncTimer` brackets a sync with CUDA events and harvests the sample later, once
  ``Event.query()`` says it is complete (or, for host-synchronous transfers, with
  ``perf_counter``).
* :func:`percentile` and :func:`summarize` turn lists of durations into p50/p99 for reports;
  they are free of any clock: callers measure, they summarise.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import HarvestTimeout

__all__ = [
    "DurationSummary",
    "Measurement",
    "TimedSample",
    "TimerClock",
    "TimerStatistics",
    "TimingEvent",
    "WeightSyncTimer",
    "cuda_timing_event",
    "percentile",
    "summarize",
]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class DurationSummary:
    """p50/p99/max/mean of durations, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float


def summarize(durations_s: Sequence[float]) -> DurationSummary:
    """Summarise durations given in seconds."""
    ms = [d * 1e3 for d in durations_s]
    return DurationSummary(
        count=len(ms),
        p50_ms=percentile(ms, 50),
        p99_ms=percentile(ms, 99),
        max_ms=max(ms, default=math.nan),
        mean_ms=sum(ms) / len(ms) if ms else math.nan,
    )


# -- timers ------------------------------------------------------------------------------------


@runtime_checkable
class TimingEvent(Protocol):
    """What the timer needs of a device event: the interface of ``torch.cuda.Event``.

    ``elapsed_time`` may only be called once both events are complete; a CUDA event raises
    otherwise. The timer guarantees it by asking ``query()`` first, and never calls a method
    that waits (``synchronize``, ``wait``).
    """

    def record(self) -> None:
        """Enqueue the event on the current stream; it completes when the work before it does."""

    def query(self) -> bool:
        """True once the work before the recorded event has completed. Never blocks."""

    def elapsed_time(self, end_event: Any, /) -> float:
        """Milliseconds from this event to ``end_event``; both must be complete."""


class TimerClock(enum.Enum):
    """What a :class:`WeightSyncTimer` measures with."""

    PERF_COUNTER = "perf_counter"
    """Host wall time around the body; for work that is complete when the body returns
    (CPU tensors, gloo collectives). The sample is ready at once."""
    CUDA_EVENTS = "cuda_events"
    """A pair of device events around the body; the sample is ready once the device has run
    past the end event, which :meth:`WeightSyncTimer.harvest` notices without waiting."""


@dataclass(frozen=True)
class TimedSample:
    """One measured sync."""

    tag: int
    """What the caller passed to :meth:`WeightSyncTimer.measure` (the training step, say)."""
    elapsed_ms: float
    nbytes: int = 0
    """Bytes moved, as set on the :class:`Measurement` (0 if nobody said)."""


@dataclass
class Measurement:
    """Yielded by :meth:`WeightSyncTimer.measure`; set ``nbytes`` once the body knows it."""

    tag: int
    nbytes: int = 0
    timed: bool = True
    """False when the timer had to skip this one (see ``max_pending``); nothing is recorded."""


@dataclass(frozen=True)
class TimerStatistics:
    """Counters of a :class:`WeightSyncTimer`."""

    clock: TimerClock
    measured: int
    """Bodies that completed and were recorded (harvested or still pending)."""
    harvested: int
    pending: int
    """Recorded on the device, end event not yet complete."""
    event_pairs: int
    """Event pairs alive: pending, inside a body, or kept for reuse. 0 on the perf_counter clock
    and before the first measurement."""
    skipped: int
    """Bodies that completed untimed because ``max_pending`` samples were already
    outstanding."""
    failed: int
    """Bodies that raised, timed or skipped; their samples are discarded."""


@dataclass
class _EventPair:
    start: TimingEvent
    end: TimingEvent


@dataclass
class _Pending:
    pair: _EventPair
    tag: int
    nbytes: int


def cuda_timing_event() -> TimingEvent:
    """The default event factory: ``torch.cuda.Event(enable_timing=True)``."""
    event: TimingEvent = torch.cuda.Event(enable_timing=True)
    return event


class WeightSyncTimer:
    """Times weight syncs without ever stalling the host.

    On the CUDA clock, :meth:`measure` records a start event before its body and an end event
    after it, and moves on: the device is still doing the work. :meth:`harvest`, called any time
    later (the next step, say), asks the oldest pending end event ``query()`` and reads
    ``elapsed_time`` only once it reports complete; it stops at the first incomplete one, so
    samples come out in the order they were measured. Nothing here synchronizes the device:
    no ``torch.cuda.synchronize()``, no ``Event.synchronize()``, no ``.item()``.

    Event pairs come from a pool, constructed on first use and reused once harvested, so a
    harvest that lags several syncs loses no sample: each pending sync keeps its own pair.
    The pool grows on demand up to ``max_pending`` pairs; past that (the device is hopelessly
    behind, or nobody harvests) a body runs untimed and is counted in ``skipped``.

    **What the end event captures.** It is recorded on the current stream after the body
    returns. A ``torch.distributed`` collective run with ``async_op=False`` (or whose work
    object the body ``wait()`` s) orders the current stream after the collective, so the end
    event completes only when the transfer has; the sample is the device-side duration of
    gather + push. Work the body leaves running on another stream, un-waited, is not captured.

    On the perf_counter clock (CPU tensors, gloo: the body returns when the work is done) the
    sample is the host wall time of the body and is ready at once; no deferral is needed.

    A disabled timer is no timer: callers that do not time simply do not construct one.

    Not meant to be shared between threads that measure concurrently; bookkeeping is guarded by
    a lock, so a harvest from another thread (a logger) is safe.

    Args:
        clock: what to measure with.
        event_factory: builds one event (CUDA clock only); default
            :func:`cuda_timing_event`. Injectable so tests drive the real state machine with fake
            events.
        pool_size: event pairs to keep for reuse once harvested.
        max_pending: most samples outstanding at once; ``pool_size`` <= ``max_pending``.
    """

    def __init__(
        self,
        clock: TimerClock = TimerClock.PERF_COUNTER,
        *,
        event_factory: Callable[[], TimingEvent] | None = None,
        pool_size: int = 4,
        max_pending: int = 256,
    ) -> None:
        if pool_size < 1 or max_pending < pool_size:
            raise ValueError(
                f"need 1 <= pool_size <= max_pending, got pool_size={pool_size}, "
                f"max_pending={max_pending}"
            )
        if event_factory is not None and clock is not TimerClock.CUDA_EVENTS:
            raise ValueError("event_factory only applies to TimerClock.CUDA_EVENTS")
        self.clock = clock
        self._event_factory = event_factory if event_factory is not None else cuda_timing_event
        self.pool_size = pool_size
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._free: list[_EventPair] = []
        self._pending: deque[_Pending] = deque()
        self._ready: list[TimedSample] = []
        self._event_pairs = 0
        self._measured = 0
        self._harvested = 0
        self._skipped = 0
        self._failed = 0

    @classmethod
    def for_backend(cls, backend: str | None, **kwargs: Any) -> WeightSyncTimer:
        """The timer for a transfer over a ``torch.distributed`` backend.

        ``"nccl"`` moves CUDA tensors on a stream: CUDA events. Anything else (``"gloo"``,
        ``None`` for an in-process push) is synchronous on the host: perf_counter.
        """
        if backend is not None and str(backend).lower() == "nccl":
            return cls(TimerClock.CUDA_EVENTS, **kwargs)
        return cls(TimerClock.PERF_COUNTER, **kwargs)

    # -- measuring -----------------------------------------------------------------------------

    @contextmanager
    def measure(self, tag: int = 0, *, nbytes: int = 0) -> Iterator[Measurement]:
        """Time the ``with`` body as one sample tagged ``tag``.

        Never blocks. If the body raises, its sample is discarded (counted in ``failed``, also
        when it ran untimed) and the error propagates.
        """
        measurement = Measurement(tag=tag, nbytes=nbytes)
        pair = None if self.clock is TimerClock.PERF_COUNTER else self._acquire_pair()
        if self.clock is TimerClock.CUDA_EVENTS and pair is None:
            measurement.timed = False
        start = time.perf_counter()
        if pair is not None:
            pair.start.record()
        try:
            yield measurement
        except BaseException:
            with self._lock:
                self._failed += 1  # timed or not, its sample is discarded
                if pair is not None:
                    self._free.append(pair)
            raise
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if pair is not None:
            pair.end.record()
        with self._lock:
            if pair is not None:
                self._measured += 1
                self._pending.append(_Pending(pair, tag, measurement.nbytes))
            elif measurement.timed:
                self._measured += 1
                self._ready.append(TimedSample(tag, elapsed_ms, measurement.nbytes))
            else:
                self._skipped += 1

    def _acquire_pair(self) -> _EventPair | None:
        """A free event pair, a new one, or None when ``max_pending`` are outstanding."""
        with self._lock:
            if not self._free:
                self._collect_locked()
            if self._free:
                return self._free.pop()
            if self._event_pairs >= self.max_pending:
                return None
            self._event_pairs += 1
        # Constructing events touches no device work; done outside the lock all the same.
        return _EventPair(self._event_factory(), self._event_factory())

    # -- harvesting ----------------------------------------------------------------------------

    def harvest(self) -> list[TimedSample]:
        """The samples completed since the last harvest, oldest first. Never blocks.

        On the CUDA clock a sample whose end event is not complete yet stays pending and comes
        out of a later harvest.
        """
        with self._lock:
            self._collect_locked()
            ready, self._ready = self._ready, []
            self._harvested += len(ready)
            return ready

    def drain(self, timeout: float) -> list[TimedSample]:
        """Harvest, waiting up to ``timeout`` seconds for every pending sample to complete.

        The one place the timer waits, for the end of training: it polls ``query()`` (never a
        synchronize), so the wait is bounded. Raises :class:`HarvestTimeout` naming how many
        samples were still pending; those stay pending, and the samples already complete are
        kept for the next harvest.
        """
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while True:
            with self._lock:
                self._collect_locked()
                pending = len(self._pending)
            if not pending:
                return self.harvest()
            if time.monotonic() >= deadline:
                raise HarvestTimeout(
                    f"weight-sync timer: {pending} sample(s) still pending after {timeout:.1f} s "
                    "(the device has not run past their end events; is a collective stuck?)",
                    timeout=timeout,
                    pending=pending,
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _collect_locked(self) -> None:
        """Move the completed prefix of the pending queue to ready; recycle its event pairs."""
        pending = self._pending
        while pending:
            oldest = pending[0]
            # Both events are asked: the body may have switched streams, and then the start
            # event's completion does not follow from the end event's.
            if not (oldest.pair.end.query() and oldest.pair.start.query()):
                return
            pending.popleft()
            elapsed_ms = float(oldest.pair.start.elapsed_time(oldest.pair.end))
            self._ready.append(TimedSample(oldest.tag, elapsed_ms, oldest.nbytes))
            if len(self._free) < self.pool_size:
                self._free.append(oldest.pair)
            else:
                self._event_pairs -= 1

    # -- introspection -------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Samples recorded on the device whose end event was not complete at the last look."""
        return len(self._pending)

    def statistics(self) -> TimerStatistics:
        with self._lock:
            return TimerStatistics(
                clock=self.clock,
                measured=self._measured,
                harvested=self._harvested,
                pending=len(self._pending),
                event_pairs=self._event_pairs,
                skipped=self._skipped,
                failed=self._failed,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<WeightSyncTimer {s.clock.value}: {s.pending} pending, {s.harvested} harvested, "
            f"{s.event_pairs} event pairs>"
        )
