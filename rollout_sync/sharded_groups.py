"""The weight-sync groups of a sharded job: trainer ranks, and replicas of several ranks each.

A sharded trainer (FSDP, tensor or pipeline parallel) has several ranks, each holding its own
shards; a replica that serves with tensor parallelism has several ranks, each serving its own
slice. :func:`build_sharded_sync_groups` makes the groups a sync of such a job runs on:

* **P2R**: every trainer rank and every rank of the first replica, one group. Its
  :class:`~rollout_sync.transfer.ShardedTransfer` moves each region once, from the trainer
  rank that owns it straight to the replica rank that serves it, along a
  :class:`~rollout_sync.transfer.TransferPlan` between the two layouts.
* **R2R**: replicas share one layout, so a slice goes rank ``k`` to rank ``k``, whole, as a
  :class:`~rollout_sync.WeightTransfer`. By default the first replica's ``k``-th rank
  broadcasts it to the ``k``-th rank of every other replica (one group per position). With
  ``fanout=f`` the replicas form a tree instead (replica ``j``'s parent is ``(j - 1) // f``,
  as in a heap): each replica with children passes each bucket on to them as it arrives (the
  pipelined relay, :meth:`~rollout_sync.WeightTransfer.relay`), so no rank sends more than
  ``f`` copies' worth and the hops overlap; ``fanout=1`` is a chain.

A :class:`~rollout_sync.RolloutWorker` on every replica rank drives them as it drives the
one-source groups: ``p2r=groups.p2r_transfer(plan)``, ``r2r=groups.r2r_transfer()``; a
``P2R(relay=True)`` on the first replica's ranks receives and then passes its slice on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._deadline import deadline_after, remaining
from .distributed import DEFAULT_GROUP_TIMEOUT_S, GroupCollectives, new_group, wait_work
from .errors import ManifestRejected, RolloutSyncError
from .trace import SpanKind
from .trainer import WeightSyncCommand
from .transfer import (
    OriginChecksums,
    ShardedTransfer,
    TransferPlan,
    TransferStats,
    WeightTransfer,
)
from .transfer.delta_sync import DeltaTarget, EncodedDelta, WholeReason
from .worker import CommandSink, WorkerCommandChannel

__all__ = [
    "ShardedCommandChannel",
    "ShardedSyncGroups",
    "TreeRelay",
    "build_sharded_sync_groups",
]

_BARRIER_MAGIC = 0x5253_4241_5252  # "RSBARR"


@dataclass(frozen=True)
class ShardedSyncGroups:
    """The groups of a sharded job, as every rank sees them. Ranks are global.

    ``trainers``: the trainer's ranks, in its layout's order. ``replicas``: each replica's
    ranks, in the replica layout's order; the first replica receives P2R and is every R2R
    group's source.
    """

    trainers: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]
    p2r: dist.ProcessGroup | None
    """The trainer ranks and the first replica's; a placeholder on other ranks."""
    r2r: tuple[dist.ProcessGroup | None, ...]
    """Per position ``k``: the ``k``-th rank of every replica (``None``s with one replica, or
    with a ``fanout``: see :attr:`tree`)."""
    fanout: int | None = None
    """Children per replica of the R2R tree; ``None``: one broadcast from the first replica."""
    tree: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    """With a ``fanout``: ``(replica j, position k)`` -> the group of replica ``j``'s rank
    ``k`` and its children's rank ``k`` (replicas with children only)."""
    p2r_cpu: dist.ProcessGroup | None = None
    """The P2R group's ranks on gloo, for :meth:`p2r_barrier` (the P2R group itself when that
    is gloo); ``None``: no barrier group was built."""

    def p2r_barrier(self, timeout: float) -> None:
        """The sharded P2R's CPU-side barrier: every trainer rank and every rank of the first
        replica meet here before each sharded P2R, as the one-source job's pair meets at
        :meth:`~rollout_sync.worker.SyncGroups.p2r_barrier`: the trainer ranks in their pusher
        (``TransferWeightPusher(barrier=groups.p2r_barrier)``), the first replica's ranks inside
        their P2R bracket, paused, payload egress held (``RolloutWorker(p2r_barrier=...)``).
        Past it, the trainer rank that receives payloads may hold its receives. Every rank of
        the P2R group takes it, or none: it is one all-gather, never touching the device.

        Raises:
            ManifestRejected: a rank met it with another collective (it takes no barrier);
                nothing was sent.
            CollectiveTimeout / CollectiveError: a rank did not arrive within ``timeout``
                seconds, or died.
            RuntimeError: no barrier group was built, or this rank is not in the P2R group.
        """
        if self.p2r_cpu is None:
            raise RuntimeError(
                "these ShardedSyncGroups have no P2R barrier group (build them with "
                "build_sharded_sync_groups)"
            )
        if dist.get_rank() not in self.trainers + self.replicas[0]:
            raise RuntimeError(f"rank {dist.get_rank()} is not in the sharded P2R group")
        collectives = GroupCollectives(self.p2r_cpu)
        ranks = collectives.ranks
        op = f"sharded P2R barrier of ranks {list(ranks)}"
        mine = torch.tensor([_BARRIER_MAGIC], dtype=torch.int64)
        rows = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        work = collectives.all_gather(rows, mine)
        wait_work(work, operation=op, timeout_s=timeout, group=self.p2r_cpu, ranks=ranks)
        votes = torch.cat(rows).tolist()
        odd = [r for r, v in zip(ranks, votes, strict=True) if v != _BARRIER_MAGIC]
        if odd:
            raise ManifestRejected(
                f"{op}: rank(s) {odd} met it with something else (every rank of the P2R group "
                "takes the barrier, or none does); nothing was sent",
                operation=op,
                version=None,
                rejected_by=odd,
            )

    def command_channel(
        self, queues: Mapping[int, CommandSink], *, pipelined_relay: bool = False
    ) -> ShardedCommandChannel:
        """The trainer's command channel for these replicas (:class:`ShardedCommandChannel`)."""
        return ShardedCommandChannel(queues, self.replicas, pipelined_relay=pipelined_relay)

    @property
    def replica_size(self) -> int:
        return len(self.replicas[0])

    def position(self, rank: int) -> tuple[int, int] | None:
        """``(replica, k)`` of a replica rank; ``None`` for a trainer rank."""
        for j, ranks in enumerate(self.replicas):
            if rank in ranks:
                return j, ranks.index(rank)
        return None

    def p2r_transfer(self, plan: TransferPlan, **kwargs: Any) -> ShardedTransfer | None:
        """The P2R :class:`~rollout_sync.transfer.ShardedTransfer` on this rank along ``plan``
        (from the trainer's layout to a replica's), or ``None`` if this rank takes no part.
        ``kwargs`` go to it: ``pipelined_relay=True`` makes the first replica's ranks pass
        each bucket on as it arrives.

        Raises:
            ValueError: ``pipelined_relay`` with a ``fanout`` (the relay tree's inner replicas
                would have to pass its verdict on: not built).
        """
        if kwargs.get("pipelined_relay") and self.fanout is not None:
            raise ValueError(
                f"a pipelined sharded relay sends to one broadcast per position, not a relay "
                f"tree (fanout={self.fanout}): build the groups without fanout"
            )
        if dist.get_rank() not in self.trainers + self.replicas[0]:
            return None
        return ShardedTransfer(
            self.p2r, plan, source_ranks=self.trainers, target_ranks=self.replicas[0], **kwargs
        )

    def children(self, replica: int) -> list[int]:
        """The replicas that ``replica`` passes its slices on to in R2R."""
        if self.fanout is None:
            return list(range(1, len(self.replicas))) if replica == 0 else []
        first = replica * self.fanout + 1
        return list(range(first, min(first + self.fanout, len(self.replicas))))

    def parent(self, replica: int) -> int | None:
        """The replica ``replica`` receives R2R from (``None`` for the first)."""
        if replica == 0:
            return None
        return 0 if self.fanout is None else (replica - 1) // self.fanout

    def r2r_transfer(self, **kwargs: Any) -> WeightTransfer | TreeRelay | None:
        """This rank's R2R, or ``None`` on a trainer rank or with a single replica.

        The first replica's ranks get the transfer they are the source of (their
        ``P2R(relay=True)`` passes the version on through it); a replica with a parent and
        children gets a :class:`TreeRelay` (its ``receive`` relays); a leaf, the transfer it
        receives from its parent.
        """
        where = self.position(dist.get_rank())
        if where is None or len(self.replicas) == 1:
            return None
        j, k = where
        parent = self.parent(j)
        incoming = None if parent is None else self._r2r_group(parent, k, **kwargs)
        outgoing = self._r2r_group(j, k, **kwargs) if self.children(j) else None
        if incoming is None:
            return outgoing
        if outgoing is None:
            return incoming
        return TreeRelay(incoming, outgoing)

    def _r2r_group(self, replica: int, k: int, **kwargs: Any) -> WeightTransfer:
        """The transfer from ``replica``'s rank ``k`` to its children's rank ``k``."""
        group = self.r2r[k] if self.fanout is None else self.tree[(replica, k)]
        return WeightTransfer(group, self.replicas[replica][k], **kwargs)


