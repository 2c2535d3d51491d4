"""Time to park stream generation: step-boundary park vs drain, and what the guard costs.

Runs :class:`~rollout_sync.backends.torch_lm.TorchLMStreamBackend` (the tiny torch LM under
:class:`~rollout_sync.RolloutTaskScheduler`) on its own thread with generations of mixed length
kept in flight, and times many weight syncs:

1. **Time to park**: from entering ``paused()`` until generation is parked, for the default
   step-boundary park and for drain (``wait_for_active_tasks=True``); p50/p99 of each, next to
   the decode step time (target: step-boundary park p99 within one decode step).
2. **Guard overhead**: decode tokens/s of the scheduler with steps inside the gate vs. without
   the gate (``guard_steps=False``), no sync pending, the same workload alternated in one run
   (target: ratio >= 0.99).

Usage: ``python benchmarks/pause_latency.py [--syncs 100] [--drain-syncs 20] [--rounds 5]``
(defaults run in well under 30 s). torch runs single-threaded (``--torch-threads``): a model
this small only loses from intra-op threads.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Run from a checkout without installing: import this repository's package, not another copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from rollout_sync import Gate, RolloutTaskScheduler, Timeline
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMStreamBackend, tiny_lm_weights
from rollout_sync.metrics import summarize
from rollout_sync.scheduler import SCHEDULER_STEP_SPAN


def _wait_steps(scheduler: RolloutTaskScheduler, steps: int, timeout: float = 30.0) -> None:
    """Poll until the scheduler has run ``steps`` decode steps in all."""
    deadline = time.monotonic() + timeout
    while scheduler.statistics().steps < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: the scheduler did not reach {steps} steps")
        time.sleep(0.0002)


def park_latency(
    config: TinyLMConfig,
    *,
    syncs: int,
    drain: bool,
    max_concurrent: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> dict[str, float]:
    """Run ``syncs`` syncs against a loaded scheduler; time each park."""
    rng = random.Random(seed)
    timeline = Timeline()
    backend = TorchLMStreamBackend(config, max_concurrent=max_concurrent, timeline=timeline)
    weight_sets = [tiny_lm_weights(config, 1000 + i) for i in range(2)]
    scheduler = backend.scheduler
    park_s: list[float] = []
    in_flight: list[int] = []
    backend.start()
    try:
        for version in range(1, syncs + 1):
            backlog = scheduler.statistics()
            for _ in range(2 * max_concurrent - backlog.queued - backlog.active):
                prompt = [rng.randrange(config.vocab_size) for _ in range(rng.randint(2, 16))]
                backend.put(prompt, max_new_tokens=rng.randint(min_tokens, max_tokens))
            # Let a few steps run so the pause lands on generation in full flight, at a random
            # point of a step.
            _wait_steps(scheduler, scheduler.statistics().steps + rng.randint(2, 4))
            time.sleep(rng.uniform(0, 1e-3))  # a random phase within the step, on purpose
            with scheduler.paused(timeout=60, wait_for_active_tasks=drain) as park:
                backend.load_weights(weight_sets[version % 2])
                backend.commit_weight_version(version)
            park_s.append(park.park_s)
            in_flight.append(park.in_flight)
    finally:
        backend.stop(timeout=60)
    steps_s = [s.duration_s for s in timeline.spans(SCHEDULER_STEP_SPAN)]
    parks = summarize(park_s)
    step = summarize(steps_s)
    return {
        "park_p50_ms": parks.p50_ms,
        "park_p99_ms": parks.p99_ms,
        "park_max_ms": parks.max_ms,
        "step_p50_ms": step.p50_ms,
        "step_p99_ms": step.p99_ms,
        "in_flight_mean": statistics.fmean(in_flight),
    }


def throughput(
    config: TinyLMConfig, *, guard_steps: bool, requests: int, tokens: int, max_concurrent: int
) -> float:
    """Decode tokens/s of one scheduler run to completion, no sync pending."""
    backend = TorchLMStreamBackend(config, max_concurrent=max_concurrent)
    backend.ensure_initialized()
    scheduler = RolloutTaskScheduler(
        backend,
        max_concurrent=max_concurrent,
        gate=backend.generation_gate,
        guard_steps=guard_steps,
    )
    rng = random.Random(1)
    for _ in range(requests):
        scheduler.put([rng.randrange(config.vocab_size) for _ in range(8)], max_new_tokens=tokens)
    started = time.perf_counter()
    scheduler.start()
    scheduler.wait_idle(120)
    elapsed = time.perf_counter() - started
    scheduler.stop()
    produced = sum(len(r.tokens) for r in scheduler.get_all())
    assert produced == requests * tokens
    return produced / elapsed


def interleaved_decode_rate(
    config: TinyLMConfig, *, steps: int, tokens: int, max_concurrent: int, control: bool = False
) -> tuple[float, float, float]:
    """Guarded vs unguarded decode steps, alternated step by step in one run.

    Driven by hand, in pairs of adjacent steps, one with the guard (side A) and one without
    (side B), the order flipping every pair (A B, B A, ...) so that neither side always gets the
    step with the longer cache. Both sides see the same batches and the same machine noise;
    pairs with an admission (a prefill) are left out. ``control=True`` guards side B too: an
    A/A run whose ratio is the measurement's noise floor.

    Returns ``(A tokens/s, B tokens/s, median over pairs of B step time / A step time)``; the
    last is the A/B throughput ratio, robust to a step that the OS preempted.
    """
    backend = TorchLMStreamBackend(config, max_concurrent=max_concurrent)
    scheduler = backend.scheduler
    rng = random.Random(2)
    spent = {"A": 0.0, "B": 0.0}
    made = {"A": 0, "B": 0}
    ratios: list[float] = []
    for pair in range(steps // 2):
        times: dict[str, float] = {}
        admitted = False
        for side in ("A", "B") if pair % 2 == 0 else ("B", "A"):
            while scheduler.statistics().queued < max_concurrent:
                scheduler.put(
                    [rng.randrange(config.vocab_size) for _ in range(8)], max_new_tokens=tokens
                )
            scheduler.guard_steps = side == "A" or control
            report = scheduler.step()
            admitted = admitted or report.admitted > 0
            times[side] = report.duration_s
            if report.admitted == 0:
                spent[side] += report.duration_s
                made[side] += report.decoded
            scheduler.get_all()
        if not admitted:
            ratios.append(times["B"] / times["A"])
    return made["A"] / spent["A"], made["B"] / spent["B"], statistics.median(ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=100, help="step-boundary syncs")
    parser.add_argument("--drain-syncs", type=int, default=20, help="drain syncs (slow)")
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds per variant")
    parser.add_argument(
        "--interleaved-steps",
        type=int,
        default=2000,
        help="steps of the step-by-step alternated throughput measurement",
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    config = TinyLMConfig()
    print(
        f"tiny LM: {config.n_layers} layers, d_model {config.d_model}, vocab "
        f"{config.vocab_size}; max_concurrent {args.max_concurrent}; generations of "
        f"{args.min_tokens}..{args.max_tokens} tokens; torch threads {args.torch_threads}\n"
    )

    def parks(syncs: int, drain: bool) -> dict[str, float]:
        return park_latency(
            config,
            syncs=syncs,
            drain=drain,
            max_concurrent=args.max_concurrent,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            seed=0,
        )

    boundary = parks(args.syncs, drain=False)
    drained = parks(args.drain_syncs, drain=True)
    print("time to park (paused() entry -> parked)")
    print(
        f"{'mode':<15} {'syncs':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} "
        f"{'in flight':>10} {'step p50':>9} {'step p99':>9}"
    )
    for name, n, r in (
        ("step boundary", args.syncs, boundary),
        ("drain", args.drain_syncs, drained),
    ):
        print(
            f"{name:<15} {n:>6} {r['park_p50_ms']:>9.3f} {r['park_p99_ms']:>9.3f} "
            f"{r['park_max_ms']:>9.3f} {r['in_flight_mean']:>10.1f} {r['step_p50_ms']:>9.3f} "
            f"{r['step_p99_ms']:>9.3f}"
        )
    print(
        f"\nstep-boundary park p99 / decode step p99: "
        f"{boundary['park_p99_ms'] / boundary['step_p99_ms']:.2f}  (target <= 1); "
        f"/ decode step p50: {boundary['park_p99_ms'] / boundary['step_p50_ms']:.2f}"
    )
    print(
        f"drain park p50 / step-boundary park p50: "
        f"{drained['park_p50_ms'] / boundary['park_p50_ms']:.1f}x"
    )

    requests, tokens = 4 * args.max_concurrent, 64

    def tokens_per_s(guard_steps: bool) -> float:
        return throughput(
            config,
            guard_steps=guard_steps,
            requests=requests,
            tokens=tokens,
            max_concurrent=args.max_concurrent,
        )

    tokens_per_s(True)  # warm-up
    guarded: list[float] = []
    unguarded: list[float] = []
    for _ in range(args.rounds):
        guarded.append(tokens_per_s(True))
        unguarded.append(tokens_per_s(False))
    g, u = statistics.median(guarded), statistics.median(unguarded)
    g_best, u_best = max(guarded), max(unguarded)
    print(
        f"\ndecode throughput, no sync pending ({args.rounds} alternated rounds, "
        f"{requests} x {tokens} tokens)"
    )
    print(f"{'':<15} {'median':>10} {'best':>10}")
    print(f"{'guarded':<15} {g:>10.0f} {g_best:>10.0f} tokens/s")
    print(f"{'unguarded':<15} {u:>10.0f} {u_best:>10.0f} tokens/s")
    print(
        f"guarded / unguarded: median {g / u:.3f}, best {g_best / u_best:.3f}  "
        "(end-to-end runs carry the machine's noise)"
    )
    ig, iu, paired = interleaved_decode_rate(
        config, steps=args.interleaved_steps, tokens=tokens, max_concurrent=args.max_concurrent
    )
    _, _, floor = interleaved_decode_rate(
        config,
        steps=args.interleaved_steps,
        tokens=tokens,
        max_concurrent=args.max_concurrent,
        control=True,
    )
    print(
        f"\ndecode steps alternated guarded/unguarded in one run ({args.interleaved_steps} "
        "steps in G-U / U-G pairs, prefill pairs excluded)"
    )
    print(f"{'guarded':<15} {ig:>10.0f} tokens/s")
    print(f"{'unguarded':<15} {iu:>10.0f} tokens/s")
    print(
        f"guarded / unguarded: {paired:.3f} (median over pairs; {ig / iu:.3f} from the "
        "totals)  (target >= 0.99)"
    )
    print(f"A/A control, both sides guarded: {floor:.3f} (the noise floor of that ratio)")
    cost = gate_section_cost_s()
    step = boundary["step_p50_ms"] / 1e3
    print(
        f"gate section enter+exit: {cost * 1e6:.2f} us per step vs a {step * 1e3:.3f} ms "
        f"step: guard cost bound {step / (step + cost):.4f}"
    )
    return 0


def gate_section_cost_s(n: int = 100_000) -> float:
    """Seconds one uncontended section (enter + exit) costs: the guard's whole per-step price."""
    gate = Gate("benchmark")
    started = time.perf_counter()
    for _ in range(n):
        gate.enter_section()
        gate.exit_section()
    return (time.perf_counter() - started) / n


if __name__ == "__main__":
    sys.exit(main())
