"""Setting up the payload transport (docs/transport.md): a trainer and two rollouts.

Three processes over gloo on loopback. Rank 1 ships a generation through a sender of its own,
rank 2 through the sender mixed into its backend; the trainer takes both and sees every sender
close.
"""

from typing import Any

from rollout_sync.backends.torch_lm import TinyLMConfig
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import find_free_port, run_processes

# isort: split
# [doc:setup]
import torch

import rollout_sync as rs
from rollout_sync.backends.torch_lm import TorchLMBackend


class MyBackend(rs.NCCLRolloutMixin, TorchLMBackend):  # any RolloutBase
    pass


def run(rank, timeline):
    # Every rank calls this (a collective, like dist.new_group), with the same arguments.
    groups = rs.new_payload_groups(ranks=[0, 1, 2])  # data: NCCL on GPU, else gloo; control: gloo

    if rank == 0:  # the trainer
        receiver = rs.PayloadReceiver(groups, sender_ranks=[1, 2], window=64, timeline=timeline)
        for payload in receiver.iter_payloads(timeout=30):  # ends when every sender closed
            print(payload.source, payload.seq, payload.tensors, payload.meta)
        receiver.close(timeout=30)

    elif rank == 1:  # a rollout: a sender directly ...
        sender = rs.PayloadSender(groups, receiver_rank=0, capacity=64, timeline=timeline)
        ids, lp, r = rollout()
        sender.register_payload({"tokens": ids, "logprobs": lp, "reward": r}, {"prompt_id": "p7"})
        sender.close(timeout=30)  # sends everything first, then says goodbye

    else:  # ... or mixed into the backend or the worker, where the weight-sync guard finds it
        backend = MyBackend(LM)
        backend.init_payload_transport(groups, receiver_rank=0, capacity=64)
        result = backend.generate([[1, 2, 3]], max_new_tokens=4)[0]
        backend.register_payload({"tokens": torch.tensor(result.tokens)}, {"prompt_id": "p8"})
        backend.close_payload_transport(timeout=30)
    # [/doc:setup]
    return receiver.statistics() if rank == 0 else None


LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def rollout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A generation of the tiny LM: its token ids, their logprobs, and a made-up reward."""
    result = TorchLMBackend(LM).generate([[4, 5, 6]], max_new_tokens=4)[0]
    return torch.tensor(result.tokens), torch.tensor(result.logprobs), torch.tensor([1.0])


def process(rank: int, port: int) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=3, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    timeline = rs.Timeline()
    stats = run(rank, timeline)
    return {"stats": stats, "spans": len(timeline.spans())}


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    results = run_processes(process, 3, (find_free_port(),), timeout_s=60, start_method="fork")
    stats = results[0]["stats"]
    print(f"trainer: received {stats.received}, lost {stats.lost}")
    assert stats.received == 2 and stats.lost == 0 and not stats.failed_senders, stats
    # A payload_recv span per transfer on the trainer, a payload_send span on rank 1.
    assert results[0]["spans"] == 2 and results[1]["spans"] == 1, results