class TreeRelay:
    """An inner replica rank's R2R in a relay tree: its ``receive`` takes the version from its
    parent's rank and passes each bucket on to its children's as it arrives (the pipelined
    relay), so a :class:`~rollout_sync.RolloutWorker` drives it with a plain ``R2R`` command.

    Not a source: ``send`` and ``relay`` are refused (the tree's root relays its P2R).
    """

    delta_syncs = True
    """It relays delta syncs packed, as :meth:`~rollout_sync.WeightTransfer.relay` does."""

    def __init__(self, incoming: WeightTransfer, outgoing: WeightTransfer) -> None:
        if not outgoing.is_source:
            raise ValueError("a tree relay must be the source of its outgoing transfer")
        self.incoming = incoming
        self.outgoing = outgoing

    @property
    def is_source(self) -> bool:
        return False

    @property
    def backend(self) -> str:
        """Its groups' backend, for the NCCL rule (both hops run on it)."""
        return self.incoming.backend

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive from the parent into ``into`` and pass it on as it arrives; see
        :meth:`~rollout_sync.WeightTransfer.relay` (its errors, its ``role="relay"``; a delta
        is passed on packed)."""
        return self.incoming.relay(
            into,
            self.outgoing,
            allow_subset=allow_subset,
            write_kind=write_kind,
            storage=storage,
            verify=verify,
            delta=delta,
        )

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: TreeRelay,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Refused: a tree relay relays on :meth:`receive` (drive it with ``R2R``)."""
        raise RolloutSyncError("a tree relay relays on receive; use R2R, not P2R(relay=True)")

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> TransferStats:
        """Refused: a tree relay is not an R2R source (its tree's root is)."""
        raise RolloutSyncError("a tree relay is not an R2R source; its tree's root is")

    def abort(self, reason: str, *, version: int | None = None) -> None:
        """Tell this relay's children that no version is coming."""
        self.outgoing.abort(reason, version=version)

    def __repr__(self) -> str:
        return f"<TreeRelay from {self.incoming!r} to {self.outgoing!r}>"


