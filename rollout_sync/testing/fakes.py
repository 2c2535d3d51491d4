"""Small real fakes: a torn-read detector, recording packers and rollouts, a fake CUDA device.

* :class:`VersionStampedModel` - weights whose every tensor carries the version that wrote it;
  a forward reads all of them, slowly enough that a concurrent write is caught, and counts
  *torn reads* (a forward that saw two versions). Writes go through ``RolloutBase.load_weights``.
* :class:`TornReadBackend` - a :class:`~rollout_sync.ThreadedRolloutBackend` serving forwards of
  that model continuously, optionally producing one payload per forward into a packer.
* :class:`RecordingPacker` - a packer with ``hold_sends`` and ``flush_pending_sends``, a bounded
  send buffer and (once started) a sender thread; :class:`FlushOnlyPacker` has only the flush,
  :class:`PlainPacker` neither.
* :class:`AsyncTornReadBackend` - a TornReadBackend that installs an async-mode weight buffer at
  its safe points (before each generation, before each forward) and records every install.
* :class:`RecordingRollout` - a blocking-style backend that logs its pause.
* :class:`EventLog` - one thread-safe, ordered log the fakes share, for order assertions.
* :class:`FakeCudaStream` / :class:`FakeCudaEvent` - a device whose events complete only when the
  test says so, with ``torch.cuda.Event``'s interface, for driving deferred event timers on CPU.
* :func:`count_host_syncs` - counts the host-device synchronizations made inside a ``with``
  block (explicit synchronizes, device-to-host reads, CUDA's own sync debug mode).

They are plain objects with real threads and real tensors; assert on what they observed.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._deadline import deadline_after, expired, limit_of, wait_arg
from ..backend import RolloutBase, ThreadedRolloutBackend
from ..buffer import WeightBuffer, install_inference_sync
from ..errors import (
    GenerationTimeout,
    InstallTimeout,
    PayloadBackpressureTimeout,
    PayloadTimeout,
    ShutdownTimeout,
)
from ..flat import FlatWeights
from ..gate import Gate
from ..sync.mode import SyncMode
from ..trace import SpanKind, Timeline

__all__ = [
    "AsyncTornReadBackend",
    "EventLog",
    "FakeCudaEvent",
    "FakeCudaStream",
    "FlushOnlyPacker",
    "ForwardResult",
    "HostSyncCount",
    "InstallRecord",
    "PlainPacker",
    "RecordingPacker",
    "RecordingRollout",
    "TornReadBackend",
    "VersionStampedModel",
    "count_host_syncs",
]


class EventLog:
    """An append-only, thread-safe list of event names (and optional details)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[str] = []

    def add(self, event: str) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[str]:
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


# -- the torn-read detector --------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardResult:
    versions_seen: tuple[int, ...]

    @property
    def torn(self) -> bool:
        return len(set(self.versions_seen)) > 1


class VersionStampedModel:
    """Weights stamped with their version, and a forward that notices a mix of versions.

    Writing version ``v`` fills every element of every tensor with ``v``. A forward reads the
    tensors one by one and pauses ``read_gap_s`` between two reads (widening the race window on
    purpose, so an unguarded concurrent write is caught rather than merely possible).

    Args:
        num_tensors, numel: the size of the fake model.
        read_gap_s: pause between reading two tensors in a forward.
        timeline: records a ``forward`` span per forward.
    """

    def __init__(
        self,
        num_tensors: int = 8,
        numel: int = 1024,
        *,
        read_gap_s: float = 50e-6,
        timeline: Timeline | None = None,
    ) -> None:
        self.weights: dict[str, torch.Tensor] = {
            f"layers.{i}.weight": torch.zeros(numel, dtype=torch.float32)
            for i in range(num_tensors)
        }
        self.read_gap_s = read_gap_s
        self.timeline = timeline
        self._lock = threading.Lock()
        self._forwarded = threading.Condition(self._lock)
        self.forwards = 0
        self.torn_reads = 0

    def forward(self) -> ForwardResult:
        """Read every tensor's stamp (first and last element) and count a torn read."""
        start = time.monotonic_ns()
        seen: list[int] = []
        for i, tensor in enumerate(self.weights.values()):
            if i and self.read_gap_s:
                time.sleep(self.read_gap_s)
            seen.append(int(tensor[0].item()))
            seen.append(int(tensor[-1].item()))
        result = ForwardResult(tuple(seen))
        with self._lock:
            self.forwards += 1
            self.torn_reads += result.torn
            self._forwarded.notify_all()
        if self.timeline is not None:
            self.timeline.add_span(
                SpanKind.FORWARD, "forward", start, versions=sorted(set(seen)), torn=result.torn
            )
        return result

    def wait_for_forwards(self, count: int, timeout: float) -> int:
        """Block until at least ``count`` forwards have completed; the number that have.

        Raises:
            GenerationTimeout: fewer did within ``timeout`` seconds (is generation parked?).
        """
        with self._forwarded:
            if not self._forwarded.wait_for(lambda: self.forwards >= count, timeout):
                raise GenerationTimeout(
                    f"{self.forwards} forward(s) completed within {timeout:.1f} s, not {count}"
                )
            return self.forwards

    def stamped(self, version: int) -> dict[str, torch.Tensor]:
        """A full set of new weights carrying ``version`` (what a trainer would send)."""
        return {name: torch.full_like(t, float(version)) for name, t in self.weights.items()}


