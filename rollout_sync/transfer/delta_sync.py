"""Delta syncs: a version sent as its changes against the version every receiver holds.

A training step changes a few percent of a model's served elements (docs/delta.md), so a sync
can ship only those (:mod:`rollout_sync.transfer.delta`'s encoding) instead of the whole model.
This module is what a sync needs around the encoding:

* :class:`DeltaEncoder`, the trainer's side: it keeps one copy of the last version it sent
  that committed (in the dtype it sends), compares the next version with it bit for bit and
  encodes it, or says why this sync goes whole (:class:`WholeReason`: the first sync, a
  keyframe, a delta no smaller than the whole version, a new set of tensors);
* :class:`DeltaHeader`, what a delta's manifest adds: the base version it applies to and, per
  tensor, its served shape and dtype and the :func:`~rollout_sync.transfer.delta.linear_digest`
  of its new version;
* :class:`DeltaTarget`, a receiver's side: the tensors that hold the base, the version they
  hold, and a :class:`DigestCache` of their digests;
* :class:`ReceivedDelta`, a delta that arrived: checked against its targets before any write,
  proven equal to the sender's new version from the changed elements alone (the digest moved
  by the old and new values at the changed positions, so a sync never reads the whole model),
  then applied, with every overwritten element kept to restore.

A receiver that cannot take a delta (it holds another version, it missed one, its weights are
torn, or it has no :class:`DeltaTarget`) votes for the whole version at the manifest vote, and
the source sends the same version whole at once, in the same transfer
(:meth:`~rollout_sync.WeightTransfer.send`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import DeltaError
from .delta import (
    Overwritten,
    apply_changes,
    apply_delta,
    bits_of,
    changed_positions,
    check_delta,
    delta_changes,
    encode_delta,
    linear_digest,
    pack_delta,
    unpack_delta,
    updated_digest,
)

__all__ = [
    "DeltaEncoder",
    "DeltaEntry",
    "DeltaHeader",
    "DeltaTarget",
    "DigestCache",
    "EncodedDelta",
    "MadeOnFirstUse",
    "ReceivedDelta",
    "SyncKind",
    "WholeReason",
    "scheduled_whole",
]


class SyncKind(str, enum.Enum):
    """What one sync moved."""

    WHOLE = "whole"
    DELTA = "delta"


class WholeReason(str, enum.Enum):
    """Why a sync with deltas on went whole (:attr:`TransferStats.whole_reason`)."""

    FIRST = "first sync: no committed base to encode against"
    KEYFRAME = "keyframe: every full_every-th sync is whole"
    NOT_SMALLER = "the delta is not smaller than the whole version"
    NEW_TENSORS = "the set, shapes or dtypes of the tensors changed"
    TRANSFER = "this transfer moves whole versions only"
    RELAY = "the pipelined sharded relay passes whole versions on"
    RECEIVER = (
        "a receiver asked for the whole version (it holds another version: it missed one, was "
        "re-seeded, its weights are torn, or it cannot apply a delta)"
    )


@dataclass(frozen=True)
class DeltaEntry:
    """One tensor of a delta: its served shape and dtype, and its new version's digest."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: tuple[int, int]
    """The new version's digest (what the receiver proves its result against)."""
    base_digest: tuple[int, int]
    """The base version's (what the receiver checks its tensor against before the vote)."""

    @property
    def numel(self) -> int:
        out = 1
        for d in self.shape:
            out *= d
        return out


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta's manifest adds to a whole one: the version it applies to and, for each
    tensor it carries (a packed delta, ``uint8``), the tensor it writes."""

    base_version: int
    entries: tuple[DeltaEntry, ...]
    full_nbytes: int
    """The bytes of the whole version (what a report compares the delta with)."""

    def to_doc(self) -> dict[str, object]:
        return {
            "base": self.base_version,
            "full_nbytes": self.full_nbytes,
            "tensors": [
                [e.name, list(e.shape), str(e.dtype), list(e.digest), list(e.base_digest)]
                for e in self.entries
            ],
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, object]) -> DeltaHeader:
        """Raises ``ValueError``/``KeyError``/``TypeError`` for a malformed one (the manifest's
        decoder turns them into :class:`~rollout_sync.errors.ManifestError`)."""
        entries = []
        for name, shape, dtype, digest, base in doc["tensors"]:  # type: ignore[attr-defined]
            found = getattr(torch, str(dtype).removeprefix("torch."), None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            a, b = (int(x) for x in digest)
            c, d = (int(x) for x in base)
            dims = tuple(int(n) for n in shape)
            entries.append(DeltaEntry(str(name), dims, found, (a, b), (c, d)))
        base, full = int(doc["base"]), int(doc["full_nbytes"])  # type: ignore[call-overload]
        return cls(base, tuple(entries), full)


@dataclass(frozen=True)
class EncodedDelta:
    """One version as a delta, ready to send: its header and a packed delta per changed
    tensor (what the transfer's buckets carry)."""

    version: int
    header: DeltaHeader
    packed: Mapping[str, torch.Tensor]
    full_nbytes: int
    """The bytes of the whole version, for the ratio a report shows."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.packed.values())


def scheduled_whole(
    syncs: int, full_every: int | None, base_version: int | None
) -> WholeReason | None:
    """Why an encoder's ``syncs``-th sync goes whole before anything is compared: it has no
    committed base (``base_version`` None), or it is a keyframe (``full_every``)."""
    if base_version is None:
        return WholeReason.FIRST
    if full_every is not None and (syncs - 1) % full_every == 0:
        return WholeReason.KEYFRAME
    return None


def _nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class DeltaEncoder:
    """The trainer's side of delta syncs: encode each version against the last one that
    committed.

    Keeps one copy of the tensors it last sent whole or by delta (in the dtype sent, the
    served dtype): :attr:`extra_bytes`. :meth:`encode` says what to send; after a send that
    committed, :meth:`committed` moves the copy to that version. A send that failed leaves the
    copy as it was: a receiver that committed the failed version anyway (in place, a version
    that landed whole commits) holds another version than the base and asks for the whole one.

    Args:
        full_every: every ``full_every``-th sync is whole (a keyframe); ``None``: only the
            fallbacks make a sync whole.
    """

    def __init__(self, *, full_every: int | None = None) -> None:
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every!r}")
        self.full_every = full_every
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version: int | None = None
        self.digests: dict[str, tuple[int, int]] = {}
        self.syncs = 0
        """Syncs encoded so far (whole or delta): what ``full_every`` counts."""
        self._changes: tuple[int | None, dict[str, tuple[torch.Tensor, torch.Tensor]]] = (None, {})
        """The last encoded version's changed positions and new bits, by tensor."""

    @property
    def extra_bytes(self) -> int:
        """The memory this encoder holds: its copy of the last committed version."""
        return 0 if self.base is None else _nbytes(self.base)

    def encode(
        self, weights: Mapping[str, torch.Tensor], version: int
    ) -> EncodedDelta | WholeReason:
        """``weights`` (version ``version``) as a delta on the last committed version, or
        why it goes whole."""
        self.syncs += 1
        base = self.base
        base_version = self.base_version
        scheduled = scheduled_whole(self.syncs, self.full_every, base_version)
        if scheduled is not None or base is None or base_version is None:
            return scheduled or WholeReason.FIRST
        if list(base) != list(weights) or any(
            base[n].shape != t.shape or base[n].dtype != t.dtype for n, t in weights.items()
        ):
            return WholeReason.NEW_TENSORS
        full = _nbytes(weights)
        packed: dict[str, torch.Tensor] = {}
        entries: list[DeltaEntry] = []
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        budget = full
        for name, tensor in weights.items():
            old, new = base[name], tensor.detach().to(base[name].device)
            changed = changed_positions(old, new)
            if not changed.numel():
                continue
            data = pack_delta(encode_delta(old, new, changed=changed))
            budget -= data.numel()
            if budget <= 0:
                return WholeReason.NOT_SMALLER
            packed[name] = data
            old_bits, new_bits = bits_of(old)[changed], bits_of(new)[changed]
            digest = updated_digest(self.digests[name], changed, old_bits, new_bits)
            changes[name] = (changed, new_bits)
            entries.append(
                DeltaEntry(name, tuple(tensor.shape), tensor.dtype, digest, self.digests[name])
            )
        header = DeltaHeader(base_version, tuple(entries), full)
        self._changes = (version, changes)
        return EncodedDelta(version, header, packed, full)

    def committed(
        self,
        weights: Mapping[str, torch.Tensor],
        version: int,
        delta: EncodedDelta | None,
    ) -> None:
        """Every receiver committed ``version``: the base is now it. ``delta``: what was sent
        (``None``: the whole ``weights``); a delta moves the copy at its changed elements."""
        if delta is None or self.base is None:
            self.base = {n: t.detach().to("cpu", copy=True) for n, t in weights.items()}
            self.digests = {n: linear_digest(t) for n, t in self.base.items()}
        else:
            kept_version, kept = self._changes
            for entry in delta.header.entries:
                target = self.base[entry.name]
                if kept_version == version and entry.name in kept:
                    apply_changes(target, *kept[entry.name])  # what encode() found changed
                else:
                    unpacked = unpack_delta(
                        delta.packed[entry.name], numel=target.numel(), dtype=target.dtype
                    )
                    apply_delta(target, unpacked, name=entry.name)
                self.digests[entry.name] = entry.digest
        self._changes = (None, {})
        self.base_version = version

    def forget(self) -> None:
        """Drop the base (the next sync goes whole): the receivers' weights were replaced by
        another means (a re-seed from elsewhere)."""
        self.base, self.base_version, self.digests = None, None, {}


@dataclass
class DigestCache:
    """A receiver's digests of the tensors it serves, each for the version it was taken at:
    taken once (a whole read) after a whole sync, then moved by each delta."""

    digests: dict[str, tuple[int, tuple[int, int]]] = field(default_factory=dict)

    def get(self, name: str, tensor: torch.Tensor, version: int) -> tuple[int, int]:
        cached = self.digests.get(name)
        if cached is not None and cached[0] == version:
            return cached[1]
        digest = linear_digest(tensor)
        self.digests[name] = (version, digest)
        return digest

    def put(self, name: str, version: int, digest: tuple[int, int]) -> None:
        self.digests[name] = (version, digest)


@dataclass
class DeltaTarget:
    """A receiver's side of a delta sync: hand it to
    :meth:`~rollout_sync.WeightTransfer.receive` (``delta=``) and a delta manifest is taken
    instead of refused.

    Args:
        served: the tensors that hold ``version`` and that the delta writes.
        version: the version they hold; ``None`` (unknown, torn): every delta is answered
            with a vote for the whole version.
        digests: their digests, kept by the owner across syncs.
        apply: write the delta during the receive, before the commit vote (in place); ``False``
            keeps it proven but unwritten in :attr:`pending` (staged: the apply is the install).
    """

    served: Mapping[str, torch.Tensor]
    version: int | None
    digests: DigestCache
    apply: bool = True
    pending: ReceivedDelta | None = None
    """After a receive with ``apply=False``: the proven delta, to :meth:`ReceivedDelta.apply`."""
    received: EncodedDelta | None = None
    """After a delta receive: what arrived, so that an R2R source can pass it on."""

    def refusal(self, header: DeltaHeader, version: int) -> DeltaError | None:
        """Why these targets cannot take the delta at all (a tensor they do not serve, or of
        another shape or dtype): a refusal, not a vote for the whole version."""
        problems = []
        for entry in header.entries:
            target = self.served.get(entry.name)
            if target is None:
                problems.append(f"{entry.name!r} is not served here")
            elif tuple(target.shape) != entry.shape or target.dtype != entry.dtype:
                problems.append(
                    f"{entry.name!r}: a delta for {list(entry.shape)} {entry.dtype}, served "
                    f"{list(target.shape)} {target.dtype}"
                )
        if problems:
            return DeltaError(
                f"delta of version {version} on version {header.base_version}: "
                + "; ".join(problems[:5])
            )
        return None

    def takes_base(self, header: DeltaHeader) -> bool:
        """Whether the targets hold the delta's base version: its number, and the bits of
        every tensor the delta writes (their digests, cached per version: a whole read only
        the first time after a whole sync), so a replica whose bytes differ under the same
        number (never synced, restored from elsewhere) asks for the whole version instead of
        failing the proof."""
        if self.version is None or self.version != header.base_version:
            return False
        return all(
            entry.name in self.served
            and self.digests.get(entry.name, self.served[entry.name], self.version)
            == entry.base_digest
            for entry in header.entries
        )


@dataclass
class ReceivedDelta:
    """A delta that arrived whole: parsed and checked against its targets (nothing written),
    then proven, applied and, if need be, restored."""

    version: int
    header: DeltaHeader
    changes: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Each tensor's changed flat positions and the bits of their new values (checked)."""
    targets: Mapping[str, torch.Tensor]
    digests: dict[str, tuple[int, int]]
    """The new version's digest of each tensor, proven from the changed elements."""
    nbytes: int
    """The packed bytes it came as (what a staged delta stages)."""
    undo: list[Overwritten] = field(default_factory=list)

    @classmethod
    def check(
        cls,
        version: int,
        header: DeltaHeader,
        packed: Mapping[str, torch.Tensor],
        target: DeltaTarget,
    ) -> ReceivedDelta:
        """Parse every packed delta and check it against its target, then prove the result
        equals the sender's new version: each tensor's cached digest, moved by the old and new
        values at the changed positions, must be the header's. Nothing is written.

        Raises:
            DeltaError: a packed delta is malformed or truncated, names positions out of range,
                unsorted or repeated, or the proof fails (named: the tensor, the block).
        """
        assert target.version is not None
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        digests: dict[str, tuple[int, int]] = {}
        nbytes = 0
        for entry in header.entries:
            served = target.served[entry.name]
            data = packed[entry.name].to(served.device)
            delta = unpack_delta(data, numel=entry.numel, dtype=entry.dtype, name=entry.name)
            check_delta(delta, served, name=entry.name)
            positions, new_bits = delta_changes(delta)
            before = target.digests.get(entry.name, served, target.version)
            after = updated_digest(before, positions, bits_of(served)[positions], new_bits)
            if after != entry.digest:
                raise DeltaError(
                    f"{entry.name}: the delta of version {version} applied to version "
                    f"{header.base_version} here would not equal the sender's version {version} "
                    f"(digest {after} against {entry.digest})"
                )
            changes[entry.name], digests[entry.name] = (positions, new_bits), after
            nbytes += data.numel()
        return cls(version, header, changes, target.served, digests, nbytes)

    def apply(self, cache: DigestCache) -> int:
        """Write every delta into its target (checked and proven already); the tensors written.
        Their digests move to the new version in ``cache``. On an error part-way, what was
        written is restored before it is raised (:attr:`undo` is then empty; were the restore
        itself to fail, what it could not put back stays in :attr:`undo`)."""
        try:
            for name, (positions, new_bits) in self.changes.items():
                # Listed before the write: a write that fails part-way is put back too.
                apply_changes(self.targets[name], positions, new_bits, undo=self.undo)
        except BaseException:
            self.restore()
            raise
        for name, digest in self.digests.items():
            cache.put(name, self.version, digest)
        return len(self.changes)

    def apply_to(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the new version's changes into other copies of the base (a staging copy)."""
        for name, (positions, new_bits) in self.changes.items():
            apply_changes(tensors[name], positions, new_bits)

    def restore(self) -> None:
        """Put back every element :meth:`apply` overwrote, bit for bit."""
        while self.undo:
            self.undo[-1].restore()
            self.undo.pop()  # only once it is back: what could not be stays listed


class MadeOnFirstUse(Mapping[str, torch.Tensor]):
    """Tensors made by ``make`` on first use: a delta's version whole, which only a receiver
    that asks for the whole version needs (an R2R source holding the delta pending)."""

    def __init__(self, make: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._make = make
        self._made: Mapping[str, torch.Tensor] | None = None

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        if self._made is None:
            self._made = self._make()
        return self._made

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors())

    def __len__(self) -> int:
        return len(self._tensors())
