"""Weight-transfer throughput: P2R + R2R, each step of the fast path, against raw broadcasts.

One trainer and ``--replicas`` rollout replicas (processes, gloo on loopback). The model is
``--model-mb`` of many small float32 tensors (``--tensor-kb`` each). In one run, on the same
groups, interleaved, each iteration measures:

* **raw**: one flat ``broadcast`` of the model's bytes trainer -> replica 1 (the P2R group),
  then replica 1 -> the other replicas (the R2R group). No manifest, no packing: the baseline.
* **raw + copies**: raw plus packing and unpacking the model locally (``_foreach_copy_`` into
  and out of a flat buffer, once each per hop), timed separately and added: the floor of a
  staged transfer when nothing overlaps.
* **bucketed** (B MB): :class:`rollout_sync.WeightTransfer` send / receive, P2R then R2R, every
  bucket staged (``zero_copy=False``), for each bucket size of the sweep.
* **zero-copy**: the replicas' weights live in flat storage
  (:class:`rollout_sync.flat.FlatWeights`): buckets are received straight into it and the R2R
  is sent straight from it. The trainer still packs (its weights are module parameters), with
  packing overlapping its sends.
* **pipelined**: staged, but replica 1 relays (:meth:`rollout_sync.WeightTransfer.relay`):
  bucket k goes on to the R2R group while bucket k + 1 arrives. P2R and R2R overlap, so only
  the total is measured.
* **pipelined + zero-copy**: both; sweeps the bucket sizes.
* **all flat**: both, and the trainer's weights in flat storage too: no copy anywhere.
* **per-tensor**: :class:`rollout_sync.trainer.BroadcastWeightPusher`, one broadcast per tensor.
* **guarded**: pipelined + zero-copy through :class:`rollout_sync.RolloutWorker`'s guarded
  handlers (pause, egress hold on a packer, lazy init, fence, version commit):
  ``P2R(relay=True)`` on replica 1, ``R2R`` on the others, a backend that declares its flat
  storage.

Each phase starts after a barrier and lasts until its slowest rank is done. The ``CPU``
column is the CPU time every process used in the phase (all threads: copies, gloo's socket
work) over the wall time times the machine's cores: near 100 % the cores, not the protocol,
bound the transfer. Prints a table, the ratios the targets are about, and as the last line one
JSON object.

    python benchmarks/transfer.py                  # ~100 MB, 5 iterations, ~25 s on 2 cores
    python benchmarks/transfer.py --model-mb 400 --iterations 5 --buckets 4 16 64 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The path is set up above, so a source checkout runs without installing the package.
from rollout_sync import P2R, R2R, RolloutWorker, TransferConfig, build_sync_groups
from rollout_sync.distributed import init_process_group
from rollout_sync.flat import FlatWeights
from rollout_sync.testing import IdleFlatRollout, RecordingPacker, find_free_port, run_processes
from rollout_sync.trainer import BroadcastWeightPusher, CommandKind, WeightSyncCommand


def _model(model_mb: float, tensor_kb: float, seed: int) -> dict[str, torch.Tensor]:
    numel = max(1, int(tensor_kb * 1024 / 4))
    count = max(1, int(model_mb * (1 << 20) / (numel * 4)))
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.rand(numel, generator=gen) for i in range(count)}


@dataclass(frozen=True)
class _Sample:
    p2r_s: float | None
    """The P2R hop alone (``None`` where the hops overlap)."""
    r2r_s: float | None
    total_s: float
    cpu_s: float
    """CPU seconds of every process during the phases."""


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds from a barrier until the slowest rank finished ``fn``, CPU seconds of all)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    took = torch.tensor(
        [time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64
    )
    wall = took[:1].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu_all = took[1:].clone()
    dist.all_reduce(cpu_all, op=dist.ReduceOp.SUM)
    return float(wall.item()), float(cpu_all.item())


def _two_hops(p2r: Callable[[], object], r2r: Callable[[], object] | None) -> _Sample:
    p2r_s, p2r_cpu = _timed(p2r)
    if r2r is None:
        return _Sample(p2r_s, 0.0, p2r_s, p2r_cpu)
    r2r_s, r2r_cpu = _timed(r2r)
    return _Sample(p2r_s, r2r_s, p2r_s + r2r_s, p2r_cpu + r2r_cpu)


def _one_phase(fn: Callable[[], object]) -> _Sample:
    total, cpu = _timed(fn)
    return _Sample(None, None, total, cpu)


def _bench_process(rank: int, port: int, args: argparse.Namespace) -> dict[str, Any] | None:
    world = args.replicas + 1
    init_process_group(
        rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=args.timeout
    )
    groups = build_sync_groups(0, range(1, world), timeout_s=args.timeout)
    weights = _model(args.model_mb, args.tensor_kb, seed=rank)
    flat_weights = FlatWeights.copy_of(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    in_p2r, in_r2r = rank in (0, 1), rank >= 1 and groups.r2r is not None
    version = itertools.count(1)

    def raw() -> _Sample:
        def p2r() -> None:
            if in_p2r:
                dist.broadcast(flat, 0, group=groups.p2r)

        def r2r() -> None:
            if in_r2r:
                dist.broadcast(flat, 1, group=groups.r2r)

        return _two_hops(p2r, r2r if groups.r2r is not None else None)

    offsets = torch.tensor([0] + [t.numel() * 4 for t in weights.values()]).cumsum(0).tolist()
    views = [flat[a:b].view(torch.float32) for a, b in itertools.pairwise(offsets)]

    def copies() -> _Sample:
        """Pack and unpack the model once, locally, on one rank: the memory traffic a staged
        hop adds to the raw broadcast's (one pack on its source, one unpack per receiver)."""

        def pack_unpack() -> None:
            if rank == 0:
                torch._foreach_copy_(views, list(weights.values()))
                torch._foreach_copy_(list(weights.values()), views)

        one_hop = _one_phase(pack_unpack)
        hops = 2 if groups.r2r is not None else 1
        return _Sample(one_hop.total_s, one_hop.total_s, hops * one_hop.total_s, one_hop.cpu_s)

    def transfer(
        bucket_mb: float, *, pipelined: bool, zero_copy: bool, flat_trainer: bool = False
    ) -> Callable[[], _Sample]:
        config = TransferConfig(
            bucket_bytes=int(bucket_mb * (1 << 20)), timeout_s=args.timeout, zero_copy=zero_copy
        )
        p2r_t = groups.p2r_transfer(config=config)
        r2r_t = groups.r2r_transfer(config=config)
        if rank == 0:
            use_flat = flat_trainer
        else:
            use_flat = zero_copy
        tensors = flat_weights.tensors if use_flat else weights
        storage = flat_weights.storage if use_flat else None

        def p2r() -> None:
            if p2r_t is None:
                return
            if p2r_t.is_source:
                p2r_t.send(tensors, version=next(version), storage=storage)
            elif pipelined and r2r_t is not None:
                p2r_t.relay(tensors, r2r_t, storage=storage)
            else:
                p2r_t.receive(tensors, storage=storage)

        def r2r() -> None:
            if r2r_t is None:
                return
            if r2r_t.is_source:
                r2r_t.send(tensors, version=1, storage=storage)
            else:
                r2r_t.receive(tensors, storage=storage)

        def run() -> _Sample:
            if groups.r2r is None:
                return _two_hops(p2r, None)
            if not pipelined:
                return _two_hops(p2r, r2r)

            def both() -> None:
                if rank == 0 or (r2r_t is not None and r2r_t.is_source):
                    p2r()
                else:
                    r2r()

            return _one_phase(both)

        return run

    def per_tensor() -> Callable[[], _Sample]:
        p2r_pusher = BroadcastWeightPusher(groups.p2r, src=0)
        r2r_pusher = BroadcastWeightPusher(groups.r2r, src=1)

        def hop(pusher: BroadcastWeightPusher, member: bool) -> None:
            if not member:
                return
            if rank == pusher.src:
                pusher.push_weights(weights, version=1, timeout=args.timeout)
            else:
                command = WeightSyncCommand(CommandKind.WEIGHTS, 1, 1, len(weights), nbytes)
                pusher.receive_weights(weights, command, args.timeout)

        def run() -> _Sample:
            return _two_hops(
                lambda: hop(p2r_pusher, in_p2r),
                (lambda: hop(r2r_pusher, in_r2r)) if groups.r2r is not None else None,
            )

        return run

    workers: list[RolloutWorker] = []

    def guarded() -> Callable[[], _Sample]:
        config = TransferConfig(
            bucket_bytes=int(args.default_bucket_mb * (1 << 20)), timeout_s=args.timeout
        )
        p2r_t = groups.p2r_transfer(config=config)
        r2r_t = groups.r2r_transfer(config=config)
        worker = RolloutWorker(
            IdleFlatRollout(weights),
            p2r=p2r_t if rank != 0 else None,
            r2r=r2r_t,
            data_packer=RecordingPacker(),
            weight_sync_timeout=args.timeout,
        )
        workers.append(worker)
        relay = groups.r2r is not None

        def both() -> None:
            if rank == 0:
                assert p2r_t is not None
                p2r_t.send(weights, version=next(version))
            elif p2r_t is not None:
                result = worker.handle(P2R(relay=relay))
                assert result.ok, result.error
            elif r2r_t is not None:
                result = worker.handle(R2R())
                assert result.ok, result.error

        return lambda: _one_phase(both)

    default = args.default_bucket_mb
    methods: list[tuple[str, float | None, Callable[[], _Sample]]] = [
        ("raw", None, raw),
        ("raw + copies", None, copies),
    ]
    methods += [
        ("bucketed", b, transfer(b, pipelined=False, zero_copy=False)) for b in args.buckets
    ]
    methods.append(("zero-copy", default, transfer(default, pipelined=False, zero_copy=True)))
    methods.append(("pipelined", default, transfer(default, pipelined=True, zero_copy=False)))
    methods += [
        ("pipelined+zero-copy", b, transfer(b, pipelined=True, zero_copy=True))
        for b in args.buckets
        if b != default
    ]
    methods.append(
        ("pipelined+zero-copy", default, transfer(default, pipelined=True, zero_copy=True))
    )
    # Guarded right after what it is compared with, so that both meet the same machine state.
    methods.append(("guarded", default, guarded()))
    methods.append(
        ("all flat", default, transfer(default, pipelined=True, zero_copy=True, flat_trainer=True))
    )
    methods.append(("per-tensor", None, per_tensor()))
    samples: dict[int, list[_Sample]] = {i: [] for i in range(len(methods))}
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
    }
    if rank != 0:
        return {"bracket": bracket}
    # Guarded against the same transfer unguarded, paired per iteration (they ran back to
    # back): the median of the pairs' ratios is robust to a load spike in one iteration.
    guarded_i = next(i for i, m in enumerate(methods) if m[0] == "guarded")
    pairs = zip(samples[guarded_i], samples[guarded_i - 1], strict=True)
    paired = [g.total_s / u.total_s for g, u in pairs]
    cores = os.cpu_count() or 1
    hops = 2 if groups.r2r is not None else 1
    rows = []
    for i, (name, bucket, _) in enumerate(methods):
        got = samples[i]
        total_s = statistics.median(s.total_s for s in got)
        p2r = [s.p2r_s for s in got if s.p2r_s is not None]
        r2r = [s.r2r_s for s in got if s.r2r_s is not None]
        rows.append(
            {
                "method": name,
                "bucket_mb": bucket,
                "p2r_ms": statistics.median(p2r) * 1e3 if p2r else None,
                "r2r_ms": statistics.median(r2r) * 1e3 if r2r else None,
                "total_ms": total_s * 1e3,
                "mb_per_s": hops * nbytes / 1e6 / total_s,
                "cpu_util": statistics.median(s.cpu_s / (s.total_s * cores) for s in got),
            }
        )
    raw_row, copies_row = rows[0], rows[1]
    # "raw + copies" is the raw broadcast with the copies added (they were timed alone).
    for key in ("p2r_ms", "r2r_ms", "total_ms"):
        copies_row[key] += raw_row[key]
    copies_row["mb_per_s"] = hops * nbytes / 1e6 / (copies_row["total_ms"] / 1e3)
    copies_row["cpu_util"] = float("nan")
    return {
        "nbytes": nbytes,
        "tensors": len(weights),
        "rows": rows,
        "bracket": bracket,
        "guard_overhead": statistics.median(paired) - 1.0,
    }


