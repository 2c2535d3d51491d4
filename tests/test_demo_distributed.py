"""A trainer and rollout replicas in separate processes, end to end, through the demo harness:
the tiny LM streaming generations on every replica and shipping them to the trainer over the
payload transport, while the trainer pushes new weights every step (P2R to the first replica,
R2R to the others)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.demos.cli import main
from rollout_sync.demos.distributed import DistributedDemoConfig, run_distributed_demo
from rollout_sync.sync import SyncMode
from rollout_sync.trace import (
    REPORT_METADATA_KEY,
    Span,
    SpanKind,
    Timeline,
    read_chrome_trace,
)

pytestmark = pytest.mark.multiprocess

_FAST = {"step_interval_s": 0.05, "timeout_s": 20.0}
_SMALL = {"num_tensors": 16, "numel": 4096, "bucket_bytes": 64 << 10, **_FAST}


def _picture(timeline: Timeline, report: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The run drawn (rollout_sync.trace_plot; tests/test_plot.py has the rest), and the
    rectangles of the whole run's axes by gid (``"<style>|<lane>"``, ``"overlap|<lane>"``).
    Skips, after the run's own checks, where the plot extra is not installed."""
    pytest.importorskip("matplotlib")
    from rollout_sync.trace_plot import plot_timeline

    drawn = plot_timeline(timeline, report=report)
    whole = drawn.figure.axes[0]
    return drawn, {c.get_gid(): len(c.get_paths()) for c in whole.collections if c.get_gid()}