class _Submits(Protocol):
    def submit(self, payload: Any, timeout: float | None = None) -> None: ...


class TornReadBackend(ThreadedRolloutBackend):
    """Serves forwards of a :class:`VersionStampedModel` on its own thread, without end.

    Each forward optionally submits a payload to ``packer`` (any object with
    ``submit(payload, timeout)``, a :class:`RecordingPacker` say), which blocks when the
    packer's send buffer is full.
    """

    def __init__(
        self,
        model: VersionStampedModel,
        *,
        packer: _Submits | None = None,
        pause_timeout: float = 30.0,
        timeline: Timeline | None = None,
    ) -> None:
        super().__init__(pause_timeout=pause_timeout, timeline=timeline)
        self.model = model
        self.packer = packer

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.weights

    def serve_step(self) -> None:
        result = self.model.forward()
        if self.packer is not None:
            self.packer.submit({"versions": result.versions_seen}, timeout=self.pause_timeout)


@dataclass(frozen=True)
class InstallRecord:
    """One install an :class:`AsyncTornReadBackend` made at a safe point."""

    version: int
    forward_index: int
    """The index of the forward it preceded (0-based)."""
    at: SyncMode
    thread_ident: int


class AsyncTornReadBackend(TornReadBackend):
    """A :class:`TornReadBackend` for the async modes: it installs a buffer at safe points.

    A *generation* is ``forwards_per_generation`` consecutive forwards. Before each generation
    the backend calls :func:`~rollout_sync.install_inference_sync` with
    ``at=SyncMode.ASYNC_PER_GENERATION``, before each forward with ``at=ASYNC_PER_FORWARD``;
    the attached buffer's mode decides which of them installs. Both run on the serving thread,
    between forwards, so an install never overlaps a forward. Every install is recorded in
    :attr:`installs`.
    """

    def __init__(
        self,
        model: VersionStampedModel,
        *,
        forwards_per_generation: int = 4,
        packer: _Submits | None = None,
        pause_timeout: float = 30.0,
        timeline: Timeline | None = None,
    ) -> None:
        super().__init__(model, packer=packer, pause_timeout=pause_timeout, timeline=timeline)
        if forwards_per_generation < 1:
            raise ValueError("forwards_per_generation must be >= 1")
        self.forwards_per_generation = forwards_per_generation
        self.weight_buffer: WeightBuffer | None = None
        self.installs: list[InstallRecord] = []
        self._installed = threading.Condition()
        self._forward_index = 0

    def attach_weight_buffer(self, buffer: WeightBuffer) -> None:
        self.weight_buffer = buffer

    def serve_step(self) -> None:
        if self._forward_index % self.forwards_per_generation == 0:
            self._install_at(SyncMode.ASYNC_PER_GENERATION)
        self._install_at(SyncMode.ASYNC_PER_FORWARD)
        super().serve_step()
        self._forward_index += 1

    def _install_at(self, at: SyncMode) -> None:
        report = install_inference_sync(self, self.weight_buffer, at=at)
        if report is not None:
            with self._installed:
                self.installs.append(
                    InstallRecord(report.version, self._forward_index, at, threading.get_ident())
                )
                self._installed.notify_all()

    def wait_for_install(self, version: int, timeout: float) -> None:
        """Block until a safe point installed ``version`` or a later one.

        Raises:
            InstallTimeout: none did within ``timeout`` seconds.
        """
        with self._installed:
            if not self._installed.wait_for(lambda: self.weight_version >= version, timeout):
                raise InstallTimeout(
                    f"version {version} was not installed within {timeout:.1f} s "
                    f"(serving v{self.weight_version})"
                )


