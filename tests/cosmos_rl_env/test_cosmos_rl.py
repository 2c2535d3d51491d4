"""The guard on cosmos-rl 0.4.7's real code: handlers through the registry, the scheduler, the
weight-sync thread and the NCCL payload producer (over a real redis-server).

Runs in .venv-cosmos (scripts/setup_cosmos_venv.sh; ./run_test.sh runs this directory there);
skipped where cosmos-rl is not installed. What is faked, each named in
rollout_sync/testing/cosmos_rl.py and used here:

* FAKE-CUDA: torch.cuda.Stream / Event / stream / set_device / current_stream (no device).
* FAKE-NCCL-WEIGHTS: the worker's P2R receive and shard-instruction fetch, cosmos's
  do_nccl_broadcast_grouped: an in-place write of the new version into the served tensor.
* FAKE-NCCL-PAYLOAD: pynccl.nccl_send and the 2-rank communicator build.
* FAKE-PACKAGE: qwen_vl_utils (imports torchvision, which has no CPU build for this torch).
* NOT STARTED: cosmos's controller; workers are built with __new__ and the attributes their
  handlers read.

Each race is shown against the unguarded (or 0.4.7-as-shipped) variant on the same harness.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import threading
import time
from typing import Any

import pytest

if importlib.util.find_spec("cosmos_rl") is None:
    pytest.skip("cosmos-rl 0.4.7 is tested in .venv-cosmos", allow_module_level=True)

# First: the harness puts the FAKE-PACKAGE stub in place before cosmos_rl is imported.
from rollout_sync.testing import cosmos_rl as harness  # noqa: E402, I001

import redis  # noqa: E402
import torch  # noqa: E402
from cosmos_rl.dispatcher.command import (  # noqa: E402
    PolicyToRolloutUnicastCommand,
    RolloutToRolloutBroadcastCommand,
)
from cosmos_rl.rollout.worker import weight_sync  # noqa: E402
from cosmos_rl.rollout.worker.colocated.rollout_control import (  # noqa: E402
    ColocatedRolloutControlWorker,
)
from cosmos_rl.rollout.worker.rollout_control import (  # noqa: E402
    DisaggregatedRolloutControlWorker,
)
from cosmos_rl.utils.payload_transport.nccl import producer as producer_module  # noqa: E402

from rollout_sync import SyncReport  # noqa: E402
from rollout_sync.errors import (  # noqa: E402
    CosmosRLVersionError,
    EgressHoldTimeout,
    FenceTimeout,
)
from rollout_sync.integrations import cosmos_rl  # noqa: E402
from rollout_sync.integrations.cosmos_rl_payload import (  # noqa: E402
    HoldableNCCLPayloadProducer,
    live_producers,
)
from rollout_sync.testing.redis_server import RedisServer, require_redis_server  # noqa: E402

pytestmark = pytest.mark.timeout(180)

P2R, R2R = PolicyToRolloutUnicastCommand, RolloutToRolloutBroadcastCommand


@pytest.fixture(autouse=True)
def _never_left_installed() -> Any:
    yield
    cosmos_rl.uninstall()


@pytest.fixture(scope="module")
def redis_port() -> Any:
    require_redis_server()
    with RedisServer() as server:
        yield server.port


@pytest.fixture
def redis_client(redis_port: int) -> Any:
    client = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=30)
    client.flushall()
    return client


# -- torn generations: the real scheduler, the real handlers through the real registry --------


@pytest.mark.parametrize("park", [True, False], ids=["backend-parks", "backend-drains"])
def test_disaggregated_handlers_tear_generations_only_unguarded(park: bool) -> None:
    unguarded = harness.run_torn_generations("unguarded", park=park)
    shipped = harness.run_torn_generations("0.4.7", park=park)
    guarded = harness.run_torn_generations("guarded", park=park)
    for counts in (unguarded, shipped, guarded):
        assert counts["generations"] == 40 and counts["engine_inits"] == 1, counts
    assert unguarded["torn"] > 0, unguarded  # the harness catches the race
    assert shipped["torn"] == 0, shipped  # 0.4.7 drains its scheduler...
    assert guarded["torn"] == 0, guarded
    assert shipped["parks"] == 0
    if park:  # ...where the guard parks a backend that can, at a step boundary
        assert guarded["parks"] == guarded["syncs"] - 1  # every sync after the first
    else:
        assert guarded["parks"] == 0


@pytest.mark.parametrize("park", [True, False], ids=["backend-parks", "backend-drains"])
def test_colocated_p2r_tears_generations_in_0_4_7_not_guarded(park: bool) -> None:
    # The colocated worker's P2R (set_underlying_model) has no pause of any kind in 0.4.7.
    shipped = harness.run_torn_generations(
        "0.4.7", park=park, worker_cls=ColocatedRolloutControlWorker
    )
    guarded = harness.run_torn_generations(
        "guarded", park=park, worker_cls=ColocatedRolloutControlWorker
    )
    assert shipped["generations"] == guarded["generations"] == 40
    assert shipped["torn"] > 0, shipped
    assert guarded["torn"] == 0, guarded


@pytest.mark.parametrize("park", [True, False], ids=["backend-parks", "backend-drains"])
def test_generations_queued_before_the_first_sync_are_not_torn_guarded(park: bool) -> None:
    # The first P2R starts the scheduler inside the handler: the bracket found nothing to
    # pause at entry (a backend parked then would block the generations cosmos's own drain
    # waits for), and cosmos's drain still runs around the write.
    unguarded = harness.run_torn_generations("unguarded", park=park, queue_first=True)
    guarded = harness.run_torn_generations("guarded", park=park, queue_first=True)
    assert unguarded["torn"] > 0, unguarded
    assert guarded["torn"] == 0 and guarded["generations"] == 40, guarded


# -- payload sends against the real weight-sync thread ------------------------------------------


def test_weight_sync_thread_sends_overlap_unless_held(redis_port: int) -> None:
    del redis_port  # the harness starts its own server; this fixture skips without one
    unguarded = harness.run_payload_overlap("unguarded", syncs=8)
    shipped = harness.run_payload_overlap("0.4.7", syncs=8)
    guarded = harness.run_payload_overlap("guarded", syncs=8)
    for counts in (unguarded, shipped, guarded):
        assert counts["syncs"] == 8 and not counts["thread_failed"], counts
        assert counts["not_accepted"] == 0, counts  # no request lost, held or not
    assert unguarded["overlapping_sync"] > 0, unguarded
    assert shipped["overlapping_sync"] > 0, shipped  # a flush before the barrier is not enough
    assert guarded["overlapping_sync"] == 0, guarded
    assert guarded["producer"] == "HoldableNCCLPayloadProducer"  # PayloadContext built it
    assert guarded["deferred"] > 0  # requests did arrive during the syncs, and waited


# -- the real handlers through the real registry: what the bracket covers -----------------------


def _worker_with_producer(
    redis_client: Any,
    *,
    worker_cls: type = DisaggregatedRolloutControlWorker,
    producer_kind: str = "context",
    **kwargs: Any,
) -> tuple[Any, Any, Any]:
    engine = harness.ParkingStepEngine()
    writer = harness.InPlaceWeightWriter(engine, window_s=0.0)
    worker = harness.make_worker(engine, writer, worker_cls=worker_cls, **kwargs)
    producer = harness.make_producer(producer_kind, redis_client)
    return worker, engine, producer


@pytest.mark.parametrize("command", ["p2r", "r2r"])
def test_lazy_init_runs_inside_the_bracket_only_guarded(redis_client: Any, command: str) -> None:
    def first_sync(worker: Any) -> None:
        cls = type(worker)
        if command == "p2r":
            cls.get_rollout_command_handler(P2R)(worker, harness.p2r_command(worker, 1))
        else:
            cls.get_rollout_command_handler(R2R)(worker, harness.r2r_command(worker, 1))

    held_at_init: dict[str, bool] = {}
    broadcast = harness.InPlaceWeightWriter(harness.StepEngine(), window_s=0.0)
    broadcast.engine.init_engine(None, 0, "dummy")
    with (
        harness.cpu_cuda(),
        harness.fake_nccl_payload_sends([]),
        harness.fake_nccl_broadcast(broadcast),
    ):
        for name in ("0.4.7", "guarded"):
            with harness.variant(name):
                # A producer that can hold in both arms: only the guard holds it.
                worker, engine, producer = _worker_with_producer(
                    redis_client, producer_kind="holdable"
                )
                engine.on_init = lambda name=name, producer=producer: held_at_init.__setitem__(
                    name, producer.held
                )
                try:
                    first_sync(worker)
                    assert engine.init_calls, "the first sync initializes the engine"
                    assert engine.init_calls[0]["thread"] == "RolloutTaskSchedulerWorker"
                finally:
                    worker.scheduler.stop(wait=True, shutdown_engine=False)
                    producer.close()
    assert held_at_init == {"0.4.7": False, "guarded": True}


def test_guarded_handlers_report_each_sync(redis_client: Any) -> None:
    reports: list[SyncReport] = []
    with (
        harness.cpu_cuda(),
        harness.fake_nccl_payload_sends([]),
        harness.fake_nccl_broadcast(harness.InPlaceWeightWriter(harness.StepEngine())),
        cosmos_rl.installed(on_report=reports.append) as guard,
    ):
        worker, _engine, producer = _worker_with_producer(redis_client)
        seen: list[SyncReport] = []
        worker.on_weight_sync_report = seen.append
        worker._execute_p2r_recv = lambda command, stream: None
        try:
            p2r = DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R)
            r2r = DisaggregatedRolloutControlWorker.get_rollout_command_handler(R2R)
            p2r(worker, harness.p2r_command(worker, 1))  # lazy init: nothing generates yet
            harness.submit_generations(worker, 2)
            p2r(worker, harness.p2r_command(worker, 2))
            r2r(worker, harness.r2r_command(worker, 3))
        finally:
            worker.scheduler.stop(wait=True, shutdown_engine=False)
            producer.close()
    names = [r.handler for r in reports]
    assert names == [
        "cosmos_rl.policy_to_rollout_unicast",
        "cosmos_rl.policy_to_rollout_unicast",
        "cosmos_rl.broadcast_to_all_rollout_replica",
    ]
    assert seen == reports and worker.last_weight_sync_report is reports[-1]
    assert list(guard.reports) == reports
    # The first sync starts the engine and the scheduler: nothing to pause at its entry.
    assert [r.paused for r in reports] == [False, True, True]
    assert all(r.egress_held >= 1 and r.error is None for r in reports)
    assert guard.strategies == {"none": 1, "park": 2}
    metrics = guard.metrics()
    assert metrics["rollout_sync/cosmos_syncs"] == 3.0
    assert set(reports[-1].to_metrics()) <= set(metrics)


def test_async_r2r_mode_holds_without_pausing(redis_client: Any) -> None:
    with harness.cpu_cuda(), harness.fake_nccl_payload_sends([]), cosmos_rl.installed() as guard:
        worker, engine, producer = _worker_with_producer(
            redis_client, mode="sync", async_r2r_sync="generation"
        )
        engine.init_engine(None, 0, "dummy")
        enqueued: list[Any] = []
        worker._weight_sync_thread = type("Queue", (), {"enqueue_r2r": enqueued.append})()
        try:
            DisaggregatedRolloutControlWorker.get_rollout_command_handler(R2R)(
                worker, harness.r2r_command(worker, 1)
            )
        finally:
            producer.close()
    assert len(enqueued) == 1  # cosmos's own routing to its weight-sync thread
    (report,) = guard.reports
    assert report.paused is False and report.egress_held >= 1
    assert guard.strategies == {"async": 1}
    assert engine.parks == 0


def test_install_is_idempotent_and_uninstall_restores_cosmos() -> None:
    p2r_before = DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R)
    colocated_before = ColocatedRolloutControlWorker.get_rollout_command_handler(P2R)
    thread_methods = (
        weight_sync.WeightSyncThread._execute_p2r,
        weight_sync.WeightSyncThread._execute_r2r,
    )
    live_before = DisaggregatedRolloutControlWorker._paused_async_live_weights
    producer_before = producer_module.NCCLPayloadProducer

    guard = cosmos_rl.install()
    assert cosmos_rl.install() is guard
    for cls in (DisaggregatedRolloutControlWorker, ColocatedRolloutControlWorker):
        for command in (P2R, R2R):
            assert hasattr(cls.get_rollout_command_handler(command), "__rollout_sync_wrapped__")
    assert producer_module.NCCLPayloadProducer is HoldableNCCLPayloadProducer
    assert weight_sync.WeightSyncThread._execute_p2r is not thread_methods[0]

    # A handler registered while installed is guarded too (a worker class defined later).
    registry = DisaggregatedRolloutControlWorker.rollout_command_handler_registry

    def handler(worker: Any, command: Any) -> None:
        return None

    try:
        registry.register(P2R, handler, "other-backend")
        wrapped = registry.get_command_handler(P2R, "other-backend")
        assert wrapped.__rollout_sync_wrapped__ is handler

        cosmos_rl.uninstall()
        assert DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R) is p2r_before
        assert ColocatedRolloutControlWorker.get_rollout_command_handler(P2R) is colocated_before
        assert registry.get_command_handler(P2R, "other-backend") is handler
        assert (
            weight_sync.WeightSyncThread._execute_p2r,
            weight_sync.WeightSyncThread._execute_r2r,
        ) == thread_methods
        assert DisaggregatedRolloutControlWorker._paused_async_live_weights is live_before
        assert producer_module.NCCLPayloadProducer is producer_before
    finally:
        registry.registry.pop("other-backend", None)


def test_a_second_install_with_other_settings_is_refused() -> None:
    guard = cosmos_rl.install(timeout=30.0)
    assert cosmos_rl.install(timeout=30.0) is guard
    with pytest.raises(ValueError, match="already installed with other settings"):
        cosmos_rl.install(timeout=5.0)
    with cosmos_rl.installed(timeout=30.0) as same:
        assert same is guard
    assert cosmos_rl._installed is guard  # installed() leaves an earlier install in place


def test_other_cosmos_versions_are_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert importlib.metadata.version("cosmos-rl") == "0.4.7"
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda n: "0.4.8" if n == "cosmos-rl" else real(n)
    )
    before = DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R)
    with pytest.raises(CosmosRLVersionError, match=r"found 0\.4\.8"):
        cosmos_rl.install()
    assert DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R) is before
    assert producer_module.NCCLPayloadProducer is not HoldableNCCLPayloadProducer


# -- the producer hold: deferred, never dropped; accepted sends always go out ---------------------


class _BlockingSends:
    """FAKE-NCCL-PAYLOAD whose sends block until released (a send in flight)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.count = 0

    def __call__(self, tensor: Any, peer: int, comm_idx: int, **kwargs: Any) -> None:
        self.count += 1
        self.started.set()
        if not self.release.wait(30):
            raise RuntimeError("send never released")


