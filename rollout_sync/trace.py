"""A timeline of forwards, payload transfers and weight syncs, and the checker that reads it.

The guard's claims are about time: no forward overlaps a weight write, no payload transfer
overlaps a weight collective. A :class:`Timeline` records spans on any thread (and, merged, from
several processes: timestamps are ``time.monotonic_ns``, one clock for the whole machine), the
checker lists every forbidden overlap, and :meth:`Timeline.to_chrome_trace` writes JSON that
chrome://tracing and https://ui.perfetto.dev open as is (:func:`read_chrome_trace` reads it
back; :mod:`rollout_sync.trace_plot` draws it).

Recording is optional everywhere: code takes ``timeline: Timeline | None`` and does nothing when
it is ``None``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORBIDDEN_OVERLAPS",
    "REPORT_METADATA_KEY",
    "Overlap",
    "Span",
    "SpanKind",
    "Timeline",
    "find_overlaps",
    "read_chrome_trace",
    "split_overlaps",
    "step_intervals_ms",
    "token_rates_in_windows",
    "torn_forwards",
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
    WEIGHT_BUFFER_WRITE = "weight_buffer_write"
    """A write into an async-mode weight buffer or a staged sync's staging area, not a served
    tensor (``transfer.BUFFER_WRITE``): generation may overlap it."""
    GENERATION_IDLE = "generation_idle"
    """A replica with nothing to generate: the synchronous learning loop's wait for the next
    version (``rollout-sync demo --learn``; parks are :attr:`PAUSE`)."""
    PAYLOAD_HOLD = "payload_hold"
    """Payload transfers held for a weight sync: a replica's sends (the bracket's egress hold,
    from asking for it until its release) or the trainer's receives (the P2R push's hold)."""


FORBIDDEN_OVERLAPS: tuple[tuple[str, str], ...] = (
    (SpanKind.FORWARD, SpanKind.WEIGHT_WRITE),
    (SpanKind.PAYLOAD_SEND, SpanKind.WEIGHT_COLLECTIVE),
    (SpanKind.PAYLOAD_RECV, SpanKind.WEIGHT_COLLECTIVE),
    (SpanKind.PAYLOAD_SEND, SpanKind.SYNC),
    (SpanKind.PAYLOAD_RECV, SpanKind.SYNC),
)
"""Pairs of kinds that must never overlap in time within one process."""

REPORT_METADATA_KEY = "rollout_sync_report"
"""The key under ``otherData`` of a Chrome trace where ``rollout-sync demo --trace`` keeps the
run's report (so that ``rollout-sync plot`` can title the picture with it)."""


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

    @property
    def start_ns(self) -> int:
        """Where the two spans begin to intersect."""
        return max(self.first.start_ns, self.second.start_ns)

    @property
    def end_ns(self) -> int:
        """Where their intersection ends."""
        return min(self.first.end_ns, self.second.end_ns)

    def __str__(self) -> str:
        a, b = self.first, self.second
        both = (self.end_ns - self.start_ns) / 1e6
        return f"{a.kind} {a.name!r} overlaps {b.kind} {b.name!r} by {both:.3f} ms (pid {a.pid})"


