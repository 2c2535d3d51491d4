"""The rollout worker and the trainer that drives it (docs/distributed.md), as one job.

A trainer and three replicas, one process each, over gloo on loopback. The trainer's
``WeightBroadcastCallback`` announces every step on the replicas' command queues and pushes the
weights to the first replica (rank 1), which broadcasts them to the others; every replica ends
bit-identical to the trainer.
"""

import multiprocessing
from typing import Any

import torch

from rollout_sync import RolloutWorker, Timeline, TransferConfig, build_sync_groups
from rollout_sync.backends.torch_lm import TinyCausalLM, TinyLMConfig, TorchLMBackend
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import RecordingPacker, find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
STEPS = 3
"""The trainer's loop below runs steps 1, 2, 3."""


def train_step(model: torch.nn.Module) -> float:
    """The stand-in for training: move every weight, so every version differs."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    return 1.0


def trainer(queues: dict[int, Any]) -> dict[str, Any]:
    model = TinyCausalLM.build(LM, seed=1)
    # [doc:trainer]
    from rollout_sync import (
        TransferWeightPusher,
        WeightBroadcastCallback,
        WorkerCommandChannel,
        build_sync_groups,
    )

    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=60)  # every rank
    # queues[r] is replica r's command queue (a multiprocessing queue, say)
    callback = WeightBroadcastCallback(
        lambda: dict(model.state_dict()),
        pusher=TransferWeightPusher(groups.p2r_transfer(), barrier=groups.p2r_barrier),
        channel=WorkerCommandChannel.for_groups(groups, queues),
    )
    for step in range(1, 4):
        loss = train_step(model)  # your training step
        metrics = callback.step_end(step, train_metrics={"loss": loss})  # announce, then push
    callback.train_end(step)  # announces Stop: every worker.run() returns
    # [/doc:trainer]
    return {"version": callback.version, "digest": weights_digest(model.state_dict()), **metrics}


def replica(rank: int, queues: dict[int, Any]) -> dict[str, Any]:
    engine = TorchLMBackend(LM, pause_timeout=30)
    command_queue = queues[rank]
    packer = RecordingPacker().start()
    timeline = Timeline()
    # [doc:worker]
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=60)  # every rank
    worker = RolloutWorker(
        engine,  # a RolloutBase; cheap to construct
        p2r=groups.p2r_transfer(config=TransferConfig(bucket_bytes=32 << 20)),
        p2r_barrier=groups.p2r_barrier,  # met inside the P2R bracket; the trainer's pusher too
        r2r=groups.r2r_transfer(config=TransferConfig(bucket_bytes=32 << 20)),
        commands=command_queue,  # queue.Queue, a multiprocessing queue, ...
        data_packer=packer,  # held by the guard during syncs
        timeline=timeline,
    )
    worker.run()  # until Stop
    worker.close()
    # [/doc:worker]
    packer.stop(10)
    return {
        "commands": [type(r.command).__name__ for r in worker.results],
        "failed": [r.error for r in worker.results if not r.ok],
        "version": engine.weight_version,
        "digest": weights_digest(engine.served_weights()),
    }


def process(rank: int, port: int, queues: dict[int, Any]) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=4, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    return trainer(queues) if rank == 0 else replica(rank, queues)


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    ctx = multiprocessing.get_context("fork")
    queues = {rank: ctx.Queue() for rank in (1, 2, 3)}
    results = run_processes(
        process, 4, (find_free_port(), queues), timeout_s=90, start_method="fork"
    )
    trainer_result = results[0]
    print(
        f"trainer: version {trainer_result['version']}, "
        f"weight_sync_time_ms {trainer_result['weight_sync_time_ms']:.1f}"
    )
    for rank in (1, 2, 3):
        result = results[rank]
        print(f"replica rank {rank}: {result['commands']}, version {result['version']}")
        assert result["failed"] == [], result["failed"]
        assert result["version"] == STEPS
        assert result["digest"] == trainer_result["digest"], f"rank {rank} differs"
    assert results[1]["commands"] == ["P2R", "R2R"] * STEPS + ["Stop"]
    assert results[2]["commands"] == ["R2R"] * STEPS + ["Stop"]
    print("every replica is bit-identical to the trainer")
