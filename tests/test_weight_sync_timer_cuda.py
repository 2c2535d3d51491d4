"""WeightSyncTimer on a real CUDA device: real events around real copies, harvested late."""

from __future__ import annotations

import pytest
import torch

from rollout_sync import WeightSyncTimer
from rollout_sync.metrics import TimerClock
from rollout_sync.testing import count_host_syncs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Keeps the device busy long after the host has left the bracket (tens of ms on any GPU), so
# "not complete yet" is what the first harvest must see.
BUSY_CYCLES = 100_000_000


@pytest.mark.timeout(120)
def test_a_real_copy_is_harvested_only_once_complete_and_matches_a_reference() -> None:
    src = torch.randn(16 << 20, device="cuda")  # 64 MiB
    dst = torch.empty_like(src)
    ref_start = torch.cuda.Event(enable_timing=True)
    ref_end = torch.cuda.Event(enable_timing=True)
    timer = WeightSyncTimer(TimerClock.CUDA_EVENTS)
    torch.cuda.synchronize()

    with count_host_syncs() as syncs:
        with timer.measure(1, nbytes=src.numel() * src.element_size()):
            ref_start.record()
            torch.cuda._sleep(BUSY_CYCLES)  # device work on purpose: events stay pending
            dst.copy_(src)
            ref_end.record()
        deferred = timer.harvest()
        still_pending = timer.pending
    assert deferred == [] and still_pending == 1, "the harvest did not wait for the device"
    assert syncs.total == 0, f"the timer synchronized the host: {syncs}"

    with count_host_syncs() as syncs:
        (sample,) = timer.drain(timeout=60.0)
    assert syncs.total == 0, f"drain synchronized instead of polling: {syncs}"

    ref_end.synchronize()
    reference_ms = ref_start.elapsed_time(ref_end)
    assert torch.equal(dst, src)
    assert sample.tag == 1 and sample.nbytes == 64 << 20
    # The timer's pair encloses the reference pair, and nothing else ran on the stream
    # (event timestamps have about half a microsecond of resolution).
    assert reference_ms - 0.01 <= sample.elapsed_ms <= reference_ms * 1.05 + 1.0


@pytest.mark.timeout(120)
def test_a_lagging_harvest_loses_no_sample_on_a_real_device() -> None:
    weights = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    buffers = [torch.empty_like(w) for w in weights]
    timer = WeightSyncTimer(TimerClock.CUDA_EVENTS, pool_size=2)
    harvested = []
    with count_host_syncs() as syncs:
        for step in range(12):
            with timer.measure(step):
                torch.cuda._sleep(BUSY_CYCLES // 10)  # device work on purpose
                for w, b in zip(weights, buffers, strict=True):
                    b.copy_(w)
            harvested += timer.harvest()
        harvested += timer.drain(timeout=60.0)
    assert syncs.total == 0, f"the timer synchronized the host: {syncs}"
    assert [s.tag for s in harvested] == list(range(12))
    assert all(s.elapsed_ms > 0.0 for s in harvested)
    assert timer.statistics().pending == 0
