"""The multi-process plumbing: spawning a group, reporting children's failures, bounded waits."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollout_sync.distributed import group_timeout_s, init_process_group, new_group, wait_work
from rollout_sync.errors import CollectiveError, CollectiveTimeout, GroupProcessError
from rollout_sync.testing import find_free_port, run_processes

pytestmark = pytest.mark.multiprocess


def _mixed_child(rank: int, behaviour: str) -> object:
    if rank == 0:
        return {"rank": rank, "tensor": torch.arange(3)}
    if behaviour == "raise":
        raise ValueError(f"rank {rank} could not load its shard")
    if behaviour == "exit":
        os._exit(3)
    if behaviour == "hang":
        threading.Event().wait()  # a child that never finishes; the parent must kill it
    return rank


def test_values_come_back_by_rank_tensors_included() -> None:
    values = run_processes(_mixed_child, 2, ("ok",), timeout_s=60)
    assert values[1] == 1
    assert torch.equal(values[0]["tensor"], torch.arange(3))


@pytest.mark.timeout(60)
def test_a_childs_exception_comes_back_with_its_traceback() -> None:
    with pytest.raises(GroupProcessError) as info:
        run_processes(_mixed_child, 2, ("raise",), timeout_s=60)
    text = str(info.value)
    assert "--- rank 1" in text and "ValueError: rank 1 could not load its shard" in text
    assert "_mixed_child" in text  # the traceback, not just the message
    assert info.value.results[0]["rank"] == 0


@pytest.mark.timeout(60)
def test_a_child_that_dies_silently_or_overstays_is_reported_and_killed() -> None:
    with pytest.raises(GroupProcessError, match=r"exited with code 3 without reporting"):
        run_processes(_mixed_child, 2, ("exit",), timeout_s=60)
    started = time.monotonic()
    with pytest.raises(GroupProcessError, match=r"killed after the group's limit of 4\.0 s"):
        run_processes(_mixed_child, 2, ("hang",), timeout_s=4)
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_an_expected_exit_is_not_a_failure() -> None:
    values = run_processes(_mixed_child, 2, ("exit",), timeout_s=60, expected_exits={1: 3})
    assert set(values) == {0}


def _collective_child(
    rank: int, port: int, timed_out: Any, wait_s: float, group_s: float | None
) -> str:
    """Rank 1 waits ``wait_s`` for a broadcast rank 0 never joins, on the default group or on
    a group made with a timeout of ``group_s``."""
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=20)
    group = None if group_s is None else new_group([0, 1], timeout_s=group_s)
    assert group_timeout_s(group) == (20 if group_s is None else group_s)
    if rank == 1:
        work = dist.broadcast(torch.zeros(1), 0, group=group, async_op=True)
        started = time.monotonic()
        try:
            wait_work(work, operation="broadcast of the test tensor", timeout_s=wait_s, group=group)
        except CollectiveTimeout as exc:
            return f"timeout|{exc.group}|{time.monotonic() - started:.1f}|{exc}"
        except CollectiveError as exc:
            return f"error|{exc.group}|{time.monotonic() - started:.1f}|{exc}"
        finally:
            timed_out.set()
        return "completed"
    # Alive (not a dead peer) until rank 1's wait has run out, so that wait is a timeout.
    assert timed_out.wait(30), "rank 1 never finished its wait"
    return "idle"


def _wait_for_a_missing_peer(wait_s: float, group_s: float | None) -> list[str]:
    timed_out = multiprocessing.get_context("spawn").Event()
    values = run_processes(
        _collective_child, 2, (find_free_port(), timed_out, wait_s, group_s), timeout_s=60
    )
    return values[1].split("|", 3)


@pytest.mark.timeout(60)
def test_wait_work_times_out_with_the_operation_and_group_named() -> None:
    kind, group, seconds, text = _wait_for_a_missing_peer(0.5, None)
    assert kind == "timeout" and group == "(0, 1)", text
    assert float(seconds) < 2.0
    assert "broadcast of the test tensor did not complete within 0.5 s" in text
    assert "on the group of ranks [0, 1]" in text


def _dead_peer_child(rank: int, port: int) -> str:
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=20)
    dist.barrier()
    if rank == 0:
        os._exit(9)  # dies with its connections open: the peer sees them close
    work = dist.broadcast(torch.zeros(1), 0, async_op=True)
    started = time.monotonic()
    try:
        wait_work(work, operation="broadcast from the dead rank", timeout_s=15)
    except CollectiveTimeout as exc:
        return f"timeout|{exc.group}|{time.monotonic() - started:.1f}|{exc}"
    except CollectiveError as exc:
        return f"error|{exc.group}|{time.monotonic() - started:.1f}|{exc}"
    return "completed"


@pytest.mark.timeout(60)
def test_a_wait_longer_than_the_groups_own_timeout_still_reads_as_a_timeout() -> None:
    """gloo ends the operation at the group's timeout (1 s); the caller waited with 10 s. That
    early end is the group's timeout, not a dead peer."""
    kind, _, seconds, text = _wait_for_a_missing_peer(10.0, 1.0)
    assert kind == "timeout", text
    assert float(seconds) < 5.0 and "within 1.0 s" in text


@pytest.mark.timeout(60)
def test_a_dead_peer_is_a_collective_error_at_once_not_a_timeout() -> None:
    """Told apart by when the wait failed (torch raises RuntimeError for both on gloo)."""
    values = run_processes(
        _dead_peer_child, 2, (find_free_port(),), timeout_s=60, expected_exits={0: 9}
    )
    kind, group, seconds, text = values[1].split("|", 3)
    assert kind == "error", values[1]
    assert group == "(0, 1)" and float(seconds) < 5.0
    assert "broadcast from the dead rank failed after" in text
    assert "peer most likely died" in text and "limit of 15.0 s" in text


def test_find_free_port_is_bindable() -> None:
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
