"""A Fast-LLM trainer drives any :class:`~rollout_sync.RolloutBase` replica, guarded.

Fast-LLM streams weights with its own protocol (:mod:`rollout_sync.integrations.fast_llm_wire`)
and leaves the receiving side, and the pause, to the user. :class:`FastLLMReceiver` is that
side:

* **Events.** It reads ``fast_llm_events`` from Redis, starting after the last event that was
  in the stream when it connected (the stream is never trimmed: earlier runs' events are not
  replayed), so the first ``weights_ready``, sent once the group exists, is neither skipped nor
  confused with an old one. ``training_finished`` ends :meth:`~FastLLMReceiver.serve` and
  leaves the group.
* **The group.** It joins the trainer's broadcast group exactly as the protocol says (same
  rendezvous, same store prefix; NCCL on GPU, gloo on CPU), in :meth:`~FastLLMReceiver.connect`,
  which the trainer waits for in its own construction.
* **Guarded receives.** Every ``weights_ready`` is received inside the package's bracket
  (pause, hold payload egress, receive, fence, release, resume), lazy engine start included:
  the first one arrives before generation starts and neither deadlocks (the pause of an engine
  that is not serving is a no-op) nor is skipped. The version committed is ``documents_seen``
  (``step`` from older builds).
* **Safe by construction.** Headers are unpickled by
  :class:`~rollout_sync.integrations.fast_llm_wire.HeaderUnpickler` (the protocol's types only)
  and capped in length. The stream has no manifest, so each header is checked against the
  served weights as it arrives (name, shape, dtype); tensors are staged and written only after
  the end marker. A wrong name, shape or dtype, a tensor that arrives shorter than its header
  (gloo completes such a receive silently; a sentinel over each buffer's tail catches it), or
  a stream that ends without a served name, is still received to the end (staying in step
  with the trainer) and the version refused there; a malicious or oversized header, a
  trainer that dies or stalls mid-stream abandon it (the receiver leaves the group). In every
  case the served weights are untouched. With ``stage=False`` (no second copy of the model)
  each tensor is received straight into the served one as its header is accepted: a failure
  after the first write raises :class:`~rollout_sync.errors.WeightTransferError` and marks
  the weights torn as the rollout worker does, and the receiver keeps generation parked (it
  holds ``paused()``) until a complete version lands, whatever the backend.
  Tensors of other shard categories (Fast-LLM's own format sends optimizer state after the
  weights) are received and dropped, as the protocol requires.
* **Stage, then swap** (``mode=SyncMode.STAGED``). By default (``SyncMode.SYNC``) generation
  is paused for the whole receive, staged buffers or not. In the staged mode the stream
  (headers, tensors, end marker, checks) lands in buffers of its own while generation goes on,
  with payload egress still held for the collective; generation is parked only to install the
  accepted version (the engine's ``load_weights``, or a copy per tensor) and commit it, and
  that stall is the sync report's ``stall_s``. A stream that fails or is refused never touches
  the served weights. An R2R receiver in this mode receives into a
  :class:`~rollout_sync.staging.StagingArea` and installs it the same way.
* **Fan-out.** The replica in the trainer's group passes each version on R2R with the package's
  :class:`~rollout_sync.transfer.WeightTransfer` (``r2r``, as its source); the other replicas run
  a :class:`FastLLMReceiver` without a group whose ``r2r`` receives it, on the same events.

:class:`FastLLMRolloutSender` ships rollouts back as ``fast_llm_streaming`` records, with
``hold_sends`` and ``flush_pending_sends`` so the guard can hold it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .._deadline import deadline_after, expired, limit_of, remaining, wait_arg
from ..backend import RolloutBase, TornWeightsPark
from ..errors import (
    EgressHoldTimeout,
    FastLLMEventTimeout,
    FastLLMProtocolError,
    PayloadBackpressureTimeout,
    PayloadTimeout,
    RolloutSyncError,
    UnsafeHeaderError,
    WeightMismatchError,
    WeightTransferError,
)
from ..guard import (
    SyncMode,
    SyncReport,
    WeightSyncBracket,
    device_fence,
    holds_payload_egress,
    weight_sync_bracket,
    weight_sync_handler,
)
from ..staging import StagingArea, check_two_communicators
from ..trace import SpanKind, Timeline
from ..transfer import BUFFER_WRITE, TransferStats, WeightTransfer
from ..worker import (
    DEFAULT_HISTORY,
    BackgroundEngine,
    bounded_history,
    reload_received,
    settle_failed_receive,
)
from .fast_llm_wire import (
    EVENTS_STREAM,
    MAX_HEADER_BYTES,
    ROLLOUTS_STREAM,
    BroadcastGroup,
    TensorHeader,
    TrainingFinished,
    WeightsReady,
    decode_header,
    encode_rollout,
    parse_event,
)

__all__ = ["FastLLMReceiver", "FastLLMRolloutSender", "ReceivedVersion"]

_SENTINEL_CHECK_BYTES = 8
"""A received tensor whose last 8 bytes still hold the sentinel arrived short (an honest one
holds it by chance with probability 2**-64)."""
_SENTINEL_SPAN_BYTES = 1 << 14
"""How much of a receive buffer's tail the sentinel covers: a shortfall up to 16 KiB is counted
to the byte in the error, a longer one as "at most". Kept under torch's parallel grain (a
64 KiB ``uint8`` copy took 16 ms on two busy cores, against microseconds for 16 KiB)."""


@dataclass(frozen=True)
class ReceivedVersion:
    """One version that landed: what the trainer announced and what came."""

    version: int
    step: int
    tensors: int
    """Tensors of the ``"weights"`` shard written."""
    dropped: int
    """Tensors of other shards received and dropped."""
    nbytes: int
    seconds: float


class FastLLMReceiver:
    """Receives a Fast-LLM trainer's weight stream into ``rollout``; see the module.

    Args:
        rollout: the engine. Its ``served_weights()`` names are the export format's (Hugging
            Face names); an engine that overrides ``load_weights`` gets the staged tensors
            through it (the vLLM backend: its native path), others are written in place.
        redis: a ``redis.Redis`` client of the trainer's Redis (``callbacks.streaming``), with
            a ``socket_timeout`` (it bounds every Redis call; event reads block for at most
            half of it at a time).
        group_address: ``(host, port)`` of the trainer's broadcast rendezvous; ``None`` for a
            replica that gets the weights R2R only.
        rank, world_size: this receiver's rank in the trainer's group (1 .. W - 1) and W.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU), as the trainer's ``broadcast.backend``.
        r2r: the package's transfer among the replicas: its source here if this receiver is in
            the trainer's group (each version is passed on), else its receiver.
        data_packer: the payload sender the guard holds (a :class:`FastLLMRolloutSender`).
        timeout_s: bounds the rendezvous, every receive, pause, hold and fence.
        mode: ``SyncMode.SYNC`` (default): generation is paused for the whole receive.
            ``SyncMode.STAGED``: the stream is received and checked while generation goes on
            (payload egress held), and generation is parked only to install the version and
            commit it (the report's ``stall_s``); an R2R receiver stages into a
            :class:`~rollout_sync.staging.StagingArea` (one copy of the served weights, kept).
            Other modes are refused.
        stage: receive into staging buffers and write after the end marker (default); ``False``
            receives in place (no second copy; torn, and generation kept parked, on a failure
            after the first write). ``mode=SyncMode.STAGED`` needs it.
        allow_subset: accept a stream that leaves served names out (default: every served
            tensor must come).
        timeline: records the bracket's spans, the writes and (through the engine) forwards.
        guarded: ``False`` receives without the bracket (to show what the pause prevents).
        events_stream: the events' stream name (Fast-LLM's is ``fast_llm_events``).
        max_header_bytes: the longest header accepted (64 KiB).
        on_version: called with each :class:`ReceivedVersion` and the served tensors, right
            after a version is committed (for checks).
        history: how many recent :class:`ReceivedVersion` s (:attr:`versions`) and sync
            reports (:attr:`sync_reports`) to keep (1024), so that a run of any length holds
            bounded memory; :attr:`versions_received` counts them all.

    Attributes:
        versions: the most recent versions received (at most ``history``), oldest first.
        sync_reports: the most recent sync reports (at most ``history``), oldest first.
        versions_received: every version received since the receiver was made.
        staging: ``SyncMode.STAGED`` R2R receivers: the staging copy of the served weights
            (built by the first R2R receive), else ``None``.

    Raises:
        ValueError: ``redis`` has no socket timeout (its calls could block for ever; give
            ``redis.Redis(..., socket_timeout=..., socket_connect_timeout=...)``),
            ``history`` is negative, ``mode`` is not ``SYNC`` or ``STAGED``, or ``STAGED``
            with ``stage=False``.
        TwoCommunicatorsRefused: ``mode=SyncMode.STAGED`` with the engine's forwards running
            NCCL collectives (tensor parallelism) and an NCCL receive (``backend="nccl"`` in
            the trainer's group, or an NCCL ``r2r``, checked whenever it is set).
    """

    def __init__(
        self,
        rollout: RolloutBase,
        *,
        redis: Any,
        group_address: tuple[str, int] | None = None,
        rank: int = 1,
        world_size: int = 2,
        backend: str = "gloo",
        r2r: WeightTransfer | None = None,
        data_packer: object = None,
        timeline: Timeline | None = None,
        timeout_s: float = 600.0,
        mode: SyncMode = SyncMode.SYNC,
        stage: bool = True,
        allow_subset: bool = False,
        guarded: bool = True,
        events_stream: str = EVENTS_STREAM,
        max_header_bytes: int = MAX_HEADER_BYTES,
        on_version: Callable[[ReceivedVersion, Mapping[str, torch.Tensor]], None] | None = None,
        history: int = DEFAULT_HISTORY,
    ) -> None:
        bounded_history("FastLLMReceiver", history)
        socket_timeout = _socket_timeout(redis)
        if socket_timeout is None:
            raise ValueError(
                "FastLLMReceiver needs a Redis client whose calls are bounded: "
                "redis.Redis(..., socket_timeout=30, socket_connect_timeout=30)"
            )
        if mode not in (SyncMode.SYNC, SyncMode.STAGED):
            raise ValueError(
                f"FastLLMReceiver(mode={mode!r}): choose SyncMode.SYNC (the default: paused for "
                "the whole receive) or SyncMode.STAGED (paused for the install only); the async "
                "modes need a weight buffer that the engine installs itself, which this receiver "
                "does not build"
            )
        if mode is SyncMode.STAGED and not stage:
            raise ValueError(
                "FastLLMReceiver(mode=SyncMode.STAGED, stage=False): a staged sync receives "
                "into buffers of its own while generation goes on, and stage=False receives "
                "straight into the served tensors, which only a paused receive may do. Drop "
                "stage=False, or keep it with mode=SyncMode.SYNC"
            )
        self.rollout = rollout
        self._mode = mode
        self.redis = redis
        self._block_s = max(0.001, socket_timeout / 2)
        self.group_address = group_address
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._trainer_group = _TrainerGroup(backend) if group_address is not None else None
        """The trainer's group as the NCCL rule reads it (joined only at :meth:`connect`)."""
        self._r2r: WeightTransfer | None = None
        self.r2r = r2r  # checked against the NCCL rule, with the trainer's group
        self.data_packer = data_packer
        self.timeline = timeline
        self.weight_sync_timeout = timeout_s
        self.stage = stage
        self.allow_subset = allow_subset
        self.guarded = guarded
        self.events_stream = events_stream
        self.max_header_bytes = max_header_bytes
        self.on_version = on_version
        self.group: BroadcastGroup | None = None
        self.versions: collections.deque[ReceivedVersion] = collections.deque(maxlen=history)
        self.sync_reports: collections.deque[SyncReport] = collections.deque(maxlen=history)
        self.versions_received = 0
        self.finished = False
        self._last_event_id: bytes | str | None = None
        self._redis_run_id: str | None = None
        self._engine_started = False
        self._torn_park = TornWeightsPark(rollout, "FastLLMReceiver")
        """Parks generation from a receive that left the weights torn until the next complete
        version lands here (or ``stop_engine``)."""
        self.staging: StagingArea | None = None
        self.last_weight_sync_report: SyncReport | None = None

    @property
    def r2r(self) -> WeightTransfer | None:
        """The transfer among the replicas (see the constructor); setting it checks the NCCL
        rule as the constructor does."""
        return self._r2r

    @r2r.setter
    def r2r(self, transfer: WeightTransfer | None) -> None:
        check_two_communicators(
            self.rollout,
            (self._trainer_group, transfer),
            self._mode,
            what="FastLLMReceiver",
            remedy=(
                "Choose mode=SyncMode.SYNC (the stream is received with generation parked), or "
                "gloo: Fast-LLM's broadcast backend is WeightsBroadcastConfig.backend (gloo "
                "streams through host memory; then backend='gloo' here), and the R2R transfer's "
                "is its group's"
            ),
        )
        self._r2r = transfer

    # -- the worker contract the guard reads --------------------------------------------------

    @property
    def weight_sync_mode(self) -> SyncMode:
        """How versions reach the served weights (``mode=``); fixed at construction. The
        decorated :attr:`receive_weights` pauses for its whole body in either mode;
        :meth:`take` runs a staged receive in ``STAGED``."""
        return self._mode

    def payload_egress_components(self) -> Sequence[object]:
        """What the guard holds during a sync: the payload sender and the engine (if they
        have the hooks)."""
        return (self.data_packer, self.rollout)

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self.sync_reports.append(report)

    # -- connecting ---------------------------------------------------------------------------

    def connect(self) -> None:
        """Note where the event stream ends now, then join the trainer's group (if this
        receiver is in it): blocks until every member is there, up to ``timeout_s``.

        Raises:
            FastLLMProtocolError: Redis cannot be read.
            RuntimeError / DistStoreError (torch): the rendezvous did not complete in time.
        """
        self._last_event_id = self._stream_end()
        if self.group_address is not None and self.group is None:
            host, port = self.group_address
            self.group = BroadcastGroup.join(
                host,
                port,
                self.rank,
                self.world_size,
                backend=self.backend,
                timeout_s=self.weight_sync_timeout,
            )

    def close(self) -> None:
        """Leave the trainer's group (idempotent). Torn weights stay parked: see
        :meth:`stop_engine`."""
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def _stream_end(self) -> bytes | str:
        try:
            self._redis_run_id = self._server_run_id()
            last = self.redis.xrevrange(self.events_stream, count=1)
        except Exception as exc:  # noqa: BLE001 - redis' errors, typed for the caller
            raise self._redis_failure("read the end of", exc) from exc
        return last[0][0] if last else "0-0"

    def _check_same_server(self) -> None:
        run_id = self._server_run_id()
        if run_id != self._redis_run_id:
            raise FastLLMProtocolError(
                f"the Redis server of the event stream {self.events_stream!r} restarted (run id "
                f"{self._redis_run_id} -> {run_id}): announcements may have been lost, so this "
                "receiver cannot tell which broadcast comes next; no weights were written"
            )

    def _server_run_id(self) -> str:
        """The Redis server's run id: a new one means it restarted (and, unless it persists
        streams, lost every event this receiver had not read)."""
        return str(self.redis.info("server")["run_id"])

    def _redis_failure(self, what: str, exc: BaseException) -> FastLLMProtocolError:
        return FastLLMProtocolError(
            f"could not {what} the Redis event stream {self.events_stream!r} "
            f"({type(exc).__name__}: {exc}); no weights were written"
        )

    # -- serving ------------------------------------------------------------------------------

    def next_event(self, timeout_s: float) -> WeightsReady | TrainingFinished | None:
        """The next event after the last one taken, waiting up to ``timeout_s`` (``None`` if
        none came).

        Raises:
            FastLLMProtocolError: Redis failed (restarted, unreachable) or sent a bad event.
        """
        if self._last_event_id is None:
            raise RolloutSyncError("FastLLMReceiver.connect() first")
        deadline = deadline_after(limit_of(timeout_s, 0.0))
        try:
            while True:
                # Each block is shorter than the client's socket timeout, so a quiet stream is
                # not mistaken for a dead connection.
                block_s = min(self._block_s, max(0.001, remaining(deadline)))
                answer = self.redis.xread(
                    {self.events_stream: self._last_event_id},
                    count=1,
                    block=max(1, int(block_s * 1000)),
                )
                if answer or expired(deadline):
                    break
            # After the reads (connect() took the first run id): a restart since the last
            # call, or during these reads, lost what this receiver had not read yet. Once a
            # call: a restart changes the run id for good.
            self._check_same_server()
        except FastLLMProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - redis' errors, typed for the caller
            raise self._redis_failure("read", exc) from exc
        if not answer:
            return None
        _, messages = answer[0]
        message_id, fields = messages[0]
        self._last_event_id = message_id
        return parse_event(fields)

    def serve(
        self, *, idle_timeout_s: float = 3600.0, poll_s: float = 1.0
    ) -> list[ReceivedVersion]:
        """Receive every version the trainer announces until ``training_finished``; return the
        most recent of them (at most ``history``; :attr:`versions_received` counts them all).

        Raises:
            FastLLMProtocolError: Redis failed, a bad event, or a stream that broke the
                protocol (the group is left; nothing of that version was written).
            WeightMismatchError: a version whose tensors do not match the served weights, or
                one that arrived shorter than its header (received in full, nothing written;
                the receiver stays in the group).
            CollectiveError: the trainer died or stopped sending mid-stream.
            WeightTransferError: ``stage=False``, any of the above after an in-place write
                (a failure chained as its cause, a refusal's WeightMismatchError too): the
                weights are torn and generation stays parked until a complete version lands
                (or :meth:`stop_engine`).
            FastLLMEventTimeout: no event for ``idle_timeout_s``.
        """
        self._torn_park.check_thread("serve()")  # before an event is taken off the stream
        if self._last_event_id is None:
            self.connect()
        idle_since = time.monotonic()
        while True:
            event = self.next_event(min(poll_s, idle_timeout_s))
            if event is None:
                if time.monotonic() - idle_since > idle_timeout_s:
                    raise FastLLMEventTimeout(
                        f"no Fast-LLM event on {self.events_stream!r} for {idle_timeout_s:.0f} s"
                    )
                continue
            idle_since = time.monotonic()
            if isinstance(event, TrainingFinished):
                self.finished = True
                self.close()
                return list(self.versions)
            self.take(event)

    def take(self, event: WeightsReady) -> ReceivedVersion:
        """Receive the version ``event`` announces (guarded unless ``guarded=False``; staged in
        ``SyncMode.STAGED``), then pass it on R2R if this receiver is the R2R source."""
        source = self.r2r is not None and self.r2r.is_source
        try:
            try:
                self._torn_park.check_thread("take()")
            except RolloutSyncError:
                self.close()  # this version's stream stays unread: out of step with the trainer
                raise
            if self._mode is SyncMode.STAGED:
                received = self._receive_staged(event)
            elif self.guarded:
                received = self.receive_weights(event)
            else:
                with weight_sync_bracket(
                    None, name="receive_weights", pause=False, hold=False, timeline=self.timeline
                ) as bracket:
                    received = self._receive(event)
                assert bracket.report is not None
                self.on_weight_sync_report(bracket.report)
        except Exception as exc:
            if source:
                # The other replicas wait for this version's manifest: tell them none comes
                # (they raise ManifestRejected at once, writing nothing).
                assert self.r2r is not None
                self.r2r.abort(
                    f"replica {self.rank} could not receive step {event.step}: "
                    f"{type(exc).__name__}",
                    version=event.version,
                )
            raise
        if source:
            if self.guarded:
                self.send_weights_r2r()
            else:
                self._send_r2r()
        return received

    def _receive_staged(self, event: WeightsReady) -> ReceivedVersion:
        """``SyncMode.STAGED``: receive in a bracket that holds payload egress (the
        collective's hazard) but does not pause; :meth:`_receive` parks generation for the
        install alone. Unguarded: neither hold nor park."""
        bracket: WeightSyncBracket | None = None
        try:
            with weight_sync_bracket(
                self.rollout,
                self.payload_egress_components() if self.guarded else (),
                name="receive_weights_staged",
                mode=SyncMode.STAGED,
                pause=False,
                hold=self.guarded,
                timeout=self.weight_sync_timeout,
                timeline=self.timeline,
            ) as bracket:
                return self._receive(event, bracket)
        finally:
            if bracket is not None and bracket.report is not None:
                self.last_weight_sync_report = bracket.report
                self.on_weight_sync_report(bracket.report)

    def _receive(
        self, event: WeightsReady, bracket: WeightSyncBracket | None = None
    ) -> ReceivedVersion:
        """Receive the version ``event`` announces, install it and commit it.

        ``bracket`` is a staged sync's (not paused): everything up to the install (the stream,
        its checks) runs while generation goes on, into buffers of this receiver's, and the
        install and the commit run parked (:meth:`_parked_install`). ``None``: the caller
        paused generation for the whole receive (the guard), or nothing does (unguarded).
        """
        try:
            self.rollout.ensure_initialized()
            served = self.rollout.served_weights()
            start = time.perf_counter()
            if self.group is not None:
                staged, dropped, nbytes = self._stream_into(served, event)
                tensors, version = len(staged), event.version

                def install() -> None:
                    self._install_stream(staged, served, event)
                    self.rollout.commit_weight_version(version)

            elif self.r2r is not None and not self.r2r.is_source:
                stats, install = self._receive_r2r(served, bracket)
                tensors, dropped, nbytes, version = stats.tensors, 0, stats.nbytes, stats.version
            else:
                raise RolloutSyncError(
                    "this FastLLMReceiver is neither in the trainer's group nor an R2R receiver"
                )
            with self._parked_install(bracket):
                install()
        except BaseException:
            # Paused still (the guard's pause; a staged install parked inside its stall), so
            # no forward runs before the park. A staged stream that failed tore nothing.
            self._torn_park.hold_if_torn(self.weight_sync_timeout)
            raise
        self._torn_park.release()
        if not self._engine_started and isinstance(self.rollout, BackgroundEngine):
            # Inside the first sync's bracket, after the version landed (paused: it begins
            # parked; staged: the install is done, it begins serving).
            self.rollout.start()
            self._engine_started = True
        received = ReceivedVersion(
            version, event.step, tensors, dropped, nbytes, time.perf_counter() - start
        )
        self.versions.append(received)
        self.versions_received += 1
        if self.on_version is not None:
            self.on_version(received, served)
        return received

    @contextmanager
    def _parked_install(self, bracket: WeightSyncBracket | None) -> Iterator[None]:
        """Generation parked for the body: a staged sync's stall (``bracket.stalled()``,
        counted into its report's ``stall_s``), or nothing more where the caller paused for
        the whole sync. A body that left the weights torn takes the torn park before the
        stall ends, so no forward runs on them."""
        park: AbstractContextManager[None] = (
            bracket.stalled(pause=self.guarded) if bracket is not None else contextlib.nullcontext()
        )
        with park:
            try:
                yield
                # The install's device work completes before generation resumes.
                device_fence(self.weight_sync_timeout)
            except BaseException:
                self._torn_park.hold_if_torn(self.weight_sync_timeout)
                raise

    def _receive_r2r(
        self, served: Mapping[str, torch.Tensor], bracket: WeightSyncBracket | None
    ) -> tuple[TransferStats, Callable[[], None]]:
        """The R2R receive, as the rollout worker does it; returns its stats and the install
        (which commits). In place (``bracket`` is ``None``): a failure after a write marks the
        weights torn. Staged: into :attr:`staging`, the served weights untouched until the
        install. Either way a failure that left every byte here intact still installs and
        commits that version before it is raised."""
        assert self.r2r is not None
        if bracket is None:
            try:
                stats = self.r2r.receive(
                    served,
                    allow_subset=self.allow_subset,
                    storage=self.rollout.flat_weight_storage(),
                )
            except BaseException as exc:  # fail closed: only the transfer's word clears a write
                settle_failed_receive(self.rollout, served, exc)
                raise

            def install_in_place() -> None:
                reload_received(self.rollout, served)
                self.rollout.commit_weight_version(stats.version)

            return stats, install_in_place
        if self.staging is None:
            self.staging = StagingArea.of(self.rollout)
        staging = self.staging
        staging.begin(served)
        try:
            stats = self.r2r.receive(
                staging.tensors,
                allow_subset=self.allow_subset,
                write_kind=BUFFER_WRITE,
                storage=staging.storage,
            )
        except WeightTransferError as exc:
            if exc.complete and exc.version is not None:  # whole here: serve it, as in place
                staging.staged(exc.version)
                with self._parked_install(bracket):
                    staging.install_into(self.rollout)
            else:
                staging.discard()
            raise
        except BaseException:
            staging.discard()
            raise
        staging.staged(stats.version)

        def install_staged() -> None:
            staging.install_into(self.rollout)  # load_weights, then the commit

        return stats, install_staged

    receive_weights = weight_sync_handler(_receive)
    """The receive, guarded: pause, hold egress, lazy init, stream, write, fence, release."""

    def _send_r2r(self) -> TransferStats:
        assert self.r2r is not None
        try:
            self.rollout.check_servable()
        except Exception as exc:
            self.r2r.abort(f"the source cannot send: {type(exc).__name__}: {exc}")
            raise
        return self.r2r.send(
            self.rollout.served_weights(),
            version=self.rollout.weight_version,
            storage=self.rollout.flat_weight_storage(),
        )

    send_weights_r2r = holds_payload_egress(_send_r2r)
    """The R2R broadcast to the other replicas: reads the served tensors, egress held."""

    def stop_engine(self, timeout: float = 60.0) -> None:
        """End serving (after ``serve`` returns): let generation go if torn weights kept it
        parked (an engine stops only unparked), then stop a background engine this receiver
        started.

        Raises:
            RolloutSyncError: called on another thread than the one whose failed receive
                parked generation (that thread must release the pause).
        """
        self._torn_park.check_thread("stop_engine()")
        self._torn_park.release()
        if self._engine_started and isinstance(self.rollout, BackgroundEngine):
            self._engine_started = False
            self.rollout.stop(timeout)

    # -- the stream ---------------------------------------------------------------------------

    def _stream_into(
        self, served: Mapping[str, torch.Tensor], event: WeightsReady
    ) -> tuple[dict[str, torch.Tensor], int, int]:
        """Receive one whole stream and check it. Staged (``stage=True``), nothing served is
        touched: the accepted tensors land in buffers of their own, for
        :meth:`_install_stream` to write once the end marker came and every check passed. In
        place (``stage=False``), each accepted tensor is received straight into the served one.

        Returns (the accepted tensors by name, tensors dropped, bytes received).

        Raises:
            WeightTransferError: ``stage=False`` and the stream failed (chained as its cause)
                or was refused after an in-place write: the weights are marked torn.
        """
        group = self.group
        assert group is not None
        # A tensor is received even when refused (to stay in step with the trainer), but no
        # allocation is made for more than 8x the largest served tensor (float64 for float8).
        largest = 8 * max((t.numel() * t.element_size() for t in served.values()), default=0)
        staged: dict[str, torch.Tensor] = {}
        came: set[str] = set()  # served names whose tensor came, accepted or refused
        problems: list[str] = []
        sentinels = _TailSentinels(event.step)
        written = dropped = nbytes = 0
        drop: torch.Tensor | None = None  # where dropped tensors are received, reused
        what = f"Fast-LLM weights of step {event.step}"
        try:
            length = torch.zeros(1, dtype=torch.int64, device=group.device)
            while True:
                group.receive(length, f"{what}: header length")
                n = int(length.item())
                if not 0 < n <= self.max_header_bytes:
                    raise UnsafeHeaderError(
                        f"{what}: a header of {n} bytes (the receiver accepts 1 .. "
                        f"{self.max_header_bytes})"
                    )
                raw = torch.empty(n, dtype=torch.uint8, device=group.device)
                group.receive(raw, f"{what}: header")
                header = decode_header(raw.cpu().numpy().tobytes())
                if header is None:
                    break
                if header.nbytes > largest:
                    raise UnsafeHeaderError(
                        f"{what}: {header.name} ({header.shard}) announces {header.nbytes} bytes, "
                        f"more than 8x any served tensor ({largest})"
                    )
                if header.shard == "weights" and header.name in served:
                    came.add(header.name)
                target, problem = self._target(header, served, staged)
                if problem is not None:
                    problems.append(problem)
                if target is None:  # another shard, or refused: received to stay in step
                    if drop is None or drop.numel() < header.nbytes:  # one buffer, grown
                        drop = torch.empty(header.nbytes, dtype=torch.uint8, device=group.device)
                    scratch = drop[: header.nbytes].view(header.dtype).view(header.shape)
                    sentinels.arm(scratch, header)
                    group.receive(scratch, f"{what}: {header.name}")
                    dropped += header.shard != "weights"
                elif not self._in_place:
                    armed = sentinels.arm(target, header)
                    group.receive(target, f"{what}: {header.name}")
                    sentinels.watch(armed)
                    staged[header.name] = target
                else:
                    with self._write_span(header.name):
                        written += 1  # counted first: a failed receive leaves it half-written
                        armed = sentinels.arm(target, header)
                        group.receive(target, f"{what}: {header.name}")
                    sentinels.watch(armed)
                    staged[header.name] = target
                nbytes += header.nbytes
        except BaseException as exc:
            # Out of step with the trainer (or it is gone): leave the group.
            self.close()
            if written and self._in_place:
                torn = self._torn(
                    served, event, written, "the stream failed", f". {type(exc).__name__}: {exc}"
                )
                if isinstance(exc, Exception):
                    raise torn from exc
            raise
        problems.extend(sentinels.shortfalls())
        missing = [] if self.allow_subset else sorted(set(served) - came)
        if missing:
            problems.append(
                f"{len(missing)} served tensor(s) did not come: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        if problems:
            if written:  # the problems, listed once, are the cause (its .problems too)
                refused = WeightMismatchError(problems, context=f"{what}: refused")
                why = f"refused at the end marker ({len(problems)} problem(s))"
                raise self._torn(served, event, written, why, "; see the cause") from refused
            raise WeightMismatchError(problems, context=f"{what}: refused, nothing written")
        return staged, dropped, nbytes

    @property
    def _in_place(self) -> bool:
        """Whether the stream is received straight into the served tensors (never staged)."""
        return not self.stage  # STAGED with stage=False is refused at construction

    def _install_stream(
        self,
        staged: Mapping[str, torch.Tensor],
        served: Mapping[str, torch.Tensor],
        event: WeightsReady,
    ) -> None:
        """Write an accepted stream into the served weights (in place, it is there already:
        hand it to an engine that overrides ``load_weights``)."""
        if self._in_place:
            reload_received(self.rollout, served)
        else:
            self._write(staged, served, event)

    def _torn(
        self,
        served: Mapping[str, torch.Tensor],
        event: WeightsReady,
        written: int,
        why: str,
        detail: str,
    ) -> WeightTransferError:
        """The error of a version that failed after ``written`` served tensors were written;
        the weights are marked torn as the rollout worker marks them
        (:func:`~rollout_sync.worker.settle_failed_receive`)."""
        error = WeightTransferError(
            f"Fast-LLM weights of step {event.step}: {why} after {written} served tensor(s) "
            "were written, so the served weights are torn: generation stays parked until a "
            f"complete version lands{detail}",
            operation=f"receive Fast-LLM weights of step {event.step}",
            version=event.version,
            tensors_written=written,
        )
        settle_failed_receive(self.rollout, served, error)
        return error

    def _target(
        self,
        header: TensorHeader,
        served: Mapping[str, torch.Tensor],
        staged: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor | None, str | None]:
        """Where to receive ``header``'s tensor, or ``None`` (drop) and why it is refused."""
        if header.shard != "weights":
            return None, None
        tensor = served.get(header.name)
        if tensor is None:
            return None, f"{header.name}: not a served weight"
        if header.name in staged:
            return None, f"{header.name}: sent twice"
        if tuple(tensor.shape) != header.shape or tensor.dtype != header.dtype:
            return None, (
                f"{header.name}: announced {list(header.shape)} {header.dtype}, served "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        if self._in_place:
            return tensor, None
        device = self.group.device if self.group is not None else tensor.device
        return torch.empty(header.shape, dtype=header.dtype, device=device), None

    def _write(
        self,
        staged: Mapping[str, torch.Tensor],
        served: Mapping[str, torch.Tensor],
        event: WeightsReady,
    ) -> None:
        """Write a complete, accepted version into the served weights (an engine's own
        ``load_weights`` marks its weights torn itself when a write fails half-way).

        Raises:
            WeightTransferError: a copy failed (its cause chained); the weights are marked torn.
        """
        if type(self.rollout).load_weights is not RolloutBase.load_weights:
            self.rollout.load_weights(staged, require_all=not self.allow_subset)
            return
        written = 0
        try:
            with torch.no_grad():
                for name, tensor in staged.items():
                    with self._write_span(name):
                        written += 1  # counted first: a failed copy leaves it half-written
                        served[name].copy_(tensor)
        except BaseException as exc:
            if written:
                torn = self._torn(
                    served, event, written, "a copy failed", f". {type(exc).__name__}: {exc}"
                )
                if isinstance(exc, Exception):
                    raise torn from exc
            raise

    def _write_span(self, name: str) -> AbstractContextManager[Any]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(SpanKind.WEIGHT_WRITE, name)


@dataclass(frozen=True)
class _TrainerGroup:
    """The trainer's broadcast group as the NCCL rule
    (:func:`~rollout_sync.staging.check_two_communicators`) reads a transfer: its backend."""

    backend: str


@dataclass(frozen=True)
class _Armed:
    """A receive buffer whose tail holds the sentinel of ``header``'s tensor."""

    header: TensorHeader
    raw: torch.Tensor
    """The buffer's bytes (a flat ``uint8`` view)."""
    tile: torch.Tensor
    """The sentinel bytes written over the last ``tile.numel()`` of them."""


class _TailSentinels:
    """Catches a tensor that arrives shorter than its header announced.

    On gloo a broadcast whose sender sends fewer bytes than the receive buffer holds completes
    without an error, writing the front of the buffer only, and the stream stays in step (the
    next receive gets the next frame); the protocol has no checksum. So before each receive
    :meth:`arm` writes a pattern over the buffer's tail (its last 16 KiB at most), and after the
    end marker :meth:`shortfalls` names every tensor whose last 8 bytes still hold it.

    The pattern is the 8-byte blake2b digest of the version's step and the tensor's shard and
    name, repeated:

    * every receiver derives the same one: gloo's broadcast is a tree, and a receiver relays its
      whole buffer, pattern included, to the next, which must recognise it (a pattern drawn at
      random by each receiver would pass a relayed short tensor as complete);
    * it is unrelated to weight values and new for every tensor and version, so an honest
      tensor's last 8 bytes equal it with probability 2**-64 whatever the values are (a fixed
      pattern, a NaN payload or zeros, coincides with real weights), and a coincidence does not
      repeat at the next version.

    No check of the received bytes can be exact: a tensor short by ``d`` bytes differs from an
    honest one only in the ``d`` bytes the sender never wrote, so catching every ``d``-byte
    shortfall would refuse honest tensors with probability ``256**-d``. A shortfall of 8 bytes
    or more is always caught; a smaller one (under two float32 elements) is not. A tensor of
    fewer than 8 bytes is checked over all its bytes.

    Bookkeeping only (the receives are the caller's): nothing here waits for the device before
    :meth:`shortfalls`, which reads every check in one transfer.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._watched: list[tuple[_Armed, torch.Tensor]] = []
        """Per tensor to be written: its armed buffer and a 0-dim bool on its device, true
        when its last bytes still held the pattern after the receive."""

    def arm(self, buffer: torch.Tensor, header: TensorHeader) -> _Armed:
        """Write ``header``'s pattern over the tail of ``buffer`` (contiguous), before the
        receive into it. Every receive is armed, refused and dropped tensors too: a receiver
        relays its buffer down gloo's tree."""
        raw = buffer.view(-1).view(torch.uint8)
        span = min(raw.numel(), _SENTINEL_SPAN_BYTES)
        digest = hashlib.blake2b(
            f"{self.step}/{header.shard}/{header.name}".encode(), digest_size=8
        ).digest()
        word = int.from_bytes(digest, sys.byteorder, signed=True)
        tile = torch.full((-(-span // 8),), word, dtype=torch.int64, device=raw.device)
        armed = _Armed(header, raw, tile.view(torch.uint8)[:span])
        if span:
            with torch.no_grad():
                raw[raw.numel() - span :].copy_(armed.tile)
        return armed

    def watch(self, armed: _Armed) -> None:
        """After the receive into ``armed``'s buffer (a tensor to be written): note whether its
        last bytes still hold the pattern."""
        n = armed.raw.numel()
        if n:
            width = min(n, _SENTINEL_CHECK_BYTES)
            span = armed.tile.numel()
            flag = (armed.raw[n - width :] == armed.tile[span - width :]).all()
            self._watched.append((armed, flag))

    def shortfalls(self) -> list[str]:
        """One problem per watched tensor that arrived short, naming it and the byte counts."""
        if not self._watched:
            return []
        device = self._watched[0][1].device
        short = torch.stack([flag.to(device) for _, flag in self._watched]).tolist()
        return [_shortfall(armed) for (armed, _), s in zip(self._watched, short, strict=True) if s]


def _shortfall(armed: _Armed) -> str:
    """What arrived of ``armed``'s tensor: the bytes before the last one that differs from the
    pattern (rounded up to whole elements: a real byte equal to the pattern's is counted as
    missing, with probability ``256**-element_size``)."""
    header, raw, tile = armed.header, armed.raw, armed.tile
    n, span = raw.numel(), tile.numel()
    differs = (raw[n - span :] != tile).nonzero()
    if differs.numel():
        element = header.dtype.itemsize
        arrived = n - span + int(differs[-1]) + 1
        arrived = min(-(-arrived // element) * element, n - min(n, _SENTINEL_CHECK_BYTES))
        count = f"{arrived} of the {n} bytes"
    else:
        count = f"{'at most ' if n > span else ''}{n - span} of the {n} bytes"
    return (
        f"{header.name}: {count} its header announces arrived ({list(header.shape)} "
        f"{header.dtype}): the trainer sent a shorter tensor"
    )


def _socket_timeout(redis: Any) -> float | None:
    """A redis-py client's socket timeout (seconds), or ``None`` when its calls are unbounded."""
    pool = getattr(redis, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {}) if pool is not None else {}
    timeout = kwargs.get("socket_timeout")
    return float(timeout) if timeout else None


class FastLLMRolloutSender:
    """Ships rollouts to a Fast-LLM trainer as ``fast_llm_streaming`` records (XADD), from a
    sender thread, in order.

    :meth:`submit` queues (blocking, bounded by its timeout, while ``capacity`` records wait).
    :meth:`hold_sends` stops launching records and waits for the one in flight; records
    submitted meanwhile wait, in order, and go when the hold ends. :meth:`flush_pending_sends`
    waits until every record submitted before it is in Redis. A record Redis refused is counted
    in ``failed``; that error is then raised by every later ``submit`` and flush (the sender is
    broken: make a new one).
    """

    def __init__(
        self,
        redis: Any,
        *,
        stream: str = ROLLOUTS_STREAM,
        capacity: int = 256,
        timeline: Timeline | None = None,
        default_timeout: float = 60.0,
    ) -> None:
        self.redis, self.stream, self.capacity = redis, stream, capacity
        self.timeline = timeline
        self.default_timeout = default_timeout
        self.submitted = self.sent = self.failed = 0
        self._queue: collections.deque[dict[str, bytes]] = collections.deque()
        self._cond = threading.Condition()
        self._held = 0
        self._in_flight = False
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fast-llm-rollouts", daemon=True)
        self._thread.start()

    def submit(
        self,
        tokens: Sequence[int] | torch.Tensor,
        old_log_probabilities: Sequence[float] | torch.Tensor,
        model_version: Sequence[int] | torch.Tensor,
        data: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Queue one rollout (see :func:`~rollout_sync.integrations.fast_llm_wire.encode_rollout`).

        Raises:
            ValueError: per-token arrays of different lengths.
            PayloadBackpressureTimeout: ``capacity`` records still waited after ``timeout``.
            FastLLMProtocolError: an earlier record failed to reach Redis.
        """
        record = encode_rollout(tokens, old_log_probabilities, model_version, data)
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)
        with self._cond:
            self._raise_if_failed()
            if self._closing:
                raise FastLLMProtocolError("the rollout sender is closed")
            if not self._cond.wait_for(
                lambda: len(self._queue) < self.capacity, wait_arg(deadline)
            ):
                raise PayloadBackpressureTimeout(
                    f"{self.capacity} rollouts still waited for Redis after {limit:.1f} s",
                    operation="queue a rollout",
                    timeout=limit,
                )
            self._queue.append(record)
            self.submitted += 1
            self._cond.notify_all()

    @contextmanager
    def hold_sends(self, timeout: float | None = None) -> Iterator[None]:
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)
        with self._cond:
            self._held += 1
            if not self._cond.wait_for(lambda: not self._in_flight, wait_arg(deadline)):
                self._held -= 1
                self._cond.notify_all()
                raise EgressHoldTimeout(
                    f"a rollout send to Redis was still in flight after {limit:.1f} s",
                    operation="hold rollout sends",
                    timeout=limit,
                    sections_running=1,
                )
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        """Return once every record submitted before this call is in Redis (or failed).

        Raises:
            PayloadTimeout: they were not all sent within ``timeout`` (a hold still on?).
            FastLLMProtocolError: a record failed to reach Redis.
        """
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)
        with self._cond:
            target = self.submitted
            if not self._cond.wait_for(
                lambda: self._error is not None or self.sent + self.failed >= target,
                wait_arg(deadline),
            ):
                raise PayloadTimeout(
                    f"{target - self.sent - self.failed} rollout(s) still waited for Redis after "
                    f"{limit:.1f} s",
                    operation="flush rollouts to Redis",
                    timeout=limit,
                )
            self._raise_if_failed()

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop the sender thread. Later submits raise.

        Raises:
            PayloadTimeout: records still waited after ``timeout`` (a hold never released):
                they are counted in ``failed`` and dropped, and the error says how many.
        """
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)  # one limit for the flush and the join together
        try:
            self.flush_pending_sends(limit)
        finally:
            with self._cond:
                self._closing = True
                self.failed += len(self._queue)
                self._queue.clear()
                self._cond.notify_all()
            self._thread.join(wait_arg(deadline))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise FastLLMProtocolError(
                f"a rollout could not be added to Redis stream {self.stream!r}: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (self._queue and not self._held))
                if not self._queue or self._held:
                    if self._closing:
                        return
                    continue
                record = self._queue.popleft()
                self._in_flight = True
                self._cond.notify_all()
            try:
                span = (
                    self.timeline.span(SpanKind.PAYLOAD_SEND, "rollout to redis")
                    if self.timeline is not None
                    else contextlib.nullcontext()
                )
                with span:
                    self.redis.xadd(self.stream, record)
            except Exception as exc:  # noqa: BLE001 - kept and raised by the next call
                with self._cond:
                    self.failed += 1
                    self._error = exc
            else:
                with self._cond:
                    self.sent += 1
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()
