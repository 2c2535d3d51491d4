"""vLLM pause modes and the backend's overhead, on a tiny Llama served by vLLM (CPU build works).

0. Park in decode steps: ``--streams`` requests decoding, ``--parks`` keep-mode pauses at
   random points, each timed from the call to the parked engine; the decode step is the
   interval between consecutive engine forwards of the same run (pauses left out). Two rows
   side by side, alternating: the backend's park flag (the engine's scheduler parks at the next
   step boundary) and vLLM's pause message alone (``park_flag=False``). Reported as multiples
   of the decode step: ``park_steps_p50`` and ``park_steps_p99`` (targets 1 and 2).
1. Time to park and total sync time (pause + weight write + resume) with a long request in
   flight, for vLLM's three pause modes through :class:`VLLMAsyncBackend`:
   ``keep`` (park at the next step boundary; the request continues after the sync),
   ``wait`` (drain: the request must finish first), ``abort`` (the request is ended).
2. Decode tokens/s with no sync pending: raw ``AsyncLLM.generate`` vs the same requests
   through the backend (bookkeeping, versions), and through the backend with forward tracing
   on. Runs alternate, side by side on one engine, so the ratios are fair on a noisy machine.

Run: ``python benchmarks/vllm_pause.py`` (``--runs``, ``--long-tokens``, ``--json``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_sync.backends.vllm import PauseMode, VLLMAsyncBackend, VLLMEngineConfig, greedy_params
from rollout_sync.errors import VLLMUnavailableError
from rollout_sync.metrics import percentile
from rollout_sync.testing.tiny_llama import build_tiny_llama, random_llama_weights
from rollout_sync.trace import SpanKind, step_intervals_ms


def _pause_modes(backend: VLLMAsyncBackend, runs: int, long_tokens: int) -> dict[str, Any]:
    shapes = {s.name: s.shape for s in backend.weight_specs()}
    rows: dict[str, Any] = {}
    for mode in (PauseMode.KEEP, PauseMode.WAIT, PauseMode.ABORT):
        backend.pause_mode = mode
        park_ms: list[float] = []
        sync_ms: list[float] = []
        write_ms: list[float] = []
        endings: list[str] = []
        for _ in range(runs):
            version = backend.weight_version + 1
            weights = random_llama_weights(shapes, seed=version)
            request = backend.submit([1, 2, 3, 4], greedy_params(long_tokens))
            request.wait_for_tokens(16, timeout=120)
            start = time.perf_counter()
            with backend.paused(timeout=120):
                parked = time.perf_counter()
                backend.load_weights(weights)
                backend.commit_weight_version(version)
                written = time.perf_counter()
            end = time.perf_counter()
            park_ms.append((parked - start) * 1e3)
            write_ms.append((written - parked) * 1e3)
            sync_ms.append((end - start) * 1e3)
            result = request.result(timeout=300)
            endings.append(f"{result.finish_reason}/{len(result.token_ids)}")
        rows[mode.value] = {
            "park_ms_p50": percentile(park_ms, 50),
            "park_ms_max": max(park_ms),
            "write_ms_p50": percentile(write_ms, 50),
            "sync_ms_p50": percentile(sync_ms, 50),
            "sync_ms_max": max(sync_ms),
            "request_end": statistics.mode(endings),
        }
    backend.pause_mode = PauseMode.KEEP
    return rows


def _park_in_steps(backend: VLLMAsyncBackend, parks: int, streams: int) -> dict[str, Any]:
    """Keep-mode parks while ``streams`` requests decode, with and without the park flag
    (alternating); the decode step from the engine's forwards of the same window."""
    assert backend.timeline is not None
    backend.pause_mode = PauseMode.KEEP
    requests = [backend.submit([9 + i, 8, 7, 6], greedy_params(100_000)) for i in range(streams)]
    park_ms: dict[bool, list[float]] = {True: [], False: []}
    lead = requests[0]
    try:
        lead.wait_for_tokens(8, timeout=120)
        backend.collect_engine_spans()
        started_ns = time.monotonic_ns()
        for i in range(2 * parks):
            flagged = i % 2 == 0
            backend.park_flag = flagged
            # A few steps of free decoding, then a park at an unsynchronized moment.
            lead.wait_for_tokens(len(lead.tokens()) + 3 + i % 4, timeout=120)
            start = time.perf_counter()
            with backend.paused(timeout=120):
                park_ms[flagged].append((time.perf_counter() - start) * 1e3)
        backend.collect_engine_spans()
    finally:
        backend.park_flag = True
        for request in requests:
            backend.abort(request)
    spans = [s for s in backend.timeline.spans() if s.start_ns >= started_ns]
    forwards = [s for s in spans if s.kind == SpanKind.FORWARD and s.name == "forward"]
    pauses = [s for s in spans if s.kind == SpanKind.PAUSE]
    step = percentile(step_intervals_ms(forwards, gaps=pauses), 50)
    rows: dict[str, Any] = {"decode_step_ms_p50": step}
    for flagged, prefix in ((True, "keep"), (False, "vllm_message")):
        p50, p99 = percentile(park_ms[flagged], 50), percentile(park_ms[flagged], 99)
        rows.update(
            {
                f"{prefix}_park_ms_p50": p50,
                f"{prefix}_park_ms_p99": p99,
                f"{prefix}_park_steps_p50": p50 / step,
                f"{prefix}_park_steps_p99": p99 / step,
            }
        )
    return rows


