"""The main job on vLLM, in-process: stream generation, payload egress and weight syncs racing.

A :class:`~rollout_sync.backends.vllm.VLLMAsyncBackend` serves a tiny random Llama (built
locally, no hub) and keeps ``streams`` requests in flight; each finished generation is handed
to a :class:`~rollout_sync.testing.RecordingPacker`, whose sender thread ships it. Meanwhile a
sync loop writes a new random version through a ``weight_sync_handler``, in two parts as a
bucketed transfer would. The first sync starts the engine, inside the bracket.

The report has the keys of the in-process demo. ``forwards`` are the engine's model forwards
(traced inside the engine); ``torn_reads`` counts forwards that ran between the first and the
last write of one sync, i.e. read part new and part old weights. Guarded, both hazards are
zero; ``guarded=False`` runs the same traffic without the bracket and shows them.
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..backends.vllm import (
    VLLMAsyncBackend,
    VLLMEngineConfig,
    VLLMGeneration,
    greedy_params,
    require_vllm,
)
from ..errors import ShutdownTimeout, TornWeightsError
from ..metrics import summarize
from ..testing import InProcessWorker, RecordingPacker, build_tiny_llama, random_llama_weights
from ..trace import Span, SpanKind, Timeline

__all__ = ["RequestFeeder", "VLLMDemoConfig", "run_vllm_demo"]


@dataclass(frozen=True)
class VLLMDemoConfig:
    syncs: int = 50
    interval_s: float = 0.02
    """Pause of the sync loop between two syncs (generation runs freely meanwhile)."""
    guarded: bool = True
    streams: int = 4
    """Requests kept in flight."""
    max_tokens: int = 48
    send_s: float = 200e-6
    """How long one fake payload send takes."""
    timeout_s: float = 60.0


class _VLLMDemoWorker(InProcessWorker):
    """Writes fresh random weights in two partial loads, so an unguarded sync is visible."""

    rollout: VLLMAsyncBackend

    def write_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.rollout.ensure_initialized()
        specs = self.rollout.weight_specs()
        weights = random_llama_weights({s.name: s.shape for s in specs}, seed=version)
        groups = self.rollout.load_groups()
        ordered = sorted(set(groups.values()))
        first_groups = set(ordered[: len(ordered) // 2])
        first = {n: t for n, t in weights.items() if groups[n] in first_groups}
        second = {n: t for n, t in weights.items() if n not in first}
        self.rollout.load_weights(first, require_all=False)
        self.rollout.load_weights(second, require_all=False)
        self.rollout.commit_weight_version(version)


class RequestFeeder:
    """Keeps ``streams`` requests in flight on a vLLM backend and hands each finished one to
    ``ship`` (on the feeder's thread, in completion order of the oldest first).

    Prompts are short token-id sequences; ``max_tokens(n)`` is the length of the ``n``-th
    request (greedy, EOS ignored). While the weights are torn nothing is submitted (the
    backend refuses); the feeder waits for a sync to land. :meth:`stop` stops submitting,
    waits for the requests in flight and ships them, bounded by ``timeout``.
    """

    def __init__(
        self,
        backend: VLLMAsyncBackend,
        ship: Callable[[VLLMGeneration], None],
        *,
        streams: int,
        max_tokens: Callable[[int], int],
        timeout_s: float,
        adapter: str | None = None,
    ) -> None:
        self.backend, self.ship = backend, ship
        self.streams, self.max_tokens, self.timeout_s = streams, max_tokens, timeout_s
        self.adapter = adapter
        """Every request runs on this LoRA adapter (``None``: on the base model)."""
        self.results: list[VLLMGeneration] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-demo-feeder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """Of the results so far: those that straddled a sync and those that failed."""
        results = list(self.results)
        return {
            "results_straddled_sync": sum(r.ok and r.straddled for r in results),
            "results_failed": sum(not r.ok for r in results),
        }

    def stop(self, timeout: float) -> None:
        """Stop submitting; ship what is in flight. Raises :class:`ShutdownTimeout` after
        ``timeout`` and :class:`RuntimeError` (chained) if the feeder had failed."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ShutdownTimeout(f"the demo's request feeder did not stop within {timeout:.1f} s")
        if self.error is not None:
            raise RuntimeError("the demo's request feeder failed") from self.error

    def _run(self) -> None:
        in_flight: collections.deque[Any] = collections.deque()
        n = 0
        try:
            while in_flight or not self._stop.is_set():
                while not self._stop.is_set() and len(in_flight) < self.streams:
                    n += 1
                    params = greedy_params(self.max_tokens(n))
                    try:
                        prompt = [1 + n % 97, 2 + n % 89, 3]
                        in_flight.append(self.backend.submit(prompt, params, adapter=self.adapter))
                    except TornWeightsError:
                        break
                if not in_flight:
                    self._stop.wait(0.01)  # torn: nothing may be submitted until a sync lands
                    continue
                result = in_flight.popleft().result(self.timeout_s)
                self.results.append(result)
                self.ship(result)
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self.error = exc


def _torn_reads(spans: list[Span], writes_per_sync: int) -> int:
    """Forwards that started inside the write window of one sync (first to last write)."""
    writes = sorted((s for s in spans if s.kind == SpanKind.WEIGHT_WRITE), key=lambda s: s.start_ns)
    windows = [
        (writes[i].start_ns, writes[i + writes_per_sync - 1].end_ns)
        for i in range(0, len(writes) - writes_per_sync + 1, writes_per_sync)
    ]
    forwards = [s for s in spans if s.kind == SpanKind.FORWARD]
    return sum(any(lo < f.end_ns and f.start_ns < hi for lo, hi in windows) for f in forwards)


def run_vllm_demo(
    config: VLLMDemoConfig,
    timeline: Timeline | None = None,
    *,
    backend: VLLMAsyncBackend | None = None,
) -> dict[str, Any]:
    """Run the demo on vLLM and return its report (the in-process demo's keys, and more).

    Without ``backend`` it builds the tiny model in a temporary directory and starts (and
    stops) its own engine; a given ``backend`` must have been built with a timeline.
    Raises :class:`~rollout_sync.backends.vllm.VLLMUnavailableError` without vLLM.
    """
    require_vllm()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with tempfile.TemporaryDirectory(prefix="rollout_sync_vllm_demo_") as tmp:
        own = backend is None
        if backend is None:
            timeline = timeline if timeline is not None else Timeline()
            build_tiny_llama(Path(tmp), seed=0)
            backend = VLLMAsyncBackend(
                VLLMEngineConfig(tmp, dtype="float32", kv_cache_memory_bytes=64 << 20),
                timeline=timeline,
                pause_timeout=config.timeout_s,
            )
        elif backend.timeline is None:
            raise ValueError("run_vllm_demo needs a backend built with a timeline")
        timeline = backend.timeline
        assert timeline is not None
        try:
            return _run(config, backend, timeline)
        finally:
            if own:
                backend.shutdown()


def _run(config: VLLMDemoConfig, backend: VLLMAsyncBackend, timeline: Timeline) -> dict[str, Any]:
    packer = RecordingPacker(
        capacity=32, send_s=config.send_s, timeline=timeline, default_timeout=config.timeout_s
    )
    worker = _VLLMDemoWorker(backend, packer, timeline, config.timeout_s)
    sync = worker.receive_weights if config.guarded else worker.receive_weights_unguarded
    feeder = RequestFeeder(
        backend,
        lambda result: packer.submit(result.token_ids, timeout=config.timeout_s),
        streams=config.streams,
        max_tokens=lambda n: config.max_tokens,
        timeout_s=config.timeout_s,
    )
    packer.start()
    start_ns = time.monotonic_ns()
    started = time.perf_counter()
    try:
        # The first sync starts the engine, inside the bracket; generation begins after it.
        first_version = backend.weight_version + 1
        sync(first_version)
        backend.collect_engine_spans()
        feeder.start()
        for version in range(first_version + 1, first_version + config.syncs):
            sync(version)
            time.sleep(config.interval_s)
    finally:
        try:
            feeder.stop(config.timeout_s * 2)
            packer.wait_sent(timeout=config.timeout_s)
        finally:
            packer.stop()
    wall_s = time.perf_counter() - started
    backend.collect_engine_spans()
    spans = [s for s in timeline.spans() if s.start_ns >= start_ns]
    forwards = [s for s in spans if s.kind == SpanKind.FORWARD and s.name == "forward"]
    egress = [
        o
        for o in timeline.overlaps()
        if o.first.start_ns >= start_ns
        and o.first.kind in (SpanKind.PAYLOAD_SEND, SpanKind.PAYLOAD_RECV)
    ]
    # The first sync started the engine: reported apart, so the percentiles describe syncs.
    first, steady = worker.reports[:1], worker.reports[1:]
    park = summarize([r.park_s for r in steady])
    total = summarize([r.total_s for r in steady])
    results = feeder.results
    return {
        "mode": "vllm",
        "guarded": config.guarded,
        "syncs": len(worker.reports),
        "forwards": len(forwards),
        "torn_reads": _torn_reads(spans, writes_per_sync=2),
        "egress_overlaps": len(egress),
        "payloads_sent": len(packer.sent),
        "generations": len(results),
        "generations_straddled": sum(r.straddled for r in results),
        "generations_failed": sum(not r.ok for r in results),
        "tokens": sum(len(r.token_ids) for r in results),
        "time_to_park_ms_p50": park.p50_ms,
        "time_to_park_ms_p99": park.p99_ms,
        "sync_ms_p50": total.p50_ms,
        "sync_ms_p99": total.p99_ms,
        "engine_start_s": first[0].total_s if first else float("nan"),
        "wall_s": wall_s,
    }
