"""The trainer side of the payload transport: a receiver that pulls, with the mirror-image hold.

:class:`PayloadReceiver` grants each sender credit for up to ``window`` payloads (credit is
only granted for room it has, so a trainer that stops taking payloads stops the senders, whose
registries then push back on their producers). It answers every offer on a reader thread per
sender: accepted offers are received on the data group and queued for :meth:`~PayloadReceiver.get`
in each sender's order.

:meth:`~PayloadReceiver.hold_receives` is the mirror of ``hold_sends``: while it is in force no
payload receive runs on the data group, so the trainer can send weights (P2R) on another
communicator. Offers that arrive meanwhile are deferred, and each deferring sender is told to
resume when the hold ends; nothing is dropped.

**When to take it.** Take ``hold_receives`` once the rollouts taking part in the sync have
paused and held their sends (after a CPU-side barrier of the sync), not before: a rollout's
pause may be waiting for a producer blocked on a full send buffer, which drains only while the
trainer still receives. Holding receives first would make that wait circular.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._deadline import expired, wait_arg
from ..errors import (
    IngressHoldTimeout,
    PayloadSendersFailed,
    PayloadsExhausted,
    PayloadTimeout,
    PayloadTransportError,
    WouldBlock,
)
from ..trace import SpanKind, Timeline
from ._wire import (
    FRAME_WORDS,
    FrameKind,
    TransportEnd,
    device_for_group,
    make_frame,
    offer_sizes,
    read_frame,
    recv_frame,
    send_frame,
    transfer_p2p,
    unpack_payload,
    use_device,
)
from .sender import PayloadGroups

__all__ = ["PayloadReceiver", "ReceivedPayload", "ReceiverStatistics"]


@dataclass(frozen=True)
class ReceivedPayload:
    """One payload as the trainer gets it.

    Attributes:
        source: the global rank of the sender.
        seq: the sender's sequence number (0, 1, 2, ... per sender, in registration order).
        tensors: by name; views into one received buffer (no copy), on the receiver's device.
        meta: the sender's metadata, as decoded from JSON.
        request_id: the credit request this payload was sent against.
        nbytes: the size of its buffer on the wire.
    """

    source: int
    seq: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    request_id: int
    nbytes: int


@dataclass(frozen=True)
class ReceiverStatistics:
    """A snapshot of a :class:`PayloadReceiver`, for logs, tests and reports."""

    sender_ranks: tuple[int, ...]
    received: int
    bytes_received: int
    transfers: int
    queued: int
    """Received and not yet taken by :meth:`PayloadReceiver.get`."""
    taken: int
    credit_outstanding: int
    """Credit granted and not yet used, over all senders."""
    requests_sent: int
    requests_expired: int
    offers_deferred: int
    holds: int
    holds_taken: int
    senders_closed: int
    announced: int
    """Payloads the closed senders said they registered (their goodbye carries the count)."""
    lost: int
    """Announced by a closed sender and never received, plus what a failed sender had in
    flight here (accepted and not fully received, or offered and deferred). Zero unless
    something broke."""
    acknowledged: int = 0
    """Payloads acknowledged to their senders: taken by :meth:`PayloadReceiver.get`, which
    then was called again (the trainer moved on from them)."""
    failed_senders: dict[int, str] = field(default_factory=dict)
    """Senders whose connection closed (they died), by rank: ``"closed"``. The receiver goes
    on with the others. A sender that hangs past the limit fails the whole receiver instead
    (:class:`~rollout_sync.errors.PayloadPeerTimeout`): on gloo a timed-out wait closes every
    pair of the group."""


@dataclass
class _Peer:
    rank: int
    requests: deque[list[int]] = field(default_factory=deque)
    """[request_id, credits left] of granted credit, oldest first (mirrors the sender's)."""
    receiving: int = 0
    """Accepted and still on the wire."""
    queued: int = 0
    next_seq: int = 0
    received: int = 0
    announced: int | None = None
    taken: int = 0
    acknowledged: int = 0
    """Taken, and get() called again since: what the sender is told it may forget."""
    deferred: int = 0
    """Payloads of the offer deferred last (the sender holds them for the next offer)."""
    failed: str | None = None
    """``"closed"`` once this sender's connection closed (it died)."""
    lost_in_flight: int = 0

    @property
    def outstanding(self) -> int:
        return sum(credits for _, credits in self.requests)


@dataclass(frozen=True)
class _Accepted:
    ticket: int
    first_seq: int
    sizes: tuple[int, ...]
    request_ids: tuple[int, ...]
    coalesced: bool


class _ReceiverState:
    """The receiver's bookkeeping: credit per sender, holds, deferrals, the delivery queue.

    Plain synchronous state: the owner calls it under one lock and does the I/O it implies
    outside. It mirrors each sender's view of its credit, so a protocol slip (an offer beyond
    the credit, a gap in a sender's sequence) is caught at once instead of corrupting data.
    """

    def __init__(self, ranks: Sequence[int], window: int, request_timeout_us: int) -> None:
        self.window = window
        self.request_timeout_us = request_timeout_us
        self.peers = {rank: _Peer(rank) for rank in ranks}
        self.queue: deque[ReceivedPayload] = deque()
        self.holds = 0
        self.deferred: set[int] = set()
        self.in_flight: dict[int, int] = {}
        """Accepted transfers on the wire: ticket -> sender rank."""
        self._next_ticket = 0
        self._next_request_id = 0
        self.error: BaseException | None = None
        self.closed_readers = 0
        # counters
        self.received = 0
        self.bytes_received = 0
        self.transfers = 0
        self.taken = 0
        self.requests_sent = 0
        self.requests_expired = 0
        self.offers_deferred = 0
        self.holds_taken = 0

    # -- credit --------------------------------------------------------------------------------

    def grant(self, rank: int) -> tuple[int, int] | None:
        """Credit to grant ``rank`` now, as (request_id, credits), or None (the request frame
        also carries ``peers[rank].acknowledged``).

        Credit covers only room the receiver has (``window`` per sender, less what is granted,
        on the wire and queued); it is granted in chunks of at least a quarter window, so that a
        steady stream does not cost one request per payload.
        """
        peer = self.peers[rank]
        if peer.announced is not None or peer.failed is not None:
            return None
        free = self.window - peer.outstanding - peer.receiving - peer.queued
        if free < max(1, self.window // 4):
            return None
        request_id = self._next_request_id
        self._next_request_id += 1
        peer.requests.append([request_id, free])
        self.requests_sent += 1
        return request_id, free

    def on_expired(self, rank: int, request_id: int, credits_left: int) -> None:
        peer = self.peers[rank]
        for i, (rid, credits) in enumerate(peer.requests):
            if rid == request_id:
                if credits != credits_left:
                    raise PayloadTransportError(
                        f"rank {rank} expired request {request_id} with {credits_left} credits "
                        f"left, this receiver counts {credits}"
                    )
                del peer.requests[i]
                self.requests_expired += 1
                return
        raise PayloadTransportError(f"rank {rank} expired unknown request {request_id}")

    # -- offers --------------------------------------------------------------------------------

    def on_offer(self, rank: int, words: list[int], *, can_accept: bool) -> _Accepted | None:
        """Decide on an offer: None to defer it (receives are held), else what to receive.

        Raises:
            PayloadTransportError: the offer breaks the protocol (beyond credit, out of order).
        """
        _, _, first_seq, count, first_request_id, coalesced = words[:6]
        peer = self.peers[rank]
        problem = None
        if peer.announced is not None:
            problem = "after its goodbye"
        elif not 0 < count <= peer.outstanding:
            problem = f"of {count} payloads with credit for {peer.outstanding}"
        elif first_seq != peer.next_seq:
            problem = f"starting at payload {first_seq}, expected {peer.next_seq}"
        elif peer.requests[0][0] != first_request_id:
            problem = f"against request {first_request_id}, oldest is {peer.requests[0][0]}"
        if problem is not None:
            raise PayloadTransportError(f"rank {rank} made an offer {problem}")
        if not can_accept:
            self.deferred.add(rank)
            self.offers_deferred += 1
            peer.deferred = count
            return None
        peer.deferred = 0
        request_ids: list[int] = []
        left = count
        while left:
            head = peer.requests[0]
            used = min(head[1], left)
            request_ids.extend([head[0]] * used)
            head[1] -= used
            left -= used
            if not head[1]:
                peer.requests.popleft()
        peer.next_seq += count
        peer.receiving += count
        self._next_ticket += 1
        self.in_flight[self._next_ticket] = rank
        return _Accepted(
            self._next_ticket,
            first_seq,
            tuple(offer_sizes(words, count)),
            tuple(request_ids),
            bool(coalesced),
        )

    def on_received(self, accepted: _Accepted, payloads: list[ReceivedPayload]) -> None:
        self.in_flight.pop(accepted.ticket, None)
        peer = self.peers[payloads[0].source]
        peer.receiving -= len(payloads)
        peer.queued += len(payloads)
        peer.received += len(payloads)
        self.queue.extend(payloads)
        self.received += len(payloads)
        self.bytes_received += sum(p.nbytes for p in payloads)
        self.transfers += 1

    def take(self) -> ReceivedPayload | None:
        if not self.queue:
            return None
        payload = self.queue.popleft()
        peer = self.peers[payload.source]
        peer.queued -= 1
        peer.taken += 1
        self.taken += 1
        return payload

    def acknowledge_taken(self) -> None:
        """The trainer moved on (it asks for the next payload): what it took is acknowledged."""
        for peer in self.peers.values():
            peer.acknowledged = peer.taken

    def on_peer_failed(self, rank: int, cause: str) -> None:
        """``rank``'s connection failed: what it had in flight here is lost, the rest goes on."""
        peer = self.peers[rank]
        peer.failed = cause
        peer.lost_in_flight = peer.receiving + peer.deferred
        peer.receiving = peer.deferred = 0
        peer.requests.clear()
        self.deferred.discard(rank)
        for ticket in [t for t, r in self.in_flight.items() if r == rank]:
            del self.in_flight[ticket]

    def on_bye(self, rank: int, total: int) -> None:
        peer = self.peers[rank]
        peer.announced = total
        peer.requests.clear()

    # -- holds ---------------------------------------------------------------------------------

    def begin_hold(self) -> None:
        self.holds += 1
        self.holds_taken += 1

    def end_hold(self) -> list[int]:
        """Release one hold; the senders to tell to resume once none is left."""
        self.holds -= 1
        if self.holds:
            return []
        ranks = sorted(r for r in self.deferred if self.peers[r].announced is None)
        self.deferred.clear()
        return ranks

    def fail(self, exc: BaseException) -> None:
        """Keep the first failure of a thread (see :meth:`TransportEnd._fail`)."""
        if self.error is None:
            self.error = exc

    def flush_target(self) -> int | None:
        return max(self.in_flight, default=None)

    def flushed(self, target: int) -> bool:
        return not any(t <= target for t in self.in_flight)

    # -- totals --------------------------------------------------------------------------------

    @property
    def all_closed(self) -> bool:
        """Every sender said goodbye or failed: nothing more will arrive."""
        return all(p.announced is not None or p.failed is not None for p in self.peers.values())

    @property
    def announced(self) -> int:
        return sum(p.announced for p in self.peers.values() if p.announced is not None)

    @property
    def lost(self) -> int:
        closed = sum(
            p.announced - p.received for p in self.peers.values() if p.announced is not None
        )
        return closed + sum(p.lost_in_flight for p in self.peers.values())


class PayloadReceiver(TransportEnd):
    """The trainer side of the payload transport; see the module docstring.

    One reader thread per sender (daemons, started in the constructor) answers that sender's
    control frames and receives its accepted transfers, one transfer at a time over all
    senders. :meth:`get` hands payloads out in arrival order, each sender's in its order.

    Args:
        groups: the transport's :class:`~rollout_sync.payload.PayloadGroups`.
        sender_ranks: the global ranks of the :class:`~rollout_sync.PayloadSender` s.
        window: payloads each sender may have granted or queued here at once.
        request_timeout: seconds a credit request stays valid at a sender while it could send
            (it stands still while the sender is held); an expired one is granted afresh, which
            also keeps an idle pair's control traffic alive.
        device: where received buffers live; default: the current CUDA device for an NCCL data
            group, else CPU.
        timeline: records a ``payload_recv`` span for every transfer.
        default_timeout: seconds, the limit of every wait called with ``timeout=None`` and of
            each transfer.
    """

    _state: _ReceiverState

    def __init__(
        self,
        groups: PayloadGroups,
        sender_ranks: Sequence[int],
        *,
        window: int = 64,
        request_timeout: float = 10.0,
        device: torch.device | str | None = None,
        timeline: Timeline | None = None,
        default_timeout: float = 60.0,
    ) -> None:
        ranks = tuple(sender_ranks)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"sender_ranks must be distinct and not empty, got {ranks}")
        if dist.get_rank() in ranks:
            raise ValueError(f"sender_ranks {ranks} include this process's own rank")
        if window < 1:
            raise ValueError(f"window must be >= 1 payload, got {window}")
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
        super().__init__(
            name="payload ingress",
            default_timeout=default_timeout,
            hold_timeout_error=IngressHoldTimeout,
            failure_subject="the payload receiver",
        )
        self.groups = groups
        self.sender_ranks = ranks
        self.device = device_for_group(groups.data, device)
        self.timeline = timeline
        self._state = _ReceiverState(ranks, window, int(request_timeout * 1e6))
        self._arrived = threading.Condition(self._lock)
        """get() waits here for payloads; close() for goodbyes."""
        self._progress = threading.Condition(self._lock)
        """Flushes wait here for transfers to finish."""
        self._conditions = (self._arrived, self._progress)
        self._send_locks = {rank: threading.Lock() for rank in ranks}
        """Per sender: frames to it go out one at a time, credit in the order it was granted."""
        self._data_lock = threading.Lock()
        """One transfer on the data group at a time, over all senders."""
        self._readers = [
            threading.Thread(
                target=self._read_loop,
                args=(rank,),
                daemon=True,
                name=f"payload-receiver-from-{rank}",
            )
            for rank in ranks
        ]
        for reader in self._readers:
            reader.start()

    # -- taking payloads -----------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> ReceivedPayload:
        """The next payload, waiting up to ``timeout`` seconds for one to arrive.

        Raises:
            PayloadTimeout: none arrived in time (the message says whether senders are held).
            PayloadsExhausted: every sender has closed and every payload was taken.
            PayloadTransportError: the transport failed.
        """
        limit, deadline = self._deadline(timeout)
        with self._lock:
            self._state.acknowledge_taken()
            while True:
                payload = self._state.take()
                if payload is not None:
                    break
                self._raise_if_failed("receive a payload")
                if self._state.all_closed:
                    raise self._exhausted()
                if expired(deadline):
                    raise PayloadTimeout(
                        f"no payload arrived within {limit:.1f} s ({self._idle_reason()})",
                        operation="receive a payload",
                        timeout=limit,
                    )
                self._arrived.wait(wait_arg(deadline))
        self._top_up_after_take(payload.source)
        return payload

    def iter_payloads(self, timeout: float | None = None) -> Iterator[ReceivedPayload]:
        """Every payload until all senders have closed; ``timeout`` bounds each wait.

        A clean end (every sender closed) ends the loop. An end where a sender failed instead
        (its process died, say: what it had not sent never comes) raises
        :class:`~rollout_sync.errors.PayloadSendersFailed` once the others are done, so a
        plain ``for`` loop learns that data was lost. Otherwise raises what :meth:`get`
        raises.
        """
        while True:
            try:
                payload = self.get(timeout)
            except PayloadSendersFailed:
                raise
            except PayloadsExhausted:
                return
            yield payload

    def _exhausted(self) -> PayloadsExhausted:
        """What :meth:`get` raises once every sender has closed or failed (under the lock)."""
        failed = {p.rank: p.failed for p in self._state.peers.values() if p.failed}
        n = len(self.sender_ranks)
        if not failed:
            return PayloadsExhausted(
                f"no more payloads: all {n} senders have closed and every payload they sent "
                "was taken"
            )
        lost = self._state.lost
        return PayloadSendersFailed(
            f"no more payloads, but the stream did not end cleanly: sender(s) {failed} of {n} "
            f"failed instead of closing (whatever they had not sent never comes; {lost} in "
            "flight lost); every payload that arrived was taken",
            failed_senders=failed,
            lost=lost,
        )

    def get_nowait(self) -> ReceivedPayload:
        """The next payload if one is queued; raise :class:`WouldBlock` if none is."""
        with self._lock:
            self._state.acknowledge_taken()
            payload = self._state.take()
            if payload is None:
                self._raise_if_failed("receive a payload")
                raise WouldBlock("no payload is queued")
        self._top_up_after_take(payload.source)
        return payload

    # -- the mirror hold -----------------------------------------------------------------------

    def hold_receives(self, timeout: float | None = None) -> AbstractContextManager[None]:
        """Keep payload receives off the data group for the ``with`` body.

        On entry new offers are deferred and this waits until the transfer being received
        has completed. Payloads already received stay available to :meth:`get`. On exit each
        sender that was deferred is told to resume. Shared among threads and re-entrant. See
        the module docstring for when to take it in a sync.

        Raises:
            IngressHoldTimeout: the transfer being received did not complete within
                ``timeout`` seconds (None: the default). Nothing is held then.
        """
        return self._hold(timeout)

    def _begin_hold(self) -> None:
        with self._lock:
            self._state.begin_hold()

    def _end_hold(self) -> None:
        with self._lock:
            resume = self._state.end_hold()
        for rank in resume:
            # A failure here surfaces from the next call; raising would hide the body's error.
            try:
                with self._send_locks[rank]:
                    self._send_frame(rank, make_frame(FrameKind.RESUME))
            except BaseException as exc:
                self._fail_from(rank, exc)

    def flush_pending_receives(self, timeout: float | None = None) -> None:
        """Return once the transfers being received at the call have completed.

        Raises:
            IngressHoldTimeout: they did not complete within ``timeout`` seconds.
        """
        self._flush(
            timeout,
            "flush pending payload receives",
            lambda limit: IngressHoldTimeout(
                f"payload receives in flight did not complete within {limit:.1f} s "
                f"({len(self._state.in_flight)} transfers; a sender may have died)",
                operation="flush pending payload receives",
                timeout=limit,
                sections_running=len(self._state.in_flight),
            ),
        )

    # -- closing -------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Wait until every sender has closed (sent its goodbye), then stop the readers.

        Payloads still queued stay available to :meth:`get_nowait`.

        Raises:
            PayloadTimeout: some sender had not closed after ``timeout`` seconds.
            PayloadTransportError: the transport had failed (its cause is chained).
        """
        limit, deadline = self._deadline(timeout)

        def timed_out() -> PayloadTimeout:
            open_ranks = [p.rank for p in self._state.peers.values() if p.announced is None]
            return PayloadTimeout(
                f"payload senders on ranks {open_ranks} had not closed after "
                f"{limit:.1f} s; close them first (PayloadSender.close)",
                operation="close the payload receiver",
                timeout=limit,
            )

        with self._lock:
            # After a failure the other readers may wait for ever on a dead peer: it raises now.
            self._wait_until(
                self._arrived,
                lambda: self._state.closed_readers >= len(self._readers),
                deadline,
                "close the payload receiver",
                timed_out,
            )
        for reader in self._readers:
            reader.join(wait_arg(deadline))
        self._raise_if_failed("close the payload receiver")

    # -- introspection -------------------------------------------------------------------------

    def statistics(self) -> ReceiverStatistics:
        with self._lock:
            s = self._state
            return ReceiverStatistics(
                sender_ranks=self.sender_ranks,
                received=s.received,
                bytes_received=s.bytes_received,
                transfers=s.transfers,
                queued=len(s.queue),
                taken=s.taken,
                credit_outstanding=sum(p.outstanding for p in s.peers.values()),
                requests_sent=s.requests_sent,
                requests_expired=s.requests_expired,
                offers_deferred=s.offers_deferred,
                holds=s.holds,
                holds_taken=s.holds_taken,
                senders_closed=sum(p.announced is not None for p in s.peers.values()),
                announced=s.announced,
                lost=s.lost,
                acknowledged=sum(p.acknowledged for p in s.peers.values()),
                failed_senders={p.rank: p.failed for p in s.peers.values() if p.failed},
            )

    def __repr__(self) -> str:
        s = self.statistics()
        state = f"held x{s.holds}" if s.holds else "open"
        return (
            f"<PayloadReceiver from ranks {list(s.sender_ranks)} {state}: {s.queued} queued, "
            f"{s.received} received, {s.senders_closed}/{len(s.sender_ranks)} senders closed>"
        )

    # -- the reader threads --------------------------------------------------------------------

    def _read_loop(self, rank: int) -> None:
        frame = torch.empty(FRAME_WORDS, dtype=torch.int64)
        try:
            use_device(self.device)
            self._top_up(rank)
            while True:
                recv_frame(frame, rank, self.groups.control, self.groups.timeout_s)
                kind, words = read_frame(frame, rank)
                if kind is FrameKind.OFFER:
                    self._on_offer(rank, words)
                elif kind is FrameKind.EXPIRED:
                    with self._lock:
                        self._state.on_expired(rank, words[1], words[2])
                    self._top_up(rank)
                elif kind is FrameKind.BYE:
                    with self._send_locks[rank]:
                        with self._lock:
                            self._state.on_bye(rank, words[1])
                            acknowledged = self._state.peers[rank].acknowledged
                        self._send_frame(rank, make_frame(FrameKind.BYE_ACK, acknowledged))
                    return
                else:
                    raise PayloadTransportError(f"rank {rank} sent {kind.name} to a receiver")
        except BaseException as exc:  # kept: every later call re-raises it
            self._fail_from(rank, exc, reader=True)
        finally:
            with self._lock:
                self._state.closed_readers += 1
                self._arrived.notify_all()

    def _on_offer(self, rank: int, words: list[int]) -> None:
        # The decision and its answer go out under the sender's send lock, so a RESUME for a
        # hold that ends meanwhile is sent after the DEFER it answers, never before.
        with self._send_locks[rank]:
            with self._lock:
                can_accept = False
                if not self._state.holds:
                    try:
                        self._gate.enter_section_nowait()
                        can_accept = True
                    except WouldBlock:
                        pass
                try:
                    accepted = self._state.on_offer(rank, words, can_accept=can_accept)
                except BaseException:
                    if can_accept:
                        self._gate.exit_section()
                    raise
            start = time.monotonic_ns()
            kind = FrameKind.DEFER if accepted is None else FrameKind.ACCEPT
            try:
                self._send_frame(rank, make_frame(kind, words[1]))
            except BaseException:
                if accepted is not None:
                    self._gate.exit_section()
                raise
        if accepted is None:
            return
        try:
            buffers = self._receive_transfer(rank, accepted)
            if self.timeline is not None:
                self.timeline.add_span(
                    SpanKind.PAYLOAD_RECV,
                    f"payloads from rank {rank}",
                    start,
                    first_seq=accepted.first_seq,
                    count=len(buffers),
                    bytes=sum(accepted.sizes),
                )
            payloads = []
            for i, buffer in enumerate(buffers):
                tensors, meta = unpack_payload(buffer)
                payloads.append(
                    ReceivedPayload(
                        rank,
                        accepted.first_seq + i,
                        tensors,
                        meta,
                        accepted.request_ids[i],
                        buffer.numel(),
                    )
                )
            # Delivered inside the section: a hold that waited for this transfer sees it counted.
            with self._lock:
                self._state.on_received(accepted, payloads)
                self._arrived.notify_all()
                self._progress.notify_all()
        finally:
            self._gate.exit_section()

    def _receive_transfer(self, rank: int, accepted: _Accepted) -> list[torch.Tensor]:
        """Receive an accepted transfer's buffers on the data group (inside its section)."""
        if accepted.coalesced:
            messages = [torch.empty(sum(accepted.sizes), dtype=torch.uint8, device=self.device)]
        else:
            messages = [
                torch.empty(n, dtype=torch.uint8, device=self.device) for n in accepted.sizes
            ]
        with self._data_lock:
            ops = [dist.P2POp(dist.irecv, m, rank, group=self.groups.data) for m in messages]
            transfer_p2p(
                ops,
                self.device,
                self.default_timeout,
                f"receiving {len(accepted.sizes)} payloads from rank {rank}",
                rank,
            )
        if accepted.coalesced:
            return list(torch.split(messages[0], list(accepted.sizes)))
        return messages

    def _top_up_after_take(self, rank: int) -> None:
        """Grant the room a take freed. The payload is already the caller's: a failure here
        must not lose it, so it is kept and raised by the next call instead."""
        try:
            self._top_up(rank)
        except BaseException as exc:  # kept: every later call re-raises it
            self._fail_from(rank, exc)

    def _top_up(self, rank: int) -> None:
        """Grant ``rank`` the credit there is room for (requests go out in grant order)."""
        with self._send_locks[rank]:
            with self._lock:
                if self._state.error is not None:
                    return
                grant = self._state.grant(rank)
                acknowledged = self._state.peers[rank].acknowledged
            if grant is not None:
                request_id, credits = grant
                self._send_frame(
                    rank,
                    make_frame(
                        FrameKind.REQUEST,
                        request_id,
                        credits,
                        self._state.request_timeout_us,
                        acknowledged,
                    ),
                )

    def _fail_from(self, rank: int, exc: BaseException, *, reader: bool = False) -> None:
        """A failure talking to sender ``rank``. If its connection closed (it died), that
        sender is marked failed and the receiver goes on with the others; its reader thread,
        the only one that receives from it, then counts what it had in flight as lost and
        releases a hold or flush waiting for its transfer. Anything else, a timeout included
        (on gloo a timed-out wait closes every pair of the group), fails the receiver."""
        if not (
            isinstance(exc, PayloadTransportError) and exc.peer == rank and exc.cause == "closed"
        ):
            self._fail(exc)
            return
        with self._lock:
            peer = self._state.peers[rank]
            if peer.failed is None:
                peer.failed = "closed"  # no more credit for it
            if reader:
                self._state.on_peer_failed(rank, "closed")
            self._progress.notify_all()
            self._arrived.notify_all()

    def _send_frame(self, rank: int, frame: torch.Tensor) -> None:
        """Send a control frame to ``rank``; the caller holds that rank's send lock."""
        send_frame(frame, rank, self.groups.control, self.default_timeout)

    # -- errors --------------------------------------------------------------------------------

    def _idle_reason(self) -> str:
        s = self._state
        open_ranks = [p.rank for p in s.peers.values() if p.announced is None]
        parts = [f"{len(open_ranks)} sender(s) open"]
        if s.holds:
            parts.append(f"receives held x{s.holds}")
        if s.deferred:
            parts.append(f"offers deferred from ranks {sorted(s.deferred)}")
        return ", ".join(parts)
