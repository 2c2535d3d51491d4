"""The P2R barrier on the wire, shaped so that a barrier only one side takes is caught at once.

The trainer and the first replica meet at the P2R barrier before the weight collective
(docs/transport.md): the replica parked with its payload sends held, the trainer about to hold
its payload receives. Both sides take it, or neither. It is two small collectives on the pair's
gloo group:

1. the trainer broadcasts the barrier header ``[BARRIER, BARRIER_MAGIC]``: two int64 words, the
   shape of a transfer's manifest header ``[manifest bytes, version]`` (or ``[ABORT,
   version]``: the source aborted);
2. both all-gather one int32 word, the shape of a transfer's vote: ``VOTE_YES`` from each side
   that takes the barrier.

Step 1 has the shape of a transfer's first collective, so a side that takes no barrier meets it
with that first collective, and each side reads what the other is doing:

* the trainer takes it, the replica does not: the replica's receive reads the barrier header
  where a manifest header belongs, answers step 2 with ``VOTE_NO`` so that the trainer is not
  left waiting, and raises; the trainer reads ``VOTE_NO`` and raises. Two collectives each.
* the replica takes it, the trainer does not: the replica's barrier reads a manifest header in
  step 1, takes the manifest the trainer broadcasts next, and votes ``VOTE_BARRIER_SKIPPED`` on
  it; both raise. Three collectives each (one, when the trainer aborted instead).

Either way both sides raise :class:`~rollout_sync.errors.P2RBarrierMismatch` within a few
collectives (a trainer that aborts instead of sending raises its own error; the replica this),
nothing is written, and the pair stays in step for the next P2R. That needs the
barrier on the transfer's own group, where :func:`~rollout_sync.worker.build_sync_groups` puts
it on gloo. On NCCL the barrier has a gloo group of its own, which a side without the barrier
never touches: there a one-sided barrier ends in the barrier's timeout.

Private: the public face is :meth:`~rollout_sync.worker.SyncGroups.p2r_barrier`.
"""

from __future__ import annotations

import enum
from typing import Literal

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives, wait_work
from ..errors import CollectiveTimeout, P2RBarrierMismatch

HEADER_WORDS = 2
"""A transfer's first collective: ``[manifest bytes, or ABORT or BARRIER; version or magic]``."""
ABORT = -1
"""First header word of a source that aborted before sending a manifest."""
UNKNOWN_VERSION = -1
"""Second header word of an abort whose source does not know the version it cannot send."""
BARRIER = -2
"""First header word of the trainer's P2R barrier."""
BARRIER_MAGIC = 0x5032_5242  # "P2RB"
"""Second header word of the trainer's P2R barrier."""

VOTE_NO = 0
VOTE_YES = 1
VOTE_BARRIER_SKIPPED = 2
"""A replica's manifest vote from inside its P2R barrier: the source sent a manifest where the
barrier belongs."""
VOTE_WHOLE = 3
"""A receiver's manifest vote on a delta it cannot take (it holds another version than the
base): send this version whole. The source then does, at once, in the same transfer."""


class HeaderKind(enum.Enum):
    MANIFEST = "manifest"
    ABORT = "abort"
    BARRIER = "barrier"


def header_kind(first: int, second: int) -> HeaderKind:
    """What the source's first collective announced."""
    if first >= 0:
        return HeaderKind.MANIFEST
    if first == BARRIER and second == BARRIER_MAGIC:
        return HeaderKind.BARRIER
    return HeaderKind.ABORT


def aborted_version(word: int) -> int | None:
    """The version an abort header names (its second word), or ``None`` when its source did not
    know it (:data:`UNKNOWN_VERSION`)."""
    return None if word == UNKNOWN_VERSION else word


