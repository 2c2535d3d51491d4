"""Delta syncs over a sharded transfer: each trainer rank sends, per move of the plan (a region
of one of its local tensors going to one target rank), the region's changes against the same
region of the last version every target committed.

* :class:`ShardedDeltaEncoder`, a source rank's side (what
  :meth:`ShardedTransfer.delta_encoder <rollout_sync.transfer.ShardedTransfer.delta_encoder>`
  makes, and :class:`~rollout_sync.trainer.TransferWeightPusher` drives as it drives a
  :class:`~rollout_sync.transfer.delta_sync.DeltaEncoder`): one copy of this rank's local
  tensors as last committed (in the dtype sent), each move's region encoded with
  :func:`~rollout_sync.transfer.delta.encode_delta` on the region flattened, and one payload
  per target rank (:class:`ShardedDelta`);
* the plan vote's delta columns (:func:`delta_columns`, :func:`decide`): whether every rank
  can take a delta, the base version, per (source, target) pair a fingerprint of the base
  digests of its regions (the source's from its copy, the target's from what it holds) and
  the payload's bytes, so every rank learns from the one all-gather which kind the sync is
  and what size each pair's payload has;
* :class:`ShardedReceivedDelta`, a target rank's side: every region's delta parsed and
  checked, proven against the source's new digest of the region (the base digest moved at
  the changed positions only) before any write, then applied in place with every
  overwritten element kept, or kept pending for a staged install. It has the members of
  :class:`~rollout_sync.transfer.delta_sync.ReceivedDelta` the install strategies use.

A pair's payload is one ``uint8`` tensor: ``int64`` words (a magic word, the move count, then
per move its packed delta's bytes and the new region digest), then each move's packed delta
(:func:`~rollout_sync.transfer.delta.pack_delta`, empty for an unchanged region), each
starting at a multiple of 8 bytes. The transfer cuts it into chunks of the bucket size, each
with its checksum (:mod:`rollout_sync.transfer.sharded`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import DeltaError
from .delta import (
    TensorDelta,
    bits_of,
    check_delta,
    delta_changes,
    delta_of_changes,
    encode_delta,
    linear_digest,
    moved_digest,
    pack_delta,
    unpack_delta,
    updated_digest,
)
from .delta_sync import (
    DeltaEntry,
    DeltaHeader,
    DeltaTarget,
    DigestCache,
    EncodedDelta,
    WholeReason,
    scheduled_whole,
)
from .layout import Box, region_of
from .plan import Move, TransferPlan

__all__ = ["ShardedDelta", "ShardedDeltaEncoder", "ShardedReceivedDelta"]

_MAGIC = 0x5253_4844_4C54_0001
"""The first word of a pair's payload ("RSHDLT", format 1)."""
_REASONS = tuple(WholeReason)


def region_key(move: Move) -> str:
    """The digest cache's key of a target's region (never a tensor's name)."""
    return f"{move.target_local}@{list(move.target_box)}"


def region_positions(shape: Sequence[int], box: Box, offsets: torch.Tensor) -> torch.Tensor:
    """The flat positions in a contiguous tensor of ``shape`` of the elements at flat
    ``offsets`` of its region ``box`` (row-major both): only the changed elements are mapped."""
    rest = offsets.to(torch.int64)
    out = torch.zeros_like(rest)
    stride = 1
    for dim in reversed(range(len(shape))):
        start, stop = box[dim]
        size = stop - start
        out += (rest % size + start) * stride
        rest = torch.div(rest, size, rounding_mode="floor")
        stride *= shape[dim]
    return out


def fingerprint(digests: Sequence[tuple[int, int]]) -> int:
    """A 62-bit hash of a pair's region digests, in plan order: what the plan vote compares."""
    data = repr(list(digests)).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 2


def reason_code(reason: WholeReason | None) -> int:
    return 0 if reason is None else _REASONS.index(reason) + 1


def reason_of(code: int) -> WholeReason | None:
    return _REASONS[code - 1] if 0 < code <= len(_REASONS) else None


