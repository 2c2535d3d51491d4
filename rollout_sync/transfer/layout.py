"""Layouts as data: how a set of named tensors is split over the ranks of one side of a sync.

A *logical* tensor is one of the model's tensors, whole: a :class:`~rollout_sync.WeightSpec`.
A rank holds *local* tensors; each is the concatenation, along one dimension, of *pieces*, and
a piece is a box (a start and stop per dimension) of one logical tensor. Three cases cover what
trainers and engines do, and :meth:`Layout.build` makes all three:

* **replicated**: every rank holds the whole tensor (one piece: the whole box);
* **sharded** along dimension ``d`` into one contiguous part per rank, split as
  :func:`torch.chunk` splits (``ceil(size / ranks)`` each, the last ones shorter or empty): the
  FSDP flat-shard case (FSDP2's ``Shard(0)``) and the tensor-parallel cases (a column-parallel
  linear's weight cut along dimension 0, a row-parallel one's along 1);
* **fused**: one local tensor made of several logical tensors' pieces, concatenated (an engine's
  ``qkv`` weight holding, on each tensor-parallel rank, its part of ``q``, of ``k`` and of
  ``v``), on one side and not the other.

A layout is plain data, the same on every rank that builds it from the same arguments, and
:meth:`Layout.describe` is its canonical form (what a :class:`~rollout_sync.transfer.TransferPlan`
hashes). :meth:`Layout.shard` cuts a rank's local tensors out of whole ones, and
:meth:`Layout.local_specs` says what a rank must hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..weights import WeightSpec

__all__ = ["Box", "Layout", "LocalTensor", "Piece", "chunk_bounds"]

Box = tuple[tuple[int, int], ...]
"""A region of a tensor: ``(start, stop)`` per dimension, stops exclusive."""


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """Where :func:`torch.chunk` cuts ``size`` elements into ``parts``: ``(start, stop)`` for
    each part, ``ceil(size / parts)`` long, the last ones shorter or empty (FSDP2's split)."""
    if parts < 1:
        raise ValueError(f"cannot cut into {parts} parts")
    step = math.ceil(size / parts) if size else 0
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes of one tensor, or ``None`` if they share no element."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, int(d)) for d in shape)


@dataclass(frozen=True)
class Piece:
    """A box of the logical tensor ``tensor``."""

    tensor: str
    box: Box

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)


@dataclass(frozen=True)
class LocalTensor:
    """A tensor one rank holds: its ``pieces`` concatenated along ``cat_dim``."""

    name: str
    pieces: tuple[Piece, ...]
    cat_dim: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def spec(self) -> WeightSpec:
        return WeightSpec(self.name, self.shape, self.dtype)

    def placed(self) -> Iterator[tuple[Piece, int]]:
        """Each piece with its offset along ``cat_dim`` in this tensor."""
        offset = 0
        for piece in self.pieces:
            yield piece, offset
            if piece.shape:  # a scalar is a piece of its own
                offset += piece.shape[self.cat_dim]

    def local_box(self, piece: Piece, offset: int, region: Box) -> Box:
        """Where ``region`` (a box of ``piece``'s logical tensor, inside ``piece``) lies in this
        tensor, ``piece`` sitting at ``offset`` along ``cat_dim``."""
        out = []
        for dim, ((start, stop), (piece_start, _)) in enumerate(
            zip(region, piece.box, strict=True)
        ):
            shift = (offset if dim == self.cat_dim else 0) - piece_start
            out.append((start + shift, stop + shift))
        return tuple(out)


