"""The two weight-sync groups of a one-source job (P2R and R2R) as every rank sees them, and
their construction. A sharded job's are in :mod:`rollout_sync.sharded_groups`. Importable from
:mod:`rollout_sync.worker` too (their old home)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .distributed import DEFAULT_GROUP_TIMEOUT_S, new_group
from .transfer import WeightTransfer
from .transfer._barrier import meet_p2r_barrier

__all__ = ["SyncGroups", "build_sync_groups"]


@dataclass(frozen=True)
class SyncGroups:
    """The two weight-sync groups of a job, as every rank sees them.

    Ranks are global. ``trainer``: the P2R source. ``replicas``: the rollout replicas, the first
    of which receives P2R and is the R2R source.
    """

    trainer: int
    replicas: tuple[int, ...]
    p2r: dist.ProcessGroup | None
    """``{trainer, replicas[0]}``; a placeholder on other ranks."""
    r2r: dist.ProcessGroup | None
    """The replicas; ``None`` with a single replica."""
    p2r_cpu: dist.ProcessGroup | None = None
    """``{trainer, replicas[0]}`` on gloo, for :meth:`p2r_barrier` (the P2R group itself when
    that is gloo already); ``None``: no barrier group was built."""

    @property
    def r2r_source(self) -> int:
        return self.replicas[0]

    def p2r_barrier(self, timeout: float) -> None:
        """The P2R pair's CPU-side barrier: the trainer and the first replica meet here.

        The replica calls it inside its P2R bracket (paused, payload egress held: pass this
        method as ``RolloutWorker(p2r_barrier=...)``); the trainer calls it before it takes its
        payload receive hold and sends (``TransferWeightPusher(barrier=...)``). Passing it tells
        the trainer that the replica can no longer be waiting for the trainer to receive, so the
        trainer's hold cannot deadlock (docs/transport.md). It never touches the device.

        Both sides take it or neither. Its first collective has the shape of a transfer's
        manifest header, so on gloo (one group for barrier and transfer) a side that takes no
        barrier meets it there: both sides raise :class:`~rollout_sync.errors.P2RBarrierMismatch`
        at once, nothing is written, and the next P2R, configured alike, goes through. On NCCL
        (a gloo group of its own) that shows only as this barrier's timeout.

        Raises:
            P2RBarrierMismatch: the other side takes no barrier (see above).
            CollectiveTimeout / CollectiveError: the peer did not arrive within ``timeout``
                seconds (per collective), or died.
            RuntimeError: no barrier group was built, or this rank is not in the pair.
        """
        if self.p2r_cpu is None:
            raise RuntimeError(
                "these SyncGroups have no P2R barrier group (build them with build_sync_groups)"
            )
        if dist.get_rank() not in (self.trainer, self.r2r_source):
            raise RuntimeError(
                f"rank {dist.get_rank()} is not in the P2R pair {[self.trainer, self.r2r_source]}"
            )
        meet_p2r_barrier(self.p2r_cpu, self.trainer, timeout)

    def p2r_transfer(self, **kwargs: Any) -> WeightTransfer | None:
        """The P2R :class:`WeightTransfer` on this rank, or ``None`` if it takes no part."""
        me = dist.get_rank()
        if me not in (self.trainer, self.r2r_source):
            return None
        return WeightTransfer(self.p2r, self.trainer, **kwargs)

    def r2r_transfer(self, **kwargs: Any) -> WeightTransfer | None:
        """The R2R :class:`WeightTransfer` on this rank, or ``None`` if it takes no part."""
        if self.r2r is None or dist.get_rank() not in self.replicas:
            return None
        return WeightTransfer(self.r2r, self.r2r_source, **kwargs)


def build_sync_groups(
    trainer: int,
    replicas: Sequence[int],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
) -> SyncGroups:
    """Create the P2R and R2R groups; every rank of the default group must call this.

    ``timeout_s`` is the default limit of every collective on them. With a ``backend`` other
    than gloo (NCCL) a gloo group of the P2R pair is made too, for
    :meth:`SyncGroups.p2r_barrier`.
    """
    if not replicas:
        raise ValueError("build_sync_groups needs at least one replica rank")
    if trainer in replicas:
        raise ValueError(f"the trainer rank {trainer} cannot also be a replica")
    reps = tuple(replicas)
    p2r = new_group([trainer, reps[0]], timeout_s=timeout_s, backend=backend)
    # Decided from the arguments and the default group, the same on every rank, so that every
    # rank makes the same new_group calls.
    on_gloo = str(backend or dist.get_backend()) == "gloo"
    p2r_cpu = p2r if on_gloo else new_group([trainer, reps[0]], timeout_s=timeout_s, backend="gloo")
    r2r = new_group(list(reps), timeout_s=timeout_s, backend=backend) if len(reps) > 1 else None
    return SyncGroups(trainer, reps, p2r, r2r, p2r_cpu)
