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

How it paces, on each rank's :class:`EmulatedNic` (its egress link, shared by every transfer
of that process):

* **A broadcast** is a bandwidth-optimal (chain) broadcast, as NCCL runs one: the source's
  link carries the bytes once, whatever the group's size. The source reserves its link when it
  launches: ``start = max(now, link free)``, ``finish = start + nbytes / rate``; the broadcast
  completes at ``finish + latency`` on every member. The source sends that instant (one
  ``float64`` on the same group, just before the data), and every member's wait returns only
  once the real bytes are there *and* the instant has passed, so causality holds across hops:
  a relay forwards bucket ``k`` after its emulated arrival, never at the real one.
* **A point-to-point send** (a :class:`~rollout_sync.transfer.ShardedTransfer`'s bucket)
  reserves the sender's link the same way and sends the arrival instant as a message of its
  own (one ``float64``, tag ``tag + STAMP_TAG``) just before the data (tag ``tag``); the
  receive completes once both are there and the instant has passed, and so does the send (its
  buffer is reused once the bucket arrived, as a broadcast's source's is).
* **An all-gather** (a vote) completes ``latency`` after the real one.
* The clock is ``time.monotonic()``, which every process of one machine shares (Linux
  ``CLOCK_MONOTONIC``): the emulation is for one machine only.

**Egress only.** Each rank's link is its sending side; what a rank receives is not paced on
its own link. Where a rank receives from one source at a time (the broadcasts of one source
and of the relay) that is exact. Where it receives from several at once (a sharded transfer's
replica rank takes its regions from every trainer rank that holds them) the receiver's link
would be shared, and the emulation does not share it: the cost model's rule for that first
hop, ``max(bytes / trainer ranks, bytes / replica GPUs)`` at one link's rate
(:mod:`rollout_sync.scale`), is the bound that covers ingress. When the plan balances both
sides (as many bytes into each replica rank as out of each trainer rank:
``benchmarks/scale.py``'s 2 trainer ranks into replicas of 2 ranks) the two sides' totals are
equal and pacing egress gives that bound's time; the order within the hop (two sources
bursting into one rank, then one) is not emulated.

The real transfer still happens underneath and still costs its time; choose a rate well below
the loopback's so that the pacing, not the cores, sets the pace.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..scale import Link
from ..trace import Timeline
from ..transfer import (
    ShardedTransfer,
    TransferConfig,
    TransferHooks,
    TransferPlan,
    WeightTransfer,
)

__all__ = [
    "STAMP_TAG",
    "EmulatedNic",
    "NicStatistics",
    "PacedCollectives",
    "PacedShardedTransfer",
    "PacedWeightTransfer",
]

STAMP_TAG = 1 << 30
"""Added to a point-to-point message's tag for the message that carries its arrival instant;
the paced sends' own tags must be below it."""


@dataclass(frozen=True)
class NicStatistics:
    """A snapshot of an :class:`EmulatedNic`: what its link carried."""

    broadcasts: int
    """Broadcasts this rank was the source of (each reserved the link)."""
    bytes_sent: int
    busy_s: float
    """Seconds the link was reserved for (bytes / rate, summed)."""
    sends: int = 0
    """Point-to-point sends (each reserved the link too)."""


class EmulatedNic:
    """One rank's emulated egress link: a queue of reservations at a set rate and latency.

    Thread-safe: a relay reserves from the thread that forwards. Never blocks; the waiting is
    done by the collectives' work handles (:class:`PacedCollectives`).
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._broadcasts = 0
        self._sends = 0
        self._bytes = 0
        self._busy_s = 0.0

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<EmulatedNic {self.link.rate_bytes_per_s / 1e6:g} MB/s, "
            f"{self.link.latency_s * 1e3:g} ms: {s.broadcasts} broadcast, {s.sends} sent, "
            f"{s.bytes_sent} bytes>"
        )

    def reserve(self, nbytes: int, *, send: bool = False) -> float:
        """Queue ``nbytes`` on the link now (a broadcast's, or with ``send`` a point-to-point
        message's); the ``time.monotonic()`` instant they arrive."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            busy = nbytes / self.link.rate_bytes_per_s
            self._free_at = start + busy
            if send:
                self._sends += 1
            else:
                self._broadcasts += 1
            self._bytes += nbytes
            self._busy_s += busy
            return self._free_at + self.link.latency_s

    def statistics(self) -> NicStatistics:
        with self._lock:
            return NicStatistics(self._broadcasts, self._bytes, self._busy_s, sends=self._sends)


class _PacedWork(dist.Work):
    """The real operations' work handles, completing no earlier than an emulated instant.

    ``stamp`` holds the instant (the sender's reservation, sent with the data); without one,
    the instant is ``delay_s`` after the real work was seen complete (an all-gather).
    """

    def __init__(
        self, works: Sequence[dist.Work], *, stamp: torch.Tensor | None, delay_s: float
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._stamp = stamp
        self._delay_s = delay_s
        self._arrives: float | None = None

    def _arrival(self) -> float:
        if self._arrives is None:
            if self._stamp is not None:
                self._arrives = float(self._stamp.item())
            else:
                self._arrives = time.monotonic() + self._delay_s
        return self._arrives

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Wait for the real work, then until the emulated arrival; ``False`` if ``timeout``
        (zero: none) ran out first. A failure of the real work raises as it would unpaced."""
        limit = timeout.total_seconds() or math.inf
        deadline = time.monotonic() + limit
        for work in self._works:
            left = deadline - time.monotonic()
            if math.isfinite(left):
                done = work.wait(datetime.timedelta(seconds=max(left, 1e-3)))
            else:
                done = work.wait()
            if done is False:
                return False
        # Sleeping is the pacing itself: the emulated link's time, not a wait for another thread.
        arrives = self._arrival()
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
        return time.monotonic() >= self._arrival()


class PacedCollectives(GroupCollectives):
    """:class:`~rollout_sync.distributed.GroupCollectives` whose operations take the time
    this rank's :class:`EmulatedNic` says they take (the module docstring says how).

    Raises:
        ValueError: the group is not gloo (the emulation reads its instants on the host).
    """

    def __init__(self, group: dist.ProcessGroup | None, nic: EmulatedNic) -> None:
        super().__init__(group)
        if self.backend != "gloo":
            raise ValueError(
                f"the emulated NIC paces gloo (CPU) groups on one machine, got a {self.backend} "
                "group; benchmark NCCL on real links"
            )
        self.nic = nic

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start ``tensor``'s broadcast from ``src``; it completes at the source's emulated
        arrival instant on every member."""
        if self.rank == src:
            arrives = self.nic.reserve(tensor.numel() * tensor.element_size())
            stamp = torch.tensor([arrives], dtype=torch.float64)
        else:
            stamp = torch.zeros(1, dtype=torch.float64)
        works = [super().broadcast(stamp, src), super().broadcast(tensor, src)]
        return _PacedWork(works, stamp=stamp, delay_s=0.0)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        """Start the all-gather; it completes one link latency after the real one."""
        work = super().all_gather(outputs, tensor)
        return _PacedWork([work], stamp=None, delay_s=self.nic.link.latency_s)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending ``tensor`` to ``dst``: this rank's link carries it, and the send and
        the matching :meth:`recv` complete at its emulated arrival instant (sent ahead of the
        data, tag ``tag + STAMP_TAG``).

        Raises:
            ValueError: ``tag`` is not below :data:`STAMP_TAG`.
        """
        _check_tag(tag)
        arrives = self.nic.reserve(tensor.numel() * tensor.element_size(), send=True)
        stamp = torch.tensor([arrives], dtype=torch.float64)
        works = [super().send(stamp, dst, tag + STAMP_TAG), super().send(tensor, dst, tag)]
        return _PacedWork(works, stamp=stamp, delay_s=0.0)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        """Start receiving into ``tensor`` what ``src`` sends with ``tag``; it completes at the
        sender's emulated arrival instant. This rank's own link is not used: the emulation
        paces egress only (the module docstring says why that is enough for its uses).

        Raises:
            ValueError: ``tag`` is not below :data:`STAMP_TAG`.
        """
        _check_tag(tag)
        stamp = torch.zeros(1, dtype=torch.float64)
        works = [super().recv(stamp, src, tag + STAMP_TAG), super().recv(tensor, src, tag)]
        return _PacedWork(works, stamp=stamp, delay_s=0.0)


def _check_tag(tag: int) -> None:
    if not 0 <= tag < STAMP_TAG:
        raise ValueError(
            f"a paced point-to-point tag must be in [0, {STAMP_TAG}) (the arrival instant "
            f"travels on tag + {STAMP_TAG}), got {tag}"
        )


class PacedWeightTransfer(WeightTransfer):
    """A :class:`~rollout_sync.WeightTransfer` whose collectives go through ``nic``.

    Everything else (manifest, votes, buckets, checksums, relay) is the production transfer's
    own code: only the time its collectives take is emulated. Give the P2R and the R2R
    transfer of one rank the same ``nic`` (one rank, one link).
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
    ) -> None:
        super().__init__(group, src, config=config, timeline=timeline, device="cpu", hooks=hooks)
        self.collectives = PacedCollectives(group, nic)
        self.nic = nic

    def __repr__(self) -> str:
        return f"<PacedWeightTransfer src={self.src} group={list(self.ranks)} nic={self.nic!r}>"


class PacedShardedTransfer(ShardedTransfer):
    """A :class:`~rollout_sync.transfer.ShardedTransfer` whose point-to-point sends and votes go
    through ``nic``, as :class:`PacedWeightTransfer` is a paced broadcast transfer.

    The plan, the buckets per peer, the votes and the checks are the production transfer's own
    code. Give a replica rank's P2R (this) and R2R (:class:`PacedWeightTransfer`) transfers the
    same ``nic``. What this rank receives is not paced on its own link (egress only: the module
    docstring).
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
        )
        self.collectives = PacedCollectives(group, nic)
        self.nic = nic

    def __repr__(self) -> str:
        side = "source" if self.is_source else "target"
        return (
            f"<PacedShardedTransfer {side} {self.index} sources={list(self.source_ranks)} "
            f"targets={list(self.target_ranks)} nic={self.nic!r}>"
        )
