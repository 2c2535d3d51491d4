"""A sharded trainer pushes to a tensor-parallel replica (docs/distributed.md): no gather.

Two trainer ranks hold FSDP-style shards of the tiny LM (every tensor cut along dim 0); one
replica of two tensor-parallel ranks streams generations. Every step each trainer rank sends
only its own regions, straight to the replica rank that serves them; the replica's ranks park
together, and its greedy output is the whole model's. Four processes, gloo on loopback.
"""

from typing import Any

import torch

from rollout_sync import P2R, RolloutWorker, TransferConfig, WeightBroadcastCallback
from rollout_sync.backends.torch_lm import (
    TinyLMConfig,
    TorchLMBackend,
    TorchLMStreamBackend,
    tiny_lm_tp_layout,
    tiny_lm_weights,
)
from rollout_sync.backends.torch_lm.tensor_parallel import TensorParallel
from rollout_sync.distributed import init_process_group, new_group
from rollout_sync.sharded_groups import build_sharded_sync_groups
from rollout_sync.testing import find_free_port, run_processes
from rollout_sync.trainer import TransferWeightPusher
from rollout_sync.transfer import Layout, TransferPlan

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
CONFIG = TransferConfig(bucket_bytes=8 << 10, checksums=True, timeout_s=30)
STEPS = 3


def whole_model(step: int) -> dict[str, torch.Tensor]:
    """The trainer's model after ``step`` steps (what a gather would give; never gathered)."""
    return tiny_lm_weights(LM, seed=100 + step)


# [doc:layouts]
# The trainer's layout: FSDP2's Shard(0) of every tensor over its 2 ranks.
fsdp = {name: 0 for name, t in tiny_lm_weights(LM, 0).items() if t.dim()}
trainer_layout = Layout.build(tiny_lm_weights(LM, 0), 2, shard=fsdp)
# A replica's layout: Megatron's split over its 2 ranks (q/k/v and fc1 column-parallel,
# proj and fc2 row-parallel, the rest replicated).
replica_layout = tiny_lm_tp_layout(LM, tp=2)
# Which trainer rank sends which region to which replica rank: the same on every rank.
plan = TransferPlan.between(trainer_layout, replica_layout)
# [/doc:layouts]


def trainer(rank: int, groups: Any) -> dict[str, Any]:
    # [doc:trainer]
    shards: dict[str, torch.Tensor] = {}
    callback = WeightBroadcastCallback(
        lambda: shards,  # this rank's own shards: no gather
        pusher=TransferWeightPusher(groups.p2r_transfer(plan, config=CONFIG)),
        sync_on_run_begin=False,
        timeout=30,
    )
    for step in range(1, STEPS + 1):
        shards.update(trainer_layout.shard(whole_model(step), rank))  # a training step
        callback.step_end(step, train_metrics={"loss": 1.0})  # both trainer ranks at once
    # [/doc:trainer]
    return {"sent": callback.pusher.last_stats.nbytes}  # type: ignore[attr-defined]


def replica(rank: int, groups: Any, tp_group: Any) -> dict[str, Any]:
    # [doc:replica]
    engine = TorchLMStreamBackend(LM, tp=TensorParallel.of(tp_group, timeout_s=30))
    worker = RolloutWorker(
        engine, p2r=groups.p2r_transfer(plan, config=CONFIG), weight_sync_timeout=30
    )
    for step in range(1, STEPS + 1):
        worker.handle(P2R(step=step))  # every rank of the replica, together
    if not engine.follower:  # the replica's first rank takes the requests
        engine.put([1, 2, 3], max_new_tokens=6)
    # [/doc:replica]
    results = [] if engine.follower else [engine.scheduler.get(timeout=30)]
    worker.close(30)
    served = engine.served_weights()
    mine = replica_layout.shard(whole_model(STEPS), rank - 2)
    return {
        "version": engine.weight_version,
        "identical": all(torch.equal(served[n], mine[n]) for n in mine),
        "torn_forwards": engine.statistics().torn_forwards,
        "results": [(r.tokens, r.token_weight_versions) for r in results],
    }


def process(rank: int, port: int) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=4, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    groups = build_sharded_sync_groups(trainers=[0, 1], replicas=[[2, 3]], timeout_s=30)
    # The replica's own group: a follower waits on it for the next step as long as it idles.
    tp_group = new_group([2, 3], timeout_s=3600)
    return trainer(rank, groups) if rank < 2 else replica(rank, groups, tp_group)


if __name__ == "__main__":
    results = run_processes(process, 4, (find_free_port(),), timeout_s=120, start_method="fork")
    model_bytes = sum(t.numel() * t.element_size() for t in whole_model(0).values())
    for rank in (0, 1):
        print(f"trainer rank {rank} sent {results[rank]['sent']} of {model_bytes} bytes")
        assert results[rank]["sent"] == plan.bytes_sent(rank)
    # Each replica rank got exactly its slice (what both hold, the embeddings and norms, twice).
    assert results[0]["sent"] + results[1]["sent"] == sum(
        replica_layout.local_nbytes(k) for k in (0, 1)
    )
    for rank in (2, 3):
        assert results[rank]["version"] == STEPS and results[rank]["identical"], rank
        assert results[rank]["torn_forwards"] == 0
    whole = TorchLMBackend(LM)
    whole.load_weights(whole_model(STEPS))
    (expected,) = whole.generate([[1, 2, 3]], max_new_tokens=6)
    (tokens, versions), *_ = results[2]["results"]
    assert tokens == expected.tokens and set(versions) == {STEPS}, (tokens, expected.tokens)
    print("the replica's two ranks hold their slices; its greedy output is the whole model's")