def barrier_mismatch(
    missing_on: Literal["trainer", "replica"],
    *,
    trainer: int,
    replica: int,
    operation: str,
    version: int | None = None,
    detail: str = "",
) -> P2RBarrierMismatch:
    """The error both sides raise; ``missing_on`` is the side that takes no barrier."""
    if missing_on == "replica":
        what = (
            f"the trainer (rank {trainer}) met a P2R barrier the replica (rank {replica}) "
            "does not take"
        )
        fix = (
            "give RolloutWorker p2r_barrier=groups.p2r_barrier, or drop barrier= from the "
            "trainer's TransferWeightPusher"
        )
    else:
        what = (
            f"the replica (rank {replica}) met a P2R barrier the trainer (rank {trainer}) "
            "does not take"
        )
        fix = (
            "give the trainer's TransferWeightPusher barrier=groups.p2r_barrier, or drop "
            "p2r_barrier= from the RolloutWorker"
        )
    return P2RBarrierMismatch(
        f"{operation}: {what}{detail}: {fix}. Nothing was written, and the group is still usable",
        operation=operation,
        version=version,
        missing_on=missing_on,
        rank=replica if missing_on == "replica" else trainer,
    )


def meet_p2r_barrier(group: dist.ProcessGroup | None, trainer: int, timeout_s: float) -> None:
    """Meet the other side of the P2R pair at the barrier (every collective on the CPU).

    Raises:
        P2RBarrierMismatch: the other side takes no barrier; nothing was written.
        CollectiveTimeout / CollectiveError: the other side did not arrive within
            ``timeout_s`` seconds (per collective), or died.
    """
    collectives = GroupCollectives(group)
    me, ranks = collectives.rank, collectives.ranks
    replica = next((r for r in ranks if r != trainer), me)
    op = f"P2R barrier of rank {trainer} (trainer) and rank {replica} (replica)"

    def wait(work: dist.Work, step: str) -> None:
        wait_work(work, operation=f"{op}: {step}", timeout_s=timeout_s, group=group, ranks=ranks)

    def gather(vote: int) -> list[int]:
        mine = torch.tensor([vote], dtype=torch.int32)
        votes = [torch.zeros(1, dtype=torch.int32) for _ in ranks]
        wait(collectives.all_gather(votes, mine), "vote")
        return [int(v) for v in torch.cat(votes).tolist()]  # one device-to-host copy

    header = torch.tensor([BARRIER, BARRIER_MAGIC] if me == trainer else [0, 0], dtype=torch.int64)
    try:
        wait(collectives.broadcast(header, trainer), "header")
    except CollectiveTimeout as exc:
        raise CollectiveTimeout(
            f"{exc} If the other side takes no P2R barrier (the pusher's barrier= and the "
            "worker's p2r_barrier= must agree), it waits on the weight group instead: on NCCL, "
            "where this barrier has a gloo group of its own, that shows only as this timeout.",
            operation=exc.operation,
            group=exc.group,
            timeout=exc.timeout,
        ) from exc
    if me == trainer:
        missing = [r for r, v in zip(ranks, gather(VOTE_YES), strict=True) if v != VOTE_YES]
        if missing:
            raise barrier_mismatch(
                "replica",
                trainer=trainer,
                replica=missing[0],
                operation=op,
                detail=" (its receive found this barrier where a manifest header belongs)",
            )
        return
    first, second = (int(w) for w in header.tolist())
    kind = header_kind(first, second)
    if kind is HeaderKind.BARRIER:
        gather(VOTE_YES)
        return
    version = aborted_version(second) if kind is HeaderKind.ABORT else second
    if kind is HeaderKind.ABORT:
        what = "a version" if version is None else f"version {version}"
        detail = f" (it aborted sending {what} here; see its log)"
    else:
        # The trainer is sending a manifest and then waits for the vote on it: take both, so
        # that it hears why, and the pair stays in step.
        wait(collectives.broadcast(torch.empty(first, dtype=torch.uint8), trainer), "manifest")
        gather(VOTE_BARRIER_SKIPPED)
        detail = f" (it sent the manifest of version {version} here)"
    raise barrier_mismatch(
        "trainer", trainer=trainer, replica=me, operation=op, version=version, detail=detail
    )
