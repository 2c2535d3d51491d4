"""Receive buffers a stream lends its loader and gets back only when the caller says so.

:meth:`~rollout_sync.transfer.WeightTransfer.stream` hands every bucket to a loader that may
keep references to the tensors it was given (vLLM's layerwise reload holds them until a layer
is complete), so within one update every bucket needs a buffer of its own. Allocating those
afresh on every update is what made a receive on the host slower than the raw broadcast of
the same bytes: a fresh host buffer is new pages, and the kernel faults and zeroes each one as
the collective first writes it (about 3.5 ms per 8 MiB here, four times the copy itself).

A :class:`ReceiveBuffers` keeps them. Within one update it never lends a buffer twice; the
buffers of an update become available again only when the caller, who knows when its loader
let go of them, calls :meth:`ReceiveBuffers.reclaim` (vLLM: after the reload was finalized,
which copies every layer into the engine's own tensors and drops what it held). ``reclaim``
checks the caller's word where it can: a buffer that any of the ``served`` tensors lies in is
never lent again (it is forgotten and a fresh one made in its place). A caller that cannot say
(a failed or abandoned receive whose thread may still write) calls :meth:`forget`: the lent
buffers are dropped, not reused.

Memory: the buffers of the last update (one copy of what it received) stay allocated between
updates. On CUDA the caching allocator already reuses freed blocks without new pages, so the
engine keeps a pool on the host only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["ReceiveBuffers"]


class ReceiveBuffers:
    """A pool of flat ``uint8`` receive buffers on one device; see the module. Thread-safe."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._free: list[torch.Tensor] = []
        """Buffers no loader holds (reclaimed), smallest first."""
        self._lent: list[torch.Tensor] = []
        """Buffers lent since the last reclaim (or forget), whole."""
        self._lock = threading.Lock()
        self.reused = 0
        """Buffers lent again (a count over the pool's life; what a test or a benchmark reads)."""
        self.allocated = 0
        """Buffers made (ditto)."""
        self.refused = 0
        """Buffers never lent again because a served tensor lay in them at a reclaim."""

    def lend(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` bytes, not lent to anyone since the last
        :meth:`reclaim` (a reclaimed one that is large enough, else a new one)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    del self._free[i]
                    self._lent.append(buffer)
                    self.reused += 1
                    return buffer[:nbytes]
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._lent.append(buffer)
            self.allocated += 1
            return buffer

    def reclaim(self, served: Iterable[torch.Tensor] = ()) -> None:
        """The loader holds none of the lent buffers any more (the caller's word): lend them
        again, except any that one of the ``served`` tensors lies in. Once something was lent,
        buffers reclaimed earlier and not lent since are dropped, so the pool holds what the
        last update used; with nothing lent this changes nothing."""
        spans = [_span(t) for t in served]
        with self._lock:
            if not self._lent:
                return
            kept = []
            for buffer in self._lent:
                lo, hi = _span(buffer)
                if any(s_lo < hi and lo < s_hi for s_lo, s_hi in spans):
                    self.refused += 1  # something serves from it: never write it again
                else:
                    kept.append(buffer)
            self._free = sorted(kept, key=lambda b: b.numel())
            self._lent = []

    def forget(self) -> None:
        """Drop the lent buffers without reusing them (someone may still hold or write one)."""
        with self._lock:
            self._lent = []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (lent and free)."""
        with self._lock:
            return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range of ``tensor``'s whole storage (a view anywhere in a buffer overlaps it)."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()