def region_of(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``tensor`` that ``box`` selects."""
    return tensor[tuple(slice(start, stop) for start, stop in box)]


@dataclass(frozen=True)
class Layout:
    """How the logical tensors ``specs`` are held by ``len(ranks)`` ranks: ``ranks[i]`` is the
    local tensors of the side's ``i``-th rank (a side's own rank, not a global one)."""

    specs: tuple[WeightSpec, ...]
    ranks: tuple[tuple[LocalTensor, ...], ...]

    @classmethod
    def build(
        cls,
        specs: Sequence[WeightSpec] | Mapping[str, torch.Tensor],
        ranks: int,
        *,
        shard: Mapping[str, int] | None = None,
        fuse: Mapping[str, tuple[Sequence[str], int]] | None = None,
        sections: Mapping[str, int | Sequence[int]] | None = None,
    ) -> Layout:
        """The layout of ``specs`` (or of whole tensors, by name) over ``ranks`` ranks.

        Args:
            shard: ``{name: dim}``: cut that tensor along ``dim`` into one contiguous part per
                rank (:func:`chunk_bounds`); every other tensor is replicated.
            fuse: ``{local_name: (names, dim)}``: each rank holds one tensor ``local_name``, its
                pieces of ``names`` (sharded or not, as ``shard`` says) concatenated along
                ``dim``, instead of those tensors under their own names.
            sections: ``{name: n}`` or ``{name: sizes}``, for a tensor in ``shard`` that is
                several tensors fused along its shard dimension (a model's ``qkv`` weight, in
                ``n`` equal parts or parts of ``sizes`` rows, as for grouped-query attention):
                each section is cut over the ranks on its own, and a rank holds its part of
                every section, concatenated, under the tensor's name: a tensor-parallel
                engine's fused q/k/v (or gate/up), meeting a trainer's plain ``qkv``.

        Raises:
            ValueError: a name that is not a tensor, a dimension out of range, a tensor fused
                twice, pieces that cannot be concatenated, or a local name used twice.
        """
        spec_list = (
            [WeightSpec.of(n, t) for n, t in specs.items()]
            if isinstance(specs, Mapping)
            else list(specs)
        )
        by_name = {s.name: s for s in spec_list}
        if len(by_name) != len(spec_list):
            raise ValueError("a layout's tensor names must be unique")
        if ranks < 1:
            raise ValueError(f"a layout needs at least one rank, got {ranks}")
        shard = dict(shard or {})
        fuse = dict(fuse or {})
        for name, dim in shard.items():
            spec = by_name.get(name)
            if spec is None:
                raise ValueError(f"shard names {name!r}, which is not one of the layout's tensors")
            if not 0 <= dim < len(spec.shape):
                raise ValueError(
                    f"{name}: cannot shard along dim {dim} of shape {list(spec.shape)}"
                )
        fused_into: dict[str, str] = {}
        for fused_name, (names, _) in fuse.items():
            for name in names:
                if name not in by_name:
                    raise ValueError(f"fuse {fused_name!r} names {name!r}, not one of the tensors")
                if name in fused_into:
                    raise ValueError(
                        f"{name!r} is fused into both {fused_into[name]!r} and {fused_name!r}"
                    )
                fused_into[name] = fused_name

        cuts = {n: _section_bounds(by_name[n], shard, k) for n, k in (sections or {}).items()}

        def pieces_of(name: str, rank: int) -> tuple[Piece, ...]:
            spec = by_name[name]
            if name not in shard:
                return (Piece(name, whole(spec.shape)),)
            dim = shard[name]
            out = []
            for start, stop in cuts.get(name, [(0, spec.shape[dim])]):
                box = list(whole(spec.shape))
                a, b = chunk_bounds(stop - start, ranks)[rank]
                box[dim] = (start + a, start + b)
                out.append(Piece(name, tuple(box)))
            return tuple(out)

        per_rank = []
        for rank in range(ranks):
            local: list[LocalTensor] = []
            for spec in spec_list:
                if spec.name in fused_into:
                    continue
                own = pieces_of(spec.name, rank)
                local.append(_fused(spec.name, own, shard.get(spec.name, 0), [spec]))
            for local_name, (names, dim) in fuse.items():
                pieces = tuple(p for n in names for p in pieces_of(n, rank))
                local.append(_fused(local_name, pieces, dim, [by_name[n] for n in names]))
            per_rank.append(tuple(local))
        return cls(tuple(spec_list), tuple(per_rank)).checked()

    def checked(self) -> Layout:
        """This layout, once every piece lies inside its tensor and every local name is unique
        on its rank and fits its pieces; else :class:`ValueError`."""
        by_name = {s.name: s for s in self.specs}
        for rank, local in enumerate(self.ranks):
            names = [t.name for t in local]
            if len(set(names)) != len(names):
                raise ValueError(f"rank {rank} holds two local tensors of one name")
            for tensor in local:
                for p in tensor.pieces:
                    spec = by_name.get(p.tensor)
                    if spec is None:
                        raise ValueError(f"rank {rank}: {tensor.name} holds unknown {p.tensor!r}")
                    if len(p.box) != len(spec.shape) or any(
                        not 0 <= a <= b <= d for (a, b), d in zip(p.box, spec.shape, strict=False)
                    ):
                        raise ValueError(
                            f"rank {rank}: piece {p.box} outside {p.tensor} {spec.shape}"
                        )
                    if spec.dtype != tensor.dtype:
                        raise ValueError(f"rank {rank}: {tensor.name} mixes dtypes")
        return self

    @property
    def world(self) -> int:
        return len(self.ranks)

    def spec(self, name: str) -> WeightSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    def local_specs(self, rank: int) -> dict[str, WeightSpec]:
        """What rank ``rank`` holds: local name -> spec."""
        return {t.name: t.spec for t in self.ranks[rank]}

    def local_nbytes(self, rank: int) -> int:
        return sum(t.spec.nbytes for t in self.ranks[rank])

    def shard(self, weights: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s local tensors, cut (copied) from the whole logical ``weights``."""
        out = {}
        for tensor in self.ranks[rank]:
            parts = [region_of(weights[p.tensor], p.box) for p in tensor.pieces]
            joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=tensor.cat_dim)
            out[tensor.name] = joined.clone(memory_format=torch.contiguous_format)
        return out

    def describe(self) -> tuple[object, ...]:
        """The canonical form of this layout: equal on two ranks exactly when the layouts are."""
        return (
            tuple((s.name, s.shape, str(s.dtype)) for s in self.specs),
            tuple(
                tuple(
                    (t.name, t.cat_dim, tuple((p.tensor, p.box) for p in t.pieces)) for t in local
                )
                for local in self.ranks
            ),
        )