class Timeline:
    """A thread-safe recorder of :class:`Span` s, and the names of the processes they ran in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._process_names: dict[int, str] = {}

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

    def name_process(self, pid: int, name: str) -> None:
        """Call process ``pid`` ``name`` (``"trainer"``, ``"replica 2"``): the trace's process
        name in Perfetto, and the lane's label in the picture."""
        with self._lock:
            self._process_names[pid] = name

    def process_names(self) -> dict[int, str]:
        """The names given by :meth:`name_process`, by pid (a copy)."""
        with self._lock:
            return dict(self._process_names)

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

    def to_chrome_trace(self, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The Chrome/Perfetto trace-event form: complete ("X") events, microseconds from the
        first span, a ``process_name`` metadata ("M") event per named process, and
        ``metadata`` (a run's report, say) as ``otherData``, with every non-finite float
        made ``null`` so that the file stays strict JSON."""
        spans = self.spans()
        origin = min((s.start_ns for s in spans), default=0)
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
            for pid, name in sorted(self.process_names().items())
        ]
        events += [
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
        trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
        if metadata is not None:
            trace["otherData"] = _json_safe(metadata)
        return trace

    def write_chrome_trace(
        self, path: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None
    ) -> Path:
        """Write :meth:`to_chrome_trace` to ``path`` (``.json``) and return the path."""
        out = Path(path)
        out.write_text(json.dumps(self.to_chrome_trace(metadata)))
        return out

    @classmethod
    def from_chrome_trace(cls, trace: Mapping[str, Any]) -> Timeline:
        """The timeline of a trace :meth:`to_chrome_trace` wrote (or any trace of complete
        events): each "X" event a span (``cat`` its kind), each ``process_name`` event a
        process name. Times are counted from the trace's origin, to the nanosecond, so
        :meth:`overlaps` finds what it found before the export. Other events are skipped.

        Raises:
            ValueError: ``trace`` has no ``traceEvents`` list (not a trace-event file), or an
                event is malformed (not an object; an "X" event without a numeric ``ts``).
        """
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            raise ValueError(
                "not a Chrome trace: no 'traceEvents' list (rollout-sync demo --trace and "
                "Timeline.write_chrome_trace write one)"
            )
        timeline = cls()
        for i, e in enumerate(events):
            try:
                timeline._add_chrome_event(e)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"trace event {i} is malformed: {exc!r}") from None
        return timeline

    def _add_chrome_event(self, e: Mapping[str, Any]) -> None:
        """One trace event: a span for "X", a process name for ``process_name``; else none."""
        if e.get("ph") == "X":
            start = round(float(e["ts"]) * 1e3)
            self.add(
                Span(
                    str(e.get("cat", "")),
                    str(e.get("name", "")),
                    start,
                    start + round(float(e.get("dur", 0.0)) * 1e3),
                    int(e.get("pid", 0)),
                    int(e.get("tid", 0)),
                    dict(e.get("args") or {}),
                )
            )
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            self.name_process(int(e["pid"]), str(e["args"]["name"]))


def read_chrome_trace(path: str | os.PathLike[str]) -> tuple[Timeline, dict[str, Any]]:
    """Read a trace file: its :class:`Timeline` (:meth:`Timeline.from_chrome_trace`) and its
    ``otherData`` (``{}`` when it has none).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or not a trace-event file.
    """
    try:
        trace = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON trace file: {exc}") from None
    if not isinstance(trace, dict):
        raise ValueError(f"{path} is not a Chrome trace (a JSON object with 'traceEvents')")
    other = trace.get("otherData")
    return Timeline.from_chrome_trace(trace), dict(other) if isinstance(other, dict) else {}


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (a percentile of no samples) made ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


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


def split_overlaps(overlaps: Iterable[Overlap]) -> tuple[list[Overlap], list[Overlap]]:
    """The two hazards in ``overlaps`` (:meth:`Timeline.overlaps`): forwards during a weight
    write (torn reads; reports' ``forward_write_overlaps``) and payload transfers during a
    weight collective or sync (``egress_overlaps``)."""
    forward_writes: list[Overlap] = []
    egress: list[Overlap] = []
    for o in overlaps:
        if o.first.kind == SpanKind.FORWARD:
            forward_writes.append(o)
        elif o.first.kind in (SpanKind.PAYLOAD_SEND, SpanKind.PAYLOAD_RECV):
            egress.append(o)
    return forward_writes, egress


def torn_forwards(forwards: Iterable[Span], overlaps: Iterable[Overlap]) -> list[Span]:
    """The forwards that read torn weights, each once, in start order: those the engine's own
    detector flagged (``args["torn"]``: a seqlock, version stamps) and those that overlap a
    weight write (``overlaps``, as :func:`find_overlaps` found them)."""
    torn: dict[tuple[int, int, int, int], Span] = {}
    flagged = [s for s in forwards if s.args.get("torn")]
    overlapping = [o.first for o in overlaps if o.first.kind == SpanKind.FORWARD]
    for span in (*flagged, *overlapping):
        torn.setdefault((span.pid, span.tid, span.start_ns, span.end_ns), span)
    return sorted(torn.values(), key=lambda s: s.start_ns)


def token_rates_in_windows(
    forwards: Iterable[Span], windows: Iterable[Span], *, tokens_arg: str = "batch"
) -> tuple[float, float]:
    """Decode throughput inside ``windows`` (weight syncs) and outside them, in tokens/s:
    ``(inside, outside)``, NaN where there is no time to divide by.

    Per process, only the time from its first forward's start to its last forward's end
    counts (before the engine starts, a sync stalls nothing). A forward counts where its
    midpoint lies: inside a window of its process or outside all of them. Its decode tokens
    are its ``tokens_arg`` argument: by default ``batch``, the sequences it stepped, each of
    which it gave one new token (prompt tokens it prefilled are not decode tokens); 1 when the
    span has no such argument. Overlapping windows of one process are merged first.
    """
    by_pid: dict[int, list[Span]] = {}
    for span in forwards:
        by_pid.setdefault(span.pid, []).append(span)
    held: dict[int, list[tuple[int, int]]] = {}
    for window in windows:
        held.setdefault(window.pid, []).append((window.start_ns, window.end_ns))
    tokens_in = tokens_out = 0.0
    time_in = time_out = 0
    for pid, spans in by_pid.items():
        lo = min(s.start_ns for s in spans)
        hi = max(s.end_ns for s in spans)
        merged: list[list[int]] = []
        for start, end in sorted(held.get(pid, [])):
            start, end = max(start, lo), min(end, hi)
            if end <= start:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        inside = sum(end - start for start, end in merged)
        time_in += inside
        time_out += (hi - lo) - inside
        for span in spans:
            mid = (span.start_ns + span.end_ns) // 2
            n = float(span.args.get(tokens_arg, 1))
            if any(start <= mid < end for start, end in merged):
                tokens_in += n
            else:
                tokens_out += n
    rate_in = tokens_in / (time_in / 1e9) if time_in else math.nan
    rate_out = tokens_out / (time_out / 1e9) if time_out else math.nan
    return rate_in, rate_out


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
