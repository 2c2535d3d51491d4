"""Weight-transfer throughput: a full P2R + R2R against raw flat broadcasts of the same bytes.

One trainer and ``--replicas`` rollout replicas (processes, gloo on loopback). The model is
``--model-mb`` of many small float32 tensors (``--tensor-kb`` each). In one run, on the same
groups, each iteration measures:

* **raw**: one flat ``broadcast`` of the model's bytes trainer -> replica 1 (the P2R group),
  then replica 1 -> the other replicas (the R2R group). No manifest, no packing: the floor.
* **bucketed (B MB)**: :class:`rollout_sync.WeightTransfer` send/receive, P2R then R2R, for
  every bucket size of the sweep (manifest, validation vote, packing, unpacking, commit vote).
* **per-tensor**: :class:`rollout_sync.trainer.BroadcastWeightPusher`, one broadcast per
  tensor (no manifest, no buckets), P2R then R2R: what the bucketed transfer replaced as
  ``WeightBroadcastCallback``'s default.
* **guarded**: the same through :class:`rollout_sync.RolloutWorker`'s guarded handlers (pause,
  egress hold on a packer, lazy init, fence, version commit) at the default bucket size.
* **raw + copies**: raw plus the time to pack and unpack the model locally (``_foreach_copy_``
  into and out of a flat buffer, once each per hop): the floor of a bucketed transfer when
  nothing overlaps. On a CPU box over loopback the copies cost about as much as the wire; on a
  GPU they run at device-memory speed, far above the wire's.

Each phase starts after a barrier and lasts until its slowest rank is done. Prints a table and
the ratios the targets are about: bucketed bytes/s over raw (target >= 0.9) and guarded time
over unguarded time at the same bucket size (guard overhead, target <= 5%).

    python benchmarks/transfer.py                  # ~100 MB, 3 iterations, ~1 min on 2 cores
    python benchmarks/transfer.py --model-mb 400 --iterations 5 --buckets 4 16 64 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The path is set up above, so a source checkout runs without installing the package.
from rollout_sync import P2R, R2R, RolloutBase, RolloutWorker, TransferConfig, build_sync_groups
from rollout_sync.distributed import init_process_group
from rollout_sync.testing import RecordingPacker, find_free_port, run_processes
from rollout_sync.trainer import BroadcastWeightPusher, CommandKind, WeightSyncCommand


class _IdleRollout(RolloutBase):
    """Serves the model's tensors and generates nothing: the guard's own cost, isolated."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._weights = dict(weights)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self._weights


def _model(model_mb: float, tensor_kb: float, seed: int) -> dict[str, torch.Tensor]:
    numel = max(1, int(tensor_kb * 1024 / 4))
    count = max(1, int(model_mb * (1 << 20) / (numel * 4)))
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.rand(numel, generator=gen) for i in range(count)}


