"""Logging both sides' metrics (docs/metrics.md), with a trainer and a replica in one process.

The trainer's ``WeightBroadcastCallback`` pushes each step's weights straight into a guarded
in-process worker (across processes the pusher is a ``TransferWeightPusher``); the trainer logs
its step metrics, ``weight_sync_time_ms`` merged in, and the worker logs each sync's report.
"""

import logging

import torch

from rollout_sync import TrainerCallbacks, WeightBroadcastCallback
from rollout_sync.backends.torch_lm import TinyCausalLM, TinyLMConfig, TorchLMBackend
from rollout_sync.testing import InProcessWorker, weights_digest

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def train_step(model: torch.nn.Module) -> tuple[dict[str, float], bool, dict[str, float]]:
    """The stand-in for training: move every weight; the losses and metrics a trainer reports."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    return {"loss": 1.0}, True, {"loss": 1.0, "lr": 1e-4}


def main() -> None:
    model = TinyCausalLM.build(LM, seed=1)
    worker = InProcessWorker(TorchLMBackend(LM), packer=None, timeline=None, timeout_s=30)

    def push(weights: dict[str, torch.Tensor], *, version: int, timeout: float) -> None:
        worker.receive_weights(version, weights)  # guarded: pause, hold, write, commit

    callbacks = TrainerCallbacks([WeightBroadcastCallback(lambda: model.state_dict(), pusher=push)])
    # [doc:logging]
    from rollout_sync.metrics_logging import MetricsLogger

    # The rollout side: each guarded sync's report (its names start with "rollout_sync/").
    rollout_log = MetricsLogger()
    worker.on_weight_sync_report = lambda report: rollout_log(report.to_metrics())

    # The trainer side: the step's metrics, with weight_sync_time_ms and the others merged in.
    log = MetricsLogger(prefix="training/")  # logger "rollout_sync.metrics", level INFO
    for step in range(1, 4):
        reduced_losses, update_successful, train_metrics = train_step(model)
        metrics = callbacks.step_end(step, reduced_losses, update_successful, train_metrics)
        if metrics is not None:
            log(metrics, step=step)  # one log line; W&B too when a run is active
    # [/doc:logging]
    assert weights_digest(worker.rollout.served_weights()) == weights_digest(model.state_dict())


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    lines = Lines()
    logging.getLogger("rollout_sync.metrics").addHandler(lines)
    main()
    trainer_lines = [line for line in lines.lines if "training/weight_sync_time_ms=" in line]
    rollout_lines = [line for line in lines.lines if "rollout_sync/time_to_park_ms=" in line]
    assert len(trainer_lines) == 3 and trainer_lines[0].startswith("step 1: "), lines.lines
    assert "training/loss=1 " in trainer_lines[0], trainer_lines[0]
    assert len(rollout_lines) == 3, lines.lines
