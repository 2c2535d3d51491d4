"""The main job on the launchers people run: Ray actors and torchrun, with the default demo's
checks, bounded in time, and cleaning up their processes when they fail too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from rollout_sync.demos.distributed import DistributedDemoConfig, run_distributed_demo
from rollout_sync.errors import GroupProcessError
from rollout_sync.launch import JobContext

pytestmark = [pytest.mark.launcher, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
_FAST = {"step_interval_s": 0.05, "timeout_s": 20.0}


def _assert_a_clean_run(report: dict[str, Any], launcher: str, replicas: int, steps: int) -> None:
    """The default demo's verdict, and the launcher that ran it."""
    assert report["launcher"] == launcher
    assert report["failed_commands"] == 0, report["errors"]
    assert report["syncs"] == steps * (1 + replicas)  # a P2R, then an R2R on every replica
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0
    assert report["payloads_sent"] > 0 and report["payloads_lost"] == 0
    assert report["payloads_received"] == report["payloads_sent"]
    assert report["bit_identical"] and report["versions_checked"] == replicas * steps
    assert report["final_versions"] == [steps] * replicas


def _ray_processes() -> list[str]:
    """Ray's own daemons running on this machine now (by their process names)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in ("raylet", "gcs_server") or name.startswith("ray::"):
                found.append(f"{entry.name}:{name}")
    return found


# -- Ray ---------------------------------------------------------------------------------------


@pytest.fixture
def no_ray_left() -> Any:
    pytest.importorskip("ray")
    assert _ray_processes() == [], "a Ray cluster is already running on this machine"
    yield
    # Ray's daemons exit asynchronously after shutdown; a poll of the process table.
    wait_until(lambda: not _ray_processes(), 30, f"Ray processes to exit: {_ray_processes()}")


@pytest.mark.timeout(240)
def test_the_demo_on_a_local_ray_cluster_is_clean_and_leaves_no_ray_process(
    no_ray_left: None,
) -> None:
    report = run_distributed_demo(
        DistributedDemoConfig(replicas=2, steps=3, **_FAST), launcher="ray"
    )
    _assert_a_clean_run(report, "ray", replicas=2, steps=3)


@pytest.mark.timeout(240)
def test_the_sharded_demo_on_ray_places_every_rank_as_an_actor(no_ray_left: None) -> None:
    """``--trainer-ranks 2 --tp 2 --launcher ray``: 2 + 2 x 2 actors, the same verdict."""
    config = DistributedDemoConfig(replicas=2, steps=3, trainer_ranks=2, tp=2, **_FAST)
    report = run_distributed_demo(config, launcher="ray")
    assert (report["processes"], report["trainer_ranks"], report["tp"]) == (6, 2, 2)
    assert report["launcher"] == "ray" and report["failed_commands"] == 0, report["errors"]
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0
    assert report["payloads_lost"] == 0  # a short run may finish no generation yet
    assert report["payloads_received"] == report["payloads_sent"]
    assert report["trainer_shard_mismatches"] == 0 and report["step_mismatches"] == 0
    assert report["bit_identical"] and report["final_versions"] == [3, 3]


def _fails_on_rank_1(context: JobContext) -> int:
    if context.rank == 1:
        raise RuntimeError("rank 1 could not load its engine")
    return context.rank


def _hangs_on_rank_2(context: JobContext) -> int:
    if context.rank == 2:
        threading.Event().wait()  # a rank that never returns: the job must kill it
    return context.rank


@pytest.mark.timeout(240)
def test_a_failing_ray_job_reports_the_rank_and_cleans_up(no_ray_left: None) -> None:
    from rollout_sync.launch.ray import RayJob

    # The actors import the entry points from this module: put tests/ on their path.
    tests_path = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    with RayJob(3, timeout_s=60, grace_s=2, env=tests_path) as job:
        with pytest.raises(GroupProcessError, match="rank 1 could not load its engine") as info:
            job.run(_fails_on_rank_1)
        assert {f.rank for f in info.value.failures} == {1}
        assert info.value.results == {0: 0, 2: 2}
        started = time.monotonic()
        with pytest.raises(GroupProcessError, match=r"killed after the job's limit of 5\.0 s"):
            job.timeout_s = 5.0
            job.run(_hangs_on_rank_2)
        assert time.monotonic() - started < 30


# -- torchrun ----------------------------------------------------------------------------------


def _run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``rollout-sync demo ...`` in a session of its own, killed with all it started if it
    overstays (torchrun and its ranks included)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "rollout_sync.demos.cli", "demo", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate(timeout=30)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(240)
def test_the_demo_under_torchrun_is_clean() -> None:
    done = _run_cli(
        "--launcher", "torchrun", "--replicas", "2", "--steps", "3", "--json", timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_a_clean_run(report, "torchrun", replicas=2, steps=3)
    assert done.stdout.count("rollout-sync demo report") == 1, "only the trainer's rank reports"


@pytest.mark.timeout(240)
def test_a_failing_torchrun_job_exits_nonzero_in_bounded_time() -> None:
    """Every rank refuses an engine that does not exist: torchrun ends them all, and the
    command fails with the reason instead of hanging."""
    started = time.monotonic()
    done = _run_cli(
        "--launcher",
        "torchrun",
        "--replicas",
        "1",
        "--steps",
        "2",
        "--backend",
        "nope",
        timeout=200,
    )
    assert done.returncode != 0
    assert "unknown --backend 'nope'" in done.stderr
    assert time.monotonic() - started < 120