# -- the source side ------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedDelta:
    """One source rank's part of a version as region deltas, ready for
    :meth:`ShardedTransfer.send(delta=...) <rollout_sync.transfer.ShardedTransfer.send>`."""

    version: int
    base_version: int
    payloads: Mapping[int, torch.Tensor]
    """Per target rank (layout index): the pair's payload (the module docstring)."""
    fingerprints: Mapping[int, int]
    """Per target rank: the fingerprint of the base digests of the pair's regions."""
    new_digests: Mapping[tuple[int, int], tuple[int, int]]
    """Per (target, move index in the pair): the region's new digest."""
    full_nbytes: int
    """The bytes this rank sends of a whole version."""

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.payloads.values())


def _payload(items: Sequence[tuple[torch.Tensor, tuple[int, int]]]) -> torch.Tensor:
    words = [_MAGIC, len(items)]
    for packed, digest in items:
        words += [packed.numel(), digest[0], digest[1]]
    parts = [torch.tensor(words, dtype=torch.int64).view(torch.uint8)]
    for packed, _ in items:
        parts.append(packed)
        pad = -packed.numel() % 8
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    return torch.cat(parts)


class ShardedDeltaEncoder:
    """A source rank's side of sharded delta syncs: encode each of its moves' regions against
    the last version every rank committed.

    Keeps one copy of this rank's local tensors of the layout (in the dtype sent):
    :attr:`extra_bytes`. Every source rank's encoder counts the same syncs and learns the same
    commits, so they agree on the first sync and the keyframes; a delta no smaller than this
    rank's whole part is its own fallback, which the plan vote makes everyone's.

    Args:
        plan: the transfer's plan; ``index``: this source rank's index in its layout.
        full_every: every ``full_every``-th sync is whole (a keyframe); ``None``: only the
            fallbacks make a sync whole.
    """

    def __init__(self, plan: TransferPlan, index: int, *, full_every: int | None = None) -> None:
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every!r}")
        self.full_every = full_every
        self.pairs = {t: moves for t in range(plan.target.world) if (moves := plan.pair(index, t))}
        self.names = sorted({m.source_local for moves in self.pairs.values() for m in moves})
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version: int | None = None
        self.digests: dict[tuple[int, int], tuple[int, int]] = {}
        """The base's digest of each region, by (target, move index in the pair)."""
        self.syncs = 0

    def __repr__(self) -> str:
        return (
            f"<ShardedDeltaEncoder {len(self.names)} tensors to {len(self.pairs)} target(s), "
            f"base {self.base_version}, {self.syncs} syncs>"
        )

    @property
    def extra_bytes(self) -> int:
        """The memory this encoder holds: its copy of the last committed version."""
        return (
            0
            if self.base is None
            else sum(t.numel() * t.element_size() for t in self.base.values())
        )

    def encode(
        self, weights: Mapping[str, torch.Tensor], version: int
    ) -> ShardedDelta | WholeReason:
        """This rank's part of ``weights`` (version ``version``) as region deltas on the last
        committed version, or why it goes whole."""
        self.syncs += 1
        base = self.base
        base_version = self.base_version
        scheduled = scheduled_whole(self.syncs, self.full_every, base_version)
        if scheduled is not None or base is None or base_version is None:
            return scheduled or WholeReason.FIRST
        if any(
            n not in weights
            or weights[n].shape != base[n].shape
            or weights[n].dtype != base[n].dtype
            for n in self.names
        ):
            return WholeReason.NEW_TENSORS
        full = sum(m.nbytes for moves in self.pairs.values() for m in moves)
        budget = full
        payloads: dict[int, torch.Tensor] = {}
        fingerprints: dict[int, int] = {}
        new_digests: dict[tuple[int, int], tuple[int, int]] = {}
        for t, moves in self.pairs.items():
            items = []
            for i, move in enumerate(moves):
                old = region_of(base[move.source_local], move.source_box)
                new = region_of(weights[move.source_local].detach(), move.source_box)
                delta = encode_delta(old, new.to(old.device))
                digest = self.digests[(t, i)]
                if delta.blocks:
                    packed = pack_delta(delta)
                    digest = moved_digest(digest, old, delta, name=move.source_local)
                else:
                    packed = torch.empty(0, dtype=torch.uint8)
                budget -= packed.numel()
                items.append((packed, digest))
                new_digests[(t, i)] = digest
            payloads[t] = _payload(items)
            fingerprints[t] = fingerprint([self.digests[(t, i)] for i in range(len(moves))])
        if budget <= 0:
            return WholeReason.NOT_SMALLER
        return ShardedDelta(version, base_version, payloads, fingerprints, new_digests, full)

    def committed(
        self, weights: Mapping[str, torch.Tensor], version: int, delta: object | None
    ) -> None:
        """Every rank committed ``version``: the base is now it. ``delta``: the
        :class:`ShardedDelta` sent (``None``: the version went whole)."""
        if self.base is None:
            self.base = {n: weights[n].detach().to("cpu", copy=True) for n in self.names}
        else:
            for n in self.names:
                self.base[n].copy_(weights[n].detach())
        if isinstance(delta, ShardedDelta):
            self.digests = dict(delta.new_digests)
        else:
            self.digests = {
                (t, i): linear_digest(region_of(self.base[m.source_local], m.source_box))
                for t, moves in self.pairs.items()
                for i, m in enumerate(moves)
            }
        self.base_version = version

    def forget(self) -> None:
        """Drop the base (the next sync goes whole)."""
        self.base, self.base_version, self.digests = None, None, {}


