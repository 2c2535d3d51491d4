"""The trainer side: callbacks that return step metrics, and the one that ships the weights.

A trainer calls its callbacks at three points: :meth:`TrainerCallback.run_begin`, after every
step :meth:`TrainerCallback.step_end`, and :meth:`TrainerCallback.train_end`. ``step_end`` may
return scalar metrics; :func:`merge_step_metrics` (or :class:`TrainerCallbacks`, which calls a
list of callbacks) merges them into the step's training metrics, and a key that two sources
both use is an error (:class:`~rollout_sync.errors.MetricKeyCollisionError`), never a silent
override of a training metric.

:class:`WeightBroadcastCallback` is the streaming callback: on every successful step it
announces ``(step, version)`` on a :class:`CommandChannel` the rollout side listens to, then
pushes the full weights through a :class:`WeightPusher`, timing gather, announcement and push
with a :class:`~rollout_sync.WeightSyncTimer`, and reports ``weight_sync_time_ms`` from
``step_end``. docs/metrics.md lists every metric name, trainer and rollout side.

The two seams are Protocols so that other transports plug in:

* :class:`WeightPusher`: ``push_weights(weights, *, version, timeout)``. The default,
  :class:`TransferWeightPusher`, is the P2R send of a bucketed, manifest-validated
  :class:`~rollout_sync.WeightTransfer` (with the trainer's payload receives held for it when
  given a receiver); :class:`BroadcastWeightPusher` is the plain per-tensor broadcast, kept by
  name for receivers that speak it (a plain function of the same arguments is accepted too).
* :class:`CommandChannel`: ``announce(command, timeout)`` on the trainer, ``receive(timeout)``
  on the rollout side. :class:`BroadcastCommandChannel` broadcasts a fixed six-integer header
  over the same group; :class:`QueueCommandChannel` is its in-process twin.
"""

from __future__ import annotations

import enum
import math
import numbers
import queue
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ._deadline import wait_collective
from .distributed import group_ranks
from .errors import (
    CollectiveError,
    CollectiveTimeout,
    MetricKeyCollisionError,
    WeightBroadcastError,
    WeightBroadcastTimeout,
)
from .metrics import TimedSample, WeightSyncTimer
from .payload.receiver import PayloadReceiver
from .trace import SpanKind
from .transfer import ShardedTransfer, TransferConfig, TransferStats, WeightTransfer
from .transfer._sharded_delta import ShardedDeltaEncoder
from .transfer.delta_sync import DeltaEncoder, WholeReason
from .weights import WeightMismatchError

__all__ = [
    "BroadcastCommandChannel",
    "BroadcastWeightPusher",
    "CommandChannel",
    "CommandKind",
    "QueueCommandChannel",
    "TrainerCallback",
    "TrainerCallbacks",
    "TransferWeightPusher",
    "WeightBroadcastCallback",
    "WeightBroadcastStatistics",
    "WeightPusher",
    "WeightSyncCommand",
    "merge_step_metrics",
]

DEFAULT_BROADCAST_TIMEOUT_S = 300.0


# -- callbacks and the merge -------------------------------------------------------------------