def _fmt(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


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
        default=[4.0, 16.0, 64.0],
        help="bucket sizes to sweep, MiB",
    )
    parser.add_argument(
        "--default-bucket-mb",
        type=float,
        default=16.0,
        help="bucket size of the single-size rows (zero-copy, pipelined, all flat, guarded)",
    )
    parser.add_argument("--iterations", type=int, default=5)
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
        timeout_s=args.timeout * 4 + 300,
        what="benchmarks/transfer.py",
        intra_op_threads=1,
    )
    result = values[0]
    rows = result["rows"]
    raw = rows[0]
    print(
        f"model: {result['nbytes'] / 1e6:.1f} MB in {result['tensors']} tensors; trainer + "
        f"{args.replicas} replicas (gloo, loopback, {os.cpu_count()} cores); median of "
        f"{args.iterations} iterations; MB/s counts the model once per hop"
    )
    print(
        f"{'method':<21}{'bucket MB':>10}{'P2R ms':>9}{'R2R ms':>9}{'total ms':>10}"
        f"{'MB/s':>8}{'vs raw':>8}{'CPU':>6}"
    )
    for row in rows:
        bucket = "-" if row["bucket_mb"] is None else f"{row['bucket_mb']:g}"
        cpu = "-" if row["cpu_util"] != row["cpu_util"] else f"{row['cpu_util'] * 100:.0f}%"
        print(
            f"{row['method']:<21}{bucket:>10}{_fmt(row['p2r_ms'], 9)}"
            f"{_fmt(row['r2r_ms'], 9)}{row['total_ms']:>10.1f}{row['mb_per_s']:>8.0f}"
            f"{row['mb_per_s'] / raw['mb_per_s']:>8.2f}{cpu:>6}"
        )

    def best(method: str) -> dict[str, Any]:
        return max((r for r in rows if r["method"] == method), key=lambda r: r["mb_per_s"])

    def at_default(method: str) -> dict[str, Any]:
        return next(
            r for r in rows if r["method"] == method and r["bucket_mb"] == args.default_bucket_mb
        )

    guarded = at_default("guarded")
    transfers = [r for r in rows if r["method"] not in ("raw", "raw + copies", "per-tensor")]
    top = max(transfers, key=lambda r: r["mb_per_s"])
    bracket_s = sum(v["bracket"]["bracket_s"] for v in values.values() if v)
    handler_s = sum(v["bracket"]["handler_s"] for v in values.values() if v)
    summary = {
        "model_mb": round(result["nbytes"] / 1e6, 1),
        "tensors": result["tensors"],
        "replicas": args.replicas,
        "cores": os.cpu_count(),
        "raw_mb_per_s": round(raw["mb_per_s"], 1),
        "bucketed_over_raw": round(best("bucketed")["mb_per_s"] / raw["mb_per_s"], 3),
        "zero_copy_over_raw": round(at_default("zero-copy")["mb_per_s"] / raw["mb_per_s"], 3),
        "pipelined_over_raw": round(at_default("pipelined")["mb_per_s"] / raw["mb_per_s"], 3),
        "pipelined_zero_copy_over_raw": round(
            best("pipelined+zero-copy")["mb_per_s"] / raw["mb_per_s"], 3
        ),
        "all_flat_over_raw": round(at_default("all flat")["mb_per_s"] / raw["mb_per_s"], 3),
        "best_over_raw": round(top["mb_per_s"] / raw["mb_per_s"], 3),
        "best_method": f"{top['method']} {top['bucket_mb']:g} MB",
        "raw_plus_copies_over_raw": round(rows[1]["mb_per_s"] / raw["mb_per_s"], 3),
        "guarded_over_raw": round(guarded["mb_per_s"] / raw["mb_per_s"], 3),
        "guard_overhead": round(result["guard_overhead"], 4),
        "bracket_overhead": round(bracket_s / handler_s, 4) if handler_s else None,
        "per_tensor_over_raw": round(best("per-tensor")["mb_per_s"] / raw["mb_per_s"], 3),
        "raw_cpu_util": round(raw["cpu_util"], 3),
        "best_cpu_util": round(top["cpu_util"], 3),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(
        f"\nbest / raw bytes/s: {summary['best_over_raw']:.2f} ({summary['best_method']}; "
        f"target >= 0.9); staged, sequential: {summary['bucketed_over_raw']:.2f}"
    )
    print(
        f"guard overhead (guarded / pipelined+zero-copy time - 1, {args.default_bucket_mb:g} MB, "
        "median of the pairs):"
        f" {summary['guard_overhead'] * 100:+.1f}% (target <= 5%; noisy under load); bracket "
        f"only, from the SyncReports: {(summary['bracket_overhead'] or 0) * 100:.2f}%"
    )
    print(
        f"CPU busy: raw {raw['cpu_util'] * 100:.0f}%, best {top['cpu_util'] * 100:.0f}% of "
        f"{os.cpu_count()} cores (near 100%: the cores bound it, not the protocol)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=2)
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
