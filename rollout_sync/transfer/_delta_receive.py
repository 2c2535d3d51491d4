"""A delta's receive on a :class:`~rollout_sync.transfer.WeightTransfer`: the packed deltas
into buffers of their own, checked and proven before any write, applied in place (or kept
pending, staged), handed rebuilt to a stream's loader, and restored whenever the version does
not land, so a delta never leaves its targets torn."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import DeltaRefused, WeightTransferError
from ._pipeline import _Forward
from ._receiving import Receiving, _Outcome
from .config import BUFFER_WRITE, TransferStats
from .delta_sync import DeltaTarget, EncodedDelta, ReceivedDelta
from .manifest import WeightManifest

__all__ = ["DeltaReceive"]


@dataclass
class _DeltaLoad:
    """A stream's loader, for a delta it rebuilds from its host copy; ``handed`` counts the
    tensors given to ``load`` (what a failure then reports as written)."""

    load: Callable[[list[str], list[torch.Tensor]], None]
    begin: Callable[[WeightManifest], None] | None
    handed: int = 0


class DeltaReceive(Receiving):
    """The receive of a delta's buckets (a part of
    :class:`~rollout_sync.transfer.WeightTransfer`)."""

    def _take_delta(
        self,
        role: str,
        manifest: WeightManifest,
        version: int,
        target: DeltaTarget,
        op: str,
        outcome: _Outcome,
        start: float,
        forwarding: _Forward | None,
        loader: _DeltaLoad | None = None,
    ) -> TransferStats:
        """Receive a delta: its buckets into buffers of the packed deltas alone (passed on
        through ``forwarding`` as they arrive), then check and prove it and apply it
        (``target.apply``; else keep it in ``target.pending``), and vote. What was written is
        restored whenever the version does not land here, so a delta never leaves the targets
        torn: every error it raises says ``tensors_written`` 0, unless the version landed
        whole here and failed elsewhere (``complete``). ``loader`` (a stream's): after the
        apply, the rebuilt tensors go to its ``load`` before the vote, and ``tensors_written``
        counts what it was handed (its engine is torn by a failure from then on)."""
        manifest_done = time.perf_counter()
        header = manifest.delta
        assert header is not None
        packed = {
            e.name: torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
            for e in manifest.entries
        }
        received: ReceivedDelta | None = None
        applied = False

        def undo(exc: BaseException) -> None:
            if isinstance(exc, WeightTransferError) and exc.complete:
                return  # it landed whole here: it stays (and commits, in place)
            if applied:
                assert received is not None
                received.restore()
            if isinstance(exc, WeightTransferError):
                handed = 0 if loader is None else loader.handed
                # An apply whose restore failed too left what ``undo`` still lists written.
                left = 0 if received is None or not received.undo else len(received.changes)
                exc.tensors_written = max(handed, left)

        try:
            self._receive_buckets(
                manifest, packed, None, op, version, outcome, BUFFER_WRITE, forwarding
            )
            outcome.tensors_written = 0  # the packed buffers only: no target yet
            if outcome.failure is None:
                try:
                    received = ReceivedDelta.check(version, header, packed, target)
                    if target.apply:
                        applied = True  # from the first write on: restored on any failure
                        with self._write_span(f"apply the delta of version {version}"):
                            outcome.tensors_written = received.apply(target.digests)
                except Exception as exc:  # its checks, or an apply that failed
                    if received is not None and received.undo:
                        # The apply failed and so did putting the old values back: torn.
                        outcome.tensors_written = len(received.changes)
                        outcome.failure, outcome.cause = f"applying the delta failed: {exc}", exc
                        applied = False
                    else:  # refused before any write, or restored bit for bit
                        applied, received = False, None
                        refused = DeltaRefused(
                            f"{op}: refused the delta: {exc}; nothing was written (this "
                            f"replica keeps version {header.base_version})",
                            operation=op,
                            version=version,
                        )
                        refused.__cause__ = exc
                        outcome.refusal = refused
            if received is not None and loader is not None and outcome.failure is None:
                # After the proof and the apply, before the vote: as a whole version loads.
                self._load_delta(loader, received, manifest, op, outcome)
            failed, commits = self._commit_vote(op, version, manifest, outcome)
        except BaseException as exc:  # the transfer's own errors, and any other: undone
            if forwarding is not None:
                forwarding.fill()
                forwarding.close(ok=False)
            undo(exc)
            raise
        if forwarding is not None:
            forwarding.close(ok=outcome.failure is None and outcome.refusal is None)
        if received is not None and outcome.failure is None:
            # Whole and proven here (raised below if it failed elsewhere: ``complete``).
            target.received = EncodedDelta(version, header, packed, header.full_nbytes)
            target.pending = None if target.apply else received
        try:
            self._raise_failures(op, version, outcome, failed)
            if not commits:
                raise WeightTransferError(
                    f"{op}: the source's verdict: version {version} does not commit",
                    operation=op,
                    version=version,
                )
        except BaseException as exc:
            undo(exc)
            raise
        return self._receive_stats(role, version, manifest, outcome, start, manifest_done)

    def _load_delta(
        self,
        loader: _DeltaLoad,
        received: ReceivedDelta,
        manifest: WeightManifest,
        op: str,
        outcome: _Outcome,
    ) -> None:
        """Hand a stream's loader the rebuilt tensors of an applied delta: ``begin``, then a
        copy of each changed target, in calls of about a bucket's bytes. A failure is recorded
        in ``outcome`` (voted no, raised after the vote, chained) and stops the loading."""
        outcome.tensors_written = 0  # from here on: what the loader was handed
        if loader.begin is not None:
            try:
                loader.begin(manifest)
            except Exception as exc:  # reported after the commit vote
                outcome.failure, outcome.cause = f"starting to load failed: {exc}", exc
                return
        chunks: list[list[str]] = [[]]
        size = 0
        for name in received.changes:
            target = received.targets[name]
            if chunks[-1] and size + target.numel() * target.element_size() > (
                self.config.bucket_bytes
            ):
                chunks.append([])
                size = 0
            chunks[-1].append(name)
            size += target.numel() * target.element_size()
        for k, names in enumerate(chunks):
            # Copies: the loader may keep them (vLLM's layerwise reload does, until a layer is
            # complete), and the targets are restored if the version does not land.
            tensors = [received.targets[n].clone() for n in names]
            loader.handed += len(names)
            outcome.tensors_written = loader.handed
            try:
                with self._write_span(f"load rebuilt tensors {k + 1}/{len(chunks)}"):
                    loader.load(names, tensors)
            except Exception as exc:  # reported after the commit vote, chained
                outcome.failure = (
                    f"loading the rebuilt tensors of the delta ({k + 1}/{len(chunks)}) "
                    f"failed: {exc}"
                )
                outcome.cause = exc
                return
