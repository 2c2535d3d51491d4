"""The rollout worker in one process: the command loop, the handlers' brackets, lazy init,
torn weights, and the async path. A small fake stands in for the distributed transfer (the
real one is exercised across processes in test_transfer_mp.py and test_worker_mp.py)."""

from __future__ import annotations

import gc
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from rollout_sync.backend import TornWeightsPark
from rollout_sync.errors import (
    ChecksumMismatchError,
    RunInterrupted,
    TornWeightsError,
    WeightMismatchError,
    WeightTransferError,
    WeightTransferTimeout,
)
from rollout_sync.sync import SyncMode
from rollout_sync.testing import (
    AsyncTornReadBackend,
    EventLog,
    RecordingPacker,
    RecordingRollout,
    TornReadBackend,
    VersionStampedModel,
)
from rollout_sync.trace import SpanKind, Timeline
from rollout_sync.transfer import TransferStats
from rollout_sync.weights import check_weights_match, specs_of
from rollout_sync.worker import P2R, R2R, RolloutWorker, Stop


class FakeTransfer:
    """One side of a transfer, in process: ``receive`` copies ``source()`` into the targets.

    ``fail_after=k`` raises a WeightTransferError after writing ``k`` tensors (a dead peer).
    """

    def __init__(
        self,
        source: Callable[[], tuple[int, Mapping[str, torch.Tensor]]],
        *,
        is_source: bool = False,
        log: EventLog | None = None,
    ) -> None:
        self.source = source
        self.is_source = is_source
        self.log = log
        self.fail_after: int | None = None
        self.fail_with: BaseException | None = None
        """Raised in place of ``fail_after``'s WeightTransferError (an error of another type)."""
        self.complete_but_failed = False
        self.sent: list[int] = []

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        version, weights = self.source()
        if self.log is not None:
            self.log.add("transfer")
        check_weights_match(specs_of(weights), into)
        for i, (name, tensor) in enumerate(weights.items()):
            if self.fail_after is not None and i == self.fail_after:
                if self.fail_with is not None:
                    raise self.fail_with
                raise WeightTransferError(
                    "peer died", operation="fake receive", version=version, tensors_written=i
                )
            into[name].copy_(tensor)
        if self.complete_but_failed:
            raise ChecksumMismatchError(
                "rank 9 failed",
                operation="fake receive",
                version=version,
                tensors_written=len(weights),
                buckets=(),
                failed_ranks=(9,),
                complete=True,
            )
        return TransferStats.build(
            role="receive",
            version=version,
            tensors=len(weights),
            buckets=1,
            nbytes=0,
            manifest_s=0.0,
            transfer_s=0.0,
            total_s=0.0,
            tensors_written=len(weights),
        )

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: object = None,
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        if self.log is not None:
            self.log.add("send")
        self.sent.append(version)
        return TransferStats.build(
            role="send",
            version=version,
            tensors=len(weights),
            buckets=1,
            nbytes=0,
            manifest_s=0.0,
            transfer_s=0.0,
            total_s=0.0,
        )

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: FakeTransfer,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        stats = self.receive(into, allow_subset=allow_subset, write_kind=write_kind)
        forward.send(into, version=stats.version)
        return stats

    def abort(self, reason: str, *, version: int | None = None) -> None:
        if self.log is not None:
            self.log.add("abort")


