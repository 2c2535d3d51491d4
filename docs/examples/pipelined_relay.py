"""The pipelined relay through the worker (docs/distributed.md): the two hops overlap.

A trainer and three replicas, one process each, over gloo on loopback. Every step the first
replica (rank 1) receives the trainer's weights and passes each bucket on to the other replicas
as it arrives; every replica ends bit-identical to the trainer.
"""

import multiprocessing
from typing import Any

import torch

from rollout_sync import (
    P2R,
    R2R,
    RolloutWorker,
    Stop,
    TransferConfig,
    TransferWeightPusher,
    WeightBroadcastCallback,
    WorkerCommandChannel,
    build_sync_groups,
)
from rollout_sync.backends.torch_lm import TinyCausalLM, TinyLMConfig, TorchLMBackend
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
CONFIG = TransferConfig(bucket_bytes=16 << 10, timeout_s=30)
"""Small buckets, so that a sync is several buckets and the relay has something to overlap."""
STEPS = 3


def trainer(groups: Any, queues: dict[int, Any]) -> dict[str, Any]:
    model = TinyCausalLM.build(LM, seed=1)
    # [doc:channel]
    channel = WorkerCommandChannel.for_groups(groups, queues, pipelined_relay=True)
    # announces P2R(step=s, relay=True) to rank 1 and R2R(step=s) to the others
    # [/doc:channel]
    callback = WeightBroadcastCallback(
        lambda: dict(model.state_dict()),
        pusher=TransferWeightPusher(groups.p2r_transfer(config=CONFIG), barrier=groups.p2r_barrier),
        channel=channel,
        timeout=30,
    )
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn_like(param))
        callback.step_end(step, train_metrics={"loss": 1.0})
    callback.train_end(STEPS)
    return {"digest": weights_digest(model.state_dict())}


def replica(rank: int, groups: Any, queues: dict[int, Any]) -> dict[str, Any]:
    engine = TorchLMBackend(LM, pause_timeout=30)
    roles: list[str] = []
    worker = RolloutWorker(
        engine,
        p2r=groups.p2r_transfer(config=CONFIG),
        p2r_barrier=groups.p2r_barrier,
        r2r=groups.r2r_transfer(config=CONFIG),
        commands=queues[rank],
        weight_sync_timeout=30,
        on_transfer=lambda stats, tensors: roles.append(stats.role),
    )
    results = worker.run(idle_timeout_s=30)
    worker.close(30)
    return {
        "commands": [r.command for r in results],
        "failed": [r.error for r in results if not r.ok],
        "roles": roles,
        "version": engine.weight_version,
        "digest": weights_digest(engine.served_weights()),
    }


def process(rank: int, port: int, queues: dict[int, Any]) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=4, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=30)
    return trainer(groups, queues) if rank == 0 else replica(rank, groups, queues)


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    ctx = multiprocessing.get_context("fork")
    queues = {rank: ctx.Queue() for rank in (1, 2, 3)}
    results = run_processes(
        process, 4, (find_free_port(), queues), timeout_s=90, start_method="fork"
    )
    for rank in (1, 2, 3):
        result = results[rank]
        print(f"replica rank {rank}: {result['roles']}, version {result['version']}")
        assert result["failed"] == [], result["failed"]
        assert result["version"] == STEPS
        assert result["digest"] == results[0]["digest"], f"rank {rank} differs from the trainer"
    steps = range(1, STEPS + 1)
    assert results[1]["commands"] == [*(P2R(step=s, relay=True) for s in steps), Stop()]
    assert results[1]["roles"] == ["relay"] * STEPS
    for rank in (2, 3):
        assert results[rank]["commands"] == [*(R2R(step=s) for s in steps), Stop()]
    print("every replica is bit-identical to the trainer")
