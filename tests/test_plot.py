"""The picture of a timeline (rollout_sync.trace_plot, `--plot`, `rollout-sync plot`): lanes and
rectangles read from the figure's artists (their gids), never from pixels; overlaps marked
exactly where the checker finds them; a clear error without matplotlib.

The runs of the real main job are drawn in tests/test_demo_distributed.py, which has them."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.demos.cli import main
from rollout_sync.errors import MatplotlibUnavailableError
from rollout_sync.scheduler import SCHEDULER_STEP_SPAN
from rollout_sync.trace import REPORT_METADATA_KEY, Span, SpanKind, Timeline, read_chrome_trace

pytestmark = pytest.mark.timeout(60)

MS = 1_000_000
TRAINER, REPLICA_1, REPLICA_2 = 100, 101, 102
SYNCS_MS = [(10.0, 20.0), (40.0, 55.0), (70.0, 76.0)]
"""Three syncs: the zoom leaves out the first and takes the median of the other two."""


def _add(
    timeline: Timeline, kind: str, pid: int, start_ms: float, end_ms: float, **args: Any
) -> None:
    timeline.add(Span(kind, kind, round(start_ms * MS), round(end_ms * MS), pid, 1, args))


def recorded_run(*, hazards: bool = False) -> Timeline:
    """A trainer and two replicas over 100 ms: decode steps between three syncs (each a park,
    a hold, a handler body, collectives and a write), payloads both ways; with ``hazards``, a
    forward during a write, a payload send during a sync, and a forward its engine saw torn."""
    t = Timeline()
    for pid, name in ((TRAINER, "trainer"), (REPLICA_1, "replica 1"), (REPLICA_2, "replica 2")):
        t.name_process(pid, name)
    for lo, hi in SYNCS_MS:
        _add(t, SpanKind.WEIGHT_COLLECTIVE, TRAINER, lo + 1, hi - 2)
        _add(t, SpanKind.PAYLOAD_HOLD, TRAINER, lo + 1, hi - 2)
    for at in (30.0, 80.0):
        _add(t, SpanKind.PAYLOAD_RECV, TRAINER, at, at + 1)
    for pid in (REPLICA_1, REPLICA_2):
        for k in range(40):
            start = k * 2.5
            if not any(lo - 1 <= start < hi for lo, hi in SYNCS_MS):
                _add(t, SCHEDULER_STEP_SPAN, pid, start, start + 1.2)  # not drawn
                _add(t, SpanKind.FORWARD, pid, start, start + 1)
        for lo, hi in SYNCS_MS:
            _add(t, SpanKind.PAUSE, pid, lo, hi, park_ms=0.5)
            _add(t, SpanKind.PAYLOAD_HOLD, pid, lo, hi)
            _add(t, SpanKind.SYNC, pid, lo + 0.5, hi - 0.5)
            _add(t, SpanKind.WEIGHT_COLLECTIVE, pid, lo + 1, hi - 2)
            _add(t, SpanKind.WEIGHT_WRITE, pid, hi - 2, hi - 1)
        for at in (30.0, 80.0):
            _add(t, SpanKind.PAYLOAD_SEND, pid, at, at + 1)
    if hazards:  # in the third sync: not the one the zoom takes when there is no overlap
        _add(t, SpanKind.FORWARD, REPLICA_1, 73.5, 74.5)  # the write runs 74..75
        _add(t, SpanKind.PAYLOAD_SEND, REPLICA_2, 71.5, 72.5)  # the sync's body and wire
        _add(t, SpanKind.FORWARD, REPLICA_2, 90.0, 91.0, torn=True)  # its seqlock saw a write
    return t


def rectangles(ax: Any) -> dict[str, int]:
    """``gid -> rectangles`` of the axes' collections (one rectangle per span or overlap)."""
    return {c.get_gid(): len(c.get_paths()) for c in ax.collections if c.get_gid()}


def markers(ax: Any, prefix: str) -> int:
    return sum(
        len(line.get_xdata()) for line in ax.lines if (line.get_gid() or "").startswith(prefix)
    )


@pytest.fixture(scope="module")
def trace_plot() -> Iterator[Any]:
    pytest.importorskip("matplotlib")
    from rollout_sync import trace_plot

    yield trace_plot


