"""A :class:`~rollout_sync.transfer.WeightTransfer`'s send in steps (:class:`StepwiseSend`):
each bucket packed and broadcast when its caller says its tensors hold the version, then the
commit vote and a two-phase verdict."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ..errors import WeightTransferError
from ._pipeline import _InFlight, void_checksum
from ._receiving import DECISION_COMMIT, DECISION_DISCARD
from .config import TransferStats
from .delta_sync import SyncKind
from .manifest import WeightManifest, bucket_checksum

if TYPE_CHECKING:
    from .weight_transfer import WeightTransfer

__all__ = ["StepwiseSend"]


class StepwiseSend:
    """One version's send from a :class:`WeightTransfer`'s source, a bucket at a time
    (:meth:`WeightTransfer.begin_send`; the manifest is already voted on).

    Bucket ``k`` is packed (or taken straight from flat ``storage``) and broadcast when
    :meth:`launch` is called; packing bucket ``k`` overlaps the broadcast of ``k - 1``: two
    staging buffers alternate, each reused only once its previous broadcast completed. Not
    thread-safe; methods in order: every bucket launched (or void), :meth:`vote`, then, for a
    two-phase manifest, :meth:`decide`.
    """

    def __init__(
        self,
        transfer: WeightTransfer,
        manifest: WeightManifest,
        weights: Mapping[str, torch.Tensor],
        storage: torch.Tensor | None,
        op: str,
        version: int,
    ) -> None:
        self.transfer = transfer
        self.manifest = manifest
        self.weights = weights
        self.op = op
        self.version = version
        self.spans = transfer._bucket_spans(manifest, weights, storage, receiving=False)
        self.buffers = transfer._bucket_buffers(manifest, self.spans, 2)
        self.views = transfer._bucket_views(manifest, self.buffers, self.spans)
        self.in_flight = _InFlight(transfer._link(), op, manifest.num_buckets, version)
        self.checksums: list[torch.Tensor] = []
        self.launched = 0
        self.voted_yes: bool | None = None
        self.sync_kind = SyncKind.WHOLE.value
        """``"delta"`` when the buckets carry a delta (the manifest's
        :attr:`~rollout_sync.transfer.WeightManifest.delta`)."""
        self.whole_reason: str | None = None
        self.full_nbytes: int | None = None

    @property
    def num_buckets(self) -> int:
        return self.manifest.num_buckets

    def bucket_names(self, k: int) -> tuple[str, ...]:
        """The names of the tensors bucket ``k`` carries."""
        return tuple(e.name for e in self.manifest.buckets[k])

    def launch(self, k: int) -> None:
        """Pack bucket ``k`` from the weights (they must hold the version now) and start its
        broadcast (its checksum's too)."""
        self._check_order(k)
        try:
            self._pack_and_launch(k)
        except WeightTransferError:
            raise
        except Exception:
            # Packing failed here: bucket k still goes out (void), so the receivers reach the
            # commit vote, where this source says no, instead of their limit.
            self._launch_zeros(k)
            raise

    def _pack_and_launch(self, k: int) -> None:
        flat = self.spans[k]
        with torch.no_grad():
            if flat is None:
                # The staging buffer of bucket k last held bucket k - len(buffers).
                self.in_flight.finish_through(k - len(self.buffers))
                flat = self.buffers[k % len(self.buffers)][: self.manifest.bucket_nbytes[k]]
                for lo, hi in self.manifest.padding[k]:
                    # Padding gets zeros, so equal weights give equal buckets (and checksums)
                    # whatever the buffer held before.
                    flat[lo:hi].zero_()
                torch._foreach_copy_(
                    self.views[k], [self.weights[e.name] for e in self.manifest.buckets[k]]
                )
            checksum = bucket_checksum(flat) if self.manifest.checksums else None
        hooks = self.transfer.hooks
        if hooks.after_pack is not None:
            hooks.after_pack(k, flat)
        self.in_flight.launch(flat, k)
        if checksum is not None:
            self.checksums.append(checksum)
            self.in_flight.launch(checksum, k, "checksum")

    def launch_void(self, k: int) -> None:
        """Broadcast zeros for bucket ``k`` (its tensors will never hold the version: the
        relay's own receive failed), so the receivers reach the commit vote, where this source
        says no, instead of waiting out their limit."""
        self._check_order(k)
        self._launch_zeros(k)

    def _launch_zeros(self, k: int) -> None:
        self.in_flight.finish_through(k - len(self.buffers))
        device = self.transfer.device
        flat = torch.zeros(self.manifest.bucket_nbytes[k], dtype=torch.uint8, device=device)
        self.in_flight.launch(flat, k)
        if self.manifest.checksums:
            self.in_flight.launch(void_checksum(device), k, "checksum")

    def vote(self, *, ok: bool) -> list[int]:
        """Finish every broadcast, then the commit vote (this source's ``ok``); the ranks that
        said no. With a two-phase manifest this is its first phase: call :meth:`decide` after
        it whenever ``ok`` was true (the receivers wait for the verdict)."""
        if self.launched != self.num_buckets:
            raise RuntimeError(
                f"{self.op}: {self.launched} of {self.num_buckets} buckets launched before the "
                "commit vote"
            )
        self.in_flight.finish_all()
        self.voted_yes = ok
        return self.transfer._vote_ranks(
            ok=ok, op=f"{self.op}: commit vote", version=self.version, written=0
        )

    def decide(self, *, commit: bool) -> None:
        """Broadcast the verdict of a two-phase manifest: whether the version commits
        everywhere. Only after a :meth:`vote` of ``ok=True`` (after a no the receivers already
        know and wait for nothing)."""
        if not self.manifest.decision or not self.voted_yes:
            raise RuntimeError(f"{self.op}: a verdict follows a two-phase manifest's yes vote")
        transfer = self.transfer
        word = DECISION_COMMIT if commit else DECISION_DISCARD
        verdict = torch.tensor([word], dtype=torch.int64, device=transfer.device)
        transfer._collective(
            lambda: transfer.collectives.broadcast(verdict, transfer.src),
            f"{self.op}: verdict",
            version=self.version,
            written=0,
        )

    def stats(self, start: float, manifest_done: float) -> TransferStats:
        end = time.perf_counter()
        manifest = self.manifest
        checksums = [(int(c[0]), int(c[1])) for c in self.checksums]
        return TransferStats.build(
            role="send",
            version=self.version,
            tensors=len(manifest.entries),
            buckets=manifest.num_buckets,
            nbytes=manifest.nbytes,
            manifest_s=manifest_done - start,
            transfer_s=end - manifest_done,
            total_s=end - start,
            bucket_checksums=tuple(checksums) if checksums else None,
            layout=manifest.layout,
            zero_copy_buckets=sum(span is not None for span in self.spans),
            sync_kind=self.sync_kind,
            whole_reason=self.whole_reason,
            full_nbytes=self.full_nbytes,
        )

    def _check_order(self, k: int) -> None:
        if k != self.launched:
            raise RuntimeError(f"{self.op}: bucket {k} launched out of order ({self.launched})")
        self.launched += 1
