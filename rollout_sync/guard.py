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

What the decorators read from the worker (all optional):

* ``rollout``: the :class:`~rollout_sync.RolloutBase` to pause, read when the bracket is entered.
* ``payload_egress_components()``: every component that ships payloads over the device. The
  default is ``data_packer``, ``validation_packer``, ``rollout`` and the worker itself (a backend
  or worker that mixes in a transport); components without hooks are skipped. Override it to
  name others.
* ``weight_sync_mode``: a :class:`SyncMode`; async modes skip the pause and keep the hold.
* ``weight_sync_timeout``: seconds for the pause, each egress hold and the fence.
* ``timeline``: a :class:`~rollout_sync.Timeline` to record the sync span into.
* ``weight_sync_fence(timeout)``: the device fence; default :func:`device_fence`.
* ``on_weight_sync_report(report)``: called with the :class:`SyncReport` of each sync, also a
  failed one. The last report is always left on ``last_weight_sync_report``.

Nested decorated calls on one worker and thread (an R2R handler that calls the P2R one) take
only what the outer bracket does not already hold, and produce no report of their own.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from .backend import RolloutBase
from .egress import payload_egress_held
from .errors import FenceTimeout
from .trace import SpanKind, Timeline

__all__ = [
    "SyncMode",
    "SyncReport",
    "WeightSyncBracket",
    "device_fence",
    "holds_payload_egress",
    "pauses_generation",
    "weight_sync_bracket",
    "weight_sync_handler",
]

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")

DEFAULT_SYNC_TIMEOUT_S = 60.0


class SyncMode(enum.Enum):
    """How a sync reaches the served weights."""

    SYNC = "sync"
    """Write the served tensors in place: generation is paused for the sync."""
    ASYNC_PER_GENERATION = "async_per_generation"
    """Write a buffer clone; it is installed before each generation call. No pause."""
    ASYNC_PER_FORWARD = "async_per_forward"
    """Write a buffer clone; it is installed before each policy forward. No pause."""

    @property
    def pauses_generation(self) -> bool:
        return self is SyncMode.SYNC


@dataclass(frozen=True)
class SyncReport:
    """Where the time of one guarded sync went. All times in seconds."""

    handler: str
    mode: SyncMode
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

    def to_metrics(self, prefix: str = "rollout_sync/") -> dict[str, float]:
        """Scalar metrics, in milliseconds, under the names docs/metrics.md lists."""
        return {
            f"{prefix}time_to_park_ms": self.park_s * 1e3,
            f"{prefix}egress_drain_ms": self.egress_drain_s * 1e3,
            f"{prefix}handler_ms": self.handler_s * 1e3,
            f"{prefix}fence_ms": self.fence_s * 1e3,
            f"{prefix}sync_total_ms": self.total_s * 1e3,
        }


@dataclass
class WeightSyncBracket:
    """Yielded by :func:`weight_sync_bracket`; ``report`` is set when the bracket exits."""

    name: str
    mode: SyncMode
    report: SyncReport | None = None
    _marks: dict[str, float] = field(default_factory=dict)