@pytest.mark.parametrize(
    ("error", "written", "torn"),
    [
        (RuntimeError("Connection closed by peer"), 1, True),  # raw: proves nothing
        (RuntimeError("Connection closed by peer"), 0, True),  # even before any write
        (WeightTransferError("died", operation="x", tensors_written=0), 0, False),
        (WeightMismatchError(["w: shape"]), 0, False),  # the check before any write
    ],
)
def test_a_failed_receive_is_torn_unless_the_transfer_proves_nothing_was_written(
    error: BaseException, written: int, torn: bool
) -> None:
    """Fail closed: only the transfer's own word (its typed error's ``tensors_written``, or
    the refusal before any write) clears a write; an error of any other type counts as one."""
    weights = {"a": torch.ones(2), "b": torch.ones(2)}
    rollout = RecordingRollout(EventLog(), {"a": torch.zeros(2), "b": torch.zeros(2)})
    transfer = FakeTransfer(lambda: (1, weights))
    transfer.fail_after, transfer.fail_with = written, error
    log = EventLog()
    r2r = FakeTransfer(lambda: (1, weights), is_source=True, log=log)
    worker = RolloutWorker(rollout, p2r=transfer, r2r=r2r)
    result = worker.handle(P2R(step=1))
    assert not result.ok and result.exception is error
    assert rollout.weights_torn is torn and rollout.weight_version == 0
    sent = worker.handle(R2R(step=1))
    if torn:
        if not isinstance(error, WeightTransferError):
            with pytest.raises(TornWeightsError, match="does not say what was written"):
                rollout.check_servable()
        # A torn source never sends: it aborts, so its receivers fail at once.
        assert isinstance(sent.exception, TornWeightsError) and log.events == ["abort"]
    else:
        assert sent.ok and r2r.sent == [0]


def _stamped(model: VersionStampedModel, version: int) -> tuple[int, dict[str, torch.Tensor]]:
    return version, model.stamped(version)


# -- the bracket around the handlers -----------------------------------------------------------


def test_p2r_runs_lazy_init_and_transfer_inside_pause_and_egress_hold() -> None:
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.zeros(4)})
    packer = RecordingPacker(log=log)
    transfer = FakeTransfer(lambda: (7, {"w": torch.full((4,), 7.0)}), log=log)
    worker = RolloutWorker(rollout, p2r=transfer, data_packer=packer)
    result = worker.handle(P2R(step=7))
    assert result.ok, result.error
    assert log.events == [
        "pause:enter",
        "hold_sends:enter",
        "init",
        "transfer",
        "hold_sends:exit",
        "pause:exit",
    ]
    assert rollout.weight_version == 7 == result.weight_version
    assert worker.last_weight_sync_report is not None
    assert worker.last_weight_sync_report.handler == "_receive_p2r"
    assert worker.last_weight_sync_report.paused and worker.last_weight_sync_report.egress_held
    worker.handle(P2R(step=8))
    assert rollout.initialize_calls == 1  # lazy: once


def test_the_p2r_barrier_is_met_inside_the_bracket_before_the_transfer() -> None:
    """The trainer takes its payload receive hold once past this barrier: by then this
    replica must be parked and hold its own sends (docs/transport.md)."""
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.zeros(4)})
    packer = RecordingPacker(log=log)
    transfer = FakeTransfer(lambda: (1, {"w": torch.ones(4)}), log=log)
    limits: list[float] = []

    def barrier(timeout: float) -> None:
        limits.append(timeout)
        log.add("barrier")

    worker = RolloutWorker(
        rollout,
        p2r=transfer,
        p2r_barrier=barrier,
        data_packer=packer,
        weight_sync_timeout=7.0,
    )
    assert worker.handle(P2R()).ok
    assert log.events == [
        "pause:enter",
        "hold_sends:enter",
        "barrier",
        "init",
        "transfer",
        "hold_sends:exit",
        "pause:exit",
    ]
    assert limits == [7.0]


def test_the_r2r_source_holds_egress_but_lets_generation_run() -> None:
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.zeros(4)})
    rollout.commit_weight_version(3)
    packer = RecordingPacker(log=log)
    transfer = FakeTransfer(lambda: (0, {}), is_source=True, log=log)
    worker = RolloutWorker(rollout, r2r=transfer, data_packer=packer)
    assert worker.handle(R2R()).ok
    assert log.events == ["hold_sends:enter", "send", "hold_sends:exit"]
    assert transfer.sent == [3]


