"""TrainerCallback metrics, the merge, and WeightBroadcastCallback in one process."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import rollout_sync.trainer as trainer_module
from rollout_sync import (
    SpanKind,
    Timeline,
    TrainerCallback,
    TrainerCallbacks,
    TransferWeightPusher,
    WeightBroadcastCallback,
    WeightMismatchError,
    WeightSyncTimer,
    merge_step_metrics,
)
from rollout_sync.errors import MetricKeyCollisionError, WeightBroadcastError
from rollout_sync.metrics import TimerClock
from rollout_sync.testing import EventLog, FakeCudaStream
from rollout_sync.trainer import (
    BroadcastWeightPusher,
    CommandKind,
    QueueCommandChannel,
    WeightSyncCommand,
)
from rollout_sync.transfer import TransferStats


class _Constant(TrainerCallback):
    def __init__(self, metrics: dict[str, Any] | None) -> None:
        self.metrics = metrics
        self.calls: list[str] = []

    def run_begin(self, step: int) -> None:
        self.calls.append(f"run_begin:{step}")

    def step_end(
        self,
        step: int,
        reduced_losses: Mapping[str, float | int] | None = None,
        update_successful: bool = True,
        train_metrics: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        self.calls.append(f"step_end:{step}")
        return self.metrics

    def train_end(self, step: int) -> None:
        self.calls.append(f"train_end:{step}")


class _RecordingPusher:
    """Receives pushes in process: keeps a copy of each, reads the announcement first."""

    def __init__(
        self, channel: QueueCommandChannel | None = None, stream: FakeCudaStream | None = None
    ) -> None:
        self.channel = channel
        self.stream = stream
        self.pushes: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.commands: list[Any] = []

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        if self.channel is not None:
            self.commands.append(self.channel.receive(timeout))
        if self.stream is not None:
            self.stream.work(10.0 * version)
        self.pushes.append((version, {k: v.clone() for k, v in weights.items()}))


def _weights() -> dict[str, torch.Tensor]:
    return {"a": torch.ones(4), "b": torch.zeros(2, 3, dtype=torch.float64)}


WEIGHT_BYTES = 4 * 4 + 6 * 8


# -- the merge ---------------------------------------------------------------------------------


def test_base_callback_returns_none() -> None:
    callback = TrainerCallback()
    callback.run_begin(0)
    assert callback.step_end(1, {"loss": 1.0}, True, {"loss": 1.0}) is None
    callback.train_end(1)


def test_merge_adds_callback_metrics_to_the_training_metrics() -> None:
    train = {"loss": 0.5, "lr": 1e-3}
    merged = merge_step_metrics(train, [("a", {"x": 1}), ("b", None), ("c", {"y": "ok"})])
    assert merged == {"loss": 0.5, "lr": 1e-3, "x": 1, "y": "ok"}
    assert train == {"loss": 0.5, "lr": 1e-3}


def test_a_key_collision_with_a_training_metric_is_an_error() -> None:
    train = {"loss": 0.5}
    with pytest.raises(
        MetricKeyCollisionError, match="'loss' from cb collides with 'loss' from train_metrics"
    ) as info:
        merge_step_metrics(train, [("cb", {"ok": 1, "loss": 9.0})])
    assert (info.value.key, info.value.first, info.value.second) == ("loss", "train_metrics", "cb")
    assert train == {"loss": 0.5}


def test_a_key_collision_between_two_callbacks_names_both() -> None:
    callbacks = TrainerCallbacks([_Constant({"m": 1}), _Constant({"m": 2})])
    with pytest.raises(MetricKeyCollisionError) as info:
        callbacks.step_end(3, None, True, {"loss": 1.0})
    assert info.value.first == "_Constant (callback #0)"
    assert info.value.second == "_Constant (callback #1)"


def test_non_scalar_metrics_are_refused() -> None:
    with pytest.raises(TypeError, match=r"tensor.*synchronize"):
        merge_step_metrics({}, [("cb", {"t": torch.tensor(1.0)})])
    with pytest.raises(TypeError, match="list"):
        merge_step_metrics({}, [("cb", {"t": [1, 2]})])


def test_callbacks_are_called_in_order_and_merged() -> None:
    first, second, silent = _Constant({"a": 1}), _Constant({"b": 2.5}), _Constant(None)
    callbacks = TrainerCallbacks([first, second, silent])
    callbacks.run_begin(0)
    assert callbacks.step_end(1, None, True, {"loss": 0.1}) == {"loss": 0.1, "a": 1, "b": 2.5}
    callbacks.train_end(1)
    assert first.calls == second.calls == ["run_begin:0", "step_end:1", "train_end:1"]
    assert "_Constant" in repr(callbacks)


def test_an_unlogged_step_with_nothing_returned_gives_none() -> None:
    assert TrainerCallbacks([_Constant(None)]).step_end(1, None, True, None) is None
    assert TrainerCallbacks([_Constant({"x": 1})]).step_end(1, None, True, None) == {"x": 1}


def test_train_end_reaches_every_callback_even_if_one_raises() -> None:
    class Failing(TrainerCallback):
        def train_end(self, step: int) -> None:
            raise RuntimeError("first")

    last = _Constant(None)
    with pytest.raises(RuntimeError, match="first"):
        TrainerCallbacks([Failing(), last]).train_end(5)
    assert last.calls == ["train_end:5"]


# -- WeightBroadcastCallback -------------------------------------------------------------------


def test_each_successful_step_is_announced_then_pushed_and_reported() -> None:
    channel = QueueCommandChannel()
    pusher = _RecordingPusher(channel)
    callback = WeightBroadcastCallback(
        _weights, pusher=pusher, channel=channel, timer="auto", sync_on_run_begin=False
    )
    assert callback.timer is not None and callback.timer.clock is TimerClock.PERF_COUNTER
    callbacks = TrainerCallbacks([callback])
    callbacks.run_begin(0)

    merged = callbacks.step_end(1, {"loss": 1.0}, True, {"loss": 1.0})
    assert merged is not None
    assert merged["loss"] == 1.0
    assert merged["weight_sync_time_ms"] > 0.0
    assert merged["weight_sync_time_ms_max"] == merged["weight_sync_time_ms"]
    assert (
        merged["weight_sync_count"],
        merged["weight_sync_bytes"],
        merged["weight_sync_version"],
    ) == (1, WEIGHT_BYTES, 1)

    # A skipped update pushes nothing.
    assert callbacks.step_end(2, None, False, {"loss": 2.0}) == {"loss": 2.0}
    # Unlogged steps push, and keep their samples for the next logged step.
    assert callbacks.step_end(3, None, True, None) is None
    assert callbacks.step_end(4, None, True, None) is None
    merged = callbacks.step_end(5, None, True, {"loss": 5.0})
    assert merged is not None
    assert (
        merged["weight_sync_count"],
        merged["weight_sync_bytes"],
        merged["weight_sync_version"],
    ) == (3, 3 * WEIGHT_BYTES, 4)

    assert [(c.kind, c.step, c.version, c.num_tensors, c.nbytes) for c in pusher.commands] == [
        (CommandKind.WEIGHTS, s, v, 2, WEIGHT_BYTES) for s, v in [(1, 1), (3, 2), (4, 3), (5, 4)]
    ]
    assert [v for v, _ in pusher.pushes] == [1, 2, 3, 4]

    callbacks.train_end(5)
    stop = channel.receive(1.0)
    assert (stop.kind, stop.step, stop.version) == (CommandKind.STOP, 5, 4)
    assert callback.final_metrics is None
    stats = callback.statistics()
    assert (stats.syncs, stats.bytes, stats.timed_samples) == (4, 4 * WEIGHT_BYTES, 4)


def test_run_begin_pushes_the_initial_weights() -> None:
    pusher = _RecordingPusher()
    callback = WeightBroadcastCallback(_weights, pusher=pusher, initial_version=10)
    callback.run_begin(100)
    assert [v for v, _ in pusher.pushes] == [11]
    merged = callback.step_end(101, None, True, {})
    assert merged is not None
    assert (merged["weight_sync_count"], merged["weight_sync_version"]) == (2, 12)


def test_cuda_clock_samples_arrive_on_a_later_logged_step() -> None:
    """With deferred events, a push's time is reported once its end event completed."""
    stream = FakeCudaStream()
    timer = WeightSyncTimer(TimerClock.CUDA_EVENTS, event_factory=stream.event)
    callback = WeightBroadcastCallback(
        _weights, pusher=_RecordingPusher(stream=stream), timer=timer, sync_on_run_begin=False
    )
    first = callback.step_end(1, None, True, {})
    assert first == {
        "weight_sync_count": 1,
        "weight_sync_bytes": WEIGHT_BYTES,
        "weight_sync_version": 1,
    }
    stream.complete_all()
    second = callback.step_end(2, None, True, {})
    assert second is not None
    assert second["weight_sync_time_ms"] == 10.0
    assert second["weight_sync_count"] == 1
    callback.step_end(3, None, True, None)
    stream.complete_all()
    callback.train_end(3)
    # The pushes of steps 2 and 3 were harvested only at train_end: kept for the final log.
    assert callback.final_metrics is not None
    assert callback.final_metrics["weight_sync_time_ms"] == pytest.approx(25.0)
    assert callback.final_metrics["weight_sync_time_ms_max"] == 30.0
    assert stream.early_elapsed_time_calls == 0 and stream.waits == 0