def _throughput(backend: VLLMAsyncBackend, runs: int, streams: int, tokens: int) -> dict[str, Any]:
    engine = backend.engine
    prompts = [[5 + i, 6, 7, 8] for i in range(streams)]
    params = greedy_params(tokens)
    counter = iter(range(10**9))

    async def raw() -> int:
        async def one(prompt: list[int]) -> int:
            from vllm.inputs import TokensPrompt

            last = None
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"raw-{next(counter)}"
            ):
                last = out
            assert last is not None
            return len(last.outputs[0].token_ids)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    def run_raw() -> float:
        start = time.perf_counter()
        n = backend.run_on_loop(raw(), 300, "raw generate")
        return n / (time.perf_counter() - start)

    def run_backend() -> float:
        start = time.perf_counter()
        results = backend.generate(prompts, params, timeout=300)
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)

    def run_traced() -> float:
        backend.set_engine_tracing(True)
        try:
            return run_backend()
        finally:
            backend.set_engine_tracing(False)
            backend.collect_engine_spans()

    cases = {"raw": run_raw, "backend": run_backend, "backend+trace": run_traced}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    backend.set_engine_tracing(False)
    run_backend()  # warm-up
    names = list(cases)
    for i in range(runs):
        # Rotate the order so that drift in the machine's load does not favour one case.
        for name in names[i % 3 :] + names[: i % 3]:
            samples[name].append(cases[name]())
    rates: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()}
    # Ratios run by run (each from three adjacent measurements), then the median: robust to
    # load that drifts over the benchmark.
    for name in ("backend", "backend+trace"):
        rates[f"{name}/raw"] = statistics.median(
            b / r for b, r in zip(samples[name], samples["raw"], strict=True)
        )
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="repetitions per case (default 7)")
    parser.add_argument(
        "--long-tokens",
        type=int,
        default=480,
        help="tokens of the long request in flight (default 480)",
    )
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests, tokens/s")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request, tokens/s")
    parser.add_argument(
        "--parks", type=int, default=60, help="keep-mode parks per row, park in steps (default 60)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)

    from rollout_sync import Timeline

    with tempfile.TemporaryDirectory(prefix="vllm_pause_bench_") as tmp:
        build_tiny_llama(Path(tmp), seed=0)
        try:
            backend = VLLMAsyncBackend(
                VLLMEngineConfig(tmp, dtype="float32", kv_cache_memory_bytes=64 << 20),
                timeline=Timeline(),
                pause_timeout=120.0,
            )
        except VLLMUnavailableError as exc:
            print(exc, file=sys.stderr)
            return 2
        with backend:
            steps = _park_in_steps(backend, args.parks, args.streams)
            modes = _pause_modes(backend, args.runs, args.long_tokens)
            rates = _throughput(backend, args.runs, args.streams, args.tokens)

    step = steps["decode_step_ms_p50"]
    print(
        f"Keep-mode park, {args.streams} requests decoding, {args.parks} parks per row "
        f"(decode step p50 {step:.2f} ms)"
    )
    print(f"{'park by':<14}{'p50 ms':>9}{'p99 ms':>9}{'p50 steps':>11}{'p99 steps':>11}")
    for prefix, label in (("keep", "flag+message"), ("vllm_message", "message only")):
        print(
            f"{label:<14}{steps[prefix + '_park_ms_p50']:>9.2f}"
            f"{steps[prefix + '_park_ms_p99']:>9.2f}"
            f"{steps[prefix + '_park_steps_p50']:>11.2f}{steps[prefix + '_park_steps_p99']:>11.2f}"
        )
    print()
    print(
        f"Pause modes, a {args.long_tokens}-token request in flight, {args.runs} runs "
        "(ms; sync = pause + verified weight write + resume)"
    )
    print(
        f"{'mode':<7}{'park p50':>10}{'park max':>10}{'write p50':>11}{'sync p50':>10}"
        f"{'sync max':>10}  request ends (reason/tokens)"
    )
    for mode, row in modes.items():
        print(
            f"{mode:<7}{row['park_ms_p50']:>10.1f}{row['park_ms_max']:>10.1f}"
            f"{row['write_ms_p50']:>11.1f}{row['sync_ms_p50']:>10.1f}{row['sync_ms_max']:>10.1f}"
            f"  {row['request_end']}"
        )
    print()
    print(
        f"Decode tokens/s, {args.streams} requests x {args.tokens} tokens, no sync pending "
        f"(median of {args.runs})"
    )
    for name in ("raw", "backend", "backend+trace"):
        print(f"{name:<15}{rates[name]:>10.1f}")
    keep, wait = modes["keep"], modes["wait"]
    ratios = {
        "wait_park_over_keep_park": wait["park_ms_p50"] / keep["park_ms_p50"],
        "wait_sync_over_keep_sync": wait["sync_ms_p50"] / keep["sync_ms_p50"],
        "backend_over_raw_tokens_per_s": rates["backend/raw"],
        "traced_backend_over_raw_tokens_per_s": rates["backend+trace/raw"],
    }
    print()
    for name, value in ratios.items():
        print(f"{name:<40}{value:>8.3f}")
    summary = {
        "keep_park_ms_p50": steps["keep_park_ms_p50"],
        "keep_park_ms_p99": steps["keep_park_ms_p99"],
        "decode_step_ms_p50": step,
        "park_steps_p50": steps["keep_park_steps_p50"],
        "park_steps_p99": steps["keep_park_steps_p99"],
    }
    print(
        f"park_steps_p50 {summary['park_steps_p50']:.2f} (target <= 1), park_steps_p99 "
        f"{summary['park_steps_p99']:.2f} (target <= 2)"
    )
    if args.json:
        print(
            json.dumps(
                {**summary, "park": steps, "modes": modes, "tokens_per_s": rates, "ratios": ratios}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
