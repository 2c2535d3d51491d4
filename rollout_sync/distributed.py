"""Multi-process plumbing: rendezvous, bounded collectives, and spawning a group with timeouts.

Everything that starts or talks to other processes in rollout_sync goes through here, so the
rules hold in one place: every rendezvous and every collective has a timeout in seconds, every
child is joined with a deadline and killed when it overstays, and a child's exception comes back
to the parent as readable text instead of a silent non-zero exit code.

Rendezvous is torch.distributed's own: ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``) or a ``tcp://host:port`` address, so the same code runs on one machine over
loopback and on several machines.

* :func:`find_free_port` - a TCP port nobody listens on now (for loopback tests and demos).
* :func:`init_process_group` / :func:`new_group` - the torch.distributed calls, with a timeout
  that bounds the rendezvous *and* becomes the group's default collective timeout.
* :func:`wait_work` - wait for an ``async_op=True`` work handle for at most ``timeout`` seconds,
  turning a timeout or a dead peer into :class:`CollectiveError`, which names the operation.
* :func:`run_processes` - spawn ``nprocs`` children running ``target(rank, *args)``, collect
  their return values, and raise :class:`ChildProcessError` with every child's traceback when
  one fails, dies or overstays.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.context
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import RolloutSyncError

__all__ = [
    "ChildFailure",
    "CollectiveError",
    "CollectiveTimeout",
    "GroupProcessError",
    "find_free_port",
    "group_ranks",
    "init_process_group",
    "new_group",
    "run_processes",
    "wait_work",
]

DEFAULT_GROUP_TIMEOUT_S = 60.0


class CollectiveError(RolloutSyncError):
    """A collective failed: a peer died, closed its connection, or the group is broken.

    Attributes:
        operation: what was being done, in words ("broadcast bucket 3/12 from rank 0").
        group: the global ranks of the group.
    """

    def __init__(self, message: str, *, operation: str, group: Sequence[int]) -> None:
        super().__init__(message)
        self.operation = operation
        self.group = tuple(group)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within its limit (a peer hung or never joined)."""

    def __init__(
        self, message: str, *, operation: str, group: Sequence[int], timeout: float
    ) -> None:
        super().__init__(message, operation=operation, group=group)
        self.timeout = timeout


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on at the time of the call.

    Another process may take it before it is used; rendezvous on loopback within a test is the
    intended use, where that race is rare enough.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _timedelta(seconds: float) -> datetime.timedelta:
    if not seconds > 0:
        raise ValueError(f"a timeout must be > 0 seconds, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


def init_process_group(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """Join the default process group; bounded by ``timeout_s`` seconds.

    ``init_method`` is ``env://`` (rank and world size may then come from ``RANK`` and
    ``WORLD_SIZE``) or ``tcp://host:port``. ``timeout_s`` bounds the rendezvous and is the
    default limit of every collective on the group (gloo and NCCL both honour it).

    Raises:
        RuntimeError (from torch.distributed): the rendezvous did not complete in time, or the
        process already belongs to a default group.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "init_process_group: this process already joined a default process group; "
            "call torch.distributed.destroy_process_group() first"
        )
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    dist.init_process_group(
        backend, init_method=init_method, timeout=_timedelta(timeout_s), **kwargs
    )


def new_group(
    ranks: Sequence[int],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """A sub-group of ``ranks`` (global ranks) whose collectives default to ``timeout_s``.

    Every rank of the default group must call this, with the same ``ranks``, in the same order
    as every other ``new_group`` call (torch.distributed's rule). A rank outside ``ranks`` gets
    a placeholder it must not use.
    """
    group: dist.ProcessGroup | None = dist.new_group(
        sorted(ranks), timeout=_timedelta(timeout_s), backend=backend
    )
    if group is None:  # pragma: no cover - torch returns a placeholder, not None, today
        raise RuntimeError(f"new_group({list(ranks)}) returned no group")
    return group


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (``None``: the default group), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def wait_work(
    work: dist.Work,
    *,
    operation: str,
    timeout_s: float,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Wait at most ``timeout_s`` seconds for an ``async_op=True`` collective to complete.

    Raises:
        CollectiveTimeout: it did not complete in time (a peer hung or never joined).
        CollectiveError: the backend reported a failure (typically a peer that died: its
            connection closed). Both name ``operation`` and the group; the group should be
            considered broken afterwards.
    """
    ranks = group_ranks(group)
    try:
        completed = work.wait(timeout=_timedelta(timeout_s))
    except Exception as exc:  # re-raised below as a named, typed error
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CollectiveTimeout(
                f"{operation} did not complete within {timeout_s:.1f} s on the group of ranks "
                f"{list(ranks)} (a peer hung, died, or never reached the same collective). "
                "The group is unusable now; re-create it.",
                operation=operation,
                group=ranks,
                timeout=timeout_s,
            ) from exc
        raise CollectiveError(
            f"{operation} failed on the group of ranks {list(ranks)}: {text.strip()[:500]} "
            "(a peer most likely died; check its log). The group is unusable now; re-create it.",
            operation=operation,
            group=ranks,
        ) from exc
    if completed is False:
        raise CollectiveTimeout(
            f"{operation} did not complete within {timeout_s:.1f} s on the group of ranks "
            f"{list(ranks)}",
            operation=operation,
            group=ranks,
            timeout=timeout_s,
        )


# -- spawning a group of processes -------------------------------------------------------------


@dataclass(frozen=True)
class ChildFailure:
    """How one child process failed."""

    rank: int
    exitcode: int | None
    """``None``: still running when it was killed for overstaying."""
    error: str
    """The child's formatted traceback, or what the parent observed."""


class GroupProcessError(RolloutSyncError, ChildProcessError):
    """One or more children of :func:`run_processes` failed, died or overstayed.

    Attributes:
        failures: one :class:`ChildFailure` per failed child, the first to fail first.
        results: the return values of the children that did finish, by rank.
    """

    def __init__(self, failures: list[ChildFailure], results: dict[int, Any], what: str) -> None:
        parts = [
            f"--- rank {f.rank} (exit code {f.exitcode}) ---\n{f.error.rstrip()}" for f in failures
        ]
        super().__init__(f"{what}: {len(failures)} child process(es) failed\n" + "\n".join(parts))
        self.failures = failures
        self.results = results


def _child_main(
    target: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    results: multiprocessing.Queue[tuple[str, int, Any]],
    intra_op_threads: int | None,
) -> None:
    """Run ``target(rank, *args)`` and report its value or its traceback to the parent."""
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


def run_processes(
    target: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float,
    start_method: str = "spawn",
    expected_exits: Mapping[int, int] | None = None,
    grace_s: float = 10.0,
    what: str = "run_processes",
    env: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
) -> dict[int, Any]:
    """Run ``target(rank, *args)`` in ``nprocs`` fresh processes; return their values by rank.

    ``target`` must be importable by name (a module-level function), as the children are
    spawned, not forked. A child's return value must be picklable.

    Args:
        timeout_s: the limit for the whole group. A child still running then is killed.
        expected_exits: ``rank -> exit code`` for children that are meant to die without
            reporting (a peer killed mid-transfer in a test); they are not failures.
        grace_s: after the first failure, how long the others get to finish (they usually
            fail fast too, and their tracebacks help) before they are killed.
        env: environment variables set for the children (inherited by spawn).
        intra_op_threads: ``torch.set_num_threads`` in each child. Pass 1 when the group
            oversubscribes the machine's cores: torch's intra-op pool spin-waits, and a copy
            big enough to be split across it can then take tens of times longer.

    Raises:
        GroupProcessError: a child raised, died with an unexpected exit code, or overstayed.
        Every child is joined or killed before this returns or raises.
    """
    # Typed loosely: the stubs' BaseContext lacks Process, which every concrete context has.
    ctx: Any = multiprocessing.get_context(start_method)
    results_queue: multiprocessing.Queue[tuple[str, int, Any]] = ctx.Queue()
    expected = dict(expected_exits or {})
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = {
            rank: ctx.Process(
                target=_child_main,
                args=(target, rank, args, results_queue, intra_op_threads),
                name=f"{what}-rank{rank}",
                daemon=True,
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

    values: dict[int, Any] = {}
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
                    why = (
                        f"killed after the group's limit of {timeout_s:.1f} s"
                        if now > deadline
                        else f"killed {grace_s:.1f} s after another rank failed"
                    )
                    failures.append(ChildFailure(rank, None, f"still running: {why}"))
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
        results_queue.close()
        results_queue.join_thread()

    for rank, code in expected.items():
        got = procs[rank].exitcode
        if got != code and not any(f.rank == rank for f in failures):
            failures.append(ChildFailure(rank, got, f"was expected to exit with code {code}"))
    if failures:
        raise GroupProcessError(failures, values, what)
    return values


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
            values[rank] = pickle.loads(payload)
        else:
            failures.append(ChildFailure(rank, None, str(payload)))
