"""An emulated NIC: weight transfers on one machine, paced as if every rank had a link of its own.

On one small machine every process shares one loopback and a few cores, so a topology that
wins by spreading bytes over more links (the pipelined relay, sharding) cannot show it in a
wall-clock run: the cores, not the links, bound every hop. The emulated NIC gives each rank a
link with a set rate and latency (a :class:`~rollout_sync.scale.Link`) and paces the transfer's
collectives and point-to-point messages on it, so that link time dominates and topologies
compete for modelled links. It is for benchmarks and tests (``benchmarks/scale.py``), never a
production path: nothing in the package builds one; a benchmark injects it by building a
:class:`PacedWeightTransfer` where it would build a :class:`~rollout_sync.WeightTransfer`, and
a :class:`PacedShardedTransfer` where it would build a
:class:`~rollout_sync.transfer.ShardedTransfer`.

How it paces. Each rank has one :class:`EmulatedNic`, shared by every transfer of its process:
two links, **egress** (what it sends) and **ingress** (what it receives), full duplex (the two
are independent), each a queue of reservations at a set rate (:meth:`EmulatedNic.reserve_egress`
and :meth:`EmulatedNic.reserve_ingress`: ``start = max(not before, link free)``, ``finish =
start + nbytes / rate``). Every message (a point-to-point bucket, each copy of a broadcast)
takes both:

* The sender reserves its egress when it launches and sends a **stamp** (three ``float64``:
  the egress start, the egress finish, the latency) just before the data.
* The receiver reserves its ingress from ``max(egress start, ingress free)`` and the message
  arrives at ``max(egress finish, ingress finish) + latency`` (the latency: the larger of the
  sender's egress and the receiver's ingress link's). Its wait returns only once the real
  bytes are there *and* that instant has passed, so causality holds across hops: a relay
  forwards bucket ``k`` after its emulated arrival, never at the real one.
* The sender's side completes at ``egress finish + latency``: the bytes have left its link
  (the network holds what the receiver's ingress has not taken yet).

What is exact, and what is not. A message occupies each of its two links for ``nbytes /
rate``, but not necessarily at the same time: the network between them is a buffer. So a
receiver fed by several senders at once (a sharded P2R into a replica rank from every trainer
rank that holds its regions) takes them back to back at its ingress rate, and the hop ends at
the ingress floor (its bytes over its rate) whenever the senders keep its ingress busy; a
sender feeding several receivers ends at the egress floor; each side is exact as the
bottleneck. A real network shares a link between flows instead (TCP's fair share): where one
side is the bottleneck the totals and the last arrival are the same, the order within the hop
is not (here the message the receiver took first arrives first, there all of them late). The
ingress is reserved in the order the receiver resolves its messages (the order its transfer
waits for them: a sharded receiver interleaves its sources, bucket by bucket); a message whose
sender started late can leave a gap in the ingress that an earlier one is not moved into.

**A broadcast** is charged as the group's backend sends it (the ``broadcast`` argument of
:class:`PacedCollectives`, a :class:`~rollout_sync.scale.Broadcast`):

* ``Broadcast.GLOO``, the default, as gloo sends it: every group here is gloo, and
  ``ProcessGroupGloo`` runs ``gloo::broadcast`` (gloo/broadcast.cc) for CPU tensors, a
  binomial tree of whole messages. Members are numbered from the root (virtual rank
  ``(rank - root) mod n``); in round ``i`` each member below ``2**i`` sends the whole message
  to the member ``2**i`` above it, and a member sends only once it received all of it. So the
  root sends ``ceil(log2 n)`` copies, one per round, and a member with children forwards. Here
  each sender reserves its egress once per child, in round order (gloo issues the root's
  copies back to back and TCP shares the link between them: the last copy ends at the same
  instant either way, the earlier ones earlier here), and sends that child its stamp point to
  point (tag :data:`BROADCAST_STAMP_TAG` plus the broadcast's sequence number on this
  collectives object); a member with children reserves its egress from its own arrival (store
  and forward) when it resolves its stamp, in its wait (so a member with children must wait for
  every broadcast it takes part in, as the transfers do). Measured on this machine
  (``benchmarks/gloo_broadcast.py``: the bytes each process wrote to its sockets during a
  67 MB broadcast from rank 0, torch 2.13): to 1 receiver the root wrote 1.0 copy; to 2, 2.0;
  to 3, the root 2.0 and the first receiver 1.0, the others nothing; the loopback carried 1, 2
  and 3 copies.
* ``Broadcast.CHAIN``: NCCL's pipelined chain, the source's egress charged once whatever the
  group's size; its stamp goes to every member on a broadcast of its own, and every member
  reserves its ingress from it. The chain's forwarding members' egress is not charged.

A member's broadcast completes at its arrival and, with children, once its copies left its
egress (``egress finish + latency``); the root's, once its last copy left.

* **An all-gather** (a vote) completes ``latency`` after the real one; its bytes are not
  charged.
* The clock is ``time.monotonic()``, which every process of one machine shares (Linux
  ``CLOCK_MONOTONIC``): the emulation is for one machine only.

The real transfer still happens underneath and still costs its time; choose a rate well below
the loopback's so that the pacing, not the cores, sets the pace.
"""

