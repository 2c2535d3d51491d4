"""Recovery after a process died (docs/distributed.md): the job as users run it, recovered.

A trainer and three replicas over gloo on loopback: each replica's worker is in ``worker.run()``
on a ``StoreCommandQueue``, the trainer's ``WeightBroadcastCallback`` announces and pushes
each step, and the replicas ship payloads the trainer has not taken yet. Then replica rank 3
dies in its command loop and is restarted empty. A stand-in for the controller (an event the
dying process sets) interrupts the survivors: ``worker.interrupt()`` makes a replica's ``run()``
raise ``RunInterrupted``; the trainer checks a flag between steps. Every process of the new
job runs the recovery: the restarted replica is re-seeded from rank 1, the survivors send
their unacknowledged payloads again, and the replicas go back into ``worker.run()``. Three more
steps land bit-identically on every replica; no payload is lost.
"""

import multiprocessing
import os
import threading
from typing import Any

import torch

from rollout_sync import (
    PayloadReceiver,
    PayloadSender,
    RolloutWorker,
    TransferConfig,
    TransferWeightPusher,
    WeightBroadcastCallback,
    WorkerCommandChannel,
    build_sync_groups,
    new_payload_groups,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.errors import PayloadTimeout, RunInterrupted
from rollout_sync.launch import command_queues
from rollout_sync.testing import find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
WORLD = 4
VICTIM = 3
STEPS_AFTER = 3
transfer_config = TransferConfig(bucket_bytes=16 << 10, timeout_s=30)


def weights_of(version: int) -> dict[str, Any]:
    """The trainer's weights of ``version`` (its checkpoint)."""
    return tiny_lm_weights(LM, seed=100 + version)


def on_interrupt(died: Any, then: Any) -> None:
    """The controller's stand-in: when the victim dies, tell this survivor."""

    def watch() -> None:
        if died.wait(60):
            then(f"rank {VICTIM} died")

    threading.Thread(target=watch, daemon=True).start()


def first_job(rank: int, port: int, died: Any) -> dict[str, Any]:
    """Generation 0 until the death: version 1 synced, payloads not taken, the victim gone."""
    from rollout_sync.distributed import init_process_group

    init_process_group(rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=30)
    payload_groups = new_payload_groups(timeout=30)
    if rank == 0:
        receiver = PayloadReceiver(payload_groups, [1, 2, 3], default_timeout=30)
        callback = WeightBroadcastCallback(
            lambda: weights_of(callback.version + 1),
            pusher=TransferWeightPusher(
                groups.p2r_transfer(config=transfer_config),
                barrier=groups.p2r_barrier,
                receiver=receiver,
            ),
            channel=WorkerCommandChannel.for_groups(groups, command_queues(groups.replicas)),
            timeout=30,
            sync_on_run_begin=False,
        )
        callback.step_end(1, train_metrics={})  # version 1 to every replica
        interrupted = threading.Event()
        on_interrupt(died, lambda reason: interrupted.set())
        interrupted.wait(60)  # the trainer's loop would check this between steps
        return {"callback": callback}
    worker = RolloutWorker(
        TorchLMBackend(LM), weight_sync_timeout=30, commands=command_queues([rank])[rank]
    )
    worker.use_groups(groups, config=transfer_config)
    sender = PayloadSender(payload_groups, 0, default_timeout=30)
    worker.data_packer = sender
    if rank == VICTIM:
        worker.on_result = lambda result: (died.set(), os._exit(17))  # dies after version 1
    else:
        on_interrupt(died, worker.interrupt)
        for i in range(2):
            sender.register_payload({"tokens": torch.arange(8)}, {"id": f"{rank}-old{i}"})
    try:
        worker.run()
    except RunInterrupted:
        pass  # the job broke: recover
    return {"worker": worker, "sender": sender, "commands": worker.commands}


def process(index: int, port0: int, port1: int, died: Any) -> dict[str, Any]:
    restarted = index == WORLD
    rank = VICTIM if restarted else index
    callback = worker = sender = None
    if restarted:
        assert died.wait(60), f"rank {VICTIM} never died"
        worker = RolloutWorker(TorchLMBackend(LM), weight_sync_timeout=30)  # as at start
    else:
        state = first_job(rank, port0, died)
        callback, worker, sender = state.get("callback"), state.get("worker"), state.get("sender")
        if state.get("commands") is not None:
            state["commands"].close()  # the old store's queue
    new_address = f"tcp://127.0.0.1:{port1}"  # a new address for every generation
    # [doc:recover]
    from rollout_sync import (
        PayloadReceiver,
        PayloadSender,
        TransferWeightPusher,
        WorkerCommandChannel,
        build_sync_groups,
        new_payload_groups,
    )
    from rollout_sync.launch import command_queues
    from rollout_sync.recovery import Rendezvous, recover_weights, rejoin

    # A surviving replica keeps its worker and sender; a restarted one made a new worker as at
    # start, and has no sender yet. The trainer keeps its callback.
    carried = []  # what the trainer has not taken
    if sender is not None:
        carried = sender.unacknowledged()
    rejoin(rank, Rendezvous(new_address, world_size=4, generation=1), timeout_s=60)
    groups = build_sync_groups(trainer=0, replicas=[1, 2, 3], timeout_s=60)
    payload_groups = new_payload_groups(timeout=60)
    if rank == 0:  # the trainer
        plan, stats = recover_weights(
            groups,
            weights=weights_of(callback.version),
            version=callback.version,
            config=transfer_config,
        )
        receiver = PayloadReceiver(payload_groups, [1, 2, 3])
        pusher = TransferWeightPusher(
            groups.p2r_transfer(config=transfer_config),
            barrier=groups.p2r_barrier,
            receiver=receiver,
        )
        channel = WorkerCommandChannel.for_groups(groups, command_queues(groups.replicas))
        callback.use_pusher(pusher, channel=channel)  # the next step_end pushes as usual
    else:  # a replica
        sender = PayloadSender(payload_groups, 0)
        worker.data_packer = sender  # before the re-seed, which holds it (not the broken one)
        worker.use_groups(groups, config=transfer_config)
        plan, stats = recover_weights(groups, worker=worker, config=transfer_config)
        for tensors, meta in carried:
            sender.register_payload(tensors, meta)
        worker.commands = command_queues([rank])[rank]  # on the new job's store
        # and back into the command loop: worker.run()
    # [/doc:recover]
    out: dict[str, Any] = {"rank": rank, "plan": (plan.version, plan.source, plan.receivers)}
    out["reseed_role"] = None if stats is None else stats.role  # None: took no part
    if rank == 0:
        received = []
        for step in range(2, 2 + STEPS_AFTER):
            callback.step_end(step, train_metrics={})
            try:
                while True:
                    received.append(receiver.get(timeout=0.1).meta["id"])
            except PayloadTimeout:
                pass
        callback.train_end(step)  # Stop: every worker.run() returns
        received += [p.meta["id"] for p in receiver.iter_payloads(timeout=30)]
        receiver.close(30)
        out.update(received=received, lost=receiver.statistics().lost, version=callback.version)
        out["digests"] = {v: weights_digest(weights_of(v)) for v in range(2, 2 + STEPS_AFTER)}
        return out
    digests: dict[int, str] = {}
    worker.on_transfer = lambda s, tensors: digests.__setitem__(s.version, weights_digest(tensors))
    out["reseeded_to"] = worker.rollout.weight_version
    out["carried"] = [meta["id"] for _, meta in carried]
    sender.register_payload({"tokens": torch.arange(8)}, {"id": f"{rank}-new"})
    worker.run()  # until the trainer's Stop
    sender.close(30)
    worker.commands.close()
    out.update(version=worker.rollout.weight_version, digests=digests)
    return out


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    context = multiprocessing.get_context("fork")
    died = context.Event()
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
        assert replica["version"] == trainer["version"] == 1 + STEPS_AFTER, replica
        assert replica["digests"] == trainer["digests"], rank  # every step, bit-identical
    carried = results[1]["carried"] + results[2]["carried"]
    assert carried == ["1-old0", "1-old1", "2-old0", "2-old1"], carried
    assert results[3]["carried"] == []
    assert sorted(trainer["received"]) == sorted([*carried, "1-new", "2-new", "3-new"])
    assert trainer["lost"] == 0
    print(f"carried over and received: {carried}; lost: {trainer['lost']}")
    print(
        f"after recovery, {STEPS_AFTER} steps landed bit-identically on every replica "
        f"(versions 2-{1 + STEPS_AFTER}), each replica back in worker.run()"
    )
