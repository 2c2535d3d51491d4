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
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .._deadline import deadline_after, expired, limit_of, remaining, wait_arg
from ..backend import RolloutBase
from ..errors import (
    EgressHoldTimeout,
    FastLLMEventTimeout,
    FastLLMProtocolError,
    PayloadBackpressureTimeout,
    PayloadTimeout,
    RolloutSyncError,
)
from ..guard import (
    SyncReport,
    device_fence,
    holds_payload_egress,
    weight_sync_handler,
)
from ..staging import StagingArea, check_two_communicators
from ..sync.contract import InstallStrategy, SupportsWeightTransfer
from ..sync.mode import SyncMode
from ..sync.slot import EngineSlot
from ..sync.staged import Staged
from ..sync.table import strategy_for
from ..trace import SpanKind, Timeline
from ..transfer import TransferStats, WeightTransfer
from ..worker import DEFAULT_HISTORY, bounded_history
from .fast_llm_stream import FastLLMStream
from .fast_llm_wire import (
    EVENTS_STREAM,
    MAX_HEADER_BYTES,
    ROLLOUTS_STREAM,
    BroadcastGroup,
    TrainingFinished,
    WeightsReady,
    encode_rollout,
    parse_event,
)

__all__ = ["FastLLMReceiver", "FastLLMRolloutSender", "ReceivedVersion"]


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
        staging: ``SyncMode.STAGED``: the staging copy of the served weights (built by the first
            receive), else ``None``.

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
        self.last_weight_sync_report: SyncReport | None = None
        # What the install strategies read of their host, beyond the guard's settings: the
        # trainer's stream is handed over per version, not as a P2R transfer, and there is no
        # vote to take with one receiver per stream: what lands whole here installs.
        self.p2r: SupportsWeightTransfer | None = None
        self.p2r_barrier: Callable[[float], None] | None = None
        self.staging_device: torch.device | str | None = None
        self.all_or_none = False
        self._slot = EngineSlot(rollout, "FastLLMReceiver", park_every_engine=True)
        """Torn weights keep generation parked, whatever the backend, until a complete version
        lands here (or ``stop_engine``)."""
        self._strategy: InstallStrategy = strategy_for(mode)(self, self._slot)
        self._stream: FastLLMStream | None = None

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

    @property
    def staging(self) -> StagingArea | None:
        """``SyncMode.STAGED``: the staging copy of the served weights (once a receive built
        it); else ``None``."""
        if not isinstance(self._strategy, Staged):
            return None
        return self._strategy.stagings.get(None)

    def weight_sync_fence(self, timeout: float | None) -> None:
        device_fence(timeout)

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
            self._stream = FastLLMStream(
                self.group,
                max_header_bytes=self.max_header_bytes,
                stage=self.stage,
                timeline=self.timeline,
                on_broken=self.close,
            )

    def close(self) -> None:
        """Leave the trainer's group (idempotent). Torn weights stay parked: see
        :meth:`stop_engine`."""
        group, self.group, self._stream = self.group, None, None
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
        self._slot.torn_park.check_thread("serve()")  # before an event is taken off the stream
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
                self._slot.torn_park.check_thread("take()")
            except RolloutSyncError:
                self.close()  # this version's stream stays unread: out of step with the trainer
                raise
            start = time.perf_counter()
            transfer = self._transfer_for(event)
            if self._mode is SyncMode.STAGED:
                name = "receive_weights_staged"
            else:
                name = "_receive" if self.guarded else "receive_weights"
            received = self._landed(event, self._strategy.receive(transfer, name), start)
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

    def _receive(self, event: WeightsReady) -> ReceivedVersion:
        """Receive and commit the version ``event`` announces, in place, in the caller's
        bracket (the decorated :attr:`receive_weights`)."""
        start = time.perf_counter()
        stats = self._strategy.receive_in_place(self._transfer_for(event))
        return self._landed(event, stats, start)

    receive_weights = weight_sync_handler(_receive)
    """The receive, guarded: pause, hold egress, lazy init, stream, write, fence, release."""

    def _transfer_for(self, event: WeightsReady) -> SupportsWeightTransfer:
        """The wire ``event``'s version comes over: the trainer's stream, or the R2R."""
        if self._stream is not None:
            self._stream.expect(event)
            return self._stream
        if self.r2r is not None and not self.r2r.is_source:
            return self.r2r
        raise RolloutSyncError(
            "this FastLLMReceiver is neither in the trainer's group (connect() joins it) nor an "
            "R2R receiver"
        )

    def _landed(self, event: WeightsReady, stats: TransferStats, start: float) -> ReceivedVersion:
        dropped = self._stream.dropped if self._stream is not None else 0
        seconds = time.perf_counter() - start
        received = ReceivedVersion(
            stats.version, event.step, stats.tensors, dropped, stats.nbytes, seconds
        )
        self.versions.append(received)
        self.versions_received += 1
        if self.on_version is not None:
            self.on_version(received, self.rollout.served_weights())
        return received

    def _send_r2r(self) -> TransferStats:
        assert self.r2r is not None
        return self._strategy.send(self.r2r, self._strategy.served_to_send)

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
        self._slot.stop_engine(timeout, what="stop_engine()")


@dataclass(frozen=True)
class _TrainerGroup:
    """The trainer's broadcast group as the NCCL rule
    (:func:`~rollout_sync.staging.check_two_communicators`) reads a transfer: its backend."""

    backend: str


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
