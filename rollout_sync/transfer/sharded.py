"""A sharded transfer: every source rank sends its own bytes, point to point, to the target
ranks that serve them.

:class:`ShardedTransfer` moves one version along a :class:`~rollout_sync.transfer.TransferPlan`
over one process group holding the source ranks (a sharded trainer's) and the target ranks (one
replica's, tensor-parallel or not). No rank gathers the model: a source rank reads regions of
its own local tensors, a target rank writes regions of its own. One transfer, in order:

1. **Plan vote.** Every rank all-gathers ``(version, digest, ok)``: the digest of its plan and
   wire settings (bucket size, checksums), and whether its own tensors match its layout (a
   source's weights, a target's served tensors, checked with
   :func:`~rollout_sync.weights.check_weights_match` before anything is written). Different
   digests are :class:`~rollout_sync.errors.TransferPlanMismatch` on every rank, a rank that said
   no is its own error there and :class:`~rollout_sync.errors.ManifestRejected` elsewhere, and
   source ranks that disagree on the version are refused too: nothing moved, the group is
   usable.
2. **Buckets per peer.** The moves of each (source, target) pair are packed, in plan order,
   into buckets of at most ``bucket_bytes`` on the wire, checksum included when checksums are
   on (a larger region is cut along its outer dimensions). All source ranks send at once: each
   sends its buckets round-robin over its targets with at most two in flight, from two staging
   buffers made once (a source rank's extra memory is two buckets); each target keeps two
   receives posted per source, into two buffers per source (two buckets per source rank), and
   takes buckets round-robin over its sources. A target verifies a bucket's checksum before
   it writes any of it; after a mismatch it writes nothing more, keeps receiving (so no sender
   is left hanging) and votes no.
3. **Commit vote.** Every rank all-gathers whether its side succeeded; only then does
   :meth:`ShardedTransfer.receive` return. A failure names the ranks that failed, and a target
   that wrote anything says how much (``tensors_written``), so a worker marks it torn and never
   serves it: one rank's part of a replica is not a version on its own, so even a target that
   received its own part whole is torn when another rank failed.

**Delta syncs** (:mod:`rollout_sync.transfer._sharded_delta_transfer`): a source rank sends
each region's changes against the last version every rank committed; the plan vote (then a
one-word base vote) decides, on every rank at once, whether a sync goes by delta or whole
(``whole_reason``), and a target proves every region before any write and restores what it
wrote on any failure up to the commit vote, so a delta never leaves it torn.

**The pipelined relay** (``pipelined_relay=True``, on the first replica's ranks):
:meth:`ShardedTransfer.relay` passes this rank's slice on to the same rank of the other
replicas (an R2R :class:`~rollout_sync.WeightTransfer` it is the source of) bucket by bucket:
the R2R manifest goes out right after the plan vote, and each R2R bucket is packed and
broadcast as soon as every tensor it carries has arrived whole, while the next P2R buckets
arrive, so the two hops overlap (:meth:`~rollout_sync.WeightTransfer.begin_send`). A bucket
whose tensors never will arrive (a dead trainer rank, a corrupted bucket) goes out void, so
the receivers reach the votes instead of their limit. It passes whole versions on: a relay
rank asks for the whole version at the plan vote
(:attr:`~rollout_sync.transfer.delta_sync.WholeReason.RELAY`). Then, two-phase:

1. the R2R commit vote: the relay's yes says its own part arrived whole;
2. the P2R commit vote, over every trainer rank and every relay: a relay votes yes only if its
   R2R group voted yes too (``_FORWARD_FAILED`` when its part is whole and passing it on
   failed), so every relay learns whether the version reached every rank of both hops;
3. the verdict: each relay broadcasts it to its R2R group
   (:attr:`~rollout_sync.transfer.WeightManifest.decision`), and every receiver waits for it.

So a version commits on every rank of every replica or on none (a staged replica installs
only a yes; in place a rank that holds the version whole keeps it and reports the failure,
``complete``): a relay rank killed mid-bucket of its second hop makes every replica discard,
the other positions, whose own hops went through, included. The trainer ranks' ``send``
returns once the first hop delivered (as for the one-source relay).

Every wait is bounded by ``config.timeout_s``: a dead or hung peer is a
:class:`~rollout_sync.errors.WeightTransferError` (or its timeout) in bounded time. The same
code runs on gloo (CPU tensors) and NCCL (CUDA tensors).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives
from ..errors import (
    ChecksumMismatchError,
    ManifestRejected,
    TransferPlanMismatch,
    WeightMismatchError,
    WeightTransferError,
)
from ..trace import SpanKind, Timeline
from ..weights import WeightSpec, check_weights_match
from ._sharded_buckets import (
    _FORWARD_FAILED,
    _NO,
    _YES,
    _Bucket,
    _buckets,
    _check_coverage,
    _interleave,
    _Progress,
)
from ._sharded_delta import (
    WHOLE,
    DeltaDecision,
    ShardedDelta,
    decide,
    delta_width,
)
from ._sharded_delta_transfer import DeltaTransfer
from ._sharded_relay import Relay
from .config import TransferConfig, TransferHooks, TransferStats
from .delta_sync import DeltaTarget, EncodedDelta, SyncKind, WholeReason
from .layout import region_of
from .manifest import OriginChecksums, bucket_checksum
from .plan import TransferPlan
from .weight_transfer import Targets, wait_transfer_work

__all__ = ["ShardedTransfer"]


class ShardedTransfer(DeltaTransfer, Relay):
    """Move versions from ``source_ranks`` to ``target_ranks`` of ``group`` along ``plan``.

    One object per (group, plan); reuse it across syncs. Source ranks call :meth:`send` with
    their own local tensors, target ranks :meth:`receive` into theirs, for every sync, in the
    same order. It has the members of :class:`~rollout_sync.worker.SupportsWeightTransfer`, so a
    :class:`~rollout_sync.RolloutWorker` drives it as its P2R transfer on every rank of a
    replica. Not thread-safe: one transfer at a time per object.

    Args:
        group: holds exactly ``source_ranks`` and ``target_ranks`` (``None``: the default group).
        plan: from the source layout (``plan.source``, one entry per source rank) to the target
            layout (``plan.target``, one per target rank).
        source_ranks / target_ranks: global ranks, in layout order: ``source_ranks[i]`` holds
            ``plan.source.ranks[i]``.
        config: ``bucket_bytes``, ``checksums`` and ``timeout_s`` are used (zero-copy is not:
            regions of sharded tensors are packed).
        device: where buckets live. Default: CUDA for an NCCL group, CPU otherwise.
        hooks: fault injection for tests: ``after_pack(k, bucket)`` on a source after its
            ``k``-th bucket of the sync is packed, ``after_receive(k, bucket)`` on a target
            after its ``k``-th arrived, before it is verified or written.
        pipelined_relay: on a target rank, :meth:`relay` passes each bucket of the next hop on
            as soon as its tensors have arrived, two-phase (the module docstring); else it
            receives whole, then sends. The source ranks need not say (their side is the same).
    """

    delta_syncs = True
    """It moves delta syncs: each source rank's regions (:meth:`delta_encoder`); the pipelined
    relay passes whole versions on."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        plan: TransferPlan,
        *,
        source_ranks: Sequence[int],
        target_ranks: Sequence[int],
        config: TransferConfig | None = None,
        timeline: Timeline | None = None,
        device: torch.device | str | None = None,
        hooks: TransferHooks | None = None,
        pipelined_relay: bool = False,
    ) -> None:
        self.group = group
        self.plan = plan
        self.pipelined_relay = pipelined_relay
        self.source_ranks = tuple(source_ranks)
        self.target_ranks = tuple(target_ranks)
        self.config = config if config is not None else TransferConfig()
        self.timeline = timeline
        self.hooks = hooks if hooks is not None else TransferHooks()
        self.collectives = GroupCollectives(group)
        self.ranks = self.collectives.ranks
        self.rank = self.collectives.rank
        if len(self.source_ranks) != plan.source.world:
            raise ValueError(
                f"the plan's source layout has {plan.source.world} rank(s), "
                f"source_ranks {list(self.source_ranks)} has {len(self.source_ranks)}"
            )
        if len(self.target_ranks) != plan.target.world:
            raise ValueError(
                f"the plan's target layout has {plan.target.world} rank(s), "
                f"target_ranks {list(self.target_ranks)} has {len(self.target_ranks)}"
            )
        members = self.source_ranks + self.target_ranks
        if len(set(members)) != len(members) or set(members) != set(self.ranks):
            raise ValueError(
                f"source ranks {list(self.source_ranks)} and target ranks "
                f"{list(self.target_ranks)} must be disjoint and together be the group "
                f"{list(self.ranks)}"
            )
        if device is None:
            nccl = self.collectives.backend == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self._is_source = self.rank in self.source_ranks
        self.index = (self.source_ranks if self.is_source else self.target_ranks).index(self.rank)
        dtypes = {s.name: s.dtype for s in plan.source.specs}
        limit = self.config.bucket_bytes
        checksums = self.config.checksums
        if self.is_source:
            self._queues = {
                t: _buckets(plan.pair(self.index, t), dtypes, limit, checksums)
                for t in range(plan.target.world)
            }
            self._specs = plan.source.local_specs(self.index)
        else:
            self._queues = {
                s: _buckets(plan.pair(s, self.index), dtypes, limit, checksums)
                for s in range(plan.source.world)
            }
            self._specs = plan.target.local_specs(self.index)
            _check_coverage(self._queues, self._specs, self.index)
        self._queues = {peer: q for peer, q in self._queues.items() if q}
        self._largest = {peer: max(b.wire_bytes for b in q) for peer, q in self._queues.items()}
        """The largest bucket to or from each peer: what each staging buffer holds."""
        wire = repr((plan.digest, limit, checksums, self.source_ranks, self.target_ranks)).encode()
        self.digest = int.from_bytes(hashlib.sha256(wire).digest()[:8], "little") >> 1
        """The plan's digest with the wire settings and which global rank holds which side's
        layout rank: what the ranks vote on."""
        self._pairs = sorted({(m.source, m.target) for m in plan.moves})
        """The (source, target) pairs of layout ranks that have moves: what a delta carries."""
        self._buffers: list[torch.Tensor] = []
        """A source's two staging buffers; a target's two per source (made on first use)."""
        self._receive_buffers: dict[int, list[torch.Tensor]] = {}

    def __repr__(self) -> str:
        side = "source" if self.is_source else "target"
        return (
            f"<ShardedTransfer {side} {self.index} sources={list(self.source_ranks)} "
            f"targets={list(self.target_ranks)} moves={len(self.plan.moves)} "
            f"bucket_bytes={self.config.bucket_bytes}>"
        )

    @property
    def is_source(self) -> bool:
        """Whether this rank is one of the source ranks (it sends; the others receive)."""
        return self._is_source

    @property
    def backend(self) -> str:
        """The group's backend (``"gloo"``, ``"nccl"``): what the NCCL rule reads
        (:func:`~rollout_sync.staging.check_two_communicators`)."""
        return str(self.collectives.backend)

    @property
    def largest_bucket_bytes(self) -> int:
        """The largest bucket this rank sends or receives (at most ``bucket_bytes``)."""
        return max(self._largest.values(), default=0)

    @property
    def staging_bytes(self) -> int:
        """The staging memory this rank holds now: a source's two buffers, a target's two per
        source (made on the first transfer)."""
        held = [*self._buffers, *(b for pair in self._receive_buffers.values() for b in pair)]
        return sum(b.numel() * b.element_size() for b in held)

    @property
    def nbytes(self) -> int:
        """The payload bytes this rank sends (a source) or receives (a target) per sync."""
        return sum(s.move.nbytes for q in self._queues.values() for b in q for s in b.slots)

    # -- the source side -------------------------------------------------------------------

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
        delta: ShardedDelta | EncodedDelta | WholeReason | None = None,
    ) -> TransferStats:
        """Send this source rank's part of ``version`` from ``weights``, its local tensors.

        ``require_all``, ``origin`` and ``storage`` are accepted so that every transfer takes
        the same arguments (:class:`~rollout_sync.WeightTransfer`'s), and not used: what a sync
        covers is the plan's to say (a subset is a plan over layouts of that subset), there are
        no origin checksums to forward, and regions of local tensors are always packed.

        ``delta``: this rank's part as region deltas (what :meth:`delta_encoder`'s ``encode``
        returned): sent as such when every rank agrees at the plan vote (every source sent
        one on the same base, every target holds that base in every region it receives),
        else ``weights`` go whole in the same call, the stats saying why (``whole_reason``).
        A :class:`~rollout_sync.transfer.delta_sync.WholeReason`: ``weights`` go whole,
        saying why; a one-source :class:`~rollout_sync.transfer.delta_sync.EncodedDelta`
        cannot be cut into regions: whole too.

        Raises:
            WeightMismatchError: ``weights`` do not match this rank's layout (every rank
                refuses, nothing moves).
            ValueError: ``delta`` is of another version (every rank refuses).
            TransferPlanMismatch / ManifestRejected: another rank's plan or tensors differ.
            ChecksumMismatchError / WeightTransferError: a target refused the delta (it
                restored what it wrote), a peer failed or died during the transfer (its
                timeout subclass if it hung).
        """
        start = time.perf_counter()
        own = self._check(weights, "the source's weights", require_all=True)
        sharded = delta if isinstance(delta, ShardedDelta) else None
        if sharded is not None and sharded.version != version:
            self.abort(f"a delta of version {sharded.version} sent as version {version}")
            raise ValueError(f"a delta of version {sharded.version} sent as version {version}")
        version, decision = self._plan_vote(version, own, self._source_columns(delta))
        voted = time.perf_counter()
        progress = _Progress()
        failure: WeightTransferError | None = None
        try:
            if decision.delta:
                assert sharded is not None  # every source offered one
                self._send_deltas(sharded, version, progress)
            else:
                self._send_buckets(weights, version, progress)
        except WeightTransferError as exc:
            failure = exc
        self._commit_vote(version, progress, failure, receiving=False)
        end = time.perf_counter()
        return self._stats("send", version, progress, start, voted, end, decision)

    def abort(self, reason: str, *, version: int | None = None) -> None:
        """On a source, in place of :meth:`send`: vote no at the plan vote, so every other rank
        raises :class:`~rollout_sync.errors.ManifestRejected` at once (nothing is sent or
        written) instead of at its limit. A failure to deliver the abort is not raised: the
        reason to abort is the error to report."""
        what = "a version" if version is None else f"version {version}"
        refusal = WeightMismatchError([reason], context=f"source rank {self.rank} aborted {what}")
        try:
            self._plan_vote(version if version is not None else -1, refusal, self._columns())
        except (WeightMismatchError, WeightTransferError):
            pass

    def _send_buckets(
        self, weights: Mapping[str, torch.Tensor], version: int, progress: _Progress
    ) -> None:
        # Two staging buffers, each the largest bucket's size, made once: a source rank's
        # extra memory is two buckets (a send in flight holds its buffer until it completes).
        if not self._buffers:
            size = max(self._largest.values(), default=0)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in "ab"]
        in_flight: deque[tuple[dist.Work | None, str]] = deque()
        for k, (target, bucket) in enumerate(_interleave(self._queues, self.index)):
            if len(in_flight) == 2:
                self._wait(*in_flight.popleft(), version, 0)
            buffer = self._buffers[k % 2][: bucket.wire_bytes]
            self._pack(weights, bucket, buffer)
            if self.hooks.after_pack is not None:
                self.hooks.after_pack(k, buffer)
            dst = self.target_ranks[target]
            op = f"send bucket {bucket.index + 1} of version {version} to rank {dst}"
            with self._span(op):
                in_flight.append((self.collectives.send(buffer, dst, bucket.index), op))
            progress.buckets += 1
            progress.nbytes += sum(s.move.nbytes for s in bucket.slots)
        while in_flight:
            self._wait(*in_flight.popleft(), version, 0)

    def _pack(
        self, weights: Mapping[str, torch.Tensor], bucket: _Bucket, buffer: torch.Tensor
    ) -> None:
        for slot in bucket.slots:
            move = slot.move
            region = region_of(weights[move.source_local], move.source_box)
            view = buffer[slot.offset : slot.offset + move.nbytes].view(slot.dtype)
            view.view(region.shape).copy_(region)
        if bucket.checksummed:
            data = buffer[: bucket.data_bytes]
            buffer[bucket.data_bytes :].view(torch.int64).copy_(bucket_checksum(data))

    # -- the target side -------------------------------------------------------------------

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
        """Receive this target rank's part of the next version into ``into``, its local tensors
        (written in place, region by region, each bucket only once its checksum matched).

        ``allow_subset`` (default ``True``, as for every transfer): ``into`` may hold tensors
        this rank's layout does not (left untouched): a subset every rank voted for, since the
        layouts are in the plan's digest; every tensor the layout holds must be in ``into``
        either way. ``False``: ``into`` must be exactly the layout's, so a served tensor no
        sync writes is refused. ``storage`` is not used. ``verify``: as for
        :meth:`~rollout_sync.WeightTransfer.receive` (run on this rank's part once it landed
        intact; a refusal is this rank's no in the commit vote, raised after it).

        ``delta``: this rank's side of delta syncs
        (:class:`~rollout_sync.transfer.delta_sync.DeltaTarget`). When every rank agrees at
        the plan vote, this rank receives its regions' deltas, checks every one (positions in
        range, increasing, no repeats) and proves each region's result equals the source's
        by a digest moved at the changed positions, all before any write; then applies them
        to ``delta.served`` (restored on any failure up to the commit, so a delta never leaves
        this rank torn: ``tensors_written`` 0), or with ``apply=False`` keeps them in
        ``delta.pending`` for a staged install; ``into`` is then never touched and may be a
        function that makes the targets of a whole version (called only if it comes whole).
        ``delta.received`` is then the same changes as a delta of this rank's local tensors,
        for an R2R :class:`~rollout_sync.WeightTransfer` to pass on. On another version,
        other bytes in a region, or without ``delta``, this rank asks for the whole version,
        which comes in the same call.

        Raises:
            WeightMismatchError: ``into`` does not match this rank's layout (nothing written,
                every rank refuses).
            TransferPlanMismatch / ManifestRejected: another rank's plan or tensors differ, or
                the source aborted; nothing was written.
            ChecksumMismatchError: a bucket arrived corrupted; the buckets before it were
                written (``tensors_written``), none after (a delta: nothing).
            DeltaRefused: this rank refused the delta (malformed, truncated, positions out of
                range or out of order, a failed proof); nothing was written.
            WeightTransferError: a peer failed or died; ``tensors_written`` says whether this
                rank's tensors are torn (never ``complete``: one rank's part of a replica is not
                a version on its own, so a rank that wrote anything is torn).
        """
        return self._receive(into, allow_subset, write_kind, verify, delta)[0]

    def _receive(
        self,
        into: Targets,
        allow_subset: bool,
        write_kind: str,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None,
        delta: DeltaTarget | None,
    ) -> tuple[TransferStats, Mapping[str, torch.Tensor] | None]:
        """:meth:`receive`; also the tensors that hold the version whole here (``None``: a
        delta kept pending, not applied)."""
        start = time.perf_counter()
        served = into if not callable(into) else delta.served if delta is not None else None
        own = (
            self._check(served, "served weights", require_all=not allow_subset)
            if served is not None
            else WeightMismatchError(
                ["a receive into a function needs a DeltaTarget (its served tensors)"],
                context=f"served weights on rank {self.rank}",
            )
        )
        version, decision = self._plan_vote(None, own, self._target_columns(delta), delta)
        voted = time.perf_counter()
        progress = _Progress()
        if decision.delta:
            assert delta is not None  # a target without one voted for the whole version
            self._receive_delta(version, decision, delta, progress)
            end = time.perf_counter()
            stats = self._stats("receive", version, progress, start, voted, end, decision)
            return stats, (delta.served if delta.apply else None)
        failure: WeightTransferError | None = None
        targets: Mapping[str, torch.Tensor] | None = None
        if callable(into):
            try:
                targets, _ = into()
            except Exception as exc:  # noqa: BLE001 - this rank's: it votes no, then raises
                progress.write_error = exc
        else:
            targets = into
        try:
            # Nothing to write into: the buckets are still taken (no source is left waiting).
            self._receive_buckets(targets or {}, version, progress, write_kind)
        except WeightTransferError as exc:
            failure = exc
        if failure is None and progress.writing and verify is not None:
            assert targets is not None
            try:
                verify(targets)
            except Exception as exc:  # noqa: BLE001 - this rank's refusal: voted, then raised
                progress.refusal = exc
        self._commit_vote(version, progress, failure, receiving=True)
        end = time.perf_counter()
        return self._stats("receive", version, progress, start, voted, end, decision), targets

    def _receive_buckets(
        self,
        into: Mapping[str, torch.Tensor],
        version: int,
        progress: _Progress,
        write_kind: str,
    ) -> None:
        for _ in self._receive_steps(into, version, progress, write_kind):
            pass

    def _receive_steps(
        self,
        into: Mapping[str, torch.Tensor],
        version: int,
        progress: _Progress,
        write_kind: str,
    ) -> Iterator[_Bucket | None]:
        """The receive, one bucket per step: yields each bucket once it is written (``None``
        for one that was not: after a checksum mismatch nothing is). Receives stay posted
        between steps, two per source."""
        pending: dict[int, deque[_Bucket]] = {s: deque(q) for s, q in self._queues.items()}
        posted: dict[int, deque[tuple[dist.Work | None, torch.Tensor, _Bucket]]] = {
            s: deque() for s in self._queues
        }
        # Two buffers per source, made once: bucket k of a source lands in its buffer k % 2,
        # free again by then (bucket k - 2 was taken before bucket k is posted).
        for source, size in self._largest.items():
            if source not in self._receive_buffers:
                self._receive_buffers[source] = [
                    torch.empty(size, dtype=torch.uint8, device=self.device) for _ in "ab"
                ]

        def post(source: int) -> None:
            while pending[source] and len(posted[source]) < 2:
                bucket = pending[source].popleft()
                buffer = self._receive_buffers[source][bucket.index % 2]
                src = self.source_ranks[source]
                work = self.collectives.recv(buffer[: bucket.wire_bytes], src, bucket.index)
                posted[source].append((work, buffer, bucket))

        for source in self._queues:
            post(source)
        for k, (source, expected) in enumerate(_interleave(self._queues)):
            work, buffer, bucket = posted[source].popleft()
            assert bucket is expected
            src = self.source_ranks[source]
            op = f"receive bucket {bucket.index + 1} of version {version} from rank {src}"
            with self._span(op):
                self._wait(work, op, version, len(progress.tensors_written))
            view = buffer[: bucket.wire_bytes]
            progress.buckets += 1
            progress.nbytes += sum(s.move.nbytes for s in bucket.slots)
            written = False
            try:
                if self.hooks.after_receive is not None:
                    self.hooks.after_receive(k, view)
                if progress.writing and self._verified(bucket, view, progress):
                    self._unpack(into, bucket, view, progress, write_kind, version)
                    written = True
                elif progress.writing:
                    progress.failed_buckets.append((k, bucket.index + 1, src))
            except Exception as exc:  # noqa: BLE001 - this rank's own: voted no, then raised
                progress.write_error = progress.write_error or exc
            post(source)
            yield bucket if written else None

    def _verified(self, bucket: _Bucket, view: torch.Tensor, progress: _Progress) -> bool:
        if not bucket.checksummed:
            return True
        expected = view[bucket.data_bytes :].view(torch.int64)
        ok = bool(torch.equal(bucket_checksum(view[: bucket.data_bytes]), expected))
        progress.checksums_verified += ok
        return ok

    def _unpack(
        self,
        into: Mapping[str, torch.Tensor],
        bucket: _Bucket,
        view: torch.Tensor,
        progress: _Progress,
        write_kind: str,
        version: int,
    ) -> None:
        with self._write_span(write_kind, f"write bucket {bucket.index + 1} v{version}"):
            for slot in bucket.slots:
                move = slot.move
                target = region_of(into[move.target_local], move.target_box)
                data = view[slot.offset : slot.offset + move.nbytes].view(slot.dtype)
                progress.tensors_written.add(move.target_local)
                target.copy_(data.view(target.shape))

    # -- votes -----------------------------------------------------------------------------

    def _check(
        self, tensors: Mapping[str, torch.Tensor], what: str, *, require_all: bool
    ) -> WeightMismatchError | None:
        specs: list[WeightSpec] = list(self._specs.values())
        try:
            if self.is_source:
                missing = [s for s in specs if s.name not in tensors]
                problems = [f"{s.name}: missing (this rank's layout holds it)" for s in missing]
                problems += [
                    f"{s.name}: shape {list(tensors[s.name].shape)} {tensors[s.name].dtype}, the "
                    f"layout says {list(s.shape)} {s.dtype}"
                    for s in specs
                    if s.name in tensors
                    and (tuple(tensors[s.name].shape), tensors[s.name].dtype) != (s.shape, s.dtype)
                ]
                if problems:
                    raise WeightMismatchError(problems, context=f"{what} on rank {self.rank}")
            else:
                check_weights_match(
                    specs, tensors, require_all=require_all, context=f"{what} on rank {self.rank}"
                )
        except WeightMismatchError as exc:
            return exc
        return None

    def _plan_vote(
        self,
        version: int | None,
        own: WeightMismatchError | None,
        columns: list[int],
        target: DeltaTarget | None = None,
    ) -> tuple[int, DeltaDecision]:
        """All-gather (version, digest, ok) and the delta columns; the version the source ranks
        send and whether it goes by delta, or raise. A delta every rank offered is then
        confirmed by the base vote (:meth:`_base_vote`)."""
        op = "sharded transfer plan vote"
        width = 3 + delta_width(self.plan.source.world, self.plan.target.world)
        mine = torch.tensor(
            [
                version if version is not None else -1,
                self.digest,
                _YES if own is None else _NO,
                *columns,
            ],
            dtype=torch.int64,
            device=self.device,
        )
        rows = [torch.zeros(width, dtype=torch.int64, device=self.device) for _ in self.ranks]
        with self._span(op):
            work = self.collectives.all_gather(rows, mine)
            self._wait(work, op, version, 0)
        table = torch.stack(rows).tolist()  # one device-to-host copy
        votes = {rank: row for rank, row in zip(self.ranks, table, strict=True)}
        lead = votes[self.source_ranks[0]]
        digests = {rank: int(row[1]) for rank, row in votes.items()}
        versions = {rank: int(votes[rank][0]) for rank in self.source_ranks}
        agreed = lead[0] if len(set(versions.values())) == 1 else None
        differ = [rank for rank, d in digests.items() if d != lead[1]]
        if differ:
            raise TransferPlanMismatch(
                f"the ranks of a sharded transfer computed different plans (layouts, bucket "
                f"size or checksums differ): rank(s) {differ} differ from source rank "
                f"{self.source_ranks[0]}; digests {digests}; nothing was sent",
                operation=op,
                version=agreed,
                digests=digests,
                rejected_by=differ,
            )
        if own is not None:
            raise own
        refused = [rank for rank, row in votes.items() if row[2] != _YES]
        if refused:
            raise ManifestRejected(
                f"rank(s) {refused} refused version {agreed} (their tensors do not match their "
                f"layout, or the source aborted); nothing was sent",
                operation=op,
                version=agreed,
                rejected_by=refused,
            )
        if agreed is None:
            raise ManifestRejected(
                f"the source ranks disagree on the version: {versions}; nothing was sent",
                operation=op,
                version=None,
                rejected_by=list(self.source_ranks),
            )
        decision = decide(
            [votes[r][3:] for r in self.source_ranks],
            [votes[r][3:] for r in self.target_ranks],
            self._pairs,
        )
        if decision.delta:
            decision = self._base_vote(int(agreed), decision, target)
        return int(agreed), decision

    def _commit_vote(
        self,
        version: int,
        progress: _Progress,
        failure: WeightTransferError | None,
        *,
        receiving: bool,
        forwarded: bool | None = None,
    ) -> list[int]:
        """Every rank's yes or no; raise this rank's failure or another's. ``forwarded``: a
        pipelined relay's next hop succeeded (``False``: its own part is whole, passing it on
        failed, a vote of its own kind). Returns the relays whose forwarding failed, for a
        relay to raise on; a plain target raises on them (its part is whole: ``complete``)."""
        op = f"sharded transfer commit vote of version {version}"
        written = len(progress.tensors_written)
        if failure is not None:
            # A collective failed: the group may be broken; do not wait on it again.
            raise failure
        corrupt = progress.failed_buckets
        no = corrupt or progress.refusal is not None or progress.write_error is not None
        vote = _NO if no else _FORWARD_FAILED if forwarded is False else _YES
        mine = torch.tensor([vote], dtype=torch.int64, device=self.device)
        rows = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in self.ranks]
        with self._span(op):
            work = self.collectives.all_gather(rows, mine)
            self._wait(work, op, version, written)
        votes = torch.cat(rows).tolist()
        failed = [rank for rank, v in zip(self.ranks, votes, strict=True) if v == _NO]
        not_forwarded = [r for r, v in zip(self.ranks, votes, strict=True) if v == _FORWARD_FAILED]
        if progress.write_error is not None:
            error = progress.write_error
            raise WeightTransferError(
                f"writing version {version} on rank {self.rank} failed part-way "
                f"({type(error).__name__}: {error}); {written} tensor(s) written, so this "
                f"rank's part is torn; rank(s) {failed} voted no",
                operation=op,
                version=version,
                tensors_written=written,
            ) from error
        if progress.refusal is not None:
            raise progress.refusal
        if corrupt:
            raise ChecksumMismatchError(
                f"bucket {corrupt[0][1]} of version {version} from rank {corrupt[0][2]} arrived "
                f"corrupted on rank {self.rank} (its checksum differs); nothing was written from "
                f"it or after it; {written} tensor(s) written before; rank(s) {failed} failed",
                operation=f"receive version {version}",
                version=version,
                tensors_written=written,
                buckets=[k for k, _, _ in corrupt],
                failed_ranks=failed,
            )
        if failed:
            # Never ``complete``: a target rank's part is not a version on its own. Its peers of
            # the same replica failed, so what it wrote is torn with respect to theirs.
            raise WeightTransferError(
                f"version {version} failed on rank(s) {failed}"
                + (
                    f"; this rank (rank {self.rank}) received its own part whole, but a "
                    "replica's part alone is not a version: it is torn"
                    if receiving and written
                    else ""
                ),
                operation=op,
                version=version,
                tensors_written=written,
            )
        if receiving and not_forwarded and forwarded is None:
            raise WeightTransferError(
                f"version {version} reached every rank of this hop whole, but relay rank(s) "
                f"{not_forwarded} could not pass it on: it does not commit everywhere",
                operation=op,
                version=version,
                tensors_written=written,
                complete=True,
            )
        return not_forwarded

    # -- plumbing --------------------------------------------------------------------------

    def _wait(self, work: dist.Work | None, op: str, version: int | None, written: int) -> None:
        timeout = self.config.timeout_s
        wait_transfer_work(work, op, timeout, self.group, self.ranks, version, written)

    def _stats(
        self,
        role: str,
        version: int,
        progress: _Progress,
        start: float,
        voted: float,
        end: float,
        decision: DeltaDecision = WHOLE,
    ) -> TransferStats:
        return TransferStats.build(
            role=role,
            version=version,
            tensors=len(self._specs),
            buckets=progress.buckets,
            nbytes=progress.nbytes,
            manifest_s=voted - start,
            transfer_s=end - voted,
            total_s=end - start,
            tensors_written=len(progress.tensors_written),
            checksums_verified=progress.checksums_verified,
            layout=f"plan:{self.digest:016x}",
            sync_kind=SyncKind.DELTA.value if decision.delta else SyncKind.WHOLE.value,
            whole_reason=None if decision.reason is None else decision.reason.value,
            full_nbytes=self.nbytes if decision.delta else None,
        )

    @contextmanager
    def _span(self, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(SpanKind.WEIGHT_COLLECTIVE, name):
                yield

    @contextmanager
    def _write_span(self, kind: str, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(kind, name):
                yield
