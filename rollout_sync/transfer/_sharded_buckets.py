"""A sharded transfer's buckets: what each (source, target) pair of ranks sends, cut and packed
to the bucket size (:func:`_buckets`), the order in which a rank takes its peers' buckets
(:func:`_interleave`), a receive's bookkeeping (:class:`_Progress`), a delta payload's chunks
(:func:`_chunks`) and the votes' words. Shared by :mod:`rollout_sync.transfer.sharded`, its
delta syncs (:mod:`rollout_sync.transfer._sharded_delta_transfer`) and its relays
(:mod:`rollout_sync.transfer._sharded_relay`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..weights import WeightSpec
from .layout import Box
from .plan import Move

_ALIGN = 8
_CHECKSUM_BYTES = 16

_YES = 1
_NO = 0
_FORWARD_FAILED = 2
"""The votes' words; ``_FORWARD_FAILED``: a pipelined relay's commit vote, its own part is
whole, passing it on failed."""


@dataclass(frozen=True)
class _Slot:
    move: Move
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Bucket:
    """One message from one source rank to one target rank."""

    index: int
    """Its position among the pair's buckets (the message tag)."""
    slots: tuple[_Slot, ...]
    data_bytes: int
    """Payload and alignment padding, a multiple of 8."""
    checksummed: bool

    @property
    def wire_bytes(self) -> int:
        return self.data_bytes + (_CHECKSUM_BYTES if self.checksummed else 0)


def _narrow(move: Move, dim: int, start: int, stop: int, unit: int) -> Move:
    """``move`` cut to ``[start, stop)`` of its region along ``dim`` (``unit``: bytes per index)."""

    def cut(box: Box) -> Box:
        out = list(box)
        out[dim] = (box[dim][0] + start, box[dim][0] + stop)
        return tuple(out)

    return replace(
        move,
        source_box=cut(move.source_box),
        target_box=cut(move.target_box),
        nbytes=unit * (stop - start),
    )


def _split(move: Move, limit: int) -> list[Move]:
    """``move`` cut into regions of at most ``limit`` bytes each (along its outermost
    dimensions), so that no bucket outgrows the bucket size."""
    if move.nbytes <= limit:
        return [move]
    shape = [stop - start for start, stop in move.source_box]
    dim = next(d for d, n in enumerate(shape) if n > 1)
    unit = move.nbytes // shape[dim]
    if unit > limit:  # one index along ``dim`` is still too large: cut each one further
        return [
            part
            for i in range(shape[dim])
            for part in _split(_narrow(move, dim, i, i + 1, unit), limit)
        ]
    step = limit // unit
    return [
        _narrow(move, dim, i, min(i + step, shape[dim]), unit) for i in range(0, shape[dim], step)
    ]


def _buckets(
    moves: list[Move], dtypes: Mapping[str, torch.dtype], bucket_bytes: int, checksums: bool
) -> list[_Bucket]:
    """The moves packed into buckets whose bytes on the wire (payload, alignment, checksum)
    are at most ``bucket_bytes``; a region larger than that is cut (:func:`_split`)."""
    limit = max(_ALIGN, (bucket_bytes - (_CHECKSUM_BYTES if checksums else 0)) // _ALIGN * _ALIGN)
    out: list[_Bucket] = []
    slots: list[_Slot] = []
    used = 0
    for move in (part for m in moves for part in _split(m, limit)):
        size = -(-move.nbytes // _ALIGN) * _ALIGN
        if slots and used + size > limit:
            out.append(_Bucket(len(out), tuple(slots), used, checksums))
            slots, used = [], 0
        slots.append(_Slot(move, used, dtypes[move.tensor]))
        used += size
    if slots:
        out.append(_Bucket(len(out), tuple(slots), used, checksums))
    return out


def _check_coverage(
    queues: Mapping[int, Sequence[_Bucket]], specs: Mapping[str, WeightSpec], target: int
) -> None:
    """Refuse a plan whose moves into this target rank do not add up to each of its tensors'
    bytes (a region missing, or sent twice): it would leave a tensor partly old. A plan that
    :meth:`TransferPlan.between` builds covers every element exactly once by construction; this
    checks a plan made by other means by its byte counts."""
    covered: dict[str, int] = dict.fromkeys(specs, 0)
    for queue in queues.values():
        for bucket in queue:
            for slot in bucket.slots:
                covered[slot.move.target_local] += slot.move.nbytes
    wrong = {n: (b, specs[n].nbytes) for n, b in covered.items() if b != specs[n].nbytes}
    if wrong:
        raise ValueError(
            f"the plan does not cover target rank {target}'s tensors exactly once "
            f"(bytes planned, bytes held): {wrong}"
        )


def _interleave(
    queues: Mapping[int, Sequence[_Bucket]], first: int = 0
) -> list[tuple[int, _Bucket]]:
    """Buckets round-robin over peers (in peer order, starting at the ``first``-th): each
    peer's first, then each one's second. Source ranks start at their own index, so that they
    do not all send to the same target rank at once (its ingress would take them in turn)."""
    order = []
    depth = max((len(q) for q in queues.values()), default=0)
    peers = sorted(queues)
    if peers:
        start = first % len(peers)
        peers = peers[start:] + peers[:start]
    for k in range(depth):
        for peer in peers:
            if k < len(queues[peer]):
                order.append((peer, queues[peer][k]))
    return order


@dataclass
class _Progress:
    tensors_written: set[str] = field(default_factory=set)
    failed_buckets: list[tuple[int, int, int]] = field(default_factory=list)
    """The first corrupted bucket: (its place among this rank's receives, its number from its
    source, the source's global rank); nothing is written from it on."""
    refusal: BaseException | None = None
    """This rank's ``verify`` refused what landed intact (voted no, raised after the vote)."""
    write_error: BaseException | None = None
    """Writing a bucket into this rank's tensors raised: nothing more is written, the rank
    keeps receiving (no source is left waiting) and votes no; raised after the vote as a
    :class:`~rollout_sync.errors.WeightTransferError` saying what was written."""
    checksums_verified: int = 0
    buckets: int = 0
    nbytes: int = 0

    @property
    def writing(self) -> bool:
        """Whether buckets are still written (none arrived corrupted, no write failed)."""
        return not self.failed_buckets and self.write_error is None


@dataclass(frozen=True)
class _Chunk:
    """One message of a delta's payload from one source rank to one target rank."""

    index: int
    """Its position among the pair's chunks (the message tag)."""
    data: tuple[int, int]
    """Its bytes of the payload."""
    wire: tuple[int, int]
    """Its bytes on the wire (the payload's, then its checksum when checksums are on)."""
    checksummed: bool


def _chunks(payload_bytes: int, bucket_bytes: int, checksums: bool) -> list[_Chunk]:
    """A delta payload of ``payload_bytes`` cut into messages of at most ``bucket_bytes`` on
    the wire, checksum included: both sides compute them from the size the plan vote carried."""
    limit = max(_ALIGN, (bucket_bytes - (_CHECKSUM_BYTES if checksums else 0)) // _ALIGN * _ALIGN)
    extra = _CHECKSUM_BYTES if checksums else 0
    out: list[_Chunk] = []
    wire = 0
    for lo in range(0, payload_bytes, limit):
        hi = min(lo + limit, payload_bytes)
        out.append(_Chunk(len(out), (lo, hi), (wire, wire + hi - lo + extra), checksums))
        wire += hi - lo + extra
    return out
