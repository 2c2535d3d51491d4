"""What timing weight syncs costs a training loop: step time with the timer on vs. off.

A training-like loop (an MLP: forward, backward, optimizer step) ends every step with a
:class:`~rollout_sync.WeightBroadcastCallback` that pushes the full weights. The push copies
every tensor into a receive buffer on the same device, standing in for the broadcast (on CUDA,
a device-to-device copy on the current stream, like NCCL's ordered-after ``work.wait()``). The
same loop runs with the callback's timer on (``timer="auto"``: CUDA events on CUDA,
perf_counter on CPU) and off (``timer=None``: nothing constructed), in alternating blocks so
that both see the same machine noise, and the script prints:

* the median step time of each, their ratio (on / off) and the difference per step;
* on CUDA, the host-device synchronizations counted in each (explicit synchronizes,
  device-to-host reads, PyTorch's sync debug mode): the timer must add zero;
* the cost of one bare ``measure()`` + ``harvest()`` per clock.

The loop itself never reads the device (no ``loss.item()``), so any sync counted in the "on"
run and not in the "off" run would be the timer's.

    python benchmarks/timer_overhead.py                # CUDA if available, else CPU
    python benchmarks/timer_overhead.py --device cpu --blocks 6 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Imported after the path fix, so that a checkout runs without installing.
from rollout_sync import TrainerCallbacks, WeightBroadcastCallback, WeightSyncTimer
from rollout_sync.metrics import TimerClock
from rollout_sync.testing import FakeCudaStream, HostSyncCount, count_host_syncs


class CopyPusher:
    """Pushes by copying each tensor into a receive buffer on the same device."""

    def __init__(self, weights: Mapping[str, torch.Tensor], backend: str) -> None:
        self.backend = backend
        self.buffers = {k: torch.empty_like(v) for k, v in weights.items()}

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        for name, tensor in weights.items():
            self.buffers[name].copy_(tensor, non_blocking=True)


@dataclass
class Run:
    step_s: list[float]
    syncs: HostSyncCount
    callback: WeightBroadcastCallback


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Setup:
    """One model, optimizer, input and pusher; two callbacks that differ only in the timer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    callbacks: dict[str, WeightBroadcastCallback]


def build(device: torch.device, hidden: int, layers: int) -> Setup:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(64, hidden, device=device)

    def gather() -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}

    pusher = CopyPusher(gather(), "nccl" if device.type == "cuda" else "gloo")
    callbacks = {
        mode: WeightBroadcastCallback(
            gather, pusher=pusher, timer="auto" if mode == "on" else None, sync_on_run_begin=False
        )
        for mode in ("on", "off")
    }
    return Setup(model, optimizer, inputs, callbacks)


def run_block(
    setup: Setup, mode: str, device: torch.device, first_step: int, steps: int, log_every: int
) -> tuple[float, HostSyncCount]:
    callbacks = TrainerCallbacks([setup.callbacks[mode]])
    _sync(device)
    started = time.perf_counter()
    with count_host_syncs() as syncs:
        for step in range(first_step, first_step + steps):
            setup.optimizer.zero_grad(set_to_none=True)
            setup.model(setup.inputs).square().mean().backward()
            setup.optimizer.step()
            logged = (step % log_every) == 0
            callbacks.step_end(step, None, True, {} if logged else None)
    _sync(device)
    return (time.perf_counter() - started) / steps, syncs


def _add(total: HostSyncCount, more: HostSyncCount) -> None:
    total.explicit += more.explicit
    total.device_reads += more.device_reads
    total.early_elapsed_time += more.early_elapsed_time
    total.debug_mode_warnings += more.debug_mode_warnings