# -- the plan vote ---------------------------------------------------------------------------


def delta_width(sources: int, targets: int) -> int:
    """The plan vote's delta columns: offer, reason, base version, then per pair a
    fingerprint and a payload size."""
    return 3 + 2 * sources * targets


def delta_columns(
    sources: int,
    targets: int,
    *,
    offer: bool,
    reason: WholeReason | None,
    base: int | None,
    fingerprints: Mapping[tuple[int, int], int] | None = None,
    sizes: Mapping[tuple[int, int], int] | None = None,
) -> list[int]:
    """One rank's delta columns of the plan vote (pairs it is not part of stay 0)."""
    pairs = sources * targets
    row = [int(offer), reason_code(reason), -1 if base is None else base] + [0] * (2 * pairs)
    for (s, t), value in (fingerprints or {}).items():
        row[3 + s * targets + t] = value
    for (s, t), value in (sizes or {}).items():
        row[3 + pairs + s * targets + t] = value
    return row


@dataclass(frozen=True)
class DeltaDecision:
    """What the plan vote decided about deltas: every rank computes the same one."""

    delta: bool
    reason: WholeReason | None
    """Why a sync with deltas on goes whole; ``None`` for a delta, or when nobody sent one."""
    sizes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """Per (source, target) pair: its payload's bytes (a delta only)."""
    fingerprints: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """Per pair: the source's fingerprint of its base regions, for the targets to match."""
    base_version: int | None = None


WHOLE = DeltaDecision(False, None)


def decide(
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    pairs: Sequence[tuple[int, int]],
) -> DeltaDecision:
    """The sync's kind from every source's and every target's delta columns (layout order),
    before the targets match their regions: a delta only if every rank offers one and the
    sources' base is every target's version; else the first source's reason, a target's, or
    :attr:`WholeReason.RECEIVER`. A delta is then confirmed by the base vote (each target's
    regions against the sources' fingerprints)."""
    n_targets = len(targets)
    n_pairs = len(sources) * n_targets

    def cell(row: Sequence[int], s: int, t: int, part: int) -> int:
        return int(row[3 + part * n_pairs + s * n_targets + t])

    if not any(row[0] or row[1] for row in sources):
        return WHOLE  # no source sent a delta: a plain whole sync
    for row in sources:
        if not row[0]:
            return DeltaDecision(False, reason_of(int(row[1])) or WholeReason.TRANSFER)
    for row in targets:
        if not row[0]:
            return DeltaDecision(False, reason_of(int(row[1])) or WholeReason.RECEIVER)
    bases = {int(row[2]) for row in sources} | {int(row[2]) for row in targets}
    if len(bases) != 1:
        return DeltaDecision(False, WholeReason.RECEIVER)
    sizes = {(s, t): cell(sources[s], s, t, 1) for s, t in pairs}
    prints = {(s, t): cell(sources[s], s, t, 0) for s, t in pairs}
    return DeltaDecision(True, None, sizes, prints, bases.pop())


