"""The rollout worker: a command loop that runs weight syncs while the engine keeps generating.

A :class:`RolloutWorker` owns one rollout engine (a :class:`~rollout_sync.RolloutBase`) and its
two weight transfers: P2R (from the trainer) and R2R (within the replica group). Commands arrive
on a queue (any object with ``get(timeout=...)``: a ``queue.Queue``, a ``multiprocessing``
queue fed by a controller), are dispatched through a handler registry, and the main loop
interleaves them with generation:

* a backend that generates on its own (a stream scheduler, a threaded backend) keeps going
  while the loop waits for commands, and is parked by the guard during a sync;
* a blocking backend gets one ``step_generation()`` call whenever no command is waiting.

The weight-sync handlers carry the guard decorators, so the bracket (pause, egress hold,
fence) covers lazy engine initialization and the barrier wait as well as the transfer:

* :meth:`RolloutWorker.receive_weights_p2r` and :meth:`RolloutWorker.receive_weights_r2r` are
  :func:`~rollout_sync.weight_sync_handler` s: they write the served tensors.
* :meth:`RolloutWorker.send_weights_r2r` (the R2R source) only reads the served tensors, so it
  :func:`~rollout_sync.holds_payload_egress` and lets generation run.

In :attr:`SyncMode.SYNC` a receive writes the served tensors in place; a failure after the first
write marks them torn (:meth:`~rollout_sync.RolloutBase.mark_weights_torn`), and the engine
refuses to generate until a later complete sync commits a version. In the async modes the
handlers queue the transfer on a :class:`~rollout_sync.buffer.WeightSyncThread`, which writes a
:class:`~rollout_sync.WeightBuffer` the backend installs at its safe points; generation never
pauses, and a failed transfer leaves the served weights whole.

In :attr:`SyncMode.STAGED` (stage, then swap: :mod:`rollout_sync.staging`) a receive lands in a
:class:`~rollout_sync.staging.StagingArea` while generation goes on, with payload egress held;
generation is parked only to install the verified version and commit it. A replica installs
only if every replica of the sync voted yes in the transfer's commit vote (two-phase), so a
version lands on every replica of the sync or on none. The P2R target of a job with R2R holds
what it staged until the R2R it sends from the staging area has been voted on; with the
pipelined relay, the relay's vote covers both hops.

Rendezvous is torch.distributed's own (``env://`` or ``tcp://``): see
:mod:`rollout_sync.distributed` and :func:`build_sync_groups`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from typing_extensions import Self, get_protocol_members

from ._deadline import deadline_after, expired, wait_arg
from .backend import RolloutBase, TornWeightsPark
from .buffer import SupportsWeightBuffer, WeightBuffer, WeightSyncThread
from .distributed import DEFAULT_GROUP_TIMEOUT_S, new_group
from .errors import (
    CommandTimeout,
    InstallTimeout,
    ManifestError,
    RolloutSyncError,
    RunInterrupted,
    StagedCommitAborted,
    WeightBroadcastTimeout,
    WeightMismatchError,
)
from .guard import (
    SyncMode,
    SyncReport,
    WeightSyncBracket,
    device_fence,
    holds_payload_egress,
    weight_sync_bracket,
    weight_sync_handler,
)
from .lora import require_adapter
from .staging import StagingArea, check_two_communicators
from .trace import Timeline
from .trainer import CommandKind, WeightSyncCommand
from .transfer import (
    BUFFER_WRITE,
    OriginChecksums,
    TransferStats,
    WeightTransfer,
    WeightTransferError,
    WeightTransferTimeout,
)
from .transfer._barrier import meet_p2r_barrier

__all__ = [
    "P2R",
    "R2R",
    "BackgroundEngine",
    "Command",
    "CommandResult",
    "CommandSink",
    "CommandSource",
    "RolloutWorker",
    "Stop",
    "SupportsWeightTransfer",
    "SyncGroups",
    "WorkerCommandChannel",
    "WorkerStatistics",
    "build_sync_groups",
]

C = TypeVar("C")

_RESEED_QUEUE_FACTOR = 4
"""An async re-seed waits this many ``weight_sync_timeout`` s for the jobs queued before it."""

DEFAULT_HISTORY = 1024
"""How many recent results and sync reports a worker keeps (``RolloutWorker(history=...)``)."""


def bounded_history(owner: str, history: int) -> int:
    """``history`` checked as a bound on what ``owner`` keeps: an int >= 0, else ValueError."""
    if isinstance(history, bool) or not isinstance(history, int) or history < 0:
        raise ValueError(
            f"{owner}(history={history!r}): the number of recent entries to keep must be an "
            f"int >= 0 (the default is {DEFAULT_HISTORY})"
        )
    return history


# -- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class P2R:
    """Receive weights from the trainer (this worker must be in the P2R group)."""

    step: int | None = None
    """Informational: the training step the weights come from (for reports)."""
    relay: bool = False
    """Pass every bucket on to the R2R group as it arrives (the pipelined relay,
    :meth:`~rollout_sync.WeightTransfer.relay`): this worker must be the R2R source, and the
    other replicas must run their R2R receive at the same time, so they get ``R2R`` and this
    worker gets no ``R2R`` of its own (``WorkerCommandChannel(pipelined_relay=True)``)."""
    adapter: str | None = None
    """Receive this LoRA adapter's set into its slot, not the model's weights
    (:mod:`rollout_sync.lora`): always staged, the whole set required."""


@dataclass(frozen=True)
class R2R:
    """Take part in the replica-to-replica broadcast: send if this replica is the source."""

    step: int | None = None
    adapter: str | None = None
    """Broadcast this LoRA adapter's set, not the model's weights (see :attr:`P2R.adapter`)."""


@dataclass(frozen=True)
class Stop:
    """Finish the loop: fence the weight-sync thread, then return from :meth:`run`."""


Command = P2R | R2R | Stop


@dataclass(frozen=True)
class CommandResult:
    """What handling one command did."""

    command: object
    ok: bool
    value: Any = None
    """The handler's return value (a TransferStats; in async modes a Future until done)."""
    error: str | None = None
    """``"ExcType: message"`` when it failed, followed by the traceback."""
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception a failed handler raised, on the result :meth:`RolloutWorker.handle`
    returns and ``on_result`` gets. The worker's history (:attr:`RolloutWorker.results`, what
    :meth:`RolloutWorker.run` returns) keeps ``None`` here: an exception holds, through its
    traceback, the frames and tensors of the failed transfer. ``error`` says what it was."""
    elapsed_s: float = 0.0
    weight_version: int = 0
    """The served weight version after the command."""
    committed_at: float | None = None
    """Wall-clock time (``time.time()``) at which this command committed a new served version
    (installed it, in staged mode); ``None`` if it committed none. Compared across replicas,
    it measures version skew: how long two replicas served different versions."""


@runtime_checkable
class CommandSource(Protocol):
    """Where commands come from: ``queue.Queue`` and ``multiprocessing`` queues qualify.

    ``get`` raises :class:`queue.Empty` when nothing arrives within ``timeout`` seconds.
    """

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


@runtime_checkable
class BackgroundEngine(Protocol):
    """An engine that generates on its own once started (a stream scheduler, a threaded backend).

    The worker starts it inside the first sync's bracket (so it begins parked, with the new
    weights) and stops it in :meth:`RolloutWorker.close`.
    """

    def start(self) -> Any: ...

    def stop(self, timeout: float = ...) -> Any: ...


@runtime_checkable
class SupportsWeightTransfer(Protocol):
    """One rank's side of a weight transfer, as the worker drives it: what P2R and R2R take.

    :class:`~rollout_sync.WeightTransfer` is the implementation; a fake of your own (an
    in-process wire, a recording transfer) qualifies by having these members. The worker calls
    ``receive`` into the served tensors (or an async-mode buffer) on a receiving rank, ``send``
    on the source, ``relay`` for ``P2R(relay=True)`` (passing each bucket on through its R2R
    transfer, of the same kind), and ``abort`` on a source that cannot send, so that its
    receivers fail at once instead of at their limit. A failed ``receive`` raises a
    :class:`~rollout_sync.transfer.WeightTransferError` saying how many tensors it wrote.
    """

    @property
    def is_source(self) -> bool:
        """Whether this rank sends (the R2R source replica, the trainer of a P2R)."""
        ...

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = ...,
        write_kind: str = ...,
        storage: torch.Tensor | None = ...,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = ...,
    ) -> TransferStats: ...

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: Self,
        *,
        allow_subset: bool = ...,
        write_kind: str = ...,
        storage: torch.Tensor | None = ...,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = ...,
    ) -> TransferStats: ...

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        origin: OriginChecksums | None = ...,
        storage: torch.Tensor | None = ...,
    ) -> TransferStats: ...

    def abort(self, reason: str) -> None: ...


def _check_transfer(name: str, transfer: object) -> None:
    """Refuse, at construction, a transfer the handlers could not drive."""
    if transfer is not None and not isinstance(transfer, SupportsWeightTransfer):
        members = sorted(get_protocol_members(SupportsWeightTransfer))
        missing = [m for m in members if not hasattr(transfer, m)]
        raise TypeError(
            f"RolloutWorker({name}=...) needs a weight transfer (a WeightTransfer, or an object "
            f"with the members of rollout_sync.worker.SupportsWeightTransfer); "
            f"{type(transfer).__name__} lacks {missing}"
        )


@dataclass(frozen=True)
class WorkerStatistics:
    """What a worker has done since it was built: running totals, read in constant time
    however long it has run (its history keeps only the recent results)."""

    commands: int
    """Commands handled (async ones once they completed)."""
    failed: int
    """Commands that failed, syncs and others."""
    syncs: int
    """P2R and R2R commands that succeeded."""
    weight_version: int
    weights_torn: bool
    generation_steps: int
    engine_started: bool
    failed_syncs: int
    """P2R and R2R commands that failed."""
    sync_reports_total: int
    """Sync brackets reported (P2R, R2R and re-seeds, failed ones too); the recent ones are in
    :attr:`RolloutWorker.sync_reports`."""
    staging_bytes: int = 0
    """Memory held by staging copies: of the weights (``SyncMode.STAGED``, from the first
    sync; none in place) and of each LoRA adapter synced (adapters are always staged)."""
    staged_discarded: int = 0
    """Staged versions thrown away: failed on this replica, or voted down by another."""


@dataclass(frozen=True)
class _SyncPath:
    """How a worker runs each weight-sync command, decided once from its mode and ``guarded``:
    each entry takes the command and returns the handler's value."""

    p2r: Callable[[P2R], Any]
    r2r_send: Callable[[R2R], Any]
    """This replica is the R2R source."""
    r2r_receive: Callable[[R2R], Any]