@pytest.fixture
def producer(redis_client: Any) -> Any:
    sends: list[harness.Interval] = []
    sent = threading.Semaphore(0)  # released once per send
    with harness.fake_nccl_payload_sends(sends, on_send=sent.release):
        made = harness.make_producer("holdable", redis_client)
        made.test_sends, made.test_sent = sends, sent
        # Released once per request the listener thread defers (cosmos's _dispatch_request
        # calls the instance's _handle_request).
        made.test_deferred = deferred = threading.Semaphore(0)
        handle = made._handle_request

        def handle_and_note(msg: Any) -> None:
            before = made.hold_stats.deferred
            handle(msg)
            if made.hold_stats.deferred > before:
                deferred.release()

        made._handle_request = handle_and_note
        try:
            yield made
        finally:
            made.close()


def _request_in_thread(consumer: harness.PolicyConsumer, transfer_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def run() -> None:
        result["status"] = consumer.request(transfer_id)

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def test_requests_during_a_hold_wait_and_are_answered_after(
    producer: Any, redis_client: Any
) -> None:
    consumers = [  # three policy replicas: three pairs
        harness.PolicyConsumer(producer, redis_client, receiver_replica=f"policy-{i}")
        for i in range(3)
    ]
    refs = [producer.publish(harness.trajectory(i))["_transfer_id"] for i in range(3)]
    with producer.hold_sends(timeout=5) as stats:
        pending = [_request_in_thread(c, t) for c, t in zip(consumers, refs, strict=True)]
        for _ in range(3):
            assert producer.test_deferred.acquire(timeout=10), "three requests deferred"
        assert producer.test_sends == []  # nothing sent...
        assert all("status" not in p for p in pending)  # ...nothing answered while held
    for p in pending:
        p["thread"].join(10)
    assert all(p["status"] in ("accepted", "complete") for p in pending), pending
    for _ in range(3):
        assert producer.test_sent.acquire(timeout=10), "each deferred request sent"
    assert len(producer.test_sends) == 3  # once each
    assert stats.answered_after_hold == 3 and stats.expired_in_hold == 0


def test_a_request_that_expires_in_a_hold_is_not_answered_late(
    producer: Any, redis_client: Any
) -> None:
    consumer = harness.PolicyConsumer(producer, redis_client, request_timeout_s=0.3)
    ref = producer.publish(harness.trajectory(0))["_transfer_id"]
    with producer.hold_sends(timeout=5) as stats:
        pending = _request_in_thread(consumer, ref)
        pending["thread"].join(10)  # the receiver gives up while the hold lasts
        assert pending["status"] == "cancelled"
    assert stats.expired_in_hold == 1 and stats.answered_after_hold == 0
    assert producer.test_sends == []  # no late ACCEPTED, no unmatched send
    consumer.request_timeout_s = 5.0
    assert consumer.request(ref, attempt=2) in ("accepted", "complete")  # the retry is served
    assert producer.test_sent.acquire(timeout=10), "the retry sent"
    assert len(producer.test_sends) == 1


def test_a_hold_waits_for_an_accepted_send_and_times_out_loudly(
    producer: Any, redis_client: Any
) -> None:
    from cosmos_rl.utils import pynccl

    blocking = _BlockingSends()
    pynccl.nccl_send = blocking  # restored by the producer fixture's fake on exit
    consumer = harness.PolicyConsumer(producer, redis_client)
    ref = producer.publish(harness.trajectory(0))["_transfer_id"]
    assert consumer.request(ref) == "accepted"
    assert blocking.started.wait(10)
    assert producer.sends_in_flight() == 1
    with pytest.raises(EgressHoldTimeout, match="1 accepted payload send"):
        with producer.hold_sends(timeout=0.2):
            pass
    assert not producer.held  # released after the timeout
    with pytest.raises(EgressHoldTimeout):
        producer.flush_pending_sends(timeout=0.2)

    entered = threading.Event()

    def hold() -> None:
        with producer.hold_sends(timeout=10):
            entered.set()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert not entered.wait(0.2)  # the accepted send is still running: no hold yet
    blocking.release.set()  # the accepted send goes out...
    assert entered.wait(10)  # ...then the hold is in force
    holder.join(10)
    assert blocking.count == 1 and producer.sends_in_flight() == 0
    producer.flush_pending_sends(timeout=1)  # nothing in flight: returns at once


def test_a_hold_longer_than_consumer_patience_is_reported(
    producer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert producer.max_hold_s == pytest.approx(4.75)  # 5 s per attempt less cosmos's margin
    producer.max_hold_s = 0.0
    with caplog.at_level(logging.WARNING), producer.hold_sends(timeout=1):
        time.sleep(0.001)  # on purpose: a known lower bound for the hold's length (> 0)
    assert producer.hold_stats.overruns == 1
    assert "longer than the consumers' patience" in caplog.text


def test_installed_guard_holds_every_live_producer(redis_client: Any) -> None:
    held_during_sync: list[bool] = []
    with (
        harness.cpu_cuda(),
        harness.fake_nccl_payload_sends([]),
        cosmos_rl.installed(),
    ):
        worker, _engine, made = _worker_with_producer(redis_client, mode="sync")
        assert isinstance(made, HoldableNCCLPayloadProducer)  # PayloadContext built ours
        assert made in live_producers() and worker.data_packer is None
        worker._execute_p2r_recv = lambda command, stream: held_during_sync.append(made.held)
        try:
            DisaggregatedRolloutControlWorker.get_rollout_command_handler(P2R)(
                worker, harness.p2r_command(worker, 1)
            )
        finally:
            made.close()
    assert held_during_sync == [True]
    assert not made.held


def test_a_weight_sync_thread_p2r_whose_hold_fails_is_marked_failed(redis_client: Any) -> None:
    from cosmos_rl.utils import pynccl

    blocking = _BlockingSends()
    with (
        harness.cpu_cuda(),
        harness.fake_nccl_payload_sends([]),
        cosmos_rl.installed(timeout=0.3) as guard,
    ):
        pynccl.nccl_send = blocking  # restored with the fake on exit
        worker, _engine, made = _worker_with_producer(
            redis_client, mode="sync", async_r2r_sync="generation"
        )
        written: list[int] = []
        worker._execute_p2r_recv = lambda command, stream: written.append(command.weight_step)
        thread = harness.attach_weight_sync_thread(worker, redis_client)
        consumer = harness.PolicyConsumer(made, redis_client)
        try:
            ref = made.publish(harness.trajectory(0))["_transfer_id"]
            assert consumer.request(ref) == "accepted"
            assert blocking.started.wait(10)  # a payload send is in flight and stays there
            thread.start()
            thread.enqueue_p2r(harness.p2r_command(worker, 1))
            # cosmos's fence: the queue drains, and it reports the failed task (False).
            assert thread.drain(timeout=30) is False
            assert thread._queue.unfinished_tasks == 0
        finally:
            blocking.release.set()
            thread.stop()
            made.close()
    assert written == []  # the transfer never started under a running send
    assert thread._p2r_failed and thread._task_failed  # as cosmos marks its own failures
    (report,) = guard.reports
    assert report.error is not None and "EgressHoldTimeout" in report.error


def test_the_stream_fence_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    class NeverDone(harness.CpuCudaEvent):
        def query(self) -> bool:
            return False

    monkeypatch.setattr(torch.cuda, "Event", NeverDone)
    fence = cosmos_rl._stream_fence(harness.CpuCudaStream())
    assert fence is not None
    with pytest.raises(FenceTimeout, match="still had weight-sync work"):
        fence(0.05)
    assert cosmos_rl._stream_fence(None) is None  # no stream (no CUDA): no fence


def test_the_cosmos_modules_define_no_exception_of_their_own() -> None:
    # The main suite's public-API check cannot import these without cosmos-rl.
    import inspect

    from rollout_sync.integrations import cosmos_rl_payload

    for module in (cosmos_rl, cosmos_rl_payload, harness):
        strays = [
            name
            for name, value in vars(module).items()
            if inspect.isclass(value)
            and issubclass(value, BaseException)
            and value.__module__ == module.__name__
        ]
        assert not strays, f"{module.__name__}: {strays} belong in rollout_sync/errors.py"


def test_install_works_in_a_fresh_process_as_the_docs_say() -> None:
    # As a user would: no harness, nothing patched beforehand (this env has cosmos-rl's imports).
    import subprocess
    import sys

    code = (
        "from rollout_sync.integrations import cosmos_rl\n"
        "from cosmos_rl.utils.payload_transport.context import PayloadContext\n"
        "from cosmos_rl.utils.payload_transport.nccl import producer\n"
        "guard = cosmos_rl.install()\n"
        "assert producer.NCCLPayloadProducer.__name__ == 'HoldableNCCLPayloadProducer'\n"
        "cosmos_rl.uninstall()\n"
        "assert producer.NCCLPayloadProducer.__name__ == 'NCCLPayloadProducer'\n"
        "print('ok', cosmos_rl.check_cosmos_rl_version())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok 0.4.7")
