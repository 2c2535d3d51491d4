"""A :class:`~rollout_sync.transfer.WeightTransfer`'s bucket memory: which buckets are already
their bytes in memory (zero-copy spans of a tensor or of declared flat storage), the staging
buffers the others pass through, and typed views of their entries, kept per layout."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .config import TransferConfig
from .manifest import WeightManifest

__all__ = ["BucketBuffers"]


class BucketBuffers:
    """Zero-copy spans, staging buffers and views of a transfer's buckets (a part of
    :class:`~rollout_sync.transfer.WeightTransfer`, which sets these fields)."""

    config: TransferConfig
    device: torch.device
    _buffers: list[torch.Tensor]
    """The staging buffers, made on first use, grown when a bucket needs more."""
    _views: tuple[object, list[list[torch.Tensor]]] | None
    """The views of the last layout and buffers (:meth:`_bucket_views`)."""
    _spans: tuple[object, tuple[torch.Tensor | None, ...]] | None
    """The zero-copy spans of the last layout and tensors (:meth:`_bucket_spans`)."""

    def _check_storage(self, storage: torch.Tensor | None) -> None:
        if storage is None:
            return
        if (
            storage.dim() != 1
            or storage.dtype != torch.uint8
            or not storage.is_contiguous()
            or storage.device != self.device
        ):
            raise ValueError(
                f"storage must be a contiguous 1-D uint8 tensor on {self.device} (see "
                f"rollout_sync.flat.FlatWeights), got {storage.dtype} of shape "
                f"{list(storage.shape)} on {storage.device}"
            )

    def _bucket_spans(
        self,
        manifest: WeightManifest,
        tensors: Mapping[str, torch.Tensor],
        storage: torch.Tensor | None,
        *,
        receiving: bool,
    ) -> tuple[torch.Tensor | None, ...]:
        """Per bucket, the bytes it already is in memory (zero-copy), or ``None`` (staged).

        A bucket is its bytes when it is exactly one contiguous tensor, or when its tensors lie
        in ``storage`` exactly at the bucket's offsets from one base. A receive that verifies
        checksums before writing stages every bucket.
        """
        n = manifest.num_buckets
        if not self.config.zero_copy or (
            receiving and manifest.checksums and self.config.verify_before_write
        ):
            return (None,) * n
        key = (
            manifest,
            None if storage is None else (storage.data_ptr(), storage.numel()),
            tuple(tensors[e.name].data_ptr() for e in manifest.entries),
        )
        cached = self._spans
        if cached is not None and cached[0] == key:
            return cached[1]
        spans = tuple(self._bucket_span(manifest, k, tensors, storage) for k in range(n))
        self._spans = (key, spans)
        return spans

    def _bucket_span(
        self,
        manifest: WeightManifest,
        k: int,
        tensors: Mapping[str, torch.Tensor],
        storage: torch.Tensor | None,
    ) -> torch.Tensor | None:
        entries = manifest.buckets[k]
        size = manifest.bucket_nbytes[k]
        first = tensors[entries[0].name]
        if first.device != self.device or not first.is_contiguous():
            return None
        if len(entries) == 1 and entries[0].nbytes == size:
            return first.detach().reshape(-1).view(torch.uint8)
        if storage is None:
            return None
        base = storage.data_ptr()
        start = first.data_ptr() - base - entries[0].offset
        if start < 0 or start + size > storage.numel():
            return None
        for e in entries:
            tensor = tensors[e.name]
            if tensor.data_ptr() - base != start + e.offset or not tensor.is_contiguous():
                return None
        return storage[start : start + size]

    def _bucket_buffers(
        self, manifest: WeightManifest, spans: tuple[torch.Tensor | None, ...], count: int
    ) -> list[torch.Tensor]:
        """``count`` staging buffers big enough for the largest staged bucket (fewer when
        there are fewer buckets; none when every bucket is zero-copy)."""
        staged = [manifest.bucket_nbytes[k] for k, span in enumerate(spans) if span is None]
        if not staged:
            return []
        need = max(staged)
        count = min(count, manifest.num_buckets)
        if (
            len(self._buffers) < count
            or self._buffers[0].numel() < need
            or self._buffers[0].device != self.device
        ):
            self._buffers = [
                torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(count)
            ]
        return self._buffers[:count]

    def _bucket_views(
        self,
        manifest: WeightManifest,
        buffers: list[torch.Tensor],
        spans: tuple[torch.Tensor | None, ...],
    ) -> list[list[torch.Tensor]]:
        """Typed, shaped views of every entry of a staged bucket in its buffer (kept per
        layout); empty for zero-copy buckets."""
        key = (manifest, tuple(b.data_ptr() for b in buffers), tuple(s is None for s in spans))
        cached = self._views
        if cached is not None and cached[0] == key:
            return cached[1]
        views = [
            [
                buffers[k % len(buffers)][e.offset : e.offset + e.nbytes]
                .view(e.dtype)
                .view(e.shape)
                for e in entries
            ]
            if spans[k] is None
            else []
            for k, entries in enumerate(manifest.buckets)
        ]
        self._views = (key, views)
        return views
