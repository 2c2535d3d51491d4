"""Launcher-neutral job pieces: roles by rank, the torchrun context, commands on the job's store."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from rollout_sync import P2R, R2R, Stop
from rollout_sync.errors import RolloutSyncError
from rollout_sync.launch import (
    JobContext,
    JobLayout,
    Role,
    StoreCommandQueue,
    torchrun_context,
)

pytestmark = pytest.mark.timeout(60)


def _store() -> tuple[Any, Any]:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(10))
    return server, client


def test_roles_by_rank() -> None:
    layout = JobLayout(4)
    assert layout.replicas == (1, 2, 3)
    assert [layout.role_of(r) for r in range(4)] == [Role.TRAINER] + [Role.REPLICA] * 3
    assert JobLayout(3, trainer=2).replicas == (0, 1)
    with pytest.raises(ValueError, match="at least one replica"):
        JobLayout(1)
    with pytest.raises(ValueError, match=r"not in 0\.\.3"):
        layout.role_of(4)


def test_torchrun_context_reads_torchruns_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    context = torchrun_context()
    assert context == JobContext(2, JobLayout(4), "env://", launcher="torchrun")
    assert context.role is Role.REPLICA and not context.is_trainer
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="RANK is not set; run this under torchrun"):
        torchrun_context()


def test_commands_cross_the_store_in_order_and_a_timeout_is_queue_empty() -> None:
    server, client = _store()
    producer, consumer = StoreCommandQueue(server, 1), StoreCommandQueue(client, 1)
    try:
        with pytest.raises(queue.Empty):
            consumer.get(timeout=0.05)
        sent = [P2R(step=1), R2R(step=1), P2R(step=2, relay=True), Stop()]
        for command in sent:
            producer.put(command)
        taken = [consumer.get(timeout=5) for _ in range(4)]
        assert taken == sent  # every field crosses, the relay flag included
        # Another replica's queue is separate.
        StoreCommandQueue(server, 2).put(Stop())
        with pytest.raises(queue.Empty):
            consumer.get(timeout=0.05)
    finally:
        consumer.close()


def test_a_command_put_later_wakes_a_waiting_get() -> None:
    server, client = _store()
    consumer = StoreCommandQueue(client, 1)
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(consumer.get(timeout=10)))
    try:
        with pytest.raises(queue.Empty):  # starts the reader on an empty queue: it blocks
            consumer.get(timeout=0.05)
        waiting.start()
        StoreCommandQueue(server, 1).put(R2R(step=7))
        waiting.join(10)
        assert got == [R2R(step=7)]
    finally:
        consumer.close()


def test_only_worker_commands_travel() -> None:
    server, _ = _store()
    with pytest.raises(TypeError, match="carries P2R, R2R and Stop commands, not dict"):
        StoreCommandQueue(server, 1).put({"kind": "P2R"})


def _host_store_then_die(port_out: Any) -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    port_out.put(server.port)
    threading.Event().wait()  # never returns: killed by the test


def test_the_stores_death_fails_every_later_get_at_once() -> None:
    """The trainer hosts the store: when its process dies, a replica learns it at once."""
    ctx = multiprocessing.get_context("spawn")
    ports: Any = ctx.Queue()
    host = ctx.Process(target=_host_store_then_die, args=(ports,), daemon=True)
    host.start()
    consumer: StoreCommandQueue | None = None
    try:
        port = ports.get(timeout=30)
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(10))
        consumer = StoreCommandQueue(client, 1)
        with pytest.raises(queue.Empty):
            consumer.get(timeout=0.05)  # the reader is waiting on the store now
        os.kill(host.pid, 9)
        started = time.monotonic()
        with pytest.raises(RolloutSyncError, match="store is gone"):
            consumer.get(timeout=20)
        assert time.monotonic() - started < 5.0
        with pytest.raises(RolloutSyncError, match="store is gone"):
            consumer.get(timeout=0)
    finally:
        host.kill()
        host.join(10)
        if consumer is not None:
            consumer.close()
