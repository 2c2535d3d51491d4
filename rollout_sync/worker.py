"""The rollout worker: a command loop that runs weight syncs while the engine keeps generating.

A :class:`RolloutWorker` owns one rollout engine (a :class:`~rollout_sync.RolloutBase`) and its
two weight transfers: P2R (from the trainer) and R2R (within the replica group). Commands arrive
on a queue (any object with ``get(timeout=...)``: a ``queue.Queue``, a ``multiprocessing``
queue fed by a controller), are dispatched through a handler registry, and the main loop
interleaves them with generation:

* a backend that generates on its own (a stream scheduler, a threaded backend) keeps going
  while the loop waits for commands, and is parked by the guard during a sync;
* a blocking backend gets one ``step_generation()`` call whenever no command is waiting.

How each P2R and R2R lands is the worker's install strategy, chosen once from its mode
(:mod:`rollout_sync.sync`): in place (``SYNC``: the served tensors are written with generation
paused; a failure after the first write marks them torn and the engine refuses to generate
until a complete sync commits), staged (``STAGED``: a staging copy is written while generation
goes on and installed under a short park; every replica of a sync installs or none does), or
buffered (the async modes: a weight-sync thread writes a :class:`~rollout_sync.WeightBuffer`
that the backend installs at its safe points). LoRA adapters are always staged.

The in-place handlers are also the worker's guard-decorated methods, so the bracket (pause,
egress hold, fence) covers lazy engine initialization and the barrier wait as well as the
transfer: :meth:`RolloutWorker.receive_weights_p2r` and :meth:`RolloutWorker.receive_weights_r2r`
are :func:`~rollout_sync.weight_sync_handler` s; :meth:`RolloutWorker.send_weights_r2r` only
reads the served tensors, so it :func:`~rollout_sync.holds_payload_egress`.

Commands, channels and groups live in :mod:`rollout_sync.commands` and :mod:`rollout_sync.groups`
(importable from here too). Rendezvous is torch.distributed's own (``env://`` or ``tcp://``):
see :mod:`rollout_sync.distributed` and :func:`build_sync_groups`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .backend import RolloutBase
from .buffer import WeightBuffer, WeightSyncThread
from .commands import (
    P2R,
    R2R,
    Command,
    CommandHistory,
    CommandResult,
    CommandSink,
    CommandSource,
    Stop,
    WorkerCommandChannel,
)
from .distributed import DEFAULT_GROUP_TIMEOUT_S
from .errors import CommandTimeout, RolloutSyncError, RunInterrupted
from .groups import SyncGroups, build_sync_groups
from .guard import SyncReport, device_fence, holds_payload_egress, weight_sync_handler
from .staging import StagingArea
from .sync.buffered import Buffered
from .sync.contract import InstallStrategy, SupportsWeightTransfer, check_transfer
from .sync.mode import SyncMode
from .sync.slot import BackgroundEngine, EngineSlot
from .sync.slot import reload_received as reload_received  # their old home: importable
from .sync.slot import settle_failed_receive as settle_failed_receive
from .sync.staged import Staged
from .sync.table import strategy_for
from .trace import Timeline
from .transfer import TransferStats

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
            staging area, or for a delta not installed yet a copy of the served tensors with
            it applied), right after it, outside the bracket, on the thread that ran it and
            before that thread starts the next one, so the tensors hold exactly what was
            transferred. For checks.
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
        check_transfer("p2r", p2r)
        check_transfer("r2r", r2r)
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
        self.staging_device = staging_device
        self.all_or_none = all_or_none
        self._history = CommandHistory(history)
        self.results = self._history.results
        self.sync_reports: deque[SyncReport] = self._history.sync_reports
        self.last_weight_sync_report: SyncReport | None = None
        self.handlers: dict[type, Callable[[Any], Any]] = {}
        self._slot = EngineSlot(rollout, "RolloutWorker")
        self._strategy: InstallStrategy = strategy_for(mode)(self, self._slot)
        """How every P2R and R2R lands, chosen once here (:mod:`rollout_sync.sync`)."""
        self._strategy.check_transfers((p2r, r2r))
        self._adapters = (
            self._strategy if isinstance(self._strategy, Staged) else Staged(self, self._slot)
        )
        """Adapter syncs: always staged (the mode's own strategy when it stages already)."""
        self._stopped = False
        self._interrupted: str | None = None
        self._generation_steps = 0
        self._lock = self._history.lock  # the history's, its totals' and ``_interrupted``
        self.register_handler(P2R, self._handle_p2r)
        self.register_handler(R2R, self._handle_r2r)
        self.register_handler(Stop, self._handle_stop)

    @property
    def staging(self) -> StagingArea | None:
        """The staging copy of the weights (``SyncMode.STAGED``, once a sync built it)."""
        return self._adapters.stagings.get(None)

    def adapter_staging(self, name: str) -> StagingArea | None:
        """The staging copy of LoRA adapter ``name`` (once a sync of it built it)."""
        return self._adapters.stagings.get(name)

    @property
    def weight_buffer(self) -> WeightBuffer | None:
        """The async modes' weight buffer (once the first sync made it)."""
        return self._strategy.weight_buffer if isinstance(self._strategy, Buffered) else None

    @property
    def sync_thread(self) -> WeightSyncThread | None:
        """The async modes' weight-sync thread."""
        return self._strategy.sync_thread if isinstance(self._strategy, Buffered) else None

    @property
    def weight_sync_mode(self) -> SyncMode:
        """How syncs reach the served weights (``mode=``): it chose the install strategy."""
        return self._mode

    @property
    def guarded(self) -> bool:
        """Whether syncs run inside the bracket (``guarded=``); fixed at construction."""
        return self._guarded

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
        self._slot.committed_at = None  # a commit outside a command (a re-seed) is not this one's
        if handler is None:
            known = sorted(t.__name__ for t in self.handlers)
            error = f"no handler registered for {type(command).__name__}; known: {known}"
            result = CommandResult(
                command, False, error=error, weight_version=self.rollout.weight_version
            )
        else:
            try:
                value = handler(command)
            except Exception as exc:  # noqa: BLE001 - becomes a failed result, loop goes on
                result = self._failure(command, exc, time.perf_counter() - start)
            else:
                if isinstance(value, concurrent.futures.Future):
                    self._track(command, value, start)
                elif isinstance(value, TransferStats) and self.on_transfer is not None:
                    self.on_transfer(value, self._strategy_of(command).transferred(command, value))
                result = CommandResult(
                    command,
                    True,
                    value,
                    elapsed_s=time.perf_counter() - start,
                    weight_version=self.rollout.weight_version,
                    committed_at=self._slot.take_committed_at(),
                )
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
            first = self._history.commands
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
            handled = self._history.commands - first
            return list(self.results)[-handled:] if handled else []

    def interrupt(self, reason: str = "interrupted") -> None:
        """Make :meth:`run` leave its loop with :class:`~rollout_sync.errors.RunInterrupted`.

        Thread-safe: for whoever learns that the job broke while this replica waits for commands
        that will never come (a controller that saw another process die). The command being
        handled, if any, finishes first; generation stops with the loop. The interruption
        stays until a :meth:`run` raises it or :meth:`use_groups` (the recovery) clears it.
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
        """Async modes: wait until a safe point installed the newest buffer version; the
        served version (at once in the other modes, or when nothing was received).

        Raises:
            InstallTimeout: the backend reached no safe point within ``timeout`` seconds (is it
                generating?).
        """
        if isinstance(self._strategy, Buffered):
            return self._strategy.wait_for_install(timeout)
        return self.rollout.weight_version

    def close(self, timeout: float = 60.0) -> None:
        """Stop the weight-sync thread and the engine (if this worker started it); a background
        engine parked on torn weights is let go first (an engine stops only unparked).

        Raises:
            RolloutSyncError: called on another thread than the one whose failed receive
                parked the engine (that thread must release the pause).
        """
        self._slot.torn_park.check_thread("close()")
        try:
            self._strategy.close(timeout)
        finally:
            self._slot.stop_engine(timeout)
        self._deliver_async_results()

    # -- recovery ----------------------------------------------------------------------------

    def use_groups(self, groups: SyncGroups, **transfer_kwargs: Any) -> None:
        """Take this replica's P2R transfer, P2R barrier and R2R transfer from ``groups`` (new
        groups after a recovery, :mod:`rollout_sync.recovery`). ``transfer_kwargs`` go to
        :meth:`SyncGroups.p2r_transfer` / :meth:`SyncGroups.r2r_transfer` (``config=``,
        ``timeline=``, ...). Clears a pending :meth:`interrupt` (its recovery is under way)."""
        with self._lock:
            self._interrupted = None
        self.p2r = groups.p2r_transfer(**transfer_kwargs)
        self.p2r_barrier = groups.p2r_barrier if self.p2r is not None else None
        self.r2r = groups.r2r_transfer(**transfer_kwargs)
        self._strategy.check_transfers((self.p2r, self.r2r))
        for strategy in {id(s): s for s in (self._strategy, self._adapters)}.values():
            strategy.discard()  # checksums and versions staged on the old groups

    def reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """Take part in a recovery's re-seed transfer (:func:`~rollout_sync.recovery.
        recover_weights`), guarded: as its source, send the served weights (egress held);
        else receive them in place, parked (a torn replica serves again once this lands). In
        async modes it runs on the weight-sync thread like any other transfer.

        Raises:
            TornWeightsError: this replica is the source but its weights are torn.
            WeightTransferError and its kinds: as for a P2R.
        """
        return self._strategy.reseed(transfer)

    def statistics(self) -> WorkerStatistics:
        """The running totals since construction, and the engine's state; constant time."""
        staged, h = self._adapters.statistics(), self._history
        with self._lock:
            return WorkerStatistics(
                commands=h.commands,
                failed=h.failed,
                syncs=h.syncs,
                weight_version=self.rollout.weight_version,
                weights_torn=self.rollout.weights_torn,
                generation_steps=self._generation_steps,
                engine_started=self._slot.engine_started,
                failed_syncs=h.failed_syncs,
                sync_reports_total=h.reports,
                staging_bytes=staged.staging_bytes,
                staged_discarded=staged.staged_discarded,
            )

    # -- guard hooks -------------------------------------------------------------------------

    def payload_egress_components(self) -> Sequence[object]:
        """What the guard holds: the packers and the engine (if they have the hooks)."""
        return (self.data_packer, self.validation_packer, self.rollout, self)

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self._history.report(report)

    def weight_sync_fence(self, timeout: float | None) -> None:
        device_fence(timeout)

    # -- the handlers: each command to its strategy --------------------------------------------

    def _handle_p2r(self, command: P2R) -> Any:
        if self.p2r is None:
            raise RolloutSyncError(  # only the first replica of a group receives from the trainer
                "P2R command on a worker without a P2R transfer"
            )
        strategy = self._strategy_of(command)
        return strategy.p2r(command, strategy.relay_target(command))

    def _handle_r2r(self, command: R2R) -> Any:
        if self.r2r is None:
            raise RolloutSyncError("R2R command on a worker that is not in an R2R group")
        # The role is read per command: use_groups() may have replaced the transfer.
        strategy = self._strategy_of(command)
        if self.r2r.is_source:
            return strategy.r2r_send(command)
        return strategy.r2r_receive(command)

    def _handle_stop(self, command: Stop) -> None:
        self._stopped = True
        self._strategy.close(self.weight_sync_timeout)

    def _strategy_of(self, command: object) -> InstallStrategy:
        """The mode's strategy; for an adapter's command, the staged one, if it may run."""
        if getattr(command, "adapter", None) is None:
            return self._strategy
        return self._adapters.for_adapter(command)

    def _receive_p2r(self, command: P2R) -> TransferStats:
        # The mode's strategy writes in place here too, so what it keeps (a staging copy that
        # mirrors the served weights, the trainer's checksums) follows the write.
        return self._strategy.receive_p2r(self._strategy.relay_target(command))

    def _receive_r2r(self, command: R2R) -> TransferStats:
        return self._strategy.receive_r2r()

    def _send_r2r(self, command: R2R) -> TransferStats:
        return self._strategy.send_r2r()

    receive_weights_p2r = weight_sync_handler(_receive_p2r)
    """P2R receive, guarded: pause, hold egress, lazy init, transfer, fence, release."""
    receive_weights_r2r = weight_sync_handler(_receive_r2r)
    """R2R receive, guarded like P2R."""
    send_weights_r2r = holds_payload_egress(_send_r2r)
    """R2R broadcast from this replica: reads the served tensors only, so egress is held and
    generation keeps running."""

    # -- bookkeeping -------------------------------------------------------------------------

    def _track(self, command: object, future: concurrent.futures.Future[Any], start: float) -> None:
        """Record an async job's result when done (on the weight-sync thread, before its next
        job: the buffer still holds what this job transferred)."""

        def done(f: concurrent.futures.Future[Any]) -> None:
            exc, elapsed = f.exception(), time.perf_counter() - start
            if exc is not None:
                self._history.later(self._failure(command, exc, elapsed))
                return
            if self.on_transfer is not None:
                self.on_transfer(f.result(), self._strategy.transferred(command, f.result()))
            version = self.rollout.weight_version
            ok = CommandResult(command, True, f.result(), elapsed_s=elapsed, weight_version=version)
            self._history.later(ok)

        future.add_done_callback(done)

    def _deliver_async_results(self) -> None:
        for result in self._history.deliver():
            if self.on_result is not None:
                self.on_result(result)

    def _failure(self, command: object, exc: BaseException, elapsed: float) -> CommandResult:
        version, at = self.rollout.weight_version, self._slot.take_committed_at()
        return CommandHistory.failure(command, exc, elapsed, version, at)

    def _record(self, result: CommandResult) -> None:
        self._history.record(result)
        if self.on_result is not None:
            self.on_result(result)
