"""cosmos-rl's NCCL payload producer, with ``hold_sends`` and ``flush_pending_sends``.

cosmos-rl 0.4.7's :class:`NCCLPayloadProducer` (``cosmos_rl.utils.payload_transport.nccl.
producer``, made by ``PayloadContext.create("nccl", ...)``) serves a policy consumer's request on
one pub/sub listener thread: it replies ``ACCEPTED`` first, then queues the ``nccl_send`` on a
per-pair FIFO drained by a sender pool. Nothing can stop it, so a request that arrives while a
weight sync uses the device launches a payload send in the middle of the weight collective.

:class:`HoldableNCCLPayloadProducer` is that producer with the two hooks of
:mod:`rollout_sync.egress`:

* ``hold_sends(timeout)``: on entry, no request is accepted any more (no new ``ACCEPTED``);
  requests that arrive are **deferred** (kept in arrival order, never dropped, never answered
  while held), and the entry waits until every send already accepted has completed (an
  accepted send is never held back: its receive is posted). On release, deferred requests are
  handed, in order, to cosmos's own request handler, which answers those whose receiver is
  still waiting and skips the ones that expired (exactly as it skips a late request).
* ``flush_pending_sends(timeout)``: waits for the sends accepted so far; nothing stops the next.

**Consumer patience.** A policy consumer waits ``nccl_recv_timeout`` (cosmos default 5 s) for
each request and tries ``nccl_read_max_attempts`` (2) times; a warm pair whose every attempt
expires is quarantined by the consumer. A hold no longer than one attempt's budget, less
cosmos's accept margin (``max_hold_s``, 4.75 s by default), expires nothing; a longer one makes
requests that arrived early in it expire (the consumer cancels and retries); one that outlasts
every attempt gets this replica quarantined by warm consumers. A hold cannot be cut short (a
send launched mid-collective is the hazard it exists to prevent), so one that outlasts
``max_hold_s`` is logged as a warning and counted in :attr:`PayloadHoldStats.overruns`.

:func:`live_producers` lists the holdable producers alive in this process: the cosmos-rl guard
(:mod:`rollout_sync.integrations.cosmos_rl`) holds all of them around every weight sync.
Importing this module imports cosmos-rl.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cosmos_rl.utils.payload_transport.nccl import producer as _cosmos_producer

from .._deadline import deadline_after, limit_of, wait_arg
from ..errors import EgressHoldTimeout

__all__ = [
    "DEFAULT_HOLD_TIMEOUT_S",
    "HoldableNCCLPayloadProducer",
    "PayloadHoldStats",
    "consumer_patience",
    "live_producers",
]

logger = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT_S = 30.0
"""How long entering a hold (or a flush) waits for accepted sends when no timeout is given."""

_COSMOS_RECV_TIMEOUT_S = 5.0
_COSMOS_READ_ATTEMPTS = 2

_live: weakref.WeakSet[HoldableNCCLPayloadProducer] = weakref.WeakSet()
_live_lock = threading.Lock()


def live_producers() -> list[HoldableNCCLPayloadProducer]:
    """The holdable producers alive in this process (in no particular order)."""
    with _live_lock:
        return list(_live)


def consumer_patience(config: Any) -> tuple[float, int]:
    """``(seconds per attempt, attempts)`` a cosmos policy consumer waits for this producer.

    Read from ``config.custom`` as cosmos's consumer reads it (``nccl_recv_timeout``,
    ``nccl_read_max_attempts``), with cosmos's defaults (5.0 s, 2) where absent or malformed.
    """
    custom = getattr(config, "custom", None) or {}
    try:
        per_attempt = float(custom.get("nccl_recv_timeout", _COSMOS_RECV_TIMEOUT_S))
    except (TypeError, ValueError):
        per_attempt = _COSMOS_RECV_TIMEOUT_S
    try:
        attempts = max(1, int(custom.get("nccl_read_max_attempts", _COSMOS_READ_ATTEMPTS)))
    except (TypeError, ValueError):
        attempts = _COSMOS_READ_ATTEMPTS
    return per_attempt, attempts


@dataclass
class PayloadHoldStats:
    """What a :class:`HoldableNCCLPayloadProducer`'s holds did, cumulative."""

    holds: int = 0
    """Holds entered (nested or concurrent holds count once each)."""
    deferred: int = 0
    """Requests that arrived while held (or while deferred ones were being answered)."""
    answered_after_hold: int = 0
    """Deferred requests handed to cosmos's handler on release, still within their deadline."""
    expired_in_hold: int = 0
    """Deferred requests whose receiver had given up by the release (not answered)."""
    overruns: int = 0
    """Holds that lasted longer than ``max_hold_s``."""
    longest_hold_s: float = 0.0


