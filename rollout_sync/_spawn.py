"""Run a function on N local processes joined by torch.distributed (gloo on 127.0.0.1).

Private plumbing for the multi-process tests and benchmarks: a free port, ``spawn`` children,
every child joined with a timeout and killed on failure, and each child's exception reported
to the parent as a readable traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankFailed", "free_port", "run_ranks"]


class RankFailed(RuntimeError):
    """A child rank raised, exited without a result, or did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    dist_timeout: float,
    results: Any,
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=dist_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
            # Nobody tears the groups down while a peer still talks on them.
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    dist_timeout: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable by name (a module-level function) and its result picklable.
    Returns the results by rank.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), died, or the ranks did
            not all finish within ``timeout`` seconds. Every child is killed then.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, args, dist_timeout, results),
                    name=f"rank-{rank}")
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in values and p.exitcode is not None]
                if not dead:
                    continue
                # A dead rank's result may still be in the pipe: look once more before failing.
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                     "without a result") from None
            if status == "error":
                raise RankFailed(f"rank {rank} failed:\n{value}")
            values[rank] = value
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    return [values[rank] for rank in range(world_size)]