def _section_bounds(
    spec: WeightSpec, shard: Mapping[str, int], sections: int | Sequence[int]
) -> list[tuple[int, int]]:
    if spec.name not in shard:
        raise ValueError(f"sections of {spec.name!r} need it in shard (they are cut along its dim)")
    size = spec.shape[shard[spec.name]]
    if isinstance(sections, int):
        if sections < 1 or size % sections:
            raise ValueError(f"{spec.name}: cannot cut {size} into {sections} equal sections")
        sizes = [size // sections] * sections
    else:
        sizes = list(sections)
        if sum(sizes) != size or any(n < 0 for n in sizes):
            raise ValueError(f"{spec.name}: sections {sizes} do not add up to {size}")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def _fused(name: str, pieces: tuple[Piece, ...], dim: int, specs: list[WeightSpec]) -> LocalTensor:
    if len(pieces) == 1:  # one piece: nothing to concatenate (a scalar too)
        shape = pieces[0].shape
        return LocalTensor(name, pieces, dim if dim < len(shape) else 0, shape, specs[0].dtype)
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        raise ValueError(
            f"fuse {name!r}: its tensors have different dtypes {sorted(map(str, dtypes))}"
        )
    ndims = {len(p.shape) for p in pieces}
    if len(ndims) != 1 or not 0 <= dim < next(iter(ndims)):
        raise ValueError(f"fuse {name!r}: cannot concatenate along dim {dim}")
    shapes = [p.shape for p in pieces]
    others = {tuple(s[:dim] + s[dim + 1 :]) for s in shapes}
    if len(others) != 1:
        raise ValueError(f"fuse {name!r}: pieces of shapes {shapes} differ off dim {dim}")
    joined = list(shapes[0])
    joined[dim] = sum(s[dim] for s in shapes)
    return LocalTensor(name, pieces, dim, tuple(joined), specs[0].dtype)
