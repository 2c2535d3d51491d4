"""Zero-copy buckets (docs/distributed.md): a trainer and a replica whose weights are flat.

Two processes over gloo on loopback; both move their model's parameters into flat storage, and
the transfer sends from and receives into it without a staging copy.
"""

from typing import Any

from rollout_sync import TransferConfig, WeightTransfer
from rollout_sync.backends.torch_lm import TinyCausalLM, TinyLMConfig
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def process(rank: int, port: int) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    # The trainer's weights are seed 1, the replica starts from seed 0.
    model = TinyCausalLM.build(LM, seed=1 if rank == 0 else 0)
    transfer = WeightTransfer(None, 0, config=TransferConfig(bucket_bytes=16 << 10, timeout_s=30))
    v = 1
    # [doc:flat]
    from rollout_sync.flat import FlatWeights

    flat = FlatWeights.adopt(dict(model.named_parameters()))  # moves the parameters in place
    if transfer.is_source:  # the trainer, or an R2R source
        stats = transfer.send(flat.tensors, version=v, storage=flat.storage)
    else:  # a receiver: flat.tensors are the tensors it serves
        stats = transfer.receive(flat.tensors, storage=flat.storage)
    # [/doc:flat]
    assert all(flat.holds(p) for p in model.parameters()), "a parameter left the flat storage"
    return {
        "digest": weights_digest(dict(model.named_parameters())),
        "buckets": stats.buckets,
        "zero_copy_buckets": stats.zero_copy_buckets,
    }


if __name__ == "__main__":
    trainer, replica = run_processes(
        process, 2, (find_free_port(),), timeout_s=60, start_method="fork"
    ).values()
    assert replica["digest"] == trainer["digest"], "the replica differs from the trainer"
    assert replica["zero_copy_buckets"] == replica["buckets"] > 1, replica
    assert trainer["zero_copy_buckets"] == trainer["buckets"], trainer
    print(
        f"{replica['buckets']} buckets, zero-copy on both sides "
        f"(trainer {trainer['zero_copy_buckets']}, replica {replica['zero_copy_buckets']}); "
        "the replica is bit-identical to the trainer"
    )