def _by_pid(timeline: Timeline, kind: str) -> dict[int, list[Span]]:
    out: dict[int, list[Span]] = defaultdict(list)
    for span in timeline.spans(kind):
        out[span.pid].append(span)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("pipelined_relay", "mode", "lora"),
    [
        (False, SyncMode.SYNC, False),
        (True, SyncMode.SYNC, False),
        (False, SyncMode.STAGED, False),
        (True, SyncMode.STAGED, False),
        (False, SyncMode.SYNC, True),
    ],
    ids=["p2r_then_r2r", "pipelined", "staged", "staged_pipelined", "lora"],
)
def test_the_default_demo_is_clean_bit_identical_and_loses_no_payload(
    pipelined_relay: bool, mode: SyncMode, lora: bool
) -> None:
    timeline = Timeline()
    steps = 6
    # Short generations: every replica finishes (and ships) some within the run's six steps
    # however loaded the machine is; the default 4..48 tokens did not always (2 cores, 3x load).
    config = DistributedDemoConfig(
        replicas=3,
        steps=steps,
        checksums=True,
        pipelined_relay=pipelined_relay,
        mode=mode,
        lora=lora,
        min_new_tokens=2,
        max_new_tokens=12,
        **_FAST,
    )
    report = run_distributed_demo(config, timeline)
    assert report["backend"] == "torch_lm"
    assert report["failed_commands"] == 0, report["errors"]
    # Bit-identical to the trainer after every step, on every replica.
    assert report["versions_checked"] == 3 * steps
    assert report["step_mismatches"] == 0 and report["bit_identical"]
    assert report["final_versions"] == [steps] * 3
    # No forward read torn weights (seqlock or timeline), no payload transfer overlapped a
    # weight collective or sync on any process, the trainer's included.
    assert report["torn_reads"] == 0 and report["torn_forwards_detected"] == 0
    assert report["forward_write_overlaps"] == 0 and report["egress_overlaps"] == 0
    assert timeline.overlaps() == []
    # Real payloads crossed: every one sent arrived intact, in both directions of the count.
    assert report["payloads_sent"] > 0
    assert report["payloads_received"] == report["payloads_sent"]
    assert report["payloads_lost"] == 0 and report["payloads_invalid"] == 0
    assert report["rollout_tokens"] > 0 and report["results_failed"] == 0
    sends, receives = (
        _by_pid(timeline, SpanKind.PAYLOAD_SEND),
        _by_pid(timeline, SpanKind.PAYLOAD_RECV),
    )
    assert len(sends) == 3 and len(receives) == 1, "every replica sent; the trainer received"
    # Generation kept going: on every replica, forwards ran between the first and the last
    # sync, syncs landed on sequences in flight, and the receivers parked once per sync.
    syncs = _by_pid(timeline, SpanKind.SYNC)
    forwards = _by_pid(timeline, SpanKind.FORWARD)
    writes = _by_pid(timeline, SpanKind.WEIGHT_WRITE)
    assert len(syncs) == 3
    for pid, spans in syncs.items():
        first, last = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
        during = [f for f in forwards[pid] if first <= f.start_ns <= last]
        assert len(during) >= 1, f"replica {pid} did not generate between its syncs"
        assert writes[pid], f"replica {pid} recorded no weight writes"
    assert report["results_straddled_sync"] > 0
    # One pause per received sync: replica 1 for P2R (its R2R only reads, or it relays inside
    # its P2R), the others for R2R. Staged, one per install: replica 1's after the R2R it sent.
    assert report["generation_pauses"] == 3 * steps
    assert report["sync_mode"] == mode.value
    assert 0 < report["stall_ms_p50"] <= report["stall_ms_p99"]
    assert report["version_skew_ms_max"] >= 0 and report["sync_window_tokens_ratio"] >= 0
    if mode is SyncMode.STAGED or lora:
        # The pause covers the install alone, not the wire (an adapter is always staged).
        assert report["stall_ms_p50"] < report["sync_ms_p50"] / 4
    if lora:
        # Only the adapter moved: a fraction of the model, every version of it checked above.
        assert report["lora"] and 0 < report["adapter_mb"] < report["model_mb"] / 4
        assert report["bytes_per_sync"] == pytest.approx(report["adapter_mb"] * 1e6)
    assert report["syncs"] == (3 if pipelined_relay else 4) * steps
    # The trainer's metric, and the rollout side's phases.
    assert report["weight_sync_time_ms_p50"] > 0
    for key in ("time_to_park_ms", "egress_drain_ms", "handler_ms", "fence_ms", "sync_ms"):
        assert report[f"{key}_p50"] >= 0 and report[f"{key}_p99"] >= report[f"{key}_p50"]
    assert report["transfer_mb_per_s"] > 0
    # Its picture: a lane per process, nothing in red, a park on each receiver and a hold on
    # every process per sync (the trainer holds its receives for each push).
    drawn, rectangles = _picture(timeline, report)
    assert drawn.lanes == ("trainer", "replica 1", "replica 2", "replica 3")
    assert drawn.overlaps == drawn.torn_reads == 0
    assert not any(gid.startswith(("overlap", "torn")) for gid in rectangles)
    assert rectangles["hold|trainer"] == rectangles["park|replica 2"] == steps
    assert rectangles["hold|replica 1"] == (1 if pipelined_relay else 2) * steps
    names = timeline.process_names()
    assert rectangles["forward|replica 3"] == sum(
        names[s.pid] == "replica 3" for s in timeline.spans(SpanKind.FORWARD)
    )