@dataclass(frozen=True)
class _Target:
    """What a sync command writes: the model's weights (``adapter`` None) or one LoRA
    adapter's slot."""

    adapter: str | None = None
    step: int | None = field(default=None, compare=False)
    """The command's step (for messages about a version whose number never arrived)."""

    @classmethod
    def of(cls, command: object) -> _Target:
        return cls(getattr(command, "adapter", None), getattr(command, "step", None))

    def served(self, rollout: RolloutBase) -> Mapping[str, torch.Tensor]:
        if self.adapter is None:
            return rollout.served_weights()
        return require_adapter(rollout, self.adapter).served_adapter(self.adapter)

    def version(self, rollout: RolloutBase) -> int:
        if self.adapter is None:
            return rollout.weight_version
        return require_adapter(rollout, self.adapter).adapter_version(self.adapter)

    def verify_kwargs(
        self, rollout: RolloutBase, transfer: SupportsWeightTransfer
    ) -> dict[str, Any]:
        """What a staged receive checks before its commit vote: an adapter's ``lora_alpha``
        (data no manifest describes), so a set every replica would refuse at install is voted
        down and the trainer never sees success for it. A transfer written before ``verify``
        existed is not given it (the install still refuses the set, after the vote)."""
        if self.adapter is None or "verify" not in inspect.signature(transfer.receive).parameters:
            return {}
        config = require_adapter(rollout, self.adapter).adapter_config(self.adapter)
        context = f"adapter {self.adapter!r}"
        return {"verify": lambda staged: config.check_alpha(staged, context=context)}

    def staging(self, rollout: RolloutBase, device: torch.device | str | None) -> StagingArea:
        if self.adapter is None:
            return StagingArea.of(rollout, device=device)
        return StagingArea(self.served(rollout), device=device)

    def __str__(self) -> str:
        return "the weights" if self.adapter is None else f"adapter {self.adapter!r}"


# -- groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncGroups:
    """The two weight-sync groups of a job, as every rank sees them.

    Ranks are global. ``trainer``: the P2R source. ``replicas``: the rollout replicas, the first
    of which receives P2R and is the R2R source.
    """

    trainer: int
    replicas: tuple[int, ...]
    p2r: dist.ProcessGroup | None
    """``{trainer, replicas[0]}``; a placeholder on other ranks."""
    r2r: dist.ProcessGroup | None
    """The replicas; ``None`` with a single replica."""
    p2r_cpu: dist.ProcessGroup | None = None
    """``{trainer, replicas[0]}`` on gloo, for :meth:`p2r_barrier` (the P2R group itself when
    that is gloo already); ``None``: no barrier group was built."""

    @property
    def r2r_source(self) -> int:
        return self.replicas[0]

    def p2r_barrier(self, timeout: float) -> None:
        """The P2R pair's CPU-side barrier: the trainer and the first replica meet here.

        The replica calls it inside its P2R bracket (paused, payload egress held: pass this
        method as ``RolloutWorker(p2r_barrier=...)``); the trainer calls it before it takes its
        payload receive hold and sends (``TransferWeightPusher(barrier=...)``). Passing it tells
        the trainer that the replica can no longer be waiting for the trainer to receive, so the
        trainer's hold cannot deadlock (docs/transport.md). It never touches the device.

        Both sides take it or neither. Its first collective has the shape of a transfer's
        manifest header, so on gloo (one group for barrier and transfer) a side that takes no
        barrier meets it there: both sides raise :class:`~rollout_sync.errors.P2RBarrierMismatch`
        at once, nothing is written, and the next P2R, configured alike, goes through. On NCCL
        (a gloo group of its own) that shows only as this barrier's timeout.

        Raises:
            P2RBarrierMismatch: the other side takes no barrier (see above).
            CollectiveTimeout / CollectiveError: the peer did not arrive within ``timeout``
                seconds (per collective), or died.
            RuntimeError: no barrier group was built, or this rank is not in the pair.
        """
        if self.p2r_cpu is None:
            raise RuntimeError(
                "these SyncGroups have no P2R barrier group (build them with build_sync_groups)"
            )
        if dist.get_rank() not in (self.trainer, self.r2r_source):
            raise RuntimeError(
                f"rank {dist.get_rank()} is not in the P2R pair {[self.trainer, self.r2r_source]}"
            )
        meet_p2r_barrier(self.p2r_cpu, self.trainer, timeout)

    def p2r_transfer(self, **kwargs: Any) -> WeightTransfer | None:
        """The P2R :class:`WeightTransfer` on this rank, or ``None`` if it takes no part."""
        me = dist.get_rank()
        if me not in (self.trainer, self.r2r_source):
            return None
        return WeightTransfer(self.p2r, self.trainer, **kwargs)

    def r2r_transfer(self, **kwargs: Any) -> WeightTransfer | None:
        """The R2R :class:`WeightTransfer` on this rank, or ``None`` if it takes no part."""
        if self.r2r is None or dist.get_rank() not in self.replicas:
            return None
        return WeightTransfer(self.r2r, self.r2r_source, **kwargs)


