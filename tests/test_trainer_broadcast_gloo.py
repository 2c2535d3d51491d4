"""A trainer and a rollout process over gloo: announce, broadcast, perf_counter timing, merge."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
import torch

from rollout_sync import TrainerCallbacks, WeightBroadcastCallback, weight_sync_bracket
from rollout_sync.errors import WeightBroadcastError
from rollout_sync.metrics import TimerClock
from rollout_sync.testing import EventLog, RecordingRollout, run_group
from rollout_sync.trainer import BroadcastCommandChannel, BroadcastWeightPusher, CommandKind

TIMEOUT_S = 20.0
SILENT_TIMEOUT_S = 0.5
GATHER_FLOOR_S = 0.02
ROLLOUT_METRICS = {
    "rollout_sync/time_to_park_ms",
    "rollout_sync/egress_drain_ms",
    "rollout_sync/handler_ms",
    "rollout_sync/fence_ms",
    "rollout_sync/sync_total_ms",
    "rollout_sync/stall_ms",
}


def _plain(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Nested lists: tensors sent through a Queue would share memory with an exiting child."""
    return {k: v.tolist() for k, v in weights.items()}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _trainer(
    channel: BroadcastCommandChannel, pusher: BroadcastWeightPusher, rollout_done: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(32, 8), torch.randn(32, 2)
    pushed: dict[int, dict[str, Any]] = {}

    def gather() -> dict[str, torch.Tensor]:
        # Stands in for a ZeRO gather; sleeps on purpose so the timed bracket has a known floor.
        time.sleep(GATHER_FLOOR_S)  # on purpose: a known floor for the timed bracket
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        pushed[broadcast.version + 1] = _plain(weights)
        return weights

    broadcast = WeightBroadcastCallback(gather, pusher=pusher, channel=channel, timeout=TIMEOUT_S)
    callbacks = TrainerCallbacks([broadcast])
    callbacks.run_begin(0)
    logged: dict[int, dict[str, Any] | None] = {}
    for step in range(1, 6):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        update_successful = step != 3  # step 3 plays an update the optimizer skipped
        if update_successful:
            optimizer.step()
        train_metrics = None if step == 4 else {"loss": loss.item()}
        logged[step] = callbacks.step_end(
            step, {"loss": loss.item()}, update_successful, train_metrics
        )
    callbacks.train_end(5)
    # Stay in the group, silent, while the rollout side waits for a command that never comes.
    assert rollout_done.wait(TIMEOUT_S), "the rollout side never finished"
    assert broadcast.timer is not None
    return {
        "clock": broadcast.timer.clock,
        "logged": logged,
        "pushed": pushed,
        "final": _plain(model.state_dict()),
        "nbytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
    }


def _rollout(
    channel: BroadcastCommandChannel, pusher: BroadcastWeightPusher, rollout_done: Any
) -> dict[str, Any]:
    torch.manual_seed(1)
    served = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    rollout = RecordingRollout(EventLog(), weights=served)
    received: list[tuple[int, int, dict[str, Any]]] = []
    metrics: list[dict[str, float]] = []
    while True:
        command = channel.receive(TIMEOUT_S)
        if command.kind is CommandKind.STOP:
            break
        with weight_sync_bracket(rollout, name="receive_weights_p2r", timeout=TIMEOUT_S) as bracket:
            pusher.receive_weights(rollout.served_weights(), command, TIMEOUT_S)
        rollout.commit_weight_version(command.version)
        assert bracket.report is not None
        metrics.append(bracket.report.to_metrics())
        received.append((command.step, command.version, _plain(served)))
    # The trainer is alive but announces nothing more: the wait is bounded and says so.
    started = time.monotonic()
    silent_error: WeightBroadcastError | None = None
    try:
        channel.receive(SILENT_TIMEOUT_S)
    except WeightBroadcastError as exc:
        silent_error = exc
    silent_s = time.monotonic() - started
    rollout_done.set()
    return {
        "silent_error": silent_error,
        "silent_s": silent_s,
        "received": received,
        "metrics": metrics,
        "version": rollout.weight_version,
        "pauses": rollout.log.events,
    }


def _rank_main(rank: int, rollout_done: Any) -> dict[str, Any]:
    channel = BroadcastCommandChannel(src=0)
    pusher = BroadcastWeightPusher(src=0)
    role = _trainer if rank == 0 else _rollout
    return role(channel, pusher, rollout_done)


def _run_two_ranks() -> dict[int, Any]:
    rollout_done = multiprocessing.get_context("spawn").Event()
    return run_group(_rank_main, 2, (rollout_done,), timeout_s=60, group_timeout_s=TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_trainer_broadcast_over_gloo_is_timed_and_merged() -> None:
    out = _run_two_ranks()
    trainer, rollout = out[0], out[1]
    nbytes = trainer["nbytes"]
    logged = trainer["logged"]

    # gloo moves CPU tensors synchronously: the perf_counter clock, no deferral.
    assert trainer["clock"] is TimerClock.PERF_COUNTER

    # Step 1: run_begin's push and step 1's, merged beside the training loss.
    step1 = logged[1]
    assert set(step1) == {
        "loss",
        "weight_sync_time_ms",
        "weight_sync_time_ms_max",
        "weight_sync_count",
        "weight_sync_bytes",
        "weight_sync_version",
    }
    assert (
        step1["weight_sync_count"],
        step1["weight_sync_bytes"],
        step1["weight_sync_version"],
    ) == (2, 2 * nbytes, 2)
    # The timer measured real wall time: each bracket includes the gather's floor.
    assert GATHER_FLOOR_S * 1e3 <= step1["weight_sync_time_ms"] < TIMEOUT_S * 1e3
    assert step1["weight_sync_time_ms"] <= step1["weight_sync_time_ms_max"]
    assert logged[2]["weight_sync_count"] == 1
    # Step 3 skipped its update: nothing pushed, nothing added.
    assert set(logged[3]) == {"loss"}
    # Step 4 was not logged; its push is reported with step 5's.
    assert logged[4] is None
    assert (logged[5]["weight_sync_count"], logged[5]["weight_sync_version"]) == (2, 5)
    assert logged[5]["weight_sync_time_ms"] >= GATHER_FLOOR_S * 1e3

    # The rollout side heard every announcement and received exactly what was pushed.
    assert [(step, version) for step, version, _ in rollout["received"]] == [
        (0, 1),
        (1, 2),
        (2, 3),
        (4, 4),
        (5, 5),
    ]
    for _, version, weights in rollout["received"]:
        assert weights == trainer["pushed"][version]
    assert rollout["received"][-1][2] == trainer["final"]
    assert trainer["pushed"][1] != trainer["final"]
    assert rollout["version"] == 5

    # Each receive ran under the guard and produced the documented rollout-side metrics.
    assert rollout["pauses"] == ["pause:enter", "pause:exit"] * 5
    assert all(set(m) == ROLLOUT_METRICS for m in rollout["metrics"])
    assert all(m["rollout_sync/handler_ms"] >= 0.0 for m in rollout["metrics"])

    # A receive with nothing announced gave a clear error within its limit.
    assert isinstance(rollout["silent_error"], WeightBroadcastError)
    assert "receiving a command from rank 0 failed" in str(rollout["silent_error"])
    assert "limit 0.5 s" in str(rollout["silent_error"])
    assert rollout["silent_s"] < TIMEOUT_S
