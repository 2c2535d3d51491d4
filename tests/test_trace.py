"""The timeline: overlap checker and the Chrome/Perfetto export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_sync import SpanKind, Timeline
from rollout_sync.demos.in_process import InProcessDemoConfig, run_in_process_demo
from rollout_sync.trace import (
    Span,
    find_overlaps,
    read_chrome_trace,
    step_intervals_ms,
    torn_forwards,
)

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


def test_a_trace_file_reads_back_to_the_nanosecond_with_process_names_and_metadata(
    tmp_path: Path,
) -> None:
    t0 = 1_234_567_891_234  # a monotonic_ns value: the file counts from the first span
    timeline = Timeline()
    for s in (
        Span(SpanKind.FORWARD, "f", t0, t0 + 1_001, 7, 1, {"torn": False}),
        Span(SpanKind.WEIGHT_WRITE, "w", t0 + 1_000, t0 + 2_000, 7, 2),  # overlaps by 1 ns
        Span(SpanKind.FORWARD, "g", t0 + 2_000, t0 + 3_000, 7, 1),  # touches: no overlap
        Span(SpanKind.PAYLOAD_RECV, "r", t0 + 5, t0 + 6, 8, 1),
    ):
        timeline.add(s)
    timeline.name_process(7, "replica 1")
    out = timeline.write_chrome_trace(tmp_path / "t.json", metadata={"p50": float("nan"), "n": 3})
    assert "NaN" not in out.read_text()  # strict JSON: Perfetto refuses NaN
    copy, metadata = read_chrome_trace(out)
    assert metadata == {"p50": None, "n": 3}
    assert copy.process_names() == {7: "replica 1"}
    assert [(s.kind, s.name, s.start_ns, s.end_ns, s.pid, s.tid) for s in copy.spans()] == [
        (s.kind, s.name, s.start_ns - t0, s.end_ns - t0, s.pid, s.tid) for s in timeline.spans()
    ]
    assert [(o.first.name, o.second.name) for o in copy.overlaps()] == [("f", "w")]
    assert [s.name for s in torn_forwards(copy.spans(SpanKind.FORWARD), copy.overlaps())] == ["f"]
    not_a_trace = tmp_path / "r.json"
    not_a_trace.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        read_chrome_trace(not_a_trace)


def test_step_intervals_leave_out_the_intervals_that_hold_a_pause() -> None:
    ms = 1_000_000

    def forward(pid: int, at_ms: int) -> Span:
        return Span(SpanKind.FORWARD, "forward", at_ms * ms, at_ms * ms + ms // 2, pid, 1)

    forwards = [forward(1, t) for t in (0, 2, 4, 30, 32)] + [forward(2, t) for t in (0, 5, 10)]
    pause = Span(SpanKind.PAUSE, "generation paused", 5 * ms, 29 * ms, 1, 1)
    assert sorted(step_intervals_ms(forwards, gaps=[pause])) == [2.0, 2.0, 2.0, 5.0, 5.0]
    assert 26.0 in step_intervals_ms(forwards)
