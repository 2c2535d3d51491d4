"""The multi-process plumbing: spawning a group, reporting children's failures, bounded waits."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollout_sync.distributed import group_timeout_s, new_group, wait_work
from rollout_sync.errors import (
    CollectiveError,
    CollectiveTimeout,
    GroupProcessError,
    PayloadSendersFailed,
    RolloutSyncTimeout,
)
from rollout_sync.testing import (
    ErrorReport,
    FaultSchedule,
    Kill,
    SyncOutcome,
    fault_point,
    find_free_port,
    run_group,
    run_processes,
)
from rollout_sync.worker import P2R, CommandResult

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


# -- the fault schedule and typed reports -------------------------------------------------------


def _counting_child(rank: int, passes: int) -> int:
    for _ in range(passes):
        fault_point("loop")
    return passes


@pytest.mark.timeout(60)
def test_a_scheduled_kill_strikes_its_rank_at_its_step_and_only_there() -> None:
    faults = FaultSchedule(Kill(1, "loop", step=2))
    # Rank 1 dies on its third pass; rank 0, not scheduled, passes every point.
    assert run_processes(_counting_child, 2, (3,), timeout_s=60, faults=faults) == {0: 3}
    # A kill that never strikes (two passes only) is a failure of the test's scenario.
    with pytest.raises(GroupProcessError, match="expected to exit with code 17"):
        run_processes(_counting_child, 2, (2,), timeout_s=60, faults=faults)


def test_a_schedule_refuses_what_it_cannot_mean() -> None:
    with pytest.raises(ValueError, match="dies once"):
        FaultSchedule(Kill(1, "a"), Kill(1, "b"))
    with pytest.raises(ValueError, match="expected twice"):
        run_processes(
            _counting_child,
            2,
            (1,),
            timeout_s=5,
            expected_exits={1: 3},
            faults=FaultSchedule(Kill(1, "loop")),
        )
    with pytest.raises(ValueError, match=r"ranks \[3\], but the group has ranks 0..1"):
        run_processes(_counting_child, 2, (1,), timeout_s=5, faults=FaultSchedule(Kill(3, "x")))
    with pytest.raises(ValueError, match="clean exit"):
        Kill(1, "loop", exit_code=0)
    with pytest.raises(ValueError, match="named point"):
        Kill(-1, "loop")
    with pytest.raises(ValueError, match="cannot leave together"):
        run_group(
            _counting_child,
            2,
            (1,),
            timeout_s=5,
            leave_together=True,
            faults=FaultSchedule(Kill(1, "loop")),
        )


class _Unrebuildable(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text}")  # args are not what __init__ takes


def _returns_an_unrebuildable_exception(rank: int) -> Exception:
    return _Unrebuildable(7, "no")


@pytest.mark.timeout(60)
def test_a_value_that_does_not_unpickle_in_the_parent_is_a_childs_failure() -> None:
    with pytest.raises(GroupProcessError, match="could not be unpickled here"):
        run_processes(_returns_an_unrebuildable_exception, 1, timeout_s=60)


def test_a_sync_outcome_refuses_a_result_it_cannot_read() -> None:
    failed = CommandResult(P2R(step=1), ok=False, error="WeightTransferError: lost")
    with pytest.raises(ValueError, match="the CommandResult that handle\\(\\) returns"):
        SyncOutcome.of(failed)  # one from the history: its exception was dropped
    with pytest.raises(TypeError, match="not str"):
        SyncOutcome.of("done")  # type: ignore[arg-type]
    assert SyncOutcome.of(CommandResult(P2R(step=1), ok=True)).ok


def test_an_error_report_matches_the_class_and_its_bases_not_a_name() -> None:
    report = ErrorReport.of(CollectiveTimeout("late", operation="x", group=(0, 1), timeout=1.0))
    assert report.is_a(CollectiveTimeout) and report.is_a(RolloutSyncTimeout, KeyError)
    assert report.is_a(TimeoutError) and not report.is_a(KeyError)
    assert str(report) == "CollectiveTimeout: late"


def test_the_packages_errors_cross_processes_whole() -> None:
    """Keyword-only constructors included: a child (or a Ray task) returns or raises them."""
    error = PayloadSendersFailed("2 lost", failed_senders={2: "closed"}, lost=2)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is PayloadSendersFailed and str(copy) == "2 lost"
    assert (copy.failed_senders, copy.lost) == ({2: "closed"}, 2)


WaitOutcome = tuple[CollectiveError | None, float]


def _wait_for(work: Any, operation: str, timeout_s: float, group: Any = None) -> WaitOutcome:
    started = time.monotonic()
    try:
        wait_work(work, operation=operation, timeout_s=timeout_s, group=group)
    except CollectiveError as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def _collective_child(
    rank: int, timed_out: Any, wait_s: float, group_s: float | None
) -> WaitOutcome | None:
    """Rank 1 waits ``wait_s`` for a broadcast rank 0 never joins, on the default group or on
    a group made with a timeout of ``group_s``."""
    group = None if group_s is None else new_group([0, 1], timeout_s=group_s)
    assert group_timeout_s(group) == (20 if group_s is None else group_s)
    if rank == 1:
        work = dist.broadcast(torch.zeros(1), 0, group=group, async_op=True)
        try:
            return _wait_for(work, "broadcast of the test tensor", wait_s, group)
        finally:
            timed_out.set()
    # Alive (not a dead peer) until rank 1's wait has run out, so that wait is a timeout.
    assert timed_out.wait(30), "rank 1 never finished its wait"
    return None


def _wait_for_a_missing_peer(wait_s: float, group_s: float | None) -> WaitOutcome:
    timed_out = multiprocessing.get_context("spawn").Event()
    values = run_group(
        _collective_child, 2, (timed_out, wait_s, group_s), timeout_s=60, group_timeout_s=20
    )
    assert values[1] is not None
    return values[1]


@pytest.mark.timeout(60)
def test_wait_work_times_out_with_the_operation_and_group_named() -> None:
    error, seconds = _wait_for_a_missing_peer(0.5, None)
    assert isinstance(error, CollectiveTimeout) and error.group == (0, 1), error
    assert seconds < 2.0
    assert "broadcast of the test tensor did not complete within 0.5 s" in str(error)
    assert "on the group of ranks [0, 1]" in str(error)


def _dead_peer_child(rank: int) -> WaitOutcome:
    dist.barrier()
    fault_point("after_barrier")  # rank 0 dies with its connections open: the peer sees them close
    work = dist.broadcast(torch.zeros(1), 0, async_op=True)
    return _wait_for(work, "broadcast from the dead rank", 15)


@pytest.mark.timeout(60)
def test_a_wait_longer_than_the_groups_own_timeout_still_reads_as_a_timeout() -> None:
    """gloo ends the operation at the group's timeout (1 s); the caller waited with 10 s. That
    early end is the group's timeout, not a dead peer."""
    error, seconds = _wait_for_a_missing_peer(10.0, 1.0)
    assert isinstance(error, CollectiveTimeout), error
    assert seconds < 5.0 and "within 1.0 s" in str(error)


@pytest.mark.timeout(60)
def test_a_dead_peer_is_a_collective_error_at_once_not_a_timeout() -> None:
    """Told apart by when the wait failed (torch raises RuntimeError for both on gloo)."""
    kill = Kill(0, "after_barrier", exit_code=9)
    values = run_group(_dead_peer_child, 2, timeout_s=60, faults=FaultSchedule(kill))
    error, seconds = values[1]
    assert type(error) is CollectiveError, error
    assert error.group == (0, 1) and seconds < 5.0
    assert "broadcast from the dead rank failed after" in str(error)
    assert "peer most likely died" in str(error) and "limit of 15.0 s" in str(error)


def test_find_free_port_is_bindable() -> None:
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
