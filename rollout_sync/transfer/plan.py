"""A transfer plan: which source rank sends which region to which target rank.

:meth:`TransferPlan.between` takes two :class:`~rollout_sync.transfer.Layout` s of the same
logical tensors - the trainer's ranks' and a replica's ranks' - and says, for every element
every target rank holds, the one source rank it comes from and where it lies in both ranks'
local tensors (a :class:`Move`). Every element of every target rank's local tensors is covered
by exactly one move, and no source rank sends an element twice to one target rank. An element
several target ranks hold (a norm weight replicated over a replica's tensor-parallel ranks)
leaves the source once per rank that holds it; an element several source ranks hold (a
replicated trainer) is sent by one of them, the one that has sent least so far, so the bytes
spread over the source ranks.

The plan is a function of the two layouts alone: every rank computes the same one, and
:attr:`TransferPlan.digest` is what ranks vote on before any byte moves
(:class:`~rollout_sync.transfer.ShardedTransfer`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from .layout import Box, Layout, LocalTensor, Piece, box_numel, intersect

__all__ = ["Move", "TransferPlan"]


@dataclass(frozen=True)
class Move:
    """One region of one logical tensor, from a source rank's local tensor to a target's.

    ``source_box`` and ``target_box`` have the same shape: the region as it lies in
    ``source_local`` (on source rank ``source``) and in ``target_local`` (on target rank
    ``target``). Ranks are each side's own (0 .. ranks - 1).
    """

    source: int
    target: int
    tensor: str
    source_local: str
    source_box: Box
    target_local: str
    target_box: Box
    nbytes: int


@dataclass(frozen=True)
class _Holder:
    rank: int
    local: LocalTensor
    piece: Piece
    offset: int


@dataclass(frozen=True)
class TransferPlan:
    """Every :class:`Move` from the ``source`` layout to the ``target`` layout, in a fixed order
    (target rank, then its local tensors, pieces and regions in layout order)."""

    source: Layout
    target: Layout
    moves: tuple[Move, ...]
    digest: int = field(compare=False)
    """A 63-bit hash of both layouts and every move: equal on two ranks when their plans are."""

    @classmethod
    def between(cls, source: Layout, target: Layout) -> TransferPlan:
        """The plan from ``source`` to ``target``.

        Raises:
            ValueError: the layouts describe different tensors (names, shapes or dtypes), or an
                element a target rank holds is held by no source rank.
        """
        _check_same_tensors(source, target)
        holders: dict[str, list[_Holder]] = defaultdict(list)
        for rank, local in enumerate(source.ranks):
            for tensor in local:
                for piece, offset in tensor.placed():
                    if box_numel(piece.box):
                        holders[piece.tensor].append(_Holder(rank, tensor, piece, offset))
        element = {s.name: s.nbytes // max(s.numel, 1) for s in source.specs}
        sent = [0] * source.world
        moves: list[Move] = []
        for target_rank, local in enumerate(target.ranks):
            for tensor in local:
                for piece, offset in tensor.placed():
                    if not box_numel(piece.box):
                        continue
                    for cell, holder in _assign(piece, holders[piece.tensor], sent, element):
                        nbytes = box_numel(cell) * element[piece.tensor]
                        sent[holder.rank] += nbytes
                        moves.append(
                            Move(
                                source=holder.rank,
                                target=target_rank,
                                tensor=piece.tensor,
                                source_local=holder.local.name,
                                source_box=holder.local.local_box(
                                    holder.piece, holder.offset, cell
                                ),
                                target_local=tensor.name,
                                target_box=tensor.local_box(piece, offset, cell),
                                nbytes=nbytes,
                            )
                        )
        canonical = repr((source.describe(), target.describe(), moves)).encode()
        digest = int.from_bytes(hashlib.sha256(canonical).digest()[:8], "little") >> 1
        return cls(source, target, tuple(moves), digest)

    def pair(self, source: int, target: int) -> list[Move]:
        """The moves from source rank ``source`` to target rank ``target``, in plan order."""
        return [m for m in self.moves if m.source == source and m.target == target]

    def bytes_sent(self, source: int) -> int:
        return sum(m.nbytes for m in self.moves if m.source == source)

    def bytes_received(self, target: int) -> int:
        return sum(m.nbytes for m in self.moves if m.target == target)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


def _check_same_tensors(source: Layout, target: Layout) -> None:
    a = {s.name: s for s in source.specs}
    b = {s.name: s for s in target.specs}
    problems = [f"{n}: only in the source layout" for n in a if n not in b]
    problems += [f"{n}: only in the target layout" for n in b if n not in a]
    problems += [
        f"{n}: {list(a[n].shape)} {a[n].dtype} in the source, {list(b[n].shape)} {b[n].dtype} "
        "in the target"
        for n in a
        if n in b and (a[n].shape, a[n].dtype) != (b[n].shape, b[n].dtype)
    ]
    if problems:
        raise ValueError("the layouts describe different tensors: " + "; ".join(problems))


def _assign(
    piece: Piece, holders: list[_Holder], sent: list[int], element: dict[str, int]
) -> list[tuple[Box, _Holder]]:
    """Cut ``piece`` into cells no source piece boundary crosses and give each cell to the
    holder that has sent least so far (ties to the lower rank)."""
    overlapping = [
        (h, box) for h in holders if (box := intersect(h.piece.box, piece.box)) is not None
    ]
    cuts = []
    for dim, (start, stop) in enumerate(piece.box):
        points = {start, stop}
        for _, box in overlapping:
            points.update(box[dim])
        cuts.append(sorted(points))
    out = []
    load = list(sent)
    for cell in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        owners = [h for h, box in overlapping if intersect(box, cell) == cell]
        if not owners:
            raise ValueError(f"{piece.tensor}: elements {list(cell)} are held by no source rank")
        chosen = min(owners, key=lambda h: (load[h.rank], h.rank))
        load[chosen.rank] += box_numel(cell) * element[piece.tensor]
        out.append((cell, chosen))
    return out
