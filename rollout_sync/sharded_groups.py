"""The weight-sync groups of a sharded job: trainer ranks, and replicas of several ranks each.

A sharded trainer (FSDP, tensor or pipeline parallel) has several ranks, each holding its own
shards; a replica that serves with tensor parallelism has several ranks, each serving its own
slice. :func:`build_sharded_sync_groups` makes the groups a sync of such a job runs on:

* **P2R**: every trainer rank and every rank of the first replica, one group. Its
  :class:`~rollout_sync.transfer.ShardedTransfer` moves each region once, from the trainer
  rank that owns it straight to the replica rank that serves it, along a
  :class:`~rollout_sync.transfer.TransferPlan` between the two layouts.
* **R2R**: for each position ``k`` within a replica, the ``k``-th rank of every replica, one
  group; the first replica's ``k``-th rank broadcasts its slice (a
  :class:`~rollout_sync.WeightTransfer`) to the others' ``k``-th ranks. Replicas share one
  layout, so a slice goes rank ``k`` to rank ``k``, whole.

A :class:`~rollout_sync.RolloutWorker` on every replica rank drives them as it drives the
one-source groups: ``p2r=groups.p2r_transfer(plan)``, ``r2r=groups.r2r_transfer()``; a
``P2R(relay=True)`` on the first replica's ranks receives and then passes its slice on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .distributed import DEFAULT_GROUP_TIMEOUT_S, new_group
from .transfer import ShardedTransfer, TransferPlan, WeightTransfer

__all__ = ["ShardedSyncGroups", "build_sharded_sync_groups"]


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
    """Per position ``k``: the ``k``-th rank of every replica (``None``s with one replica)."""

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
        (from the trainer's layout to a replica's), or ``None`` if this rank takes no part."""
        if dist.get_rank() not in self.trainers + self.replicas[0]:
            return None
        return ShardedTransfer(
            self.p2r, plan, source_ranks=self.trainers, target_ranks=self.replicas[0], **kwargs
        )

    def r2r_transfer(self, **kwargs: Any) -> WeightTransfer | None:
        """The R2R :class:`~rollout_sync.WeightTransfer` of this rank's position, or ``None``
        on a trainer rank or with a single replica."""
        where = self.position(dist.get_rank())
        if where is None or len(self.replicas) == 1:
            return None
        k = where[1]
        return WeightTransfer(self.r2r[k], self.replicas[0][k], **kwargs)


def build_sharded_sync_groups(
    trainers: Sequence[int],
    replicas: Sequence[Sequence[int]],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
) -> ShardedSyncGroups:
    """Create the P2R and R2R groups of a sharded job; every rank of the default group must
    call this, with the same arguments. ``timeout_s`` is every collective's default limit.

    Raises:
        ValueError: no trainer or replica rank, replicas of different sizes, or a rank used
            twice.
    """
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
    for k in range(len(replica_ranks[0])):
        if len(replica_ranks) == 1:
            r2r.append(None)
        else:
            ranks = [replica[k] for replica in replica_ranks]
            r2r.append(new_group(ranks, timeout_s=timeout_s, backend=backend))
    return ShardedSyncGroups(trainer_ranks, replica_ranks, p2r, tuple(r2r))
