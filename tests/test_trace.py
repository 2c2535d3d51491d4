"""The timeline: overlap checker and the Chrome/Perfetto export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_sync import SpanKind, Timeline
from rollout_sync.demos.in_process import InProcessDemoConfig, run_in_process_demo
from rollout_sync.trace import Span, find_overlaps, step_intervals_ms

pytestmark = pytest.mark.timeout(60)


def span(kind: str, start: int, end: int, pid: int = 1) -> Span:
    return Span(kind, f"{kind}@{start}", start, end, pid, 0)


def test_overlap_checker_finds_exactly_the_forbidden_intersections() -> None:
    spans = [
        span(SpanKind.FORWARD, 0, 10),
        span(SpanKind.FORWARD, 5, 30),  # long forward, still running when a write starts
        span(SpanKind.WEIGHT_WRITE, 10, 20),  # touches the first forward's end: no overlap
        span(SpanKind.FORWARD, 20, 25),  # starts as the write ends: no overlap
        span(SpanKind.PAYLOAD_SEND, 40, 50),
        span(SpanKind.WEIGHT_COLLECTIVE, 45, 60),
        span(SpanKind.WEIGHT_WRITE, 100, 110, pid=2),  # another process: its own timeline
        span(SpanKind.PAUSE, 0, 100),  # not a forbidden kind
    ]
    found = find_overlaps(spans)
    assert [(o.first.name, o.second.name) for o in found] == [
        ("forward@5", "weight_write@10"),
        ("payload_send@40", "weight_collective@45"),
    ]
    assert "overlaps weight_write" in str(found[0])


def test_no_spans_no_overlaps() -> None:
    assert Timeline().overlaps() == []


def test_records_round_trip_between_processes() -> None:
    timeline = Timeline()
    with timeline.span(SpanKind.FORWARD, "f", step=3):
        pass
    copy = Timeline.from_records(json.loads(json.dumps(timeline.to_records())))
    assert copy.spans() == timeline.spans()


def test_demo_trace_exports_valid_chrome_json(tmp_path: Path) -> None:
    timeline = Timeline()
    run_in_process_demo(InProcessDemoConfig(syncs=10, interval_s=0.001), timeline)
    out = timeline.write_chrome_trace(tmp_path / "demo.trace.json")
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    kinds = {e["cat"] for e in events}
    assert {
        SpanKind.FORWARD,
        SpanKind.WEIGHT_WRITE,
        SpanKind.PAYLOAD_SEND,
        SpanKind.SYNC,
        SpanKind.PAUSE,
    } <= kinds
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    assert sum(e["cat"] == SpanKind.SYNC for e in events) == 10


def test_step_intervals_leave_out_the_intervals_that_hold_a_pause() -> None:
    ms = 1_000_000

    def forward(pid: int, at_ms: int) -> Span:
        return Span(SpanKind.FORWARD, "forward", at_ms * ms, at_ms * ms + ms // 2, pid, 1)

    forwards = [forward(1, t) for t in (0, 2, 4, 30, 32)] + [forward(2, t) for t in (0, 5, 10)]
    pause = Span(SpanKind.PAUSE, "generation paused", 5 * ms, 29 * ms, 1, 1)
    assert sorted(step_intervals_ms(forwards, gaps=[pause])) == [2.0, 2.0, 2.0, 5.0, 5.0]
    assert 26.0 in step_intervals_ms(forwards)
