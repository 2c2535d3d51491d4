"""How torch's gloo backend sends a broadcast of a CPU tensor: who sends how many copies.

The refit cost model (``rollout_sync.scale``) and the emulated NIC need to know what a
broadcast puts on each member's link. NCCL pipelines a broadcast through a chain (the source
sends the bytes once); gloo's ``gloo::broadcast`` (``gloo/broadcast.cc``, which
``ProcessGroupGloo::broadcast`` runs for CPU tensors) is a binomial tree of whole messages:
in round ``i`` every member that has the message sends all of it to the member ``2**i`` away
(virtual ranks, the root 0), and a member forwards only once it received the whole message.

This measures it: one job of 4 processes (gloo on loopback), a broadcast of ``--mb`` MiB from
rank 0 to 1, 2 and 3 receivers (groups of 2, 3, 4), and for each member the bytes its process
wrote to its sockets during the broadcast (``wchar`` of ``/proc/self/io``: gloo's TCP transport
sends with ``writev``), beside what the whole loopback carried (``lo``'s transmit counter in
``/proc/net/dev``). Linux only.

    python benchmarks/gloo_broadcast.py          # a few seconds; last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The path is set up above, so a source checkout runs without installing the package.
from rollout_sync.testing import run_group

WORLD = 4


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _lo_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def _member(rank: int, nbytes: int, repeat: int) -> dict[str, Any]:
    groups = {size: dist.new_group(list(range(size))) for size in range(2, WORLD + 1)}
    tensor = torch.full((nbytes,), rank, dtype=torch.uint8)
    out: dict[str, Any] = {}
    for size, group in groups.items():
        wrote, lo = [], []
        for _ in range(repeat):
            dist.barrier()
            lo_before, before = _lo_tx_bytes(), _wchar()
            if rank < size:
                dist.broadcast(tensor, 0, group=group)
            dist.barrier()
            wrote.append(_wchar() - before)
            lo.append(_lo_tx_bytes() - lo_before)
        out[str(size)] = {"wrote": min(wrote), "lo": min(lo)}
        if rank < size:
            assert int(tensor[0]) == 0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=64.0, help="the broadcast's size, MiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    nbytes = int(args.mb * (1 << 20))
    values = run_group(
        _member, WORLD, (nbytes, args.repeat), timeout_s=300, what="benchmarks/gloo_broadcast.py"
    )
    copies: dict[str, list[float]] = {}
    print(f"torch {torch.__version__}: a {nbytes / 1e6:.1f} MB gloo broadcast from rank 0")
    print(f"{'members':>8}  copies each member's process wrote (rank 0 first)  loopback")
    for size in range(2, WORLD + 1):
        key = str(size)
        copies[key] = [round(values[r][key]["wrote"] / nbytes, 3) for r in range(size)]
        lo = values[0][key]["lo"] / nbytes
        print(f"{size:>8}  {copies[key]!s:<48}  {lo:.3f} copies")
    summary = {
        "torch": torch.__version__,
        "broadcast_bytes": nbytes,
        "copies_written_by_rank": copies,
        "loopback_copies": {
            str(s): round(values[0][str(s)]["lo"] / nbytes, 3) for s in range(2, WORLD + 1)
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
