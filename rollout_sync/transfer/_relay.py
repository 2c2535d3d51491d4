"""The pipelined relay: :meth:`~rollout_sync.transfer.WeightTransfer.relay` receives a version
and passes each bucket on to the next hop as soon as it has arrived, manifest and votes spanning
both hops (a delta passed on packed; a downstream vote for the whole version asked upstream)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
from typing_extensions import Self

from ..errors import (
    ChecksumMismatchError,
    ManifestError,
    ManifestRejected,
    RelayForwardError,
    WeightTransferError,
)
from ..trace import SpanKind
from ._barrier import VOTE_NO, VOTE_WHOLE, VOTE_YES
from ._delta_receive import DeltaReceive
from ._pipeline import _Forward
from ._receiving import Targets, _Arrival, _Outcome, _verify_landed
from .config import TransferStats
from .delta_sync import DeltaTarget

__all__ = ["Relay"]


def _vote_word(arrival: _Arrival) -> int:
    """This rank's word in a manifest vote."""
    if arrival.problem is not None:
        return VOTE_NO
    return VOTE_WHOLE if arrival.want_whole else VOTE_YES


def _forward_failure(fop: str, version: int, forwarding: _Forward) -> WeightTransferError | None:
    """The relay's second hop, failed after its buckets: the ranks that voted no there."""
    if not forwarding.failed_ranks:
        return None
    return ChecksumMismatchError(
        f"{fop}: ranks {forwarding.failed_ranks} reported a failure after receiving",
        operation=fop,
        version=version,
        tensors_written=0,
        buckets=(),
        failed_ranks=forwarding.failed_ranks,
    )


def _relay_forward_error(
    op: str, fop: str, version: int, outcome: _Outcome, forward_error: WeightTransferError
) -> RelayForwardError:
    error = RelayForwardError(
        f"{op}: this rank received version {version} whole, but passing it on failed: "
        f"{forward_error}",
        operation=fop,
        version=version,
        tensors_written=outcome.tensors_written,
        cause=forward_error,
    )
    error.__cause__ = forward_error
    return error


