"""The guard: order of the bracket, async modes, failures, timeouts, re-entrancy, real races."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import pytest
import torch
from conftest import ThreadRunner, wait_until

from rollout_sync import (
    EgressHoldTimeout,
    PauseTimeout,
    SpanKind,
    SyncMode,
    SyncReport,
    ThreadedRolloutBackend,
    Timeline,
    WeightSyncWorker,
    WorkerContractError,
    holds_payload_egress,
    pauses_generation,
    payload_egress_held,
    weight_sync_bracket,
    weight_sync_handler,
)
from rollout_sync.demos.in_process import InProcessDemoConfig, run_in_process_demo
from rollout_sync.testing import (
    EventLog,
    RecordingPacker,
    RecordingRollout,
    TornReadBackend,
    VersionStampedModel,
)

pytestmark = pytest.mark.timeout(60)


class InjectedFault(Exception):
    pass


class LazyRollout(RecordingRollout):
    def __init__(self, log: EventLog, fail_at: Callable[[], str | None]) -> None:
        super().__init__(log)
        self._fail_at = fail_at

    def initialize(self) -> None:
        super().initialize()
        if self._fail_at() == "init":
            raise InjectedFault("init")


class Worker:
    """A rollout worker as the guard sees it: rollout, data_packer, optional hooks."""

    def __init__(self, mode: SyncMode = SyncMode.SYNC) -> None:
        self.log = EventLog()
        self.fail_at: str | None = None
        self.rollout = LazyRollout(self.log, lambda: self.fail_at)
        self.data_packer = RecordingPacker(log=self.log)
        self.weight_sync_mode = mode
        self.weight_sync_timeout = 5.0
        self.reports: list[SyncReport] = []

    def _step(self, name: str) -> None:
        self.log.add(name)
        if self.fail_at == name:
            raise InjectedFault(name)

    def weight_sync_fence(self, timeout: float | None) -> None:
        self._step("fence")

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self.reports.append(report)

    @weight_sync_handler
    def receive_p2r(self) -> str:
        self.rollout.ensure_initialized()
        self._step("barrier")
        self._step("transfer")
        return "p2r done"

    @weight_sync_handler
    def broadcast_r2r(self) -> None:
        self.rollout.ensure_initialized()
        self._step("barrier")
        self._step("broadcast")

    @weight_sync_handler
    def p2r_then_r2r(self) -> None:
        self.receive_p2r()
        self.broadcast_r2r()


BRACKET_OPEN = ["pause:enter", "hold_sends:enter"]
BRACKET_CLOSE = ["fence", "hold_sends:exit", "pause:exit"]


def test_p2r_handler_order_with_lazy_init_inside_the_bracket() -> None:
    worker = Worker()
    assert worker.receive_p2r() == "p2r done"
    assert worker.log.events == [*BRACKET_OPEN, "init", "barrier", "transfer", *BRACKET_CLOSE]
    (report,) = worker.reports
    assert report.handler == "receive_p2r" and report.paused and report.egress_held == 1
    assert report.error is None and report.total_s >= report.handler_s
    assert worker.last_weight_sync_report is report  # type: ignore[attr-defined]


def test_r2r_handler_order() -> None:
    worker = Worker()
    worker.rollout.ensure_initialized()
    worker.log.clear()
    worker.broadcast_r2r()
    assert worker.log.events == [*BRACKET_OPEN, "barrier", "broadcast", *BRACKET_CLOSE]


def test_nested_handlers_take_the_bracket_once() -> None:
    worker = Worker()
    worker.p2r_then_r2r()
    events = worker.log.events
    assert events[:2] == BRACKET_OPEN and events[-3:] == BRACKET_CLOSE
    assert events.count("pause:enter") == 1 and events.count("hold_sends:enter") == 1
    assert [r.handler for r in worker.reports] == ["p2r_then_r2r"]


def test_single_purpose_decorators_compose_in_the_right_order() -> None:
    class Split(Worker):
        @pauses_generation
        @holds_payload_egress
        def handler(self) -> None:
            self._step("body")

    worker = Split()
    worker.handler()
    assert worker.log.events == [
        "pause:enter",
        "hold_sends:enter",
        "body",
        "fence",
        "hold_sends:exit",
        "fence",
        "pause:exit",
    ]


@pytest.mark.parametrize("mode", [SyncMode.ASYNC_PER_GENERATION, SyncMode.ASYNC_PER_FORWARD])
def test_async_modes_skip_the_pause_and_keep_the_hold(mode: SyncMode) -> None:
    worker = Worker(mode)
    worker.receive_p2r()
    assert worker.log.events == [
        "hold_sends:enter",
        "init",
        "barrier",
        "transfer",
        "fence",
        "hold_sends:exit",
    ]
    assert not worker.reports[0].paused


def test_async_mode_generation_keeps_running_during_the_sync() -> None:
    model = VersionStampedModel(num_tensors=4, numel=16)
    packer = RecordingPacker().start()
    backend = TornReadBackend(model, packer=packer)

    class AsyncWorker:
        rollout = backend
        data_packer = packer
        weight_sync_mode = SyncMode.ASYNC_PER_GENERATION

        @weight_sync_handler
        def write_buffer(self) -> None:
            assert packer.egress_gate.held, "egress is held in async modes too"
            n = model.forwards
            # Generation is not paused: forwards keep completing inside the sync.
            model.wait_for_forwards(n + 3, timeout=10)

    backend.start()
    try:
        AsyncWorker().write_buffer()
    finally:
        backend.stop()
        packer.stop()


@pytest.mark.parametrize("fail_at", ["init", "barrier", "transfer", "fence"])
def test_exception_anywhere_leaves_generation_resumed_and_egress_released(fail_at: str) -> None:
    worker = Worker()
    worker.fail_at = fail_at
    with pytest.raises(InjectedFault):
        worker.receive_p2r()
    events = worker.log.events
    assert events[:2] == BRACKET_OPEN
    assert events[-2:] == ["hold_sends:exit", "pause:exit"]
    assert not worker.data_packer.egress_gate.held
    (report,) = worker.reports
    assert report.error == f"InjectedFault: {fail_at}"
    # The worker is usable again afterwards.
    worker.fail_at = None
    worker.log.clear()
    worker.receive_p2r()
    assert worker.log.events[-3:] == BRACKET_CLOSE


class StuckStepBackend(ThreadedRolloutBackend):
    def __init__(self) -> None:
        super().__init__()
        self.in_step = threading.Event()
        self.release = threading.Event()

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return {}

    def serve_step(self) -> None:
        self.in_step.set()
        self.release.wait(30)


def test_pause_that_cannot_be_had_raises_clearly_and_holds_nothing() -> None:
    backend = StuckStepBackend()
    worker = Worker()
    worker.rollout = backend  # type: ignore[assignment]
    worker.weight_sync_timeout = 0.2
    backend.start()
    assert backend.in_step.wait(10)
    with pytest.raises(PauseTimeout, match=r"did not park within 0\.2 s"):
        worker.receive_p2r()
    assert "barrier" not in worker.log.events, "the handler body never ran"
    assert not worker.data_packer.egress_gate.held and not backend.generation_gate.held
    assert worker.reports[0].error is not None
    backend.release.set()
    backend.stop()


def test_hold_that_cannot_be_had_raises_clearly_and_resumes_generation() -> None:
    worker = Worker()
    worker.weight_sync_timeout = 0.2
    worker.data_packer.egress_gate.enter_section()  # a send that never completes
    with pytest.raises(EgressHoldTimeout, match=r"did not hold within 0\.2 s"):
        worker.receive_p2r()
    assert worker.log.events == ["pause:enter", "pause:exit"]
    worker.data_packer.egress_gate.exit_section()


def test_weight_sync_thread_and_main_loop_both_hold_egress(threads: ThreadRunner) -> None:
    """Async mode: the weight-sync thread holds egress in its run loop while the main loop runs
    a decorated handler; the holds share the gate instead of deadlocking."""
    worker = Worker(SyncMode.ASYNC_PER_GENERATION)
    in_thread_hold = threading.Event()
    main_done = threading.Event()

    def weight_sync_thread_loop() -> None:
        with payload_egress_held(worker.data_packer, timeout=5):
            in_thread_hold.set()
            assert main_done.wait(10)

    threads.start(weight_sync_thread_loop)
    assert in_thread_hold.wait(10)
    worker.receive_p2r()
    main_done.set()
    assert not threads.join_all()
    assert not worker.data_packer.egress_gate.held


def test_guard_prevents_torn_reads_on_real_threads() -> None:
    report = run_in_process_demo(InProcessDemoConfig(syncs=60, interval_s=0.001))
    assert report["syncs"] == 60 and report["forwards"] > 0
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0


def test_without_the_guard_the_same_harness_finds_torn_reads() -> None:
    report = run_in_process_demo(InProcessDemoConfig(syncs=60, interval_s=0.001, guarded=False))
    assert report["torn_reads"] > 0
    assert report["egress_overlaps"] > 0


def test_holding_egress_before_pausing_deadlocks_and_our_order_does_not() -> None:
    """A producer blocked on a full send buffer cannot reach its park point while egress is
    held; so egress-outermost times out, and the guard's pause-outermost order completes."""
    model = VersionStampedModel(num_tensors=2, numel=4, read_gap_s=0)
    packer = RecordingPacker(capacity=2).start()
    backend = TornReadBackend(model, packer=packer, pause_timeout=30)
    backend.start()
    try:
        with payload_egress_held(packer, timeout=5):
            # Sender holds one payload at the gate, buffer full, producer blocked in submit.
            wait_until(
                lambda: (
                    model.forwards == len(packer.sent) + packer.buffered + 2
                    and packer.buffered == 2
                    and packer.egress_gate.statistics().sections_waiting == 1
                )
            )
            with pytest.raises(PauseTimeout):
                with backend.paused(timeout=0.5):
                    pytest.fail("generation cannot park while its producer is blocked")
        with weight_sync_bracket(backend, [packer], timeout=5) as bracket:
            assert backend.generation_gate.held and packer.egress_gate.held
        assert bracket.report is not None and bracket.report.error is None
    finally:
        backend.stop()
        packer.stop()