from __future__ import annotations

import datetime
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..scale import Broadcast, Link
from ..trace import Timeline
from ..transfer import (
    ShardedTransfer,
    TransferConfig,
    TransferHooks,
    TransferPlan,
    WeightTransfer,
)

__all__ = [
    "BROADCAST_STAMP_TAG",
    "STAMP_TAG",
    "EmulatedNic",
    "NicStatistics",
    "PacedCollectives",
    "PacedShardedTransfer",
    "PacedWeightTransfer",
    "gloo_tree",
]

STAMP_TAG = 1 << 30
"""Added to a point-to-point message's tag for the message that carries its stamp."""
BROADCAST_STAMPS = 1 << 20
BROADCAST_STAMP_TAG = STAMP_TAG - BROADCAST_STAMPS
"""A gloo broadcast's stamps travel point to point on ``BROADCAST_STAMP_TAG + (its sequence
number mod BROADCAST_STAMPS)``; the paced sends' own tags must be below it."""


@dataclass(frozen=True)
class NicStatistics:
    """A snapshot of an :class:`EmulatedNic`: what its two links carried."""

    broadcasts: int
    """Broadcasts this rank was the root of."""
    bytes_sent: int
    """Bytes its egress carried: point-to-point messages, and every broadcast copy it sent
    (a gloo root's ``ceil(log2 n)``, a forwarding member's)."""
    busy_s: float
    """Seconds the egress was reserved for (bytes / rate, summed)."""
    sends: int = 0
    """Point-to-point sends."""
    copies: int = 0
    """Broadcast copies its egress carried (a chain's root: one per broadcast)."""
    bytes_received: int = 0
    """Bytes its ingress carried (point-to-point messages and broadcasts it received)."""
    received: int = 0
    """Messages its ingress carried."""
    ingress_busy_s: float = 0.0
    """Seconds the ingress was reserved for."""


