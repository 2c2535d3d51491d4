"""The job as users run it recovers from kills: benchmarks/chaos.py, with replicas in
``worker.run()`` and the trainer's ``WeightBroadcastCallback``, kills the trainer at a placed
point (mid-P2R), then a leaf and then the trainer at random wall-clock moments (SIGKILL from
outside), recovers each time by the documented calls, and pushes three more versions: no torn
weights served, no acknowledged payload lost, every committed version the trainer's bytes,
every replica converged, no hang. With ``--staged`` (stage, then swap, two-phase), a leaf killed
inside the R2R wire leaves no replica torn and no two live replicas on different versions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _chaos(*args: str, timeout_s: float) -> dict[str, Any]:
    """Run benchmarks/chaos.py; its last line, the summary."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_job_in_its_command_loops_recovers_from_placed_and_random_kills() -> None:
    kills = ["trainer:mid_p2r", "leaf:any_moment", "trainer:any_moment"]
    summary = _chaos(
        "--seed", "3", *[arg for kill in kills for arg in ("--kill", kill)], timeout_s=280
    )
    assert summary["rounds"] == 3 and summary["mode"] == "sync"
    assert summary["kills"] == {"leaf/any_moment": 1, "trainer/any_moment": 1, "trainer/mid_p2r": 1}
    # The trainer died after sending at least one bucket: the relay was torn then, and asked to
    # serve, refused; torn_served == 0 below means nothing torn was ever served.
    (placed,) = summary["placed"]
    assert placed["point"] == "mid_p2r" and placed["bucket"] >= 1, placed
    assert summary["refused_while_torn"] >= 1
    assert summary["torn_served"] == 0 and summary["acked_payloads_lost"] == 0
    assert summary["mismatched_commits"] == 0 and summary["commits_checked"] > 0
    # After the last recovery, three more pushes landed bit-identically on every replica.
    assert summary["converged"] is True and summary["final_pushes_identical"] >= 3
    assert summary["hangs"] == 0
    assert summary["payloads_acked"] > 0
    assert summary["recovery_s_p50"] is not None and summary["recovery_s_p99"] is not None


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_staged_sync_leaves_no_replica_torn_or_on_another_version_after_a_death_mid_r2r() -> None:
    # Seed 4 places the death in bucket 2 of the first step's R2R. In place this very kill tears
    # the other leaf while the relay serves the version it committed at its P2R: torn and mixed.
    summary = _chaos(
        "--staged", "--seed", "4", "--kill", "leaf:mid_r2r", "--final-steps", "2", timeout_s=180
    )
    assert summary["mode"] == "staged" and summary["kills"] == {"leaf/mid_r2r": 1}
    (placed,) = summary["placed"]
    assert placed == {"victim": "leaf:3", "point": "mid_r2r", "step": 1, "bucket": 2}, placed
    assert summary["torn_replicas"] == 0 and summary["refused_while_torn"] == 0
    assert summary["mixed_versions"] == 0, summary["mixed"]
    assert summary["syncs_committed"] > 0 and summary["stall_ms_p50"] is not None
    assert summary["torn_served"] == 0 and summary["mismatched_commits"] == 0
    assert summary["converged"] is True and summary["final_pushes_identical"] == 2
    assert summary["hangs"] == 0