def compare(
    device: torch.device, hidden: int, layers: int, blocks: int, steps: int, log_every: int
) -> dict[str, Run]:
    """Alternating blocks of the same loop, timer on and off; the order flips every block."""
    setup = build(device, hidden, layers)
    for mode in ("on", "off"):
        run_block(setup, mode, device, 0, steps, log_every)  # warm-up
    runs = {mode: Run([], HostSyncCount(), setup.callbacks[mode]) for mode in ("on", "off")}
    step = steps
    for block in range(blocks):
        for mode in ("on", "off") if block % 2 == 0 else ("off", "on"):
            step_s, syncs = run_block(setup, mode, device, step, steps, log_every)
            step += steps
            runs[mode].step_s.append(step_s)
            _add(runs[mode].syncs, syncs)
    return runs


def bare_timer_cost(clock: str, iterations: int) -> float:
    """Seconds per ``measure()`` + ``harvest()`` with an empty body."""
    if clock == "perf_counter":
        timer = WeightSyncTimer(TimerClock.PERF_COUNTER)
    elif clock == "fake events":
        stream = FakeCudaStream()
        stream.complete_after_queries = 0  # the device is always done: every harvest reads
        timer = WeightSyncTimer(TimerClock.CUDA_EVENTS, event_factory=stream.event)
    else:
        timer = WeightSyncTimer(TimerClock.CUDA_EVENTS)
    started = time.perf_counter()
    for i in range(iterations):
        with timer.measure(i):
            pass
        timer.harvest()
    elapsed = time.perf_counter() - started
    if clock == "cuda events":
        timer.drain(60.0)
    return elapsed / iterations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per mode (alternating)")
    parser.add_argument("--steps", type=int, default=25, help="steps per block")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--log-every", type=int, default=1, help="steps between logged steps (reports)"
    )
    parser.add_argument("--bare-iterations", type=int, default=20000)
    args = parser.parse_args()
    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    device = torch.device(want)
    torch.set_num_threads(1)

    runs = compare(device, args.hidden, args.layers, args.blocks, args.steps, args.log_every)
    on, off = runs["on"], runs["off"]
    med_on, med_off = statistics.median(on.step_s), statistics.median(off.step_s)
    timer = on.callback.timer
    assert timer is not None

    print(
        f"timer overhead: {device.type}, MLP {args.layers}x{args.hidden}, "
        f"{args.blocks} blocks x {args.steps} steps per mode, timer clock "
        f"{timer.clock.value}, log every {args.log_every} step(s)"
    )
    print()
    print(
        f"{'mode':<10}{'median step ms':>16}{'min block ms':>14}{'max block ms':>14}"
        f"{'host syncs':>12}"
    )
    for name, run in (("timer on", on), ("timer off", off)):
        syncs = str(run.syncs.total) if device.type == "cuda" else "n/a"
        print(
            f"{name:<10}{statistics.median(run.step_s) * 1e3:>16.3f}"
            f"{min(run.step_s) * 1e3:>14.3f}{max(run.step_s) * 1e3:>14.3f}{syncs:>12}"
        )
    print()
    print(f"step time ratio on/off:     {med_on / med_off:.4f}")
    print(f"difference per step:        {(med_on - med_off) * 1e6:+.1f} us (noise included)")
    stats = timer.statistics()
    print(
        f"timer: {stats.measured} measured, {stats.harvested} harvested, {stats.pending} "
        f"pending, {stats.skipped} skipped, {stats.event_pairs} event pairs alive"
    )
    if device.type == "cuda":
        added = on.syncs.total - off.syncs.total
        print(f"host syncs added by timer:  {added}  (on: {on.syncs}; off: {off.syncs})")
        if added != 0 or on.syncs.early_elapsed_time:
            print("FAIL: the timer synchronized the host")
            return 1
    else:
        print(
            "host syncs added by timer:  skipped (no CUDA device: the CPU path uses "
            "perf_counter and has no device to synchronize)"
        )

    print()
    print("bare measure() + harvest(), empty body:")
    clocks = ["perf_counter", "fake events"] + (["cuda events"] if device.type == "cuda" else [])
    for clock in clocks:
        print(f"  {clock:<14}{bare_timer_cost(clock, args.bare_iterations) * 1e6:>8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