class TrainerCallback:
    """A hook into the training loop; override what you need, every method defaults to nothing.

    The trainer calls :meth:`run_begin` once before the first step, :meth:`step_end` after every
    step (successful or not) and :meth:`train_end` once at the end. ``step_end`` may return a
    dict of scalar metrics (numbers or strings; not tensors, whose ``.item()`` would stall the
    host) to be merged into the step's training metrics; the base returns None.
    """

    @property
    def metrics_source(self) -> str:
        """How merge errors name this callback."""
        return type(self).__name__

    def run_begin(self, step: int) -> None:
        """Called once before training starts (``step`` is the first step, or the resumed one)."""

    def step_end(
        self,
        step: int,
        reduced_losses: Mapping[str, float | int] | None = None,
        update_successful: bool = True,
        train_metrics: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Called after every step.

        Args:
            step: the step that just ended.
            reduced_losses: the step's losses, reduced over data-parallel ranks.
            update_successful: False when the optimizer skipped the update (a NaN gradient,
                say); the weights did not change.
            train_metrics: the metrics the trainer logs for this step, or None on a step it
                does not log. Read-only: return additions instead.

        Returns:
            Scalar metrics to merge into the step's training metrics, or None.
        """
        return None

    def train_end(self, step: int) -> None:
        """Called once after the last step."""


def merge_step_metrics(
    train_metrics: Mapping[str, Any] | None,
    contributions: Iterable[tuple[str, Mapping[str, Any] | None]],
    *,
    train_source: str = "train_metrics",
) -> dict[str, Any]:
    """The step's training metrics with every contribution added; a new dict.

    Args:
        train_metrics: the trainer's own metrics (None: none).
        contributions: ``(source name, metrics or None)`` pairs, e.g. one per callback.

    Raises:
        MetricKeyCollisionError: a key is already present (from the training metrics or an
            earlier contribution). Nothing is merged: the inputs are untouched.
        TypeError: a value is not a scalar (a number or a string).
    """
    merged: dict[str, Any] = dict(train_metrics) if train_metrics is not None else {}
    owner = dict.fromkeys(merged, train_source)
    for source, metrics in contributions:
        if metrics is None:
            continue
        for key, value in metrics.items():
            first = owner.get(key)
            if first is not None:
                raise MetricKeyCollisionError(
                    f"metric {key!r} from {source} collides with {key!r} from {first}; "
                    "a step metric is never silently overridden. Rename one of them (give the "
                    "callback's metrics a prefix).",
                    key=key,
                    first=first,
                    second=source,
                )
            _check_scalar(key, value, source)
            merged[key] = value
            owner[key] = source
    return merged


def _check_scalar(key: str, value: Any, source: str) -> None:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"metric {key!r} from {source} is a tensor; return a Python number instead "
            "(converting it here would synchronize the device)"
        )
    if not isinstance(value, (numbers.Number, str)):
        raise TypeError(
            f"metric {key!r} from {source} is a {type(value).__name__}; step metrics are "
            "scalars (numbers or strings)"
        )


class TrainerCallbacks:
    """Calls a list of callbacks in order and merges what their ``step_end`` return.

    ``step_end`` returns the merged training metrics (``train_metrics`` plus every callback's
    additions), or None on a step with no training metrics and nothing added. ``train_end``
    calls every callback even if one raises, then re-raises the first error.
    """

    def __init__(self, callbacks: Sequence[TrainerCallback] = ()) -> None:
        self.callbacks: list[TrainerCallback] = list(callbacks)

    def run_begin(self, step: int) -> None:
        for callback in self.callbacks:
            callback.run_begin(step)

    def step_end(
        self,
        step: int,
        reduced_losses: Mapping[str, float | int] | None = None,
        update_successful: bool = True,
        train_metrics: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Run every callback's ``step_end``; see :func:`merge_step_metrics` for what raises."""
        contributions = [
            (
                self._source(i, cb),
                cb.step_end(step, reduced_losses, update_successful, train_metrics),
            )
            for i, cb in enumerate(self.callbacks)
        ]
        if train_metrics is None and all(m is None for _, m in contributions):
            return None
        return merge_step_metrics(train_metrics, contributions)

    def train_end(self, step: int) -> None:
        first_error: BaseException | None = None
        for callback in self.callbacks:
            try:
                callback.train_end(step)
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error

    def _source(self, index: int, callback: TrainerCallback) -> str:
        return f"{callback.metrics_source} (callback #{index})"

    def __repr__(self) -> str:
        names = ", ".join(cb.metrics_source for cb in self.callbacks)
        return f"<TrainerCallbacks [{names}]>"


# -- the command channel -----------------------------------------------------------------------


class CommandKind(enum.IntEnum):
    """What a command tells the rollout side."""

    WEIGHTS = 1
    """New weights follow on the weight pusher: receive them."""
    STOP = 2
    """Training ended: nothing more will come."""


@dataclass(frozen=True)
class WeightSyncCommand:
    """One announcement from the trainer to the rollout side."""

    kind: CommandKind
    step: int
    version: int
    num_tensors: int = 0
    nbytes: int = 0
    """Bytes the weights that follow take, so a receiver can check its buffers first."""
    adapter: str | None = None
    """The LoRA adapter whose set follows, not the model's weights (:mod:`rollout_sync.lora`);
    a :class:`~rollout_sync.worker.WorkerCommandChannel` turns it into ``P2R(adapter=...)``
    and ``R2R(adapter=...)``."""


@runtime_checkable
class CommandChannel(Protocol):
    """Carries :class:`WeightSyncCommand` s from the trainer to the rollout side, in order."""

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        """Trainer side: send ``command``; raise within ``timeout`` seconds if it cannot."""

    def receive(self, timeout: float) -> WeightSyncCommand:
        """Rollout side: the next command; raise within ``timeout`` seconds if none comes."""


_HEADER_MAGIC = 0x52_53_59_4E_43  # "RSYNC": tells a command header from stray bytes
_HEADER_LEN = 6


class BroadcastCommandChannel:
    """Commands as a six-integer header broadcast from ``src`` over a process group.

    The header is ``[magic, kind, step, version, num_tensors, nbytes]`` (int64). Every member of
    the group must take part in each broadcast: the trainer (``src``) calls :meth:`announce`,
    every rollout rank calls :meth:`receive`, in the same order as the weight broadcasts that
    follow. It can share the group of :class:`BroadcastWeightPusher`: collectives on one group
    run in issue order, so a header is never mistaken for weights.

    Args:
        group: the process group (None: the default group).
        src: the global rank of the trainer.
        device: where the header lives: ``"cpu"`` for gloo; the rank's CUDA device for NCCL.
            On CUDA the trainer's header goes through pinned memory with a non-blocking copy,
            so announcing does not stall the host; a receiver's read of the header does wait
            for it (bounded by the group's timeout on NCCL, by ``timeout`` on gloo).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        src: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.group = group
        self.src = src
        self.device = torch.device(device)

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        """Broadcast ``command`` as a fixed six-integer header.

        Raises:
            ValueError: the command names a LoRA adapter, which the header cannot carry (use a
                :class:`~rollout_sync.worker.WorkerCommandChannel`).
        """
        if command.adapter is not None:
            raise ValueError(
                f"BroadcastCommandChannel carries integers only, not the adapter name "
                f"{command.adapter!r}: announce adapter syncs on a WorkerCommandChannel"
            )
        values = [
            _HEADER_MAGIC,
            int(command.kind),
            command.step,
            command.version,
            command.num_tensors,
            command.nbytes,
        ]
        header = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            header = header.pin_memory().to(self.device, non_blocking=True)
        _broadcast_and_wait(
            header,
            self.src,
            self.group,
            timeout,
            f"announcing {command.kind.name} step {command.step}",
        )

    def receive(self, timeout: float) -> WeightSyncCommand:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        _broadcast_and_wait(header, self.src, self.group, timeout, "receiving a command")
        magic, kind, step, version, num_tensors, nbytes = (int(v) for v in header.tolist())
        if magic != _HEADER_MAGIC:
            raise WeightBroadcastError(
                f"received a command header with magic {magic:#x}, expected {_HEADER_MAGIC:#x}: "
                "trainer and rollout side disagree on the order of broadcasts on this group "
                "(is another collective issued on it?)"
            )
        return WeightSyncCommand(CommandKind(kind), step, version, num_tensors, nbytes)

    def __repr__(self) -> str:
        return f"<BroadcastCommandChannel src={self.src} device={self.device}>"


class QueueCommandChannel:
    """An in-process :class:`CommandChannel`: a FIFO queue between two threads or objects."""

    def __init__(self) -> None:
        self._queue: queue.Queue[WeightSyncCommand] = queue.Queue()

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        self._queue.put(command, timeout=timeout)

    def receive(self, timeout: float) -> WeightSyncCommand:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise WeightBroadcastTimeout(
                f"no weight-sync command arrived within {timeout:.1f} s (is the trainer "
                "running, and announcing on this channel?)"
            ) from None

    def __len__(self) -> int:
        return self._queue.qsize()


# -- the weight pusher -------------------------------------------------------------------------


@runtime_checkable
class WeightPusher(Protocol):
    """Ships a full set of named weights to the rollout side.

    ``push_weights`` returns once the push is complete as far as the current CUDA stream is
    concerned: for a ``torch.distributed`` collective, after ``work.wait()`` (what
    ``async_op=False`` does), which orders the current stream after the transfer. That is what
    lets :class:`~rollout_sync.WeightSyncTimer` time it with an event recorded afterwards.
    It raises within ``timeout`` seconds if a peer does not take part (on NCCL, where waiting
    on the host is what must not happen, the process group's own timeout is the bound).
    """

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        """Push ``weights`` (in their mapping order) as ``version``."""


class BroadcastWeightPusher:
    """The per-tensor pusher: every tensor broadcast from ``src`` over a process group.

    One ``torch.distributed.broadcast`` per tensor, in the mapping's order, all launched and
    then waited for: on gloo within one ``timeout`` in total; on NCCL by ordering the current
    stream after them (no host wait; the group's own timeout bounds them). Plain: no buckets,
    no manifest checked before the first byte lands, no checksums, so a receiver writing in
    place must validate (:meth:`receive_weights` checks counts and bytes only). One collective
    per tensor costs: docs/distributed.md has it measured against the bucketed
    :class:`TransferWeightPusher`, the default. :meth:`receive_weights` is the receiving half.

    Args:
        group: the process group (None: the default group).
        src: the global rank of the trainer.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, src: int = 0) -> None:
        self.group = group
        self.src = src

    @property
    def backend(self) -> str:
        """The group's backend (``"gloo"``, ``"nccl"``): picks the timer's clock."""
        return str(dist.get_backend(self.group))

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        tensors = [t.detach().contiguous() for t in weights.values()]
        _broadcast_all(tensors, self.src, self.group, timeout, f"pushing weights v{version}")

    def receive_weights(
        self, into: Mapping[str, torch.Tensor], command: WeightSyncCommand, timeout: float
    ) -> None:
        """Receive a push announced by ``command`` into ``into`` (in its mapping order).

        ``into`` must be contiguous tensors matching what the trainer pushes; the tensor count
        and byte total are checked against the command first, and a mismatch raises
        :class:`~rollout_sync.WeightMismatchError` before taking part (the trainer's push then
        times out). Receive into a buffer, or call inside the weight-sync guard: the tensors are
        written in place as bytes arrive.
        """
        nbytes = sum(t.numel() * t.element_size() for t in into.values())
        if len(into) != command.num_tensors or nbytes != command.nbytes:
            raise WeightMismatchError(
                [
                    (
                        f"announced {command.num_tensors} tensors, {command.nbytes} bytes; "
                        f"receiving into {len(into)} tensors, {nbytes} bytes"
                    )
                ],
                context=f"weights v{command.version} (step {command.step})",
            )
        for name, tensor in into.items():
            if not tensor.is_contiguous():
                raise ValueError(f"cannot receive {name!r} into a non-contiguous tensor")
        _broadcast_all(
            list(into.values()),
            self.src,
            self.group,
            timeout,
            f"receiving weights v{command.version}",
        )

    def __repr__(self) -> str:
        return f"<BroadcastWeightPusher src={self.src}>"


class TransferWeightPusher:
    """The trainer's P2R as a :class:`WeightPusher`: a :class:`~rollout_sync.WeightTransfer`
    send, with the trainer's payload receives held for its collectives.

    Per push, in this order:

    1. ``barrier(timeout)``: the CPU-side barrier of the P2R pair
       (:meth:`~rollout_sync.worker.SyncGroups.p2r_barrier`), which the receiving replica
       reaches inside its bracket, paused and with its payload egress held;
    2. ``receiver.hold_receives(timeout)``: no payload receive runs on the data communicator
       from here until the send returns (a ``payload_hold`` span on the transfer's timeline);
    3. ``transfer.send(weights, version=version)``: manifest, vote, buckets, commit vote;
       each collective bounded by the transfer's own ``TransferConfig.timeout_s``.

    The hold comes after the barrier, never before it: a replica's pause may be waiting for a
    producer blocked on a full send registry, which drains only while the trainer still
    receives (docs/transport.md). So a receiver without a barrier is refused.

    **A sharded trainer** pushes with a :class:`~rollout_sync.transfer.ShardedTransfer` as
    ``transfer``: every trainer rank builds its own pusher (and its own
    :class:`WeightBroadcastCallback`, whose ``weights()`` returns that rank's local shards, no
    gather; announce on one rank's ``channel`` only) and every rank's ``push_weights`` runs at
    once; each sends only the regions it owns (docs/distributed.md, "Sharded trainers").

    Args:
        transfer: the P2R transfer on the trainer's rank (its source; one of the sources of a
            sharded transfer).
        barrier: the P2R barrier; ``None``: none (only without a receiver). The replica's
            ``RolloutWorker(p2r_barrier=...)`` must agree: with one side only, both raise
            :class:`~rollout_sync.errors.P2RBarrierMismatch` (on gloo, at once).
        receiver: the trainer's payload receiver to hold; ``None``: nothing is held (the
            unguarded demo, or a trainer that takes no payloads over the device).
        delta: send each version as its changes against the last one every replica committed
            (docs/delta.md): a :class:`~rollout_sync.transfer.delta_sync.DeltaEncoder` keeps
            one copy of what was sent (in the dtype sent, the served one). The first sync, a
            keyframe, a delta no smaller than the whole version, or a replica on another
            version goes whole, automatically (``last_stats.sync_kind``, ``whole_reason``).
            A :class:`~rollout_sync.transfer.ShardedTransfer` makes its own encoder
            (:meth:`~rollout_sync.transfer.ShardedTransfer.delta_encoder`: this rank's regions,
            each against the same region of the last committed version).
        full_every: with ``delta``, every ``full_every``-th sync goes whole (a keyframe).

    Attributes:
        last_stats: the :class:`~rollout_sync.transfer.TransferStats` of the last push.
        encoder: the :class:`~rollout_sync.transfer.delta_sync.DeltaEncoder` (``delta``; a
            sharded transfer's ``ShardedDeltaEncoder``), or ``None``.
        last_barrier_s: seconds the last push waited at the barrier (the replica parking).
        last_hold_s: seconds the last push waited for payload receives in flight.
    """

    def __init__(
        self,
        transfer: WeightTransfer | ShardedTransfer,
        *,
        barrier: Callable[[float], None] | None = None,
        receiver: PayloadReceiver | None = None,
        delta: bool = False,
        full_every: int | None = None,
    ) -> None:
        if full_every is not None and not delta:
            raise ValueError("full_every is the keyframe interval of delta syncs: pass delta=True")
        if not transfer.is_source:
            raise ValueError(
                f"TransferWeightPusher runs on a P2R source ({transfer!r}), "
                f"not on rank {dist.get_rank()}"
            )
        if receiver is not None and barrier is None:
            raise ValueError(
                "holding payload receives needs the P2R barrier first: without it the hold can "
                "wait for a replica that waits for this trainer to receive (pass "
                "barrier=sync_groups.p2r_barrier)"
            )
        self.transfer = transfer
        self.barrier = barrier
        self.receiver = receiver
        self.last_stats: TransferStats | None = None
        self.last_barrier_s = 0.0
        self.last_hold_s = 0.0
        self.encoder: DeltaEncoder | ShardedDeltaEncoder | None = None
        if delta:
            self.use_deltas(full_every=full_every)

    def use_deltas(self, *, full_every: int | None = None) -> None:
        """Send deltas from the next push on (``delta=True``; a base is kept from then).

        Raises:
            ValueError: the transfer moves whole versions only (its class's ``delta_syncs``
                is false), or ``full_every`` < 1. A sharded transfer gives its own encoder
                (:meth:`~rollout_sync.transfer.ShardedTransfer.delta_encoder`: each rank's
                regions).
        """
        if not getattr(self.transfer, "delta_syncs", False):
            raise ValueError(
                f"delta syncs need a transfer that moves them (delta_syncs); {self.transfer!r} "
                "moves whole versions only"
            )
        if isinstance(self.transfer, ShardedTransfer):
            self.encoder = self.transfer.delta_encoder(full_every=full_every)
        else:
            self.encoder = DeltaEncoder(full_every=full_every)

    @property
    def backend(self) -> str:
        """The transfer group's backend (``"gloo"``, ``"nccl"``): picks the timer's clock."""
        return str(dist.get_backend(self.transfer.group))

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        """Barrier, hold, send; see the class docstring.

        Raises:
            P2RBarrierMismatch: only one side takes the P2R barrier (this pusher's ``barrier``
                and the replica's ``RolloutWorker(p2r_barrier=...)`` must agree); raised by the
                barrier, or by the send when the replica takes one and this pusher does not.
                Nothing was written, and the group is still usable.
            CollectiveTimeout / CollectiveError: the barrier failed (the replica never parked).
            IngressHoldTimeout: a payload receive in flight did not complete within
                ``timeout``.
            WeightTransferError and its kinds: the transfer failed (see
                :meth:`~rollout_sync.WeightTransfer.send`).
        """
        start = time.perf_counter()
        if self.barrier is not None:
            self.barrier(timeout)
        barrier_done = time.perf_counter()
        hold: AbstractContextManager[None] = (
            nullcontext() if self.receiver is None else self.receiver.hold_receives(timeout)
        )
        hold_start_ns = time.monotonic_ns()
        with hold:
            held = time.perf_counter()
            try:
                self.last_stats = self._send(weights, version)
            finally:
                # The receiver's hold, from asking for it until the send ended (none when the
                # hold timed out: then the body never ran), on the receiver's own timeline.
                timeline = None if self.receiver is None else self.receiver.timeline
                if timeline is not None:
                    timeline.add_span(SpanKind.PAYLOAD_HOLD, "payload receives held", hold_start_ns)
        self.last_barrier_s = barrier_done - start
        self.last_hold_s = held - barrier_done

    def _send(self, weights: Mapping[str, torch.Tensor], version: int) -> TransferStats:
        """The send: whole, or (``delta``) encoded against the last committed version, whose
        copy moves to this one once every replica committed it."""
        encoder = self.encoder
        if encoder is None:
            return self.transfer.send(weights, version=version)
        encoded = encoder.encode(weights, version)
        stats = self.transfer.send(weights, version=version, delta=encoded)  # type: ignore[arg-type]
        delta = not isinstance(encoded, WholeReason) and stats.sync_kind == "delta"
        encoder.committed(weights, version, encoded if delta else None)  # type: ignore[arg-type]
        return stats

    def __repr__(self) -> str:
        held = "holding receives" if self.receiver is not None else "no receive hold"
        return f"<TransferWeightPusher {self.transfer!r}, {held}>"


def _default_pusher(timeout: float) -> TransferWeightPusher:
    """The validated, bucketed transfer over the default group from this rank."""
    if not dist.is_initialized():
        raise RuntimeError(
            "WeightBroadcastCallback with no pusher sends the weights with a WeightTransfer over "
            "torch.distributed's default group from this rank, and this process has joined no "
            "group: call rollout_sync.distributed.init_process_group first, or pass pusher="
        )
    transfer = WeightTransfer(None, dist.get_rank(), config=TransferConfig(timeout_s=timeout))
    return TransferWeightPusher(transfer)


class _FunctionPusher:
    """Adapts ``push(weights, version=..., timeout=...)`` to :class:`WeightPusher`."""

    def __init__(self, push: Callable[..., object]) -> None:
        self._push = push

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        self._push(weights, version=version, timeout=timeout)


def _broadcast_and_wait(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    timeout: float,
    operation: str,
) -> None:
    _broadcast_all([tensor], src, group, timeout, operation)


def _broadcast_all(
    tensors: Sequence[torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    timeout: float,
    operation: str,
) -> None:
    """Broadcast each tensor, then wait for all (what ``async_op=False`` does).

    On gloo the wait blocks the host and is bounded by ``timeout`` seconds in total. On NCCL the
    wait is the stream-ordering one, ``work.wait()`` with no timeout: it makes the current
    stream wait for the collective and returns at once. Passing a timeout there would make
    ProcessGroupNCCL block the host until the collective completes, the stall the event timer
    exists to avoid; the bound on NCCL is the process group's own timeout (its watchdog), set
    at ``init_process_group``.
    """
    start = time.monotonic()
    try:
        works = [dist.broadcast(t, src, group=group, async_op=True) for t in tensors]
        if str(dist.get_backend(group)) == "nccl":
            for work in works:
                if work is not None:
                    work.wait()
        else:
            wait_collective(works, operation=operation, timeout_s=timeout, ranks=group_ranks(group))
    except (CollectiveError, RuntimeError) as exc:
        elapsed = time.monotonic() - start
        kind = (
            WeightBroadcastTimeout if isinstance(exc, CollectiveTimeout) else WeightBroadcastError
        )
        raise kind(
            f"{operation} from rank {src} failed after {elapsed:.1f} s (limit {timeout:.1f} s): "
            f"{type(exc).__name__}: {exc}. A peer of the group did not take part in the "
            "broadcast (exited, or is waiting on a different collective)."
        ) from exc


# -- the weight-broadcast callback -------------------------------------------------------------


@dataclass(frozen=True)
class WeightBroadcastStatistics:
    """Totals of a :class:`WeightBroadcastCallback` since construction."""

    syncs: int
    bytes: int
    version: int
    """The last version pushed (``initial_version`` before the first)."""
    timed_samples: int
    pending_samples: int


def _deltas_on(pusher: object, full_every: int | None) -> None:
    """Turn deltas on in a :class:`WeightBroadcastCallback`'s pusher (``delta=True``): its
    encoder, made here unless it has one, takes the callback's keyframes (``full_every``).

    Raises:
        ValueError: ``pusher`` is not a :class:`TransferWeightPusher`.
    """
    if not isinstance(pusher, TransferWeightPusher):
        raise ValueError(
            "a WeightBroadcastCallback(delta=True) sends through a TransferWeightPusher (it "
            f"keeps the base the deltas are encoded against); got {pusher!r}"
        )
    if pusher.encoder is None:
        pusher.use_deltas(full_every=full_every)
    elif full_every is not None:
        pusher.encoder.full_every = full_every  # the callback's keyframes hold


class WeightBroadcastCallback(TrainerCallback):
    """On every successful step: announce, then push the full weights, timed.

    Per push, all inside the timer's bracket (everything the step spends on the sync):
    ``weights()`` (the gather: a state dict, a ZeRO gather), then
    ``channel.announce(WEIGHTS, step, version, num_tensors, nbytes)``, then
    ``pusher.push_weights``. Construct it on the broadcasting rank only (the pusher's ``src``).

    ``step_end`` returns, on a step the trainer logs (``train_metrics`` is not None, or every
    step with ``report_every_step``), what happened since the last report:

    * ``weight_sync_time_ms``: mean time of gather + push over the samples harvested since the
      last report. On the CUDA clock a sample is harvested only once its end event completes,
      typically one step later, so it may belong to the previous report's pushes.
    * ``weight_sync_time_ms_max``: the largest of those samples.
    * ``weight_sync_count``: pushes since the last report.
    * ``weight_sync_bytes``: bytes those pushes moved.
    * ``weight_sync_version``: the last version pushed.

    The time keys are absent when no sample was harvested; None is returned when there is
    nothing to say. Samples are never dropped between reports: an unlogged step keeps them.

    Args:
        weights: called inside the timed bracket; returns the full named weights to push.
        pusher: a :class:`WeightPusher`, or a function ``push(weights, *, version, timeout)``.
            Default: a :class:`TransferWeightPusher` sending a :class:`~rollout_sync.
            WeightTransfer` over torch.distributed's default group from this rank (each
            collective bounded by ``timeout``); every other rank of the group receives with
            ``WeightTransfer(None, src=this rank).receive(...)`` (a
            :class:`~rollout_sync.RolloutWorker` whose ``p2r`` is that transfer does it).
            Needs the default group to exist when the callback is built.
        channel: where pushes are announced (None: not announced).
        timer: the :class:`~rollout_sync.WeightSyncTimer`; ``"auto"`` picks its clock from the
            pusher's ``backend`` (CUDA events for NCCL, perf_counter otherwise); None disables
            timing entirely (no timer is constructed, no time keys are reported).
        timeout: seconds for each announcement and each push; at ``train_end``, for draining
            the timer.
        initial_version: the version the rollout side serves before the first push.
        adapter: ``weights()`` returns this LoRA adapter's set (:mod:`rollout_sync.lora`), not
            the model's: every announcement names it, so the replicas receive it into that
            adapter's slot. Its versions count apart from the model's.
        sync_on_run_begin: push the weights once at ``run_begin`` too, so the rollout side
            starts from the trainer's (resumed) weights.
        report_every_step: report on every step, not only those with training metrics.
        delta: send each version as its changes against the last committed one (docs/delta.md):
            the pusher must be a :class:`TransferWeightPusher` (the default is one), which it
            turns on (:class:`TransferWeightPusher`'s ``delta``). ``weight_sync_bytes`` then
            counts the bytes that moved, and ``weight_sync_delta_count`` the pushes that went
            by delta.
        full_every: with ``delta``, every ``full_every``-th push goes whole (a keyframe).
    """

    def __init__(
        self,
        weights: Callable[[], Mapping[str, torch.Tensor]],
        *,
        pusher: WeightPusher | Callable[..., object] | None = None,
        channel: CommandChannel | None = None,
        timer: WeightSyncTimer | Literal["auto"] | None = "auto",
        timeout: float = DEFAULT_BROADCAST_TIMEOUT_S,
        initial_version: int = 0,
        sync_on_run_begin: bool = True,
        report_every_step: bool = False,
        adapter: str | None = None,
        delta: bool = False,
        full_every: int | None = None,
    ) -> None:
        if pusher is None:
            pusher = _default_pusher(timeout)
        if full_every is not None and not delta:
            raise ValueError("full_every is the keyframe interval of delta syncs: pass delta=True")
        if delta:
            _deltas_on(pusher, full_every)
        self.delta = delta
        self.full_every = full_every
        self.weights = weights
        self.pusher: WeightPusher = (
            pusher if isinstance(pusher, WeightPusher) else _FunctionPusher(pusher)
        )
        self.channel = channel
        if timer == "auto":
            timer = WeightSyncTimer.for_backend(getattr(self.pusher, "backend", None))
        self.timer: WeightSyncTimer | None = timer
        self.timeout = timeout
        self.version = initial_version
        self.sync_on_run_begin = sync_on_run_begin
        self.report_every_step = report_every_step
        self.adapter = adapter
        self.final_metrics: dict[str, Any] | None = None
        """What ``train_end`` harvested after the last report (read it for the final log)."""
        self._window_syncs = 0
        self._window_bytes = 0
        self._window_deltas = 0
        self._window_samples: list[TimedSample] = []
        self._syncs = 0
        self._bytes = 0
        self._timed = 0

    # -- the hooks -----------------------------------------------------------------------------

    def run_begin(self, step: int) -> None:
        if self.sync_on_run_begin:
            self.sync(step)

    def step_end(
        self,
        step: int,
        reduced_losses: Mapping[str, float | int] | None = None,
        update_successful: bool = True,
        train_metrics: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        if update_successful:
            self.sync(step)
        if train_metrics is None and not self.report_every_step:
            self._collect()
            return None
        return self.report()

    def train_end(self, step: int) -> None:
        """Drain the timer (bounded by ``timeout``), keep the rest in ``final_metrics``, STOP."""
        if self.timer is not None:
            self._add_samples(self.timer.drain(self.timeout))
        self.final_metrics = self._report()
        if self.channel is not None:
            self.channel.announce(
                WeightSyncCommand(CommandKind.STOP, step, self.version), self.timeout
            )

    # -- the push ------------------------------------------------------------------------------

    def sync(self, step: int) -> int:
        """Announce and push the current weights as the next version; returns the version.

        Blocks for as long as the pusher does (bounded by ``timeout``); raises what the channel
        or the pusher raise, and then the version is not advanced.
        """
        version = self.version + 1
        if self.timer is None:
            nbytes = self._announce_and_push(step, version)
        else:
            with self.timer.measure(step) as measurement:
                nbytes = measurement.nbytes = self._announce_and_push(step, version)
        self.version = version
        self._syncs += 1
        self._bytes += nbytes
        self._window_syncs += 1
        self._window_bytes += nbytes
        return version

    def use_pusher(
        self,
        pusher: WeightPusher | Callable[..., object],
        *,
        channel: CommandChannel | None,
    ) -> None:
        """Push through ``pusher`` and announce on ``channel`` from now on: the new job's after
        a recovery (:mod:`rollout_sync.recovery`), whose groups and command queues replaced the
        broken ones. The version count, the timer and the metrics go on: the next push is
        ``version + 1``, and :attr:`version` is what the recovery re-seeded the replicas to
        (``recover_weights(..., version=callback.version)``). A callback built with ``delta``
        turns deltas on in the new pusher as in the first (its base starts empty: its first push
        goes whole).

        Raises:
            ValueError: the callback sends deltas and ``pusher`` is not a
                :class:`TransferWeightPusher`.
        """
        if self.delta:
            _deltas_on(pusher, self.full_every)
        self.pusher = pusher if isinstance(pusher, WeightPusher) else _FunctionPusher(pusher)
        self.channel = channel

    def _announce_and_push(self, step: int, version: int) -> int:
        weights = self.weights()
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        if self.channel is not None:
            self.channel.announce(
                WeightSyncCommand(
                    CommandKind.WEIGHTS, step, version, len(weights), nbytes, self.adapter
                ),
                self.timeout,
            )
        self.pusher.push_weights(weights, version=version, timeout=self.timeout)
        stats = getattr(self.pusher, "last_stats", None)
        if getattr(self.pusher, "encoder", None) is not None and stats is not None:
            self._window_deltas += stats.sync_kind == "delta"
            return int(stats.nbytes)  # what moved: the delta's bytes when it went by one
        return nbytes

    # -- reporting -----------------------------------------------------------------------------

    def _collect(self) -> None:
        if self.timer is not None:
            self._add_samples(self.timer.harvest())

    def _add_samples(self, samples: list[TimedSample]) -> None:
        self._window_samples.extend(samples)
        self._timed += len(samples)

    def report(self) -> dict[str, Any] | None:
        """Harvest the timer (never blocks) and return what happened since the last report:
        the keys ``step_end`` documents, or None when there is nothing to say."""
        self._collect()
        return self._report()

    def _report(self) -> dict[str, Any] | None:
        samples = self._window_samples
        if not samples and not self._window_syncs:
            return None
        metrics: dict[str, Any] = {}
        if samples:
            times = [s.elapsed_ms for s in samples]
            metrics["weight_sync_time_ms"] = math.fsum(times) / len(times)
            metrics["weight_sync_time_ms_max"] = max(times)
        metrics["weight_sync_count"] = self._window_syncs
        metrics["weight_sync_bytes"] = self._window_bytes
        metrics["weight_sync_version"] = self.version
        if getattr(self.pusher, "encoder", None) is not None:
            metrics["weight_sync_delta_count"] = self._window_deltas
        self._window_samples = []
        self._window_syncs = self._window_bytes = self._window_deltas = 0
        return metrics

    def statistics(self) -> WeightBroadcastStatistics:
        return WeightBroadcastStatistics(
            syncs=self._syncs,
            bytes=self._bytes,
            version=self.version,
            timed_samples=self._timed,
            pending_samples=self.timer.pending if self.timer is not None else 0,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<WeightBroadcastCallback v{s.version}: {s.syncs} syncs, {s.bytes} bytes, "
            f"timer={self.timer!r}>"
        )