def test_unguarded_handlers_take_no_pause_and_no_hold() -> None:
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.zeros(4)})
    packer = RecordingPacker(log=log)
    transfer = FakeTransfer(lambda: (1, {"w": torch.ones(4)}), log=log)
    worker = RolloutWorker(
        rollout,
        p2r=transfer,
        data_packer=packer,
        guarded=False,
    )
    assert worker.handle(P2R()).ok
    assert log.events == ["init", "transfer"]
    assert worker.sync_reports and not worker.sync_reports[0].paused


@pytest.mark.timeout(30)
def test_a_threaded_engine_starts_inside_the_first_sync_and_first_serves_new_weights() -> None:
    timeline = Timeline()
    model = VersionStampedModel(4, 64, timeline=timeline)
    backend = TornReadBackend(model, timeline=timeline)
    transfer = FakeTransfer(lambda: _stamped(model, 1))
    worker = RolloutWorker(backend, p2r=transfer, timeline=timeline)
    assert not backend.running
    try:
        assert worker.handle(P2R()).ok
        assert backend.running and worker.statistics().engine_started
        model.wait_for_forwards(1, timeout=10)  # the first forward after the sync
    finally:
        worker.close()
    sync = timeline.spans(SpanKind.SYNC)[0]
    first_forward = min(s.start_ns for s in timeline.spans(SpanKind.FORWARD))
    assert first_forward >= sync.end_ns  # it began parked, and read version 1 only
    assert timeline.spans(SpanKind.FORWARD)[0].args["versions"] == [1]
    assert not backend.running


# -- torn weights ------------------------------------------------------------------------------


def test_a_transfer_that_fails_after_writing_marks_the_weights_torn() -> None:
    model = VersionStampedModel(4, 16)
    backend = TornReadBackend(model)
    transfer = FakeTransfer(lambda: _stamped(model, 2))
    worker = RolloutWorker(backend, p2r=transfer)
    transfer.fail_after = 0
    failed = worker.handle(P2R())
    assert not failed.ok and not backend.weights_torn  # nothing written: still whole
    transfer.fail_after = 2
    failed = worker.handle(P2R())
    assert not failed.ok and isinstance(failed.exception, WeightTransferError)
    assert backend.weights_torn
    with pytest.raises(TornWeightsError, match="refuses to generate"):
        backend.check_servable()
    transfer.fail_after = None
    assert worker.handle(P2R()).ok
    assert not backend.weights_torn and backend.weight_version == 2
    worker.close()


class _CarelessBackend(TornReadBackend):
    """Serves on its own thread and never looks at ``weights_torn``: only its ``paused()``
    (the gate every step runs in) can keep it from serving torn weights. ``stepped`` is set
    after every step, ``served_torn`` after one on torn weights."""

    def __init__(self, model: VersionStampedModel) -> None:
        super().__init__(model)
        self.stepped = threading.Event()
        self.served_torn = threading.Event()

    def _serve_forever(self) -> None:
        while not self._stopping.is_set():
            self.generation_gate.enter_section(math.inf)
            try:
                if self.weights_torn:
                    self.served_torn.set()
                self.stepped.set()
            finally:
                self.generation_gate.exit_section()
            self._stopping.wait(0.001)  # pacing on purpose: a step a millisecond, not a spin


