"""From the trainer's announcements to the workers' commands, with the library's defaults only:
``WeightBroadcastCallback`` (default pusher: the validated, bucketed transfer) on a
``WorkerCommandChannel``, and ``RolloutWorker`` s taking the commands. No bridge of our own."""

from __future__ import annotations

import queue
from typing import Any

import pytest
import torch

from rollout_sync import (
    P2R,
    R2R,
    RolloutWorker,
    Stop,
    TransferWeightPusher,
    WeightBroadcastCallback,
    WeightTransfer,
    WorkerCommandChannel,
)
from rollout_sync.errors import WeightBroadcastError
from rollout_sync.testing import EventLog, RecordingRollout, run_group, weights_digest
from rollout_sync.trainer import CommandKind, WeightSyncCommand

STEPS = 4


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen),
        "layers.0.weight": torch.randn(16, 16, generator=gen),
        "layers.0.bias": torch.randn(16, generator=gen),
    }


def _process(rank: int, commands: Any) -> dict[str, Any]:
    if rank == 0:
        weights = _weights(0)
        callback = WeightBroadcastCallback(
            lambda: weights,
            channel=WorkerCommandChannel({1: commands}),
            timeout=30,
            sync_on_run_begin=False,
        )
        digests = {}
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                for tensor in weights.values():
                    tensor.add_(0.5)
            callback.step_end(step, train_metrics={"loss": 1.0})
            digests[callback.version] = weights_digest(weights)
        callback.train_end(STEPS)
        return {"pusher": type(callback.pusher), "digests": digests}
    rollout = RecordingRollout(EventLog(), weights=_weights(1))
    received: dict[int, str] = {}
    worker = RolloutWorker(
        rollout,
        p2r=WeightTransfer(None, 0),
        commands=commands,
        weight_sync_timeout=30,
        on_transfer=lambda stats, tensors: received.update(
            {stats.version: weights_digest(tensors)}
        ),
    )
    results = worker.run(idle_timeout_s=60)
    return {
        "received": received,
        "version": rollout.weight_version,
        "commands": [type(r.command) for r in results],
        "failed": [r.error for r in results if not r.ok],
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_trainer_callback_drives_a_worker_with_the_defaults_bit_identically() -> None:
    import multiprocessing

    commands = multiprocessing.get_context("spawn").Queue()
    try:
        values = run_group(_process, 2, (commands,), timeout_s=100)
    finally:
        commands.close()
        commands.join_thread()
    trainer, replica = values[0], values[1]
    assert trainer["pusher"] is TransferWeightPusher
    assert replica["failed"] == []
    assert replica["commands"] == [P2R] * STEPS + [Stop]
    assert replica["version"] == STEPS
    assert replica["received"] == trainer["digests"]


# -- the mapping, in one process ---------------------------------------------------------------


def _announcement(kind: CommandKind, step: int = 3) -> WeightSyncCommand:
    return WeightSyncCommand(kind, step, step)


def test_weights_become_p2r_for_the_target_and_r2r_for_every_replica() -> None:
    queues: dict[int, queue.Queue[object]] = {rank: queue.Queue() for rank in (2, 1, 3)}
    channel = WorkerCommandChannel(queues, replicas=[2, 1, 3])
    channel.announce(_announcement(CommandKind.WEIGHTS), timeout=1)
    taken = {rank: [q.get_nowait() for _ in range(q.qsize())] for rank, q in queues.items()}
    assert taken == {2: [P2R(step=3), R2R(step=3)], 1: [R2R(step=3)], 3: [R2R(step=3)]}
    channel.announce(_announcement(CommandKind.STOP), timeout=1)
    assert all(q.get_nowait() == Stop() for q in queues.values())


def test_a_pipelined_relay_gets_p2r_relay_and_the_others_r2r() -> None:
    queues: dict[int, queue.Queue[object]] = {rank: queue.Queue() for rank in (2, 1, 3)}
    channel = WorkerCommandChannel(queues, replicas=[2, 1, 3], pipelined_relay=True)
    channel.announce(_announcement(CommandKind.WEIGHTS), timeout=1)
    taken = {rank: [q.get_nowait() for _ in range(q.qsize())] for rank, q in queues.items()}
    assert taken == {2: [P2R(step=3, relay=True)], 1: [R2R(step=3)], 3: [R2R(step=3)]}
    # One replica: nothing to relay to.
    single: dict[int, queue.Queue[object]] = {1: queue.Queue()}
    WorkerCommandChannel(single, pipelined_relay=True).announce(
        _announcement(CommandKind.WEIGHTS), timeout=1
    )
    assert [single[1].get_nowait()] == [P2R(step=3)]


def test_a_single_replica_gets_p2r_only() -> None:
    queues: dict[int, queue.Queue[object]] = {1: queue.Queue()}
    WorkerCommandChannel(queues).announce(_announcement(CommandKind.WEIGHTS), timeout=1)
    assert [queues[1].get_nowait()] == [P2R(step=3)] and queues[1].empty()


def test_a_full_queue_fails_the_announcement_in_bounded_time() -> None:
    full: queue.Queue[object] = queue.Queue(maxsize=1)
    full.put("a command nobody takes")
    channel = WorkerCommandChannel({1: full})
    with pytest.raises(WeightBroadcastError, match=r"replica rank 1 stayed full for 0\.1 s"):
        channel.announce(_announcement(CommandKind.WEIGHTS), timeout=0.1)


def test_the_channel_refuses_a_replica_without_a_queue_and_receives_nothing() -> None:
    with pytest.raises(ValueError, match=r"no command queue for replica rank\(s\) \[2\]"):
        WorkerCommandChannel({1: queue.Queue()}, replicas=[1, 2])
    with pytest.raises(TypeError, match="only announces"):
        WorkerCommandChannel({1: queue.Queue()}).receive(timeout=1)


def test_the_default_pusher_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group first, or pass pusher="):
        WeightBroadcastCallback(lambda: {}, channel=None)