def holds_base(
    plan: TransferPlan, index: int, target: DeltaTarget, decision: DeltaDecision
) -> bool:
    """Whether this target rank's regions are the sources' base, bit for bit: per (source,
    this target) pair, the fingerprint of its regions' digests (cached per version: a whole
    read of each region once after a whole sync) against the source's."""
    version = target.version
    assert version is not None
    for s in range(plan.source.world):
        moves = plan.pair(s, index)
        if moves:
            digests = [
                target.digests.get(
                    region_key(m), region_of(target.served[m.target_local], m.target_box), version
                )
                for m in moves
            ]
            if fingerprint(digests) != decision.fingerprints.get((s, index)):
                return False
    return True


# -- the target side -------------------------------------------------------------------------


@dataclass
class _Region:
    move: Move
    positions: torch.Tensor
    """Flat positions in the target's local tensor."""
    offsets: torch.Tensor
    """Flat positions in the region (what its digest reads)."""
    new_bits: torch.Tensor
    old_bits: torch.Tensor
    digest: tuple[int, int]
    nbytes: int


@dataclass
class ShardedReceivedDelta:
    """A target rank's delta that arrived whole: every region checked and proven (nothing
    written), then applied in place with what it overwrote kept, or kept pending until a
    staged install applies it. The members the install strategies use are
    :class:`~rollout_sync.transfer.delta_sync.ReceivedDelta`'s."""

    version: int
    base_version: int
    targets: Mapping[str, torch.Tensor]
    regions: list[_Region]
    undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    whole_digests: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The new version's digest of each local tensor it writes (set by :meth:`encoded`)."""

    @classmethod
    def check(
        cls,
        version: int,
        base_version: int,
        payloads: Mapping[int, torch.Tensor],
        moves: Mapping[int, Sequence[Move]],
        target: DeltaTarget,
        ranks: Mapping[int, int],
    ) -> ShardedReceivedDelta:
        """Parse every source's payload (``payloads[s]``, the moves ``moves[s]`` in plan
        order), check every region's delta, and prove each region's result equals the
        source's: the region's base digest moved at the changed positions must be the digest
        the source sent. Nothing is written.

        Raises:
            DeltaError: a payload is malformed or truncated, a delta names positions out of
                range, unsorted or repeated, or a proof fails; the message names the source
                rank, the tensor and the region.
        """
        regions = []
        for s, payload in payloads.items():
            regions += _check_pair(payload, moves[s], target, ranks[s], version)
        return cls(version, base_version, target.served, regions)

    @property
    def nbytes(self) -> int:
        """The packed bytes it holds (what a staged delta stages)."""
        return sum(r.nbytes for r in self.regions)

    @property
    def tensors(self) -> list[str]:
        """The local tensors it writes."""
        return sorted({r.move.target_local for r in self.regions})

    def apply(self, cache: DigestCache) -> int:
        """Write every region's changes into its target tensor (checked and proven already);
        the tensors written. Their digests move to the new version in ``cache``. On an error
        part-way, what was written is restored before it is raised (:attr:`undo` is then empty;
        not so if the restore failed, or the error came after the writes: the caller's sign
        that something may be written)."""
        try:
            for region in self.regions:
                bits = bits_of(self.targets[region.move.target_local])
                self.undo.append((bits, region.positions, region.old_bits))
                bits[region.positions] = region.new_bits
        except BaseException:
            self.restore()
            raise
        for region in self.regions:
            cache.put(region_key(region.move), self.version, region.digest)
        for name, digest in self.whole_digests.items():
            cache.put(name, self.version, digest)
        return len(self.tensors)

    def restore(self) -> None:
        """Put back every element :meth:`apply` overwrote, bit for bit (were it to fail, what
        it could not put back stays in :attr:`undo`)."""
        while self.undo:
            bits, positions, old = self.undo[-1]
            bits[positions] = old
            self.undo.pop()  # only once it is back

    def apply_to(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the new version's changes into other copies of the base (a staging copy)."""
        for region in self.regions:
            bits_of(tensors[region.move.target_local])[region.positions] = region.new_bits

    def encoded(self, cache: DigestCache) -> EncodedDelta:
        """The same changes as a delta of this rank's local tensors (what an R2R
        :class:`~rollout_sync.WeightTransfer` carries to the same rank of the other replicas):
        per tensor, the changed positions of all its regions, and its whole digest moved by
        them (the base's read once after a whole sync, cached)."""
        by_tensor: dict[str, list[_Region]] = {}
        for region in self.regions:
            by_tensor.setdefault(region.move.target_local, []).append(region)
        packed: dict[str, torch.Tensor] = {}
        entries = []
        for name in sorted(by_tensor):
            parts = by_tensor[name]
            served = self.targets[name]
            positions = torch.cat([r.positions for r in parts])
            order = torch.argsort(positions)
            positions = positions[order]
            new = torch.cat([r.new_bits for r in parts])[order]
            old = torch.cat([r.old_bits for r in parts])[order]
            base = cache.get(name, served, self.base_version)
            digest = updated_digest(base, positions, old, new)
            self.whole_digests[name] = digest
            delta = delta_of_changes(served.numel(), served.dtype, positions, new)
            packed[name] = pack_delta(delta)
            entries.append(DeltaEntry(name, tuple(served.shape), served.dtype, digest, base))
        full = sum(t.numel() * t.element_size() for t in self.targets.values())
        header = DeltaHeader(self.base_version, tuple(entries), full)
        return EncodedDelta(self.version, header, packed, full)


def _check_pair(
    payload: torch.Tensor, moves: Sequence[Move], target: DeltaTarget, src: int, version: int
) -> list[_Region]:
    where = f"the delta of version {version} from source rank {src}"
    held = target.version
    assert held is not None
    if payload.numel() < 16 or payload.numel() % 8:
        raise DeltaError(f"{where}: {payload.numel()} bytes are not a payload (truncated?)")
    head = payload[:16].clone().view(torch.int64).tolist()
    if head[0] != _MAGIC or head[1] != len(moves):
        raise DeltaError(
            f"{where}: not a payload of this plan's {len(moves)} region(s) (magic word or "
            f"region count wrong)"
        )
    table_bytes = 8 * (2 + 3 * len(moves))
    if payload.numel() < table_bytes:
        raise DeltaError(f"{where}: {payload.numel()} bytes end inside its table (truncated?)")
    table = payload[16:table_bytes].clone().view(torch.int64).view(-1, 3).tolist()
    regions = []
    at = table_bytes
    for move, (nbytes, d0, d1) in zip(moves, table, strict=True):
        name = f"{move.target_local}{list(move.target_box)}"
        served = target.served[move.target_local]
        region = region_of(served, move.target_box)
        if not 0 <= nbytes <= payload.numel() - at:
            raise DeltaError(f"{where}: {name}: {nbytes} bytes past the payload's end (truncated?)")
        base = target.digests.get(region_key(move), region, held)
        if nbytes == 0:
            if (d0, d1) != base:
                raise DeltaError(
                    f"{where}: {name}: an unchanged region whose digest differs from this "
                    f"replica's ({(d0, d1)} against {base}); nothing was written"
                )
            continue
        delta: TensorDelta = unpack_delta(
            payload[at : at + nbytes], numel=region.numel(), dtype=served.dtype, name=name
        )
        at += nbytes + (-nbytes % 8)
        check_delta(delta, region, name=name)
        offsets, new = delta_changes(delta)
        positions = region_positions(served.shape, move.target_box, offsets)
        old = bits_of(served)[positions].clone()
        digest = updated_digest(base, offsets, old, new)
        if digest != (d0, d1):
            raise DeltaError(
                f"{where}: {name}: applied to version {held} here it would not equal the "
                f"sender's version {version} (digest {digest} against {(d0, d1)}); nothing "
                "was written"
            )
        regions.append(_Region(move, positions, offsets, new, old, digest, nbytes))
    if at != payload.numel():
        raise DeltaError(
            f"{where}: its table makes {at} bytes, the payload has {payload.numel()} "
            "(truncated or padded)"
        )
    return regions
