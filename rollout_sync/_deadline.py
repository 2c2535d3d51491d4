"""Deadlines: what a timeout leaves, bounded polling, and bounded waits on collectives.

Every blocking call in rollout_sync takes a timeout in seconds and fails loudly when it runs
out. The arithmetic of that lives here, once:

* a timeout becomes a *limit* (:func:`limit_of`: ``None`` means a default, ``math.inf`` means for
  ever on purpose, a negative or NaN one is refused) and a *deadline* on ``time.monotonic()``'s
  clock (:func:`deadline_after`);
* a deadline becomes what each kind of wait takes: :func:`remaining` (seconds, never negative,
  ``inf`` for ever), :func:`wait_arg` (``Condition.wait`` / ``Thread.join`` / ``Event.wait``:
  ``None`` for ever), :func:`wait_timedelta` (torch's ``Work.wait``);
* device work is waited for by polling a CUDA event against a deadline
  (:func:`wait_device_event`, :func:`wait_device_idle`), never by ``synchronize()``, which cannot
  be bounded;
* a collective is waited for with :func:`wait_collective`, which turns a failure into the
  package's :class:`~rollout_sync.errors.CollectiveTimeout` (the limit ran out) or
  :class:`~rollout_sync.errors.CollectiveError` (it failed before: typically a peer that died and
  closed its connection). Torch gives one type to both on gloo (``RuntimeError``), so the two are
  told apart by a network-error type where torch raises one and otherwise by *when* the wait
  failed, never by the text of the message. Given the group's abort flag
  (:class:`~rollout_sync._group_abort.GroupAbort`), a failed wait posts it and every other wait
  of the group ends at it, so one rank's view of a dead peer reaches them all.

Private: the public faces are :func:`rollout_sync.distributed.wait_work` and the timeouts each
class documents.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CollectiveError, CollectiveTimeout

if TYPE_CHECKING:
    from ._group_abort import GroupAbort

T = TypeVar("T")

DEVICE_POLL_S = 50e-6
"""How often a CUDA event is polled while waiting for device work."""

ABORT_POLL_S = 0.02
"""How often a wait on a gloo group reads the group's abort flag (one store ``check``)."""

_DEADLINE_SLACK_S = 0.01
"""A collective that failed this close to its deadline is taken to have timed out."""

_MIN_WAIT = datetime.timedelta(milliseconds=1)


def limit_of(timeout: float | None, default: float) -> float:
    """The limit ``timeout`` stands for: ``default`` for ``None``, else itself.

    Raises:
        ValueError: a negative or NaN timeout (``math.inf`` is allowed: wait for ever on purpose).
    """
    limit = default if timeout is None else timeout
    if not limit >= 0:
        raise ValueError(f"timeout must be >= 0 seconds (or math.inf), got {timeout!r}")
    return limit


def deadline_after(limit: float) -> float:
    """The ``time.monotonic()`` deadline ``limit`` seconds from now (``inf`` stays ``inf``)."""
    return time.monotonic() + limit


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline``: never negative, ``inf`` for an infinite deadline."""
    if math.isinf(deadline):
        return math.inf
    return max(0.0, deadline - time.monotonic())


def expired(deadline: float) -> bool:
    """Whether ``deadline`` has passed."""
    return time.monotonic() >= deadline


def wait_arg(deadline: float) -> float | None:
    """``deadline`` as the ``timeout`` of ``Condition.wait``, ``Thread.join`` or ``Event.wait``:
    seconds left, or ``None`` (wait for ever) for an infinite deadline."""
    if math.isinf(deadline):
        return None
    return max(0.0, deadline - time.monotonic())


def wait_timedelta(deadline: float) -> datetime.timedelta:
    """``deadline`` as the timeout of torch's ``Work.wait`` (at least a millisecond: torch
    treats zero as "no limit")."""
    return max(datetime.timedelta(seconds=remaining(deadline)), _MIN_WAIT)


def group_timedelta(seconds: float) -> datetime.timedelta:
    """A process group's timeout (``init_process_group``, ``new_group``).

    Raises:
        ValueError: not a positive, finite number of seconds.
    """
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"a process group timeout must be > 0 seconds, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


# -- device work -------------------------------------------------------------------------------


def wait_device_event(event: Any, deadline: float, timed_out: Callable[[], BaseException]) -> None:
    """Poll a CUDA event (anything with ``query()``) until it completes.

    Raises:
        ``timed_out()``: ``deadline`` passed first; built then, so it can say what is stuck.
    """
    while not event.query():
        if expired(deadline):
            raise timed_out()
        time.sleep(DEVICE_POLL_S)


def wait_device_idle(deadline: float, timed_out: Callable[[], BaseException]) -> None:
    """Wait until the work enqueued so far on the current CUDA stream has completed.

    A no-op where CUDA is not in use in this process (CPU work and gloo collectives are
    synchronous already).

    Raises:
        ``timed_out()``: the device work did not complete by ``deadline``.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    event = torch.cuda.Event()
    event.record()
    wait_device_event(event, deadline, timed_out)


# -- collectives -------------------------------------------------------------------------------


