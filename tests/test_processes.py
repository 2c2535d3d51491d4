"""run_processes with children that start processes of their own (as vLLM's engine core)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import wait_until

from rollout_sync.errors import GroupProcessError
from rollout_sync.testing import run_processes

pytestmark = pytest.mark.timeout(120)


def _start_a_grandchild_and_hang(rank: int, pid_file: str) -> None:
    grandchild = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(str(grandchild.pid))
    threading.Event().wait()  # overstays: the parent must kill it and what it started


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_non_daemonic_child_that_overstays_is_killed_with_what_it_started(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(GroupProcessError, match=r"overstayed|limit"):
        run_processes(_start_a_grandchild_and_hang, 1, (str(pid_file),), timeout_s=10, daemon=False)
    grandchild = int(pid_file.read_text())
    try:
        wait_until(lambda: not _alive(grandchild), timeout=10, what="the grandchild killed")
    finally:
        if _alive(grandchild):
            os.kill(grandchild, 9)
