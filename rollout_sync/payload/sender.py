"""Payload transport from rollout to trainer, whose sends can be held for a weight sync.

Rollout results ("payloads": token ids, logprobs, rewards, any tensors plus small metadata) go
to the trainer over torch.distributed point-to-point on a process group of their own: the
*data* group (NCCL on GPU, gloo on CPU; the same code). NCCL gives no guarantee for two
communicators used at once on one device, so no payload transfer may be in flight while the
weight-sync collective runs, for the whole sync. This module makes that enforceable:

* :class:`PayloadSender`, the rollout side: a producer *registers* a payload (it is packed into
  a send buffer, and waits for room in a bounded registry: backpressure, never eviction); a
  bounded *sender pool* launches the sends against credit the receiver grants. It has both
  egress hooks, ``hold_sends`` and ``flush_pending_sends``
  (:class:`~rollout_sync.SupportsHoldSends`), so :func:`~rollout_sync.payload_egress_held` and
  the guard decorators hold it for a sync.
* :class:`NCCLRolloutMixin`, the same hooks on a rollout backend or worker that owns a sender,
  where the guard looks for them (``worker.rollout``, the worker itself, its attributes).
* :class:`~rollout_sync.PayloadReceiver` (in :mod:`rollout_sync.payload.receiver`), the
  trainer side, with the mirror hold ``hold_receives``.

**A transfer happens only when both ends agree, over a control group that never touches the
device.** The receiver grants credit (``REQUEST``); the pool picks the next payloads, enters a
section of its egress :class:`~rollout_sync.Gate` and *offers* them (``OFFER``); the receiver
accepts only if its own receives are not held, entering its section before it answers
(``ACCEPT``), else it answers ``DEFER`` and sends ``RESUME`` when its hold ends. Only after
``ACCEPT`` do bytes move on the data group. So a transfer is either fully committed on both ends,
and each end's hold waits for it, or it has not started; a hold on one end can never wait for
a transfer the other end's hold keeps from completing.

**Holding.** ``hold_sends`` stops the pool from picking work and closes the egress gate: it
returns once the transfer in flight has completed. Payloads registered while held wait in the
registry in order; credit requests that arrive while held are queued in order, and their
deadlines do not run while sends are held (or deferred by a held receiver); on exit the pool
launches again. Holds are shared and re-entrant (the weight-sync thread and the main loop may
both hold).

The pool's bookkeeping (:class:`_SendPoolState`) is plain synchronous code under one lock that
returns the work to do; the torch.distributed sends happen outside the lock, and nothing reads
the bookkeeping without it. Its lifecycle is one :class:`_PoolPhase`: open, closing, goodbye
acknowledged, stopped, or failed (then stopped by ``close``). One launcher thread runs the
transfers (up to ``max_in_flight`` payload sends launched together per transfer, in
registration order); one reader thread takes the receiver's control frames.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._deadline import deadline_after, expired, group_timedelta, remaining, wait_arg
from ..errors import (
    EgressHoldTimeout,
    PayloadBackpressureTimeout,
    PayloadPeerTimeout,
    PayloadTimeout,
    PayloadTransportError,
    WouldBlock,
)
from ..trace import SpanKind, Timeline
from ._wire import (
    FRAME_WORDS,
    MAX_BATCH,
    FrameKind,
    TransportEnd,
    coalesce,
    default_data_backend,
    device_for_group,
    make_frame,
    pack_payload,
    read_frame,
    recv_frame,
    send_frame,
    transfer_p2p,
    unpack_payload,
    use_device,
)

__all__ = [
    "NCCLRolloutMixin",
    "PayloadGroups",
    "PayloadSender",
    "SenderStatistics",
    "new_payload_groups",
]

DEFAULT_CONTROL_TIMEOUT_S = 1800.0
"""Default idle limit of the control group: it must exceed the longest hold (see groups)."""


# -- process groups ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PayloadGroups:
    """The two process groups one payload transport runs on.

    Attributes:
        data: the device communicator the payload bytes travel on (NCCL on GPU, gloo on CPU).
            Only transfers both ends agreed to run on it.
        control: always gloo (CPU): credit, offers, answers, resume notices. Its timeout is
            the longest a reader waits for the next frame, so it must exceed the longest hold
            (a held sender sends nothing).
    """

    data: dist.ProcessGroup
    control: dist.ProcessGroup
    timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    """The groups' timeout: the longest a reader waits for the next control frame."""


def new_payload_groups(
    ranks: Sequence[int] | None = None,
    *,
    data_backend: str | None = None,
    timeout: float = DEFAULT_CONTROL_TIMEOUT_S,
) -> PayloadGroups:
    """Create the data and control groups of a payload transport among ``ranks``.

    A collective, like :func:`torch.distributed.new_group`: every rank of the default group
    calls it, in the same order relative to other ``new_group`` calls, with the same
    arguments, including ranks outside ``ranks``.

    Args:
        ranks: the trainer and every rollout rank that ships payloads to it; all by default.
        data_backend: "nccl" or "gloo"; by default NCCL where CUDA is available, else gloo.
        timeout: seconds, the groups' timeout (see :class:`PayloadGroups` on ``control``).
    """
    backend = data_backend or default_data_backend()
    members = None if ranks is None else list(ranks)
    data = dist.new_group(members, backend=backend, timeout=group_timedelta(timeout))
    control = dist.new_group(members, backend="gloo", timeout=group_timedelta(timeout))
    if data is None or control is None:  # pragma: no cover - new_group returns a group here
        raise RuntimeError("torch.distributed.new_group returned no group")
    return PayloadGroups(data=data, control=control, timeout_s=timeout)


# -- the pool's bookkeeping --------------------------------------------------------------------


@dataclass
class _Entry:
    """A registered payload: its packed send buffer and its place in the sender's order."""

    seq: int
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


@dataclass
class _Request:
    """Credit granted by the receiver: ``credits`` payloads, until ``expires_at_ns``.

    ``expires_at_ns`` is on the *request clock* (see :class:`_SendPoolState`), which stands
    still while sends are held.
    """

    request_id: int
    credits: int
    expires_at_ns: int


@dataclass(frozen=True)
class _Offer:
    """One transfer: consecutive payloads offered together, served by the oldest credit."""

    offer_id: int
    ticket: int
    entries: tuple[_Entry, ...]
    first_request_id: int

    @property
    def first_seq(self) -> int:
        return self.entries[0].seq

    @property
    def count(self) -> int:
        return len(self.entries)

    @property
    def sizes(self) -> list[int]:
        return [e.nbytes for e in self.entries]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass(frozen=True)