@pytest.mark.timeout(30)
@pytest.mark.parametrize("parked", [True, False], ids=["parked", "park_disabled"])
def test_a_background_engine_that_ignores_torn_weights_stays_parked_while_torn(
    parked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not parked:  # the counterfactual: the worker no longer parks it, and it serves torn
        monkeypatch.setattr(TornWeightsPark, "hold_if_torn", lambda self, timeout: None)
    model = VersionStampedModel(4, 16)
    backend = _CarelessBackend(model)
    transfer = FakeTransfer(lambda: _stamped(model, 2))
    worker = RolloutWorker(backend, p2r=transfer)
    try:
        assert worker.handle(P2R()).ok
        assert backend.stepped.wait(10), "the engine never served"
        transfer.fail_after = 2
        assert not worker.handle(P2R()).ok and backend.weights_torn
        if not parked:
            assert backend.served_torn.wait(10), "the unparked engine never served torn"
            return
        assert backend.statistics().parked  # the gate is held: no step can start
        transfer.fail_after = None
        backend.stepped.clear()  # the last step ran before the park
        assert worker.handle(P2R()).ok and not backend.statistics().parked
        assert backend.stepped.wait(10), "the engine did not serve again after the commit"
        assert not backend.served_torn.is_set()
    finally:
        worker.close()
    assert not backend.running


def test_a_group_failure_after_a_complete_receive_commits_the_version() -> None:
    model = VersionStampedModel(4, 16)
    backend = TornReadBackend(model)
    transfer = FakeTransfer(lambda: _stamped(model, 5))
    transfer.complete_but_failed = True
    worker = RolloutWorker(backend, p2r=transfer)
    result = worker.handle(P2R())
    assert not result.ok and "rank 9 failed" in (result.error or "")
    assert backend.weight_version == 5 and not backend.weights_torn
    worker.close()


@pytest.mark.timeout(30)
def test_the_loop_does_not_generate_on_torn_weights() -> None:
    """A blocking engine: the loop calls step_generation between commands, never while torn."""
    log = EventLog()
    rollout = RecordingRollout(log, {"a": torch.zeros(2), "b": torch.zeros(2)})
    version = [0]

    def source() -> tuple[int, dict[str, torch.Tensor]]:
        version[0] += 1
        return version[0], {
            "a": torch.full((2,), float(version[0])),
            "b": torch.full((2,), float(version[0])),
        }

    transfer = FakeTransfer(source)
    failed = threading.Event()  # the loop thread recorded the failed sync (weights torn)
    worker = RolloutWorker(
        rollout, p2r=transfer, on_result=lambda result: None if result.ok else failed.set()
    )
    generated: list[tuple[int, bool]] = []

    def step_generation() -> None:
        generated.append((rollout.weight_version, rollout.weights_torn))
        if len(generated) == 1:
            transfer.fail_after = 1  # the controller's next sync will die half-way
            worker.submit(P2R())
        else:
            worker.submit(Stop())

    worker.step_generation = step_generation

    def recover() -> None:
        assert failed.wait(10), "the loop thread never recorded the failed sync"
        assert rollout.weights_torn
        transfer.fail_after = None
        worker.submit(P2R())

    helper = threading.Thread(target=recover)
    helper.start()
    worker.submit(P2R())
    results = worker.run(idle_timeout_s=10)
    helper.join(10)
    assert [r.ok for r in results] == [True, False, True, True]
    assert generated == [(1, False), (3, False)]
    assert worker.statistics().generation_steps == 2


# -- the loop ----------------------------------------------------------------------------------


def test_registry_unknown_commands_custom_handlers_and_stop() -> None:
    rollout = RecordingRollout(EventLog())
    worker = RolloutWorker(rollout)
    seen: list[object] = []

    class Ping:
        pass

    unknown = worker.handle(Ping())
    assert not unknown.ok and "no handler registered for Ping" in (unknown.error or "")
    worker.register_handler(Ping, seen.append)
    worker.submit(Ping())
    worker.submit(P2R())  # no P2R transfer on this worker: a clear failure, the loop goes on
    worker.submit(Stop())
    results = worker.run(idle_timeout_s=10)  # this run's results; the history has all four
    assert [type(r.command).__name__ for r in results] == ["Ping", "P2R", "Stop"]
    assert [r.ok for r in results] == [True, False, True]
    assert "without a P2R transfer" in (results[1].error or "")
    assert list(worker.results) == [unknown, *results]
    assert len(seen) == 1


def test_a_stop_ends_one_run_and_the_next_run_takes_commands_again() -> None:
    """After a recovery a replica calls run() again: the Stop that ended the first loop must
    not end the second at once."""
    worker = RolloutWorker(RecordingRollout(EventLog()))
    seen: list[object] = []

    class Ping:
        pass

    worker.register_handler(Ping, seen.append)
    worker.submit(Stop())
    worker.run(idle_timeout_s=10)
    worker.submit(Ping())
    worker.submit(Stop())
    worker.run(idle_timeout_s=10)
    assert len(seen) == 1


def test_interrupt_makes_a_waiting_run_raise_and_a_recovery_clears_a_stale_one() -> None:
    worker = RolloutWorker(RecordingRollout(EventLog()))
    waiting = threading.Event()

    class Marker:
        pass

    worker.register_handler(Marker, lambda command: waiting.set())
    worker.submit(Marker())
    outcome: list[BaseException] = []

    def loop() -> None:
        try:
            worker.run(idle_timeout_s=30, poll_s=0.01)
        except RunInterrupted as exc:
            outcome.append(exc)

    thread = threading.Thread(target=loop)
    thread.start()
    assert waiting.wait(10)  # the loop is running, waiting for its next command
    worker.interrupt("rank 3 died")
    thread.join(10)
    assert not thread.is_alive() and len(outcome) == 1
    assert outcome[0].reason == "rank 3 died" and "rank 3 died" in str(outcome[0])
    # An interruption that comes before run() is not lost ...
    worker.interrupt("again")
    with pytest.raises(RunInterrupted, match="again"):
        worker.run(idle_timeout_s=5)
    # ... and one that the recovery has dealt with (use_groups) does not end the next loop.
    worker.interrupt("stale")
    worker.use_groups(_NoGroups())  # type: ignore[arg-type]
    worker.submit(Stop())
    assert [type(r.command) for r in worker.run(idle_timeout_s=5)][-1] is Stop


class _NoGroups:
    """SyncGroups of a replica that takes part in no transfer."""

    def p2r_transfer(self, **kwargs: Any) -> None:
        return None

    def r2r_transfer(self, **kwargs: Any) -> None:
        return None


def test_run_gives_up_when_no_command_arrives() -> None:
    worker = RolloutWorker(RecordingRollout(EventLog()))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no command arrived for 0\.2 s"):
        worker.run(idle_timeout_s=0.2, poll_s=0.02)
    assert time.monotonic() - started < 5


def test_commands_can_come_from_any_queue_like_source() -> None:
    source: queue.SimpleQueue[Any] = queue.SimpleQueue()
    source.put(Stop())
    worker = RolloutWorker(RecordingRollout(EventLog()), commands=source)
    with pytest.raises(TypeError, match="default queue"):
        worker.submit(Stop())
    assert [type(r.command) for r in worker.run(idle_timeout_s=5)] == [Stop]


def test_a_long_lived_worker_keeps_a_bounded_history_and_no_failed_transfer_alive() -> None:
    """Thousands of syncs, every tenth dying half-way: the history stays at its bound, the
    totals count everything, and the tensors a failed transfer held (through its exception's
    traceback) are unreachable once the caller drops the result that reported it."""
    rollout = RecordingRollout(EventLog(), {"a": torch.zeros(4), "b": torch.zeros(4)})
    calls = [0]
    failed_tensors: list[weakref.ref[torch.Tensor]] = []

    def source() -> tuple[int, dict[str, torch.Tensor]]:
        calls[0] += 1
        weights = {"a": torch.full((4,), float(calls[0])), "b": torch.full((4,), float(calls[0]))}
        transfer.fail_after = 1 if calls[0] % 10 == 5 else None  # dies after writing "a"
        if transfer.fail_after is not None:
            failed_tensors.extend(weakref.ref(t) for t in weights.values())
        return calls[0], weights

    transfer = FakeTransfer(source)
    worker = RolloutWorker(rollout, p2r=transfer, history=100)
    total = 3000
    for _ in range(total):
        worker.submit(P2R())
    worker.submit(Stop())
    results = worker.run(idle_timeout_s=30)

    assert len(results) == len(worker.results) == len(worker.sync_reports) == 100
    assert type(results[-1].command) is Stop and results == list(worker.results)
    failures = [r for r in worker.results if not r.ok]
    assert len(failures) == 10 and all("peer died" in (r.error or "") for r in failures)
    assert all(r.exception is None for r in worker.results)
    s = worker.statistics()
    assert (s.commands, s.failed, s.syncs, s.failed_syncs) == (total + 1, 300, 2700, 300)
    assert (s.sync_reports_total, worker.history, s.weights_torn) == (total, 100, False)
    gc.collect()
    assert len(failed_tensors) == 600
    assert [r for r in failed_tensors if r() is not None] == []
    # The counterfactual: the result handle() returns keeps its exception, and with it the
    # failed transfer's tensors, for as long as the caller holds it.
    calls[0] = 4
    result = worker.handle(P2R())
    assert isinstance(result.exception, WeightTransferError) and rollout.weights_torn
    gc.collect()
    assert failed_tensors[-1]() is not None
    del result
    gc.collect()
    assert failed_tensors[-1]() is None


def test_a_worker_refuses_a_transfer_it_cannot_drive_and_a_negative_history() -> None:
    rollout = RecordingRollout(EventLog())
    with pytest.raises(TypeError, match=r"r2r=.*SupportsWeightTransfer.*lacks \['relay'"):
        RolloutWorker(rollout, r2r=_NoRelay())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="history=-1"):
        RolloutWorker(rollout, history=-1)