def test_a_lane_per_process_and_a_rectangle_per_span(trace_plot: Any) -> None:
    timeline = recorded_run()
    drawn = trace_plot.plot_timeline(timeline)
    assert drawn.lanes == ("trainer", "replica 1", "replica 2")
    whole, zoom = drawn.figure.axes
    # Every span of a drawn kind is one rectangle, in its process's lane and its kind's style;
    # the scheduler's steps (each holding a decode step) are left out.
    names = timeline.process_names()
    expected: dict[str, int] = {}
    for span in timeline.spans():
        for style in trace_plot.STYLES:
            if span.kind in style.kinds:
                key = f"{style.key}|{names[span.pid]}"
                expected[key] = expected.get(key, 0) + 1
    assert rectangles(whole) == expected
    assert expected["forward|replica 1"] == 27 and expected["park|replica 2"] == 3
    assert "sync|trainer" not in expected and "hold|trainer" in expected
    # Each lane has the rows it has spans for, top to bottom.
    rows = [label.get_text() for label in whole.get_yticklabels()]
    assert rows == ["wire", "payload"] + ["generation", "wire", "write", "payload"] * 2
    # Zoomed: the median sync after the first, padded by a fifth of its length and 1 ms; only
    # what runs in that window is drawn there.
    assert drawn.zoom_ns == (36 * MS, 59 * MS)
    in_window = [
        s
        for s in timeline.spans(SpanKind.FORWARD)
        if s.pid == REPLICA_1 and s.start_ns < 59 * MS and s.end_ns > 36 * MS
    ]
    assert rectangles(zoom)["forward|replica 1|zoom"] == len(in_window) == 3
    # Nothing to mark, and the headline from the trace alone: 6 handler bodies, 10 ms parked.
    assert drawn.overlaps == drawn.torn_reads == 0
    assert not any(gid.startswith(("overlap", "torn")) for gid in rectangles(whole))
    assert drawn.headline.source == "trace" and drawn.headline.syncs == 6
    assert "6 syncs · 0 torn reads · stall p50 10.0 ms · park p99 0.5 ms" in (
        drawn.figure.get_suptitle()
    )


def test_overlaps_are_marked_in_red_exactly_where_the_checker_finds_them(trace_plot: Any) -> None:
    timeline = recorded_run(hazards=True)
    overlaps = timeline.overlaps()
    assert sorted((o.first.pid, o.first.kind, o.second.kind) for o in overlaps) == [
        (REPLICA_1, SpanKind.FORWARD, SpanKind.WEIGHT_WRITE),
        (REPLICA_2, SpanKind.PAYLOAD_SEND, SpanKind.WEIGHT_COLLECTIVE),
        (REPLICA_2, SpanKind.PAYLOAD_SEND, SpanKind.SYNC),
    ]
    drawn = trace_plot.plot_timeline(timeline)
    whole = drawn.figure.axes[0]
    marked = rectangles(whole)
    assert marked["overlap|replica 1"] == 1 and marked["overlap|replica 2"] == 2
    assert markers(whole, "overlap-marker|") == drawn.overlaps == 3
    # Torn reads as the report counts them: the forward during the write, and the one its
    # engine flagged.
    assert markers(whole, "torn|") == drawn.torn_reads == 2
    # The zoom goes where the overlaps are (the third sync, where without them it would take
    # the second: see the test above), and marks them there too.
    assert drawn.zoom_ns is not None
    assert 55 * MS < drawn.zoom_ns[0] <= 70 * MS and drawn.zoom_ns[1] >= 76 * MS
    assert markers(drawn.figure.axes[1], "overlap-marker|") == 3
    assert "2 torn reads" in drawn.figure.get_suptitle()
    assert "3 overlaps marked in red" in drawn.figure.get_suptitle()


def test_a_report_heads_the_picture_and_a_timeline_without_syncs_has_no_zoom(
    trace_plot: Any,
) -> None:
    timeline = Timeline()
    _add(timeline, SpanKind.FORWARD, 7, 0, 1)
    report = {"syncs": 9, "torn_reads": 0, "sync_ms_p50": 12.25, "time_to_park_ms_p99": None}
    drawn = trace_plot.plot_timeline(timeline, report={**report, "guarded": True})
    assert len(drawn.figure.axes) == 1 and drawn.zoom_ns is None
    assert drawn.lanes == ("pid 7",)
    title = drawn.figure.get_suptitle()
    assert "9 syncs · 0 torn reads · stall p50 12.2 ms · park p99 n/a" in title
    assert "guarded" in title and "figures from the report" in title
    with pytest.raises(ValueError, match="nothing to draw"):
        trace_plot.plot_timeline(Timeline())


