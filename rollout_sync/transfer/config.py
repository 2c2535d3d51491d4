"""What a caller chooses for a weight transfer, and what it gets back.

:class:`TransferConfig` (bucket size, checksums, collective timeout, zero-copy) and
:class:`TransferHooks` (fault injection for tests) go into a
:class:`~rollout_sync.transfer.WeightTransfer`; every send and receive returns a
:class:`TransferStats`. :data:`BUFFER_WRITE` names the span kind of a write into an async-mode
weight buffer, which generation may legitimately overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..flat import ALIGN_BYTES
from ..trace import SpanKind

__all__ = ["BUFFER_WRITE", "TransferConfig", "TransferHooks", "TransferStats"]

BUFFER_WRITE = SpanKind.WEIGHT_BUFFER_WRITE
"""Span kind of a write into an async-mode weight buffer (not a served tensor)."""


@dataclass(frozen=True)
class TransferConfig:
    """How a :class:`WeightTransfer` moves bytes."""

    bucket_bytes: int = 32 << 20
    """Target size of one flat bucket; a larger tensor gets a bucket of its own."""
    checksums: bool = False
    """Send a checksum after every bucket and verify it on every receiver."""
    timeout_s: float = 60.0
    """Limit of each collective (manifest, each bucket, each vote)."""
    zero_copy: bool = True
    """Send from, and receive into, buckets whose bytes already lie contiguously (one tensor,
    or a span of declared flat storage) instead of staging them. ``False`` stages every bucket
    (for comparison)."""
    verify_before_write: bool = True
    """With checksums, stage every received bucket and verify it before any target is written.
    ``False`` lets zero-copy buckets land in the targets first and be verified after: no
    staging copy, but a bad bucket leaves the targets torn (they are marked so, never
    served). Ignored without checksums (nothing to verify)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < ALIGN_BYTES:
            raise ValueError(f"bucket_bytes must be >= {ALIGN_BYTES}, got {self.bucket_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")


@dataclass
class TransferHooks:
    """Fault-injection points for tests (corrupt a bucket, kill a peer mid-transfer).

    ``after_pack(bucket_index, flat)`` runs on the source after a bucket is packed and
    checksummed, before it is sent; ``after_receive(bucket_index, flat)`` on a receiver (and a
    relay) after a bucket arrived, before it is verified, forwarded and unpacked. Both fire for
    every bucket. For a zero-copy bucket ``flat`` is the tensors' own bytes (on the source, the
    weights being sent; on a receiver, the targets), so a hook that changes it changes them.
    """

    after_pack: Callable[[int, torch.Tensor], None] | None = None
    after_receive: Callable[[int, torch.Tensor], None] | None = None


@dataclass(frozen=True)
class TransferStats:
    """What one transfer did on this rank. Times in seconds.

    Build one with :meth:`build`, every field by name: the fields' order is not part of the
    contract (positional construction still works, for code written before :meth:`build`).
    """

    role: str
    """``"send"``, ``"receive"`` or ``"relay"`` (received, and passed on as it arrived)."""
    version: int
    tensors: int
    buckets: int
    nbytes: int
    """Payload bytes (tensor bytes, without padding or checksums)."""
    manifest_s: float
    """Manifest broadcast and validation vote."""
    transfer_s: float
    """Buckets: packing, collectives, unpacking."""
    total_s: float
    tensors_written: int = 0
    checksums_verified: int = 0
    bucket_checksums: tuple[tuple[int, int], ...] | None = None
    """The source's checksums of each bucket, when checksums are on (for R2R's origin check)."""
    layout: str = ""
    """Identifies the bucket layout; checksums are comparable only between equal layouts."""
    zero_copy_buckets: int = 0
    """Buckets sent from, or received into, the tensors' own memory (no staging copy)."""
    sync_kind: str = "whole"
    """``"whole"`` (every tensor's bytes) or ``"delta"`` (packed changes against the version
    the receivers held: :mod:`rollout_sync.transfer.delta_sync`); ``nbytes`` is what moved."""
    whole_reason: str | None = None
    """Why a sync that could have gone by delta went whole (a
    :class:`~rollout_sync.transfer.delta_sync.WholeReason` value); ``None`` otherwise."""
    full_nbytes: int | None = None
    """The bytes of the whole version, for a delta (``nbytes / full_nbytes`` is its ratio)."""

    @classmethod
    def build(
        cls,
        *,
        role: str,
        version: int,
        tensors: int,
        buckets: int,
        nbytes: int,
        manifest_s: float,
        transfer_s: float,
        total_s: float,
        tensors_written: int = 0,
        checksums_verified: int = 0,
        bucket_checksums: tuple[tuple[int, int], ...] | None = None,
        layout: str = "",
        zero_copy_buckets: int = 0,
        sync_kind: str = "whole",
        whole_reason: str | None = None,
        full_nbytes: int | None = None,
    ) -> TransferStats:
        """The stats of one transfer, every field by keyword (the fields, with their defaults)."""
        return cls(
            role=role,
            version=version,
            tensors=tensors,
            buckets=buckets,
            nbytes=nbytes,
            manifest_s=manifest_s,
            transfer_s=transfer_s,
            total_s=total_s,
            tensors_written=tensors_written,
            checksums_verified=checksums_verified,
            bucket_checksums=bucket_checksums,
            layout=layout,
            zero_copy_buckets=zero_copy_buckets,
            sync_kind=sync_kind,
            whole_reason=whole_reason,
            full_nbytes=full_nbytes,
        )

    @property
    def mb_per_s(self) -> float:
        """Payload megabytes (1e6 bytes) per second over the whole transfer."""
        return self.nbytes / 1e6 / self.total_s if self.total_s > 0 else float("nan")
