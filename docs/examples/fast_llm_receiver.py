"""docs/fast_llm.md: a replica receiving a Fast-LLM trainer's weight stream (region
``receiver``).

Fill-ins, outside the region: a redis-server on a free local port (stopped at the end), a
trainer that speaks Fast-LLM's protocol on a thread of this process
(``FastLLMTrainerStandIn``: two versions, then ``training_finished``), gloo for the broadcast
(no GPU) on a free port, and the package's tiny torch LM as the engine. The replica ends with
exactly the trainer's last weights, at its ``documents_seen``.
"""

import threading

from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.testing import find_free_port, weights_digest
from rollout_sync.testing.fast_llm_trainer import FastLLMTrainerStandIn
from rollout_sync.testing.redis_server import RedisServer

VERSIONS = {8: tiny_lm_weights(TinyLMConfig(), seed=1), 16: tiny_lm_weights(TinyLMConfig(), seed=2)}
"""The trainer's weights after each step, by ``documents_seen``."""


def run_trainer(trainer: FastLLMTrainerStandIn, errors: list[BaseException]) -> None:
    try:
        trainer.connect()  # hosts the group's store: waits for the receiver to join
        for step, documents_seen in enumerate(VERSIONS, start=1):
            trainer.push(step, documents_seen, VERSIONS[documents_seen])
        trainer.training_finished()
    except BaseException as exc:
        errors.append(exc)
    finally:
        trainer.close()


with RedisServer() as server:
    redis_host, redis_port = "127.0.0.1", server.port
    trainer_host, broadcast_port = "127.0.0.1", find_free_port()
    rollout = TorchLMBackend()
    trainer_errors: list[BaseException] = []
    trainer = threading.Thread(
        target=run_trainer,
        args=(
            FastLLMTrainerStandIn(
                server.client(), host=trainer_host, port=broadcast_port, timeout_s=60
            ),
            trainer_errors,
        ),
        daemon=True,
    )
    trainer.start()

    # [doc:receiver]
    import redis

    from rollout_sync.integrations.fast_llm import FastLLMReceiver, FastLLMRolloutSender

    client = redis.Redis(  # bounded calls: required
        host=redis_host, port=redis_port, socket_timeout=30, socket_connect_timeout=30
    )
    sender = FastLLMRolloutSender(client)  # the guard holds it during every sync
    receiver = FastLLMReceiver(
        rollout,  # any RolloutBase; names in the export format
        redis=client,
        group_address=(trainer_host, broadcast_port),  # its broadcast rendezvous (default 23456)
        rank=1,  # this receiver's rank in the group
        world_size=2,  # W: the trainer and the receivers in the group
        backend="gloo",  # the trainer's broadcast backend ("nccl" on GPUs)
        data_packer=sender,
        timeout_s=600.0,  # Fast-LLM's default group timeout
    )
    receiver.connect()  # notes the event stream's end, joins the group (the trainer waits for it)
    receiver.serve()  # every weights_ready, guarded, until training_finished
    # [/doc:receiver]
    sender.close(timeout=30)
    trainer.join(timeout=60)
    assert not trainer.is_alive() and not trainer_errors, trainer_errors
    assert receiver.finished and [v.version for v in receiver.versions] == [8, 16]
    assert rollout.weight_version == 16
    assert weights_digest(rollout.served_weights()) == weights_digest(VERSIONS[16])
    assert all(r.error is None and r.paused for r in receiver.sync_reports), receiver.sync_reports
    print(f"fast_llm: versions {[v.version for v in receiver.versions]} landed, bit-identical")
