"""Recovery after a process died (docs/distributed.md): rejoin, rebuild, re-seed, resume.

A trainer and three replicas over gloo on loopback sync version 1 while the replicas ship
payloads the trainer has not taken yet. Then replica rank 3 dies and is restarted empty. Every
process of the new job runs the recovery: the restarted replica is re-seeded from rank 1, the
survivors send their unacknowledged payloads again, and the next sync runs on the new groups:
every replica bit-identical to the trainer, no payload lost.
"""

import multiprocessing
import os
from typing import Any

import torch

from rollout_sync import (
    P2R,
    R2R,
    PayloadReceiver,
    PayloadSender,
    RolloutWorker,
    TransferConfig,
    TransferWeightPusher,
    build_sync_groups,
    new_payload_groups,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
WORLD = 4
VICTIM = 3
transfer_config = TransferConfig(bucket_bytes=16 << 10, timeout_s=30)


def weights_of(version: int) -> dict[str, Any]:
    """The trainer's weights of ``version`` (its checkpoint)."""
    return tiny_lm_weights(LM, seed=100 + version)


def sync(rank: int, version: int, pusher: Any = None, worker: Any = None) -> None:
    """One weight sync: the trainer pushes, rank 1 receives and broadcasts to the others."""
    if rank == 0:
        pusher.push_weights(weights_of(version), version=version, timeout=30)
        return
    results = [worker.handle(P2R(step=version))] if rank == 1 else []
    results.append(worker.handle(R2R(step=version)))
    assert all(r.ok for r in results), [r.error for r in results]


def first_job(rank: int, port: int) -> tuple[Any, Any]:
    """Generation 0 up to the death: version 1 synced, two payloads per survivor not taken."""
    init_process_group(rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=30)
    payload_groups = new_payload_groups(timeout=30)
    if rank == 0:
        receiver = PayloadReceiver(payload_groups, [1, 2, 3], default_timeout=30)
        p2r = groups.p2r_transfer(config=transfer_config)
        pusher = TransferWeightPusher(p2r, barrier=groups.p2r_barrier, receiver=receiver)
        sync(rank, 1, pusher=pusher)
        return None, None
    worker = RolloutWorker(TorchLMBackend(LM), weight_sync_timeout=30)
    worker.use_groups(groups, config=transfer_config)
    sender = PayloadSender(payload_groups, 0, default_timeout=30)
    worker.data_packer = sender
    sync(rank, 1, worker=worker)
    if rank != VICTIM:
        for i in range(2):
            sender.register_payload({"tokens": torch.arange(8)}, {"id": f"{rank}-old{i}"})
    return worker, sender


def process(index: int, port0: int, port1: int, died: Any) -> dict[str, Any] | None:
    restarted = index == WORLD
    rank = VICTIM if restarted else index
    if restarted:
        assert died.wait(30), f"rank {VICTIM} never died"
        worker = RolloutWorker(TorchLMBackend(LM), weight_sync_timeout=30)  # as at start
        sender = None
    else:
        worker, sender = first_job(rank, port0)
        if rank == VICTIM:
            died.set()
            os._exit(17)
    last_pushed = 1
    new_address = f"tcp://127.0.0.1:{port1}"  # a new address for every generation
    # [doc:recover]
    from rollout_sync import (
        PayloadReceiver,
        PayloadSender,
        TransferWeightPusher,
        build_sync_groups,
        new_payload_groups,
    )
    from rollout_sync.recovery import Rendezvous, recover_weights, rejoin

    # A surviving replica keeps its worker and sender; a restarted one made a new worker as at
    # start, and has no sender yet.
    carried = []  # what the trainer has not taken
    if sender is not None:
        carried = sender.unacknowledged()
    rejoin(rank, Rendezvous(new_address, world_size=4, generation=1), timeout_s=60)
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=60)
    payload_groups = new_payload_groups(timeout=60)
    if rank == 0:  # the trainer
        plan, stats = recover_weights(
            groups, weights=weights_of(last_pushed), version=last_pushed, config=transfer_config
        )
        receiver = PayloadReceiver(payload_groups, [1, 2, 3])
        pusher = TransferWeightPusher(
            groups.p2r_transfer(config=transfer_config),
            barrier=groups.p2r_barrier,
            receiver=receiver,
        )
    else:  # a replica
        sender = PayloadSender(payload_groups, 0)
        worker.data_packer = sender  # before the re-seed, which holds it (not the broken one)
        worker.use_groups(groups, config=transfer_config)
        plan, stats = recover_weights(groups, worker=worker, config=transfer_config)
        for tensors, meta in carried:
            sender.register_payload(tensors, meta)
    # and the next weight sync runs on the new groups as usual
    # [/doc:recover]
    out: dict[str, Any] = {"rank": rank, "plan": (plan.version, plan.source, plan.receivers)}
    out["reseed_role"] = None if stats is None else stats.role  # None: took no part
    if rank == 0:
        sync(rank, 2, pusher=pusher)
        out["received"] = [p.meta["id"] for p in receiver.iter_payloads(timeout=30)]
        receiver.close(30)
        out["lost"] = receiver.statistics().lost
        out["digest"] = weights_digest(weights_of(2))
    else:
        out["reseeded_to"] = worker.rollout.weight_version
        out["carried"] = [meta["id"] for _, meta in carried]
        sync(rank, 2, worker=worker)
        sender.register_payload({"tokens": torch.arange(8)}, {"id": f"{rank}-new"})
        sender.close(30)
        out["version"] = worker.rollout.weight_version
        out["digest"] = weights_digest(worker.rollout.served_weights())
    return out


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    died = multiprocessing.get_context("fork").Event()
    values = run_processes(
        process,
        WORLD + 1,  # the fifth is rank 3 restarted
        (find_free_port(), find_free_port(), died),
        timeout_s=90,
        expected_exits={VICTIM: 17},
        start_method="fork",
    )
    results = {v["rank"]: v for v in values.values() if v is not None}
    trainer = results[0]
    print(f"plan (version, source, receivers): {trainer['plan']}")
    assert all(r["plan"] == (1, 1, (3,)) for r in results.values()), results
    roles = {rank: r["reseed_role"] for rank, r in results.items()}
    assert roles == {0: None, 1: "send", 2: None, 3: "receive"}, roles
    for rank in (1, 2, 3):
        replica = results[rank]
        assert replica["reseeded_to"] == 1, replica
        assert replica["version"] == 2 and replica["digest"] == trainer["digest"], rank
    carried = results[1]["carried"] + results[2]["carried"]
    assert carried == ["1-old0", "1-old1", "2-old0", "2-old1"], carried
    assert results[3]["carried"] == []
    assert sorted(trainer["received"]) == sorted([*carried, "1-new", "2-new", "3-new"])
    assert trainer["lost"] == 0
    print(f"carried over and received: {carried}; lost: {trainer['lost']}")
    print("after the next sync every replica is bit-identical to the trainer (version 2)")
