"""Async weight sync: a buffer clone written on a thread of its own, installed at safe points.

In the async modes (:attr:`SyncMode.ASYNC_PER_GENERATION`, :attr:`SyncMode.ASYNC_PER_FORWARD`)
generation never pauses for a sync. The transfer writes a :class:`WeightBuffer`, a clone of the
served weights, on the :class:`WeightSyncThread`, while generation keeps reading the served
tensors. The backend calls :func:`install_inference_sync` at its own safe point (before each
generation call, or before each policy forward, whichever the buffer's mode names), which
copies the newest complete buffer version into the served tensors on the generation thread
itself, so no forward can run during the copy.

Three fences keep this honest:

* **Publish after the write completes.** A buffer version becomes installable only when its
  write returned without error and its device work finished. A failed write leaves nothing to
  install: the served weights stay whole, at their old version.
* **Reverse fence.** The next write into the buffer waits until an install that is reading it
  has finished (on the host and, for CUDA tensors, on the device). Without it a slow install
  could copy half of version ``v`` and half of ``v + 1`` into the served tensors.
* **Stop fences the thread.** :meth:`WeightSyncThread.stop` drains the queue, runs the device
  fence, and raises clearly if the thread failed or overstayed.

A version that was published but overwritten before any safe point installed it is counted as
*superseded* (the backend was busy for longer than a sync interval; not an error).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from ._deadline import deadline_after, limit_of, wait_arg, wait_device_event
from .backend import RolloutBase
from .errors import FenceTimeout, WeightSyncThreadError
from .guard import device_fence
from .sync.mode import SyncMode
from .trace import SpanKind, Timeline

__all__ = [
    "BufferStatistics",
    "InstallReport",
    "SupportsWeightBuffer",
    "WeightBuffer",
    "WeightSyncThread",
    "WeightSyncThreadError",
    "install_inference_sync",
]

T = TypeVar("T")


@dataclass(frozen=True)
class BufferStatistics:
    """A snapshot of a :class:`WeightBuffer`."""

    published_version: int | None
    """The newest complete version in the buffer (``None``: nothing installable)."""
    installed_version: int | None
    """The version the last install copied into the served tensors."""
    writes: int
    failed_writes: int
    installs: int
    superseded: int
    """Published versions overwritten before any safe point installed them."""
    fence_waits: int
    """Writes that had to wait for an install to finish reading (the reverse fence)."""
    writing: bool
    installing: bool


@dataclass(frozen=True)
class InstallReport:
    """What one :func:`install_inference_sync` call installed."""

    version: int
    previous_version: int
    superseded: int
    """Versions skipped since the previous install (published, overwritten, never served)."""
    install_s: float


class _WriteHandle:
    """Yielded by :meth:`WeightBuffer.write`: the tensors to write, and the version they hold."""

    __slots__ = ("tensors", "version")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.version: int | None = None


class WeightBuffer:
    """A clone of the served weights that async syncs write and safe points install.

    Args:
        served: the served tensors to clone (names, shapes, dtypes, devices are kept).
        mode: which safe point installs it (an async :class:`SyncMode`).
        timeline: records installs as ``weight_write`` spans (they write served tensors).
        fence_timeout_s: default limit of the reverse fence and the device waits.
        reverse_fence: ``False`` disables the reverse fence. For tests that show it matters.
    """

    def __init__(
        self,
        served: Mapping[str, torch.Tensor],
        *,
        mode: SyncMode = SyncMode.ASYNC_PER_FORWARD,
        timeline: Timeline | None = None,
        fence_timeout_s: float = 60.0,
        reverse_fence: bool = True,
    ) -> None:
        if not mode.is_async:
            raise ValueError(
                f"a WeightBuffer serves an async mode, got {mode}; "
                "SyncMode.SYNC writes the served tensors directly"
            )
        if not served:
            raise ValueError("a WeightBuffer needs at least one served tensor to clone")
        with torch.no_grad():
            self.tensors: dict[str, torch.Tensor] = {
                name: t.detach().clone(memory_format=torch.contiguous_format)
                for name, t in served.items()
            }
        self.mode = mode
        self.timeline = timeline
        self.fence_timeout_s = fence_timeout_s
        self.reverse_fence = reverse_fence
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._published: int | None = None
        self._published_installed = False
        self._installed: int | None = None
        self._writing = False
        self._installing = 0
        self._install_event: Any = None
        self._writes = self._failed_writes = self._installs = 0
        self._superseded = self._superseded_since_install = self._fence_waits = 0

    def __repr__(self) -> str:
        s = self.statistics()
        state = "writing" if s.writing else "installing" if s.installing else "idle"
        return (
            f"<WeightBuffer {self.mode.value} {state}: published v{s.published_version}, "
            f"installed v{s.installed_version}, {s.superseded} superseded>"
        )

    # -- the writer (the weight-sync thread) ---------------------------------------------------

    @contextmanager
    def write(self, timeout: float | None = None) -> Iterator[_WriteHandle]:
        """Hold the buffer for one write; set ``handle.version`` and exit to publish it.

        Waits first for an install that is reading the buffer to finish (the reverse fence),
        on the host and on the device. A version published earlier and not yet installed is
        lost the moment the write starts (counted as superseded). If the body raises, or exits
        without setting ``handle.version``, nothing is published.

        Raises:
            FenceTimeout: the install in progress did not finish within ``timeout`` seconds.
            RuntimeError: another write is in progress (one writer only).
        """
        limit = limit_of(timeout, self.fence_timeout_s)
        deadline = deadline_after(limit)
        with self._lock:
            if self._writing:
                raise RuntimeError(
                    "WeightBuffer.write: another write is in progress; "
                    "only the weight-sync thread writes the buffer"
                )
            if self.reverse_fence and self._installing:
                self._fence_waits += 1
                while self._installing:
                    woken = self._changed.wait(wait_arg(deadline))
                    if not woken and self._installing:
                        raise FenceTimeout(
                            f"WeightBuffer.write: an install of v{self._published} was "
                            f"still reading the buffer after {limit:.1f} s (reverse fence); "
                            "is a safe point stuck?"
                        )
            install_event = self._install_event
            self._writing = True
            if self._published is not None and not self._published_installed:
                self._superseded += 1
                self._superseded_since_install += 1
            self._published = None
        handle = _WriteHandle(self.tensors)
        ok = False
        try:
            if self.reverse_fence and install_event is not None:
                wait_device_event(
                    install_event,
                    deadline,
                    lambda: FenceTimeout(
                        f"WeightBuffer.write: an install's device reads did not complete within "
                        f"{limit:.1f} s (reverse fence)"
                    ),
                )
            yield handle
            if handle.version is not None:
                # Publish only what the device has finished writing.
                device_fence(limit)
                ok = True
        finally:
            with self._lock:
                self._writing = False
                self._writes += 1
                if ok:
                    self._published = handle.version
                    self._published_installed = False
                else:
                    self._failed_writes += 1
                self._changed.notify_all()

    # -- the installer (the backend, at its safe point) ----------------------------------------

    def install_into(self, rollout: RolloutBase) -> InstallReport | None:
        """Copy the newest published version into ``rollout``'s served tensors, if newer.

        Call on the generation thread at a safe point: the copy is the caller's forward-free
        window. Returns at once with ``None`` when there is nothing newer or a write is in
        progress (the installed version keeps serving; generation never waits for a sync).
        """
        with self._lock:
            version = self._published
            if self._writing or version is None or self._published_installed:
                return None
            if version <= rollout.weight_version and not rollout.weights_torn:
                self._published_installed = True
                return None
            self._installing += 1
        start = time.perf_counter()
        previous = rollout.weight_version
        event: Any = None
        ok = False
        try:
            span = (
                self.timeline.span(SpanKind.WEIGHT_WRITE, f"install v{version}", previous=previous)
                if self.timeline is not None
                else None
            )
            if span is None:
                rollout.load_weights(self.tensors)
            else:
                with span:
                    rollout.load_weights(self.tensors)
            event = _record_event_if_cuda(self.tensors)
            rollout.commit_weight_version(version)
            ok = True
        finally:
            with self._lock:
                self._installing -= 1
                skipped = self._superseded_since_install
                if ok:
                    self._install_event = event
                    self._installs += 1
                    self._installed = version
                    self._published_installed = True
                    self._superseded_since_install = 0
                self._changed.notify_all()
        return InstallReport(version, previous, skipped, time.perf_counter() - start)

    # -- introspection -------------------------------------------------------------------------

    @property
    def published_version(self) -> int | None:
        return self._published

    def statistics(self) -> BufferStatistics:
        with self._lock:
            return BufferStatistics(
                published_version=self._published,
                installed_version=self._installed,
                writes=self._writes,
                failed_writes=self._failed_writes,
                installs=self._installs,
                superseded=self._superseded,
                fence_waits=self._fence_waits,
                writing=self._writing,
                installing=self._installing > 0,
            )


def _record_event_if_cuda(tensors: Mapping[str, torch.Tensor]) -> Any:
    if any(t.is_cuda for t in tensors.values()):
        event = torch.cuda.Event()
        event.record()
        return event
    return None


@runtime_checkable
class SupportsWeightBuffer(Protocol):
    """A backend that takes a :class:`WeightBuffer` and installs it at its safe points.

    It calls :func:`install_inference_sync` before each generation call (``at=
    SyncMode.ASYNC_PER_GENERATION``) and before each policy forward (``at=
    SyncMode.ASYNC_PER_FORWARD``); the buffer's mode decides which of the two installs.
    """

    def attach_weight_buffer(self, buffer: WeightBuffer) -> None:
        """Install ``buffer`` at the safe points from now on."""
        ...


def install_inference_sync(
    rollout: RolloutBase, buffer: WeightBuffer | None, *, at: SyncMode | None = None
) -> InstallReport | None:
    """Install the newest complete buffer version into ``rollout``, at a safe point.

    A backend calls this on its generation thread where no forward is running: before each
    generation call with ``at=SyncMode.ASYNC_PER_GENERATION``, before each policy forward with
    ``at=SyncMode.ASYNC_PER_FORWARD``. It installs only at the point the buffer's mode names
    (``at=None``: at any point), never waits for a write in progress, and returns ``None`` when
    it installed nothing. Versions overwritten before they could be installed are counted in
    the report's ``superseded``.
    """
    if buffer is None or (at is not None and at is not buffer.mode):
        return None
    return buffer.install_into(rollout)


# -- the weight-sync thread --------------------------------------------------------------------


_P2R_PRIORITY = 0
_R2R_PRIORITY = 1
_STOP_PRIORITY = 9


@dataclass(frozen=True)
class _Job:
    kind: str
    run: Callable[[], Any]
    future: concurrent.futures.Future[Any]


class WeightSyncThread:
    """Runs async-mode transfers on a thread of its own, each inside the egress-hold bracket.

    Jobs are taken P2R first, then R2R (oldest first within a kind): a replica that has both
    queued brings in the newest weights before forwarding them. Each job runs inside
    ``bracket(name)`` (the worker passes the guard's bracket with the pause off and the egress
    hold on), so no payload send overlaps a weight collective here either.

    Args:
        bracket: a context-manager factory taking the job's name.
        name: the thread's name.
        fence: the device fence run by :meth:`stop` after the queue drained.
    """

    def __init__(
        self,
        bracket: Callable[[str], AbstractContextManager[object]],
        *,
        name: str = "weight-sync",
        fence: Callable[[float | None], None] = device_fence,
    ) -> None:
        self._bracket = bracket
        self._fence = fence
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._stopped = False
        self._error: BaseException | None = None
        self._done = 0
        self._failed = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = (
            "stopped" if self._stopped else "running" if self._thread.is_alive() else "not started"
        )
        return (
            f"<WeightSyncThread {state}: {self._queue.qsize()} queued, {self._done} done, "
            f"{self._failed} failed>"
        )

    def start(self) -> WeightSyncThread:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()
        return self

    def submit(self, kind: str, run: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``run`` as a ``"p2r"`` or ``"r2r"`` job; its future gets the value or error."""
        if kind not in ("p2r", "r2r"):
            raise ValueError(f"job kind must be 'p2r' or 'r2r', got {kind!r}")
        with self._lock:
            if self._stopped:
                raise WeightSyncThreadError(
                    f"{kind} job submitted after the weight-sync thread was stopped"
                )
        self.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        priority = _P2R_PRIORITY if kind == "p2r" else _R2R_PRIORITY
        self._queue.put((priority, next(self._seq), _Job(kind, run, future)))
        return future

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float = 60.0) -> None:
        """Drain the queue, fence the device, join the thread; bounded by ``timeout`` seconds.

        Raises:
            WeightSyncThreadError: the thread did not finish in time, or its loop or the
                device fence failed. (A failed *job* is reported through its future.)
        """
        with self._lock:
            self._stopped = True
            started = self._started
        if not started:
            return
        self._queue.put((_STOP_PRIORITY, next(self._seq), None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WeightSyncThreadError(
                f"the weight-sync thread did not drain and stop within {timeout:.1f} s "
                f"({self._queue.qsize()} job(s) still queued; a transfer is likely waiting for "
                "a peer)"
            )
        if self._error is not None:
            raise WeightSyncThreadError("the weight-sync thread failed") from self._error

    def _run(self) -> None:
        try:
            while True:
                _, _, job = self._queue.get()
                if job is None:
                    break
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    with self._bracket(f"{job.kind}_async"):
                        value = job.run()
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    self._failed += 1
                    job.future.set_exception(exc)
                else:
                    self._done += 1
                    job.future.set_result(value)
            self._fence(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self._error = exc
