"""A receiver's side of a :class:`~rollout_sync.transfer.WeightTransfer`, shared by ``receive``,
``stream``, ``relay`` and a delta's receive: the manifest taken and checked before any write,
the buckets received (two in flight, verified, unpacked or loaded), the commit vote with a
two-phase verdict, and the failures raised after it. :class:`_Outcome` is the bookkeeping of one
receive, kept apart from the collectives that fill it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..errors import (
    ChecksumMismatchError,
    DeltaRefused,
    ManifestError,
    ManifestRejected,
    RolloutSyncError,
    WeightTransferError,
)
from ..trace import SpanKind
from ..weights import check_weights_match
from ._barrier import (
    HEADER_WORDS,
    VOTE_NO,
    HeaderKind,
    aborted_version,
    barrier_mismatch,
    header_kind,
)
from ._buckets import BucketBuffers
from ._collectives import TransferCollectives
from ._pipeline import _Forward, _InFlight
from .config import TransferStats
from .delta_sync import DeltaTarget, SyncKind
from .manifest import WeightManifest, bucket_checksum

__all__ = ["DECISION_COMMIT", "DECISION_DISCARD", "Receiving", "Targets"]


def _verify_landed(
    verify: Callable[[Mapping[str, torch.Tensor]], None] | None,
    into: Mapping[str, torch.Tensor],
    outcome: _Outcome,
) -> None:
    """Run a receiver's ``verify`` on what landed whole; its refusal is this rank's no."""
    if verify is None or outcome.failure is not None:
        return
    try:
        verify(into)
    except Exception as exc:  # noqa: BLE001 - this rank's refusal: voted, then raised
        outcome.refusal = exc


@dataclass
class _Outcome:
    """Bookkeeping of one receive, kept apart from the collectives that fill it."""

    tensors_written: int = 0
    failed_buckets: list[int] = field(default_factory=list)
    failure: str | None = None
    cause: BaseException | None = None
    """The exception behind ``failure`` when a consumer of the bytes raised (a stream's load)."""
    refusal: BaseException | None = None
    """This rank's ``verify`` refused what landed whole (voted no, raised after the vote)."""
    checksums_verified: int = 0
    source_checksums: list[tuple[int, int]] = field(default_factory=list)
    zero_copy_buckets: int = 0


Targets = (
    Mapping[str, torch.Tensor]
    | Callable[[], tuple[Mapping[str, torch.Tensor], torch.Tensor | None]]
)
"""A receive's targets: the tensors by name, or a function that makes them and returns them with
their flat storage (or ``None``), called only when a whole version arrives (a staging copy made
only when a delta cannot serve)."""


@dataclass
class _Arrival:
    """One manifest as a receiver took it."""

    version: int
    manifest: WeightManifest | None
    data: bytes
    problem: BaseException | None = None
    """This rank's objection (voted no, raised after the vote)."""
    want_whole: bool = False
    """A delta this rank cannot take: it votes for the whole version."""
    into: Mapping[str, torch.Tensor] | None = None
    """A whole version's targets (made now, if the receive was given a function)."""
    storage: torch.Tensor | None = None


DECISION_COMMIT = 1
DECISION_DISCARD = 0


class Receiving(TransferCollectives, BucketBuffers):
    """The receive steps every receiving method runs (a part of
    :class:`~rollout_sync.transfer.WeightTransfer`)."""

    _decoded: tuple[bytes, WeightManifest] | None
    """The last manifest received, with its bytes (decoded again only when they change)."""

    def _manifest_vote(self, op: str, arrival: _Arrival) -> bool:
        """A receiver's vote on the manifest; raises its own problem or another's rejection.
        Returns whether the version comes again, whole (a delta some rank cannot take)."""
        manifest = arrival.manifest
        return self._vote(
            ok=arrival.problem is None,
            op=f"{op}: manifest vote",
            version=arrival.version,
            written=0,
            reject_message="rejected the manifest; nothing was written",
            own_error=arrival.problem,
            whole_allowed=manifest is not None and manifest.delta is not None,
            want_whole=arrival.want_whole,
        )

    def _commit(
        self,
        role: str,
        op: str,
        version: int,
        manifest: WeightManifest,
        outcome: _Outcome,
        start: float,
        manifest_done: float,
    ) -> TransferStats:
        """A receiver's commit vote on ``outcome``; raise any rank's failure, else its stats."""
        failed, commits = self._commit_vote(op, version, manifest, outcome)
        self._raise_failures(op, version, outcome, failed)
        if not commits:
            raise WeightTransferError(
                f"{op}: the source's verdict: version {version} does not commit (a rank "
                "beyond this group failed its part of the sync); this rank received it whole",
                operation=op,
                version=version,
                tensors_written=outcome.tensors_written,
                complete=True,
            )
        return self._receive_stats(role, version, manifest, outcome, start, manifest_done)

    def _commit_vote(
        self, op: str, version: int, manifest: WeightManifest, outcome: _Outcome
    ) -> tuple[list[int], bool]:
        """The commit vote on ``outcome``: the ranks that said no, and whether the version
        commits (two-phase: a source that voted yes sends its verdict, which every receiver
        takes, whatever its own outcome, before it raises anything)."""
        failed = self._vote_ranks(
            ok=outcome.failure is None and outcome.refusal is None,
            op=f"{op}: commit vote",
            version=version,
            written=outcome.tensors_written,
        )
        commits = (
            self._verdict(op, version, outcome)
            if manifest.decision and self.src not in failed
            else True
        )
        return failed, commits

    def _verdict(self, op: str, version: int, outcome: _Outcome) -> bool:
        """A two-phase manifest's second phase: the source's verdict (commit or not)."""
        verdict = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._collective(
            lambda: self.collectives.broadcast(verdict, self.src),
            f"{op}: verdict",
            version=version,
            written=outcome.tensors_written,
        )
        return int(verdict.item()) == DECISION_COMMIT

    def _raise_failures(self, op: str, version: int, outcome: _Outcome, failed: list[int]) -> None:
        """After the commit vote: raise for this rank's own failure or another rank's."""
        if outcome.refusal is not None:
            raise outcome.refusal
        if outcome.cause is not None:
            raise WeightTransferError(
                f"{op}: {outcome.failure}; {outcome.tensors_written} tensor(s) were handed to "
                "the loader, so the targets are torn until the next complete sync",
                operation=op,
                version=version,
                tensors_written=outcome.tensors_written,
            ) from outcome.cause
        if outcome.failure is not None:
            written = (
                f"{outcome.tensors_written} target tensor(s) were written before it, so the "
                "targets are torn until the next complete sync"
                if outcome.tensors_written
                else "no target tensor was written"
            )
            raise ChecksumMismatchError(
                f"{op}: {outcome.failure}; {written}",
                operation=op,
                version=version,
                tensors_written=outcome.tensors_written,
                buckets=outcome.failed_buckets,
                failed_ranks=failed,
            )
        if self.src in failed:
            raise WeightTransferError(
                f"{op}: the source rank {self.src} reported that it failed mid-transfer (its "
                f"own source died or timed out), so the bytes sent are void; "
                f"{outcome.tensors_written} target tensor(s) were written",
                operation=op,
                version=version,
                tensors_written=outcome.tensors_written,
            )
        if failed:
            raise ChecksumMismatchError(
                f"{op}: ranks {failed} reported a failure after receiving; this rank received "
                f"version {version} whole, so its targets are complete (not torn)",
                operation=op,
                version=version,
                tensors_written=outcome.tensors_written,
                buckets=(),
                failed_ranks=failed,
                complete=True,
            )

    def _receive_stats(
        self,
        role: str,
        version: int,
        manifest: WeightManifest,
        outcome: _Outcome,
        start: float,
        manifest_done: float,
    ) -> TransferStats:
        end = time.perf_counter()
        return TransferStats.build(
            role=role,
            version=version,
            tensors=len(manifest.entries),
            buckets=manifest.num_buckets,
            nbytes=manifest.nbytes,
            manifest_s=manifest_done - start,
            transfer_s=end - manifest_done,
            total_s=end - start,
            tensors_written=outcome.tensors_written,
            checksums_verified=outcome.checksums_verified,
            bucket_checksums=tuple(outcome.source_checksums) if manifest.checksums else None,
            layout=manifest.layout,
            zero_copy_buckets=outcome.zero_copy_buckets,
            sync_kind=SyncKind.WHOLE.value if manifest.delta is None else SyncKind.DELTA.value,
            whole_reason=manifest.whole_reason,
            full_nbytes=None if manifest.delta is None else manifest.delta.full_nbytes,
        )

    def _receive_manifest(
        self,
        op: str,
        into: Targets,
        allow_subset: bool,
        storage: torch.Tensor | None,
        delta: DeltaTarget | None = None,
        *,
        whole_asked: bool = False,
    ) -> _Arrival:
        """Receive and check the manifest (and this rank's ``storage``): its version, the
        manifest, its bytes and this rank's objection (voted, so every peer learns it). A delta
        is checked against ``delta`` (a vote for the whole version when this rank cannot take
        it); a whole version against ``into``, made now if it is a function. ``whole_asked``:
        the last manifest's vote asked for the whole version, so this one must be it."""
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self._collective(
            lambda: self.collectives.broadcast(header, self.src),
            f"{op}: manifest header",
            version=None,
            written=0,
        )
        size, version = (int(x) for x in header.tolist())
        kind = header_kind(size, version)
        if kind is HeaderKind.BARRIER:
            # The source takes a P2R barrier this side does not (docs in _barrier): answer its
            # vote, so that it hears it and the pair stays in step, then refuse.
            self._gather_votes(VOTE_NO, op=f"{op}: P2R barrier vote", version=None, written=0)
            raise barrier_mismatch(
                "replica",
                trainer=self.src,
                replica=self.rank,
                operation=op,
                detail=" (this receive found the barrier where a manifest header belongs)",
            )
        if kind is HeaderKind.ABORT:
            aborted = aborted_version(version)
            raise ManifestRejected(
                f"{op}: the source rank {self.src} aborted the transfer"
                + ("" if aborted is None else f" of version {aborted}")
                + " before sending a manifest (see its log); nothing was written",
                operation=op,
                version=aborted,
                rejected_by=(self.src,),
            )
        payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._collective(
            lambda: self.collectives.broadcast(payload, self.src),
            f"{op}: manifest",
            version=version,
            written=0,
        )
        data = payload.cpu().numpy().tobytes()
        arrival = _Arrival(version, None, data)
        try:
            cached = self._decoded
            if cached is not None and cached[0] == data:
                manifest = cached[1]
            else:
                manifest = WeightManifest.from_bytes(data)
                self._decoded = (data, manifest)
        except ManifestError as exc:
            arrival.problem = exc
            return arrival
        arrival.manifest = manifest
        try:
            if manifest.delta is not None:
                if whole_asked:
                    raise ManifestError(
                        f"{op}: a delta again after the vote asked for version {version} whole"
                    )
                refusal = None if delta is None else delta.refusal(manifest.delta, version)
                if refusal is not None:
                    refused = DeltaRefused(
                        f"{op}: refused the delta: {refusal}; nothing was written",
                        operation=op,
                        version=version,
                    )
                    refused.__cause__ = refusal
                    arrival.problem = refused
                elif delta is None or not delta.takes_base(manifest.delta):
                    arrival.want_whole = True  # the version comes whole next
                return arrival
            if callable(into):
                into, storage = into()
            arrival.into, arrival.storage = into, storage
            if not manifest.require_all and not allow_subset:
                raise ManifestError(
                    f"{op}: the source sent a subset ({len(manifest.entries)} of "
                    f"{len(into)} weights) and this receiver requires a full sync"
                )
            check_weights_match(
                manifest.specs,
                into,
                require_all=manifest.require_all,
                context=f"weights of version {version} from rank {self.src}",
            )
            self._check_storage(storage)
        except (RolloutSyncError, ValueError) as exc:
            arrival.problem = exc
        return arrival

    def _receive_buckets(
        self,
        manifest: WeightManifest,
        into: Mapping[str, torch.Tensor],
        storage: torch.Tensor | None,
        op: str,
        version: int,
        outcome: _Outcome,
        write_kind: str,
        forward: _Forward | None,
    ) -> None:
        """Receive every bucket, two in flight, into its span of ``into`` or a staging buffer
        (then verified and unpacked); pass each on through ``forward`` when relaying."""
        n = manifest.num_buckets
        spans = self._bucket_spans(manifest, into, storage, receiving=True)
        # A relay keeps a third staging buffer: one receiving, one being forwarded and
        # unpacked, one whose forward may still be finishing.
        buffers = self._bucket_buffers(manifest, spans, 2 if forward is None else 3)
        views = self._bucket_views(manifest, buffers, spans)
        flats = [
            span if span is not None else buffers[k % len(buffers)][: manifest.bucket_nbytes[k]]
            for k, span in enumerate(spans)
        ]
        sent_checksums = (
            [torch.zeros(2, dtype=torch.int64, device=self.device) for _ in range(n)]
            if manifest.checksums
            else None
        )
        outcome.zero_copy_buckets = sum(span is not None for span in spans)
        in_flight = _InFlight(self._link(), op, n, version)
        write_starts: dict[int, int] = {}

        def post(k: int) -> None:
            if spans[k] is not None:
                # The collective itself writes the targets (zero-copy).
                outcome.tensors_written += len(manifest.buckets[k])
                write_starts[k] = time.monotonic_ns()
            in_flight.launch(flats[k], k)
            if sent_checksums is not None:
                in_flight.launch(sent_checksums[k], k, "checksum")

        post(0)
        with torch.no_grad():
            for k in range(n):
                # Post bucket k + 1 before unpacking k. Staged, it lands in a buffer whose
                # previous bucket was unpacked already (and, when relaying, forwarded).
                if k + 1 < n:
                    if forward is not None and spans[k + 1] is None:
                        forward.finish_through(k + 1 - len(buffers))
                    post(k + 1)
                try:
                    in_flight.finish_through(k, outcome.tensors_written)
                finally:
                    if k in write_starts and self.timeline is not None:
                        self.timeline.add_span(
                            write_kind,
                            f"receive bucket {k + 1}/{n} v{version} in place",
                            write_starts[k],
                        )
                flat = flats[k]
                if self.hooks.after_receive is not None:
                    self.hooks.after_receive(k, flat)
                if forward is not None:
                    forward.launch(k, flat, None if sent_checksums is None else sent_checksums[k])
                if outcome.failure is not None:
                    continue  # keep the collectives matched; write nothing more
                if sent_checksums is not None:
                    outcome.failure = self._verify(flat, sent_checksums[k], k, manifest, outcome)
                    if outcome.failure is not None:
                        outcome.failed_buckets.append(k)
                        continue
                if spans[k] is not None:
                    continue
                targets = [into[e.name] for e in manifest.buckets[k]]
                # Counted before the copy: a copy that fails half-way has still written.
                outcome.tensors_written += len(targets)
                if self.timeline is None:
                    torch._foreach_copy_(targets, views[k])
                else:
                    with self.timeline.span(write_kind, f"write bucket {k + 1}/{n} v{version}"):
                        torch._foreach_copy_(targets, views[k])

    def _stream_buckets(
        self,
        manifest: WeightManifest,
        op: str,
        version: int,
        outcome: _Outcome,
        load: Callable[[list[str], list[torch.Tensor]], None],
        ahead: int,
    ) -> None:
        """A stream's buckets, each in a buffer of its own (allocated for it) and handed to
        ``load``, while up to ``ahead`` later buckets are on the wire. With checksums,
        bucket ``k``'s is checked before ``load`` sees bucket ``k``; on the CPU it is computed
        on a thread of its own while ``load`` runs on bucket ``k - 1`` (the checksum is the
        receive's other big cost, and vLLM's loader holds this thread). On a GPU it is taken
        here: its kernels run asynchronously anyway, and on another thread they would run on
        that thread's stream, not ordered after the receive's wait on this one's."""
        n = manifest.num_buckets
        flats: list[torch.Tensor | None] = [None] * n
        sent = (
            [torch.zeros(2, dtype=torch.int64, device=self.device) for _ in range(n)]
            if manifest.checksums
            else None
        )
        in_flight = _InFlight(self._link(), op, n, version)

        def post(k: int) -> None:
            nbytes = manifest.bucket_nbytes[k]
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            flats[k] = flat
            in_flight.launch(flat, k)
            if sent is not None:
                in_flight.launch(sent[k], k, "checksum")

        def check_and_load(
            k: int, flat: torch.Tensor, checksum: Future[torch.Tensor] | None
        ) -> None:
            if outcome.failure is not None:
                return  # keep the collectives matched; load nothing more
            if sent is not None:
                computed = None if checksum is None else checksum.result()
                failure = self._verify(flat, sent[k], k, manifest, outcome, computed)
                if failure is not None:
                    outcome.failure = failure
                    outcome.failed_buckets.append(k)
                    return
            self._load_bucket(load, flat, k, manifest, outcome)

        checker = (
            ThreadPoolExecutor(1, thread_name_prefix="rollout_sync-checksum")
            if sent is not None and self.device.type == "cpu"
            else None
        )
        posted = 0
        held: tuple[int, torch.Tensor, Future[torch.Tensor] | None] | None = None
        try:
            with torch.no_grad():
                for k in range(n):
                    while posted < n and posted <= k + ahead:
                        post(posted)
                        posted += 1
                    in_flight.finish_through(k, outcome.tensors_written)
                    flat, flats[k] = flats[k], None  # the loader holds the only reference
                    assert flat is not None
                    if self.hooks.after_receive is not None:
                        self.hooks.after_receive(k, flat)
                    checksum = None
                    if checker is not None and outcome.failure is None:
                        checksum = checker.submit(bucket_checksum, flat)
                    if held is not None:
                        check_and_load(*held)
                    held = (k, flat, checksum)
                if held is not None:
                    check_and_load(*held)
        finally:
            if checker is not None:
                checker.shutdown(wait=True)  # a checksum ends on its own: nothing to cancel

    def _load_bucket(
        self,
        load: Callable[[list[str], list[torch.Tensor]], None],
        flat: torch.Tensor,
        k: int,
        manifest: WeightManifest,
        outcome: _Outcome,
    ) -> None:
        """Hand bucket ``k`` (its own buffer) to a stream's loader, as typed, shaped views."""
        entries = manifest.buckets[k]
        names = [e.name for e in entries]
        tensors = [
            flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries
        ]
        # Counted before the call: a loader that fails half-way has still written.
        outcome.tensors_written += len(entries)
        try:
            if self.timeline is None:
                load(names, tensors)
            else:
                with self.timeline.span(
                    SpanKind.WEIGHT_WRITE, f"load bucket {k + 1}/{manifest.num_buckets}"
                ):
                    load(names, tensors)
        except Exception as exc:  # reported after the commit vote, chained
            outcome.failure = f"loading bucket {k + 1}/{manifest.num_buckets} failed: {exc}"
            outcome.cause = exc
            outcome.failed_buckets.append(k)

    def _verify(
        self,
        flat: torch.Tensor,
        sent: torch.Tensor,
        k: int,
        manifest: WeightManifest,
        outcome: _Outcome,
        computed: torch.Tensor | None = None,
    ) -> str | None:
        """Check bucket ``k`` against the checksum its source sent (and the origin's); the
        failure, or ``None``. ``computed``: ``flat``'s checksum, if taken already."""
        checksum = bucket_checksum(flat) if computed is None else computed
        got = [int(x) for x in checksum.tolist()]
        expected = [int(x) for x in sent.tolist()]
        outcome.source_checksums.append((expected[0], expected[1]))
        origin = manifest.origin
        if got != expected:
            return (
                f"bucket {k} arrived with checksum {got} but rank {self.src} sent {expected} "
                "(bytes corrupted in transit or in this rank's buffer)"
            )
        if origin is not None and list(origin.checksums[k]) != got:
            return (
                f"bucket {k} has checksum {got} but the original sender of version "
                f"{origin.version} sent {list(origin.checksums[k])}: the source replica "
                f"rank {self.src} is serving bytes that differ from what it received"
            )
        outcome.checksums_verified += 1
        return None