def reload_received(rollout: RolloutBase, served: Mapping[str, torch.Tensor]) -> None:
    """Hand tensors received in place into ``served`` to an engine that overrides
    ``load_weights`` (one that cannot serve the tensors it exposes). The default would find the
    same storage and copy nothing, after re-checking what the transfer already checked, so it
    is skipped."""
    if type(rollout).load_weights is not RolloutBase.load_weights:
        rollout.load_weights(served, require_all=False)


def settle_failed_receive(
    rollout: RolloutBase, served: Mapping[str, torch.Tensor], exc: BaseException
) -> bool:
    """What an in-place receive into ``served`` that raised ``exc`` leaves behind (fail
    closed: only the transfer's own word clears a write).

    Every byte landed intact (a :class:`~rollout_sync.errors.WeightTransferError` that is
    ``complete``: the failure was another rank's): the version is whole, so it is reloaded and
    committed, and True returned. The transfer says nothing was written (its error's
    ``tensors_written`` is 0, or a :class:`~rollout_sync.errors.WeightMismatchError` or
    :class:`~rollout_sync.errors.ManifestError`, which the checks before any write raise):
    nothing changes. Anything else (tensors written, or an error
    of a type the transfer does not raise on purpose, which proves nothing) marks the weights
    torn. The caller raises ``exc`` either way.
    """
    if isinstance(exc, WeightTransferError):
        if exc.complete and exc.version is not None:
            reload_received(rollout, served)
            rollout.commit_weight_version(exc.version)
            return True
        if exc.targets_torn:
            rollout.mark_weights_torn(
                f"{exc.tensors_written} tensor(s) of version {exc.version} were written before "
                f"the transfer failed: {type(exc).__name__}"
            )
        return False
    if not isinstance(exc, (WeightMismatchError, ManifestError)):
        rollout.mark_weights_torn(
            f"the receive failed with {type(exc).__name__} ({exc}), which does not say what "
            "was written: taken as written part-way"
        )
    return False


def build_sync_groups(
    trainer: int,
    replicas: Sequence[int],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
) -> SyncGroups:
    """Create the P2R and R2R groups; every rank of the default group must call this.

    ``timeout_s`` is the default limit of every collective on them. With a ``backend`` other
    than gloo (NCCL) a gloo group of the P2R pair is made too, for
    :meth:`SyncGroups.p2r_barrier`.
    """
    if not replicas:
        raise ValueError("build_sync_groups needs at least one replica rank")
    if trainer in replicas:
        raise ValueError(f"the trainer rank {trainer} cannot also be a replica")
    reps = tuple(replicas)
    p2r = new_group([trainer, reps[0]], timeout_s=timeout_s, backend=backend)
    # Decided from the arguments and the default group, the same on every rank, so that every
    # rank makes the same new_group calls.
    on_gloo = str(backend or dist.get_backend()) == "gloo"
    p2r_cpu = p2r if on_gloo else new_group([trainer, reps[0]], timeout_s=timeout_s, backend="gloo")
    r2r = new_group(list(reps), timeout_s=timeout_s, backend=backend) if len(reps) > 1 else None
    return SyncGroups(trainer, reps, p2r, r2r, p2r_cpu)


# -- from the trainer's announcements to commands ---------------------------------------------


