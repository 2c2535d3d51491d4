"""The trainer's side of a weight sync with payloads streaming (docs/transport.md).

Two processes over gloo on loopback: a replica generates with the tiny LM and ships every
generation to the trainer, while the trainer pushes new weights to it. The replica's worker
pauses generation and holds its sends, then meets the trainer at the P2R barrier; only then does
the trainer hold its receives and send. No payload transfer overlaps the weight collective on
either side, and payloads keep flowing before and after the sync.
"""

import threading
from typing import Any

import torch

from rollout_sync import (
    P2R,
    PayloadReceiver,
    PayloadSender,
    RolloutWorker,
    Timeline,
    TransferConfig,
    build_sync_groups,
    new_payload_groups,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import find_free_port, run_processes, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
CONFIG = TransferConfig(bucket_bytes=16 << 10, timeout_s=30)
PAYLOADS_BEFORE = PAYLOADS_AFTER = 3


def trainer(groups: Any, payload_groups: Any, timeline: Timeline) -> dict[str, Any]:
    receiver = PayloadReceiver(payload_groups, [1], timeline=timeline, default_timeout=30)
    versions: list[int] = []

    def take() -> None:  # the trainer's consumer: every payload until the sender closes
        versions.extend(p.meta["version"] for p in receiver.iter_payloads(timeout=30))

    taker = threading.Thread(target=take)
    taker.start()
    p2r = groups.p2r_transfer(config=CONFIG, timeline=timeline)
    weights = tiny_lm_weights(LM, seed=1)
    # [doc:hold]
    groups.p2r_barrier(timeout=60)  # the replica is paused and holds its sends
    with receiver.hold_receives(timeout=60):
        p2r.send(weights, version=1)  # the weight collective
    # [/doc:hold]
    taker.join(40)
    assert not taker.is_alive(), "the sender never closed"
    receiver.close(30)
    return {"versions": versions, "digest": weights_digest(weights)}


def replica(groups: Any, payload_groups: Any, timeline: Timeline) -> dict[str, Any]:
    engine = TorchLMBackend(LM, pause_timeout=30)
    sender = PayloadSender(payload_groups, 0, capacity=8, timeline=timeline, default_timeout=30)
    worker = RolloutWorker(
        engine,
        p2r=groups.p2r_transfer(config=CONFIG, timeline=timeline),
        p2r_barrier=groups.p2r_barrier,
        data_packer=sender,
        timeline=timeline,
        weight_sync_timeout=30,
    )
    registered = {0: threading.Semaphore(0), 1: threading.Semaphore(0)}
    stop = threading.Event()

    def generate() -> None:  # generation runs on its own thread, across the sync
        while not stop.is_set():
            result = engine.generate([[1, 2, 3]], max_new_tokens=4, timeout=30)[0]
            version = result.completed_weight_version
            sender.register_payload({"tokens": torch.tensor(result.tokens)}, {"version": version})
            registered[version].release()

    generator = threading.Thread(target=generate)
    generator.start()
    try:
        for _ in range(PAYLOADS_BEFORE):
            assert registered[0].acquire(timeout=30), "no generation before the sync"
        result = worker.handle(P2R(step=1))  # paused, sends held, barrier, receive, commit
        for _ in range(PAYLOADS_AFTER):
            assert registered[1].acquire(timeout=30), "no generation after the sync"
    finally:
        stop.set()
        generator.join(30)
    sender.close(30)
    assert result.ok, result.error
    return {
        "digest": weights_digest(engine.served_weights()),
        "holds_taken": sender.statistics().holds_taken,
    }


def process(rank: int, port: int) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    groups = build_sync_groups(trainer=0, replicas=[1], timeout_s=30)
    payload_groups = new_payload_groups(timeout=30)
    timeline = Timeline()
    out = (trainer if rank == 0 else replica)(groups, payload_groups, timeline)
    out["overlaps"] = [str(o) for o in timeline.overlaps()]
    out["payload_spans"] = len(timeline.spans("payload_send") + timeline.spans("payload_recv"))
    return out


if __name__ == "__main__":
    # fork: the children inherit this process's imports instead of importing torch again.
    results = run_processes(process, 2, (find_free_port(),), timeout_s=60, start_method="fork")
    trainer_result, replica_result = results[0], results[1]
    versions = trainer_result["versions"]
    print(
        f"trainer took {len(versions)} payloads (weight versions {sorted(set(versions))}) in "
        f"{trainer_result['payload_spans']} transfers; replica held its sends "
        f"{replica_result['holds_taken']} time(s)"
    )
    for name, result in (("trainer", trainer_result), ("replica", replica_result)):
        assert result["overlaps"] == [], f"{name}: {result['overlaps']}"
    assert {0, 1} <= set(versions), versions
    assert replica_result["holds_taken"] >= 1
    assert replica_result["digest"] == trainer_result["digest"], "the replica differs"
    print("no payload transfer overlapped the weight collective; the replica is bit-identical")