def test_the_bracket_records_its_egress_hold_when_it_held_something() -> None:
    """A ``payload_hold`` span from asking for the hold until its release, around the body's
    ``weight_sync`` span; none when nothing was held (hold off, or nothing to hold)."""
    timeline = Timeline()
    packer = RecordingPacker(timeline=timeline)
    with weight_sync_bracket(None, [packer], timeout=5, timeline=timeline):
        assert packer.egress_gate.held
    with weight_sync_bracket(None, [packer], hold=False, timeline=timeline):
        pass
    with weight_sync_bracket(None, [], timeout=5, timeline=timeline):
        pass
    (hold,) = timeline.spans(SpanKind.PAYLOAD_HOLD)
    body = timeline.spans(SpanKind.SYNC)
    assert len(body) == 3
    assert hold.start_ns <= body[0].start_ns and body[0].end_ns <= hold.end_ns
    assert hold.args == {"held": 1}


# -- the worker contract -----------------------------------------------------------------------


class EngineNamedEngine:
    """The bug the contract exists for: the engine is ``self.engine``, not ``self.rollout``."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.engine = RecordingRollout(self.log)

    @weight_sync_handler
    def receive_p2r(self) -> None:
        self.log.add("body")


def test_a_worker_without_rollout_is_refused_at_its_first_sync_naming_the_attribute() -> None:
    worker = EngineNamedEngine()
    with pytest.raises(WorkerContractError, match=r"reads `rollout`.*no such attribute") as info:
        worker.receive_p2r()
    assert info.value.attribute == "rollout"
    assert isinstance(info.value, TypeError)
    assert worker.log.events == [], "nothing may run (body, pause) for a worker the guard refuses"


def test_pauses_generation_refuses_it_too_but_a_hold_alone_needs_no_rollout() -> None:
    class HoldOnly:
        def __init__(self) -> None:
            self.log = EventLog()
            self.data_packer = RecordingPacker(log=self.log)

        @pauses_generation
        def paused_body(self) -> None:
            self.log.add("body")

        @holds_payload_egress
        def held_body(self) -> None:
            self.log.add("body")

    worker = HoldOnly()
    with pytest.raises(WorkerContractError, match="rollout"):
        worker.paused_body()
    worker.held_body()
    assert worker.log.events == ["hold_sends:enter", "body", "hold_sends:exit"]


def test_rollout_none_is_allowed_for_lazy_initialization() -> None:
    class Lazy:
        def __init__(self) -> None:
            self.rollout: RecordingRollout | None = None
            self.log = EventLog()

        @weight_sync_handler
        def receive_p2r(self) -> None:
            self.rollout = RecordingRollout(self.log)  # built inside the first sync
            self.log.add("built")

    worker = Lazy()
    worker.receive_p2r()
    assert worker.log.events == ["built"]
    worker.receive_p2r()
    assert worker.log.events == ["built", "pause:enter", "built", "pause:exit"]


def test_weight_sync_pauser_names_the_pause_target_when_it_is_not_rollout() -> None:
    """A framework whose generation is owned by a scheduler, not ``self.rollout``: the hook is
    read at every sync (None before the scheduler exists), and it, not ``rollout``, is paused."""

    class SchedulerOwned:
        def __init__(self) -> None:
            self.log = EventLog()
            self.rollout = RecordingRollout(EventLog())  # the engine: not what generates
            self.scheduler: RecordingRollout | None = None

        def weight_sync_pauser(self) -> RecordingRollout | None:
            return self.scheduler

        @weight_sync_handler
        def receive_p2r(self) -> None:
            self.log.add("body")
            if self.scheduler is None:
                self.scheduler = RecordingRollout(self.log)  # built inside the first sync

    worker = SchedulerOwned()
    worker.receive_p2r()
    worker.receive_p2r()
    assert worker.log.events == ["body", "pause:enter", "body", "pause:exit"]
    assert worker.rollout.log.events == [], "rollout is not the pause target here"


@pytest.mark.parametrize(
    ("hook", "message"),
    [(1.0, "not callable"), (lambda: object(), "returned a object, which has no paused")],
)
def test_a_broken_weight_sync_pauser_is_refused(hook: object, message: str) -> None:
    worker = Worker()
    worker.weight_sync_pauser = hook  # type: ignore[attr-defined]
    with pytest.raises(WorkerContractError, match=message) as info:
        worker.receive_p2r()
    assert info.value.attribute == "weight_sync_pauser"
    assert worker.log.events == []


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("rollout", object(), "no paused()"),
        ("weight_sync_mode", "sync", "not a rollout_sync.SyncMode"),
        ("weight_sync_timeout", 0, "not a positive number"),
        ("weight_sync_timeout", -1.0, "not a positive number"),
        ("weight_sync_timeout", float("nan"), "not a positive number"),
        ("weight_sync_timeout", "5", "not a positive number"),
        ("weight_sync_timeout", True, "not a positive number"),
        ("timeline", [], "not a Timeline"),
        ("weight_sync_fence", 1.0, "not callable"),
        ("on_weight_sync_report", [], "not callable"),
        ("payload_egress_components", (), "not callable"),
    ],
)
def test_a_broken_contract_is_refused_before_anything_runs(
    attribute: str, value: object, message: str
) -> None:
    worker = Worker()
    setattr(worker, attribute, value)
    with pytest.raises(WorkerContractError, match=message) as info:
        worker.receive_p2r()
    assert info.value.attribute == attribute
    assert worker.log.events == []


def test_a_packer_under_any_attribute_name_is_held() -> None:
    """A packer kept as ``self.sender`` (not ``data_packer``) is still found and held."""

    class Misnamed:
        def __init__(self) -> None:
            self.log = EventLog()
            self.rollout = RecordingRollout(self.log)
            self.sender = RecordingPacker(log=self.log)

        @weight_sync_handler
        def receive_p2r(self) -> None:
            self.log.add("body")

    worker = Misnamed()
    worker.receive_p2r()
    assert worker.log.events == [
        "pause:enter",
        "hold_sends:enter",
        "body",
        "hold_sends:exit",
        "pause:exit",
    ]


def test_the_worker_protocol_describes_a_conforming_worker() -> None:
    assert isinstance(Worker(), WeightSyncWorker)
    assert not isinstance(EngineNamedEngine(), WeightSyncWorker)