@runtime_checkable
class CommandSink(Protocol):
    """Where a controller puts a worker's commands: ``queue.Queue`` and ``multiprocessing``
    queues qualify (the other end of a :class:`CommandSource`)."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None: ...


class WorkerCommandChannel:
    """The trainer's :class:`~rollout_sync.trainer.CommandChannel` that turns each announcement
    into :class:`RolloutWorker` commands, so trainer and workers need no bridge of your own.

    Give it to :class:`~rollout_sync.WeightBroadcastCallback` as ``channel``. Per announcement:

    * ``WEIGHTS`` of step ``s``: ``P2R(step=s)`` to the P2R target (the replica that receives
      from the trainer), then, with more than one replica, ``R2R(step=s)`` to every replica (the
      target sends what it received, the others receive). With ``pipelined_relay``:
      ``P2R(step=s, relay=True)`` to the target, which passes each bucket on as it arrives,
      and ``R2R(step=s)`` to every other replica (they receive during the P2R);
    * ``STOP``: ``Stop()`` to every replica.

    Commands go on each replica's command queue, the one its worker reads
    (``RolloutWorker(commands=...)``): in one process the worker's own ``worker.commands``,
    across processes a ``multiprocessing`` queue, across hosts a
    :class:`~rollout_sync.launch.job.StoreCommandQueue` on the job's rendezvous store.
    Every put of one announcement shares its ``timeout``.

    Args:
        queues: replica rank -> that replica's command queue.
        replicas: the replica ranks, the P2R target first (as in :class:`SyncGroups`); default:
            the keys of ``queues`` in order.
        pipelined_relay: overlap the two hops (see above); the P2R target's worker must have
            its R2R transfer.
    """

    def __init__(
        self,
        queues: Mapping[int, CommandSink],
        replicas: Sequence[int] | None = None,
        *,
        pipelined_relay: bool = False,
    ) -> None:
        self.pipelined_relay = pipelined_relay
        self.replicas = tuple(queues) if replicas is None else tuple(replicas)
        if not self.replicas:
            raise ValueError("WorkerCommandChannel needs at least one replica")
        missing = [r for r in self.replicas if r not in queues]
        if missing:
            raise ValueError(f"no command queue for replica rank(s) {missing}")
        self.queues = dict(queues)

    @classmethod
    def for_groups(
        cls, groups: SyncGroups, queues: Mapping[int, CommandSink], *, pipelined_relay: bool = False
    ) -> WorkerCommandChannel:
        """The channel for the replicas of ``groups``, the P2R target first."""
        return cls(queues, groups.replicas, pipelined_relay=pipelined_relay)

    @property
    def p2r_target(self) -> int:
        return self.replicas[0]

    def commands_for(self, announcement: WeightSyncCommand) -> list[tuple[int, object]]:
        """The ``(replica rank, command)`` pairs one announcement becomes, in order."""
        if announcement.kind is CommandKind.STOP:
            return [(rank, Stop()) for rank in self.replicas]
        step, adapter = announcement.step, announcement.adapter
        if self.pipelined_relay and len(self.replicas) > 1:
            out: list[tuple[int, object]] = [
                (self.p2r_target, P2R(step=step, relay=True, adapter=adapter))
            ]
            out.extend((rank, R2R(step=step, adapter=adapter)) for rank in self.replicas[1:])
            return out
        out = [(self.p2r_target, P2R(step=step, adapter=adapter))]
        if len(self.replicas) > 1:
            out.extend((rank, R2R(step=step, adapter=adapter)) for rank in self.replicas)
        return out

    def announce(self, command: WeightSyncCommand, timeout: float) -> None:
        """Put the commands ``command`` becomes on the replicas' queues.

        Raises:
            WeightBroadcastError: a queue stayed full past ``timeout`` seconds (is that
                replica's worker running?).
        """
        deadline = deadline_after(timeout)
        for rank, worker_command in self.commands_for(command):
            try:
                self.queues[rank].put(worker_command, timeout=wait_arg(deadline))
            except queue.Full:
                raise WeightBroadcastTimeout(
                    f"the command queue of replica rank {rank} stayed full for {timeout:.1f} s "
                    f"announcing {command.kind.name} of step {command.step} (is its worker "
                    "taking commands?)"
                ) from None

    def receive(self, timeout: float) -> WeightSyncCommand:
        raise TypeError(
            "a WorkerCommandChannel only announces: the replicas take their commands from their "
            "queues (RolloutWorker(commands=...)), not from this channel"
        )

    def __repr__(self) -> str:
        relay = ", pipelined relay" if self.pipelined_relay else ""
        return f"<WorkerCommandChannel replicas={list(self.replicas)}{relay}>"


# -- the worker --------------------------------------------------------------------------------


class RolloutWorker:
    """A rollout replica's command loop; see the module docstring.

    Args:
        rollout: the engine. Constructing it must be cheap; the expensive part belongs in
            :meth:`~rollout_sync.RolloutBase.initialize`, which the first sync calls inside
            the bracket. A :class:`BackgroundEngine` is started there too.
        p2r: this replica's P2R transfer (``None``: it never receives from the trainer); a
            :class:`~rollout_sync.WeightTransfer` or anything :class:`SupportsWeightTransfer`.
        p2r_barrier: called with ``weight_sync_timeout`` inside every P2R bracket (generation
            paused, egress held), before the transfer: a CPU-side barrier with the trainer,
            which takes its payload receive hold once past it (``SyncGroups.p2r_barrier``;
            docs/transport.md). ``None``: no barrier. It must agree with the trainer's
            ``TransferWeightPusher(barrier=...)``: with one side only, both raise
            :class:`~rollout_sync.errors.P2RBarrierMismatch` (on gloo, at once).
        r2r: this replica's R2R transfer (source or receiver; ``None``: no R2R).
        mode: :class:`SyncMode`; async modes need a :class:`SupportsWeightBuffer` backend.
            With ``guarded``, it decides once, here, how every P2R and R2R runs.
        commands: where :meth:`run` takes commands from (default: a fresh ``queue.Queue``,
            fed by :meth:`submit`).
        step_generation: for a blocking backend, one generation call; run by the loop
            whenever no command is waiting and the weights are servable.
        data_packer, validation_packer: payload egress components the guard holds.
        timeline: records sync, collective and write spans.
        weight_sync_timeout: seconds for the pause, each egress hold, fences and collectives.
        guarded: ``False`` runs the handlers without the bracket (to show the hazards).
        staging_device: ``SyncMode.STAGED``: where the staging copy of the weights lives
            (default: with the served weights; ``"cpu"``: in host memory).
        all_or_none: ``SyncMode.STAGED``: install a version only if every replica of the sync
            received it whole (two-phase, the default). ``False`` installs whatever this
            replica received whole even when another failed: the fleet may serve two
            versions (to show the hazard).
        allow_subset: accept ``trainable_only`` (subset) syncs.
        on_result: called on the loop thread with every :class:`CommandResult` (async jobs:
            when they complete).
        on_transfer: called with the :class:`TransferStats` and the tensors of every
            successful transfer (the served tensors; in async modes the buffer; staged, the
            staging area), right after
            it, outside the bracket, on the thread that ran it and before that thread starts
            the next one, so the tensors hold exactly what was transferred. For checks.
        history: how many recent :class:`CommandResult` s (:attr:`results`) and
            :class:`SyncReport` s (:attr:`sync_reports`) to keep; older ones are dropped, so a
            worker that syncs every few seconds for weeks holds no more than this.
            :meth:`statistics` keeps the totals. Kept results carry ``error`` (the text) but
            not ``exception``. Default 1024.

    Attributes:
        results: the most recent results (at most ``history``), oldest first.
        sync_reports: the most recent sync reports (at most ``history``), oldest first.
    """

    def __init__(
        self,
        rollout: RolloutBase,
        *,
        p2r: SupportsWeightTransfer | None = None,
        p2r_barrier: Callable[[float], None] | None = None,
        r2r: SupportsWeightTransfer | None = None,
        mode: SyncMode = SyncMode.SYNC,
        commands: CommandSource | None = None,
        step_generation: Callable[[], Any] | None = None,
        data_packer: object = None,
        validation_packer: object = None,
        timeline: Timeline | None = None,
        weight_sync_timeout: float = DEFAULT_GROUP_TIMEOUT_S,
        guarded: bool = True,
        allow_subset: bool = True,
        on_result: Callable[[CommandResult], None] | None = None,
        on_transfer: Callable[[TransferStats, Mapping[str, torch.Tensor]], None] | None = None,
        history: int = DEFAULT_HISTORY,
        staging_device: torch.device | str | None = None,
        all_or_none: bool = True,
    ) -> None:
        bounded_history("RolloutWorker", history)
        _check_transfer("p2r", p2r)
        _check_transfer("r2r", r2r)
        check_two_communicators(rollout, (p2r, r2r), mode)
        self.rollout = rollout
        self.p2r = p2r
        self.p2r_barrier = p2r_barrier
        self.r2r = r2r
        self._mode = mode
        self.commands: CommandSource = commands if commands is not None else queue.Queue()
        self.step_generation = step_generation
        self.data_packer = data_packer
        self.validation_packer = validation_packer
        self.timeline = timeline
        self.weight_sync_timeout = weight_sync_timeout
        self._guarded = guarded
        self.allow_subset = allow_subset
        self.on_result = on_result
        self.on_transfer = on_transfer
        self.history = history
        self.results: deque[CommandResult] = deque(maxlen=history)
        self.sync_reports: deque[SyncReport] = deque(maxlen=history)
        self.last_weight_sync_report: SyncReport | None = None
        self.handlers: dict[type, Callable[[Any], Any]] = {}
        self.weight_buffer: WeightBuffer | None = None
        self.sync_thread: WeightSyncThread | None = None
        self._engine_started = False
        self._stopped = False
        self._interrupted: str | None = None
        self._torn_park = TornWeightsPark(rollout, "RolloutWorker")
        """Parks a background engine from a receive that left its weights torn until a
        complete version commits (or :meth:`close`): it generates on its own, and need not
        look at ``weights_torn`` itself."""
        self._generation_steps = 0
        self._origin: OriginChecksums | None = None
        self._async_results: queue.SimpleQueue[CommandResult] = queue.SimpleQueue()
        self._lock = threading.Lock()
        """Guards the history, the running totals below and ``_interrupted``."""
        self._commands = 0
        self._failed = 0
        self._syncs = 0
        self._failed_syncs = 0
        self._reports = 0
        self._stagings: dict[str | None, StagingArea] = {}
        """Staging copies by target: the weights (``None``; ``SyncMode.STAGED``) and each LoRA
        adapter (always staged), built by the first sync of each."""
        self.staging_device = staging_device
        self.all_or_none = all_or_none
        self._committed_at: float | None = None
        if mode.is_async:
            if not isinstance(rollout, SupportsWeightBuffer):
                raise TypeError(
                    f"{mode} needs a backend that installs a WeightBuffer at its safe points "
                    f"(implement attach_weight_buffer, see SupportsWeightBuffer); "
                    f"{type(rollout).__name__} does not"
                )
            self.sync_thread = WeightSyncThread(
                self._async_bracket, name=f"weight-sync-{id(self):x}", fence=self.weight_sync_fence
            )
        self._path = self._choose_path()
        self.register_handler(P2R, self._handle_p2r)
        self.register_handler(R2R, self._handle_r2r)
        self.register_handler(Stop, self._handle_stop)

    @property
    def staging(self) -> StagingArea | None:
        """The staging copy of the weights (``SyncMode.STAGED``, once a sync built it)."""
        return self._stagings.get(None)

    def adapter_staging(self, name: str) -> StagingArea | None:
        """The staging copy of LoRA adapter ``name`` (once a sync of it built it)."""
        return self._stagings.get(name)

    @property
    def weight_sync_mode(self) -> SyncMode:
        """How syncs reach the served weights (``mode=``); fixed at construction, which chose
        how every P2R and R2R runs."""
        return self._mode

    @property
    def guarded(self) -> bool:
        """Whether syncs run inside the bracket (``guarded=``); fixed at construction."""
        return self._guarded

    def _choose_path(self) -> _SyncPath:
        if self.weight_sync_mode is SyncMode.STAGED:
            return _SyncPath(
                partial(self._staged, self._stage_p2r),
                partial(self._staged, self._stage_r2r_send),
                partial(self._staged, self._stage_r2r_receive),
            )
        if self.weight_sync_mode.is_async:
            # Queued on the weight-sync thread, which sends or receives by the R2R role it
            # finds when the job runs.
            r2r = partial(self._queue_async, "r2r")
            return _SyncPath(partial(self._queue_async, "p2r"), r2r, r2r)
        if self.guarded:
            return _SyncPath(
                self.receive_weights_p2r, self.send_weights_r2r, self.receive_weights_r2r
            )
        return _SyncPath(
            partial(self._unguarded, self._receive_p2r),
            partial(self._unguarded, self._send_r2r),
            partial(self._unguarded, self._receive_r2r),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<RolloutWorker {self.weight_sync_mode.value}: v{s.weight_version}"
            f"{' TORN' if s.weights_torn else ''}, {s.syncs} syncs, {s.failed} failed>"
        )

    # -- commands in -------------------------------------------------------------------------

    def register_handler(self, command_type: type[C], handler: Callable[[C], Any]) -> None:
        """Handle commands of ``command_type`` with ``handler`` (replacing a previous one)."""
        self.handlers[command_type] = handler

    def submit(self, command: object) -> None:
        """Queue ``command`` (only with the default queue; otherwise feed your source)."""
        if not isinstance(self.commands, queue.Queue):
            raise TypeError(
                "submit() needs the default queue.Queue command source; "
                "put commands on your own source instead"
            )
        self.commands.put(command)

    def handle(self, command: object) -> CommandResult:
        """Dispatch one command now, on this thread; never raises for a handler's error."""
        handler = self.handlers.get(type(command))
        start = time.perf_counter()
        self._committed_at = None  # a commit outside a command (a re-seed) is not this one's
        if handler is None:
            result = CommandResult(
                command,
                False,
                error=(
                    f"no handler registered for {type(command).__name__}; known: "
                    f"{sorted(t.__name__ for t in self.handlers)}"
                ),
                weight_version=self.rollout.weight_version,
            )
        else:
            try:
                value = handler(command)
            except Exception as exc:  # noqa: BLE001 - becomes a failed result, loop goes on
                result = self._failure(command, exc, time.perf_counter() - start)
            else:
                result = CommandResult(
                    command,
                    True,
                    value,
                    elapsed_s=time.perf_counter() - start,
                    weight_version=self.rollout.weight_version,
                    committed_at=self._take_committed_at(),
                )
                if isinstance(value, TransferStats) and self.on_transfer is not None:
                    target = _Target.of(command)
                    staging = self._stagings.get(target.adapter)
                    transferred = (
                        staging.tensors
                        if staging is not None and value.role != "send"
                        else target.served(self.rollout)
                    )
                    self.on_transfer(value, transferred)
        if not isinstance(result.value, concurrent.futures.Future):
            self._record(result)
        return result

    def run(
        self, *, idle_timeout_s: float = 300.0, poll_s: float = 0.05, stop_on_error: bool = False
    ) -> list[CommandResult]:
        """Take and handle commands until :class:`Stop`; return the results recorded while it
        ran (its commands', and async completions delivered meanwhile), oldest first: the last
        ``history`` of them if there were more (the totals are in :meth:`statistics`). Like
        every kept result, they carry ``error`` but no ``exception``.

        Between commands the engine generates: a :class:`BackgroundEngine` on its own, a
        blocking one through ``step_generation`` (skipped while the weights are torn). A
        :class:`Stop` ends this call only: after a recovery, ``run()`` again takes commands
        (from ``worker.commands``, which the recovery replaces).

        Raises:
            RunInterrupted: :meth:`interrupt` was called (before this call too, if no
                :meth:`use_groups` came in between); within ``poll_s`` of it when waiting for a
                command, else once the command being handled finished (bounded by its limit).
            CommandTimeout: no command arrived for ``idle_timeout_s`` seconds (is the controller
                alive?).
            RolloutSyncError: a command failed and ``stop_on_error`` is set; or the command
                source raised (a :class:`~rollout_sync.launch.StoreCommandQueue` whose store is
                gone: the trainer's process died).
        """
        last_command = time.monotonic()
        self._stopped = False
        with self._lock:
            first = self._commands
        while not self._stopped:
            self._raise_if_interrupted()
            self._deliver_async_results()
            generate = (
                self.step_generation is not None
                and self.rollout.is_initialized
                and not self.rollout.weights_torn
            )
            try:
                command = self.commands.get(timeout=0.0 if generate else poll_s)
            except queue.Empty:
                if generate:
                    assert self.step_generation is not None
                    self.rollout.check_servable()
                    self.step_generation()
                    self._generation_steps += 1
                elif time.monotonic() - last_command > idle_timeout_s:
                    raise CommandTimeout(
                        f"RolloutWorker.run: no command arrived for {idle_timeout_s:.1f} s "
                        "(is the controller alive? send Stop to end the loop)"
                    ) from None
                continue
            last_command = time.monotonic()
            result = self.handle(command)
            if stop_on_error and not result.ok:
                raise RolloutSyncError(
                    f"command {command!r} failed: {result.error}"
                ) from result.exception
        self._deliver_async_results()
        with self._lock:
            handled = self._commands - first
            return list(self.results)[-handled:] if handled else []

    def interrupt(self, reason: str = "interrupted") -> None:
        """Make :meth:`run` leave its loop with :class:`~rollout_sync.errors.RunInterrupted`.

        Thread-safe: for whoever learns that the job broke while this replica's loop is waiting
        for commands that will never come (a controller that saw another process die, on a
        thread of its own). The command being handled, if any, finishes first; generation
        stops with the loop. The interruption stays until a :meth:`run` raises it or
        :meth:`use_groups` (the recovery) clears it, so one that arrives just before ``run()``
        is not lost.
        """
        with self._lock:
            self._interrupted = reason

    def _raise_if_interrupted(self) -> None:
        if self._interrupted is None:  # every loop turn: no lock unless there is one to take
            return
        with self._lock:
            reason, self._interrupted = self._interrupted, None
        if reason is not None:
            self._deliver_async_results()
            raise RunInterrupted(
                f"RolloutWorker.run interrupted: {reason} (recover, then call run() again)",
                reason=reason,
            )

    def wait_for_install(self, timeout: float = 60.0) -> int:
        """Async modes: wait until a safe point installed the newest buffer version.

        Returns the served version (at once in sync mode, or when nothing was received).

        Raises:
            InstallTimeout: the backend reached no safe point within ``timeout`` seconds (is it
                generating?).
        """
        buffer = self.weight_buffer
        deadline = deadline_after(timeout)
        while buffer is not None:
            wanted = buffer.published_version
            if wanted is None or self.rollout.weight_version >= wanted:
                break
            if expired(deadline):
                raise InstallTimeout(
                    f"version {wanted} was not installed within {timeout:.1f} s (serving "
                    f"v{self.rollout.weight_version}); the backend reached no safe point"
                )
            time.sleep(0.001)  # polling the backend's version; installs happen on its thread
        return self.rollout.weight_version

    def close(self, timeout: float = 60.0) -> None:
        """Stop the weight-sync thread and the engine (if this worker started it); a background
        engine parked on torn weights is let go first (an engine stops only unparked).

        Raises:
            RolloutSyncError: called on another thread than the one whose failed receive
                parked the engine (that thread must release the pause).
        """
        self._torn_park.check_thread("close()")
        self._torn_park.release()
        try:
            if self.sync_thread is not None:
                self.sync_thread.stop(timeout)
        finally:
            if self._engine_started and isinstance(self.rollout, BackgroundEngine):
                self._engine_started = False
                self.rollout.stop(timeout)
        self._deliver_async_results()

    # -- recovery ----------------------------------------------------------------------------

    def use_groups(self, groups: SyncGroups, **transfer_kwargs: Any) -> None:
        """Take this replica's P2R transfer, P2R barrier and R2R transfer from ``groups`` (new
        groups after a recovery, :mod:`rollout_sync.recovery`). ``transfer_kwargs`` go to
        :meth:`SyncGroups.p2r_transfer` / :meth:`SyncGroups.r2r_transfer` (``config=``,
        ``timeline=``, ...). Clears a pending :meth:`interrupt`: the recovery it asked for is
        under way."""
        with self._lock:
            self._interrupted = None
        self.p2r = groups.p2r_transfer(**transfer_kwargs)
        self.p2r_barrier = groups.p2r_barrier if self.p2r is not None else None
        self.r2r = groups.r2r_transfer(**transfer_kwargs)
        check_two_communicators(self.rollout, (self.p2r, self.r2r), self._mode)
        self._origin = None  # checksums of a layout on the old groups
        for staging in self._stagings.values():
            staging.discard()  # a version staged on the old groups was never voted on

    def reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """Take part in a recovery's re-seed transfer (:func:`~rollout_sync.recovery.
        recover_weights`), guarded: as its source, send the served weights (egress held,
        generation keeps running); else receive them in place (paused, egress held, committed;
        a torn replica serves again once this lands). In async modes the transfer runs on the
        weight-sync thread like any other.

        Raises:
            TornWeightsError: this replica is the source but its weights are torn.
            WeightTransferError and its kinds: as for a P2R.
        """
        if self.weight_sync_mode.is_async:
            assert self.sync_thread is not None
            job = (
                (lambda: self._async_send(transfer))
                if transfer.is_source
                else (lambda: self._async_receive(transfer))
            )
            # A re-seed receive queues like a P2R, a re-seed send like an R2R.
            future = self.sync_thread.submit("r2r" if transfer.is_source else "p2r", job)
            # Queued jobs run first, each bounded by its own collectives' limits.
            limit = self.weight_sync_timeout * _RESEED_QUEUE_FACTOR
            try:
                result: TransferStats = future.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                future.cancel()  # not run later, on groups a next recovery has destroyed
                raise WeightTransferTimeout(
                    f"the re-seed transfer on the weight-sync thread did not finish within "
                    f"{limit:.1f} s",
                    operation="reseed",
                ) from None
            return result
        if transfer.is_source:
            return self.send_reseed(transfer)
        return self.receive_reseed(transfer)

    def _receive_reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        return self._receive_in_place(transfer)

    def _send_reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        return self._send(transfer, self._served_to_send)

    receive_reseed = weight_sync_handler(_receive_reseed)
    """A re-seed receive, guarded like P2R."""
    send_reseed = holds_payload_egress(_send_reseed)
    """A re-seed send from the served weights, guarded like an R2R send."""

    def statistics(self) -> WorkerStatistics:
        """The running totals since construction, and the engine's state; constant time (and
        one term per staging area: the weights' and each adapter's)."""
        stagings = tuple(self._stagings.values())  # a snapshot: the loop thread may add one
        with self._lock:
            return WorkerStatistics(
                commands=self._commands,
                failed=self._failed,
                syncs=self._syncs,
                weight_version=self.rollout.weight_version,
                weights_torn=self.rollout.weights_torn,
                generation_steps=self._generation_steps,
                engine_started=self._engine_started,
                failed_syncs=self._failed_syncs,
                sync_reports_total=self._reports,
                staging_bytes=sum(s.nbytes for s in stagings),
                staged_discarded=sum(s.discarded for s in stagings),
            )

    # -- guard hooks -------------------------------------------------------------------------

    def payload_egress_components(self) -> Sequence[object]:
        """What the guard holds: the packers and the engine (if they have the hooks)."""
        return (self.data_packer, self.validation_packer, self.rollout, self)

    def on_weight_sync_report(self, report: SyncReport) -> None:
        with self._lock:
            self.sync_reports.append(report)
            self._reports += 1

    def weight_sync_fence(self, timeout: float | None) -> None:
        device_fence(timeout)

    # -- the handlers ------------------------------------------------------------------------

    def _handle_p2r(self, command: P2R) -> Any:
        if self.p2r is None:
            raise RolloutSyncError(
                "P2R command on a worker without a P2R transfer "
                "(only the first replica of a group receives from the trainer)"
            )
        if command.adapter is not None:
            self._refuse_async_adapter(command)
            return self._staged(self._stage_p2r, command)  # adapters: always staged
        return self._path.p2r(command)

    def _handle_r2r(self, command: R2R) -> Any:
        if self.r2r is None:
            raise RolloutSyncError("R2R command on a worker that is not in an R2R group")
        # The role is read per command: use_groups() may have replaced the transfer.
        if command.adapter is not None:
            self._refuse_async_adapter(command)
            send = self.r2r.is_source
            return self._staged(self._stage_r2r_send if send else self._stage_r2r_receive, command)
        if self.r2r.is_source:
            return self._path.r2r_send(command)
        return self._path.r2r_receive(command)

    def _handle_stop(self, command: Stop) -> None:
        self._stopped = True
        if self.sync_thread is not None:
            self.sync_thread.stop(self.weight_sync_timeout)

    def _refuse_async_adapter(self, command: P2R | R2R) -> None:
        """An adapter sync runs on the loop thread; in an async mode the weight-sync thread
        runs collectives on the same groups, so the two could interleave. And an adapter is
        staged in every mode, so its receive runs beside the forwards: the NCCL rule applies
        as to a staged sync, whatever the worker's mode."""
        what = f"{type(command).__name__}(adapter={command.adapter!r})"
        if self.weight_sync_mode.is_async:
            raise RolloutSyncError(
                f"{what} on a worker in {self.weight_sync_mode.value} mode: adapter syncs run "
                "in the sync or staged modes only (an async mode's weight-sync thread shares "
                "the groups)"
            )
        check_two_communicators(
            self.rollout,
            (self.p2r, self.r2r),
            SyncMode.STAGED,
            what=what,
            remedy="An adapter is always received beside generation: give the P2R and R2R "
            "transfers a gloo group (RolloutWorker(staging_device='cpu'))",
        )

    def _receive_p2r(self, command: P2R) -> TransferStats:
        assert self.p2r is not None
        forward = self._relay_target(command)
        self._meet_trainer(forward)
        stats = self._receive_in_place(self.p2r, forward)
        self._keep_origin(stats)
        return stats

    def _relay_target(self, command: P2R) -> SupportsWeightTransfer | None:
        """The R2R transfer a ``P2R(relay=True)`` passes the weights on through."""
        if not command.relay:
            return None
        if self.r2r is None or not self.r2r.is_source:
            raise RolloutSyncError(
                "P2R(relay=True) on a worker that is not the R2R source: only the replica that "
                "receives from the trainer and broadcasts R2R can relay"
            )
        return self.r2r

    def _keep_origin(self, stats: TransferStats) -> None:
        """Remember the trainer's bucket checksums, for a later R2R to pass on."""
        if stats.bucket_checksums is not None:
            self._origin = OriginChecksums(stats.version, stats.layout, stats.bucket_checksums)

    def _meet_trainer(self, forward: SupportsWeightTransfer | None) -> None:
        """The P2R barrier, inside the bracket: from here on this replica sends no payload
        until the sync ends, so the trainer may hold its receives.

        A relay whose barrier fails tells its leaves (already waiting for the R2R manifest)
        that no version is coming, so they fail at once instead of at their limit."""
        if self.p2r_barrier is None:
            return
        try:
            self.p2r_barrier(self.weight_sync_timeout)
        except Exception as exc:
            if forward is not None:
                forward.abort(f"the relay's P2R barrier failed: {type(exc).__name__}")
            raise

    def _receive_r2r(self, command: R2R) -> TransferStats:
        assert self.r2r is not None
        return self._receive_in_place(self.r2r)

    def _send_r2r(self, command: R2R) -> TransferStats:
        assert self.r2r is not None
        return self._send(self.r2r, self._served_to_send)

    def _served_to_send(
        self, target: _Target = _Target()
    ) -> tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]:
        """What is served of ``target`` (the weights, or an adapter), its version and flat
        storage; refused while the weights are torn."""
        self.rollout.check_servable()
        if target.adapter is not None:
            lora = require_adapter(self.rollout, target.adapter)
            lora.check_adapter_servable(target.adapter)
            return target.served(self.rollout), target.version(self.rollout), None
        return (
            self.rollout.served_weights(),
            self.rollout.weight_version,
            self.rollout.flat_weight_storage(),
        )

    receive_weights_p2r = weight_sync_handler(_receive_p2r)
    """P2R receive, guarded: pause, hold egress, lazy init, transfer, fence, release."""
    receive_weights_r2r = weight_sync_handler(_receive_r2r)
    """R2R receive, guarded like P2R."""
    send_weights_r2r = holds_payload_egress(_send_r2r)
    """R2R broadcast from this replica: reads the served tensors only, so egress is held and
    generation keeps running."""

    def _receive_in_place(
        self, transfer: SupportsWeightTransfer, forward: SupportsWeightTransfer | None = None
    ) -> TransferStats:
        self._torn_park.check_thread("a receive")
        self._ensure_engine()
        served = self.rollout.served_weights()
        storage = self.rollout.flat_weight_storage()
        if self.staging is not None:
            self.staging.discard()  # the served weights change under it: it mirrors them no more
        try:
            stats = self._take(transfer, forward, served, storage=storage)
        except BaseException as exc:
            if settle_failed_receive(self.rollout, served, exc):
                self._committed_at = time.time()
                self._torn_park.release()
                self._start_engine()
            elif isinstance(self.rollout, BackgroundEngine):
                # Inside the bracket: the engine stays parked from here while torn.
                self._torn_park.hold_if_torn(self.weight_sync_timeout)
            raise
        reload_received(self.rollout, served)
        self._committed(stats.version)
        self._torn_park.release()
        self._start_engine()
        return stats

    def _take(
        self,
        transfer: SupportsWeightTransfer,
        forward: SupportsWeightTransfer | None,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool | None = None,
        **kwargs: Any,
    ) -> TransferStats:
        """Receive ``transfer`` into ``into``, relaying it through ``forward`` if given
        (``allow_subset``: default the worker's)."""
        subset = self.allow_subset if allow_subset is None else allow_subset
        if forward is None:
            return transfer.receive(into, allow_subset=subset, **kwargs)
        return transfer.relay(into, forward, allow_subset=subset, **kwargs)

    def _send(
        self,
        transfer: SupportsWeightTransfer,
        what: Callable[[], tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]],
    ) -> TransferStats:
        """Send ``what()`` (weights, version, storage) as ``transfer``'s source. If this side
        cannot (torn weights, nothing received yet), the receivers, who are waiting for a
        manifest, are told at once (the abort header) before the error is raised."""
        try:
            weights, version, storage = what()
        except Exception as exc:
            transfer.abort(f"the source cannot send: {type(exc).__name__}: {exc}")
            raise
        origin = (
            self._origin if self._origin is not None and self._origin.version == version else None
        )
        return transfer.send(weights, version=version, origin=origin, storage=storage)

    def _unguarded(self, body: Callable[[Any], TransferStats], command: object) -> TransferStats:
        """The same handler body without pause or egress hold (the demo's ``--unguarded``)."""
        with weight_sync_bracket(
            None,
            name=getattr(body, "__name__", "sync"),
            pause=False,
            hold=False,
            timeline=self.timeline,
            fence=self.weight_sync_fence,
        ) as bracket:
            value = body(command)
        assert bracket.report is not None
        self.last_weight_sync_report = bracket.report
        self.on_weight_sync_report(bracket.report)
        return value

    # -- staged mode: stage, then swap ------------------------------------------------------

    def _staged(
        self, body: Callable[[WeightSyncBracket, Any], TransferStats], command: object
    ) -> TransferStats:
        """Run a staged handler body in a bracket that holds payload egress for the transfer
        but does not pause; the body parks generation only to install
        (:meth:`WeightSyncBracket.stalled`). Unguarded: neither hold nor pause."""
        bracket: WeightSyncBracket | None = None
        try:
            with weight_sync_bracket(
                self.rollout,
                self.payload_egress_components() if self.guarded else (),
                name=getattr(body, "__name__", "staged sync").lstrip("_"),
                mode=SyncMode.STAGED,
                pause=False,
                hold=self.guarded,
                timeout=self.weight_sync_timeout,
                fence=self.weight_sync_fence,
                timeline=self.timeline,
            ) as bracket:
                return body(bracket, command)
        finally:
            if bracket is not None and bracket.report is not None:
                self.last_weight_sync_report = bracket.report
                self.on_weight_sync_report(bracket.report)

    def _stage_p2r(self, bracket: WeightSyncBracket, command: P2R) -> TransferStats:
        """Stage the trainer's version. It is installed at once when this replica is the only
        one, or when it relays (the relay's R2R vote covers every replica); else it waits for
        the R2R this replica sends next, whose vote decides for all."""
        assert self.p2r is not None
        forward = self._relay_target(command)
        self._meet_trainer(forward)
        install = forward is not None or self.r2r is None
        target = _Target.of(command)
        stats = self._stage(bracket, self.p2r, forward, install=install, target=target)
        if target.adapter is None:
            self._keep_origin(stats)
        return stats

    def _stage_r2r_receive(self, bracket: WeightSyncBracket, command: R2R) -> TransferStats:
        assert self.r2r is not None
        return self._stage(bracket, self.r2r, None, install=True, target=_Target.of(command))

    def _stage_r2r_send(self, bracket: WeightSyncBracket, command: R2R) -> TransferStats:
        """Send the version staged by the P2R (or, with none staged, the served one); install
        the staged one once every receiver voted yes, discard it otherwise."""
        assert self.r2r is not None
        target = _Target.of(command)
        staging = self._stagings.get(target.adapter)
        version = staging.staged_version if staging is not None else None
        if staging is None or version is None:
            return self._send(self.r2r, partial(self._served_to_send, target))
        staged = staging

        def what() -> tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]:
            return staged.tensors, version, staged.storage

        try:
            stats = self._send(self.r2r, what)
        except WeightTransferError as exc:
            if self.all_or_none:
                staged.discard()
                raise self._commit_aborted(exc, version, target) from exc
            self._install(bracket, target)  # two-phase off: this replica serves it regardless
            raise
        except BaseException:
            staged.discard()
            raise
        self._install(bracket, target)
        return stats

    def _stage(
        self,
        bracket: WeightSyncBracket,
        transfer: SupportsWeightTransfer,
        forward: SupportsWeightTransfer | None,
        *,
        install: bool,
        target: _Target,
    ) -> TransferStats:
        """Receive ``transfer`` into ``target``'s staging area while generation goes on;
        install the version if ``install``, else keep it staged. A failure discards it: the
        served tensors were never touched. An adapter's set must be whole."""
        self._ensure_engine()
        staging = self._staging_for(target)
        staging.begin(target.served(self.rollout))
        try:
            stats = self._take(
                transfer,
                forward,
                staging.tensors,
                storage=staging.storage,
                write_kind=BUFFER_WRITE,
                allow_subset=self.allow_subset and target.adapter is None,
                **target.verify_kwargs(self.rollout, transfer),
            )
        except WeightTransferError as exc:
            if exc.complete and exc.version is not None and not self.all_or_none:
                staging.staged(exc.version)  # two-phase off: install what landed here whole
                self._install(bracket, target)
                raise
            staging.discard()
            if not self.all_or_none:
                raise
            raise self._commit_aborted(exc, exc.version, target) from exc
        except Exception as exc:  # this rank's own refusal (a manifest that does not fit)
            staging.discard()
            if not self.all_or_none:
                raise
            raise self._commit_aborted(exc, getattr(exc, "version", None), target) from exc
        except BaseException:
            staging.discard()
            raise
        staging.staged(stats.version)
        if install:
            self._install(bracket, target)
        return stats

    def _install(self, bracket: WeightSyncBracket, target: _Target) -> None:
        """Park generation, copy the staged version into the served weights, fence the copy,
        commit it; then let generation go on.

        It runs after every replica voted yes, so a failure here leaves this replica behind the
        others (the in-doubt window of docs/staged.md): generation did not park in time (the
        version stays staged, the served weights untouched), or the engine's ``load_weights``
        failed part-way (the weights are torn, and a background engine stays parked until a
        complete version commits). Either is raised."""
        staging = self._stagings[target.adapter]
        with bracket.stalled(pause=self.guarded):
            try:
                staging.install_into(
                    self.rollout,
                    adapter=target.adapter,
                    fence=partial(self.weight_sync_fence, self.weight_sync_timeout),
                )
            except BaseException:
                if self.rollout.weights_torn and isinstance(self.rollout, BackgroundEngine):
                    self._torn_park.hold_if_torn(self.weight_sync_timeout)
                raise
            self._committed_at = time.time()
        if not self.rollout.weights_torn:
            self._torn_park.release()  # a park an earlier failed install took
        self._start_engine()

    def _staging_for(self, target: _Target) -> StagingArea:
        staging = self._stagings.get(target.adapter)
        if staging is None:
            staging = self._stagings[target.adapter] = target.staging(
                self.rollout, self.staging_device
            )
        return staging

    def _commit_aborted(
        self, exc: Exception, version: int | None, target: _Target
    ) -> StagedCommitAborted:
        failed = tuple(getattr(exc, "failed_ranks", ()))
        problems = exc.problems if isinstance(exc, WeightMismatchError) else None
        first_line = "; ".join(problems[:3]) if problems else (str(exc).splitlines() or [""])[0]
        why = (
            f"rank(s) {list(failed)} voted no"
            if failed
            else f"the transfer failed: {type(exc).__name__}: {first_line}"
        )
        kept = target.version(self.rollout)
        if version is not None:
            what = f"version {version}"
        elif target.step is not None:  # the manifest never arrived: name the step instead
            what = f"the version of step {target.step}"
        else:
            what = "the version being synced"
        return StagedCommitAborted(
            f"{what} of {target} is installed on no replica of this sync (two-phase "
            "commit): "
            f"{why}. This replica keeps serving version {kept}; its served weights were not "
            "touched",
            operation=getattr(exc, "operation", "staged receive"),
            version=version,
            failed_ranks=failed,
            kept_version=kept,
        )

    # -- the engine --------------------------------------------------------------------------

    def _ensure_engine(self) -> None:
        """Build the engine (once). Called inside the bracket by the first sync."""
        self.rollout.ensure_initialized()

    def _start_engine(self) -> None:
        """Start a background engine after its first complete sync (inside the bracket, so in
        sync mode it begins parked and first generates with the new weights)."""
        if not self._engine_started and isinstance(self.rollout, BackgroundEngine):
            self.rollout.start()
            self._engine_started = True

    # -- async modes -------------------------------------------------------------------------

    @contextmanager
    def _async_bracket(self, name: str) -> Iterator[None]:
        """The weight-sync thread's bracket: egress held, generation not paused."""
        hold = self.guarded
        bracket: WeightSyncBracket | None = None
        try:
            with weight_sync_bracket(
                self.rollout,
                self.payload_egress_components() if hold else (),
                name=name,
                mode=self.weight_sync_mode,
                pause=False,
                hold=hold,
                timeout=self.weight_sync_timeout,
                fence=self.weight_sync_fence,
                timeline=self.timeline,
            ) as bracket:
                yield
        finally:
            if bracket is not None and bracket.report is not None:
                self.last_weight_sync_report = bracket.report
                self.on_weight_sync_report(bracket.report)

    def _queue_async(self, kind: str, command: object) -> concurrent.futures.Future[Any]:
        assert self.sync_thread is not None
        if isinstance(command, P2R):
            forward = self._relay_target(command)
            job: Callable[[], TransferStats] = lambda: self._async_p2r(forward)  # noqa: E731
        else:
            job = self._async_r2r
        future = self.sync_thread.submit(kind, job)
        start = time.perf_counter()

        def done(f: concurrent.futures.Future[Any]) -> None:
            exc = f.exception()
            elapsed = time.perf_counter() - start
            if exc is None:
                # Runs on the weight-sync thread before it takes the next job: the buffer still
                # holds what this job transferred.
                if self.on_transfer is not None and self.weight_buffer is not None:
                    self.on_transfer(f.result(), self.weight_buffer.tensors)
                self._async_results.put(
                    CommandResult(
                        command,
                        True,
                        f.result(),
                        elapsed_s=elapsed,
                        weight_version=self.rollout.weight_version,
                    )
                )
            else:
                self._async_results.put(self._failure(command, exc, elapsed))

        future.add_done_callback(done)
        return future

    def _ensure_buffer(self) -> WeightBuffer:
        """Initialize the engine and clone its served weights into the buffer (once)."""
        if self.weight_buffer is None:
            self._ensure_engine()
            self.weight_buffer = WeightBuffer(
                self.rollout.served_weights(),
                mode=self.weight_sync_mode,
                timeline=self.timeline,
                fence_timeout_s=self.weight_sync_timeout,
            )
            assert isinstance(self.rollout, SupportsWeightBuffer)
            self.rollout.attach_weight_buffer(self.weight_buffer)
        return self.weight_buffer

    def _async_receive(
        self, transfer: SupportsWeightTransfer, forward: SupportsWeightTransfer | None = None
    ) -> TransferStats:
        buffer = self._ensure_buffer()
        elsewhere: WeightTransferError | None = None
        with buffer.write(self.weight_sync_timeout) as handle:
            try:
                stats = self._take(transfer, forward, handle.tensors, write_kind=BUFFER_WRITE)
            except WeightTransferError as exc:
                if not (exc.complete and exc.version is not None):
                    raise
                # Every byte landed here intact; the failure was another rank's (or the
                # relay's next hop). Publish the version, and still report the failure.
                handle.version, elsewhere = exc.version, exc
            else:
                handle.version = stats.version
        if not self._engine_started:
            # Not generating yet: install on this thread, then start with the new weights.
            buffer.install_into(self.rollout)
            self._start_engine()
        if elsewhere is not None:
            raise elsewhere
        return stats

    def _async_p2r(self, forward: SupportsWeightTransfer | None = None) -> TransferStats:
        assert self.p2r is not None
        self._meet_trainer(forward)
        stats = self._async_receive(self.p2r, forward)
        self._keep_origin(stats)
        return stats

    def _async_r2r(self) -> TransferStats:
        assert self.r2r is not None
        if not self.r2r.is_source:
            return self._async_receive(self.r2r)
        return self._async_send(self.r2r)

    def _async_send(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """Send the newest complete buffer version (on the weight-sync thread)."""

        def newest() -> tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]:
            buffer = self.weight_buffer
            version = None if buffer is None else buffer.published_version
            if buffer is None or version is None:
                raise RolloutSyncError(
                    "R2R broadcast before this replica received any complete version "
                    "(send P2R first)"
                )
            # This thread is the buffer's only writer, so it is stable while it is read here.
            return buffer.tensors, version, None

        return self._send(transfer, newest)

    def _deliver_async_results(self) -> None:
        while True:
            try:
                result = self._async_results.get_nowait()
            except queue.Empty:
                return
            self._record(result)

    # -- bookkeeping -------------------------------------------------------------------------

    def _failure(self, command: object, exc: BaseException, elapsed: float) -> CommandResult:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return CommandResult(
            command,
            False,
            error=f"{type(exc).__name__}: {exc}\n{text}",
            exception=exc,
            elapsed_s=elapsed,
            weight_version=self.rollout.weight_version,
            committed_at=self._take_committed_at(),
        )

    def _committed(self, version: int) -> None:
        """Commit ``version`` as served, noting when (``CommandResult.committed_at``)."""
        self.rollout.commit_weight_version(version)
        self._committed_at = time.time()

    def _take_committed_at(self) -> float | None:
        at, self._committed_at = self._committed_at, None
        return at

    def _record(self, result: CommandResult) -> None:
        """Count ``result`` and keep it in the history, without its exception (whose
        traceback would keep the failed transfer's frames and tensors alive)."""
        sync = isinstance(result.command, (P2R, R2R))
        kept = result if result.exception is None else dataclasses.replace(result, exception=None)
        with self._lock:
            self.results.append(kept)
            self._commands += 1
            self._failed += not result.ok
            self._syncs += result.ok and sync
            self._failed_syncs += (not result.ok) and sync
        if self.on_result is not None:
            self.on_result(result)