class Relay(DeltaReceive):
    """:meth:`relay` (a part of :class:`~rollout_sync.transfer.WeightTransfer`)."""

    def relay(
        self,
        into: Targets,
        forward: Self,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive one broadcast into ``into`` and pass it on through ``forward`` as it arrives.

        The pipelined relay: this rank receives from this transfer's source (the P2R) and is
        the source of ``forward`` (the R2R), whose other members run :meth:`receive` at the
        same time. Bucket ``k`` is broadcast on ``forward``'s group as soon as it has arrived,
        while bucket ``k + 1`` arrives, so the two hops overlap instead of adding up. The bytes
        are passed on exactly as received, checksums included, so a bucket corrupted on either
        hop is caught by every downstream receiver.

        Validation spans both hops: the manifest is passed on before this rank votes on it, so
        a downstream receiver that rejects it gets nothing written, while this rank still
        takes the version (as a separate R2R would). A relay that rejects the manifest tells
        its downstream receivers at once (the abort header).

        Args:
            into, allow_subset, write_kind, storage, verify, delta: as for :meth:`receive`
                (a refusal by ``verify`` is this relay's no in both commit votes). A delta is
                passed on packed, as it arrives; when a downstream receiver votes for the
                whole version, this rank asks its source for it, and passes that on.
            forward: the R2R transfer; this rank must be its source, on the same device.

        Returns:
            This rank's receive, as ``role="relay"``.

        Raises:
            RelayForwardError: this rank received the version whole (``complete``), but the
                forwarding failed (a downstream receiver rejected the manifest, died, timed out
                or reported a bad bucket); the caller commits the version and reports this.
            Otherwise as :meth:`receive`. When the upstream source fails mid-transfer, the
            buckets not yet forwarded are still sent (their bytes void) and this rank votes no
            in the R2R commit vote, so downstream receivers fail within one transfer's time,
            marked torn, instead of waiting out the timeout.
        """
        if self.is_source:
            raise RuntimeError(f"relay() on the source rank {self.src}; this rank must receive")
        if not forward.is_source:
            raise ValueError(
                f"relay() forwards as the source of the next hop, but rank {forward.rank} "
                f"is not the source of {forward!r}"
            )
        if forward.device != self.device:
            raise ValueError(
                f"relay() passes buckets on as they arrive, so both hops need one device; "
                f"got {self.device} and {forward.device}"
            )
        start = time.perf_counter()
        me = self.rank
        whole_asked = False
        forward_open = True  # the downstream receivers still wait for a manifest from here
        while True:  # twice at most: a delta, then (if any rank asked) the version whole
            try:
                arrival = self._receive_manifest(
                    f"relay from rank {self.src} on rank {me}",
                    into,
                    allow_subset,
                    storage,
                    delta,
                    whole_asked=whole_asked,
                )
            except WeightTransferError as exc:
                if forward_open:
                    reason = f"the relay's source failed: {type(exc).__name__}"
                    forward.abort(reason, version=exc.version)
                raise
            version, manifest = arrival.version, arrival.manifest
            if manifest is not None and manifest.decision and arrival.problem is None:
                # A relay would have to wait for its source's verdict and pass it on: not built.
                arrival.problem = ManifestError(
                    f"rank {me} relays, and version {version} is two-phase (its source sends a "
                    "verdict after the commit vote): a relay cannot pass it on; build the groups "
                    "without a relay tree below a pipelined sharded relay"
                )
            op = f"relay version {version} from rank {self.src} on rank {me}"
            fop = f"forward version {version} from rank {me} to ranks {list(forward.ranks)}"
            forwarding: _Forward | None = None
            forward_error: WeightTransferError | None = None
            downstream_whole = False
            if not forward_open:
                pass
            elif manifest is None:
                forward.abort(f"rank {me} cannot decode the manifest", version=version)
                forward_open = False
            else:
                forwarding = _Forward(forward._link(), fop, manifest, version)
                try:
                    forward._broadcast_manifest(arrival.data, version, fop)
                    votes = forward._gather_votes(
                        _vote_word(arrival), op=f"{fop}: manifest vote", version=version, written=0
                    )
                except WeightTransferError as exc:
                    forward_error, forwarding, forward_open = exc, None, False
                else:
                    accepted = (VOTE_YES, VOTE_WHOLE) if manifest.delta else (VOTE_YES,)
                    theirs = [(r, v) for r, v in zip(forward.ranks, votes, strict=True) if r != me]
                    rejected = [r for r, v in theirs if v not in accepted]
                    if arrival.problem is not None:
                        forwarding, forward_open = None, False  # the vote told them: said no
                    elif rejected:
                        forwarding, forward_open = None, False
                        forward_error = ManifestRejected(
                            f"{fop}: ranks {rejected} rejected the manifest; nothing was "
                            "written there",
                            operation=fop,
                            version=version,
                            rejected_by=rejected,
                        )
                    elif VOTE_WHOLE in votes:
                        # A downstream receiver (or this rank) cannot take the delta: they all
                        # wait for the whole version, which this rank asks its source for.
                        forwarding, downstream_whole = None, True
                        arrival.want_whole = True
            outcome = _Outcome()
            try:
                whole = self._manifest_vote(op, arrival)
            except WeightTransferError as exc:
                if forwarding is not None:
                    forwarding.fill()
                    forwarding.close(ok=False)
                elif downstream_whole:  # they wait for the whole version's manifest
                    forward.abort(
                        f"the relay's source failed: {type(exc).__name__}", version=version
                    )
                raise
            if not whole:
                break
            if forwarding is not None:
                # Downstream took the delta, upstream goes whole (another rank of the source's
                # group asked): the delta never comes; void it so they fail, not wait.
                forwarding.fill()
                forwarding.close(ok=False)
                forward_open, forwarding = False, None
            whole_asked = True
        assert manifest is not None
        manifest_done = time.perf_counter()
        if manifest.delta is not None:
            assert delta is not None  # a rank without one voted for the whole version
            stats = self._take_delta(
                "relay", manifest, version, delta, op, outcome, start, forwarding
            )
            if forwarding is not None:
                forward_error = forwarding.error or _forward_failure(fop, version, forwarding)
            if forward_error is not None:
                raise _relay_forward_error(op, fop, version, outcome, forward_error)
            return stats
        targets = arrival.into
        assert targets is not None
        try:
            self._receive_buckets(
                manifest, targets, arrival.storage, op, version, outcome, write_kind, forwarding
            )
            _verify_landed(verify, targets, outcome)
            failed = self._vote_ranks(
                ok=outcome.failure is None and outcome.refusal is None,
                op=f"{op}: commit vote",
                version=version,
                written=outcome.tensors_written,
            )
        except BaseException:  # the transfer's own errors, and any other (as a delta's)
            if forwarding is not None:
                # The buckets not passed on yet still go out (void), so the receivers reach
                # the commit vote, where this rank says no, instead of timing out.
                forwarding.fill()
                forwarding.close(ok=False)
            raise
        if forwarding is not None:
            forwarding.close(ok=outcome.failure is None and outcome.refusal is None)
            forward_error = forwarding.error or _forward_failure(fop, version, forwarding)
        self._raise_failures(op, version, outcome, failed)
        if forward_error is not None:
            raise _relay_forward_error(op, fop, version, outcome, forward_error)
        return self._receive_stats("relay", version, manifest, outcome, start, manifest_done)
