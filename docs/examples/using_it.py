from dataclasses import dataclass
from functools import partial

import torch

from rollout_sync import WorkerContractError
from rollout_sync.backends.torch_lm import TinyCausalLM, TinyLMConfig, tiny_lm_weights
from rollout_sync.testing import EventLog, RecordingPacker, weights_digest

# isort: split
# [doc:using_it]
from rollout_sync import RolloutBase, weight_sync_handler


class MyBackend(RolloutBase):
    def initialize(self):  # built once, by the first sync, inside its bracket
        self.model = build_model()

    def served_weights(self):  # the tensors generation reads, by name
        return dict(self.model.named_parameters())

    # override paused() if generation runs while the worker's loop handles commands


class Worker:
    def __init__(self):
        self.rollout = MyBackend()  # paused for the sync
        self.data_packer = my_packer  # held for the sync if it has hold_sends/flush_pending_sends

    @weight_sync_handler  # pause -> hold egress -> body -> fence -> release -> resume
    def receive_weights_p2r(self, command):
        self.rollout.ensure_initialized()  # lazy init happens inside the bracket
        self.rollout.load_weights(command.weights)  # the transfer (here the command carries them)
        self.rollout.commit_weight_version(command.version)


# [/doc:using_it]


# -- the fill-ins: a tiny model, a fake packer that logs its holds, and one sync ---------------

CONFIG = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
build_model = partial(TinyCausalLM.build, CONFIG)
events = EventLog()
my_packer = RecordingPacker(log=events)


@dataclass(frozen=True)
class P2RCommand:
    version: int
    weights: dict[str, torch.Tensor]


if __name__ == "__main__":
    worker = Worker()
    trainer_weights = tiny_lm_weights(CONFIG, seed=1)
    worker.receive_weights_p2r(P2RCommand(1, trainer_weights))

    served = worker.rollout.served_weights()
    assert weights_digest(served) == weights_digest(trainer_weights), "not the trainer's bytes"
    assert worker.rollout.weight_version == 1
    assert events.events == ["hold_sends:enter", "hold_sends:exit"], events.events
    report = worker.last_weight_sync_report
    assert report is not None and report.error is None
    print(f"served version {worker.rollout.weight_version}, bit-identical to the trainer's")
    print(f"packer: {events.events}")
    print(f"SyncReport: {report.to_metrics()}")

    # A worker whose engine is not `rollout` is refused at its first sync, not left unguarded.
    class Typo(Worker):
        def __init__(self):
            self.engine = MyBackend()
            self.data_packer = my_packer

    try:
        Typo().receive_weights_p2r(P2RCommand(2, trainer_weights))
    except WorkerContractError as exc:
        print(f"refused: {type(exc).__name__}: {str(exc)[:80]}...")
    else:
        raise AssertionError("a worker without `rollout` was not refused")
