"""Payload transport throughput, with and without periodic egress holds, and hold drain latency.

Two processes on this machine (gloo on 127.0.0.1): rank 1 is a rollout whose producer registers
payloads as fast as it can through a :class:`~rollout_sync.PayloadSender`; rank 0 is a trainer
taking them off a :class:`~rollout_sync.PayloadReceiver`. For each payload size it runs the
same traffic twice, side by side in one run: without holds, and with a "weight-sync" thread
taking ``hold_sends`` every ``--hold-every-ms`` for ``--hold-ms``. It reports payloads/s and
MB/s (from the first registration until every payload was sent), payloads per transfer, and
the drain latency: how long ``hold_sends`` took to take effect (wait out the transfer in
flight), p50/p99.

    python benchmarks/transport.py                 # short default run (~15 s)
    python benchmarks/transport.py --seconds 5 --sizes 1024,65536,1048576
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from rollout_sync import PayloadReceiver, PayloadSender, new_payload_groups
from rollout_sync.distributed import init_process_group
from rollout_sync.metrics import summarize
from rollout_sync.testing import find_free_port, run_processes


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]
    seconds: float
    hold_every_ms: float
    hold_ms: float
    capacity: int
    max_in_flight: int
    window: int


@dataclass(frozen=True)
class CaseResult:
    size: int
    holds: bool
    payloads: int
    elapsed_s: float
    bytes: int
    transfers: int
    drains_s: tuple[float, ...]

    @property
    def payloads_per_s(self) -> float:
        return self.payloads / self.elapsed_s

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.elapsed_s / 1e6


def _payload(size: int) -> dict[str, torch.Tensor]:
    """About ``size`` bytes of a rollout result: token ids, logprobs and a reward."""
    n = max(1, (size - 4) // 12)
    return {
        "tokens": torch.arange(n, dtype=torch.int64),
        "logprobs": torch.randn(n),
        "reward": torch.tensor(1.0),
    }


def _run_case(sender: PayloadSender, config: Config, size: int, holds: bool) -> CaseResult:
    tensors = _payload(size)
    stop = threading.Event()
    drains: list[float] = []

    def weight_sync_thread() -> None:
        idle_s = max(0.0, config.hold_every_ms - config.hold_ms) / 1e3
        while not stop.wait(idle_s):
            started = time.perf_counter()
            with sender.hold_sends(timeout=30):
                drains.append(time.perf_counter() - started)
                time.sleep(config.hold_ms / 1e3)  # the sync's own work, while held

    syncer = threading.Thread(target=weight_sync_thread, daemon=True)
    before = sender.statistics()
    if holds:
        syncer.start()
    started = time.perf_counter()
    count = 0
    while time.perf_counter() - started < config.seconds:
        sender.register_payload(tensors, {"i": count}, timeout=30)
        count += 1
    sender.wait_all_sent(60)
    elapsed = time.perf_counter() - started
    stop.set()
    if holds:
        syncer.join(30)
    after = sender.statistics()
    return CaseResult(
        size,
        holds,
        count,
        elapsed,
        after.bytes_sent - before.bytes_sent,
        after.transfers - before.transfers,
        tuple(drains),
    )


def _bench_rank(rank: int, port: int, config: Config) -> Any:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_process_group(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    result = _bench_side(rank, config)
    dist.barrier()  # nobody tears the groups down while a peer still talks on them
    return result


def _bench_side(rank: int, config: Config) -> Any:
    groups = new_payload_groups(timeout=120)
    if rank == 0:
        receiver = PayloadReceiver(groups, [1], window=config.window)
        taken = sum(1 for _ in receiver.iter_payloads(timeout=60))
        receiver.close(30)
        return taken
    sender = PayloadSender(groups, 0, capacity=config.capacity, max_in_flight=config.max_in_flight)
    sender.wait_for_credit(30)
    _run_case(sender, Config(config.sizes[:1], 0.2, 10, 2, 0, 0, 0), config.sizes[0], False)
    results = [
        _run_case(sender, config, size, holds) for size in config.sizes for holds in (False, True)
    ]
    sender.close(60)
    return results


def _fmt_size(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        default="1024,262144",
        help="payload sizes in bytes, comma-separated (default 1024,262144)",
    )
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="registration time per case (default 2.0)"
    )
    parser.add_argument("--hold-every-ms", type=float, default=10.0)
    parser.add_argument("--hold-ms", type=float, default=2.0)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--max-in-flight", type=int, default=32)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args(argv)
    config = Config(
        tuple(int(s) for s in args.sizes.split(",")),
        args.seconds,
        args.hold_every_ms,
        args.hold_ms,
        args.capacity,
        args.max_in_flight,
        args.window,
    )
    results = run_processes(
        _bench_rank,
        2,
        (find_free_port(), config),
        intra_op_threads=1,
        timeout_s=60 + 3 * len(config.sizes) * config.seconds * 2,
    )[1]

    hold_label = f"{config.hold_ms:g} ms / {config.hold_every_ms:g} ms"
    print(
        f"payload transport, gloo on 127.0.0.1, 1 rollout -> 1 trainer, "
        f"capacity {config.capacity}, max_in_flight {config.max_in_flight}, "
        f"window {config.window}, {config.seconds:g} s per case"
    )
    header = (
        f"{'payload':>9}  {'holds':>16}  {'payloads':>8}  {'payloads/s':>10}  "
        f"{'MB/s':>8}  {'per xfer':>8}  {'holds':>5}  {'drain p50 ms':>12}  "
        f"{'drain p99 ms':>12}"
    )
    print(header)
    print("-" * len(header))
    by_key: dict[tuple[int, bool], CaseResult] = {}
    for r in results:
        by_key[(r.size, r.holds)] = r
        drain = summarize(list(r.drains_s))
        p50 = f"{drain.p50_ms:.3f}" if r.drains_s else "-"
        p99 = f"{drain.p99_ms:.3f}" if r.drains_s else "-"
        print(
            f"{_fmt_size(r.size):>9}  {hold_label if r.holds else 'none':>16}  "
            f"{r.payloads:>8}  {r.payloads_per_s:>10.0f}  {r.mb_per_s:>8.1f}  "
            f"{r.payloads / max(1, r.transfers):>8.1f}  {len(r.drains_s):>5}  {p50:>12}  "
            f"{p99:>12}"
        )
    held_fraction = config.hold_ms / config.hold_every_ms
    print(
        f"\nthroughput with holds / without (holds keep egress shut "
        f"{held_fraction:.0%} of the time):"
    )
    for size in config.sizes:
        plain, held = by_key[(size, False)], by_key[(size, True)]
        ratio = held.payloads_per_s / plain.payloads_per_s
        print(
            f"  {_fmt_size(size):>9}: payloads/s {ratio:.2f}x"
            f"   MB/s {held.mb_per_s / plain.mb_per_s:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