def _timed(fn: Callable[[], object]) -> float:
    """Seconds from a barrier until the slowest rank finished ``fn``."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _bench_process(rank: int, port: int, args: argparse.Namespace) -> dict[str, Any] | None:
    world = args.replicas + 1
    init_process_group(
        rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=args.timeout
    )
    groups = build_sync_groups(0, range(1, world), timeout_s=args.timeout)
    weights = _model(args.model_mb, args.tensor_kb, seed=rank)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    in_p2r, in_r2r = rank in (0, 1), rank >= 1 and groups.r2r is not None

    def raw() -> tuple[float, float]:
        def p2r() -> None:
            if in_p2r:
                dist.broadcast(flat, 0, group=groups.p2r)

        def r2r() -> None:
            if in_r2r:
                dist.broadcast(flat, 1, group=groups.r2r)

        return _timed(p2r), _timed(r2r) if groups.r2r is not None else 0.0

    def bucketed(bucket_mb: float) -> Callable[[], tuple[float, float]]:
        config = TransferConfig(bucket_bytes=int(bucket_mb * (1 << 20)), timeout_s=args.timeout)
        p2r_t = groups.p2r_transfer(config=config)
        r2r_t = groups.r2r_transfer(config=config)
        version = [0]

        def run() -> tuple[float, float]:
            version[0] += 1

            def p2r() -> None:
                if p2r_t is not None:
                    if p2r_t.is_source:
                        p2r_t.send(weights, version=version[0])
                    else:
                        p2r_t.receive(weights)

            def r2r() -> None:
                if r2r_t is not None:
                    if r2r_t.is_source:
                        r2r_t.send(weights, version=version[0])
                    else:
                        r2r_t.receive(weights)

            return _timed(p2r), _timed(r2r) if groups.r2r is not None else 0.0

        return run

    def per_tensor() -> Callable[[], tuple[float, float]]:
        p2r_pusher = BroadcastWeightPusher(groups.p2r, src=0)
        r2r_pusher = BroadcastWeightPusher(groups.r2r, src=1)
        version = [0]

        def hop(pusher: BroadcastWeightPusher, member: bool) -> None:
            if not member:
                return
            if rank == pusher.src:
                pusher.push_weights(weights, version=version[0], timeout=args.timeout)
            else:
                command = WeightSyncCommand(
                    CommandKind.WEIGHTS, version[0], version[0], len(weights), nbytes
                )
                pusher.receive_weights(weights, command, args.timeout)

        def run() -> tuple[float, float]:
            version[0] += 1
            p2r_s = _timed(lambda: hop(p2r_pusher, in_p2r))
            r2r_s = _timed(lambda: hop(r2r_pusher, in_r2r)) if groups.r2r is not None else 0.0
            return p2r_s, r2r_s

        return run

    workers: list[RolloutWorker] = []

    def guarded() -> Callable[[], tuple[float, float]]:
        config = TransferConfig(
            bucket_bytes=int(args.default_bucket_mb * (1 << 20)), timeout_s=args.timeout
        )
        p2r_t = groups.p2r_transfer(config=config)
        r2r_t = groups.r2r_transfer(config=config)
        packer = RecordingPacker()
        worker = RolloutWorker(
            _IdleRollout(weights),
            p2r=p2r_t if rank != 0 else None,
            r2r=r2r_t,
            data_packer=packer,
            weight_sync_timeout=args.timeout,
        )
        workers.append(worker)
        version = [0]

        def run() -> tuple[float, float]:
            version[0] += 1

            def p2r() -> None:
                if rank == 0:
                    assert p2r_t is not None
                    p2r_t.send(weights, version=version[0])
                elif p2r_t is not None:
                    result = worker.handle(P2R())
                    assert result.ok, result.error

            def r2r() -> None:
                if r2r_t is not None:
                    result = worker.handle(R2R())
                    assert result.ok, result.error

            return _timed(p2r), _timed(r2r) if groups.r2r is not None else 0.0

        return run

    def copies() -> tuple[float, float]:
        """Packing the model into a flat buffer and unpacking it again, locally: the memory
        traffic a bucketed transfer adds to the raw broadcast's (one pack on the source, one
        unpack on each receiver)."""

        def pack() -> None:
            if rank == 0:
                torch._foreach_copy_(views, list(weights.values()))

        def unpack() -> None:
            if rank == 0:
                torch._foreach_copy_(list(weights.values()), views)

        return _timed(pack), _timed(unpack)

    offsets = torch.tensor([0] + [t.numel() * 4 for t in weights.values()]).cumsum(0).tolist()
    views = [flat[a:b].view(torch.float32) for a, b in itertools.pairwise(offsets)]
    guarded_run = guarded()
    methods: list[tuple[str, float | None, Callable[[], tuple[float, float]]]] = [
        ("raw broadcast", None, raw),
        ("local pack/unpack", None, copies),
    ]
    methods += [("bucketed", b, bucketed(b)) for b in args.buckets]
    methods.append(("per-tensor", None, per_tensor()))
    methods.append(("guarded", args.default_bucket_mb, guarded_run))
    samples: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(methods))}
    for iteration in range(args.iterations + 1):
        # Interleaved, so drift in machine load hits every method alike.
        for i, (_, _, run) in enumerate(methods):
            result = run()
            if iteration > 0:  # the first round warms up buffers and caches
                samples[i].append(result)
    # The bracket's own time (pause, egress hold, fence, bookkeeping) against the handler's
    # (init, transfer, commit), from the guard's per-sync reports: immune to load noise.
    reports = [r for w in workers for r in w.sync_reports]
    bracket = {
        "bracket_s": sum(r.total_s - r.handler_s for r in reports),
        "handler_s": sum(r.handler_s for r in reports),
        "syncs": len(reports),
    }
    if rank != 0:
        return {"bracket": bracket}
    rows = []
    for i, (name, bucket, _) in enumerate(methods):
        p2r_s = statistics.median(s[0] for s in samples[i])
        r2r_s = statistics.median(s[1] for s in samples[i])
        if name == "local pack/unpack":
            # One pack and one unpack per hop: P2R and R2R each add both.
            rows.append(
                {
                    "method": name,
                    "bucket_mb": None,
                    "p2r_ms": (p2r_s + r2r_s) * 1e3,
                    "r2r_ms": (p2r_s + r2r_s) * 1e3 if groups.r2r is not None else 0.0,
                    "total_ms": 0.0,
                    "mb_per_s": float("nan"),
                }
            )
            continue
        rows.append(
            {
                "method": name,
                "bucket_mb": bucket,
                "p2r_ms": p2r_s * 1e3,
                "r2r_ms": r2r_s * 1e3,
                "total_ms": (p2r_s + r2r_s) * 1e3,
                "mb_per_s": 2 * nbytes / 1e6 / (p2r_s + r2r_s)
                if groups.r2r is not None
                else nbytes / 1e6 / p2r_s,
            }
        )
    return {"nbytes": nbytes, "tensors": len(weights), "rows": rows, "bracket": bracket}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model-mb", type=float, default=100.0)
    parser.add_argument(
        "--tensor-kb",
        type=float,
        default=40.0,
        help="size of each tensor (default 40 KiB: ~2500 tensors per 100 MB)",
    )
    parser.add_argument(
        "--buckets",
        type=float,
        nargs="+",
        default=[1.0, 4.0, 16.0, 64.0],
        help="bucket sizes to sweep, MiB",
    )
    parser.add_argument(
        "--default-bucket-mb",
        type=float,
        default=16.0,
        help="bucket size of the guarded run (compare with the same bucketed)",
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.default_bucket_mb not in args.buckets:
        args.buckets = sorted([*args.buckets, args.default_bucket_mb])

    started = time.perf_counter()
    values = run_processes(
        _bench_process,
        args.replicas + 1,
        (find_free_port(), args),
        timeout_s=args.timeout * 4 + 120,
        what="benchmarks/transfer.py",
        intra_op_threads=1,
    )
    result = values[0]
    rows = result["rows"]
    raw = rows[0]
    copy_row = next(r for r in rows if r["method"] == "local pack/unpack")
    copy_row["total_ms"] = copy_row["p2r_ms"] + copy_row["r2r_ms"]
    floor_ms = raw["total_ms"] + copy_row["total_ms"]
    copy_row["mb_per_s"] = raw["mb_per_s"] * raw["total_ms"] / floor_ms
    copy_row["method"] = "raw + copies"
    bracket_s = sum(v["bracket"]["bracket_s"] for v in values.values() if v)
    handler_s = sum(v["bracket"]["handler_s"] for v in values.values() if v)
    print(
        f"model: {result['nbytes'] / 1e6:.1f} MB in {result['tensors']} tensors; trainer + "
        f"{args.replicas} replicas (gloo, loopback); median of {args.iterations} iterations"
    )
    print(
        f"{'method':<16}{'bucket MB':>10}{'P2R ms':>10}{'R2R ms':>10}{'total ms':>10}"
        f"{'MB/s':>10}{'vs raw':>9}"
    )
    for row in rows:
        bucket = "-" if row["bucket_mb"] is None else f"{row['bucket_mb']:g}"
        print(
            f"{row['method']:<16}{bucket:>10}{row['p2r_ms']:>10.1f}{row['r2r_ms']:>10.1f}"
            f"{row['total_ms']:>10.1f}{row['mb_per_s']:>10.0f}"
            f"{row['mb_per_s'] / raw['mb_per_s']:>9.2f}"
        )
    bucketed = [r for r in rows if r["method"] == "bucketed"]
    best = max(bucketed, key=lambda r: r["mb_per_s"])
    guarded = next(r for r in rows if r["method"] == "guarded")
    same = next(r for r in bucketed if r["bucket_mb"] == guarded["bucket_mb"])
    per_tensor_row = next(r for r in rows if r["method"] == "per-tensor")
    ratios = {
        "best_bucketed_over_raw": best["mb_per_s"] / raw["mb_per_s"],
        "best_bucket_mb": best["bucket_mb"],
        "best_bucketed_over_raw_plus_copies": best["mb_per_s"] / copy_row["mb_per_s"],
        "guarded_over_raw": raw["total_ms"] / guarded["total_ms"],
        "per_tensor_over_bucketed_time": per_tensor_row["total_ms"] / same["total_ms"],
        "guard_overhead": guarded["total_ms"] / same["total_ms"] - 1.0,
        "bracket_overhead": bracket_s / handler_s if handler_s else float("nan"),
    }
    print(
        f"\nbucketed / raw bytes/s (best, {best['bucket_mb']:g} MB buckets): "
        f"{ratios['best_bucketed_over_raw']:.2f}   (target >= 0.9)"
    )
    print(
        f"bucketed / (raw + local pack and unpack copies):  "
        f"{ratios['best_bucketed_over_raw_plus_copies']:.2f}   (how much of the copying the "
        "pipeline hides)"
    )
    print(f"guarded / raw bytes/s:                        {ratios['guarded_over_raw']:.2f}")
    print(
        f"per-tensor broadcast time / bucketed ({same['bucket_mb']:g} MB):   "
        f"{ratios['per_tensor_over_bucketed_time']:.2f}x"
    )
    print(
        f"guard overhead, end to end (guarded / bucketed time - 1, {guarded['bucket_mb']:g} MB):"
        f" {ratios['guard_overhead'] * 100:+.1f}%   (target <= 5%; noisy under load)"
    )
    print(
        f"guard overhead, bracket only (pause + hold + fence / handler time, from the "
        f"SyncReports): {ratios['bracket_overhead'] * 100:.2f}%"
    )
    print(f"wall: {time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "result": result, "ratios": ratios}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
