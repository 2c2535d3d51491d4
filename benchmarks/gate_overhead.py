"""What the guard costs on the generation hot path.

1. An uncontended Gate section enter/exit vs. a bare ``threading.Lock`` acquire/release.
2. Forwards per second of a ThreadedRolloutBackend (every step inside a gate section) vs. the
   same forward in a plain loop on a thread, no sync pending. Rounds alternate A/B so drift on
   a shared machine hits both; the ratio of medians is reported. Target: >= 0.99.

    python benchmarks/gate_overhead.py [--seconds 1.0] [--rounds 5] [--hidden 512]
"""

from __future__ import annotations

import argparse
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
        self.x = torch.randn(8, hidden)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)

    gate, lock = Gate(), threading.Lock()
    n = 200_000
    gate_ns = statistics.median(ns_per_op(gate.enter_section, gate.exit_section, n)
                                for _ in range(5))
    lock_ns = statistics.median(ns_per_op(lock.acquire, lock.release, n) for _ in range(5))
    print(f"uncontended enter+exit: Gate section {gate_ns:7.1f} ns   "
          f"threading.Lock {lock_ns:7.1f} ns   (x{gate_ns / lock_ns:.1f})")

    guarded, unguarded = [], []
    for _ in range(args.rounds):
        unguarded.append(unguarded_rate(args.hidden, args.seconds))
        guarded.append(guarded_rate(args.hidden, args.seconds))
    g, u = statistics.median(guarded), statistics.median(unguarded)
    print(f"forwards/s (MLP hidden={args.hidden}, batch 8, 1 torch thread, "
          f"{args.rounds} alternating rounds of {args.seconds} s):")
    print(f"  guarded (ThreadedRolloutBackend) {g:10.1f}")
    print(f"  unguarded (plain loop)           {u:10.1f}")
    print(f"  ratio guarded/unguarded          {g / u:10.3f}   (target >= 0.99)")


if __name__ == "__main__":
    main()