class _NoRelay:
    is_source = False

    def receive(self, into: object) -> None: ...

    def send(self, weights: object) -> None: ...

    def abort(self, reason: str) -> None: ...


def test_async_modes_need_a_backend_that_installs_buffers() -> None:
    with pytest.raises(TypeError, match="attach_weight_buffer"):
        RolloutWorker(RecordingRollout(EventLog()), mode=SyncMode.ASYNC_PER_FORWARD)


# -- the async path ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_async_syncs_run_on_the_sync_thread_and_install_at_safe_points() -> None:
    timeline = Timeline()
    model = VersionStampedModel(4, 64, timeline=timeline)
    backend = AsyncTornReadBackend(model, timeline=timeline)
    packer = RecordingPacker()
    version = [0]
    threads: list[int] = []
    held: list[bool] = []

    def source() -> tuple[int, dict[str, torch.Tensor]]:
        threads.append(threading.get_ident())
        held.append(packer.egress_gate.held)
        version[0] += 1
        return _stamped(model, version[0])

    barriers: list[bool] = []
    transferred: list[int] = []
    worker = RolloutWorker(
        backend,
        p2r=FakeTransfer(source),
        p2r_barrier=lambda timeout: barriers.append(packer.egress_gate.held),
        mode=SyncMode.ASYNC_PER_FORWARD,
        data_packer=packer,
        timeline=timeline,
        on_transfer=lambda stats, tensors: transferred.append(int(next(iter(tensors.values()))[0])),
    )
    for _ in range(5):
        worker.submit(P2R())
    worker.submit(Stop())
    try:
        results = worker.run(idle_timeout_s=10)
        assert worker.wait_for_install(10) == 5
    finally:
        worker.close()
    assert [r.ok for r in results] == [True] * 6
    assert threading.get_ident() not in threads and len(set(threads)) == 1
    assert all(held)  # the weight-sync thread held payload egress around every transfer
    assert barriers == [True] * 5  # and met the trainer's barrier inside that hold
    assert transferred == [1, 2, 3, 4, 5]  # what on_transfer saw is what was received
    assert backend.weight_version == 5
    assert backend.generation_gate.statistics().exclusive_acquired == 0
    assert model.torn_reads == 0 and timeline.overlaps() == []
    assert worker.weight_buffer is not None
    assert worker.weight_buffer.statistics().writes == 5


