"""Weight transfer over torch.distributed: P2R and R2R as one validated, bucketed broadcast.

Both commands are the same operation on different groups. **P2R** is a broadcast from the
trainer to a rollout replica (the group ``{trainer, replica}``); **R2R** is a broadcast from the
replica that received to the other replicas of its group. :class:`WeightTransfer` does either;
the code path is the same for gloo (CPU tensors) and NCCL (CUDA tensors).

One transfer, in order:

1. **Manifest.** The source broadcasts a :class:`~rollout_sync.transfer.WeightManifest`: every
   tensor's name, shape, dtype, bucket and byte offset, the weight version, whether it is a full
   sync or a subset, and whether buckets carry checksums. A source that cannot even build one
   broadcasts an abort instead, so its peers fail fast rather than time out. A P2R barrier
   (``SyncGroups.p2r_barrier``) starts with a broadcast of the same shape, so a receiver that
   takes no barrier meets it here and fails fast too (``_barrier``).
2. **Vote.** Every receiver checks the manifest against its targets with
   :func:`~rollout_sync.weights.check_weights_match` *before touching any of them*, then every rank
   contributes an ok flag to an all-gather. If any rank said no, every rank raises (the
   rejecting one its :class:`~rollout_sync.WeightMismatchError`, the others
   :class:`ManifestRejected` naming it) and nothing is written anywhere. The group stays usable.
3. **Buckets.** Tensors are packed into flat byte buffers of at most ``bucket_bytes`` (a tensor
   larger than that gets a bucket of its own), so thousands of small parameters cost a few
   collectives. Two buffers alternate: the source packs bucket ``k + 1`` while bucket ``k`` is
   on the wire, a receiver unpacks bucket ``k`` while bucket ``k + 1`` arrives. Unpacking is
   ``target.copy_(view)``, so non-contiguous targets are fine.

   **Zero-copy.** A bucket whose bytes already lie contiguously in memory is not staged: a
   bucket that is exactly one contiguous tensor, or a span of the flat ``storage`` the caller
   declares its tensors live in (:class:`~rollout_sync.flat.FlatWeights`,
   :meth:`~rollout_sync.RolloutBase.flat_weight_storage`) is sent straight from it and
   received straight into it.
4. **Checksums** (optional). The source broadcasts a checksum after each bucket; a receiver
   checks it before unpacking that bucket (``verify_before_write``, the default, stages every
   bucket for this). A mismatch stops all further writes on that receiver, which keeps
   receiving (so the group is not left hanging) and votes no at the end. With
   ``verify_before_write=False`` zero-copy buckets are verified *after* they landed in the
   targets: a bad one leaves them torn, and the worker marks them so.
5. **Commit vote.** Every rank all-gathers whether its side succeeded. Only then does
   :meth:`WeightTransfer.receive` return; the caller commits the version.

**The pipelined relay.** :meth:`WeightTransfer.relay` runs on the replica that receives the P2R
and is the R2R source: it passes bucket ``k`` on to the R2R group while bucket ``k + 1``
arrives, bytes and checksums exactly as received, so the two hops overlap. The other replicas
run an ordinary :meth:`WeightTransfer.receive` at the same time.

Every collective is waited for with a timeout (:func:`~rollout_sync.distributed.wait_work`). A
peer that dies mid-transfer is a :class:`WeightTransferError` in bounded time, whose
``tensors_written`` tells the caller whether its targets are now torn (a mix of versions).

With a :class:`~rollout_sync.Timeline`, every collective is a ``weight_collective`` span and
every write into target tensors a ``weight_write`` span (or the kind the caller names, e.g.
:data:`~rollout_sync.transfer.BUFFER_WRITE` for an async-mode buffer, which generation may
legitimately overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives, wait_work
from ..errors import (
    ChecksumMismatchError,
    CollectiveError,
    CollectiveTimeout,
    DeltaRefused,
    ManifestError,
    ManifestRejected,
    RelayForwardError,
    RolloutSyncError,
    WeightTransferError,
    WeightTransferTimeout,
)
from ..trace import SpanKind, Timeline
from ..weights import check_weights_match
from ._barrier import (
    ABORT,
    HEADER_WORDS,
    UNKNOWN_VERSION,
    VOTE_BARRIER_SKIPPED,
    VOTE_NO,
    VOTE_WHOLE,
    VOTE_YES,
    HeaderKind,
    aborted_version,
    barrier_mismatch,
    header_kind,
)
from ._pipeline import _Forward, _InFlight, _Link, void_checksum
from .config import BUFFER_WRITE, TransferConfig, TransferHooks, TransferStats
from .delta_sync import DeltaTarget, EncodedDelta, ReceivedDelta, SyncKind, WholeReason
from .manifest import OriginChecksums, WeightManifest, bucket_checksum

__all__ = ["StepwiseSend", "WeightTransfer", "wait_transfer_work"]


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


def wait_transfer_work(
    work: dist.Work | None,
    op: str,
    timeout_s: float,
    group: dist.ProcessGroup | None,
    ranks: tuple[int, ...],
    version: int | None,
    written: int,
) -> None:
    """Wait for one of a transfer's operations (:func:`~rollout_sync.distributed.wait_work`),
    its failure raised as the transfer's own error, saying how many target tensors this rank
    had written (``written``) by then.

    Raises:
        WeightTransferTimeout: it did not complete within ``timeout_s``.
        WeightTransferError: a peer failed (typically died) before that.
    """
    try:
        wait_work(work, operation=op, timeout_s=timeout_s, group=group, ranks=ranks)
    except CollectiveTimeout as exc:
        raise WeightTransferTimeout(
            f"{exc} [{written} target tensor(s) written before it failed]",
            operation=op,
            version=version,
            tensors_written=written,
        ) from exc
    except CollectiveError as exc:
        raise WeightTransferError(
            f"{exc} [{written} target tensor(s) written before it failed]",
            operation=op,
            version=version,
            tensors_written=written,
        ) from exc


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
class _DeltaLoad:
    """A stream's loader, for a delta it rebuilds from its host copy; ``handed`` counts the
    tensors given to ``load`` (what a failure then reports as written)."""

    load: Callable[[list[str], list[torch.Tensor]], None]
    begin: Callable[[WeightManifest], None] | None
    handed: int = 0


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


class WeightTransfer:
    """Broadcast weights from ``src`` to the rest of ``group``, validated and bucketed.

    One object per (group, source); reuse it across syncs: its bucket buffers, the encoded
    manifest (source) and the decoded one (receivers) are kept while the layout is unchanged.
    The source calls :meth:`send`, every other member :meth:`receive` (or, on a replica that
    passes the weights on, :meth:`relay`), for each sync, in the same order. Not thread-safe:
    one transfer at a time per object.

    Args:
        group: the process group (``None``: the default group). P2R: ``{trainer, replica}``;
            R2R: the replicas. A *standalone* group (made outside the default group, as vLLM's
            ``stateless_init_torch_distributed_process_group`` does) works the same way, on
            its group ranks (see :class:`~rollout_sync.distributed.GroupCollectives`).
        src: the rank of the source: global for a registered group, the group rank for a
            standalone one. ``rank`` is this process's rank in the same numbering.
        config: bucket size, checksums, collective timeout, zero-copy.
        timeline: records collective and write spans.
        device: where buckets live. Default: CUDA for an NCCL group, CPU otherwise.
        hooks: fault injection for tests.
    """

    delta_syncs = True
    """It moves delta syncs (:meth:`send`'s and :meth:`receive`'s ``delta``)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        src: int,
        *,
        config: TransferConfig | None = None,
        timeline: Timeline | None = None,
        device: torch.device | str | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        self.group = group
        self.src = src
        self.config = config if config is not None else TransferConfig()
        self.timeline = timeline
        self.hooks = hooks if hooks is not None else TransferHooks()
        self.collectives = GroupCollectives(group)
        self.ranks = self.collectives.ranks
        self.rank = self.collectives.rank
        if src not in self.ranks:
            raise ValueError(f"source rank {src} is not in the group of ranks {list(self.ranks)}")
        if device is None:
            nccl = self.collectives.backend == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor] = []
        self._encoded: tuple[object, WeightManifest, bytes] | None = None
        self._decoded: tuple[bytes, WeightManifest] | None = None
        self._views: tuple[object, list[list[torch.Tensor]]] | None = None
        self._spans: tuple[object, tuple[torch.Tensor | None, ...]] | None = None

    @property
    def staging_bytes(self) -> int:
        """The bucket buffers this rank holds now (made on first use, kept across syncs)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def __repr__(self) -> str:
        return (
            f"<WeightTransfer src={self.src} group={list(self.ranks)} "
            f"bucket_bytes={self.config.bucket_bytes} device={self.device}>"
        )

    @property
    def is_source(self) -> bool:
        return self.rank == self.src

    @property
    def backend(self) -> str:
        """The group's backend (``"gloo"``, ``"nccl"``): what the NCCL rule reads
        (:func:`~rollout_sync.staging.check_two_communicators`)."""
        return str(self.collectives.backend)

    # -- the source ----------------------------------------------------------------------------

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> TransferStats:
        """Broadcast ``weights`` (this rank must be the source); returns when all committed.

        Args:
            version: the weight version receivers commit.
            require_all: ``False`` for a deliberate subset (``trainable_only``); receivers then
                accept a manifest that does not name every served weight.
            origin: the original sender's checksums of ``version`` (an R2R forwarding what it
                received), checked by every receiver when the layouts match.
            storage: the flat buffer ``weights`` are views of, if they are
                (:class:`~rollout_sync.flat.FlatWeights`): buckets that are spans of it are
                sent straight from it, with no packing copy.
            delta: ``weights`` as a delta on the version the receivers hold
                (:meth:`~rollout_sync.transfer.delta_sync.DeltaEncoder.encode`): that is sent
                instead, unless a receiver votes for the whole version (it holds another one),
                when ``weights`` go whole at once. A
                :class:`~rollout_sync.transfer.delta_sync.WholeReason`: ``weights`` go whole,
                the stats saying why.

        Raises:
            ManifestRejected: a receiver rejected the manifest; nothing was written.
            P2RBarrierMismatch: the receiver voted from inside a P2R barrier this side did not
                take (``SyncGroups.p2r_barrier``); nothing was written.
            ChecksumMismatchError: a receiver failed after the vote (see ``failed_ranks``).
            WeightTransferTimeout / WeightTransferError: a collective timed out or failed.
        """
        start = time.perf_counter()
        steps = self.begin_send(
            weights,
            version=version,
            require_all=require_all,
            origin=origin,
            storage=storage,
            delta=delta,
        )
        manifest_done = time.perf_counter()
        for k in range(steps.num_buckets):
            steps.launch(k)
        failed = steps.vote(ok=True)
        if failed:
            raise ChecksumMismatchError(
                f"{steps.op}: ranks {failed} reported a failure after receiving (a checksum "
                "mismatch, a failed write, or a refusal of what landed, such as a LoRA set's "
                "lora_alpha); no replica of the sync commits this version",
                operation=steps.op,
                version=version,
                tensors_written=0,
                buckets=(),
                failed_ranks=failed,
            )
        return steps.stats(start, manifest_done)

    def begin_send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
        decision: bool = False,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> StepwiseSend:
        """:meth:`send` in steps, for a relay that passes on what another transfer receives
        (:class:`~rollout_sync.transfer.ShardedTransfer`'s pipelined relay): the manifest is
        broadcast and voted on here; then :meth:`StepwiseSend.launch` each bucket in order once
        its tensors hold the version (:meth:`StepwiseSend.launch_void` one that never will),
        :meth:`StepwiseSend.vote` the commit vote, and with ``decision``
        :meth:`StepwiseSend.decide` the verdict every receiver waits for
        (:attr:`~rollout_sync.transfer.WeightManifest.decision`).

        Raises:
            As :meth:`send` before its first bucket (the manifest, its vote; an encoding
            failure aborts the receivers first).
        """
        if not self.is_source:
            raise RuntimeError(f"send() on rank {self.rank}, but the source is {self.src}")
        op = f"send version {version} from rank {self.src} to ranks {list(self.ranks)}"
        encoded = delta if isinstance(delta, EncodedDelta) else None
        reason = None if encoded is not None or delta is None else WholeReason(delta).value
        try:
            self._check_storage(storage)
            if encoded is not None and encoded.version != version:
                raise ValueError(f"a delta of version {encoded.version} sent as version {version}")
            if encoded is not None and not encoded.packed:
                encoded = None  # nothing changed: a delta needs one tensor to carry
                reason = WholeReason.NOT_SMALLER.value
            if encoded is not None:
                manifest, data = self._encode(
                    encoded.packed, require_all, origin, decision, encoded
                )
            else:
                manifest, data = self._encode(weights, require_all, origin, decision, reason)
        except BaseException as exc:
            self.abort(f"{type(exc).__name__}: {exc}", version=version)
            raise
        self._broadcast_manifest(data, version, op)
        whole = self._vote(
            ok=True,
            op=f"{op}: manifest vote",
            version=version,
            written=0,
            reject_message="rejected the manifest; nothing was written",
            whole_allowed=encoded is not None,
        )
        if encoded is None:
            steps = StepwiseSend(self, manifest, weights, storage, op, version)
            steps.whole_reason = reason
            return steps
        if not whole:
            steps = StepwiseSend(self, manifest, encoded.packed, None, op, version)
            steps.sync_kind, steps.full_nbytes = SyncKind.DELTA.value, encoded.full_nbytes
            return steps
        # A receiver holds another version than the base: the same version goes whole now.
        steps = self.begin_send(
            weights,
            version=version,
            require_all=require_all,
            origin=origin,
            storage=storage,
            decision=decision,
            delta=WholeReason.RECEIVER,
        )
        return steps

    def abort(self, reason: str, *, version: int | None = None) -> None:
        """Tell the receivers waiting for this transfer's manifest that none is coming.

        On the source only, in place of :meth:`send` (a source that cannot send, say because
        its own weights are torn): every receiver raises :class:`ManifestRejected` at once,
        writing nothing, instead of waiting out the timeout. ``version``: the version that is
        not coming, if the source knows it (the receivers' message names it). A failure to
        deliver the abort (a receiver already dead) is not raised: the reason to abort is the
        error to report.
        """
        what = "a version" if version is None else f"version {version}"
        op = f"send {what} from rank {self.src} to ranks {list(self.ranks)}"
        word = UNKNOWN_VERSION if version is None else version
        header = torch.tensor([ABORT, word], dtype=torch.int64, device=self.device)
        try:
            self._collective(
                lambda: self.collectives.broadcast(header, self.src),
                f"{op}: abort ({reason})",
                version=version,
                written=0,
            )
        except WeightTransferError:
            pass

    def _encode(
        self,
        weights: Mapping[str, torch.Tensor],
        require_all: bool,
        origin: OriginChecksums | None,
        decision: bool = False,
        delta: EncodedDelta | str | None = None,
    ) -> tuple[WeightManifest, bytes]:
        """The manifest of ``weights`` and its bytes, reused while the layout is unchanged (a
        delta's, never: its sizes change every sync). ``delta``: the delta these weights are,
        or why a version that could have gone by delta goes whole."""
        encoded = delta if isinstance(delta, EncodedDelta) else None
        key = (
            tuple((n, t.shape, t.dtype, t.layout) for n, t in weights.items()),
            self.config.bucket_bytes,
            require_all,
            self.config.checksums,
            origin,
            decision,
            delta,
        )
        cached = self._encoded
        if encoded is None and cached is not None and cached[0] == key:
            return cached[1], cached[2]
        manifest = WeightManifest.build(
            weights,
            bucket_bytes=self.config.bucket_bytes,
            require_all=require_all,
            checksums=self.config.checksums,
            origin=origin,
            decision=decision,
            delta=None if encoded is None else encoded.header,
            whole_reason=None if encoded is not None else delta,  # type: ignore[arg-type]
        )
        if encoded is not None:
            return manifest, manifest.to_bytes()
        data = manifest.to_bytes()
        self._encoded = (key, manifest, data)
        return manifest, data

    def _broadcast_manifest(self, data: bytes, version: int, op: str) -> None:
        header = torch.tensor([len(data), version], dtype=torch.int64, device=self.device)
        self._collective(
            lambda: self.collectives.broadcast(header, self.src),
            f"{op}: manifest header",
            version=version,
            written=0,
        )
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._collective(
            lambda: self.collectives.broadcast(payload, self.src),
            f"{op}: manifest",
            version=version,
            written=0,
        )

    # -- a receiver ----------------------------------------------------------------------------

    def receive(
        self,
        into: Targets,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive one broadcast into ``into`` (this rank must not be the source), in place.

        Nothing in ``into`` is touched before the manifest has been checked against it and
        every rank of the group has voted yes.

        Args:
            into: the target tensors by name (served tensors, or an async-mode buffer).
            allow_subset: accept a manifest that does not name every target, one the source
                declared a subset (``send(require_all=False)``: a ``trainable_only`` sync); a
                manifest that claims a full sync must name every target either way. ``False``
                rejects a declared subset too. ``True`` by default, as on every transfer
                (:class:`~rollout_sync.transfer.ShardedTransfer`,
                :class:`~rollout_sync.sharded_groups.TreeRelay`).
            write_kind: the span kind of writes into ``into``.
            storage: the flat buffer ``into`` are views of, if they are
                (:meth:`~rollout_sync.RolloutBase.flat_weight_storage`): buckets that are
                spans of it are received straight into it (zero-copy; its padding bytes are
                overwritten). With checksums and ``verify_before_write`` (the default) every
                bucket is still staged and verified first. A storage that is not a contiguous
                1-D ``uint8`` tensor on this transfer's device is this rank's objection in the
                manifest vote: ``ValueError`` here, ``ManifestRejected`` on the others.
            verify: checks what landed, once every bucket arrived intact, before the commit
                vote: values no manifest can describe (a LoRA set's ``lora_alpha``). Raising
                makes this rank vote no (the source's ``send`` fails) and is raised here after
                the vote; ``into`` then holds the refused bytes, so pass it with a staging
                copy, not served tensors.
            delta: this rank's side of delta syncs
                (:class:`~rollout_sync.transfer.delta_sync.DeltaTarget`): a delta on the
                version it holds is received (only the packed delta is staged), checked,
                proven and applied to ``delta.served`` (or kept pending, ``apply=False``);
                ``into`` is then never touched, and may be a function that makes the targets
                of a whole version. Without it, or on another base, this rank votes for the
                whole version, which the source then sends at once.

        Raises:
            WeightMismatchError: this rank rejected the manifest; ``into`` is untouched.
            ManifestRejected: another rank rejected it (or the source aborted); untouched.
            P2RBarrierMismatch: the source sent a P2R barrier where the manifest belongs (it
                takes a barrier this side does not); untouched.
            ChecksumMismatchError: a bucket arrived corrupted here (writing stopped at it) or
                another rank reported a failure; see ``tensors_written``.
            WeightTransferTimeout / WeightTransferError: a collective timed out or failed
                (a peer died); ``tensors_written`` says whether ``into`` is torn.
        """
        if self.is_source:
            raise RuntimeError(f"receive() on the source rank {self.src}; call send()")
        start = time.perf_counter()
        me = self.rank
        whole_asked = False
        while True:  # twice at most: a delta, then (if any rank asked) the version whole
            arrival = self._receive_manifest(
                f"receive from rank {self.src} on rank {me}",
                into,
                allow_subset,
                storage,
                delta,
                whole_asked=whole_asked,
            )
            op = f"receive version {arrival.version} from rank {self.src} on rank {me}"
            if not self._manifest_vote(op, arrival):
                break
            whole_asked = True
        version, manifest = arrival.version, arrival.manifest
        assert manifest is not None  # a missing manifest always comes with a problem (raised)
        manifest_done = time.perf_counter()
        outcome = _Outcome()
        if manifest.delta is not None:
            assert delta is not None  # a rank without one voted for the whole version
            return self._take_delta("receive", manifest, version, delta, op, outcome, start, None)
        targets = arrival.into
        assert targets is not None
        self._receive_buckets(
            manifest, targets, arrival.storage, op, version, outcome, write_kind, None
        )
        _verify_landed(verify, targets, outcome)
        return self._commit("receive", op, version, manifest, outcome, start, manifest_done)

    def stream(
        self,
        expected: Mapping[str, torch.Tensor],
        load: Callable[[list[str], list[torch.Tensor]], None],
        *,
        accept: Callable[[WeightManifest], None] | None = None,
        begin: Callable[[WeightManifest], None] | None = None,
        allow_subset: bool = True,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive one broadcast and hand each bucket's tensors to ``load`` as it arrives.

        For a receiver whose targets are not standing tensors: a loader that takes tensors by
        name (vLLM's ``load_weights``). The manifest is checked against ``expected`` (names,
        shapes and dtypes; meta tensors will do) and by ``accept`` (raise to object), then
        voted on by every rank, as :meth:`receive` does; only after the vote passed does
        ``begin`` run and the first bucket arrive. Every bucket lands in a buffer of its own,
        allocated for it and never reused by the transfer (a loader may keep references to the
        tensors it was given, as vLLM's layerwise reload does until a layer is complete); with
        checksums, a bucket is verified before ``load`` sees it.

        A ``begin`` or ``load`` that raises stops all further loading on this rank, which
        keeps receiving (the group is not left hanging) and votes no at the commit.

        ``delta``: for a loader that cannot take a delta in place (vLLM for CPU repacks its
        weights after loading), a host copy of the base it serves
        (:class:`~rollout_sync.transfer.delta_sync.DeltaTarget`; without one, or on another
        base, this rank votes for the whole version, which the source then sends at once). A
        delta on that base arrives in buffers of the packed deltas alone and is checked and
        proven against ``delta.served`` before anything is loaded. Then, with ``delta.apply``,
        it is written into ``delta.served`` and ``begin`` runs, and the rebuilt whole tensor
        of every changed name (a copy of the written one, the loader's to keep) goes to
        ``load`` in the delta's order, in calls of about a bucket's bytes; the names it does
        not change are not loaded. All of this happens before the commit vote, as for a whole
        version; whenever the version does not land here ``delta.served`` is restored, bit for
        bit (the loader's engine is then torn as after a whole version's failed load: see
        ``tensors_written``). With ``apply=False`` nothing is loaded and nothing written: the
        proven delta is kept in ``delta.pending`` (a staged receive; the caller rebuilds at
        its install). ``expected`` and ``allow_subset`` concern whole versions only.

        Returns:
            This rank's receive, as ``role="stream"``; ``tensors_written`` counts the tensors
            handed to ``load``.

        Raises:
            WeightMismatchError / ManifestError / what ``accept`` raised: this rank rejected
                the manifest; nothing was loaded (``begin`` did not run).
            ManifestRejected: another rank rejected it; nothing was loaded.
            WeightTransferError: ``begin`` or ``load`` raised (chained), or as for
                :meth:`receive`; ``tensors_written`` says how much was loaded.
            DeltaRefused: a delta that fails its checks or its proof; nothing was loaded
                (``begin`` did not run) and ``delta.served`` is untouched.
        """
        if self.is_source:
            raise RuntimeError(f"stream() on the source rank {self.src}; call send()")
        start = time.perf_counter()
        me = self.rank
        whole_asked = False
        while True:  # a delta is answered with a vote for the whole version
            arrival = self._receive_manifest(
                f"stream from rank {self.src} on rank {me}",
                expected,
                allow_subset,
                None,
                delta,
                whole_asked=whole_asked,
            )
            manifest = arrival.manifest
            if arrival.problem is None and not arrival.want_whole and accept is not None:
                assert manifest is not None
                try:
                    accept(manifest)
                except Exception as exc:  # this rank's objection, voted below
                    arrival.problem = exc
            op = f"stream version {arrival.version} from rank {self.src} on rank {me}"
            if not self._manifest_vote(op, arrival):
                break
            whole_asked = True
        version = arrival.version
        assert manifest is not None
        manifest_done = time.perf_counter()
        outcome = _Outcome()
        if manifest.delta is not None:
            assert delta is not None  # a rank without one voted for the whole version
            loader = _DeltaLoad(load, begin) if delta.apply else None
            return self._take_delta(
                "stream", manifest, version, delta, op, outcome, start, None, loader
            )
        if begin is not None:
            try:
                begin(manifest)
            except Exception as exc:  # reported after the commit vote
                outcome.failure, outcome.cause = f"starting to load failed: {exc}", exc
        self._receive_buckets(
            manifest, {}, None, op, version, outcome, SpanKind.WEIGHT_WRITE, None, load=load
        )
        return self._commit("stream", op, version, manifest, outcome, start, manifest_done)

    def relay(
        self,
        into: Targets,
        forward: WeightTransfer,
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
        except WeightTransferError:
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
                exc.tensors_written = 0 if loader is None else loader.handed

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
        except WeightTransferError as exc:
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

    @contextmanager
    def _write_span(self, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(SpanKind.WEIGHT_WRITE, name):
                yield

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
        *,
        load: Callable[[list[str], list[torch.Tensor]], None] | None = None,
    ) -> None:
        """Receive every bucket, two in flight, into its span of ``into`` or a staging buffer
        (then verified and unpacked); pass each on through ``forward`` when relaying. With
        ``load`` (a stream), every bucket gets a fresh buffer and is handed to ``load``."""
        n = manifest.num_buckets
        flats: list[torch.Tensor | None]
        if load is None:
            spans = self._bucket_spans(manifest, into, storage, receiving=True)
            # A relay keeps a third staging buffer: one receiving, one being forwarded and
            # unpacked, one whose forward may still be finishing.
            buffers = self._bucket_buffers(manifest, spans, 2 if forward is None else 3)
            views = self._bucket_views(manifest, buffers, spans)
            flats = [
                span if span is not None else buffers[k % len(buffers)][: manifest.bucket_nbytes[k]]
                for k, span in enumerate(spans)
            ]
        else:
            spans, views = (None,) * n, []
            flats = [None] * n
        sent_checksums = (
            [torch.zeros(2, dtype=torch.int64, device=self.device) for _ in range(n)]
            if manifest.checksums
            else None
        )
        outcome.zero_copy_buckets = sum(span is not None for span in spans)
        in_flight = _InFlight(self._link(), op, n, version)
        write_starts: dict[int, int] = {}

        def post(k: int) -> None:
            if flats[k] is None:  # a stream's bucket: a buffer of its own
                flats[k] = torch.empty(
                    manifest.bucket_nbytes[k], dtype=torch.uint8, device=self.device
                )
            if spans[k] is not None:
                # The collective itself writes the targets (zero-copy).
                outcome.tensors_written += len(manifest.buckets[k])
                write_starts[k] = time.monotonic_ns()
            in_flight.launch(flats[k], k)  # type: ignore[arg-type]
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
                assert flat is not None
                if load is not None:
                    flats[k] = None  # the loader holds the only reference from here on
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
                if load is not None:
                    self._load_bucket(load, flat, k, manifest, outcome)
                    continue
                targets = [into[e.name] for e in manifest.buckets[k]]
                # Counted before the copy: a copy that fails half-way has still written.
                outcome.tensors_written += len(targets)
                if self.timeline is None:
                    torch._foreach_copy_(targets, views[k])
                else:
                    with self.timeline.span(write_kind, f"write bucket {k + 1}/{n} v{version}"):
                        torch._foreach_copy_(targets, views[k])

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
    ) -> str | None:
        """Check bucket ``k`` against the checksum its source sent (and the origin's); the
        failure, or ``None``."""
        got = [int(x) for x in bucket_checksum(flat).tolist()]
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

    # -- buffers and collectives ---------------------------------------------------------------

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

    def _collective(
        self, launch: Callable[[], dist.Work | None], op: str, *, version: int | None, written: int
    ) -> None:
        with self._span(op):
            work = launch()
            assert work is not None
            self._wait(work, op, version, written)

    def _wait(self, work: dist.Work, op: str, version: int | None, written: int) -> None:
        wait_transfer_work(
            work, op, self.config.timeout_s, self.group, self.ranks, version, written
        )

    def _link(self) -> _Link:
        """This transfer as the pipeline drives it (its group, its bounded wait and vote)."""

        def vote_ranks(ok: bool, op: str, version: int | None) -> list[int]:
            return self._vote_ranks(ok=ok, op=op, version=version, written=0)

        return _Link(self.src, self.collectives, self.timeline, self.device, self._wait, vote_ranks)

    @contextmanager
    def _span(self, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(SpanKind.WEIGHT_COLLECTIVE, name, src=self.src):
                yield

    def _vote_ranks(self, *, ok: bool, op: str, version: int | None, written: int) -> list[int]:
        """All-gather an ok flag; the global ranks that said no."""
        votes = self._gather_votes(
            VOTE_YES if ok else VOTE_NO, op=op, version=version, written=written
        )
        return [rank for rank, vote in zip(self.ranks, votes, strict=True) if vote != VOTE_YES]

    def _gather_votes(self, vote: int, *, op: str, version: int | None, written: int) -> list[int]:
        """All-gather a vote (``VOTE_YES``, ``VOTE_NO``, ...); every rank's, in rank order."""
        mine = torch.tensor([vote], dtype=torch.int32, device=self.device)
        votes = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in self.ranks]
        self._collective(
            lambda: self.collectives.all_gather(votes, mine),
            op,
            version=version,
            written=written,
        )
        return [int(v) for v in torch.cat(votes).tolist()]  # one device-to-host copy

    def _vote(
        self,
        *,
        ok: bool,
        op: str,
        version: int | None,
        written: int,
        reject_message: str,
        own_error: BaseException | None = None,
        whole_allowed: bool = False,
        want_whole: bool = False,
    ) -> bool:
        """Vote; raise ``own_error`` if this rank said no, :class:`ManifestRejected` if another
        did (:class:`~rollout_sync.errors.P2RBarrierMismatch` on the source, if a replica voted
        from inside a P2R barrier this source skipped). Every rank learns the outcome, so none
        is left waiting on the next collective.

        On a delta's manifest (``whole_allowed``) a receiver may vote for the whole version
        instead (``want_whole``, :data:`VOTE_WHOLE`): returns whether any rank did (and none
        said no), when every rank expects the same version again, whole."""
        vote = VOTE_WHOLE if want_whole and ok else (VOTE_YES if ok else VOTE_NO)
        votes = self._gather_votes(vote, op=op, version=version, written=written)
        if own_error is not None:
            raise own_error
        skipped = [r for r, v in zip(self.ranks, votes, strict=True) if v == VOTE_BARRIER_SKIPPED]
        if skipped and self.is_source:
            raise barrier_mismatch(
                "trainer",
                trainer=self.src,
                replica=skipped[0],
                operation=op,
                version=version,
                detail=" (it voted on this manifest from inside its barrier)",
            )
        accepted = (VOTE_YES, VOTE_WHOLE) if whole_allowed else (VOTE_YES,)
        failed = [r for r, v in zip(self.ranks, votes, strict=True) if v not in accepted]
        if failed:
            raise ManifestRejected(
                f"{op}: ranks {failed} {reject_message} (see their logs for the problems)",
                operation=op,
                version=version,
                rejected_by=failed,
            )
        return VOTE_WHOLE in votes


DECISION_COMMIT = 1
DECISION_DISCARD = 0


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
