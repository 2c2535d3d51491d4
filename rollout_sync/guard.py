"""The weight-sync guard: the composed bracket, and the decorators for command handlers.

A weight sync is bracketed, in this order::

    pause generation -> hold payload egress -> handler (lazy init, barrier, transfer)
                     -> device fence -> release egress -> resume generation

Pause is outermost on purpose. A generation step may block on a full payload send buffer; if
egress were held first, that step could never finish, so generation could never park: the sync
would deadlock. Parked first, generation produces nothing more, and holding egress is safe.
The fence makes the release wait until the sync's device work is complete, not merely enqueued.

Decorate the P2R receive and R2R broadcast handlers of a rollout worker, so that the bracket
covers lazy engine initialization and the barrier wait as well as the transfer::

    class Worker:
        rollout: RolloutBase          # what paused() is called on (may be None before init)
        data_packer: object           # found by payload_egress_held if it has the hooks

        @weight_sync_handler
        def receive_weights_p2r(self, command): ...

What the decorators read from the worker is a contract, :class:`WeightSyncWorker`: a ``rollout``
to pause (required unless ``weight_sync_pauser()`` names the target; ``None`` allowed before
lazy initialization) and optional hooks (``weight_sync_pauser()``,
``payload_egress_components()``, ``weight_sync_mode``, ``weight_sync_timeout``, ``timeline``,
``weight_sync_fence``, ``on_weight_sync_report``). A worker that breaks it is refused at its
first sync with :class:`~rollout_sync.errors.WorkerContractError`, never guarded by accident
of a typo.

Nested decorated calls on one worker and thread (an R2R handler that calls the P2R one) take
only what the outer bracket does not already hold, and produce no report of their own.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

from ._deadline import deadline_after, limit_of, wait_device_idle
from ._moved import resolve_moved
from .egress import (
    EgressHoldReport,
    SupportsFlushPendingSends,
    SupportsHoldSends,
    payload_egress_held,
)
from .errors import FenceTimeout, WorkerContractError
from .sync.mode import SyncMode as _SyncMode
from .trace import SpanKind, Timeline

__all__ = [
    "SupportsPause",
    "SyncReport",
    "WeightSyncBracket",
    "WeightSyncWorker",
    "device_fence",
    "holds_payload_egress",
    "pauses_generation",
    "reported_bracket",
    "weight_sync_bracket",
    "weight_sync_handler",
]

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")

DEFAULT_SYNC_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SyncReport:
    """Where the time of one guarded sync went. All times in seconds."""

    handler: str
    mode: _SyncMode
    paused: bool
    egress_held: int
    egress_flushed: int
    park_s: float
    """From entering the bracket until generation was parked."""
    egress_drain_s: float
    """Holding (or flushing) payload egress: waiting out sends in flight."""
    handler_s: float
    """The handler body: lazy init, barrier wait, transfer."""
    fence_s: float
    total_s: float
    error: str | None = None
    stall_s: float = 0.0
    """How long generation was parked by this sync: from parked to resumed. A receive in
    place (``SYNC``) stalls for nearly all of ``total_s``; a staged sync only for its install
    (:meth:`WeightSyncBracket.stalled`: a staged receive, or the staged R2R source's send,
    which installs once its receivers voted yes); an R2R send in place or an async-mode sync
    not at all. The install's time to park is in ``park_s`` (and, being inside the handler,
    in ``handler_s`` too)."""
    sync_kind: str | None = None
    """What the transfer moved: ``"whole"`` or ``"delta"`` (docs/delta.md); ``None`` when no
    transfer completed (a failed sync), or for a body that does not say."""
    whole_reason: str | None = None
    """Why a sync with deltas on went whole (a
    :class:`~rollout_sync.transfer.delta_sync.WholeReason` value), else ``None``."""
    nbytes: int = 0
    """The bytes the transfer moved (a delta's packed bytes); 0 when unknown."""
    full_nbytes: int = 0
    """The whole version's bytes (``nbytes`` for a whole sync); 0 when unknown."""

    def to_metrics(self, prefix: str = "rollout_sync/") -> dict[str, float]:
        """Scalar metrics, in milliseconds, under the names docs/metrics.md lists."""
        return {
            f"{prefix}time_to_park_ms": self.park_s * 1e3,
            f"{prefix}egress_drain_ms": self.egress_drain_s * 1e3,
            f"{prefix}handler_ms": self.handler_s * 1e3,
            f"{prefix}fence_ms": self.fence_s * 1e3,
            f"{prefix}sync_total_ms": self.total_s * 1e3,
            f"{prefix}stall_ms": self.stall_s * 1e3,
        }


def device_fence(timeout: float | None = None) -> None:
    """Wait until the device work enqueued so far on the current CUDA stream has completed.

    A no-op without CUDA in use (CPU collectives are synchronous). Polls an event instead of
    calling ``synchronize()`` so the wait is bounded by ``timeout`` seconds.
    """
    limit = limit_of(timeout, DEFAULT_SYNC_TIMEOUT_S)
    wait_device_idle(
        deadline_after(limit),
        lambda: FenceTimeout(
            f"device work of the weight sync did not complete within {limit:.1f} s "
            "(a collective is likely stuck waiting for a peer)"
        ),
    )


class WeightSyncBracket:
    """The bracket of one weight sync, as a context manager; made by :func:`weight_sync_bracket`.

    ``report`` is set when the bracket exits, also when entering it failed (a pause or an
    egress hold that timed out), so a failed sync is reported like any other.
    """

    def __init__(
        self,
        rollout: SupportsPause | None,
        egress_components: Sequence[object],
        *,
        name: str,
        mode: _SyncMode,
        pause: bool,
        hold: bool,
        timeout: float | None,
        fence: Callable[[float | None], None] | None,
        timeline: Timeline | None,
    ) -> None:
        self.name = name
        self.mode = mode
        self.report: SyncReport | None = None
        self._rollout = rollout
        self._egress_components = egress_components
        self._pause = pause and rollout is not None
        self._hold = hold
        self._timeout = timeout
        self._fence = fence
        self._timeline = timeline
        self._stack = ExitStack()
        self._start = self._parked = self._drained = 0.0
        self._body_start_ns = 0
        self._egress = EgressHoldReport()
        self._stall_s = 0.0
        self._install_park_s = 0.0
        self._parked_on_entry = False
        self._moved: tuple[str | None, str | None, int, int] = (None, None, 0, 0)

    def record_transfer(self, stats: object) -> None:
        """Say in the report what the body's transfer moved (its
        :class:`~rollout_sync.transfer.TransferStats`: kind, why whole, bytes)."""
        kind = getattr(stats, "sync_kind", None)
        nbytes = int(getattr(stats, "nbytes", 0) or 0)
        full = getattr(stats, "full_nbytes", None)
        whole = nbytes if kind == "whole" else 0
        self._moved = (kind, getattr(stats, "whole_reason", None), nbytes, int(full or whole))

    def __enter__(self) -> WeightSyncBracket:
        self._start = self._parked = self._drained = time.perf_counter()
        try:
            if self._pause:
                assert self._rollout is not None
                self._stack.enter_context(self._rollout.paused(self._timeout))
                self._parked_on_entry = True
            self._parked = self._drained = time.perf_counter()
            if self._hold:
                if self._timeline is not None:
                    # Unwound after the egress release and before the resume: the span ends
                    # when sends may run again.
                    self._stack.callback(self._record_hold, time.monotonic_ns())
                self._egress = self._stack.enter_context(
                    payload_egress_held(*self._egress_components, timeout=self._timeout)
                )
            self._drained = time.perf_counter()
        except BaseException as exc:
            self._stack.close()
            self._finish(None, None, exc)
            raise
        self._body_start_ns = time.monotonic_ns()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        body_done = time.perf_counter()
        if self._timeline is not None:
            self._timeline.add_span(SpanKind.SYNC, self.name, self._body_start_ns)
        fence_done: float | None = None
        error = exc
        try:
            # The fence runs after a failed body too: a transfer that raised may still have
            # device work in flight, and egress must not be released under it.
            if self._fence is not None:
                self._fence(self._timeout)
            fence_done = time.perf_counter()
        except BaseException as fence_error:
            error = error or fence_error
            raise
        finally:
            try:
                self._stack.close()  # release egress, then resume generation
            except BaseException as release_error:
                error = error or release_error
                raise
            finally:
                self._finish(body_done, fence_done, error)

    @contextmanager
    def stalled(self, *, pause: bool = True) -> Iterator[None]:
        """Park generation for the ``with`` body alone (a staged sync's install and version
        commit) and count its time into the report's ``stall_s``.

        In a bracket that paused on entry (``SYNC``) generation is parked already: the body
        just runs. ``pause=False`` (an unguarded worker, to show the hazard) or a bracket
        without a rollout parks nothing and counts nothing.

        Raises:
            PauseTimeout: generation did not park within the bracket's timeout.
        """
        if self._pause or not pause or self._rollout is None:
            yield
            return
        asked = time.perf_counter()
        with self._rollout.paused(self._timeout):
            parked = time.perf_counter()
            self._install_park_s += parked - asked
            try:
                yield
            finally:
                self._stall_s += time.perf_counter() - parked

    def _record_hold(self, start_ns: int) -> None:
        """A ``payload_hold`` span from asking for the hold until its release, if anything was
        held (a hold that timed out on entry, or only flushed, held nothing)."""
        if self._timeline is not None and self._egress.held:
            self._timeline.add_span(
                SpanKind.PAYLOAD_HOLD, "payload sends held", start_ns, held=self._egress.held
            )

    def _finish(
        self, body_done: float | None, fence_done: float | None, error: BaseException | None
    ) -> None:
        end = time.perf_counter()
        body_end = body_done if body_done is not None else self._drained
        self.report = SyncReport(
            handler=self.name,
            mode=self.mode,
            paused=self._pause or self._stall_s > 0,
            egress_held=self._egress.held,
            egress_flushed=self._egress.flushed,
            park_s=self._parked - self._start + self._install_park_s,
            egress_drain_s=self._drained - self._parked,
            handler_s=body_end - self._drained,
            fence_s=(fence_done - body_end) if fence_done is not None else 0.0,
            total_s=end - self._start,
            error=None if error is None else f"{type(error).__name__}: {error}",
            stall_s=(end - self._parked) if self._parked_on_entry else self._stall_s,
            sync_kind=self._moved[0],
            whole_reason=self._moved[1],
            nbytes=self._moved[2],
            full_nbytes=self._moved[3],
        )


def weight_sync_bracket(
    rollout: SupportsPause | None,
    egress_components: Sequence[object] = (),
    *,
    name: str = "weight sync",
    mode: _SyncMode = _SyncMode.SYNC,
    pause: bool | None = None,
    hold: bool = True,
    timeout: float | None = None,
    fence: Callable[[float | None], None] | None = device_fence,
    timeline: Timeline | None = None,
) -> WeightSyncBracket:
    """The bracket of one weight sync, for code that is not a decorated handler.

    ::

        with weight_sync_bracket(rollout, [packer], timeout=30) as bracket:
            transfer()
        log(bracket.report)

    Args:
        rollout: paused for the body, unless the mode is async or ``pause`` is False.
        egress_components: held for the body via :func:`payload_egress_held` when ``hold``.
        pause: force the pause on or off; ``None`` follows ``mode``.
        timeout: seconds for the pause, each egress hold and the fence.
        fence: called with ``timeout`` after the body (also a failed one), before egress is
            released.
        timeline: records the body as a ``weight_sync`` span, and the egress hold (when
            something was held) as a ``payload_hold`` span.

    Raises whatever the pause, holds, body or fence raise; generation is resumed and egress
    released in every case, and ``report`` is set either way.
    """
    return WeightSyncBracket(
        rollout,
        egress_components,
        name=name,
        mode=mode,
        pause=mode.pauses_generation if pause is None else pause,
        hold=hold,
        timeout=timeout,
        fence=fence,
        timeline=timeline,
    )


# -- the worker contract -----------------------------------------------------------------------


@runtime_checkable
class SupportsPause(Protocol):
    """What the guard pauses: anything with :meth:`~rollout_sync.RolloutBase.paused`."""

    def paused(self, timeout: float | None = None) -> AbstractContextManager[object]:
        """Park generation for the ``with`` body; see :meth:`RolloutBase.paused`."""
        ...


@runtime_checkable
class WeightSyncWorker(Protocol):
    """The contract between the guard decorators and the worker whose methods they decorate.

    **Required** by :func:`weight_sync_handler` and :func:`pauses_generation` (not by
    :func:`holds_payload_egress`, which pauses nothing):

    * ``rollout``: what the bracket pauses, read when the bracket is entered. Anything with a
      ``paused(timeout)`` context manager (a :class:`~rollout_sync.RolloutBase`), or ``None``
      while the engine does not exist yet (lazy initialization inside the first sync; nothing
      generates then, so there is nothing to pause). Not needed when the worker has
      ``weight_sync_pauser()``.

    **Optional**, read when present and checked like ``rollout``:

    * ``weight_sync_pauser()``: the pause target when it is not ``self.rollout`` (a framework's
      scheduler that owns generation, say): called when the bracket is entered, it returns
      something with ``paused(timeout)``, or ``None`` (nothing generates yet). When present it
      replaces ``rollout`` as the pause target.

    * ``payload_egress_components()``: every component that ships payloads over the device.
      Default: ``data_packer``, ``validation_packer`` and ``rollout`` where present, every
      other attribute of the worker that has ``hold_sends`` or ``flush_pending_sends``, and
      the worker itself (a worker that mixes in a transport). Components without hooks are
      skipped by :func:`~rollout_sync.payload_egress_held`.
    * ``weight_sync_mode``: a :class:`SyncMode` (default ``SYNC``); async modes skip the pause
      and keep the hold.
    * ``weight_sync_timeout``: seconds (a positive number; ``None``: each part's default) for
      the pause, each egress hold and the fence.
    * ``timeline``: a :class:`~rollout_sync.Timeline` (or ``None``) to record the sync and
      hold spans.
    * ``weight_sync_fence(timeout)``: the device fence (``None``: none); default
      :func:`device_fence`.
    * ``on_weight_sync_report(report)``: called with the :class:`SyncReport` of each sync,
      also a failed one. The last report is always left on ``last_weight_sync_report``.

    A worker that breaks the contract (no ``rollout`` attribute at all, a ``rollout`` without
    ``paused``, a ``weight_sync_mode`` that is not a :class:`SyncMode`, a timeout that is not a
    positive number, a hook that is not callable) gets :class:`~rollout_sync.errors.
    WorkerContractError` at its first sync, naming the attribute, before anything is paused,
    held or written. A typo must never turn the guard into a silent no-op.
    """

    rollout: SupportsPause | None


@dataclass(frozen=True)
class _WorkerSettings:
    """What the guard read from a worker for one sync, checked."""

    rollout: SupportsPause | None
    mode: _SyncMode
    timeout: float | None
    timeline: Timeline | None
    fence: Callable[[float | None], None] | None


_MISSING = object()


def _refuse(worker: object, attribute: str, method: str, rule: str) -> WorkerContractError:
    return WorkerContractError(
        f"{type(worker).__name__}.{method} is guarded by rollout_sync, which reads "
        f"`{attribute}` from the worker: {rule}. See rollout_sync.guard.WeightSyncWorker for the "
        "contract.",
        attribute=attribute,
    )


def _read_worker(worker: object, method: str, *, needs_rollout: bool) -> _WorkerSettings:
    """Read and check what the bracket needs from ``worker`` (see :class:`WeightSyncWorker`).

    Raises:
        WorkerContractError: an attribute is missing (``rollout`` only) or of the wrong kind.
    """
    pauser = getattr(worker, "weight_sync_pauser", None)
    if pauser is not None:
        if not callable(pauser):
            raise _refuse(
                worker,
                "weight_sync_pauser",
                method,
                f"it is a {type(pauser).__name__}, not callable",
            )
        rollout = pauser()
        if rollout is not None and not isinstance(rollout, SupportsPause):
            raise _refuse(
                worker,
                "weight_sync_pauser",
                method,
                f"it returned a {type(rollout).__name__}, which has no paused() to park "
                "generation with",
            )
    else:
        rollout = getattr(worker, "rollout", _MISSING)
    if rollout is _MISSING:
        if needs_rollout:
            raise _refuse(
                worker,
                "rollout",
                method,
                "it has no such attribute, so there is nothing to pause. Set self.rollout to the "
                "engine that generates (None until a lazy initialization builds it)",
            )
        rollout = None
    elif rollout is not None and not isinstance(rollout, SupportsPause):
        raise _refuse(
            worker,
            "rollout",
            method,
            f"it is a {type(rollout).__name__}, which has no paused() to park generation with "
            "(subclass rollout_sync.RolloutBase)",
        )
    mode = getattr(worker, "weight_sync_mode", _SyncMode.SYNC)
    if not isinstance(mode, _SyncMode):
        raise _refuse(
            worker,
            "weight_sync_mode",
            method,
            f"it is {mode!r}, not a rollout_sync.SyncMode (e.g. SyncMode.SYNC)",
        )
    timeout = getattr(worker, "weight_sync_timeout", None)
    if timeout is not None and not (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    ):
        raise _refuse(
            worker,
            "weight_sync_timeout",
            method,
            f"it is {timeout!r}, not a positive number of seconds (or None for the defaults)",
        )
    timeline = getattr(worker, "timeline", None)
    if timeline is not None and not isinstance(timeline, Timeline):
        raise _refuse(
            worker, "timeline", method, f"it is a {type(timeline).__name__}, not a Timeline"
        )
    fence = getattr(worker, "weight_sync_fence", device_fence)
    for attribute, hook in (
        ("weight_sync_fence", fence),
        ("on_weight_sync_report", getattr(worker, "on_weight_sync_report", None)),
        ("payload_egress_components", getattr(worker, "payload_egress_components", None)),
    ):
        if hook is not None and not callable(hook):
            raise _refuse(worker, attribute, method, f"it is a {type(hook).__name__}, not callable")
    return _WorkerSettings(rollout, mode, timeout, timeline, fence)


def _egress_components_of(worker: object) -> tuple[object, ...]:
    custom = getattr(worker, "payload_egress_components", None)
    if custom is not None:
        return tuple(custom())
    named = [getattr(worker, n, None) for n in ("data_packer", "validation_packer", "rollout")]
    found = [
        value
        for value in getattr(worker, "__dict__", {}).values()
        if isinstance(value, (SupportsHoldSends, SupportsFlushPendingSends))
    ]
    return (*named, *found, worker)


# -- the decorators ----------------------------------------------------------------------------

_active = threading.local()


def _active_on_thread() -> set[tuple[int, str]]:
    try:
        found: set[tuple[int, str]] = _active.brackets
    except AttributeError:
        found = _active.brackets = set()
    return found


@contextmanager
def reported_bracket(
    worker: object,
    name: str,
    *,
    pause: bool,
    hold: bool,
    mode: _SyncMode | None = None,
) -> Iterator[WeightSyncBracket]:
    """The bracket of one sync of ``worker`` (read as the decorators read it:
    :class:`WeightSyncWorker`), its report delivered to the worker (``last_weight_sync_report``,
    ``on_weight_sync_report``) however the body ends: the one way every receiver brackets a
    sync, decorated handler or not. ``mode``: the report's (default the worker's).

    Raises:
        WorkerContractError: the worker breaks its contract; and whatever the bracket raises.
    """
    settings = _read_worker(worker, name, needs_rollout=pause)
    bracket = weight_sync_bracket(
        settings.rollout,
        _egress_components_of(worker) if hold else (),
        name=name,
        mode=settings.mode if mode is None else mode,
        pause=pause,
        hold=hold,
        timeout=settings.timeout,
        fence=settings.fence,
        timeline=settings.timeline,
    )
    active = _active_on_thread()
    keys = {(id(worker), "pause")} if pause else set()
    keys |= {(id(worker), "hold")} if hold else set()
    taken = keys - active  # a decorated handler called inside takes only what is not held
    active |= taken
    try:
        with bracket:
            yield bracket
    finally:
        active -= taken
        if bracket.report is not None:
            _deliver_report(worker, bracket.report)


def _guarded(
    method: Callable[Concatenate[W, P], R], *, pause: bool | None, hold: bool
) -> Callable[Concatenate[W, P], R]:
    needs_rollout = pause is not False

    @functools.wraps(method)
    def wrapper(self: W, /, *args: P.args, **kwargs: P.kwargs) -> R:
        settings = _read_worker(self, method.__name__, needs_rollout=needs_rollout)
        active = _active_on_thread()
        want_pause = settings.mode.pauses_generation if pause is None else pause
        pause_key, hold_key = (id(self), "pause"), (id(self), "hold")
        do_pause = want_pause and pause_key not in active
        do_hold = hold and hold_key not in active
        if not do_pause and not do_hold:
            return method(self, *args, **kwargs)
        with reported_bracket(self, method.__name__, pause=do_pause, hold=do_hold):
            return method(self, *args, **kwargs)

    return wrapper


def _deliver_report(worker: Any, report: SyncReport) -> None:
    worker.last_weight_sync_report = report
    sink = getattr(worker, "on_weight_sync_report", None)
    if sink is not None:
        sink(report)


def weight_sync_handler(method: Callable[Concatenate[W, P], R]) -> Callable[Concatenate[W, P], R]:
    """Decorate a weight-sync command handler with the whole bracket (see module docstring).

    Pauses generation in :attr:`SyncMode.SYNC` (the worker's ``weight_sync_mode``), holds
    payload egress in every mode.
    """
    return _guarded(method, pause=None, hold=True)


def pauses_generation(method: Callable[Concatenate[W, P], R]) -> Callable[Concatenate[W, P], R]:
    """Decorate a method so that it runs with generation paused (and nothing else)."""
    return _guarded(method, pause=True, hold=False)


def holds_payload_egress(method: Callable[Concatenate[W, P], R]) -> Callable[Concatenate[W, P], R]:
    """Decorate a method so that it runs with payload egress held (and nothing else)."""
    return _guarded(method, pause=False, hold=True)


def __getattr__(name: str) -> Any:
    if name == "SyncMode":  # moved to rollout_sync.sync in 0.2.0
        return resolve_moved(__name__, "rollout_sync.sync", name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