class HoldableNCCLPayloadProducer(_cosmos_producer.NCCLPayloadProducer):  # type: ignore[misc]
    """cosmos-rl 0.4.7's NCCL payload producer with ``hold_sends`` / ``flush_pending_sends``.

    A drop-in subclass: :func:`rollout_sync.integrations.cosmos_rl.install` makes
    ``PayloadContext.create("nccl", ...)`` build this class; it can also be built directly and
    ``setup(**kwargs)`` exactly as cosmos's.

    Args:
        max_hold_s: a hold longer than this is reported as an overrun. ``None``: one consumer
            attempt's budget (``config.custom["nccl_recv_timeout"]``, default 5 s) less
            cosmos's accept margin, read at ``setup``.
    """

    def __init__(self, *, max_hold_s: float | None = None) -> None:
        super().__init__()
        self._hold_cond = threading.Condition()
        self._holds = 0
        self._replaying = False
        self._accepting = 0
        self._deferred: deque[dict[str, Any]] = deque()
        self._in_flight: set[Any] = set()
        self._hold_started = 0.0
        self._max_hold_s_arg = max_hold_s
        self.max_hold_s = max_hold_s if max_hold_s is not None else self._default_max_hold(None)
        self.hold_stats = PayloadHoldStats()
        with _live_lock:
            _live.add(self)

    @staticmethod
    def _default_max_hold(config: Any) -> float:
        per_attempt, _ = consumer_patience(config)
        margin: float = _cosmos_producer._accept_margin(per_attempt)
        return max(0.0, per_attempt - margin)

    def setup(self, **kwargs: Any) -> None:
        """cosmos's ``setup``; also reads the consumer patience from ``config``."""
        if self._max_hold_s_arg is None:
            self.max_hold_s = self._default_max_hold(kwargs.get("config"))
        super().setup(**kwargs)

    # -- the hooks ---------------------------------------------------------------------------

    @contextmanager
    def hold_sends(self, timeout: float | None = None) -> Iterator[PayloadHoldStats]:
        """Accept no request for the ``with`` body; wait for the sends already accepted.

        Raises:
            EgressHoldTimeout: accepted sends were still running after ``timeout`` seconds
                (default :data:`DEFAULT_HOLD_TIMEOUT_S`); the hold is released again.
        """
        limit = limit_of(timeout, DEFAULT_HOLD_TIMEOUT_S)
        deadline = deadline_after(limit)
        with self._hold_cond:
            self._holds += 1
            if self._holds == 1:
                self._hold_started = time.monotonic()
            self.hold_stats.holds += 1
        try:
            with self._hold_cond:
                drained = self._hold_cond.wait_for(self._idle, timeout=wait_arg(deadline))
                busy = len(self._in_flight) + self._accepting
        except BaseException:
            self._release()
            raise
        if not drained:
            self._release()
            raise EgressHoldTimeout(
                f"{busy} accepted payload send(s) still running after {limit:.1f} s; "
                "cannot hold cosmos's NCCL payload producer",
                operation="hold payload sends",
                timeout=limit,
                sections_running=busy,
            )
        try:
            yield self.hold_stats
        finally:
            self._release()

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        """Return once every send accepted before this call has completed.

        A request being accepted at the moment of the call counts as accepted before it.

        Raises:
            EgressHoldTimeout: one was still running after ``timeout`` seconds.
        """
        limit = limit_of(timeout, DEFAULT_HOLD_TIMEOUT_S)
        deadline = deadline_after(limit)
        with self._hold_cond:
            # An ACCEPTED reply precedes the send's queueing: let that acceptance finish.
            accepted = self._hold_cond.wait_for(
                lambda: self._accepting == 0, timeout=wait_arg(deadline)
            )
            waiting_for = set(self._in_flight)
            done = accepted and self._hold_cond.wait_for(
                lambda: not (waiting_for & self._in_flight), timeout=wait_arg(deadline)
            )
            left = len(waiting_for & self._in_flight) + self._accepting
        if not done:
            raise EgressHoldTimeout(
                f"{left} accepted payload send(s) still running after {limit:.1f} s",
                operation="flush payload sends",
                timeout=limit,
                sections_running=left,
            )

    @property
    def held(self) -> bool:
        """Whether no request is accepted now (a hold is in force, or being entered)."""
        with self._hold_cond:
            return self._holds > 0

    def sends_in_flight(self) -> int:
        """Accepted sends that have not completed (or been dropped) yet."""
        with self._hold_cond:
            return len(self._in_flight)

    # -- cosmos's request path, intercepted -----------------------------------------------------

    def _handle_request(self, msg: dict[str, Any]) -> None:
        with self._hold_cond:
            if self._holds or self._replaying or self._deferred:
                self._deferred.append(msg)
                self.hold_stats.deferred += 1
                return
            self._accepting += 1
        try:
            super()._handle_request(msg)
        finally:
            with self._hold_cond:
                self._accepting -= 1
                self._hold_cond.notify_all()

    def _enqueue_send(self, pair: Any, pending: Any) -> None:
        with self._hold_cond:
            self._in_flight.add(pending.resp_key)
        super()._enqueue_send(pair, pending)

    def _send_and_quarantine_on_failure(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._send_and_quarantine_on_failure(*args, **kwargs)
        finally:
            self._finished(kwargs.get("resp_key"))

    def _drop_pending(self, pending: Any, pair: Any, *, reason: str) -> None:
        try:
            super()._drop_pending(pending, pair, reason=reason)
        finally:
            self._finished(pending.resp_key)

    def _abandon_queued_sends(self) -> None:
        try:
            super()._abandon_queued_sends()
        finally:
            with self._hold_cond:
                self._in_flight.clear()
                self._hold_cond.notify_all()

    # -- internals -------------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self._accepting == 0 and not self._in_flight

    def _finished(self, resp_key: Any) -> None:
        with self._hold_cond:
            self._in_flight.discard(resp_key)
            self._hold_cond.notify_all()

    def _release(self) -> None:
        """End one hold; the last one out answers the deferred requests in arrival order.

        One thread answers them at a time (``_replaying``); it stops, leaving the rest
        deferred, as soon as a new hold begins, and that hold's release goes on.
        """
        with self._hold_cond:
            self._holds -= 1
            if self._holds:
                return
            held_for = time.monotonic() - self._hold_started
            stats = self.hold_stats
            stats.longest_hold_s = max(stats.longest_hold_s, held_for)
            if held_for > self.max_hold_s:
                stats.overruns += 1
                logger.warning(
                    "payload sends were held for %.2f s, longer than the consumers' patience "
                    "(max_hold_s=%.2f s): requests deferred early in the hold expire and are "
                    "retried; a hold past every attempt gets this replica quarantined",
                    held_for,
                    self.max_hold_s,
                )
            if self._replaying or not self._deferred:
                return  # nothing deferred, or the thread answering them goes on
            self._replaying = True
        try:
            while True:
                with self._hold_cond:
                    if self._holds or not self._deferred:
                        # Checked and cleared under one lock: a release that saw _replaying
                        # set is seen here; one that comes after finds it clear.
                        self._replaying = False
                        self._hold_cond.notify_all()
                        return
                    msg = self._deferred.popleft()
                    self._accepting += 1
                try:
                    if _expired(msg):
                        stats.expired_in_hold += 1
                    else:
                        stats.answered_after_hold += 1
                    # cosmos's handler skips an expired request itself (no late ACCEPTED).
                    super()._handle_request(msg)
                except Exception:
                    logger.exception("answering a deferred payload request failed")
                finally:
                    with self._hold_cond:
                        self._accepting -= 1
                        self._hold_cond.notify_all()
        except BaseException:
            with self._hold_cond:
                self._replaying = False
                self._hold_cond.notify_all()
            raise


def _expired(msg: dict[str, Any]) -> bool:
    deadline = msg.get("req_deadline")
    if deadline is None:
        return False
    margin: float = _cosmos_producer._accept_margin(msg.get("req_timeout"))
    return time.time() >= float(deadline) - margin
