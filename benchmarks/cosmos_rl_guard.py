"""cosmos-rl 0.4.7 unguarded / as shipped / guarded, side by side on the same harnesses.

Three counts, each from cosmos's own classes on CPU (rollout_sync/testing/cosmos_rl.py names
every fake: CUDA streams and events, the NCCL transfers, one package without a CPU build):

1. **Torn generations**: ``--generations`` generations on cosmos's ``RolloutTaskScheduler``
   while syncs land through the real command registry (P2R and R2R alternating), on the
   disaggregated worker and on the colocated one; with a backend that parks at a step
   boundary (``paused()``) and with one that cannot (drained). Also the wait from dispatching
   a sync to its first weight write (park vs drain).
2. **Payload sends overlapping a sync**: a policy consumer fetching payloads from the real
   NCCL payload producer over a real redis-server, while cosmos's ``WeightSyncThread`` runs
   ``--syncs`` transfers (each R2R waiting in cosmos's Redis barrier for a peer).
3. **Requests lost**: requests that never got ACCEPTED in run 2 (a hold defers, never drops).

Run it in the cosmos-rl environment, in one command:
``scripts/cosmos_rl_counts.sh`` (sets up ``.venv-cosmos`` first; ``--json`` for the last line as
JSON), or ``.venv-cosmos/bin/python benchmarks/cosmos_rl_guard.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=40)
    parser.add_argument("--syncs", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    # The harness first: it stubs the one package without a CPU build before cosmos imports.
    from rollout_sync.testing import cosmos_rl as harness

    # isort: split
    from cosmos_rl.rollout.worker.colocated.rollout_control import ColocatedRolloutControlWorker
    from cosmos_rl.utils.logging import logger as cosmos_logger

    cosmos_logger.setLevel(logging.ERROR)

    started = time.perf_counter()
    torn: list[dict[str, Any]] = []
    for worker_cls in (harness.DisaggregatedRolloutControlWorker, ColocatedRolloutControlWorker):
        for park in (True, False):
            for name in harness.VARIANTS:
                torn.append(
                    harness.run_torn_generations(
                        name, generations=args.generations, park=park, worker_cls=worker_cls
                    )
                )
    payload = [harness.run_payload_overlap(name, syncs=args.syncs) for name in harness.VARIANTS]
    wall_s = time.perf_counter() - started

    from rollout_sync.integrations.cosmos_rl import SUPPORTED_VERSION

    print(f"cosmos-rl {SUPPORTED_VERSION}: unguarded / as shipped / guarded ({wall_s:.1f} s)")
    print("\n1. torn generations (of N) on the real scheduler; wait from sync to write, p50 ms")
    for i in range(0, len(torn), 3):
        row = torn[i : i + 3]
        worker = "colocated" if "Colocated" in row[0]["worker"] else "disaggregated"
        backend = "backend parks" if row[0]["backend_park"] else "backend drains"
        counts = " / ".join(f"{r['torn']}/{r['generations']}" for r in row)
        waits = " / ".join(f"{r['wait_to_write_ms_p50']:.2f}" for r in row)
        print(f"  {worker:13} {backend:14}  torn {counts:17}  wait {waits}")
    print("\n2. payload sends overlapping a weight sync (of all sends), real WeightSyncThread")
    counts = " / ".join(f"{r['overlapping_sync']}/{r['sends']}" for r in payload)
    print(
        f"  {counts}  (overlapping the transfer itself: "
        + " / ".join(str(r["overlapping_collective"]) for r in payload)
        + ")"
    )
    print(
        "\n3. payload requests not accepted (lost): "
        + " / ".join(str(r["not_accepted"]) for r in payload)
        + f"; deferred by the guard's holds: {payload[2]['deferred']}"
    )
    if args.json:
        print(
            json.dumps(
                {"torn_generations": torn, "payload_overlap": payload, "wall_s": round(wall_s, 1)}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
