"""The main job, in-process: generation, payload egress and weight syncs racing on real threads.

A :class:`~rollout_sync.testing.TornReadBackend` runs forwards continuously on its own thread and
hands each result to a :class:`~rollout_sync.testing.RecordingPacker`, whose sender thread ships
it. Meanwhile a trainer loop pushes new weights every step through a
:class:`~rollout_sync.WeightBroadcastCallback`, which announces each push on a command channel
and times it; the worker writes them in place through a ``weight_sync_handler``. Run it guarded
and there are no torn reads and no payload send inside a sync; ``guarded=False`` runs the same
traffic without the bracket and shows both hazards.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..metrics import percentile, summarize
from ..testing import InProcessWorker, RecordingPacker, TornReadBackend, VersionStampedModel
from ..trace import SpanKind, Timeline, split_overlaps
from ..trainer import QueueCommandChannel, TrainerCallbacks, WeightBroadcastCallback

__all__ = ["InProcessDemoConfig", "run_in_process_demo"]


@dataclass(frozen=True)
class InProcessDemoConfig:
    syncs: int = 200
    interval_s: float = 0.002
    """Pause of the sync loop between two syncs (generation runs freely meanwhile)."""
    guarded: bool = True
    num_tensors: int = 16
    numel: int = 1024
    send_s: float = 200e-6
    """How long one fake payload send takes."""
    timeout_s: float = 30.0


class _DemoWorker(InProcessWorker):
    """Writes version-stamped weights (made on the spot when none are pushed)."""

    rollout: TornReadBackend
    timeline: Timeline

    def write_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.rollout.ensure_initialized()
        if weights is None:
            weights = self.rollout.model.stamped(version)
        with self.timeline.span(SpanKind.WEIGHT_WRITE, f"write v{version}"):
            self.rollout.load_weights(weights)
        self.rollout.commit_weight_version(version)


class _WorkerPusher:
    """The trainer's pusher in process: the worker takes the announcement, then the weights.

    What a rollout worker's command loop does with a P2R command, reduced to a direct call.
    """

    def __init__(self, worker: _DemoWorker, channel: QueueCommandChannel, guarded: bool) -> None:
        self.worker = worker
        self.channel = channel
        self.receive = worker.receive_weights if guarded else worker.receive_weights_unguarded

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        command = self.channel.receive(timeout)
        if command.version != version:
            raise RuntimeError(f"announced v{command.version}, pushing v{version}")
        self.receive(command.version, weights)


def run_in_process_demo(
    config: InProcessDemoConfig, timeline: Timeline | None = None
) -> dict[str, Any]:
    """Run the in-process demo and return its report (see the CLI for the keys)."""
    timeline = timeline if timeline is not None else Timeline()
    model = VersionStampedModel(config.num_tensors, config.numel, timeline=timeline)
    packer = RecordingPacker(
        capacity=32, send_s=config.send_s, timeline=timeline, default_timeout=config.timeout_s
    )
    backend = TornReadBackend(
        model, packer=packer, pause_timeout=config.timeout_s, timeline=timeline
    )
    worker = _DemoWorker(backend, packer, timeline, config.timeout_s)
    channel = QueueCommandChannel()
    # The trainer's side: stamps the weights of the version about to be pushed.
    broadcast = WeightBroadcastCallback(
        lambda: model.stamped(broadcast.version + 1),
        pusher=_WorkerPusher(worker, channel, config.guarded),
        channel=channel,
        timeout=config.timeout_s,
        sync_on_run_begin=False,
    )
    callbacks = TrainerCallbacks([broadcast])
    weight_sync_ms: list[float] = []

    packer.start()
    backend.start()
    started = time.perf_counter()
    try:
        callbacks.run_begin(0)
        for step in range(1, config.syncs + 1):
            metrics = callbacks.step_end(step, None, True, {"forwards": model.forwards})
            if metrics is not None and "weight_sync_time_ms" in metrics:
                weight_sync_ms.append(metrics["weight_sync_time_ms"])
            time.sleep(config.interval_s)
        callbacks.train_end(config.syncs)
    finally:
        backend.stop()
        packer.stop()
    wall_s = time.perf_counter() - started

    park = summarize([r.park_s for r in worker.reports])
    total = summarize([r.total_s for r in worker.reports])
    drain = summarize([r.egress_drain_s for r in worker.reports])
    handler = summarize([r.handler_s for r in worker.reports])
    fence = summarize([r.fence_s for r in worker.reports])
    forward_writes, egress_overlaps = split_overlaps(timeline.overlaps())
    return {
        "mode": "in_process",
        "guarded": config.guarded,
        "syncs": len(worker.reports),
        "forwards": model.forwards,
        "torn_reads": model.torn_reads,
        "forward_write_overlaps": len(forward_writes),
        "egress_overlaps": len(egress_overlaps),
        "payloads_sent": len(packer.sent),
        "time_to_park_ms_p50": park.p50_ms,
        "time_to_park_ms_p99": park.p99_ms,
        "sync_ms_p50": total.p50_ms,
        "sync_ms_p99": total.p99_ms,
        "egress_drain_ms_p50": drain.p50_ms,
        "egress_drain_ms_p99": drain.p99_ms,
        "handler_ms_p50": handler.p50_ms,
        "handler_ms_p99": handler.p99_ms,
        "fence_ms_p50": fence.p50_ms,
        "fence_ms_p99": fence.p99_ms,
        "weight_sync_time_ms_p50": percentile(weight_sync_ms, 50),
        "weight_sync_time_ms_p99": percentile(weight_sync_ms, 99),
        "wall_s": wall_s,
    }