class RecordingRollout(RolloutBase):
    """A blocking-style backend (base ``paused`` contract) that logs its pause to an EventLog.

    ``paused`` here logs ``pause:enter`` / ``pause:exit`` and is re-entrant; it parks nothing.
    """

    def __init__(self, log: EventLog, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.log = log
        self._weights = dict(weights) if weights is not None else {"w": torch.zeros(4)}
        self.initialize_calls = 0

    def initialize(self) -> None:
        self.initialize_calls += 1
        self.log.add("init")

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self._weights

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        self.log.add("pause:enter")
        try:
            yield
        finally:
            self.log.add("pause:exit")


class IdleFlatRollout(RolloutBase):
    """Serves ``weights`` (copied into one flat storage, so transfers write it zero-copy) and
    generates nothing: what a sync costs on its own, for benchmarks. Base ``paused`` contract."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.flat = FlatWeights.copy_of(weights)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.flat.tensors

    def flat_weight_storage(self) -> torch.Tensor | None:
        return self.flat.storage


# -- packers -----------------------------------------------------------------------------------


class RecordingPacker:
    """A payload packer with a bounded send buffer, a sender thread and both egress hooks.

    ``submit`` puts a payload in the buffer (blocking while it is full: backpressure).
    The sender thread, once :meth:`start` ed, takes payloads in order and "sends" each one as a
    section of :attr:`egress_gate` (recorded as a ``payload_send`` span, ``send_s`` long).
    ``hold_sends`` closes that gate: the send in flight completes, the next one waits, nothing
    is dropped or reordered. ``flush_pending_sends`` waits for the send in flight only.
    """

    def __init__(
        self,
        *,
        capacity: int = 16,
        send_s: float = 0.0,
        log: EventLog | None = None,
        timeline: Timeline | None = None,
        default_timeout: float = 30.0,
    ) -> None:
        self.egress_gate = Gate.for_payloads("payload send", timeout=default_timeout)
        self.capacity = capacity
        self.send_s = send_s
        self.log = log
        self.timeline = timeline
        self.default_timeout = default_timeout
        self._buffer: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._sent: list[Any] = []
        self._submitted = 0
        self._sent_lock = threading.Lock()
        self._sent_changed = threading.Condition(self._sent_lock)
        """Notified on every send and when the sender thread fails."""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- producer side -------------------------------------------------------------------------

    def submit(self, payload: Any, timeout: float | None = None) -> None:
        """Buffer ``payload`` for sending; raise :class:`PayloadBackpressureTimeout` if it stays
        full."""
        limit = limit_of(timeout, self.default_timeout)
        try:
            self._buffer.put(payload, timeout=wait_arg(deadline_after(limit)))
            with self._sent_lock:
                self._submitted += 1
        except queue.Full:
            raise PayloadBackpressureTimeout(
                f"payload send buffer stayed full ({self.capacity} payloads) for {limit:.1f} s; "
                "sends are held or too slow",
                operation="buffer a payload",
                timeout=limit,
            ) from None

    @property
    def sent(self) -> list[Any]:
        with self._sent_lock:
            return list(self._sent)

    @property
    def buffered(self) -> int:
        return self._buffer.qsize()

    # -- the egress hooks ----------------------------------------------------------------------

    @contextmanager
    def hold_sends(self, timeout: float | None = None) -> Iterator[None]:
        with self.egress_gate.exclusive(timeout):
            self._log("hold_sends:enter")
            try:
                yield
            finally:
                self._log("hold_sends:exit")

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        self.egress_gate.wait_idle(timeout)
        self._log("flush_pending_sends")

    # -- the sender ----------------------------------------------------------------------------

    def start(self) -> RecordingPacker:
        self._thread = threading.Thread(
            target=self._send_forever, name="packer-sender", daemon=True
        )
        self._thread.start()
        return self

    def wait_sent(self, count: int | None = None, timeout: float | None = None) -> None:
        """Wait until ``count`` payloads have been sent in all (``None``: every payload
        submitted so far), bounded by ``timeout``.

        Raises:
            PayloadTimeout: fewer were sent within ``timeout`` seconds (held, or not started?).
            RuntimeError: the sender thread had failed (its error is chained).
        """
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)
        with self._sent_changed:
            wanted = self._submitted if count is None else count
            while len(self._sent) < wanted:
                if self._error is not None:
                    raise RuntimeError("packer sender failed") from self._error
                if expired(deadline):
                    raise PayloadTimeout(
                        f"the packer sent {len(self._sent)} of {wanted} payloads in "
                        f"{limit:.1f} s (are its sends held, or was it never started?)",
                        operation="wait for payloads to be sent",
                        timeout=limit,
                    )
                self._sent_changed.wait(wait_arg(deadline))

    def stop(self, timeout: float = 30.0) -> None:
        """Send what is buffered, then stop the sender thread (bounded by ``timeout``).

        Raises:
            ShutdownTimeout: the sender did not stop within ``timeout`` seconds.
            RuntimeError: the sender thread had failed (its error is chained).
        """
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise ShutdownTimeout(f"packer sender did not stop within {timeout:.1f} s")
        if self._error is not None:
            raise RuntimeError("packer sender failed") from self._error

    def _send_forever(self) -> None:
        try:
            # On stop, what is already buffered is still sent: stopping loses nothing.
            while not (self._stopping.is_set() and self._buffer.empty()):
                try:
                    payload = self._buffer.get(timeout=0.05)
                except queue.Empty:
                    continue
                self.egress_gate.enter_section(float("inf"))
                try:
                    self._send(payload)
                finally:
                    self.egress_gate.exit_section()
        except BaseException as exc:
            with self._sent_changed:
                self._error = exc
                self._sent_changed.notify_all()

    def _send(self, payload: Any) -> None:
        start = time.monotonic_ns()
        if self.send_s:
            time.sleep(self.send_s)
        with self._sent_changed:
            self._sent.append(payload)
            self._sent_changed.notify_all()
        if self.timeline is not None:
            self.timeline.add_span(SpanKind.PAYLOAD_SEND, "payload send", start)

    def _log(self, event: str) -> None:
        if self.log is not None:
            self.log.add(event)


class FlushOnlyPacker:
    """A packer with ``flush_pending_sends`` only (the weaker, fallback hook)."""

    def __init__(self, log: EventLog | None = None) -> None:
        self.log = log
        self.flushes = 0

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        self.flushes += 1
        if self.log is not None:
            self.log.add("flush_pending_sends")


class PlainPacker:
    """A packer with neither hook: it ships nothing over the device's NCCL."""

    def __init__(self) -> None:
        self.packed: list[Any] = []

    def pack(self, payload: Any) -> None:
        self.packed.append(payload)


# -- a fake device for event timers ------------------------------------------------------------


class FakeCudaStream:
    """One fake CUDA stream: events recorded on it complete only when the test runs the device.

    Device time is a cursor in milliseconds: :meth:`work` enqueues that much work, and an event
    records the cursor when it is recorded. :meth:`complete_until` lets the "device" run past
    the first ``n`` events recorded. Reading ``elapsed_time`` of an incomplete event raises, as
    a real CUDA event does; waiting on an event (``synchronize``, ``wait``) is counted and
    raises, because a timer that never stalls the host must not do it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cursor_ms = 0.0
        self._recorded = 0
        self._completed = 0
        self.queries = 0
        self.events_created = 0
        self.early_elapsed_time_calls = 0
        self.waits = 0
        self.complete_after_queries: int | None = None
        """If set, the device runs past everything recorded once this many queries were made."""

    def event(self) -> FakeCudaEvent:
        """A new event on this stream (what an event factory returns)."""
        with self._lock:
            self.events_created += 1
        return FakeCudaEvent(self)

    def work(self, ms: float) -> None:
        """Enqueue ``ms`` of device work after everything recorded so far."""
        with self._lock:
            self.cursor_ms += ms

    @property
    def recorded(self) -> int:
        """Events recorded so far; pass a snapshot of it to :meth:`complete_until`."""
        return self._recorded

    def complete_until(self, n: int) -> None:
        """The device has run past the first ``n`` recorded events (never goes backwards)."""
        with self._lock:
            self._completed = max(self._completed, min(n, self._recorded))

    def complete_all(self) -> None:
        self.complete_until(self._recorded)

    def _record(self) -> tuple[int, float]:
        with self._lock:
            seq = self._recorded
            self._recorded += 1
            return seq, self.cursor_ms

    def _query(self, seq: int | None) -> bool:
        with self._lock:
            self.queries += 1
            if (
                self.complete_after_queries is not None
                and self.queries >= self.complete_after_queries
            ):
                self._completed = self._recorded
            return seq is not None and seq < self._completed


class FakeCudaEvent:
    """An event of a :class:`FakeCudaStream`, with the interface of ``torch.cuda.Event``."""

    def __init__(self, stream: FakeCudaStream) -> None:
        self.stream = stream
        self._seq: int | None = None
        self.time_ms = 0.0

    def record(self, stream: Any = None) -> None:
        self._seq, self.time_ms = self.stream._record()

    def query(self) -> bool:
        return self.stream._query(self._seq)

    def elapsed_time(self, end_event: FakeCudaEvent) -> float:
        if not (self._is_complete() and end_event._is_complete()):
            with self.stream._lock:
                self.stream.early_elapsed_time_calls += 1
            raise RuntimeError(
                "CUDA error: device not ready (elapsed_time() on an event that has not completed)"
            )
        return end_event.time_ms - self.time_ms

    def synchronize(self) -> None:
        self._count_wait()
        raise AssertionError("FakeCudaEvent.synchronize(): a host stall in code that must not")

    def wait(self, stream: Any = None) -> None:
        self._count_wait()
        raise AssertionError("FakeCudaEvent.wait(): not expected of an event timer")

    def _is_complete(self) -> bool:
        with self.stream._lock:
            return self._seq is not None and self._seq < self.stream._completed

    def _count_wait(self) -> None:
        with self.stream._lock:
            self.stream.waits += 1


# -- counting host-device synchronizations -----------------------------------------------------


@dataclass
class HostSyncCount:
    """What :func:`count_host_syncs` saw; ``total`` is what "adds no sync" must keep at zero."""

    explicit: int = 0
    """``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize`` calls."""
    device_reads: int = 0
    """``Tensor.item`` / ``tolist`` / ``cpu`` on a CUDA tensor: each waits for the device."""
    early_elapsed_time: int = 0
    """``Event.elapsed_time`` on an event not yet complete (an error, or a hidden wait)."""
    debug_mode_warnings: int = 0
    """Synchronizing operations reported by ``torch.cuda.set_sync_debug_mode("warn")``."""

    @property
    def total(self) -> int:
        return (
            self.explicit + self.device_reads + self.early_elapsed_time + self.debug_mode_warnings
        )


@contextmanager
def count_host_syncs() -> Iterator[HostSyncCount]:
    """Count host-device synchronizations made, on any thread, inside the ``with`` block.

    Wraps the explicit synchronize calls, device-to-host reads of CUDA tensors and
    ``Event.elapsed_time`` (flagging a call on an incomplete event), and, with CUDA available,
    turns on PyTorch's sync debug mode ("warn") to catch what the wrappers cannot see. All is
    restored on exit. Without CUDA it still counts the wrapped calls (all zero, normally).
    Not re-entrant; meant for tests and benchmarks, never for production code.
    """
    counts = HostSyncCount()
    lock = threading.Lock()
    restore: list[Callable[[], None]] = []

    def bump(field_name: str) -> None:
        with lock:
            setattr(counts, field_name, getattr(counts, field_name) + 1)

    def wrap(owner: Any, name: str, before: Callable[..., None]) -> None:
        had_own = name in vars(owner)
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        restore.append(
            (lambda: setattr(owner, name, original)) if had_own else (lambda: delattr(owner, name))
        )

    def explicit(*args: Any, **kwargs: Any) -> None:
        bump("explicit")

    def device_read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if tensor.is_cuda:
            bump("device_reads")

    def elapsed_time(start: Any, end: Any, *args: Any, **kwargs: Any) -> None:
        if not (start.query() and end.query()):
            bump("early_elapsed_time")

    wrap(torch.cuda, "synchronize", explicit)
    wrap(torch.cuda.Stream, "synchronize", explicit)
    wrap(torch.cuda.Event, "synchronize", explicit)
    wrap(torch.cuda.Event, "elapsed_time", elapsed_time)
    for name in ("item", "tolist", "cpu"):
        wrap(torch.Tensor, name, device_read)

    cuda = torch.cuda.is_available()
    previous_mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous_mode)
        counts.debug_mode_warnings = sum("synchroniz" in str(w.message).lower() for w in caught)
    finally:
        for undo in reversed(restore):
            undo()