def test_an_engine_start_longer_than_the_rest_is_left_out_of_the_top(trace_plot: Any) -> None:
    """vLLM starts its engine inside the first sync: a minute of nothing would squeeze the run
    into a sliver of the whole-run axes."""
    timeline = Timeline()
    _add(timeline, SpanKind.PAUSE, 7, 0, 90)  # the first sync, starting the engine
    for k in range(10):
        _add(timeline, SpanKind.FORWARD, 7, 90 + k, 90.5 + k)
    whole = trace_plot.plot_timeline(timeline).figure.axes[0]
    assert whole.get_xlim() == pytest.approx((0.089525, 0.0995))  # s: 5 % of the rest before
    assert "the 0.1 s before it, no generation yet, left out" in whole.get_title(loc="left")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The threads-only demo with --trace and --plot, once (about a second)."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("cli")
    trace, picture = out / "run.json", out / "run.png"
    printed = io.StringIO()  # capsys is function-scoped
    with contextlib.redirect_stdout(printed):
        code = main(
            ["demo", "--in-process", "--syncs", "8", "--trace", str(trace), "--plot", str(picture)]
        )
    assert code == 0, printed.getvalue()
    return trace, picture, printed.getvalue()


def test_demo_plot_writes_the_picture_and_the_trace_keeps_the_report(
    cli_run: tuple[Path, Path, str],
) -> None:
    trace, picture, printed = cli_run
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {picture} (1 process; " in printed
    timeline, metadata = read_chrome_trace(trace)
    report = metadata[REPORT_METADATA_KEY]
    assert report["syncs"] == 8 and report["guarded"] is True
    assert len(timeline.spans(SpanKind.SYNC)) == 8


def test_rollout_sync_plot_draws_a_trace_written_earlier(
    cli_run: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, _, _ = cli_run
    out = tmp_path / "again.png"
    assert main(["plot", str(trace), "-o", str(out), "--dpi", "30"]) == 0
    assert f"plot: {out} (1 process;" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without -o the picture goes next to the trace.
    copy = tmp_path / "copy.json"
    copy.write_bytes(trace.read_bytes())
    assert main(["plot", str(copy), "--dpi", "30"]) == 0 and (tmp_path / "copy.png").exists()
    not_a_trace = tmp_path / "report.json"
    not_a_trace.write_text('{"syncs": 3}')
    with pytest.raises(SystemExit, match="not a Chrome trace: no 'traceEvents' list"):
        main(["plot", str(not_a_trace)])
    with pytest.raises(SystemExit, match="cannot read"):
        main(["plot", str(tmp_path / "missing.json")])
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"traceEvents": [{"ph": "X", "name": "no ts"}]}')
    with pytest.raises(SystemExit, match="trace event 0 is malformed"):
        main(["plot", str(malformed)])
    # A PNG whatever the name says (the docs promise a PNG; the suffix picks no format).
    odd = tmp_path / "picture.json"
    assert main(["plot", str(trace), "-o", str(odd), "--dpi", "30"]) == 0
    assert odd.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="cannot write the picture"):
        main(["plot", str(trace), "-o", str(tmp_path / "no" / "such" / "dir.png")])


def test_without_matplotlib_the_cli_names_the_extra_before_running_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """matplotlib made unimportable (a None in sys.modules fails every import of it)."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    picture = tmp_path / "x.png"
    assert main(["demo", "--in-process", "--syncs", "1", "--plot", str(picture)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the run: no report
    assert "rollout-sync demo --plot: drawing a timeline needs matplotlib" in captured.err
    assert "pip install 'rollout-sync[plot]'" in captured.err
    assert main(["plot", str(tmp_path / "t.json")]) == 2
    assert "pip install 'rollout-sync[plot]'" in capsys.readouterr().err
    assert not picture.exists()
    from rollout_sync.trace_plot import plot_timeline

    with pytest.raises(MatplotlibUnavailableError, match=r"rollout-sync\[plot\]"):
        plot_timeline(recorded_run())


def test_demo_plot_into_a_missing_folder_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "no" / "such" / "sync.png"
    assert main(["demo", "--in-process", "--syncs", "1", "--plot", str(picture)]) == 2
    captured = capsys.readouterr()
    assert "no folder" in captured.err and "rollout-sync demo report" not in captured.out
