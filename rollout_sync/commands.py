"""The commands a rollout worker takes, what handling one returns, and the channel that turns a
trainer's announcements into them.

* :class:`P2R`, :class:`R2R`, :class:`Stop`: the commands (:data:`Command`).
* :class:`CommandResult`: what handling one did.
* :class:`CommandSource` / :class:`CommandSink`: the two ends of a worker's command queue.
* :class:`WorkerCommandChannel`: the trainer's channel that puts one announcement's commands on
  every replica's queue.

All of them are importable from :mod:`rollout_sync.worker` too (their old home).
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ._deadline import deadline_after, wait_arg
from .errors import WeightBroadcastTimeout
from .trainer import CommandKind, WeightSyncCommand

if TYPE_CHECKING:
    from .groups import SyncGroups

__all__ = [
    "P2R",
    "R2R",
    "Command",
    "CommandHistory",
    "CommandResult",
    "CommandSink",
    "CommandSource",
    "Stop",
    "WorkerCommandChannel",
]


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


class CommandHistory:
    """What a command loop did: the recent results and sync reports (at most ``history`` of
    each, oldest first) and the running totals since it was built, so a loop that syncs every
    few seconds for weeks holds no more than this. Thread-safe: async jobs complete on the
    weight-sync thread (:meth:`later`), the loop takes them in (:meth:`deliver`).

    Kept results carry ``error`` but not ``exception``: an exception holds, through its
    traceback, the frames and tensors of a failed transfer.
    """

    def __init__(self, history: int) -> None:
        self.results: deque[CommandResult] = deque(maxlen=history)
        self.sync_reports: deque[Any] = deque(maxlen=history)
        self.commands = self.failed = self.syncs = self.failed_syncs = self.reports = 0
        self.lock = threading.Lock()
        """Guards the history and the totals."""
        self._later: queue.SimpleQueue[CommandResult] = queue.SimpleQueue()

    def __repr__(self) -> str:
        return f"<CommandHistory {self.commands} commands, {self.failed} failed>"

    @staticmethod
    def failure(
        command: object,
        exc: BaseException,
        elapsed: float,
        weight_version: int,
        committed_at: float | None,
    ) -> CommandResult:
        """The result of a command whose handler raised ``exc``."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return CommandResult(
            command,
            False,
            error=f"{type(exc).__name__}: {exc}\n{text}",
            exception=exc,
            elapsed_s=elapsed,
            weight_version=weight_version,
            committed_at=committed_at,
        )

    def record(self, result: CommandResult) -> None:
        """Count ``result`` and keep it (without its exception)."""
        sync = isinstance(result.command, (P2R, R2R))
        kept = result if result.exception is None else replace(result, exception=None)
        with self.lock:
            self.results.append(kept)
            self.commands += 1
            self.failed += not result.ok
            self.syncs += result.ok and sync
            self.failed_syncs += (not result.ok) and sync

    def report(self, report: Any) -> None:
        """Keep a sync report and count it."""
        with self.lock:
            self.sync_reports.append(report)
            self.reports += 1

    def later(self, result: CommandResult) -> None:
        """An async job's result, from any thread: recorded by the next :meth:`deliver`."""
        self._later.put(result)

    def deliver(self) -> list[CommandResult]:
        """Record the async results that came in since the last call; those results."""
        delivered: list[CommandResult] = []
        while True:
            try:
                result = self._later.get_nowait()
            except queue.Empty:
                return delivered
            self.record(result)
            delivered.append(result)