class _Queue:
    """One direction of one link: reservations back to back at its rate.

    Bookkeeping only (no lock, no clock): the caller says when a reservation may start.
    Invariant: ``free_at`` is the finish of the latest reservation (0 before any), and every
    reservation starts at or after the one before it finished.
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self.free_at = 0.0
        self.messages = 0
        self.nbytes = 0
        self.busy_s = 0.0

    def reserve(self, nbytes: int, not_before: float) -> tuple[float, float]:
        """Queue ``nbytes`` from ``not_before`` or once the link is free: (start, finish)."""
        start = max(not_before, self.free_at)
        busy = nbytes / self.link.rate_bytes_per_s
        self.free_at = start + busy
        self.messages += 1
        self.nbytes += nbytes
        self.busy_s += busy
        return start, self.free_at


class EmulatedNic:
    """One rank's emulated NIC: an egress and an ingress link, full duplex, each a queue of
    reservations at a set rate and latency (the ingress the egress's unless given).

    Thread-safe: a relay reserves from the thread that forwards. Never blocks; the waiting is
    done by the collectives' work handles (:class:`PacedCollectives`).
    """

    def __init__(self, link: Link, *, ingress: Link | None = None) -> None:
        self.link = link
        """The egress link."""
        self.ingress = ingress if ingress is not None else link
        self._lock = threading.Lock()
        self._egress = _Queue(link)
        self._ingress = _Queue(self.ingress)
        self._broadcasts = 0
        self._copies = 0
        self._sends = 0

    def __repr__(self) -> str:
        s = self.statistics()
        ingress = "" if self.ingress == self.link else f", ingress {_rate(self.ingress)}"
        return (
            f"<EmulatedNic {_rate(self.link)}{ingress}: {s.broadcasts} broadcast, "
            f"{s.sends} sent, {s.bytes_sent} bytes out, {s.bytes_received} bytes in>"
        )

    def reserve_egress(
        self, nbytes: int, *, not_before: float | None = None, send: bool = False
    ) -> tuple[float, float]:
        """Queue ``nbytes`` on the egress from ``not_before`` (default: now): a broadcast copy,
        or with ``send`` a point-to-point message. Its ``(start, finish)`` instants
        (``time.monotonic()``)."""
        with self._lock:
            now = time.monotonic() if not_before is None else not_before
            if send:
                self._sends += 1
            else:
                self._copies += 1
            return self._egress.reserve(nbytes, now)

    def reserve_ingress(self, nbytes: int, *, not_before: float) -> tuple[float, float]:
        """Queue ``nbytes`` on the ingress from ``not_before`` (the sender's egress start) or
        once it is free: ``(start, finish)``."""
        with self._lock:
            return self._ingress.reserve(nbytes, not_before)

    def arrival(self, nbytes: int, stamp: Sequence[float]) -> float:
        """Take in a message of ``nbytes`` whose sender's ``stamp`` is ``(egress start, egress
        finish, latency)``: reserve the ingress, and return the instant it arrives."""
        start, finish, latency = stamp
        _, taken = self.reserve_ingress(nbytes, not_before=start)
        return max(finish, taken) + max(latency, self.ingress.latency_s)

    def count_broadcast(self) -> None:
        """Count a broadcast this rank is the root of (its copies are reserved apart)."""
        with self._lock:
            self._broadcasts += 1

    def statistics(self) -> NicStatistics:
        with self._lock:
            return NicStatistics(
                self._broadcasts,
                self._egress.nbytes,
                self._egress.busy_s,
                sends=self._sends,
                copies=self._copies,
                bytes_received=self._ingress.nbytes,
                received=self._ingress.messages,
                ingress_busy_s=self._ingress.busy_s,
            )


def _rate(link: Link) -> str:
    return f"{link.rate_bytes_per_s / 1e6:g} MB/s, {link.latency_s * 1e3:g} ms"


def gloo_tree(vrank: int, members: int) -> tuple[int | None, list[int]]:
    """``gloo::broadcast``'s binomial tree: the parent and the children, in the rounds they are
    sent to, of the member at virtual rank ``vrank`` (``(rank - root) mod members``) of a group
    of ``members``. In round ``i`` each member below ``2**i`` sends to the one ``2**i`` above.
    """
    if not 0 <= vrank < members:
        raise ValueError(f"virtual rank {vrank} is not in a group of {members}")
    rounds = math.ceil(math.log2(members)) if members > 1 else 0
    top = vrank.bit_length()  # the round this member receives in, plus one (root: 0)
    parent = None if vrank == 0 else vrank - (1 << (top - 1))
    children = [vrank + (1 << i) for i in range(top, rounds) if vrank + (1 << i) < members]
    return parent, children


_Resolved = tuple[float, list[dist.Work]]


class _PacedWork(dist.Work):
    """The real operations' work handles, completing no earlier than an emulated instant.

    ``resolve`` runs once, after the real works completed (a stamp is there to read), on the
    thread that first waits or asks: it returns the instant (a receiver reserves its ingress in
    it) and more works to wait for (a forwarding member's stamps to its children).
    """

    def __init__(self, works: Sequence[dist.Work], *, resolve: Callable[[], _Resolved]) -> None:
        super().__init__()
        self._works = list(works)
        self._resolve = resolve
        self._lock = threading.Lock()
        self._resolved: _Resolved | None = None

    def _arrival(self) -> _Resolved:
        with self._lock:
            if self._resolved is None:
                self._resolved = self._resolve()
            return self._resolved

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Wait for the real work, then until the emulated arrival; ``False`` if ``timeout``
        (zero: none) ran out first. A failure of the real work raises as it would unpaced."""
        limit = timeout.total_seconds() or math.inf
        deadline = time.monotonic() + limit
        if not _wait_all(self._works, deadline):
            return False
        arrives, more = self._arrival()
        if not _wait_all(more, deadline):
            return False
        # Sleeping is the pacing itself: the emulated link's time, not a wait for another thread.
        pause = arrives - time.monotonic()
        if pause > deadline - time.monotonic():
            time.sleep(max(0.0, deadline - time.monotonic()))
            return False
        if pause > 0:
            time.sleep(pause)
        return True

    def is_completed(self) -> bool:
        if not all(work.is_completed() for work in self._works):
            return False
        arrives, more = self._arrival()
        return all(work.is_completed() for work in more) and time.monotonic() >= arrives


def _wait_all(works: Sequence[dist.Work], deadline: float) -> bool:
    for work in works:
        left = deadline - time.monotonic()
        if math.isfinite(left):
            done = work.wait(datetime.timedelta(seconds=max(left, 1e-3)))
        else:
            done = work.wait()
        if done is False:
            return False
    return True


def _stamp(start: float, finish: float, latency: float) -> torch.Tensor:
    return torch.tensor([start, finish, latency], dtype=torch.float64)


class PacedCollectives(GroupCollectives):
    """:class:`~rollout_sync.distributed.GroupCollectives` whose operations take the time
    this rank's :class:`EmulatedNic` says they take (the module docstring says how).

    ``broadcast`` says how a broadcast is charged: ``Broadcast.GLOO`` (as gloo sends it, the
    default) or ``Broadcast.CHAIN`` (as NCCL would). Every member of a group must pace it
    alike.

    Raises:
        ValueError: the group is not gloo (the emulation reads its instants on the host).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        nic: EmulatedNic,
        *,
        broadcast: Broadcast = Broadcast.GLOO,
    ) -> None:
        super().__init__(group)
        if self.backend != "gloo":
            raise ValueError(
                f"the emulated NIC paces gloo (CPU) groups on one machine, got a {self.backend} "
                "group; benchmark NCCL on real links"
            )
        self.nic = nic
        self.algorithm = Broadcast(broadcast)
        self._sequence = itertools.count()

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start ``tensor``'s broadcast from ``src``; every member's work completes at its
        emulated arrival (the root's, once its copies left its link)."""
        nbytes = tensor.numel() * tensor.element_size()
        sequence = next(self._sequence)
        if self.algorithm is Broadcast.CHAIN:
            return self._chain(tensor, src, nbytes)
        return self._gloo(tensor, src, nbytes, sequence)

    def _chain(self, tensor: torch.Tensor, src: int, nbytes: int) -> dist.Work:
        latency = self.nic.link.latency_s
        if self.rank == src:
            self.nic.count_broadcast()
            start, finish = self.nic.reserve_egress(nbytes)
            stamp = _stamp(start, finish, latency)
            works = [super().broadcast(stamp, src), super().broadcast(tensor, src)]
            return _PacedWork(works, resolve=lambda: (finish + latency, []))
        stamp = torch.zeros(3, dtype=torch.float64)
        works = [super().broadcast(stamp, src), super().broadcast(tensor, src)]
        return _PacedWork(works, resolve=lambda: (self.nic.arrival(nbytes, stamp.tolist()), []))

    def _gloo(self, tensor: torch.Tensor, src: int, nbytes: int, sequence: int) -> dist.Work:
        members = len(self.ranks)
        root = self.ranks.index(src)
        vrank = (self.ranks.index(self.rank) - root) % members
        parent, children = gloo_tree(vrank, members)
        tag = BROADCAST_STAMP_TAG + sequence % BROADCAST_STAMPS

        def rank_of(v: int) -> int:
            return self.ranks[(v + root) % members]

        def forward(not_before: float | None) -> _Resolved:
            """Reserve a copy per child, in round order, and send each its stamp."""
            latency = self.nic.link.latency_s
            done, sent = 0.0, []
            for child in children:
                start, finish = self.nic.reserve_egress(nbytes, not_before=not_before)
                stamp = _stamp(start, finish, latency)
                sent.append(GroupCollectives.send(self, stamp, rank_of(child), tag))
                done = finish + latency
            return done, sent

        if parent is None:
            self.nic.count_broadcast()
            done, sent = forward(None)
            data = super().broadcast(tensor, src)
            return _PacedWork([*sent, data], resolve=lambda: (done, []))
        stamp = torch.zeros(3, dtype=torch.float64)
        works = [super().recv(stamp, rank_of(parent), tag), super().broadcast(tensor, src)]

        def resolve() -> _Resolved:
            arrives = self.nic.arrival(nbytes, stamp.tolist())
            done, sent = forward(arrives)
            return max(arrives, done), sent

        return _PacedWork(works, resolve=resolve)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        """Start the all-gather; it completes one link latency after the real one."""
        work = super().all_gather(outputs, tensor)
        delay = self.nic.link.latency_s
        return _PacedWork([work], resolve=lambda: (time.monotonic() + delay, []))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending ``tensor`` to ``dst``: this rank's egress carries it, and the send
        completes once it left (egress finish + latency); its stamp goes ahead of the data, on
        tag ``tag + STAMP_TAG``.

        Raises:
            ValueError: ``tag`` is not below :data:`BROADCAST_STAMP_TAG`.
        """
        _check_tag(tag)
        latency = self.nic.link.latency_s
        start, finish = self.nic.reserve_egress(tensor.numel() * tensor.element_size(), send=True)
        stamp = _stamp(start, finish, latency)
        works = [super().send(stamp, dst, tag + STAMP_TAG), super().send(tensor, dst, tag)]
        return _PacedWork(works, resolve=lambda: (finish + latency, []))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        """Start receiving into ``tensor`` what ``src`` sends with ``tag``; it completes at the
        emulated arrival, this rank's ingress reserved when the wait first sees the stamp.

        Raises:
            ValueError: ``tag`` is not below :data:`BROADCAST_STAMP_TAG`.
        """
        _check_tag(tag)
        nbytes = tensor.numel() * tensor.element_size()
        stamp = torch.zeros(3, dtype=torch.float64)
        works = [super().recv(stamp, src, tag + STAMP_TAG), super().recv(tensor, src, tag)]
        return _PacedWork(works, resolve=lambda: (self.nic.arrival(nbytes, stamp.tolist()), []))


def _check_tag(tag: int) -> None:
    if not 0 <= tag < BROADCAST_STAMP_TAG:
        raise ValueError(
            f"a paced point-to-point tag must be in [0, {BROADCAST_STAMP_TAG}) (its stamp "
            f"travels on tag + {STAMP_TAG}, a broadcast's from {BROADCAST_STAMP_TAG}), got {tag}"
        )


class PacedWeightTransfer(WeightTransfer):
    """A :class:`~rollout_sync.WeightTransfer` whose collectives go through ``nic``.

    Everything else (manifest, votes, buckets, checksums, relay) is the production transfer's
    own code: only the time its collectives take is emulated. Give the P2R and the R2R
    transfer of one rank the same ``nic`` (one rank, one NIC). ``broadcast``: how its
    broadcasts are charged (:class:`PacedCollectives`; as gloo sends them by default).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        src: int,
        *,
        nic: EmulatedNic,
        config: TransferConfig | None = None,
        timeline: Timeline | None = None,
        hooks: TransferHooks | None = None,
        broadcast: Broadcast = Broadcast.GLOO,
    ) -> None:
        super().__init__(group, src, config=config, timeline=timeline, device="cpu", hooks=hooks)
        self.collectives = PacedCollectives(group, nic, broadcast=broadcast)
        self.nic = nic

    def __repr__(self) -> str:
        return f"<PacedWeightTransfer src={self.src} group={list(self.ranks)} nic={self.nic!r}>"


class PacedShardedTransfer(ShardedTransfer):
    """A :class:`~rollout_sync.transfer.ShardedTransfer` whose point-to-point sends and votes go
    through ``nic``, as :class:`PacedWeightTransfer` is a paced broadcast transfer.

    The plan, the buckets per peer, the votes and the checks are the production transfer's own
    code. Give a replica rank's P2R (this) and R2R (:class:`PacedWeightTransfer`) transfers the
    same ``nic``: its ingress takes what this rank receives here, its egress what it sends on.
    Other keyword arguments go to :class:`~rollout_sync.transfer.ShardedTransfer` as they are.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        plan: TransferPlan,
        *,
        source_ranks: Sequence[int],
        target_ranks: Sequence[int],
        nic: EmulatedNic,
        config: TransferConfig | None = None,
        timeline: Timeline | None = None,
        hooks: TransferHooks | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            group,
            plan,
            source_ranks=source_ranks,
            target_ranks=target_ranks,
            config=config,
            timeline=timeline,
            device="cpu",
            hooks=hooks,
            **kwargs,
        )
        self.collectives = PacedCollectives(group, nic)
        self.nic = nic

    def __repr__(self) -> str:
        side = "source" if self.is_source else "target"
        return (
            f"<PacedShardedTransfer {side} {self.index} sources={list(self.source_ranks)} "
            f"targets={list(self.target_ranks)} nic={self.nic!r}>"
        )