def test_a_reseed_receive_is_guarded_and_clears_a_torn_state() -> None:
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.zeros(4)})
    worker = RolloutWorker(rollout, data_packer=RecordingPacker(log=log))
    rollout.mark_weights_torn("a P2R died part-way")
    stats = worker.reseed(FakeTransfer(lambda: (4, {"w": torch.full((4,), 4.0)}), log=log))
    assert stats.version == 4 and rollout.weight_version == 4 and not rollout.weights_torn
    assert log.events[:2] == ["pause:enter", "hold_sends:enter"]
    assert worker.last_weight_sync_report is not None
    assert worker.last_weight_sync_report.handler == "_receive_reseed"


def test_a_reseed_source_holds_egress_only_and_refuses_torn_weights() -> None:
    log = EventLog()
    rollout = RecordingRollout(log, {"w": torch.ones(4)})
    rollout.commit_weight_version(3)
    worker = RolloutWorker(rollout, data_packer=RecordingPacker(log=log))
    source = FakeTransfer(lambda: (0, {}), is_source=True, log=log)
    worker.reseed(source)
    assert source.sent == [3]
    assert log.events == ["hold_sends:enter", "send", "hold_sends:exit"]  # held, not paused
    rollout.mark_weights_torn("torn")
    with pytest.raises(TornWeightsError):
        worker.reseed(source)
    assert source.sent == [3]  # refused before anything was sent
    assert log.events[-2:] == ["abort", "hold_sends:exit"]  # its receivers were told at once


