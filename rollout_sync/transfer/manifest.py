"""What a weight version is made of: its manifest, its buckets and their checksums.

A transfer lays the tensors it sends out into flat byte buckets. The :class:`WeightManifest`
describes that layout (every tensor's name, shape, dtype, bucket and byte offset, whether the
sync is full or a subset, and whether buckets carry checksums) and is what a receiver checks
before the first byte of a weight is written. It encodes to the same bytes for an unchanged
layout, so both sides cache it. :func:`bucket_checksum` is the per-bucket checksum (and
:class:`OriginChecksums` the original sender's, carried through an R2R); :func:`named_weights`
picks the tensors a transfer sends.

Nothing here touches a process group.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import ManifestError
from ..flat import ALIGN_BYTES, aligned
from ..weights import WeightSpec
from .delta_sync import DeltaHeader

__all__ = [
    "ManifestEntry",
    "OriginChecksums",
    "WeightManifest",
    "bucket_checksum",
    "named_weights",
]

_MANIFEST_FORMAT = 3
"""3: checksums over 64-bit words (2: over 32-bit words; both: a broadcast of their own after
each bucket; 1: appended to it)."""


# -- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestEntry:
    """Where one tensor lies in the transfer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    """Bytes from the start of its bucket (a multiple of :data:`ALIGN_BYTES`)."""
    nbytes: int

    @property
    def spec(self) -> WeightSpec:
        return WeightSpec(self.name, self.shape, self.dtype)


