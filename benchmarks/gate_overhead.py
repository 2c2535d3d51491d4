"""What the guard costs on the generation hot path.

1. An uncontended Gate section enter/exit vs. a bare ``threading.Lock`` acquire/release.
2. The hot path: one thread interleaves, step by step, a forward inside a gate section, the
   same forward bare, and the forward next to two trivial Python calls (``Event.is_set()``),
   so load bursts hit all three alike. Reported as forwards/s guarded / unguarded (target
   >= 0.99); the third line shows what *any* Python call costs next to a big torch op here
   (cache-cold interpreter), which is most of what the gate costs in context.
3. End to end: forwards/s of a ThreadedRolloutBackend (its serving loop, every step inside a
   gate section) vs. the same forward in a plain loop on a thread, in short alternating rounds;
   the median of the per-pair ratios. Coarser than (2): it also sees thread scheduling noise.

    python benchmarks/gate_overhead.py [--steps 4000] [--seconds 0.25] [--rounds 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Mapping

import torch

from rollout_sync import Gate, ThreadedRolloutBackend


def ns_per_op(fn_enter, fn_exit, n: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter_ns()
    for _ in range(n):
        fn_enter()
        fn_exit()
    return (time.perf_counter_ns() - start) / n


class MLPBackend(ThreadedRolloutBackend):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = {"w1": torch.randn(hidden, hidden), "w2": torch.randn(hidden, hidden)}
        self.x = torch.randn(32, hidden)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights

    def serve_step(self) -> None:
        forward(self.weights, self.x)


def forward(weights: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ weights["w1"]) @ weights["w2"]


def guarded_rate(hidden: int, seconds: float) -> float:
    backend = MLPBackend(hidden)
    backend.start()
    time.sleep(seconds)  # the measurement window
    n = backend.statistics().steps_served
    backend.stop()
    return n / seconds


def unguarded_rate(hidden: int, seconds: float) -> float:
    backend = MLPBackend(hidden)
    stop = threading.Event()
    count = [0]

    def loop() -> None:
        while not stop.is_set():
            forward(backend.weights, backend.x)
            count[0] += 1

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(seconds)  # the measurement window
    n = count[0]
    stop.set()
    t.join()
    return n / seconds


def hot_path_costs(hidden: int, steps: int) -> dict[str, float]:
    """Per-step seconds of the same forward three ways, interleaved step by step on one thread
    (shuffled order), so load bursts on a shared machine hit all three alike."""
    backend = MLPBackend(hidden)
    gate = backend.generation_gate
    flag = threading.Event()

    def unguarded() -> None:
        forward(backend.weights, backend.x)

    def guarded() -> None:
        with gate.section():
            forward(backend.weights, backend.x)

    def two_trivial_calls() -> None:  # the floor: any Python call next to a big torch op
        flag.is_set()
        forward(backend.weights, backend.x)
        flag.is_set()

    variants = {"unguarded": unguarded, "guarded": guarded, "two Event.is_set()": two_trivial_calls}
    totals = dict.fromkeys(variants, 0.0)
    order = list(variants.items())
    rng = random.Random(0)
    for _ in range(steps):
        rng.shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            totals[name] += time.perf_counter() - start
    return {name: total / steps for name, total in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seconds", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--hidden",
        type=int,
        default=1024,
        help="MLP width; the default step (~1 ms) is about one decode step of "
        "the tiny torch LM on this CPU",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    gate, lock = Gate(), threading.Lock()
    n = 200_000
    gate_ns = statistics.median(
        ns_per_op(gate.enter_section, gate.exit_section, n) for _ in range(5)
    )
    lock_ns = statistics.median(ns_per_op(lock.acquire, lock.release, n) for _ in range(5))
    print(
        f"uncontended enter+exit: Gate section {gate_ns:7.1f} ns   "
        f"threading.Lock {lock_ns:7.1f} ns   (x{gate_ns / lock_ns:.1f})"
    )

    costs = hot_path_costs(args.hidden, args.steps)
    u_step = costs["unguarded"]
    print(
        f"hot path, {args.steps} interleaved steps (MLP hidden={args.hidden}, batch 32, "
        "1 torch thread):"
    )
    for name, per_step in costs.items():
        print(
            f"  {name:20s} {per_step * 1e6:9.1f} us/step   (+{(per_step - u_step) * 1e6:5.1f} us)"
        )
    print(
        f"  forwards/s ratio guarded/unguarded  {u_step / costs['guarded']:.4f}   (target >= 0.99)"
    )

    ratios = []
    for i in range(args.rounds):
        if i % 2:
            u = unguarded_rate(args.hidden, args.seconds)
            g = guarded_rate(args.hidden, args.seconds)
        else:
            g = guarded_rate(args.hidden, args.seconds)
            u = unguarded_rate(args.hidden, args.seconds)
        ratios.append(g / u)
    print(
        f"end to end, ThreadedRolloutBackend vs plain thread loop, {args.rounds} alternating "
        f"rounds of {args.seconds} s:"
    )
    print(
        f"  median ratio {statistics.median(ratios):.3f}   "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
