"""Buckets in flight: the collective queue a transfer pipelines through, and the relay's hop.

Both ends of a transfer keep two buckets in flight (the source packs bucket ``k + 1`` while
bucket ``k`` is on the wire, a receiver unpacks ``k`` while ``k + 1`` arrives). ``_InFlight``
is the queue that makes this safe: collectives launched on one transfer's group and waited for
in launch order, each wait bounded by the transfer's timeout and recorded as a
``weight_collective`` span.

**The pipelined relay.** A replica that receives the P2R and is the R2R source passes bucket
``k`` on to the R2R group while bucket ``k + 1`` arrives, bytes and checksums exactly as
received, so the two hops overlap. ``_Forward`` is that second hop; it runs inside
:meth:`~rollout_sync.transfer.WeightTransfer.relay`, driven by the relay's receive.

Both are private. What they need of the transfer that drives them is a :class:`_Link`: its
group and source, and its bounded wait and vote passed in as callables, so this module neither
imports :class:`~rollout_sync.transfer.WeightTransfer` nor reaches into its private members.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..errors import WeightTransferError
from ..trace import SpanKind, Timeline
from .manifest import WeightManifest


def void_checksum(device: torch.device) -> torch.Tensor:
    """The checksum sent with a void bucket: one no bucket has (a bucket's weighted sum is
    never negative), so a receiver that verifies refuses the bucket and writes none of it."""
    return torch.tensor([0, -1], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class _Link:
    """The transfer a pipeline launches its collectives on, and waits and votes through."""

    src: int
    """The rank that broadcasts on :attr:`collectives`."""
    collectives: GroupCollectives
    timeline: Timeline | None
    device: torch.device
    wait: Callable[[dist.Work, str, int | None, int], None]
    """``wait(work, op, version, written)``: wait for one collective within the transfer's
    limit; its typed error (saying ``written``) if it failed or hung."""
    vote_ranks: Callable[[bool, str, int | None], list[int]]
    """``vote_ranks(ok, op, version)``: all-gather an ok flag (nothing written by this rank
    yet); the global ranks that said no."""


@dataclass(frozen=True)
class _Launched:
    work: dist.Work
    bucket: int
    what: str
    start_ns: int


class _InFlight:
    """Collectives launched on one transfer's group, waited for in launch order."""

    def __init__(self, transfer: _Link, op: str, buckets: int, version: int | None):
        self.transfer = transfer
        self.op = op
        self.buckets = buckets
        self.version = version
        self.pending: deque[_Launched] = deque()

    def launch(self, tensor: torch.Tensor, bucket: int, what: str = "bucket") -> None:
        """Start one broadcast (one that cannot start fails at its wait)."""
        start_ns = time.monotonic_ns()
        # A group already broken by a dead peer refuses new work: that fails at the wait.
        work = self.transfer.collectives.broadcast(tensor, self.transfer.src)
        self.pending.append(_Launched(work, bucket, what, start_ns))

    def finish_through(self, bucket: int, written: int = 0) -> None:
        """Wait for every collective of buckets up to ``bucket``, in order."""
        while self.pending and self.pending[0].bucket <= bucket:
            launched = self.pending.popleft()
            name = f"{launched.what} {launched.bucket + 1}/{self.buckets}"
            try:
                self.transfer.wait(launched.work, f"{self.op}: {name}", self.version, written)
            finally:
                if self.transfer.timeline is not None:
                    self.transfer.timeline.add_span(
                        SpanKind.WEIGHT_COLLECTIVE,
                        name,
                        launched.start_ns,
                        src=self.transfer.src,
                        version=self.version,
                    )

    def finish_all(self, written: int = 0) -> None:
        self.finish_through(self.buckets, written)


class _Forward:
    """The relay's second hop: every bucket, once received, broadcast again on the R2R group.

    A failure here (a receiver died, timed out, or rejected) stops the forwarding but not the
    relay's own receive: it is kept in :attr:`error` and reported after the relay committed.
    """

    def __init__(self, transfer: _Link, op: str, manifest: WeightManifest, version: int) -> None:
        self.transfer = transfer
        self.op = op
        self.version = version
        self.manifest = manifest
        self.buckets = manifest.num_buckets
        self.in_flight = _InFlight(transfer, op, self.buckets, version)
        self.error: WeightTransferError | None = None
        self.failed_ranks: list[int] = []
        self.launched = 0

    def launch(self, bucket: int, flat: torch.Tensor, checksum: torch.Tensor | None) -> None:
        self.launched = bucket + 1
        if self.error is not None:
            return
        try:
            self.in_flight.launch(flat, bucket)
            if checksum is not None:
                self.in_flight.launch(checksum, bucket, "checksum")
        except WeightTransferError as exc:
            self._fail(exc)

    def finish_through(self, bucket: int) -> None:
        if self.error is None:
            try:
                self.in_flight.finish_through(bucket)
            except WeightTransferError as exc:
                self._fail(exc)

    def fill(self) -> None:
        """The relay's source failed: send zeros for the buckets not passed on yet, so the
        receivers reach the commit vote, where the relay says no, instead of waiting out the
        timeout."""
        if self.error is not None or self.launched >= self.buckets:
            return
        device = self.transfer.device
        zeros = torch.zeros(max(self.manifest.bucket_nbytes), dtype=torch.uint8, device=device)
        checksum = void_checksum(device)
        for k in range(self.launched, self.buckets):
            flat = zeros[: self.manifest.bucket_nbytes[k]]
            self.launch(k, flat, checksum if self.manifest.checksums else None)

    def close(self, *, ok: bool) -> None:
        """Finish every forward, then the R2R commit vote (this relay's ``ok``)."""
        self.finish_through(self.buckets)
        if self.error is None:
            try:
                self.failed_ranks = self.transfer.vote_ranks(
                    ok, f"{self.op}: commit vote", self.version
                )
            except WeightTransferError as exc:
                self._fail(exc)

    def _fail(self, exc: WeightTransferError) -> None:
        self.error = exc
        self.in_flight.pending.clear()  # a broken group's other works are abandoned, not waited
