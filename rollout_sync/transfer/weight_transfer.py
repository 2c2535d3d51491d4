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
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..errors import ChecksumMismatchError, WeightTransferError
from ..trace import SpanKind, Timeline
from ._collectives import wait_transfer_work
from ._delta_receive import _DeltaLoad
from ._pipeline import _InFlight, void_checksum
from ._receiving import DECISION_COMMIT, DECISION_DISCARD, _Outcome, _verify_landed
from ._receiving import Targets as Targets
from ._relay import Relay
from .config import TransferConfig, TransferHooks, TransferStats
from .delta_sync import DeltaTarget, EncodedDelta, SyncKind, WholeReason
from .manifest import OriginChecksums, WeightManifest, bucket_checksum

__all__ = ["StepwiseSend", "WeightTransfer", "wait_transfer_work"]


class WeightTransfer(Relay):
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
        ahead: int = 1,
    ) -> TransferStats:
        """Receive one broadcast and hand each bucket's tensors to ``load`` as it arrives.

        For a receiver whose targets are not standing tensors: a loader that takes tensors by
        name (vLLM's ``load_weights``). The manifest is checked against ``expected`` (names,
        shapes and dtypes; meta tensors will do) and by ``accept`` (raise to object), then
        voted on by every rank, as :meth:`receive` does; only after the vote passed does
        ``begin`` run and the first bucket arrive. Every bucket lands in a buffer of its own,
        allocated for it and never reused by the transfer (a loader may keep references to the
        tensors it was given, as vLLM's layerwise reload does until a layer is complete); with
        checksums, a bucket is verified before ``load`` sees it (on the CPU its checksum is
        taken on a thread of its own while ``load`` runs on the bucket before). While ``load``
        runs on bucket ``k``, bucket ``k + 1`` has arrived (and is being checked) and buckets
        ``k + 2`` .. ``k + 1 + ahead`` are on the wire (each one more buffer held at once).

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
            ValueError: ``ahead`` is negative (before anything is received).
        """
        if self.is_source:
            raise RuntimeError(f"stream() on the source rank {self.src}; call send()")
        if ahead < 0:
            raise ValueError(f"ahead must be 0 or more (buckets on the wire), got {ahead}")
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
        self._stream_buckets(
            manifest,
            op,
            version,
            outcome,
            load,
            ahead,
        )
        return self._commit("stream", op, version, manifest, outcome, start, manifest_done)


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