def build_sharded_sync_groups(
    trainers: Sequence[int],
    replicas: Sequence[Sequence[int]],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
    fanout: int | None = None,
) -> ShardedSyncGroups:
    """Create the P2R and R2R groups of a sharded job; every rank of the default group must
    call this, with the same arguments. ``timeout_s`` is every collective's default limit;
    ``fanout``: children per replica of the R2R relay tree (``None``: one broadcast).

    Raises:
        ValueError: no trainer or replica rank, replicas of different sizes, a rank used
            twice, or a ``fanout`` below 1.
    """
    if fanout is not None and fanout < 1:
        raise ValueError(f"an R2R relay tree needs fanout >= 1, got {fanout}")
    trainer_ranks = tuple(trainers)
    replica_ranks = tuple(tuple(r) for r in replicas)
    if not trainer_ranks or not replica_ranks or not all(replica_ranks):
        raise ValueError("a sharded job needs at least one trainer rank and one replica rank")
    if len({len(r) for r in replica_ranks}) != 1:
        raise ValueError(
            f"every replica must have as many ranks: {[list(r) for r in replica_ranks]}"
        )
    every = trainer_ranks + tuple(r for ranks in replica_ranks for r in ranks)
    if len(set(every)) != len(every):
        raise ValueError(
            f"a rank is used twice: trainers {list(trainer_ranks)}, replicas "
            f"{[list(r) for r in replica_ranks]}"
        )
    p2r = new_group(trainer_ranks + replica_ranks[0], timeout_s=timeout_s, backend=backend)
    r2r: list[dist.ProcessGroup | None] = []
    tree: dict[tuple[int, int], dist.ProcessGroup] = {}
    shape = ShardedSyncGroups(trainer_ranks, replica_ranks, p2r, (), fanout)
    for k in range(len(replica_ranks[0])):
        if len(replica_ranks) == 1 or fanout is not None:
            r2r.append(None)
        else:
            ranks = [replica[k] for replica in replica_ranks]
            r2r.append(new_group(ranks, timeout_s=timeout_s, backend=backend))
        if fanout is not None:
            for j in range(len(replica_ranks)):
                if children := shape.children(j):
                    ranks = [replica_ranks[c][k] for c in [j, *children]]
                    tree[(j, k)] = new_group(ranks, timeout_s=timeout_s, backend=backend)
    on_gloo = str(backend or dist.get_backend()) == "gloo"
    p2r_ranks = trainer_ranks + replica_ranks[0]
    p2r_cpu = p2r if on_gloo else new_group(p2r_ranks, timeout_s=timeout_s, backend="gloo")
    return ShardedSyncGroups(trainer_ranks, replica_ranks, p2r, tuple(r2r), fanout, tree, p2r_cpu)