def device_fence(timeout: float | None = None) -> None:
    """Wait until the device work enqueued so far on the current CUDA stream has completed.

    A no-op without CUDA in use (CPU collectives are synchronous). Polls an event instead of
    calling ``synchronize()`` so the wait is bounded by ``timeout`` seconds.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    limit = DEFAULT_SYNC_TIMEOUT_S if timeout is None else timeout
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + limit
    while not event.query():
        if time.monotonic() > deadline:
            raise FenceTimeout(
                f"device work of the weight sync did not complete within {limit:.1f} s "
                "(a collective is likely stuck waiting for a peer)"
            )
        time.sleep(50e-6)


@contextmanager
def weight_sync_bracket(
    rollout: RolloutBase | None,
    egress_components: Sequence[object] = (),
    *,
    name: str = "weight sync",
    mode: SyncMode = SyncMode.SYNC,
    pause: bool | None = None,
    hold: bool = True,
    timeout: float | None = None,
    fence: Callable[[float | None], None] | None = device_fence,
    timeline: Timeline | None = None,
) -> Iterator[WeightSyncBracket]:
    """The bracket of one weight sync, as a context manager (the decorators use this).

    Args:
        rollout: paused for the body, unless the mode is async or ``pause`` is False.
        egress_components: held for the body via :func:`payload_egress_held` when ``hold``.
        pause: force the pause on or off; ``None`` follows ``mode``.
        timeout: seconds for the pause, each egress hold and the fence.
        fence: called with ``timeout`` after the body, before egress is released.

    Raises whatever the pause, holds, body or fence raise; generation is resumed and egress
    released in every case. The report is set on the yielded object either way.
    """
    bracket = WeightSyncBracket(name=name, mode=mode)
    do_pause = mode.pauses_generation if pause is None else pause
    start = time.perf_counter()
    parked = drained = body_done = start
    fence_s = 0.0
    egress_held = egress_flushed = 0
    error: BaseException | None = None
    try:
        with ExitStack() as stack:
            if do_pause and rollout is not None:
                stack.enter_context(rollout.paused(timeout))
            parked = time.perf_counter()
            if hold:
                egress = stack.enter_context(payload_egress_held(*egress_components,
                                                                 timeout=timeout))
                egress_held, egress_flushed = egress.held, egress.flushed
            drained = time.perf_counter()
            span = timeline.span(SpanKind.SYNC, name) if timeline is not None else nullcontext()
            with span:
                yield bracket
            body_done = time.perf_counter()
            if fence is not None:
                fence(timeout)
            fence_s = time.perf_counter() - body_done
    except BaseException as exc:
        error = exc
        raise
    finally:
        end = time.perf_counter()
        if body_done == start:
            body_done = end
        bracket.report = SyncReport(
            handler=name,
            mode=mode,
            paused=do_pause and rollout is not None,
            egress_held=egress_held,
            egress_flushed=egress_flushed,
            park_s=parked - start,
            egress_drain_s=max(0.0, drained - parked),
            handler_s=max(0.0, body_done - drained),
            fence_s=fence_s,
            total_s=end - start,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )


# -- the decorators ----------------------------------------------------------------------------

_active = threading.local()


def _active_on_thread() -> set[tuple[int, str]]:
    try:
        found: set[tuple[int, str]] = _active.brackets
    except AttributeError:
        found = _active.brackets = set()
    return found


def _egress_components_of(worker: object) -> Sequence[object]:
    custom = getattr(worker, "payload_egress_components", None)
    if callable(custom):
        return tuple(custom())
    return (
        getattr(worker, "data_packer", None),
        getattr(worker, "validation_packer", None),
        getattr(worker, "rollout", None),
        worker,
    )


def _guarded(
    method: Callable[Concatenate[W, P], R], *, pause: bool | None, hold: bool
) -> Callable[Concatenate[W, P], R]:
    @functools.wraps(method)
    def wrapper(self: W, /, *args: P.args, **kwargs: P.kwargs) -> R:
        active = _active_on_thread()
        mode = SyncMode(getattr(self, "weight_sync_mode", SyncMode.SYNC))
        want_pause = mode.pauses_generation if pause is None else pause
        pause_key, hold_key = (id(self), "pause"), (id(self), "hold")
        do_pause = want_pause and pause_key not in active
        do_hold = hold and hold_key not in active
        if not do_pause and not do_hold:
            return method(self, *args, **kwargs)
        taken = {k for k, on in ((pause_key, do_pause), (hold_key, do_hold)) if on}
        active |= taken
        bracket: WeightSyncBracket | None = None
        try:
            with weight_sync_bracket(
                getattr(self, "rollout", None),
                _egress_components_of(self) if do_hold else (),
                name=method.__name__,
                mode=mode,
                pause=do_pause,
                hold=do_hold,
                timeout=getattr(self, "weight_sync_timeout", None),
                fence=getattr(self, "weight_sync_fence", device_fence),
                timeline=getattr(self, "timeline", None),
            ) as bracket:
                return method(self, *args, **kwargs)
        finally:
            active -= taken
            if bracket is not None and bracket.report is not None:
                _deliver_report(self, bracket.report)

    return wrapper


def _deliver_report(worker: Any, report: SyncReport) -> None:
    worker.last_weight_sync_report = report
    sink = getattr(worker, "on_weight_sync_report", None)
    if callable(sink):
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