def _dtype_from_name(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ManifestError(f"manifest names an unknown dtype {name!r}")
    return found


@dataclass(frozen=True)
class WeightManifest:
    """Everything a receiver checks before the first byte of a weight is written.

    The manifest describes the layout; the weight version travels next to it, in the header,
    so that an unchanged layout encodes to the same bytes every sync (and both sides cache it).
    """

    entries: tuple[ManifestEntry, ...]
    bucket_nbytes: tuple[int, ...]
    """Bytes of each bucket's tensor area (padded), without the checksum tail."""
    require_all: bool
    """A full sync (every served weight is sent) rather than a subset."""
    checksums: bool
    origin: OriginChecksums | None = None
    """The original sender's per-bucket checksums, when an R2R forwards them."""
    decision: bool = False
    """Two-phase: after the commit vote, the source broadcasts whether the version commits
    everywhere (its own verdict, over more ranks than this group: a pipelined sharded relay's,
    :class:`~rollout_sync.transfer.ShardedTransfer`), and every receiver waits for it."""
    delta: DeltaHeader | None = None
    """A delta sync: the entries are packed deltas (``uint8``) of the tensors the header
    names, to apply to its base version (:mod:`rollout_sync.transfer.delta_sync`)."""
    whole_reason: str | None = None
    """Why a source with deltas on sends this version whole (a
    :class:`~rollout_sync.transfer.delta_sync.WholeReason` value), for every side's report."""

    @classmethod
    def build(
        cls,
        weights: Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int,
        require_all: bool = True,
        checksums: bool = False,
        origin: OriginChecksums | None = None,
        decision: bool = False,
        delta: DeltaHeader | None = None,
        whole_reason: str | None = None,
    ) -> WeightManifest:
        """Lay ``weights`` out into buckets, in mapping order.

        ``origin`` is kept only if its layout is this manifest's (checksums of other buckets
        compare nothing). ``decision``, ``delta``, ``whole_reason``: see those attributes.

        Raises:
            ManifestError: no weights, or a tensor that is not dense (sparse, quantized).
        """
        if not weights:
            raise ManifestError("a weight transfer needs at least one tensor")
        entries: list[ManifestEntry] = []
        sizes: list[int] = []
        bucket, offset = 0, 0
        for name, tensor in weights.items():
            if tensor.layout is not torch.strided:
                raise ManifestError(
                    f"{name}: only dense (strided) tensors can be transferred, "
                    f"got layout {tensor.layout}"
                )
            nbytes = tensor.numel() * tensor.element_size()
            start = aligned(offset)
            if start + nbytes > bucket_bytes and offset > 0:
                sizes.append(aligned(offset))
                bucket, start = bucket + 1, 0
            entries.append(
                ManifestEntry(name, tuple(tensor.shape), tensor.dtype, bucket, start, nbytes)
            )
            offset = start + nbytes
        sizes.append(max(aligned(offset), ALIGN_BYTES))
        parts = (tuple(entries), tuple(sizes), require_all, checksums)
        manifest = cls(*parts, None, decision, delta, whole_reason)
        if origin is not None and origin.layout == manifest.layout:
            manifest = cls(*parts, origin, decision, delta, whole_reason)
        return manifest

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_nbytes)

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @functools.cached_property
    def layout(self) -> str:
        """A key equal for two manifests exactly when their bucket bytes are comparable."""
        digest = hashlib.sha1(usedforsecurity=False)
        for e in self.entries:
            digest.update(f"{e.name}:{list(e.shape)}:{e.dtype}:{e.bucket}:{e.offset}|".encode())
        digest.update(repr(self.bucket_nbytes).encode())
        return f"{digest.hexdigest()[:16]}/{len(self.entries)}"

    @functools.cached_property
    def specs(self) -> tuple[WeightSpec, ...]:
        """What each entry would write, for :func:`~rollout_sync.weights.check_weights_match`."""
        return tuple(e.spec for e in self.entries)

    @functools.cached_property
    def buckets(self) -> tuple[tuple[ManifestEntry, ...], ...]:
        """The entries of each bucket, in order."""
        out: list[list[ManifestEntry]] = [[] for _ in self.bucket_nbytes]
        for e in self.entries:
            out[e.bucket].append(e)
        return tuple(tuple(b) for b in out)

    @functools.cached_property
    def padding(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Byte ranges of each bucket that no tensor covers (alignment gaps, the end)."""
        out: list[tuple[tuple[int, int], ...]] = []
        for k, entries in enumerate(self.buckets):
            gaps: list[tuple[int, int]] = []
            end = 0
            for e in entries:
                if e.offset > end:
                    gaps.append((end, e.offset))
                end = e.offset + e.nbytes
            if self.bucket_nbytes[k] > end:
                gaps.append((end, self.bucket_nbytes[k]))
            out.append(tuple(gaps))
        return tuple(out)

    def to_bytes(self) -> bytes:
        doc = {
            "format": _MANIFEST_FORMAT,
            "require_all": self.require_all,
            "checksums": self.checksums,
            "bucket_nbytes": list(self.bucket_nbytes),
            "entries": [
                [e.name, list(e.shape), str(e.dtype), e.bucket, e.offset, e.nbytes]
                for e in self.entries
            ],
            "origin": None
            if self.origin is None
            else {
                "version": self.origin.version,
                "layout": self.origin.layout,
                "checksums": [list(c) for c in self.origin.checksums],
            },
        }
        if self.decision:  # absent otherwise: a one-phase manifest's bytes are as they were
            doc["decision"] = True
        if self.delta is not None:  # likewise: a whole sync's manifest is as it was
            doc["delta"] = self.delta.to_doc()
        if self.whole_reason is not None:
            doc["whole_reason"] = self.whole_reason
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightManifest:
        """Decode and sanity-check a manifest (offsets inside buckets, sizes consistent).

        Raises:
            ManifestError: it is not a manifest this version of rollout_sync understands.
        """
        try:
            doc = json.loads(data.decode())
            if doc.get("format") != _MANIFEST_FORMAT:
                raise ManifestError(
                    f"manifest format {doc.get('format')!r} is not "
                    f"{_MANIFEST_FORMAT}; are both sides the same version?"
                )
            entries = tuple(
                ManifestEntry(
                    str(name),
                    tuple(int(d) for d in shape),
                    _dtype_from_name(dtype),
                    int(bucket),
                    int(offset),
                    int(nbytes),
                )
                for name, shape, dtype, bucket, offset, nbytes in doc["entries"]
            )
            origin_doc = doc.get("origin")
            origin = (
                None
                if origin_doc is None
                else OriginChecksums(
                    int(origin_doc["version"]),
                    str(origin_doc["layout"]),
                    tuple((int(a), int(b)) for a, b in origin_doc["checksums"]),
                )
            )
            manifest = cls(
                entries,
                tuple(int(n) for n in doc["bucket_nbytes"]),
                bool(doc["require_all"]),
                bool(doc["checksums"]),
                origin,
                bool(doc.get("decision", False)),
                None if doc.get("delta") is None else DeltaHeader.from_doc(doc["delta"]),
                None if doc.get("whole_reason") is None else str(doc["whole_reason"]),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"undecodable weight manifest: {exc}") from exc
        manifest._check_layout()
        return manifest

    def _check_layout(self) -> None:
        if not self.entries or not self.bucket_nbytes:
            raise ManifestError("manifest lists no tensors")
        if self.origin is not None and len(self.origin.checksums) != len(self.bucket_nbytes):
            raise ManifestError("manifest origin checksums do not match its buckets")
        if self.delta is not None:
            carried = [(e.name, e.dtype, len(e.shape)) for e in self.entries]
            named = [(e.name, torch.uint8, 1) for e in self.delta.entries]
            if carried != named:
                raise ManifestError(
                    "a delta manifest must carry one packed delta (1-D uint8) for each tensor "
                    "its header names, in order"
                )
        sizes: dict[torch.dtype, int] = {}
        for e in self.entries:
            elem = sizes.get(e.dtype)
            if elem is None:
                elem = sizes[e.dtype] = torch.empty((), dtype=e.dtype).element_size()
            numel = 1
            for d in e.shape:
                numel *= d
            if not 0 <= e.bucket < len(self.bucket_nbytes):
                raise ManifestError(f"{e.name}: bucket {e.bucket} out of range")
            if (
                e.offset % ALIGN_BYTES
                or e.offset < 0
                or e.nbytes != numel * elem
                or e.offset + e.nbytes > self.bucket_nbytes[e.bucket]
            ):
                raise ManifestError(
                    f"{e.name}: inconsistent layout (offset {e.offset}, "
                    f"{e.nbytes} bytes, bucket of {self.bucket_nbytes[e.bucket]})"
                )


# -- checksums ---------------------------------------------------------------------------------


_CHECKSUM_COLS = 1024
_CHECKSUM_PRIME = 2_147_483_629


@dataclass(frozen=True)
class OriginChecksums:
    """Checksums the original sender computed for a version, to carry through an R2R."""

    version: int
    layout: str
    checksums: tuple[tuple[int, int], ...]


def bucket_checksum(data: torch.Tensor) -> torch.Tensor:
    """A position-sensitive checksum of a flat ``uint8`` buffer, as two int64 values.

    Computed on the buffer's device without a host sync, in two passes of native 64-bit sums
    (an order of magnitude faster than widening 32-bit words; sums wrap around, the same way on
    every rank): the plain sum of its 64-bit words, and a sum weighted by row and column of
    those words laid out in rows of 1024 (each term reduced modulo a prime). Bytes past the
    last whole row are summed as 32-bit words, weighted by position. Catches flipped bits and
    moved words; not cryptographic. ``data.numel()`` must be a multiple of 4.
    """
    n = data.numel()
    row_bytes = _CHECKSUM_COLS * 8
    rows = n // row_bytes
    main = data[: rows * row_bytes].view(torch.int64).view(rows, _CHECKSUM_COLS)
    tail = data[rows * row_bytes :].view(torch.int32)
    device = data.device
    col_sum = main.sum(0)
    row_sum = main.sum(1)
    col_w = torch.arange(1, _CHECKSUM_COLS + 1, dtype=torch.int64, device=device)
    row_w = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    tail_w = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=device)
    plain = col_sum.sum() + tail.sum(dtype=torch.int64)
    # Every product is of two terms below 2**31, so no weighted sum can overflow int64 for any
    # bucket up to 2**32 rows.
    p = _CHECKSUM_PRIME
    weighted = (
        ((col_sum.remainder(p) * col_w).remainder(p)).sum()
        + ((row_sum.remainder(p) * row_w.remainder(p)).remainder(p)).sum()
        + ((tail.to(torch.int64).remainder(p) * tail_w).remainder(p)).sum() * 7
    )
    return torch.stack([plain, weighted])


# -- picking what to send ----------------------------------------------------------------------


def named_weights(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    trainable_only: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors a transfer sends, by name.

    For a module: every parameter and persistent buffer (its ``state_dict`` names), or with
    ``trainable_only`` only the parameters that require grad. For a mapping: the mapping itself
    (``trainable_only`` keeps the tensors that require grad). Tensors are detached views; nothing
    is copied.
    """
    if isinstance(source, torch.nn.Module):
        if trainable_only:
            return {n: p.detach() for n, p in source.named_parameters() if p.requires_grad}
        return {n: t.detach() for n, t in source.state_dict(keep_vars=True).items()}
    if trainable_only:
        return {n: t.detach() for n, t in source.items() if t.requires_grad}
    return {n: t.detach() for n, t in source.items()}
