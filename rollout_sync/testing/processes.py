"""The process harness: spawn a group of processes, bounded, with every child's traceback.

For tests, benchmarks and demos that start their own processes on one machine. A job placed by
a launcher (torchrun, Ray) starts its processes there instead and joins with
:func:`rollout_sync.distributed.init_process_group`.

* :func:`find_free_port` - a TCP port nobody listens on now (from
  :mod:`rollout_sync.distributed`; here for the tests that pick loopback rendezvous).
* :func:`run_processes` - spawn ``nprocs`` children running ``target(rank, *args)``, collect
  their return values, and raise :class:`~rollout_sync.errors.GroupProcessError` with every
  child's traceback when one fails, dies or overstays. A child killed by a signal reports the
  negative signal number as its exit code (``-9`` for SIGKILL), as :mod:`multiprocessing` does.
  A :class:`~rollout_sync.testing.FaultSchedule` (:mod:`.faults`) kills named children at named
  points, and their exits are expected.
* :func:`run_group` - the same for a job of one process group: each child joins it first.

Children return typed values (dataclasses of their own; exceptions as
:class:`~rollout_sync.testing.ErrorReport`, :class:`~rollout_sync.testing.SyncOutcome`), which
come back by value.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import pickle
import queue
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..distributed import find_free_port, init_process_group, wait_work
from ..errors import ChildFailure, GroupProcessError, RolloutSyncError
from .faults import FaultSchedule
from .faults import install as install_faults

T = TypeVar("T")

__all__ = [
    "ChildFailure",
    "GroupProcessError",
    "ServerOutput",
    "find_free_port",
    "run_group",
    "run_processes",
    "stop_process",
]


# -- spawning a group of processes -------------------------------------------------------------


def _child_main(
    target: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    results: multiprocessing.Queue[tuple[str, int, Any]],
    intra_op_threads: int | None,
    own_process_group: bool = False,
    faults: FaultSchedule | None = None,
) -> None:
    """Run ``target(rank, *args)`` and report its value or its traceback to the parent."""
    if own_process_group:
        os.setpgid(0, 0)  # the parent can then kill this child and whatever it started
    install_faults(faults, rank)
    try:
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)
        value = target(rank, *args)
    except BaseException:  # noqa: BLE001 - every failure is reported, then the child exits
        results.put(("error", rank, traceback.format_exc()))
        _destroy_group_quietly()
        raise SystemExit(1) from None
    try:
        # Pickled here, by value: the queue's own pickler would share tensors through file
        # descriptors that vanish when this process exits.
        results.put(("ok", rank, pickle.dumps(value)))
    except Exception:  # noqa: BLE001 - an unpicklable result is itself a reportable failure
        results.put(("error", rank, traceback.format_exc()))
    _destroy_group_quietly()


def _destroy_group_quietly() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a broken group cannot be torn down cleanly
            pass


_default_start_method = "spawn"


def use_start_method(method: str, *, preload: Sequence[str] = ()) -> None:
    """Make :func:`run_processes` start its children with ``method`` unless a call names one.

    ``"forkserver"`` with ``preload=["torch", ...]`` imports those modules once, in the fork
    server, and forks every child from it: a child starts with them imported instead of
    importing torch itself (seconds per child on a small machine). The fork server runs no
    torch code, so its children are as clean as spawned ones. Call it before the first
    :func:`run_processes` (a test suite's conftest).
    """
    global _default_start_method
    if method == "forkserver" and preload:
        multiprocessing.set_forkserver_preload(list(preload))
    _default_start_method = method


def run_processes(
    target: Callable[..., T],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
    start_method: str | None = None,
    expected_exits: Mapping[int, int] | None = None,
    grace_s: float = 10.0,
    what: str = "run_processes",
    env: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
    daemon: bool = True,
    faults: FaultSchedule | None = None,
) -> dict[int, T]:
    """Run ``target(rank, *args)`` in ``nprocs`` fresh processes; return their values by rank.

    ``target`` must be importable by name (a module-level function), as the children start
    fresh (spawned, or forked from a fork server: :func:`use_start_method`), never forked from
    the caller. A child's return value must be picklable.

    Args:
        timeout_s: the limit for the whole group. A child still running then is killed.
        expected_exits: ``rank -> exit code`` for children that are meant to die without
            reporting; they are not failures (and have no value).
        faults: a :class:`~rollout_sync.testing.FaultSchedule`: each child is armed with its
            kill, and the processes it kills are expected to exit so.
        grace_s: after the first failure, how long the others get to finish (they usually
            fail fast too, and their tracebacks help) before they are killed.
        env: environment variables set for the children (inherited by spawn; a fork server
            started earlier has the environment it started with).
        intra_op_threads: ``torch.set_num_threads`` in each child. Pass 1 when the group
            oversubscribes the machine's cores: torch's intra-op pool spin-waits, and a copy
            big enough to be split across it can then take tens of times longer.
        daemon: ``False`` for children that start processes of their own (vLLM's engine
            core; a daemonic process may not). Each child then leads a process group of its
            own, and a child that overstays is killed with everything it started.

    Raises:
        GroupProcessError: a child raised, died with an unexpected exit code, overstayed, or
            returned a value that does not unpickle here. Every child is joined or killed
            before this returns or raises.
        ValueError: an exit expected of a rank outside the group, or expected twice (in
            ``expected_exits`` and in ``faults``); nothing was started.
    """
    # Typed loosely: the stubs' BaseContext lacks Process, which every concrete context has.
    ctx: Any = multiprocessing.get_context(start_method or _default_start_method)
    expected = dict(expected_exits or {})
    if faults is not None:
        if expected.keys() & faults.expected_exits.keys():
            raise ValueError("a rank's exit is expected twice: in expected_exits and in faults")
        expected.update(faults.expected_exits)
    strangers = sorted(set(expected) - set(range(nprocs)))
    if strangers:
        raise ValueError(
            f"exits are expected of ranks {strangers}, but the group has ranks 0..{nprocs - 1}"
        )
    results_queue: multiprocessing.Queue[tuple[str, int, Any]] = ctx.Queue()
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = {
            rank: ctx.Process(
                target=_child_main,
                args=(target, rank, args, results_queue, intra_op_threads, not daemon, faults),
                name=f"{what}-rank{rank}",
                daemon=daemon,
            )
            for rank in range(nprocs)
        }
        for proc in procs.values():
            proc.start()
    finally:
        for key, old in saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old

    values: dict[int, T] = {}
    failures: list[ChildFailure] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    try:
        while True:
            _drain_reports(results_queue, values, failures, reported)
            pending = [r for r, p in procs.items() if r not in reported and r not in expected]
            for rank in pending:
                proc = procs[rank]
                if not proc.is_alive() and proc.exitcode is not None:
                    # A report may still be in the queue's pipe: give it one last look.
                    _drain_reports(results_queue, values, failures, reported, wait_s=0.2)
                    if rank not in reported:
                        reported.add(rank)
                        failures.append(
                            ChildFailure(
                                rank,
                                proc.exitcode,
                                f"exited with code {proc.exitcode} without reporting a result "
                                "(killed, crashed in native code, or called os._exit)",
                            )
                        )
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
            pending = [r for r, p in procs.items() if r not in reported and r not in expected]
            unexpected_alive = [r for r in expected if procs[r].is_alive()]
            if not pending and not unexpected_alive:
                break
            now = time.monotonic()
            give_up = now > deadline or (
                first_failure_at is not None and now > first_failure_at + grace_s
            )
            if give_up:
                for rank in pending + unexpected_alive:
                    failures.append(
                        ChildFailure.overstayed(
                            rank,
                            past_limit=now > deadline,
                            limit_s=timeout_s,
                            grace_s=grace_s,
                            group="group",
                        )
                    )
                break
            if not pending:
                # Only children expected to die are left; wait for them without a report.
                time.sleep(0.01)  # polling exit codes; nothing to read from the queue
                continue
            _drain_reports(results_queue, values, failures, reported, wait_s=0.05)
    finally:
        for proc in procs.values():
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
            if not daemon and proc.pid is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # what the child left behind
                except (ProcessLookupError, PermissionError):
                    pass
        results_queue.close()
        results_queue.join_thread()

    for rank, code in expected.items():
        got = procs[rank].exitcode
        if got != code and not any(f.rank == rank for f in failures):
            failures.append(ChildFailure(rank, got, f"was expected to exit with code {code}"))
    values = dict(sorted(values.items()))  # by rank, whatever order they reported in
    if failures:
        raise GroupProcessError(failures, values, what)
    return values


def run_group(
    target: Callable[..., T],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
    group_timeout_s: float = 30.0,
    leave_together: bool = False,
    faults: FaultSchedule | None = None,
    intra_op_threads: int | None = 1,
    expected_exits: Mapping[int, int] | None = None,
    grace_s: float = 10.0,
    what: str | None = None,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
) -> dict[int, T]:
    """:func:`run_processes` for a job of one process group: each child first joins the default
    group (gloo, on a free loopback port), then runs ``target(rank, *args)``.

    ``group_timeout_s`` bounds the rendezvous and is the group's collective limit. With
    ``leave_together``, a child whose target returned waits at a barrier for the others before
    it leaves, so that nobody tears the group down while a peer still talks on it (background
    threads on the group); only for a run whose collectives all complete, as a failed transfer
    leaves a group whose next collective would not match. ``intra_op_threads`` defaults to 1,
    as a group usually oversubscribes a small machine's cores. The other arguments are
    :func:`run_processes`' own (``what`` defaults to the target's name).
    """
    if leave_together and faults is not None and faults.kills:
        raise ValueError("a group whose faults kill a process cannot leave together")
    join = (world_size, f"tcp://127.0.0.1:{find_free_port()}", group_timeout_s, leave_together)
    return run_processes(
        _group_member,
        world_size,
        (target, join, args),
        timeout_s=timeout_s,
        faults=faults,
        intra_op_threads=intra_op_threads,
        expected_exits=expected_exits,
        grace_s=grace_s,
        what=what or str(getattr(target, "__name__", "run_group")),
        env=env,
        start_method=start_method,
    )


def _group_member(
    rank: int,
    target: Callable[..., T],
    join: tuple[int, str, float, bool],
    args: tuple[Any, ...],
) -> T:
    world_size, init_method, group_timeout_s, leave_together = join
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_process_group(
        rank=rank, world_size=world_size, init_method=init_method, timeout_s=group_timeout_s
    )
    value = target(rank, *args)
    if leave_together:
        wait_work(
            dist.barrier(async_op=True),
            operation="the group's members leaving together",
            timeout_s=group_timeout_s,
        )
    return value


def _drain_reports(
    results_queue: multiprocessing.Queue[tuple[str, int, Any]],
    values: dict[int, Any],
    failures: list[ChildFailure],
    reported: set[int],
    wait_s: float = 0.0,
) -> None:
    """Move every report waiting in the queue into ``values`` / ``failures``."""
    block = wait_s > 0
    while True:
        try:
            status, rank, payload = results_queue.get(block=block, timeout=wait_s or None)
        except queue.Empty:
            return
        block = False
        reported.add(rank)
        if status == "ok":
            try:
                values[rank] = pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - a value the parent cannot rebuild
                failures.append(
                    ChildFailure(
                        rank,
                        None,
                        f"its value could not be unpickled here ({type(exc).__name__}: {exc}); "
                        "report an exception as an ErrorReport",
                    )
                )
        else:
            failures.append(ChildFailure(rank, None, str(payload)))


class ServerOutput:
    """Readiness of a server process, from what it prints: no polling.

    A thread copies the process's ``stdout`` (start it with ``stdout=subprocess.PIPE``,
    ``stderr=subprocess.STDOUT``) line by line to ``log`` (or drops it) and notes the first line
    containing ``ready_marker``, or the end of the output (the process exited).
    :meth:`wait_ready` blocks on that.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], ready_marker: str, log: Path | None = None
    ) -> None:
        if process.stdout is None:
            raise ValueError("start the process with stdout=subprocess.PIPE")
        self.process = process
        self.ready_marker = ready_marker.encode()
        self.log = log
        self.ready = False
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="server-output", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        assert self.process.stdout is not None
        sink = self.log.open("ab") if self.log is not None else None
        try:
            for line in self.process.stdout:
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if not self.ready and self.ready_marker in line:
                    self.ready = True
                    self._changed.set()
        finally:
            if sink is not None:
                sink.close()
            self._changed.set()  # the output ended: the process exited

    def wait_ready(self, timeout_s: float, what: str) -> None:
        """Return once the ready line was printed.

        Raises:
            RolloutSyncError: the process's output ended first (it exited), or ``timeout_s``
                passed; the message names ``what`` and the log.
        """
        where = f"; see {self.log}" if self.log is not None else ""
        if not self._changed.wait(timeout_s):
            raise RolloutSyncError(f"{what} was not ready within {timeout_s} s{where}")
        if not self.ready:
            self.process.wait(timeout_s)
            raise RolloutSyncError(f"{what} exited ({self.process.returncode}){where}")


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Terminate ``process``; kill it if it is still there after ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
