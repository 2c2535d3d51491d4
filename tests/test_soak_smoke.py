"""benchmarks/soak.py, short: the in-process job (trainer and three replicas in their command
loops) through a failed transfer on each hop, each leaving its replica torn and the next sync
recovering it; no torn read, every version bit-identical, the workers' history at its bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_a_short_soak_recovers_every_injected_failure_and_keeps_the_history_bounded() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--syncs", "300", "--history", "64"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["errors"] == []
    # One failure per hop: the P2R (replica 1), then the R2R into replica 2, then replica 3.
    assert report["failures_injected"] == report["torn_after_failure"] == report["recovered"] == 3
    assert report["torn_reads"] == 0 and report["bit_identical"] is True
    assert report["history_len"] == report["sync_reports_len"] == 64
    assert report["payloads_sent"] > 0