@pytest.mark.timeout(30)
def test_an_async_reseed_writes_the_buffer_on_the_sync_thread() -> None:
    model = VersionStampedModel(4, 16)
    backend = AsyncTornReadBackend(model)
    worker = RolloutWorker(backend, mode=SyncMode.ASYNC_PER_FORWARD)
    threads: list[int] = []

    def source() -> tuple[int, dict[str, torch.Tensor]]:
        threads.append(threading.get_ident())
        return _stamped(model, 6)

    try:
        stats = worker.reseed(FakeTransfer(source))
        assert stats.version == 6
        assert threads and threads[0] != threading.get_ident()  # the weight-sync thread
        assert worker.weight_buffer is not None
        assert worker.weight_buffer.published_version == 6
        assert backend.weight_version == 6  # not generating yet: installed at once
    finally:
        worker.close()


@pytest.mark.timeout(30)
def test_an_async_reseed_that_does_not_finish_in_time_is_a_transfer_timeout() -> None:
    model = VersionStampedModel(4, 16)
    worker = RolloutWorker(
        AsyncTornReadBackend(model), mode=SyncMode.ASYNC_PER_FORWARD, weight_sync_timeout=0.05
    )
    release = threading.Event()

    def stuck() -> tuple[int, dict[str, torch.Tensor]]:
        assert release.wait(20)
        return _stamped(model, 1)

    try:
        with pytest.raises(WeightTransferTimeout, match="re-seed transfer"):
            worker.reseed(FakeTransfer(stuck))
    finally:
        release.set()
        worker.close()


class _ReloadingRollout(RecordingRollout):
    """An engine that cannot serve the tensors it exposes: it reloads them after a sync."""

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        self.log.add(f"reload:{float(weights['w'][0])}")


def test_an_engine_that_overrides_load_weights_gets_the_received_tensors() -> None:
    log = EventLog()
    rollout = _ReloadingRollout(log, {"w": torch.zeros(4)})
    transfer = FakeTransfer(lambda: (2, {"w": torch.full((4,), 2.0)}), log=log)
    worker = RolloutWorker(rollout, p2r=transfer)
    assert worker.handle(P2R()).ok
    assert log.events == ["pause:enter", "init", "transfer", "reload:2.0", "pause:exit"]