def test_a_plain_function_can_be_the_pusher() -> None:
    seen: list[int] = []

    def push(weights: Mapping[str, torch.Tensor], *, version: int, timeout: float) -> None:
        seen.append(version)

    callback = WeightBroadcastCallback(_weights, pusher=push, sync_on_run_begin=False)
    callback.step_end(1)
    callback.step_end(2)
    assert seen == [1, 2]


def test_a_failed_push_does_not_advance_the_version() -> None:
    class Failing:
        def push_weights(
            self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
        ) -> None:
            raise WeightBroadcastError("peer gone")

    callback = WeightBroadcastCallback(_weights, pusher=Failing(), sync_on_run_begin=False)
    with pytest.raises(WeightBroadcastError, match="peer gone"):
        callback.step_end(1, None, True, {})
    assert callback.version == 0
    assert callback.timer is not None and callback.timer.statistics().failed == 1
    assert callback.step_end(2, None, False, {}) is None


def test_disabled_timing_constructs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """timer=None: no timer, no event, no time key; the count and bytes are still reported."""
    constructed: list[object] = []

    class CountingTimer(WeightSyncTimer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            constructed.append(self)
            super().__init__(*args, **kwargs)

    def no_events(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a CUDA event was constructed on the disabled path")

    monkeypatch.setattr(trainer_module, "WeightSyncTimer", CountingTimer)
    monkeypatch.setattr(torch.cuda, "Event", no_events)
    callback = WeightBroadcastCallback(_weights, pusher=_RecordingPusher(), timer=None)
    callbacks = TrainerCallbacks([callback])
    callbacks.run_begin(0)
    counts = []
    for step in range(1, 4):
        merged = callbacks.step_end(step, None, True, {"loss": 0.0})
        assert merged is not None and "weight_sync_time_ms" not in merged
        counts.append(merged["weight_sync_count"])
    callbacks.train_end(3)
    assert counts == [2, 1, 1]
    assert constructed == []
    assert callback.timer is None

    # The same monkeypatch sees the enabled path: the check above is not vacuous.
    WeightBroadcastCallback(_weights, pusher=_RecordingPusher())
    assert len(constructed) == 1


def test_a_receiver_checks_the_announcement_before_taking_part() -> None:
    """Tensor count and bytes are checked before any collective: no dist group is needed."""
    into = {"a": torch.zeros(4), "b": torch.zeros(2, 3, dtype=torch.float64)}
    before = {k: v.clone() for k, v in into.items()}
    command = WeightSyncCommand(
        CommandKind.WEIGHTS, step=3, version=2, num_tensors=2, nbytes=WEIGHT_BYTES + 8
    )
    with pytest.raises(
        WeightMismatchError, match=r"(?s)weights v2 \(step 3\).*announced 2 tensors"
    ):
        BroadcastWeightPusher().receive_weights(into, command, timeout=1.0)
    assert all(torch.equal(into[k], before[k]) for k in into)


@pytest.mark.timeout(60)
def test_the_demo_reports_trainer_and_rollout_side_sync_metrics() -> None:
    from rollout_sync.demos.in_process import InProcessDemoConfig, run_in_process_demo

    report = run_in_process_demo(InProcessDemoConfig(syncs=20, interval_s=0.0))
    assert report["syncs"] == 20 and report["torn_reads"] == 0
    for key in ("weight_sync_time_ms", "egress_drain_ms", "handler_ms", "fence_ms"):
        assert report[f"{key}_p50"] <= report[f"{key}_p99"]
    # The trainer's push contains the whole guarded receive.
    assert report["weight_sync_time_ms_p50"] >= report["handler_ms_p50"]


# -- TransferWeightPusher ----------------------------------------------------------------------


class _SourceTransfer:
    """The P2R source side of a transfer, in process: logs each send."""

    is_source = True

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def send(self, weights: Mapping[str, torch.Tensor], *, version: int) -> TransferStats:
        self.log.add(f"send:v{version}")
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


class _HoldingReceiver:
    def __init__(self, log: EventLog, timeline: Timeline | None = None) -> None:
        self.log = log
        self.timeline = timeline

    @contextmanager
    def hold_receives(self, timeout: float | None = None) -> Iterator[None]:
        self.log.add(f"hold:{timeout}")
        try:
            yield
        finally:
            self.log.add("release")


def test_the_transfer_pusher_meets_the_replica_then_holds_receives_then_sends() -> None:
    log = EventLog()
    timeline = Timeline()
    pusher = TransferWeightPusher(
        _SourceTransfer(log),  # type: ignore[arg-type]
        barrier=lambda timeout: log.add(f"barrier:{timeout}"),
        receiver=_HoldingReceiver(log, timeline),
    )  # type: ignore[arg-type]
    pusher.push_weights(_weights(), version=3, timeout=5.0)
    assert log.events == ["barrier:5.0", "hold:5.0", "send:v3", "release"]
    assert pusher.last_stats is not None and pusher.last_stats.version == 3
    # The hold is on the receiver's timeline (the trainer's lane of the picture).
    assert [s.name for s in timeline.spans(SpanKind.PAYLOAD_HOLD)] == ["payload receives held"]


def test_the_transfer_pusher_refuses_a_receive_hold_without_the_barrier() -> None:
    with pytest.raises(ValueError, match="barrier"):
        TransferWeightPusher(
            _SourceTransfer(EventLog()),  # type: ignore[arg-type]
            receiver=_HoldingReceiver(EventLog()),
        )  # type: ignore[arg-type]


class _SourceOnly:
    """Just enough of a P2R source for a pusher that is never pushed through."""

    is_source = True
    delta_syncs = True
    group = None


def test_the_delta_callback_sets_its_keyframes_and_turns_deltas_on_after_a_recovery() -> None:
    from rollout_sync.trainer import TransferWeightPusher, WeightBroadcastCallback

    already = TransferWeightPusher(_SourceOnly(), delta=True, full_every=5)  # type: ignore[arg-type]
    callback = WeightBroadcastCallback(dict, pusher=already, timer=None, delta=True, full_every=2)
    assert already.encoder is not None and already.encoder.full_every == 2  # the callback's
    plain = TransferWeightPusher(_SourceOnly())  # type: ignore[arg-type]
    callback.use_pusher(plain, channel=None)
    assert plain.encoder is not None and plain.encoder.full_every == 2
    with pytest.raises(ValueError, match="sends through a TransferWeightPusher"):
        callback.use_pusher(lambda weights, **kw: None, channel=None)
    whole = WeightBroadcastCallback(dict, pusher=TransferWeightPusher(_SourceOnly()), timer=None)  # type: ignore[arg-type]
    other = TransferWeightPusher(_SourceOnly())  # type: ignore[arg-type]
    whole.use_pusher(other, channel=None)
    assert other.encoder is None  # a callback without delta leaves the pusher as it is