class _Expire:
    """Requests that ran out unserved: tell the receiver, so it can grant credit afresh."""

    requests: tuple[tuple[int, int], ...]
    """(request_id, credits left) of each."""


class _PoolPhase(enum.Enum):
    """Where a sender is in its life: the one lifecycle state of :class:`_SendPoolState`.

    ::

        OPEN --begin_close--> CLOSING --bye_acknowledged--> BYE_ACKED --stop--> STOPPED
          |                      |                              |                  ^
          +---------fail---------+-------------fail-------------+--> FAILED --stop-+

    Only the named methods of :class:`_SendPoolState` move it, along these arrows
    (:data:`_NEXT_PHASES`); any other move is refused. A failure may also come after
    ``stop`` (a thread that ``close`` did not wait out): the phase stays STOPPED and the error
    is kept.
    """

    OPEN = "open"
    """Registrations are accepted and the launcher runs."""
    CLOSING = "closing"
    """``close`` was called: registrations are refused, the launcher drains the registry, and
    the goodbye goes out once it is empty."""
    BYE_ACKED = "goodbye acknowledged"
    """The receiver acknowledged the goodbye, and the reader has returned; ``close`` stops the
    launcher next."""
    FAILED = "failed"
    """A thread failed (the state's ``error``): nothing launches, every call raises it, and
    ``close`` stops the threads next."""
    STOPPED = "stopped"
    """``close`` told the threads to stop. The end: nothing launches, a later ``close``
    returns at once."""


_NEXT_PHASES: dict[_PoolPhase, frozenset[_PoolPhase]] = {
    _PoolPhase.OPEN: frozenset({_PoolPhase.CLOSING, _PoolPhase.FAILED}),
    _PoolPhase.CLOSING: frozenset({_PoolPhase.BYE_ACKED, _PoolPhase.FAILED}),
    _PoolPhase.BYE_ACKED: frozenset({_PoolPhase.STOPPED, _PoolPhase.FAILED}),
    _PoolPhase.FAILED: frozenset({_PoolPhase.STOPPED}),
    _PoolPhase.STOPPED: frozenset(),
}
"""The moves :class:`_SendPoolState` makes between phases; every other move is refused."""


