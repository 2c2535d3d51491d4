"""Flat weight storage: named tensors laid out in one byte buffer, the way a transfer's buckets are.

A :class:`~rollout_sync.WeightTransfer` packs tensors into buckets in mapping order, each tensor
at a multiple of :data:`ALIGN_BYTES` from the start of its bucket. Weights that already lie in
one flat buffer with that same alignment, in the same order, *are* their buckets: a bucket is a
contiguous span of the buffer, which the transfer sends from and receives into directly, without
a staging copy (``storage=`` of :meth:`~rollout_sync.WeightTransfer.send`,
:meth:`~rollout_sync.WeightTransfer.receive` and :meth:`~rollout_sync.WeightTransfer.relay`).

:class:`FlatWeights` builds such a buffer. A backend opts in by keeping its served weights in
one (:meth:`FlatWeights.adopt` moves existing tensors, module parameters included, into it) and
returning it from :meth:`~rollout_sync.RolloutBase.flat_weight_storage`. The bytes between
tensors are padding that belongs to the buffer: a zero-copy receive overwrites them, which is
why the storage must be declared and is never guessed from tensor addresses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ALIGN_BYTES", "FlatWeights", "aligned"]

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this in its bucket (and in flat storage), so a byte slice
views as any dtype."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class FlatWeights:
    """Named tensors that are views into one flat ``uint8`` buffer, in mapping order.

    Attributes:
        storage: the buffer (1-D, ``uint8``, contiguous); its length is a multiple of
            :data:`ALIGN_BYTES`. Padding bytes are zero when it is built.
        tensors: the views, by name, in layout order.
    """

    storage: torch.Tensor
    tensors: dict[str, torch.Tensor]

    @staticmethod
    def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], int]:
        """Byte offset of each tensor in flat storage, and the storage's length."""
        offsets: dict[str, int] = {}
        end = 0
        for name, tensor in tensors.items():
            if tensor.layout is not torch.strided:
                raise ValueError(
                    f"{name}: only dense (strided) tensors can be flat, got {tensor.layout}"
                )
            offsets[name] = aligned(end)
            end = offsets[name] + tensor.numel() * tensor.element_size()
        return offsets, max(aligned(end), ALIGN_BYTES)

    @classmethod
    def zeros_like(
        cls, tensors: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None
    ) -> FlatWeights:
        """Zeroed flat storage with a view of each tensor's shape and dtype (nothing copied).

        ``device``: where the storage lives; default the first tensor's device.
        """
        if not tensors:
            raise ValueError("flat storage needs at least one tensor")
        offsets, total = cls.layout(tensors)
        where = torch.device(device) if device is not None else next(iter(tensors.values())).device
        storage = torch.zeros(total, dtype=torch.uint8, device=where)
        views = {
            name: storage[offsets[name] : offsets[name] + t.numel() * t.element_size()]
            .view(t.dtype)
            .view(t.shape)
            for name, t in tensors.items()
        }
        return cls(storage, views)

    @classmethod
    def copy_of(
        cls, tensors: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None
    ) -> FlatWeights:
        """Flat storage holding a copy of ``tensors``."""
        flat = cls.zeros_like(tensors, device=device)
        with torch.no_grad():
            for name, tensor in tensors.items():
                flat.tensors[name].copy_(tensor)
        return flat

    @classmethod
    def adopt(cls, tensors: Mapping[str, torch.Tensor]) -> FlatWeights:
        """Move ``tensors`` into flat storage *in place*: each tensor object (a module's
        ``nn.Parameter`` included) keeps its identity and value but now views the storage.

        A tensor listed under two names (tied weights) is moved once; its second name then is
        not where the layout would put it, so buckets holding it are staged, not zero-copy.
        All tensors must be on one device.
        """
        unique: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in tensors.items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                unique[name] = tensor
        devices = {t.device for t in unique.values()}
        if len(devices) > 1:
            raise ValueError(
                f"flat storage lives on one device; got tensors on {sorted(map(str, devices))}"
            )
        flat = cls.copy_of(unique)
        with torch.no_grad():
            for name, tensor in unique.items():
                tensor.data = flat.tensors[name]
        return cls(flat.storage, dict(tensors))

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie inside :attr:`storage`."""
        start = self.storage.data_ptr()
        ptr = tensor.data_ptr()
        return (
            tensor.device == self.storage.device
            and start <= ptr
            and ptr + tensor.numel() * tensor.element_size() <= start + self.storage.numel()
        )