@pytest.mark.timeout(90)
def test_the_unguarded_demo_shows_torn_reads_and_payload_overlaps(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The harness above can fail: the same run without the guard sees both hazards, on the
    replicas and on the trainer (which then receives payloads through its weight sends)."""
    trace, picture = tmp_path / "unguarded.json", tmp_path / "unguarded.png"
    argv = ["demo", "--replicas", "2", "--steps", "12", "--unguarded", "--json"]
    code = main([*argv, "--trace", str(trace), "--plot", str(picture)])  # as README shows
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out  # hazards are the expected outcome of an unguarded run
    assert report["failed_commands"] == 0, report["errors"]
    assert report["guarded"] is False and report["backend"] == "torch_lm"
    assert report["torn_reads"] > 0
    assert report["forward_write_overlaps"] > 0
    assert report["egress_overlaps"] > 0
    assert report["trainer_egress_overlaps"] > 0
    assert report["generation_pauses"] == 0
    # The bytes still arrive intact; what breaks is who read (and sent) when.
    assert report["bit_identical"] and report["payloads_lost"] == 0
    assert "Unguarded:" in out
    # Its picture, from the trace written: every overlap the report counts is marked in red,
    # on the trainer too, and every torn read; nothing was held.
    timeline, metadata = read_chrome_trace(trace)
    assert metadata[REPORT_METADATA_KEY]["torn_reads"] == report["torn_reads"]
    drawn, rectangles = _picture(timeline, metadata[REPORT_METADATA_KEY])
    assert drawn.overlaps == report["forward_write_overlaps"] + report["egress_overlaps"]
    assert drawn.torn_reads == report["torn_reads"]
    assert sum(n for gid, n in rectangles.items() if gid.startswith("overlap|")) == drawn.overlaps
    assert rectangles.get("overlap|trainer", 0) == report["trainer_egress_overlaps"]
    assert not any(gid.startswith("hold|") for gid in rectangles)
    assert "UNGUARDED" in drawn.figure.get_suptitle()
    # The CLI's own --plot drew the same run and said how many it marked.
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {picture} (3 processes; {drawn.overlaps} overlaps marked in red)" in out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [SyncMode.ASYNC_PER_FORWARD, SyncMode.ASYNC_PER_GENERATION])
def test_async_modes_never_pause_and_install_only_at_safe_points(mode: SyncMode) -> None:
    timeline = Timeline()
    report = run_distributed_demo(
        DistributedDemoConfig(replicas=2, steps=8, mode=mode, backend="torn_read", **_SMALL),
        timeline,
    )
    assert report["failed_commands"] == 0, report["errors"]
    assert report["generation_pauses"] == 0
    assert report["torn_reads"] == 0 and timeline.overlaps() == []
    assert report["step_mismatches"] == 0 and report["bit_identical"]
    assert report["payloads_lost"] == 0 and report["payloads_received"] > 0
    assert report["installs"] >= 1
    assert report["final_versions"] == [8, 8]  # the last version reached every replica
    # Every install into served tensors ran on the serving thread (a safe point between
    # forwards), except the very first, made before that thread existed.
    forwards = _by_pid(timeline, SpanKind.FORWARD)
    for pid, writes in _by_pid(timeline, SpanKind.WEIGHT_WRITE).items():
        serving = {f.tid for f in forwards[pid]}
        first_forward = min(f.start_ns for f in forwards[pid])
        for write in writes:
            assert write.tid in serving or write.end_ns <= first_forward, write


def test_the_stream_lm_refuses_async_modes_before_spawning_anything() -> None:
    with pytest.raises(ValueError, match="torch_lm"):
        run_distributed_demo(DistributedDemoConfig(mode=SyncMode.ASYNC_PER_FORWARD))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", [None, "torn_read"], ids=["default", "torn_read"])
def test_cli_demo_runs_multi_process_by_default(
    backend: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "demo",
        "--replicas",
        "1",
        "--steps",
        "3",
        "--model-mb",
        "0.25",
        "--bucket-mb",
        "0.0625",
        "--json",
    ]
    code = main(argv if backend is None else [*argv, "--backend", backend])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert report["mode"] == "multi_process" and report["replicas"] == 1
    assert report["backend"] == (backend or "torch_lm")
    for key in (
        "syncs",
        "forwards",
        "torn_reads",
        "egress_overlaps",
        "time_to_park_ms_p50",
        "time_to_park_ms_p99",
        "sync_ms_p50",
        "sync_ms_p99",
        "transfer_mb_per_s",
        "bit_identical",
        "payloads_sent",
        "payloads_received",
        "payloads_lost",
        "weight_sync_time_ms_p50",
        "weight_sync_time_ms_p99",
        "egress_drain_ms_p50",
        "handler_ms_p99",
        "fence_ms_p50",
    ):
        assert key in report
    assert report["syncs"] == 3 and report["bit_identical"] is True
    assert report["payloads_lost"] == 0
    assert "OK:" in out