def wait_collective(
    works: Sequence[dist.Work | None],
    *,
    operation: str,
    timeout_s: float,
    ranks: Sequence[int],
    abort: GroupAbort | None = None,
) -> None:
    """Wait for ``works`` (``async_op=True`` handles) to complete, all within ``timeout_s``.

    ``None`` entries (what torch returns to a rank outside the group) are skipped. With
    ``abort`` (the group's flag, :class:`~rollout_sync._group_abort.GroupAbort`), a failure
    here is posted to every rank of the group, and a failure another rank posted ends this wait
    within :data:`ABORT_POLL_S` (gloo; on NCCL, only a failure this process has seen already,
    before the wait starts).

    Raises:
        CollectiveTimeout: they did not complete within ``timeout_s`` (a peer hung, never
            reached the same collective, or is too slow for the limit).
        CollectiveError: the backend reported a failure before the limit (typically a peer that
            died: its connection closed), or another rank of the group posted one. Both name
            ``operation`` and the group's ``ranks``, and say that the group should be
            considered broken afterwards.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    for work in works:
        if work is None:
            continue
        try:
            completed = _wait_one(work, deadline, abort, operation, ranks, timeout_s, start)
        except CollectiveError:  # another rank's abort: raised as it is
            raise
        except Exception as exc:  # re-raised below as the package's typed error
            error = collective_failure(exc, operation, ranks, timeout_s, start)
            if abort is not None:
                abort.post(f"{error}")
            raise error from exc
        if completed is False:
            error = _timeout(operation, ranks, timeout_s)
            if abort is not None:
                abort.post(f"{error}")
            raise error


def _wait_one(
    work: dist.Work,
    deadline: float,
    abort: GroupAbort | None,
    operation: str,
    ranks: Sequence[int],
    timeout_s: float,
    start: float,
) -> bool | None:
    """``work.wait`` within ``deadline``, ended early by ``abort``'s flag.

    On gloo the wait runs on a waiter thread (:data:`_WAITERS`) while this one polls the flag
    (gloo's point-to-point work neither completes without a wait nor survives a wait that timed
    out, so neither polling ``is_completed`` nor waiting in slices would do); a wait given up
    is left to end at the group's own timeout. The flag's store is read only once a wait has
    lasted a poll: a wait that completes at once costs no store round trip. Elsewhere (NCCL:
    the wait orders the caller's CUDA stream, so it must run on the caller's thread) only a
    flag this process has already seen is read, before the wait.
    """
    if abort is not None and abort.seen() is not None:
        _raise_if_aborted(abort, operation, ranks, start)
    if abort is None or abort.backend != "gloo" or work.is_completed():
        # No limit for an infinite deadline (a timedelta cannot hold one).
        return work.wait() if math.isinf(deadline) else work.wait(wait_timedelta(deadline))

    def wait() -> bool | None:
        return work.wait() if math.isinf(deadline) else work.wait(wait_timedelta(deadline))

    waited = _WAITERS.submit(wait)
    while True:
        try:
            return waited.result(timeout=ABORT_POLL_S)
        except concurrent.futures.TimeoutError:
            _raise_if_aborted(abort, operation, ranks, start)


class _WaiterThreads:
    """Daemon threads that run blocking waits for callers, reused: a thread that finished a
    wait takes the next; one more starts only when every thread is busy (a wait given up on
    keeps its thread until the group's own timeout ends it). Daemon threads, so a process
    never waits at exit for a wait it gave up."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._jobs = queue.SimpleQueue()
        self._idle = 0
        """Threads waiting for a job and not yet promised one."""
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put((job, future))
        if start:
            threading.Thread(target=self._run, name="rollout_sync wait", daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            with self._lock:
                self._idle += 1


_WAITERS = _WaiterThreads()
"""The process's waiter threads for gloo waits (:func:`_wait_one`)."""


def _raise_if_aborted(
    abort: GroupAbort, operation: str, ranks: Sequence[int], start: float
) -> None:
    reason = abort.reason()
    if reason is None:
        return
    elapsed = time.monotonic() - start
    raise CollectiveError(
        f"{operation} was abandoned after {elapsed:.2f} s on the group of ranks {list(ranks)}: "
        f"another rank of the group saw it fail ({' '.join(reason.split())[:400]}). The group "
        "is unusable now; re-create it.",
        operation=operation,
        group=ranks,
    )


def collective_failure(
    exc: BaseException, operation: str, ranks: Sequence[int], timeout_s: float, start: float
) -> CollectiveError:
    """The package's error for a collective that raised ``exc`` after starting at ``start``
    (on ``time.monotonic()``'s clock) with a limit of ``timeout_s`` seconds."""
    elapsed = time.monotonic() - start
    network = isinstance(exc, dist.DistNetworkError)
    if not network and elapsed >= timeout_s - _DEADLINE_SLACK_S:
        return _timeout(operation, ranks, timeout_s)
    detail = " ".join(str(exc).split())[:400]
    return CollectiveError(
        f"{operation} failed after {elapsed:.2f} s on the group of ranks {list(ranks)}, well "
        f"before its limit of {timeout_s:.1f} s: {type(exc).__name__}: {detail} (a peer most "
        "likely died and its connection closed; check its log). The group is unusable now; "
        "re-create it.",
        operation=operation,
        group=ranks,
    )


def _timeout(operation: str, ranks: Sequence[int], timeout_s: float) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"{operation} did not complete within {timeout_s:.1f} s on the group of ranks "
        f"{list(ranks)} (a peer hung, died without closing its connection, or never reached the "
        "same collective). The group is unusable now; re-create it.",
        operation=operation,
        group=ranks,
        timeout=timeout_s,
    )
