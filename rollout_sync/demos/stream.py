"""The demo on the real tiny LM: stream generation racing weight syncs (``--backend torch_lm``).

:class:`~rollout_sync.backends.torch_lm.TorchLMStreamBackend` decodes mixed-length generations
on its scheduler thread; the main loop keeps its queue fed, runs a weight sync through a
``weight_sync_handler`` (new weights written in place into the served parameters), and hands
finished results to a :class:`~rollout_sync.testing.RecordingPacker` whose sender ships them.
Guarded, no forward reads torn weights, no forward overlaps a weight write and no payload send
overlaps a sync, while sequences in flight survive every sync. ``guarded=False`` writes without
the bracket and shows the hazards. ``stream=False`` runs the blocking backend instead: generate
and sync alternate on one thread, idle by construction.

The multi-process demo (:mod:`rollout_sync.demos.distributed`, the default of ``rollout-sync
demo``) runs the same LM streaming on every replica, with real payloads and transfers.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.torch_lm import (
    KVCachePolicy,
    TinyLMConfig,
    TorchLMBackend,
    TorchLMStreamBackend,
    tiny_lm_weights,
)
from ..metrics import summarize
from ..scheduler import FinishReason, GenerationRequest, GenerationResult
from ..testing import InProcessWorker, RecordingPacker
from ..trace import SpanKind, Timeline, split_overlaps

__all__ = ["StreamDemoConfig", "build_stream_backend", "run_stream_demo"]


@dataclass(frozen=True)
class StreamDemoConfig:
    syncs: int = 200
    interval_s: float = 0.01
    """Pause of the main loop between two syncs (generation runs freely meanwhile)."""
    guarded: bool = True
    stream: bool = True
    """Stream generation (scheduler thread); ``False``: blocking generate on the main loop."""
    model: TinyLMConfig = field(default_factory=TinyLMConfig)
    max_concurrent: int = 8
    min_new_tokens: int = 4
    max_new_tokens: int = 48
    """Generations are of mixed length, uniform in [min_new_tokens, max_new_tokens]."""
    kv_policy: KVCachePolicy = KVCachePolicy.RECOMPUTE
    send_s: float = 200e-6
    timeout_s: float = 30.0
    seed: int = 0
    torch_threads: int | None = 1
    """torch intra-op threads for the run (restored after); a model this small only loses
    from parallel kernels, badly so on a busy machine. ``None`` leaves the setting alone."""


def build_stream_backend(
    config: StreamDemoConfig | None = None, timeline: Timeline | None = None
) -> TorchLMStreamBackend:
    """The stream-generation backend the demo runs (not started; call ``start()``)."""
    config = config if config is not None else StreamDemoConfig()
    return TorchLMStreamBackend(
        config.model,
        max_concurrent=config.max_concurrent,
        kv_policy=config.kv_policy,
        pause_timeout=config.timeout_s,
        timeline=timeline,
    )


def _request(rng: random.Random, config: StreamDemoConfig) -> GenerationRequest:
    prompt = tuple(rng.randrange(config.model.vocab_size) for _ in range(rng.randint(2, 12)))
    return GenerationRequest(
        prompt, max_new_tokens=rng.randint(config.min_new_tokens, config.max_new_tokens)
    )


def run_stream_demo(config: StreamDemoConfig, timeline: Timeline | None = None) -> dict[str, Any]:
    """Run the torch_lm demo and return its report (the CLI prints it)."""
    threads = torch.get_num_threads()
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    try:
        return _run_stream_demo(config, timeline if timeline is not None else Timeline())
    finally:
        torch.set_num_threads(threads)


def _run_stream_demo(config: StreamDemoConfig, timeline: Timeline) -> dict[str, Any]:
    rng = random.Random(config.seed)
    # A trainer's successive weights: two seeds, alternating, so every sync changes every tensor.
    weight_sets = [tiny_lm_weights(config.model, config.seed + 1 + i) for i in range(2)]
    packer = RecordingPacker(
        capacity=64, send_s=config.send_s, timeline=timeline, default_timeout=config.timeout_s
    )
    backend: TorchLMBackend
    if config.stream:
        backend = build_stream_backend(config, timeline)
    else:
        backend = TorchLMBackend(
            config.model,
            kv_policy=config.kv_policy,
            pause_timeout=config.timeout_s,
            timeline=timeline,
        )
    worker = InProcessWorker(backend, packer, timeline, config.timeout_s)
    sync = worker.receive_weights if config.guarded else worker.receive_weights_unguarded
    results: list[GenerationResult] = []

    def ship(done: list[GenerationResult]) -> None:
        for result in done:
            results.append(result)
            packer.submit(
                {
                    "request_id": result.request_id,
                    "tokens": result.tokens,
                    "versions": result.token_weight_versions,
                },
                timeout=config.timeout_s,
            )

    packer.start()
    started = time.perf_counter()
    try:
        if isinstance(backend, TorchLMStreamBackend):
            backend.start()
            for version in range(1, config.syncs + 1):
                backlog = backend.scheduler.statistics()
                for _ in range(2 * config.max_concurrent - backlog.queued - backlog.active):
                    backend.put(_request(rng, config))
                sync(version, weight_sets[version % 2])
                ship(backend.get_all())
                time.sleep(config.interval_s)
            backend.stop(config.timeout_s)
            ship(backend.get_all())
        else:
            for version in range(1, config.syncs + 1):
                ship(
                    backend.generate([_request(rng, config) for _ in range(config.max_concurrent)])
                )
                sync(version, weight_sets[version % 2])
        packer.wait_sent(len(results), config.timeout_s)
    finally:
        if isinstance(backend, TorchLMStreamBackend) and backend.scheduler.running:
            backend.stop(config.timeout_s)
        packer.stop()
    wall_s = time.perf_counter() - started

    forward_writes, egress = split_overlaps(timeline.overlaps())
    park = summarize([r.park_s for r in worker.reports])
    total = summarize([r.total_s for r in worker.reports])
    steps = summarize([s.duration_s for s in timeline.spans(SpanKind.FORWARD)])
    finished = [r for r in results if r.ok]
    tokens = sum(len(r.tokens) for r in results)
    stats = backend.statistics()
    return {
        "mode": "in_process",
        "backend": "torch_lm",
        "stream": config.stream,
        "guarded": config.guarded,
        "kv_policy": config.kv_policy.value,
        "syncs": len(worker.reports),
        "forwards": stats.forwards,
        "torn_reads": stats.torn_forwards,
        "forward_write_overlaps": len(forward_writes),
        "egress_overlaps": len(egress),
        "results": len(results),
        "results_finished": len(finished),
        "results_failed": sum(1 for r in results if r.finish_reason is FinishReason.ERROR),
        "results_cancelled": sum(1 for r in results if r.finish_reason is FinishReason.CANCELLED),
        "results_straddled_sync": sum(1 for r in results if r.straddled_sync),
        "payloads_sent": len(packer.sent),
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "decode_step_ms_p50": steps.p50_ms,
        "decode_step_ms_p99": steps.p99_ms,
        "time_to_park_ms_p50": park.p50_ms,
        "time_to_park_ms_p99": park.p99_ms,
        "sync_ms_p50": total.p50_ms,
        "sync_ms_p99": total.p99_ms,
        "wall_s": wall_s,
    }
