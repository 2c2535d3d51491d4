"""Learning with in-flight weight updates: does updating weights while generation runs keep
learning intact, and keep the replicas busy?

The main job's learning loop (``rollout-sync demo --learn``; docs/learning.md) on one task and
one trainer-step budget (``--steps`` training steps of the same number of groups), three ways,
side by side, over ``--seeds`` seeds:

* ``sync``: synchronous, on-policy. Each replica generates its share of a step's groups on the
  version it serves, ships them, and waits idle for the next version; the trainer's step waits
  for the whole batch, so every request in flight has finished (drained) before it trains and
  syncs (in place, ``--mode sync``).
* ``inflight``: generation runs through training steps and syncs; the replicas stage each
  version and park only to install it (``--staged``); the loss weights each token by its
  truncated importance ratio and drops sequences more than ``--max-staleness`` versions old.
* ``inflight_no_is``: the same, the loss ignoring the behaviour log-probabilities.

A run's final reward is its ``reward_last`` (the mean reward over the last fifth of its steps).
JSON keys: ``final_reward_sync``, ``final_reward_inflight``, ``final_reward_inflight_no_is``
(means over the seeds), ``final_reward_ratio`` (in-flight over synchronous),
``idle_fraction_sync``, ``idle_fraction_inflight``, ``idle_fraction_ratio`` (in-flight over
synchronous: the share of the run a replica was parked or had nothing to generate),
``tokens_per_s_ratio`` (in-flight over synchronous; reported, not targeted: on two shared cores
the trainer and the replicas compete for the same CPUs), ``staleness_p99`` (the in-flight runs'
largest), ``torn_reads`` (all runs), ``bit_identical`` (all runs), ``seeds`` and every run's
row. Targets: ``final_reward_ratio`` >= 0.9, ``idle_fraction_ratio`` <= 0.3.

    python benchmarks/learn.py [--seeds 3] [--steps 40] [--replicas 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from rollout_sync.backends.torch_lm import TinyLMConfig
from rollout_sync.demos.distributed import run_distributed_demo
from rollout_sync.demos.job import DistributedDemoConfig
from rollout_sync.learn import LearnConfig
from rollout_sync.sync.mode import SyncMode

ARMS = {
    "sync": (SyncMode.SYNC, {"inflight": False}),
    "inflight": (SyncMode.STAGED, {"inflight": True}),
    "inflight_no_is": (SyncMode.STAGED, {"inflight": True, "importance_weights": False}),
}
ROW_KEYS = (
    "reward_first",
    "reward_last",
    "replica_idle_fraction",
    "tokens_per_s",
    "staleness_p50",
    "staleness_p99",
    "tokens_dropped_stale",
    "importance_weight_p99",
    "clipped_fraction",
    "changed_fraction_p50",
    "torn_reads",
    "bit_identical",
    "wall_s",
)


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    mode, learn = ARMS[arm]
    config = DistributedDemoConfig(
        replicas=args.replicas,
        steps=args.steps,
        mode=mode,
        seed=seed,
        model=TinyLMConfig(dtype=torch.bfloat16, seed=seed),
        learn=dataclasses.replace(LearnConfig(max_staleness=args.max_staleness), **learn),
    )
    report = run_distributed_demo(config)
    return {"arm": arm, "seed": seed, **{k: report[k] for k in ROW_KEYS}}


def mean(rows: list[dict[str, Any]], arm: str, key: str) -> float:
    return statistics.fmean(r[key] for r in rows if r["arm"] == arm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    parser.add_argument(
        "--max-staleness", type=int, default=LearnConfig.max_staleness, help="in-flight arms"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 5:
        raise SystemExit("--seeds must be at least 1 and --steps at least 5")
    started = time.monotonic()
    rows = []
    print(
        f"{'arm':<16}{'seed':>5}{'reward first':>14}{'last':>7}{'idle':>7}{'tok/s':>8}"
        f"{'stale p99':>10}{'dropped':>9}{'torn':>6}"
    )
    for seed in range(args.seeds):
        for arm in ARMS:
            row = run_arm(arm, seed, args)
            rows.append(row)
            print(
                f"{arm:<16}{seed:>5}{row['reward_first']:>14.3f}{row['reward_last']:>7.3f}"
                f"{row['replica_idle_fraction']:>7.3f}{row['tokens_per_s']:>8.0f}"
                f"{row['staleness_p99']:>10.1f}{row['tokens_dropped_stale']:>9}"
                f"{row['torn_reads']:>6}",
                flush=True,
            )
    result = {
        "final_reward_sync": mean(rows, "sync", "reward_last"),
        "final_reward_inflight": mean(rows, "inflight", "reward_last"),
        "final_reward_inflight_no_is": mean(rows, "inflight_no_is", "reward_last"),
        "idle_fraction_sync": mean(rows, "sync", "replica_idle_fraction"),
        "idle_fraction_inflight": mean(rows, "inflight", "replica_idle_fraction"),
        "tokens_per_s_sync": mean(rows, "sync", "tokens_per_s"),
        "tokens_per_s_inflight": mean(rows, "inflight", "tokens_per_s"),
        "staleness_p99": max(r["staleness_p99"] for r in rows if r["arm"] != "sync"),
        "torn_reads": sum(r["torn_reads"] for r in rows),
        "bit_identical": all(r["bit_identical"] for r in rows),
        "seeds": list(range(args.seeds)),
        "steps": args.steps,
        "replicas": args.replicas,
        "max_staleness": args.max_staleness,
        "wall_s": time.monotonic() - started,
    }
    result["final_reward_ratio"] = result["final_reward_inflight"] / result["final_reward_sync"]
    result["idle_fraction_ratio"] = result["idle_fraction_inflight"] / result["idle_fraction_sync"]
    result["tokens_per_s_ratio"] = result["tokens_per_s_inflight"] / result["tokens_per_s_sync"]
    result["runs"] = rows
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    targets = result["final_reward_ratio"] >= 0.9 and result["idle_fraction_ratio"] <= 0.3
    print(
        f"final_reward_ratio {result['final_reward_ratio']:.3f} (target >= 0.9), "
        f"idle_fraction_ratio {result['idle_fraction_ratio']:.3f} (target <= 0.3): "
        + ("met" if targets else "MISSED")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["torn_reads"] == 0 and result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
