"""A trainer and rollout replicas in separate processes, end to end, through the demo harness:
P2R to the first replica and R2R to the others every step, generation running throughout."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from rollout_sync.cli import main
from rollout_sync.demo_distributed import DistributedDemoConfig, run_distributed_demo
from rollout_sync.guard import SyncMode
from rollout_sync.trace import Span, SpanKind, Timeline

pytestmark = pytest.mark.multiprocess

_SMALL = {"num_tensors": 16, "numel": 4096, "bucket_bytes": 64 << 10, "timeout_s": 20.0}


def _by_pid(timeline: Timeline, kind: str) -> dict[int, list[Span]]:
    out: dict[int, list[Span]] = defaultdict(list)
    for span in timeline.spans(kind):
        out[span.pid].append(span)
    return out


@pytest.mark.timeout(90)
def test_trainer_and_three_replicas_stay_bit_identical_every_step_while_generating() -> None:
    timeline = Timeline()
    steps = 6
    report = run_distributed_demo(
        DistributedDemoConfig(replicas=3, steps=steps, checksums=True, **_SMALL), timeline)
    assert report["failed_commands"] == 0, report["errors"]
    # Bit-identical to the trainer after every step, on every replica.
    assert report["versions_checked"] == 3 * steps
    assert report["step_mismatches"] == 0 and report["bit_identical"]
    assert report["final_versions"] == [steps] * 3
    # No forward read torn weights; no forward overlapped a write; no send overlapped a sync.
    assert report["torn_reads"] == 0
    assert report["write_forward_overlaps"] == 0 and report["egress_overlaps"] == 0
    assert timeline.overlaps() == []
    # Generation kept going: on every replica, forwards ran between the first and the last
    # sync, and the receivers parked once per sync.
    syncs = _by_pid(timeline, SpanKind.SYNC)
    forwards = _by_pid(timeline, SpanKind.FORWARD)
    writes = _by_pid(timeline, SpanKind.WEIGHT_WRITE)
    assert len(syncs) == 3
    for pid, spans in syncs.items():
        first, last = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
        during = [f for f in forwards[pid] if first <= f.start_ns <= last]
        assert len(during) >= 1, f"replica {pid} did not generate between its syncs"
        assert writes[pid], f"replica {pid} recorded no weight writes"
    # One pause per received sync: replica 1 for P2R (its R2R only reads), the others for R2R.
    assert report["generation_pauses"] == 3 * steps
    assert report["transfer_mb_per_s"] > 0


@pytest.mark.timeout(90)
def test_the_unguarded_run_shows_torn_reads_and_egress_overlaps() -> None:
    """The harness above can fail: the same run without the guard sees both hazards."""
    report = run_distributed_demo(DistributedDemoConfig(
        replicas=2, steps=12, guarded=False, num_tensors=32, numel=16384, timeout_s=20.0))
    assert report["failed_commands"] == 0, report["errors"]
    assert report["torn_reads"] > 0
    assert report["write_forward_overlaps"] > 0
    assert report["egress_overlaps"] > 0
    assert report["bit_identical"]  # the bytes arrive intact; what breaks is who read when


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [SyncMode.ASYNC_PER_FORWARD, SyncMode.ASYNC_PER_GENERATION])
def test_async_modes_never_pause_and_install_only_at_safe_points(mode: SyncMode) -> None:
    timeline = Timeline()
    report = run_distributed_demo(
        DistributedDemoConfig(replicas=2, steps=8, mode=mode, **_SMALL), timeline)
    assert report["failed_commands"] == 0, report["errors"]
    assert report["generation_pauses"] == 0
    assert report["torn_reads"] == 0 and timeline.overlaps() == []
    assert report["step_mismatches"] == 0 and report["bit_identical"]
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


@pytest.mark.timeout(90)
def test_cli_demo_runs_multi_process_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--replicas", "1", "--steps", "3", "--model-mb", "0.25",
                 "--bucket-mb", "0.0625", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert report["mode"] == "multi_process" and report["replicas"] == 1
    for key in ("syncs", "forwards", "torn_reads", "egress_overlaps", "time_to_park_ms_p50",
                "time_to_park_ms_p99", "sync_ms_p50", "sync_ms_p99", "transfer_mb_per_s",
                "bit_identical"):
        assert key in report
    assert report["syncs"] == 3 and report["bit_identical"] is True
    assert "OK:" in out
