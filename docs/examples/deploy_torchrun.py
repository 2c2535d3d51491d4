"""docs/deploy.md: one entry point for every launcher (region ``entry``), here under torchrun.

Run plainly (``python docs/examples/deploy_torchrun.py``), it starts torchrun on this file with
three processes on this host (a trainer and two replicas) and checks that every one of them
succeeded; under torchrun each process runs the region. The trainer pushes two versions, and
every rank's weights end bit-identical. Fill-ins: the package's tiny torch LM as the replicas'
engine, and its weights as the trainer's model.
"""

# ruff: noqa: E402 - the fill-in that starts torchrun comes before the region's imports

import os
import subprocess
import sys

if __name__ == "__main__" and "RANK" not in os.environ:
    # Started plainly: start torchrun on this file (one host, three processes), bounded.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "3", __file__]
    done = subprocess.run(command, timeout=150, check=False)
    assert done.returncode == 0, f"torchrun exited with {done.returncode}"
    sys.exit(0)

# [doc:entry]
from rollout_sync import (
    RolloutWorker,
    TransferWeightPusher,
    WeightBroadcastCallback,
    WorkerCommandChannel,
    build_sync_groups,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.launch import JobContext, results_on_trainer, torchrun_context
from rollout_sync.testing import weights_digest


def entry(context: JobContext) -> str:  # the same on every launcher
    context.join(timeout_s=60)  # env:// or tcp://host:port
    groups = build_sync_groups(context.layout.trainer, context.layout.replicas)
    queues = context.command_queues()  # on the rendezvous store
    if context.is_trainer:
        channel = WorkerCommandChannel.for_groups(groups, queues)
        pusher = TransferWeightPusher(groups.p2r_transfer(), barrier=groups.p2r_barrier)
        weights = tiny_lm_weights(TinyLMConfig(), seed=0)  # the trainer's model, say
        broadcast = WeightBroadcastCallback(
            lambda: weights, pusher=pusher, channel=channel, timeout=60
        )
        for step in (1, 2):  # the training loop: a step, then the callback
            weights.update(tiny_lm_weights(TinyLMConfig(), seed=step))
            broadcast.step_end(step)  # P2R to the first replica, R2R to all; pushed
        broadcast.train_end(2)  # Stop to every replica
        return weights_digest(weights)
    worker = RolloutWorker(
        TorchLMBackend(),  # your engine
        p2r=groups.p2r_transfer(),
        r2r=groups.r2r_transfer(),
        p2r_barrier=groups.p2r_barrier,
        commands=queues[context.rank],
    )
    worker.run()  # until the Stop that train_end announces
    queues[context.rank].close()
    return weights_digest(worker.rollout.served_weights())


if __name__ == "__main__":  # under torchrun
    context = torchrun_context()
    results = results_on_trainer(context, entry(context))  # {rank: value} on the trainer
    # [/doc:entry]
    # Leave together, in order: rank 0 hosts the rendezvous store, and a store torn down at
    # interpreter exit while peers still hold connections has aborted rank 0 (seen once).
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    if context.is_trainer:
        assert results is not None and len(results) == 3, results
        assert len(set(results.values())) == 1, f"ranks differ: {results}"
        print(f"torchrun: 3 ranks, bit-identical weights {results[0]}")
