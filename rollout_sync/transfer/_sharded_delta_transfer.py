"""Delta syncs on a :class:`~rollout_sync.transfer.ShardedTransfer`: the transfer's own sends
and receives of region deltas, written apart from its whole-version buckets.

A source rank's :meth:`~DeltaTransfer.delta_encoder` keeps a copy of its local tensors as last
committed and encodes, per move, the region's changes against the same region of that copy (one
payload per target rank: per move its packed delta and the region's new digest; the codec is
:mod:`rollout_sync.transfer._sharded_delta`). The plan vote carries each rank's delta columns: a
source's offer (or why it sends whole: the first sync, a keyframe, a delta no smaller than its
whole part), its base version, per pair a fingerprint of its base regions' digests and the
payload's size; a target's offer (a :class:`~rollout_sync.transfer.delta_sync.DeltaTarget` on a
version, its tensors contiguous) and the version it holds. When every rank offers on one base, a
one-word base vote follows: each target rank matches the digests of the regions it holds (cached
per version, so read once after a whole sync) against the sources' fingerprints. Every rank so
learns whether the sync is a delta, and each target the size of each source's payload, which then
goes point to point in chunks of the bucket size, each with its checksum. Anything else (a source
without a delta, a target on another version or with other bytes, a pipelined relay) makes the
same call move the version whole, saying why (``whole_reason``).

A target checks every region's delta (positions in range, strictly increasing) and proves each
region's result by its digest moved at the changed positions, before any write; then it applies
them in place, keeping what it overwrote, or keeps them pending for a staged install
(``DeltaTarget.pending``); whatever fails up to the commit vote (its own refusal,
:class:`~rollout_sync.errors.DeltaRefused`, another rank's failure, a dead peer) restores what it
wrote, so a delta never leaves a target torn (``tensors_written`` 0). ``DeltaTarget.received`` is
then the same changes as a delta of the rank's local tensors, which the (two-hop) relay and the
R2R source pass on to the other replicas through their :class:`~rollout_sync.WeightTransfer`.

:class:`DeltaTransfer` is a part of ``ShardedTransfer`` (it runs on the transfer's own plan vote,
commit vote and plumbing, named in it as abstract members), as
:class:`~rollout_sync.transfer._sharded_relay.PipelinedRelay` is.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..errors import DeltaRefused, WeightTransferError
from ..trace import SpanKind
from ..weights import WeightSpec
from ._sharded_buckets import _NO, _YES, _Bucket, _Chunk, _chunks, _Progress
from ._sharded_delta import (
    DeltaDecision,
    ShardedDelta,
    ShardedDeltaEncoder,
    ShardedReceivedDelta,
    delta_columns,
    holds_base,
)
from .config import TransferConfig, TransferHooks
from .delta_sync import DeltaTarget, EncodedDelta, WholeReason
from .manifest import bucket_checksum
from .plan import TransferPlan
from .weight_transfer import Targets

__all__ = ["DeltaTransfer"]


class DeltaTransfer(abc.ABC):
    """The delta syncs of a :class:`~rollout_sync.transfer.ShardedTransfer` (a part of it: the
    members below are the transfer's, named here so that this part says what it uses)."""

    plan: TransferPlan
    config: TransferConfig
    hooks: TransferHooks
    collectives: GroupCollectives
    device: torch.device
    rank: int
    ranks: tuple[int, ...]
    index: int
    source_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    _queues: Mapping[int, list[_Bucket]]
    _specs: Mapping[str, WeightSpec]

    @property
    @abc.abstractmethod
    def is_source(self) -> bool: ...

    @abc.abstractmethod
    def _wait(self, work: dist.Work | None, op: str, version: int | None, written: int) -> None: ...

    @abc.abstractmethod
    def _span(self, name: str) -> AbstractContextManager[None]: ...

    @abc.abstractmethod
    def _write_span(self, kind: str, name: str) -> AbstractContextManager[None]: ...

    @abc.abstractmethod
    def _commit_vote(
        self,
        version: int,
        progress: _Progress,
        failure: WeightTransferError | None,
        *,
        receiving: bool,
        forwarded: bool | None = None,
    ) -> list[int]: ...

    def _columns(
        self,
        *,
        offer: bool = False,
        reason: WholeReason | None = None,
        base: int | None = None,
        fingerprints: Mapping[tuple[int, int], int] | None = None,
        sizes: Mapping[tuple[int, int], int] | None = None,
    ) -> list[int]:
        return delta_columns(
            self.plan.source.world,
            self.plan.target.world,
            offer=offer,
            reason=reason,
            base=base,
            fingerprints=fingerprints,
            sizes=sizes,
        )

    def delta_encoder(self, *, full_every: int | None = None) -> ShardedDeltaEncoder:
        """This source rank's encoder of delta syncs (what
        :class:`~rollout_sync.trainer.TransferWeightPusher` asks for with ``delta=True``): it
        keeps a copy of this rank's local tensors as last committed and encodes each move's
        region against it; pass what its ``encode`` returns to :meth:`send` (``delta=``).

        Raises:
            RuntimeError: this rank is a target.
        """
        if not self.is_source:
            raise RuntimeError(f"delta_encoder() on target rank {self.rank}: sources encode")
        return ShardedDeltaEncoder(self.plan, self.index, full_every=full_every)

    def _source_columns(self, delta: ShardedDelta | EncodedDelta | WholeReason | None) -> list[int]:
        """A source rank's delta columns: its offer of ``delta`` (what :meth:`delta_encoder`'s
        ``encode`` returned), or why it sends whole (a one-source
        :class:`~rollout_sync.transfer.delta_sync.EncodedDelta` cannot be cut into regions)."""
        if isinstance(delta, ShardedDelta):
            return self._columns(
                offer=True,
                base=delta.base_version,
                fingerprints={(self.index, t): f for t, f in delta.fingerprints.items()},
                sizes={(self.index, t): p.numel() for t, p in delta.payloads.items()},
            )
        if isinstance(delta, EncodedDelta):
            return self._columns(reason=WholeReason.TRANSFER)
        return self._columns(reason=None if delta is None else WholeReason(delta))

    def _send_deltas(self, sharded: ShardedDelta, version: int, progress: _Progress) -> None:
        """Send each target rank its payload, in chunks of the bucket size (each with its
        checksum), all posted at once: a delta is small, and its targets post every receive
        before they wait on any, so no order of the sources' sends can block them."""
        config = self.config
        in_flight: list[tuple[dist.Work | None, str]] = []
        k = 0
        targets = sorted(sharded.payloads)
        start = self.index % len(targets) if targets else 0
        for t in targets[start:] + targets[:start]:
            payload = sharded.payloads[t].to(self.device)
            chunks = _chunks(payload.numel(), config.bucket_bytes, config.checksums)
            wire = torch.empty(
                chunks[-1].wire[1] if chunks else 0, dtype=torch.uint8, device=self.device
            )
            dst = self.target_ranks[t]
            for chunk in chunks:
                view = wire[chunk.wire[0] : chunk.wire[1]]
                data = payload[chunk.data[0] : chunk.data[1]]
                size = data.numel()
                view[:size].copy_(data)
                if chunk.checksummed:
                    view[size:].view(torch.int64).copy_(bucket_checksum(view[:size]))
                if self.hooks.after_pack is not None:
                    self.hooks.after_pack(k, view)
                k += 1
                op = f"send delta chunk {chunk.index + 1} of version {version} to rank {dst}"
                with self._span(op):
                    in_flight.append((self.collectives.send(view, dst, chunk.index), op))
                progress.buckets += 1
                progress.nbytes += size
        for work, op in in_flight:
            self._wait(work, op, version, 0)

    def _target_columns(self, target: DeltaTarget | None, *, relaying: bool = False) -> list[int]:
        """A target rank's delta columns: whether it can take a delta on the version it holds
        (its layout's tensors served, contiguous, of their shapes), or why not."""
        if target is None:
            return self._columns()
        if relaying:
            return self._columns(reason=WholeReason.RELAY)
        served = target.served
        fits = target.version is not None and all(
            (t := served.get(name)) is not None
            and t.is_contiguous()
            and (tuple(t.shape), t.dtype) == (spec.shape, spec.dtype)
            for name, spec in self._specs.items()
        )
        if not fits:
            return self._columns(reason=WholeReason.RECEIVER)
        return self._columns(offer=True, base=target.version)

    def _base_vote(
        self, version: int, decision: DeltaDecision, target: DeltaTarget | None
    ) -> DeltaDecision:
        """All-gather whether each target rank holds the sources' base in every region it
        receives (its regions' digests, cached per version, against the sources'
        fingerprints): the delta if all do, else the whole version
        (:attr:`~rollout_sync.transfer.delta_sync.WholeReason.RECEIVER`). Only a sync every
        rank offered a delta for runs it, so a whole sync never reads the served weights."""
        op = f"sharded transfer base vote of version {version}"
        holds = True
        if not self.is_source:
            try:
                holds = target is not None and holds_base(self.plan, self.index, target, decision)
            except Exception:  # noqa: BLE001 - a target that cannot tell takes the whole
                holds = False
        mine = torch.tensor([_YES if holds else _NO], dtype=torch.int64, device=self.device)
        rows = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in self.ranks]
        with self._span(op):
            work = self.collectives.all_gather(rows, mine)
            self._wait(work, op, version, 0)
        if all(v == _YES for v in torch.cat(rows).tolist()):
            return decision
        return DeltaDecision(False, WholeReason.RECEIVER)

    def _receive_delta(
        self, version: int, decision: DeltaDecision, target: DeltaTarget, progress: _Progress
    ) -> None:
        """A delta, on this target rank: every source's payload, then the check and proof of
        every region (no write), the apply (or ``target.pending``), the commit vote. Anything
        written is restored when the version does not commit, before the error is raised."""
        failure: WeightTransferError | None = None
        payloads: dict[int, torch.Tensor] = {}
        try:
            payloads = self._receive_payloads(version, decision, progress)
        except WeightTransferError as exc:
            failure = exc
        received: ShardedReceivedDelta | None = None
        applied = False
        base = decision.base_version
        assert base is not None
        if failure is None and progress.writing:
            moves = {s: self.plan.pair(s, self.index) for s in payloads}
            ranks = {s: self.source_ranks[s] for s in payloads}
            try:
                received = ShardedReceivedDelta.check(version, base, payloads, moves, target, ranks)
                encoded = received.encoded(target.digests)
                if target.apply:
                    applied = True  # from the first write on: restored on any failure
                    with self._write_span(SpanKind.WEIGHT_WRITE, f"apply delta v{version}"):
                        received.apply(target.digests)
            except Exception as exc:  # noqa: BLE001 - its checks, or an apply that failed
                applied = False
                if received is not None and received.undo:
                    # The apply failed after writing and what it wrote is not all back (its
                    # restore failed, or it failed past the writes): torn, never "untouched".
                    progress.tensors_written.update(received.tensors)
                    progress.write_error = exc
                else:  # refused before any write, or restored bit for bit
                    received = None
                    refused = DeltaRefused(
                        f"rank {self.rank} refused the delta of version {version}: {exc}; "
                        f"nothing was written (this replica keeps version {base})",
                        operation=f"receive the delta of version {version}",
                        version=version,
                    )
                    refused.__cause__ = exc
                    progress.refusal = refused
        try:
            self._commit_vote(version, progress, failure, receiving=True)
        except BaseException as exc:
            if applied:
                assert received is not None
                try:
                    received.restore()
                except Exception as undo_error:
                    raise WeightTransferError(
                        f"version {version} did not commit ({type(exc).__name__}), and putting "
                        f"back what rank {self.rank} wrote of its delta failed "
                        f"({type(undo_error).__name__}: {undo_error}): its part is torn",
                        operation=f"restore after the delta of version {version}",
                        version=version,
                        tensors_written=len(received.tensors),
                    ) from undo_error
            raise
        assert received is not None  # every rank voted yes
        target.received = encoded
        target.pending = None if target.apply else received  # type: ignore[assignment]
        if target.apply:
            progress.tensors_written.update(received.tensors)

    def _receive_payloads(
        self, version: int, decision: DeltaDecision, progress: _Progress
    ) -> dict[int, torch.Tensor]:
        """Every source's payload to this rank: every chunk's receive posted before any wait
        (the sources post all their sends at once), each chunk's checksum verified; a
        corrupted one is named in ``progress`` (nothing is applied), the rest still taken."""
        config = self.config
        posted: list[tuple[int, _Chunk, torch.Tensor, dist.Work | None]] = []
        wires: dict[int, tuple[torch.Tensor, list[_Chunk]]] = {}
        for s in sorted(self._queues):
            size = decision.sizes.get((s, self.index), 0)
            chunks = _chunks(size, config.bucket_bytes, config.checksums)
            wire = torch.empty(
                chunks[-1].wire[1] if chunks else 0, dtype=torch.uint8, device=self.device
            )
            wires[s] = (wire, chunks)
            for chunk in chunks:
                view = wire[chunk.wire[0] : chunk.wire[1]]
                src = self.source_ranks[s]
                posted.append((s, chunk, view, self.collectives.recv(view, src, chunk.index)))
        for k, (s, chunk, view, work) in enumerate(posted):
            src = self.source_ranks[s]
            op = f"receive delta chunk {chunk.index + 1} of version {version} from rank {src}"
            with self._span(op):
                self._wait(work, op, version, 0)
            size = chunk.data[1] - chunk.data[0]
            progress.buckets += 1
            progress.nbytes += size
            try:
                if self.hooks.after_receive is not None:
                    self.hooks.after_receive(k, view)
            except Exception as exc:  # noqa: BLE001 - this rank's own: voted no, then raised
                progress.write_error = progress.write_error or exc
            if chunk.checksummed and progress.writing:
                expected = view[size:].view(torch.int64)
                ok = bool(torch.equal(bucket_checksum(view[:size]), expected))
                progress.checksums_verified += ok
                if not ok:
                    progress.failed_buckets.append((k, chunk.index + 1, src))
        payloads = {}
        for s, (wire, chunks) in wires.items():
            parts = [wire[c.wire[0] : c.wire[0] + c.data[1] - c.data[0]] for c in chunks]
            payloads[s] = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)
        return payloads


def _applied(into: Targets, target: DeltaTarget) -> Mapping[str, torch.Tensor]:
    """A pending delta's version whole (an R2R receiver asked for it): the tensors ``into``
    makes (copies of the served ones if it is not a function) with the delta applied."""
    pending = target.pending
    assert pending is not None
    if callable(into):
        made, _ = into()
    else:
        made = {n: t.clone() for n, t in target.served.items()}
    pending.apply_to(made)
    return made
