"""A timeline of forwards, payload transfers and weight syncs, and the checker that reads it.

The guard's claims are about time: no forward overlaps a weight write, no payload transfer
overlaps a weight collective. A :class:`Timeline` records spans on any thread (and, merged, from
several processes: timestamps are ``time.monotonic_ns``, one clock for the whole machine), the
checker lists every forbidden overlap, and :meth:`Timeline.to_chrome_trace` writes JSON that
chrome://tracing and https://ui.perfetto.dev open as is.

Recording is optional everywhere: code takes ``timeline: Timeline | None`` and does nothing when
it is ``None``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORBIDDEN_OVERLAPS",
    "Overlap",
    "Span",
    "SpanKind",
    "Timeline",
    "find_overlaps",
    "step_intervals_ms",
]


class SpanKind:
    """The span kinds the checker knows. Other kinds may be recorded and are exported as is."""

    FORWARD = "forward"
    WEIGHT_WRITE = "weight_write"
    WEIGHT_COLLECTIVE = "weight_collective"
    PAYLOAD_SEND = "payload_send"
    PAYLOAD_RECV = "payload_recv"
    PAUSE = "pause"
    SYNC = "weight_sync"
    """The body of a guarded sync (after pause and egress hold, before release)."""


FORBIDDEN_OVERLAPS: tuple[tuple[str, str], ...] = (
    (SpanKind.FORWARD, SpanKind.WEIGHT_WRITE),
    (SpanKind.PAYLOAD_SEND, SpanKind.WEIGHT_COLLECTIVE),
    (SpanKind.PAYLOAD_RECV, SpanKind.WEIGHT_COLLECTIVE),
    (SpanKind.PAYLOAD_SEND, SpanKind.SYNC),
    (SpanKind.PAYLOAD_RECV, SpanKind.SYNC),
)
"""Pairs of kinds that must never overlap in time within one process."""


@dataclass(frozen=True)
class Span:
    """One recorded interval. Times are ``time.monotonic_ns()`` values."""

    kind: str
    name: str
    start_ns: int
    end_ns: int
    pid: int
    tid: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class Overlap:
    """Two spans of a forbidden pair whose intervals intersect."""

    first: Span
    second: Span

    def __str__(self) -> str:
        a, b = self.first, self.second
        both = (min(a.end_ns, b.end_ns) - max(a.start_ns, b.start_ns)) / 1e6
        return f"{a.kind} {a.name!r} overlaps {b.kind} {b.name!r} by {both:.3f} ms (pid {a.pid})"


class Timeline:
    """A thread-safe recorder of :class:`Span` s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    @contextmanager
    def span(self, kind: str, name: str = "", **args: Any) -> Iterator[None]:
        """Record the time the ``with`` body takes as one span (also when it raises)."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.add_span(kind, name or kind, start, **args)

    def add_span(self, kind: str, name: str, start_ns: int, **args: Any) -> None:
        """Record a span that started at ``start_ns`` (``time.monotonic_ns()``) and ends now."""
        self.add(
            Span(
                kind, name, start_ns, time.monotonic_ns(), os.getpid(), threading.get_ident(), args
            )
        )

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    def extend(self, spans: Iterable[Span]) -> None:
        """Merge spans recorded elsewhere (another process's :meth:`to_records`)."""
        with self._lock:
            self._spans.extend(spans)

    def spans(self, kind: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if kind is None or s.kind == kind]

    def __len__(self) -> int:
        return len(self._spans)

    def overlaps(self, pairs: Sequence[tuple[str, str]] = FORBIDDEN_OVERLAPS) -> list[Overlap]:
        """Every forbidden overlap in this timeline; see :func:`find_overlaps`."""
        return find_overlaps(self.spans(), pairs)

    def to_records(self) -> list[dict[str, Any]]:
        """Plain dicts (picklable, JSON-able) for shipping spans between processes."""
        return [asdict(s) for s in self.spans()]

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]]) -> Timeline:
        timeline = cls()
        timeline.extend(Span(**r) for r in records)
        return timeline

    def to_chrome_trace(self) -> dict[str, Any]:
        """The Chrome/Perfetto trace-event form: complete ("X") events, microseconds."""
        spans = self.spans()
        origin = min((s.start_ns for s in spans), default=0)
        events = [
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": (s.start_ns - origin) / 1e3,
                "dur": (s.end_ns - s.start_ns) / 1e3,
                "pid": s.pid,
                "tid": s.tid,
                "args": s.args,
            }
            for s in spans
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.write_text(json.dumps(self.to_chrome_trace()))
        return out


def find_overlaps(
    spans: Iterable[Span], pairs: Sequence[tuple[str, str]] = FORBIDDEN_OVERLAPS
) -> list[Overlap]:
    """Every pair of spans of a forbidden kind pair, in the same process, that intersect.

    Intervals are half-open: a span that starts exactly when another ends does not overlap it.
    """
    by_key: dict[tuple[int, str], list[Span]] = {}
    for s in spans:
        by_key.setdefault((s.pid, s.kind), []).append(s)
    found: list[Overlap] = []
    pids = {pid for pid, _ in by_key}
    for pid in sorted(pids):
        for kind_a, kind_b in pairs:
            found.extend(
                _intersections(by_key.get((pid, kind_a), []), by_key.get((pid, kind_b), []))
            )
    return found


def _intersections(a: list[Span], b: list[Span]) -> Iterator[Overlap]:
    """Sweep both lists by start time; yields each intersecting (a, b) pair once."""
    a = sorted(a, key=lambda s: s.start_ns)
    b = sorted(b, key=lambda s: s.start_ns)
    j0 = 0
    for x in a:
        # a is sorted by start, so a span of b that ends before this x ends before every later x.
        while j0 < len(b) and b[j0].end_ns <= x.start_ns:
            j0 += 1
        j = j0
        while j < len(b) and b[j].start_ns < x.end_ns:
            if b[j].end_ns > x.start_ns:
                yield Overlap(x, b[j])
            j += 1


def step_intervals_ms(forwards: Iterable[Span], *, gaps: Iterable[Span] = ()) -> list[float]:
    """An engine's decode step, sampled: the time between the starts of consecutive
    ``forwards`` of one process, in milliseconds, leaving out every interval that contains a
    ``gaps`` span of the same process (a pause: the engine was held, not stepping)."""
    starts: dict[int, list[int]] = {}
    for span in forwards:
        starts.setdefault(span.pid, []).append(span.start_ns)
    held: dict[int, list[tuple[int, int]]] = {}
    for gap in gaps:
        held.setdefault(gap.pid, []).append((gap.start_ns, gap.end_ns))
    intervals: list[float] = []
    for pid, times in starts.items():
        times.sort()
        gaps_here = held.get(pid, [])
        for a, b in itertools.pairwise(times):
            if not any(lo < b and a < hi for lo, hi in gaps_here):
                intervals.append((b - a) / 1e6)
    return intervals