class _SendPoolState:
    """The sender pool's bookkeeping: what is registered, queued, in flight, held; what is next.

    Plain synchronous state: no locks, no threads, no I/O, no clock of its own (every method
    that needs the time takes ``now_ns``). The owner calls it under one lock and does the work
    it returns outside that lock.

    The *request clock* measures a request's deadline. It runs only while the pool may launch:
    it stands still while a hold is in force or being taken, and while the receiver has deferred
    an offer (its receives are held) until it sends ``RESUME``. A request that waits through a
    hold therefore keeps the time it had left.

    At most one offer is in flight at a time; tickets number them, so a flush can wait for
    exactly the offers launched before it was called.

    Every registered payload is in exactly one place, and they move in sequence order: sent
    (0 .. ``sent`` - 1), then in flight, then unsent (up to ``next_seq`` - 1). So what can be
    counted from the places is not stored (``sent``, ``registered``, ``tickets_done``). Each
    field says what is always true of it; :meth:`check_invariants` asserts all of it.
    """

    def __init__(self, capacity: int, max_in_flight: int) -> None:
        self.capacity = capacity
        """Most payloads unsent, in flight or reserved at once (>= 1); fixed."""
        self.max_in_flight = max_in_flight
        """Most payloads in one offer (1 .. ``MAX_BATCH``); fixed."""
        self.unsent: deque[_Entry] = deque()
        """Registered payloads in no offer yet, in order: consecutive sequence numbers, the
        last ``next_seq - 1``, the first right after the offer in flight (a returned offer goes
        back at the head)."""
        self.unacknowledged: deque[_Entry] = deque()
        """Sent, and not yet acknowledged by the receiver (kept to be sent again after a
        recovery): exactly the sequence numbers ``acknowledged .. sent - 1``, in order; none
        while the receiver has acknowledged more than this end counts sent."""
        self.acknowledged = 0
        """The receiver's count of this sender's first payloads the trainer moved on from:
        ``0 <= acknowledged <= next_seq``, never decreasing. It may run ahead of ``sent`` by the
        offer in flight (the receiver can take it before this end books it)."""
        self.reserved = 0
        """Registry slots taken by producers still packing: ``reserved >= 0`` and
        ``occupancy`` (``len(unsent)`` + in flight + ``reserved``) ``<= capacity``."""
        self.in_flight: _Offer | None = None
        """The one offer picked and not yet finished (completed or returned): 1 ..
        ``max_in_flight`` consecutive payloads just before ``unsent``; the newest, so its
        ticket is ``tickets_issued``."""
        self.reply: FrameKind | None = None
        """The receiver's answer to the offer in flight: None until it comes, then ACCEPT or
        DEFER; always None while nothing is in flight."""
        self.requests: deque[_Request] = deque()
        """Credit not yet spent, oldest first; each grants >= 1 payload (a request spent to 0
        is dropped, an expired one removed). ``len(requests) + requests_expired <=
        requests_received``."""
        self.holds = 0
        """Holds in force: ``0 <= holds <= holds_taken``."""
        self.receiver_deferred = False
        """The receiver deferred an offer and has not sent ``RESUME`` yet: nothing launches.
        Only a DEFER sets it, so it implies ``offers_deferred >= 1``."""
        self._stopped_since: int | None = None
        """When the request clock stopped: set exactly while ``holds`` or
        ``receiver_deferred``."""
        self._stopped_total = 0
        """Nanoseconds the request clock stood still in stops that have ended: ``>= 0``."""
        self.next_seq = 0
        """The sequence number the next registration gets: payloads 0 .. ``next_seq - 1`` are
        registered, and ``registered`` is this count."""
        self.tickets_issued = 0
        """Offers picked so far: offer n (from 0) has ``offer_id`` n and ticket n + 1, so ticket
        0 stands for none."""
        self._phase = _PoolPhase.OPEN
        """Where the sender is in its life (see :class:`_PoolPhase`)."""
        self._error: BaseException | None = None
        """The first failure, never cleared: set in FAILED, None in OPEN, CLOSING and
        BYE_ACKED; in STOPPED, set if the transport failed before or after the stop."""
        # Running totals: each >= 0 and never decreasing.
        self.bytes_sent = 0
        """Bytes of the completed transfers."""
        self.transfers = 0
        """Completed transfers: ``transfers <= sent <= transfers * max_in_flight`` (each carries
        1 .. ``max_in_flight`` payloads) and ``transfers <= tickets_done``."""
        self.requests_received = 0
        """Credit requests added."""
        self.requests_expired = 0
        """Requests that ran out unserved (each expires once)."""
        self.offers_deferred = 0
        """Offers the receiver answered DEFER: ``<= tickets_issued``."""
        self.holds_taken = 0
        """Holds begun."""
        self.backpressure_waits = 0
        """Registrations that had to wait for room (the owner counts them)."""
        self.backpressure_timeouts = 0
        """Registrations that gave up waiting: ``<= backpressure_waits``."""

    # -- what is counted, not stored -----------------------------------------------------------

    @property
    def registered(self) -> int:
        """Payloads registered so far: every sequence number handed out."""
        return self.next_seq

    @property
    def in_flight_count(self) -> int:
        """Payloads in the offer in flight (0: none)."""
        return self.in_flight.count if self.in_flight is not None else 0

    @property
    def sent(self) -> int:
        """Payloads whose transfer completed: every registered payload neither unsent nor in
        flight (payloads leave in sequence order, so these are 0 .. ``sent - 1``)."""
        return self.next_seq - len(self.unsent) - self.in_flight_count

    @property
    def tickets_done(self) -> int:
        """The last ticket whose offer finished: offers finish one at a time, in ticket order,
        so every ticket issued but the one in flight."""
        return self.tickets_issued - (1 if self.in_flight is not None else 0)

    # -- the lifecycle -------------------------------------------------------------------------

    @property
    def phase(self) -> _PoolPhase:
        return self._phase

    @property
    def error(self) -> BaseException | None:
        """The transport's first failure, if it failed (see ``_error``)."""
        return self._error

    @property
    def running(self) -> bool:
        """Neither failed nor stopped: the launcher goes on."""
        return self._phase not in (_PoolPhase.FAILED, _PoolPhase.STOPPED)

    def _enter(self, phase: _PoolPhase) -> None:
        if phase not in _NEXT_PHASES[self._phase]:
            raise RuntimeError(
                f"payload sender: no move from {self._phase.name} to {phase.name} (allowed: "
                f"{', '.join(sorted(p.name for p in _NEXT_PHASES[self._phase])) or 'none'}); "
                "the sender's close() or a thread broke the lifecycle"
            )
        self._phase = phase

    def begin_close(self) -> None:
        """OPEN -> CLOSING: refuse registrations from now on, drain, then say goodbye."""
        self._enter(_PoolPhase.CLOSING)

    def bye_acknowledged(self, receiver: int) -> None:
        """Rank ``receiver`` acknowledged the goodbye: CLOSING -> BYE_ACKED.

        After a failure it changes nothing: the failure stands.

        Raises:
            PayloadTransportError: no goodbye awaited an answer (the receiver broke the
                protocol: an acknowledgment while open, or a second one).
        """
        if self._error is not None:
            return
        if self._phase is not _PoolPhase.CLOSING:
            raise PayloadTransportError(
                f"rank {receiver} acknowledged a goodbye while the payload sender is "
                f"{self._phase.value}: it answers a goodbye that is not awaited",
                peer=receiver,
            )
        self._enter(_PoolPhase.BYE_ACKED)

    def fail(self, exc: BaseException) -> None:
        """Keep the first failure: OPEN, CLOSING or BYE_ACKED -> FAILED.

        A thread may fail in any phase, so this is never refused: a later failure is dropped
        (the first is the cause), and one after the stop is kept with the phase left STOPPED.
        """
        if self._error is not None:
            return
        self._error = exc
        if self._phase is not _PoolPhase.STOPPED:
            self._enter(_PoolPhase.FAILED)

    def stop(self) -> None:
        """BYE_ACKED or FAILED -> STOPPED: the threads are told to return.

        ``close`` stops only once the goodbye was acknowledged or the transport failed.
        """
        self._enter(_PoolPhase.STOPPED)

    # -- the request clock ---------------------------------------------------------------------

    def _retime(self, now_ns: int) -> None:
        stopped = self.holds > 0 or self.receiver_deferred
        if stopped and self._stopped_since is None:
            self._stopped_since = now_ns
        elif not stopped and self._stopped_since is not None:
            self._stopped_total += now_ns - self._stopped_since
            self._stopped_since = None

    def request_clock(self, now_ns: int) -> int:
        """Nanoseconds of time in which the pool could launch (what deadlines are counted in)."""
        stopped_for = 0 if self._stopped_since is None else now_ns - self._stopped_since
        return now_ns - self._stopped_total - stopped_for

    # -- the registry --------------------------------------------------------------------------

    @property
    def occupancy(self) -> int:
        """Registry slots in use: unsent, in flight, or reserved by a producer packing."""
        return len(self.unsent) + self.in_flight_count + self.reserved

    def try_reserve(self) -> bool:
        """Take a registry slot for a payload about to be packed; False when full."""
        if self.occupancy >= self.capacity:
            return False
        self.reserved += 1
        return True

    def cancel_reservation(self) -> None:
        self.reserved -= 1

    def commit(self, buffer: torch.Tensor) -> int:
        """Turn a reservation into a registered payload; returns its sequence number."""
        self.reserved -= 1
        seq = self.next_seq
        self.next_seq += 1
        self.unsent.append(_Entry(seq, buffer))
        return seq

    def all_sent(self) -> bool:
        return not self.unsent and self.in_flight is None and self.reserved == 0

    # -- credit --------------------------------------------------------------------------------

    def add_request(self, request_id: int, credits: int, timeout_ns: int, now_ns: int) -> None:
        if credits <= 0:
            raise PayloadTransportError(f"credit request {request_id} grants {credits} payloads")
        self.requests.append(_Request(request_id, credits, self.request_clock(now_ns) + timeout_ns))
        self.requests_received += 1

    @property
    def credits(self) -> int:
        return sum(r.credits for r in self.requests)

    # -- holds ---------------------------------------------------------------------------------

    def begin_hold(self, now_ns: int) -> None:
        self.holds += 1
        self.holds_taken += 1
        self._retime(now_ns)

    def end_hold(self, now_ns: int) -> None:
        self.holds -= 1
        self._retime(now_ns)

    def receiver_resumed(self, now_ns: int) -> None:
        self.receiver_deferred = False
        self._retime(now_ns)

    # -- launching -----------------------------------------------------------------------------

    def next_work(self, now_ns: int) -> _Offer | _Expire | None:
        """What the launcher should do now: an offer to make, requests to expire, or nothing.

        Nothing once failed or stopped, while an offer is in flight, while held, while the
        receiver defers, or when there is no payload or no credit. Expired requests are
        reported before anything is served: a request past its deadline is never served.
        """
        if not self.running or self.in_flight is not None:
            return None
        if self.holds or self.receiver_deferred:
            return None
        clock = self.request_clock(now_ns)
        expired = [r for r in self.requests if r.expires_at_ns <= clock]
        if expired:
            self.requests = deque(r for r in self.requests if r.expires_at_ns > clock)
            self.requests_expired += len(expired)
            return _Expire(tuple((r.request_id, r.credits) for r in expired))
        if not self.unsent or not self.requests:
            return None
        count = min(self.max_in_flight, len(self.unsent), self.credits)
        entries = tuple(self.unsent.popleft() for _ in range(count))
        offer_id = self.tickets_issued
        self.tickets_issued += 1
        offer = _Offer(offer_id, self.tickets_issued, entries, self.requests[0].request_id)
        self.in_flight = offer
        self.reply = None
        return offer

    def next_wakeup_s(self, now_ns: int) -> float | None:
        """Seconds until the next request deadline, if the launcher has one to watch."""
        if self.holds or self.receiver_deferred or self.in_flight is not None:
            return None
        if not self.requests:
            return None
        clock = self.request_clock(now_ns)
        first = min(r.expires_at_ns for r in self.requests)
        return max(0.0, (first - clock) / 1e9)

    def on_reply(self, offer_id: int, kind: FrameKind, now_ns: int) -> None:
        """The receiver answered an offer. A DEFER stops launching until RESUME."""
        if self.in_flight is None or self.in_flight.offer_id != offer_id or self.reply is not None:
            raise PayloadTransportError(
                f"receiver answered offer {offer_id} with {kind.name}, but the offer in flight "
                f"is {None if self.in_flight is None else self.in_flight.offer_id}"
            )
        self.reply = kind
        if kind is FrameKind.DEFER:
            self.receiver_deferred = True
            self.offers_deferred += 1
            self._retime(now_ns)

    def offer_returned(self, offer: _Offer) -> None:
        """The offer was never made (a hold closed the gate first) or the receiver deferred
        it: its payloads go back at the head, in order."""
        self._check_in_flight(offer)
        self.unsent.extendleft(reversed(offer.entries))
        self._finish()

    def offer_accepted(self, offer: _Offer) -> None:
        """Spend the oldest credit on the offer's payloads."""
        left = offer.count
        while left:
            head = self.requests[0]
            used = min(head.credits, left)
            head.credits -= used
            left -= used
            if not head.credits:
                self.requests.popleft()

    def offer_completed(self, offer: _Offer) -> None:
        """The offer's transfer completed: its payloads are sent."""
        self._check_in_flight(offer)
        self.bytes_sent += offer.nbytes
        self.transfers += 1
        self.unacknowledged.extend(e for e in offer.entries if e.seq >= self.acknowledged)
        self._finish()

    def acknowledge(self, count: int) -> None:
        """The receiver says the trainer took and moved on from this sender's first
        ``count`` payloads."""
        # The receiver may take a transfer, and move on, before this end has finished its own
        # bookkeeping of it: the offer in flight counts as sent here.
        launched = self.sent + self.in_flight_count
        if count > launched:
            raise PayloadTransportError(
                f"the receiver acknowledged {count} payloads, this sender launched {launched}"
            )
        self.acknowledged = max(self.acknowledged, count)
        while self.unacknowledged and self.unacknowledged[0].seq < self.acknowledged:
            self.unacknowledged.popleft()

    def not_acknowledged(self) -> list[_Entry]:
        """Every registered payload not acknowledged, in order: sent, in flight, unsent."""
        in_flight = list(self.in_flight.entries) if self.in_flight is not None else []
        entries = [*self.unacknowledged, *in_flight, *self.unsent]
        return sorted({e.seq: e for e in entries}.values(), key=lambda e: e.seq)

    def _check_in_flight(self, offer: _Offer) -> None:
        # ``sent`` and ``tickets_done`` count the offer in flight out: only it can finish.
        if offer is not self.in_flight:
            raise RuntimeError(
                f"payload sender: offer {offer.offer_id} finished, but the offer in flight is "
                f"{None if self.in_flight is None else self.in_flight.offer_id}"
            )

    def _finish(self) -> None:
        self.in_flight = None
        self.reply = None

    # -- flushing ------------------------------------------------------------------------------

    def flush_target(self) -> int | None:
        """The ticket a flush called now must see finish (None: nothing is in flight)."""
        return None if self.in_flight is None else self.in_flight.ticket

    def flushed(self, target: int) -> bool:
        return self.tickets_done >= target

    # -- the invariants ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert every invariant the fields document; for tests and debugging.

        Linear in the payloads held, so never on the hot path.

        Raises:
            AssertionError: names the first invariant that does not hold, with the values.
        """

        def require(holds: bool, rule: str) -> None:
            if not holds:
                raise AssertionError(f"_SendPoolState invariant broken: {rule}")

        in_flight = list(self.in_flight.entries) if self.in_flight is not None else []
        unsent = [e.seq for e in self.unsent]
        unacknowledged = [e.seq for e in self.unacknowledged]
        require(self.capacity >= 1, f"capacity {self.capacity} >= 1")
        require(
            1 <= self.max_in_flight <= MAX_BATCH,
            f"max_in_flight {self.max_in_flight} within 1..{MAX_BATCH}",
        )
        require(self.next_seq >= 0, f"next_seq {self.next_seq} >= 0")
        require(self.reserved >= 0, f"reserved {self.reserved} >= 0")
        require(
            self.occupancy <= self.capacity,
            f"occupancy {self.occupancy} (unsent {len(unsent)}, in flight {len(in_flight)}, "
            f"reserved {self.reserved}) <= capacity {self.capacity}",
        )
        require(
            [e.seq for e in in_flight] + unsent == list(range(self.sent, self.next_seq)),
            f"in flight {[e.seq for e in in_flight]} then unsent {unsent} are the payloads "
            f"{self.sent}..{self.next_seq - 1}, in order",
        )
        if self.in_flight is None:
            require(self.reply is None, f"reply {self.reply} is None with nothing in flight")
        else:
            offer = self.in_flight
            require(
                1 <= offer.count <= self.max_in_flight,
                f"the offer in flight carries {offer.count} payloads, 1..{self.max_in_flight}",
            )
            require(
                offer.ticket == self.tickets_issued and offer.offer_id == offer.ticket - 1,
                f"the offer in flight (id {offer.offer_id}, ticket {offer.ticket}) is the "
                f"newest of {self.tickets_issued}",
            )
            require(
                self.reply in (None, FrameKind.ACCEPT, FrameKind.DEFER),
                f"reply {self.reply} is None, ACCEPT or DEFER",
            )
        require(
            0 <= self.acknowledged <= self.next_seq,
            f"acknowledged {self.acknowledged} within 0..{self.next_seq} (registered)",
        )
        require(
            unacknowledged == list(range(self.acknowledged, self.sent)),
            f"unacknowledged {unacknowledged} are the payloads "
            f"{self.acknowledged}..{self.sent - 1}",
        )
        require(
            all(r.credits >= 1 for r in self.requests),
            f"every pending request grants >= 1 payload: {[r.credits for r in self.requests]}",
        )
        require(
            len(self.requests) + self.requests_expired <= self.requests_received,
            f"{len(self.requests)} pending + {self.requests_expired} expired requests <= "
            f"{self.requests_received} received",
        )
        require(
            0 <= self.holds <= self.holds_taken,
            f"holds {self.holds} within 0..{self.holds_taken} (taken)",
        )
        clock_stopped = self.holds > 0 or self.receiver_deferred
        require(
            (self._stopped_since is not None) == clock_stopped,
            f"the request clock stopped ({self._stopped_since}) exactly while held "
            f"({self.holds}) or deferred ({self.receiver_deferred})",
        )
        require(self._stopped_total >= 0, f"_stopped_total {self._stopped_total} >= 0")
        require(
            self.offers_deferred <= self.tickets_issued,
            f"offers_deferred {self.offers_deferred} <= tickets_issued {self.tickets_issued}",
        )
        require(
            not self.receiver_deferred or self.offers_deferred >= 1,
            "receiver_deferred only after a DEFER",
        )
        if self._phase is _PoolPhase.FAILED:
            require(self._error is not None, "a FAILED sender keeps its error")
        elif self._phase is not _PoolPhase.STOPPED:
            require(
                self._error is None,
                f"a {self._phase.name} sender has no error, not {self._error!r}",
            )
        require(
            self.transfers <= self.sent <= self.transfers * self.max_in_flight,
            f"sent {self.sent} within transfers {self.transfers} .. transfers x "
            f"max_in_flight {self.max_in_flight}",
        )
        require(
            self.transfers <= self.tickets_done,
            f"transfers {self.transfers} <= tickets_done {self.tickets_done}",
        )
        counters = {
            "bytes_sent": self.bytes_sent,
            "transfers": self.transfers,
            "requests_received": self.requests_received,
            "requests_expired": self.requests_expired,
            "holds_taken": self.holds_taken,
            "offers_deferred": self.offers_deferred,
            "backpressure_waits": self.backpressure_waits,
        }
        negative = {name: value for name, value in counters.items() if value < 0}
        require(not negative, f"running totals >= 0: {negative}")
        require(
            0 <= self.backpressure_timeouts <= self.backpressure_waits,
            f"backpressure_timeouts {self.backpressure_timeouts} within 0.."
            f"{self.backpressure_waits} (waits)",
        )


# -- the sender --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SenderStatistics:
    """A snapshot of a :class:`PayloadSender`, for logs, tests and reports."""

    receiver_rank: int
    registered: int
    """Payloads registered since the sender was made."""
    sent: int
    """Payloads whose transfer completed."""
    acknowledged: int
    """Payloads (the first ``acknowledged`` in order) the trainer took and moved on from, as
    its receiver said; the rest may be lost if a process dies (see
    :meth:`PayloadSender.unacknowledged`)."""
    awaiting_acknowledgment: int
    """Sent payloads whose buffers are kept until acknowledged (to be sent again after a
    recovery). At most about the receiver's ``window`` beyond ``capacity``: the receiver grants
    credit only for room it has, and acknowledges as the trainer takes."""
    bytes_sent: int
    transfers: int
    """Completed transfers (each carries up to ``max_in_flight`` payloads)."""
    unsent: int
    """Registered payloads not yet launched (waiting for credit, a hold's end, their turn)."""
    in_flight: int
    capacity: int
    credits: int
    """Payloads the receiver has granted credit for and not yet been sent."""
    requests_pending: int
    oldest_request_id: int | None
    requests_received: int
    requests_expired: int
    offers_deferred: int
    """Offers the receiver deferred because its receives were held."""
    holds: int
    """Holds in force now (shared among holders, re-entrant)."""
    holds_taken: int
    receiver_deferred: bool
    backpressure_waits: int
    """Registrations that had to wait for room in the registry."""
    backpressure_timeouts: int
    closed: bool


class PayloadSender(TransportEnd):
    """The rollout side of the payload transport: a bounded registry and sender pool.

    See the module docstring for the protocol. Threads (daemons) start in the constructor: a
    launcher that runs transfers and a reader of the receiver's control frames.

    Args:
        groups: the transport's :class:`PayloadGroups` (see :func:`new_payload_groups`).
        receiver_rank: the global rank of the :class:`~rollout_sync.PayloadReceiver`.
        capacity: most payloads registered and not yet sent (unsent plus in flight); a
            producer waits for room beyond it.
        max_in_flight: most payload sends launched together in one transfer (at most 56).
        device: where send buffers live; default: the current CUDA device for an NCCL data
            group, else CPU.
        timeline: records a ``payload_send`` span for every transfer.
        default_timeout: seconds, the limit of every wait called with ``timeout=None``, and of
            each transfer and control answer.
    """

    _state: _SendPoolState

    def __init__(
        self,
        groups: PayloadGroups,
        receiver_rank: int,
        *,
        capacity: int = 64,
        max_in_flight: int = 32,
        device: torch.device | str | None = None,
        timeline: Timeline | None = None,
        default_timeout: float = 60.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 payload, got {capacity}")
        if not 1 <= max_in_flight <= MAX_BATCH:
            raise ValueError(f"max_in_flight must be within 1..{MAX_BATCH}, got {max_in_flight}")
        if receiver_rank == dist.get_rank():
            raise ValueError(f"receiver_rank {receiver_rank} is this process's own rank")
        super().__init__(
            name=f"payload egress to rank {receiver_rank}",
            default_timeout=default_timeout,
            hold_timeout_error=EgressHoldTimeout,
            failure_subject=f"the payload transport to rank {receiver_rank}",
        )
        self.groups = groups
        self.receiver_rank = receiver_rank
        self.device = device_for_group(groups.data, device)
        self.timeline = timeline
        self._state = _SendPoolState(capacity, max_in_flight)
        self._work = threading.Condition(self._lock)
        """The launcher waits here: for payloads, credit, a hold's end, a resume, a deadline."""
        self._space = threading.Condition(self._lock)
        """Producers wait here for room in the registry."""
        self._progress = threading.Condition(self._lock)
        """Flushes, drains, credit waits and offer answers wait here."""
        self._conditions = (self._work, self._space, self._progress)
        self._send_lock = threading.Lock()
        self._bye_sent = False
        self._launcher = threading.Thread(
            target=self._launch_loop, daemon=True, name=f"payload-launcher-to-{receiver_rank}"
        )
        self._reader = threading.Thread(
            target=self._read_loop, daemon=True, name=f"payload-control-from-{receiver_rank}"
        )
        self._launcher.start()
        self._reader.start()

    # -- producers -----------------------------------------------------------------------------

    def register_payload(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        """Pack ``tensors`` and ``meta`` into a send buffer and queue it; returns its sequence.

        Sequence numbers count 0, 1, 2, ... per sender; the receiver gets payloads in this
        order. Blocks while the registry is full (backpressure). The tensors are copied: the
        caller may reuse them as soon as this returns.

        Raises:
            PayloadBackpressureTimeout: no room within ``timeout`` seconds (None: the default).
                Nothing was evicted; the payload was not registered.
            PayloadTransportError: the sender is closing or its transport failed.
            TypeError, ValueError: not a mapping of names to dense tensors, or ``meta`` is not
                JSON-serialisable. Checked before anything is queued.
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            waited = False
            while True:
                self._check_usable("register a payload")
                if self._state.try_reserve():
                    break
                if not waited:
                    self._state.backpressure_waits += 1
                    waited = True
                if expired(deadline):
                    self._state.backpressure_timeouts += 1
                    raise PayloadBackpressureTimeout(
                        self._backpressure_message(limit),
                        operation="register a payload",
                        timeout=limit,
                    )
                self._space.wait(wait_arg(deadline))
        return self._pack_and_commit(tensors, meta)

    def register_payload_nowait(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None
    ) -> int:
        """Register a payload if the registry has room now; raise :class:`WouldBlock` if not."""
        with self._lock:
            self._check_usable("register a payload")
            if not self._state.try_reserve():
                raise WouldBlock(self._backpressure_message(0.0))
        return self._pack_and_commit(tensors, meta)

    def _pack_and_commit(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None
    ) -> int:
        try:
            buffer = pack_payload(tensors, meta, self.device)
        except BaseException:
            with self._lock:
                self._state.cancel_reservation()
                self._space.notify()
            raise
        with self._lock:
            seq = self._state.commit(buffer)
            self._work.notify()
        return seq

    # -- the egress hooks ----------------------------------------------------------------------

    def hold_sends(self, timeout: float | None = None) -> AbstractContextManager[None]:
        """Hold payload egress for the ``with`` body.

        On entry the pool stops launching and this waits until the transfer in flight has
        completed. Inside, payloads still register (up to capacity), credit requests queue and
        their deadlines stand still; nothing is dropped or reordered. On exit the pool
        launches again. Shared among threads and re-entrant.

        Raises:
            EgressHoldTimeout: the transfer in flight did not complete within ``timeout``
                seconds (None: the default). Nothing is held then.
        """
        return self._hold(timeout)

    def _begin_hold(self) -> None:
        with self._lock:
            self._state.begin_hold(time.monotonic_ns())

    def _end_hold(self) -> None:
        with self._lock:
            self._state.end_hold(time.monotonic_ns())
            self._work.notify_all()

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        """Return once the transfer in flight at the call (if any) has completed.

        Weaker than :meth:`hold_sends`: the next transfer may start right after.

        Raises:
            EgressHoldTimeout: it did not complete within ``timeout`` seconds.
            PayloadTransportError: the transport failed meanwhile.
        """

        def timed_out(limit: float) -> EgressHoldTimeout:
            # Built inside the flush's wait, under the lock.
            in_flight = self._state.in_flight
            count = in_flight.count if in_flight is not None else 0
            return EgressHoldTimeout(
                f"payload sends to rank {self.receiver_rank} in flight did not complete "
                f"within {limit:.1f} s ({count} payloads in one transfer; the receiver "
                "may have stopped serving its transport)",
                operation="flush pending payload sends",
                timeout=limit,
                sections_running=1,
            )

        self._flush(timeout, "flush pending payload sends", timed_out)

    # -- waiting for the pool ------------------------------------------------------------------

    def wait_all_sent(self, timeout: float | None = None) -> None:
        """Return once every payload registered so far (and any registering now) is sent.

        Raises:
            PayloadTimeout: some were still unsent after ``timeout`` seconds (says why).
            PayloadTransportError: the transport failed meanwhile.
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            self._wait_until(
                self._progress,
                self._state.all_sent,
                deadline,
                "wait for every payload to be sent",
                lambda: PayloadTimeout(
                    f"{self._state.occupancy} payloads to rank {self.receiver_rank} were "
                    f"still unsent after {limit:.1f} s: {self._stall_reason()}",
                    operation="wait for every payload to be sent",
                    timeout=limit,
                ),
            )

    def wait_sent(self, seq: int, timeout: float | None = None) -> None:
        """Return once payload ``seq`` (a :meth:`register_payload` result) has been sent.

        Payloads are sent in sequence order, so every earlier one has been sent too.

        Raises:
            PayloadTimeout: it was still unsent after ``timeout`` seconds (says why).
            PayloadTransportError: the transport failed meanwhile.
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            if not 0 <= seq < self._state.next_seq:
                raise ValueError(
                    f"payload {seq} was never registered with this sender "
                    f"({self._state.next_seq} so far)"
                )
            self._wait_until(
                self._progress,
                lambda: self._state.sent > seq,
                deadline,
                f"wait for payload {seq} to be sent",
                lambda: PayloadTimeout(
                    f"payload {seq} to rank {self.receiver_rank} was still unsent after "
                    f"{limit:.1f} s ({self._state.sent} sent so far): {self._stall_reason()}",
                    operation="wait for a payload to be sent",
                    timeout=limit,
                ),
            )

    def unacknowledged(self) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """Every payload registered here that the trainer has not acknowledged, in order, as
        ``(tensors, meta)``: sent but unacknowledged, in flight, and unsent.

        Works on a sender that failed or closed too. After a recovery, register these on the
        new transport's sender: nothing acknowledged is lost, and nothing unacknowledged is
        dropped (a payload the trainer took but had not moved on from may arrive twice; give
        payloads an id in ``meta`` where that matters).
        """
        with self._lock:
            entries = self._state.not_acknowledged()
        return [unpack_payload(e.buffer) for e in entries]

    def wait_for_credit(self, timeout: float | None = None) -> int:
        """Wait until the receiver has granted credit; returns the payloads it covers.

        Raises:
            PayloadTimeout: no credit within ``timeout`` seconds (is the receiver running?).
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            self._wait_until(
                self._progress,
                lambda: self._state.credits > 0,
                deadline,
                "wait for credit",
                lambda: PayloadTimeout(
                    f"rank {self.receiver_rank} granted no payload credit within "
                    f"{limit:.1f} s: is its PayloadReceiver running and consuming?",
                    operation="wait for credit",
                    timeout=limit,
                ),
            )
            return self._state.credits

    # -- closing -------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Send every registered payload, say goodbye to the receiver, and stop the threads.

        New registrations are refused from the call on. Nothing registered is dropped: if the
        registry cannot drain in time, this raises and the sender keeps sending (call again).
        Safe to call more than once.

        Raises:
            PayloadTimeout: payloads were still unsent, or the receiver did not acknowledge the
                goodbye, after ``timeout`` seconds.
            PayloadTransportError: the transport had failed (its cause is chained).
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            phase = self._state.phase
            if phase is _PoolPhase.STOPPED:
                return
            if phase is _PoolPhase.OPEN:
                self._state.begin_close()
            self._space.notify_all()
            failed = phase is _PoolPhase.FAILED
        if not failed:
            self.wait_all_sent(remaining(deadline))
            with self._lock:
                total = self._state.registered
            self._send_frame(
                make_frame(FrameKind.BYE, total),
                min(self.default_timeout, remaining(deadline)),
                bye=True,
            )
            with self._lock:
                # A failure ends this wait too: the threads are stopped below, then it raises.
                # (STOPPED: another close() got there first.)
                self._wait_until(
                    self._progress,
                    lambda: self._state.phase is not _PoolPhase.CLOSING,
                    deadline,
                    "close the payload sender",
                    lambda: PayloadTimeout(
                        f"rank {self.receiver_rank} did not acknowledge the payload "
                        f"sender's goodbye within {limit:.1f} s",
                        operation="close the payload sender",
                        timeout=limit,
                    ),
                )
        with self._lock:
            # The reader returns after the goodbye's acknowledgment, so only then is it joined:
            # otherwise it may wait for a frame until the control group's timeout.
            s = self._state
            reader_returns = s.phase is _PoolPhase.BYE_ACKED or (
                s.phase is _PoolPhase.STOPPED and s.error is None
            )
            if s.phase is not _PoolPhase.STOPPED:
                s.stop()
            self._work.notify_all()
        self._launcher.join(wait_arg(deadline))
        if reader_returns:
            self._reader.join(wait_arg(deadline))
        with self._lock:
            self._raise_if_failed("close the payload sender")

    # -- introspection -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        with self._lock:
            return self._state.capacity

    def statistics(self) -> SenderStatistics:
        with self._lock:
            s = self._state
            return SenderStatistics(
                receiver_rank=self.receiver_rank,
                registered=s.registered,
                sent=s.sent,
                acknowledged=s.acknowledged,
                awaiting_acknowledgment=len(s.unacknowledged),
                bytes_sent=s.bytes_sent,
                transfers=s.transfers,
                unsent=len(s.unsent),
                in_flight=s.in_flight.count if s.in_flight is not None else 0,
                capacity=s.capacity,
                credits=s.credits,
                requests_pending=len(s.requests),
                oldest_request_id=s.requests[0].request_id if s.requests else None,
                requests_received=s.requests_received,
                requests_expired=s.requests_expired,
                offers_deferred=s.offers_deferred,
                holds=s.holds,
                holds_taken=s.holds_taken,
                receiver_deferred=s.receiver_deferred,
                backpressure_waits=s.backpressure_waits,
                backpressure_timeouts=s.backpressure_timeouts,
                closed=s.phase is _PoolPhase.STOPPED,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        if s.closed:
            state = "closed"
        elif s.holds:
            state = f"held x{s.holds}"
        elif s.receiver_deferred:
            state = "deferred by receiver"
        else:
            state = "open"
        return (
            f"<PayloadSender to rank {s.receiver_rank} {state}: {s.unsent} unsent, "
            f"{s.in_flight} in flight, {s.credits} credit, {s.sent}/{s.registered} sent>"
        )

    # -- the threads ---------------------------------------------------------------------------

    def _launch_loop(self) -> None:
        try:
            use_device(self.device)
            while True:
                with self._lock:
                    while True:
                        if not self._state.running:
                            return
                        now = time.monotonic_ns()
                        work = self._state.next_work(now)
                        if work is not None:
                            break
                        self._work.wait(self._state.next_wakeup_s(now))
                if isinstance(work, _Expire):
                    for request_id, credits in work.requests:
                        self._send_frame(make_frame(FrameKind.EXPIRED, request_id, credits))
                else:
                    self._run_offer(work)
        except BaseException as exc:  # kept: every later call re-raises it
            self._fail(exc)

    def _run_offer(self, offer: _Offer) -> None:
        """Offer ``offer`` and, if accepted, send it; all inside one egress section."""
        try:
            self._gate.enter_section_nowait()
        except WouldBlock:
            # A hold began after the pick; the payloads wait at the head for its end.
            with self._lock:
                self._state.offer_returned(offer)
                self._progress.notify_all()
            return
        start = time.monotonic_ns()
        try:
            message = coalesce([e.buffer for e in offer.entries])
            self._send_frame(
                make_frame(
                    FrameKind.OFFER,
                    offer.offer_id,
                    offer.first_seq,
                    offer.count,
                    offer.first_request_id,
                    int(message is not None),
                    sizes=offer.sizes,
                )
            )
            reply = self._await_reply(offer)
            if reply is FrameKind.DEFER:
                with self._lock:
                    self._state.offer_returned(offer)
                return
            buffers = [e.buffer for e in offer.entries] if message is None else [message]
            ops = [
                dist.P2POp(dist.isend, b, self.receiver_rank, group=self.groups.data)
                for b in buffers
            ]
            transfer_p2p(
                ops,
                self.device,
                self.default_timeout,
                f"sending {offer.count} payloads to rank {self.receiver_rank}",
                self.receiver_rank,
            )
            if self.timeline is not None:
                self.timeline.add_span(
                    SpanKind.PAYLOAD_SEND,
                    f"payloads to rank {self.receiver_rank}",
                    start,
                    first_seq=offer.first_seq,
                    count=offer.count,
                    bytes=offer.nbytes,
                )
            with self._lock:
                self._state.offer_completed(offer)
        finally:
            self._gate.exit_section()
            with self._lock:
                self._progress.notify_all()
                self._space.notify_all()

    def _await_reply(self, offer: _Offer) -> FrameKind:
        deadline = deadline_after(self.default_timeout)
        with self._lock:
            self._wait_until(
                self._progress,
                lambda: self._state.reply is not None,
                deadline,
                "wait for an answer to a payload offer",
                lambda: PayloadPeerTimeout(
                    f"rank {self.receiver_rank} did not answer an offer of {offer.count} "
                    f"payloads within {self.default_timeout:.1f} s; its receiver is not "
                    "serving the transport",
                    peer=self.receiver_rank,
                    cause="timeout",
                ),
            )
            reply = self._state.reply
            assert reply is not None
            if reply is FrameKind.ACCEPT:
                self._state.offer_accepted(offer)
            return reply

    def _read_loop(self) -> None:
        frame = torch.empty(FRAME_WORDS, dtype=torch.int64)
        try:
            use_device(self.device)
            while True:
                recv_frame(frame, self.receiver_rank, self.groups.control, self.groups.timeout_s)
                kind, words = read_frame(frame, self.receiver_rank)
                now = time.monotonic_ns()
                with self._lock:
                    if kind is FrameKind.REQUEST:
                        self._state.acknowledge(words[4])
                        self._state.add_request(words[1], words[2], words[3] * 1000, now)
                        self._work.notify()
                        self._progress.notify_all()
                    elif kind in (FrameKind.ACCEPT, FrameKind.DEFER):
                        self._state.on_reply(words[1], kind, now)
                        self._progress.notify_all()
                    elif kind is FrameKind.RESUME:
                        self._state.receiver_resumed(now)
                        self._work.notify()
                    elif kind is FrameKind.BYE_ACK:
                        self._state.acknowledge(words[1])
                        self._state.bye_acknowledged(self.receiver_rank)
                        self._progress.notify_all()
                        return
                    else:
                        raise PayloadTransportError(
                            f"rank {self.receiver_rank} sent {kind.name} to a payload sender"
                        )
        except BaseException as exc:  # kept: every later call re-raises it
            self._fail(exc)

    def _send_frame(
        self, frame: torch.Tensor, timeout: float | None = None, *, bye: bool = False
    ) -> None:
        """Send a control frame. After the goodbye nothing more goes out: the receiver's
        reader for this pair has stopped, and it forgot this sender's credit anyway."""
        limit = self.default_timeout if timeout is None else timeout
        with self._send_lock:
            if self._bye_sent:
                return
            self._bye_sent = bye
            send_frame(frame, self.receiver_rank, self.groups.control, limit)

    # -- errors --------------------------------------------------------------------------------

    def _check_usable(self, operation: str) -> None:
        """Raise unless registrations are accepted (the caller holds the lock)."""
        self._raise_if_failed(operation)
        if self._state.phase is not _PoolPhase.OPEN:
            raise PayloadTransportError(
                f"cannot {operation}: the payload sender to rank {self.receiver_rank} is closing"
            )

    def _stall_reason(self) -> str:
        """Why the registry does not drain (the caller holds the lock)."""
        s = self._state
        reasons = []
        if s.holds:
            reasons.append(f"sends are held ({s.holds} hold(s) in force: a weight sync?)")
        if s.receiver_deferred:
            reasons.append(f"rank {self.receiver_rank} is holding its receives")
        if not s.requests:
            reasons.append(
                f"rank {self.receiver_rank} grants no credit (is its receiver "
                "running, and is the trainer taking payloads off it?)"
            )
        return "; ".join(reasons) or "sends are slower than registration"

    def _backpressure_message(self, limit: float) -> str:
        """The caller holds the lock."""
        return (
            f"payload registry to rank {self.receiver_rank} stayed full "
            f"({self._state.occupancy}/{self._state.capacity} payloads unsent or in flight) for "
            f"{limit:.1f} s: {self._stall_reason()}. Nothing was evicted and this payload was not "
            "registered; retry, raise capacity or the timeout, or consume faster."
        )


# -- the mixin ---------------------------------------------------------------------------------


class NCCLRolloutMixin:
    """Payload egress on a rollout backend or worker, where the weight-sync guard finds it.

    Mix it into a :class:`~rollout_sync.RolloutBase` subclass or into a worker class. It adds
    :meth:`hold_sends` and :meth:`flush_pending_sends`, so
    :func:`~rollout_sync.payload_egress_held` (and the guard decorators, which look at
    ``worker.rollout`` and the worker itself) hold this object's payload sends for a sync.
    Until a sender is attached both hooks do nothing: there is nothing to hold, which is right
    for a lazily initialised engine whose first sync builds it.

    It needs no ``__init__`` of its own::

        class MyBackend(NCCLRolloutMixin, RolloutBase):
            def initialize(self) -> None:
                self.init_payload_transport(groups, receiver_rank=0)

            def on_rollout_done(self, result):
                self.register_payload({"tokens": result.tokens, "logprobs": result.logprobs},
                                      {"prompt_id": result.prompt_id})
    """

    _payload_sender: PayloadSender | None = None

    def init_payload_transport(
        self, groups: PayloadGroups, receiver_rank: int, **options: Any
    ) -> PayloadSender:
        """Create this object's :class:`PayloadSender` (``options`` go to its constructor)."""
        if self._payload_sender is not None:
            raise RuntimeError(f"{type(self).__name__} already has a payload sender")
        sender = PayloadSender(groups, receiver_rank, **options)
        self._payload_sender = sender
        return sender

    def attach_payload_sender(self, sender: PayloadSender) -> None:
        """Use an existing sender (shared with the worker, say) for this object's egress."""
        self._payload_sender = sender

    @property
    def payload_sender(self) -> PayloadSender:
        sender = self._payload_sender
        if sender is None:
            raise RuntimeError(
                f"{type(self).__name__} has no payload sender yet: call "
                "init_payload_transport() (or attach_payload_sender()) first"
            )
        return sender

    def register_payload(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        """Queue a payload for the trainer; see :meth:`PayloadSender.register_payload`."""
        return self.payload_sender.register_payload(tensors, meta, timeout=timeout)

    def hold_sends(self, timeout: float | None = None) -> AbstractContextManager[None]:
        """Hold payload egress (see :meth:`PayloadSender.hold_sends`); no-op without a sender."""
        sender = self._payload_sender
        return nullcontext() if sender is None else sender.hold_sends(timeout)

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        """Wait for the transfer in flight (see :meth:`PayloadSender.flush_pending_sends`)."""
        sender = self._payload_sender
        if sender is not None:
            sender.flush_pending_sends(timeout)

    def close_payload_transport(self, timeout: float | None = None) -> None:
        """Close the sender (every registered payload is sent first) and detach it."""
        sender = self._payload_sender
        if sender is not None:
            sender.close(timeout)
            self._payload_sender = None