class ShardedCommandChannel:
    """The trainer's :class:`~rollout_sync.trainer.CommandChannel` for replicas of several
    ranks: each announcement becomes a command on every replica rank's queue.

    A sharded sync runs per position ``k`` within a replica exactly as a plain job's runs per
    replica: the first replica's ``k``-th rank takes the P2R (with the other first-replica
    ranks, in one :class:`~rollout_sync.transfer.ShardedTransfer`) and is the source of the
    R2R group of the ``k``-th ranks. So this is one
    :class:`~rollout_sync.worker.WorkerCommandChannel` per position over the ``k``-th ranks:
    ``P2R`` to every rank of the first replica, then, with more than one replica, ``R2R`` to
    every replica rank; with ``pipelined_relay``, ``P2R(relay=True)`` to the first replica's
    ranks (each passes its slice on: once it has it whole, or bucket by bucket when its
    transfer was built with ``pipelined_relay=True``) and ``R2R`` to the other replicas'
    ranks; ``STOP``: ``Stop()`` to every rank.

    Args:
        queues: replica rank -> its command queue (every rank of every replica).
        replicas: each replica's ranks, the first replica first, each in its tensor-parallel
            order (:attr:`~rollout_sync.launch.JobLayout.replica_groups`).
        pipelined_relay: see above.
    """

    def __init__(
        self,
        queues: Mapping[int, CommandSink],
        replicas: Sequence[Sequence[int]],
        *,
        pipelined_relay: bool = False,
    ) -> None:
        groups = tuple(tuple(r) for r in replicas)
        if not groups or len({len(r) for r in groups}) != 1 or not groups[0]:
            raise ValueError(f"replicas must be of one size, at least one rank: {groups}")
        self.replicas = groups
        self.pipelined_relay = pipelined_relay
        self.positions = tuple(
            WorkerCommandChannel(
                queues, [replica[k] for replica in groups], pipelined_relay=pipelined_relay
            )
            for k in range(len(groups[0]))
        )

    def commands_for(self, announcement: WeightSyncCommand) -> list[tuple[int, object]]:
        """The ``(replica rank, command)`` pairs one announcement becomes."""
        return [pair for channel in self.positions for pair in channel.commands_for(announcement)]

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        """Put the commands ``command`` becomes on the replica ranks' queues (every put of it
        within ``timeout``; see :meth:`~rollout_sync.worker.WorkerCommandChannel.announce`)."""
        deadline = deadline_after(timeout)
        for channel in self.positions:
            channel.announce(command, remaining(deadline))

    def receive(self, timeout: float) -> WeightSyncCommand:
        raise TypeError(
            "a ShardedCommandChannel only announces: the replica ranks take their commands from "
            "their queues (RolloutWorker(commands=...))"
        )

    def __repr__(self) -> str:
        relay = ", pipelined relay" if self.pipelined_relay else ""
        return f"<ShardedCommandChannel replicas={[list(r) for r in self.replicas]}{relay}>"
