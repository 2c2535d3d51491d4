"""Async modes in one process: the weight buffer, installs at safe points, the fences, and the
weight-sync thread. Real threads, real tensors; ordering by events, not sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from conftest import wait_until

from rollout_sync.backend import RolloutBase
from rollout_sync.buffer import WeightBuffer, WeightSyncThread, install_inference_sync
from rollout_sync.errors import FenceTimeout, WeightSyncThreadError
from rollout_sync.guard import weight_sync_bracket
from rollout_sync.sync import SyncMode
from rollout_sync.testing import AsyncTornReadBackend, RecordingPacker, VersionStampedModel
from rollout_sync.trace import SpanKind, Timeline


def _write_version(buffer: WeightBuffer, version: int, gap_s: float = 0.0) -> None:
    """What the weight-sync thread does: fill the buffer tensor by tensor, then publish."""
    with buffer.write(timeout=10) as handle:
        for tensor in handle.tensors.values():
            tensor.fill_(float(version))
            if gap_s:
                time.sleep(gap_s)  # widens the write on purpose, so a racing read would tear
        handle.version = version


def test_buffer_needs_an_async_mode_and_clones() -> None:
    served = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="async mode"):
        WeightBuffer(served, mode=SyncMode.SYNC)
    buffer = WeightBuffer(served, mode=SyncMode.ASYNC_PER_FORWARD)
    assert buffer.tensors["w"].data_ptr() != served["w"].data_ptr()
    assert "published vNone" in repr(buffer)


def test_nothing_is_installed_before_a_complete_write() -> None:
    model = VersionStampedModel(4, 16)
    backend = AsyncTornReadBackend(model)
    buffer = WeightBuffer(model.weights, mode=SyncMode.ASYNC_PER_FORWARD)
    assert install_inference_sync(backend, buffer) is None
    with pytest.raises(RuntimeError, match="boom"), buffer.write() as handle:
        next(iter(handle.tensors.values())).fill_(7.0)
        raise RuntimeError("boom")  # the transfer failed half-way
    assert install_inference_sync(backend, buffer) is None
    assert backend.weight_version == 0 and not backend.weights_torn
    assert all(float(t.max()) == 0.0 for t in model.weights.values())
    assert buffer.statistics().failed_writes == 1


def test_installs_the_newest_version_and_counts_the_superseded() -> None:
    model = VersionStampedModel(4, 16)
    backend = AsyncTornReadBackend(model)
    buffer = WeightBuffer(model.weights, mode=SyncMode.ASYNC_PER_GENERATION)
    for version in (1, 2, 3):
        _write_version(buffer, version)
    # Only the generation safe point installs in this mode.
    assert install_inference_sync(backend, buffer, at=SyncMode.ASYNC_PER_FORWARD) is None
    report = install_inference_sync(backend, buffer, at=SyncMode.ASYNC_PER_GENERATION)
    assert report is not None
    assert (report.version, report.previous_version, report.superseded) == (3, 0, 2)
    assert backend.weight_version == 3
    assert all(float(t.min()) == 3.0 == float(t.max()) for t in model.weights.values())
    assert install_inference_sync(backend, buffer) is None  # nothing newer
    stats = buffer.statistics()
    assert (stats.installs, stats.superseded, stats.installed_version) == (1, 2, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [SyncMode.ASYNC_PER_FORWARD, SyncMode.ASYNC_PER_GENERATION])
def test_generation_never_pauses_and_installs_only_at_safe_points(mode: SyncMode) -> None:
    timeline = Timeline()
    model = VersionStampedModel(8, 256, timeline=timeline)
    backend = AsyncTornReadBackend(model, forwards_per_generation=3, timeline=timeline)
    buffer = WeightBuffer(model.weights, mode=mode, timeline=timeline)
    backend.attach_weight_buffer(buffer)
    backend.start()
    try:
        for version in range(1, 13):
            before = model.forwards
            _write_version(buffer, version, gap_s=200e-6)
            # Generation goes on around the write: the sync does not stop it.
            model.wait_for_forwards(before + 1, timeout=10)
        backend.wait_for_install(12, timeout=10)
    finally:
        backend.stop()
    assert model.torn_reads == 0
    assert backend.generation_gate.statistics().exclusive_acquired == 0  # never paused
    assert backend.installs, "nothing was installed"
    serving = {r.thread_ident for r in backend.installs}
    assert len(serving) == 1 and threading.get_ident() not in serving
    assert all(r.at is mode for r in backend.installs)
    if mode is SyncMode.ASYNC_PER_GENERATION:
        assert all(r.forward_index % 3 == 0 for r in backend.installs)
    versions = [r.version for r in backend.installs]
    assert versions == sorted(versions)
    assert timeline.overlaps() == []
    assert len(timeline.spans(SpanKind.WEIGHT_WRITE)) == len(backend.installs)


@pytest.mark.timeout(60)
def test_writing_served_tensors_directly_tears_reads() -> None:
    """The harness above can fail: the same writes, aimed at the served tensors, tear."""
    model = VersionStampedModel(8, 256)
    backend = AsyncTornReadBackend(model)
    backend.start()
    try:
        for version in range(1, 30):
            for tensor in model.weights.values():
                tensor.fill_(float(version))
                time.sleep(200e-6)  # the same widened write as above
            if model.torn_reads:
                break
    finally:
        backend.stop()
    assert model.torn_reads > 0


class _SlowInstallRollout(RolloutBase):
    """Its install copies half the tensors, then waits for the test to let it finish."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.halfway = threading.Event()
        self.finish = threading.Event()

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        names = list(weights)
        for i, name in enumerate(names):
            if i == len(names) // 2:
                self.halfway.set()
                assert self.finish.wait(10)
            self.weights[name].copy_(weights[name])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fenced", [True, False])
def test_the_reverse_fence_keeps_the_next_write_off_a_buffer_being_installed(fenced: bool) -> None:
    served = {f"t{i}": torch.zeros(8) for i in range(6)}
    rollout = _SlowInstallRollout(served)
    buffer = WeightBuffer(served, mode=SyncMode.ASYNC_PER_FORWARD, reverse_fence=fenced)
    _write_version(buffer, 1)
    installer = threading.Thread(target=buffer.install_into, args=(rollout,))
    installer.start()
    assert rollout.halfway.wait(10)  # the install is reading the buffer now
    writer_done = threading.Event()

    def write_next() -> None:
        _write_version(buffer, 2)
        writer_done.set()

    writer = threading.Thread(target=write_next)
    writer.start()
    if fenced:
        wait_until(lambda: buffer.statistics().fence_waits == 1)
        assert not writer_done.is_set()  # held off while the install reads
    else:
        assert writer_done.wait(10)  # nothing stops it: it overwrites the buffer mid-install
    rollout.finish.set()
    installer.join(10)
    writer.join(10)
    assert writer_done.is_set()
    values = {float(t[0]) for t in served.values()}
    if fenced:
        assert values == {1.0}, "the install read a mix of two versions"
        assert buffer.published_version == 2
    else:
        assert values == {1.0, 2.0}  # the torn install the fence prevents


@pytest.mark.timeout(30)
def test_the_reverse_fence_times_out_clearly() -> None:
    served = {f"t{i}": torch.zeros(8) for i in range(4)}
    rollout = _SlowInstallRollout(served)
    buffer = WeightBuffer(served, mode=SyncMode.ASYNC_PER_FORWARD)
    _write_version(buffer, 1)
    installer = threading.Thread(target=buffer.install_into, args=(rollout,))
    installer.start()
    try:
        assert rollout.halfway.wait(10)
        started = time.monotonic()
        with (
            pytest.raises(FenceTimeout, match=r"still reading the buffer after 0\.2 s"),
            buffer.write(timeout=0.2),
        ):
            pass
        assert time.monotonic() - started < 5
    finally:
        rollout.finish.set()
        installer.join(10)


# -- the weight-sync thread --------------------------------------------------------------------


def _plain_bracket(name: str) -> AbstractContextManager[object]:
    return weight_sync_bracket(None, name=name, pause=False, hold=False)


@pytest.mark.timeout(30)
def test_the_thread_runs_p2r_before_r2r_and_stop_drains_the_queue() -> None:
    order: list[str] = []
    gate = threading.Event()
    started = threading.Event()
    thread = WeightSyncThread(_plain_bracket)

    def first() -> str:
        started.set()
        assert gate.wait(10)
        return "first"

    def job(name: str) -> object:
        return lambda: order.append(name) or name

    f0 = thread.submit("p2r", first)
    assert started.wait(10)  # the thread is busy: the rest queue up behind it
    futures = [
        thread.submit("r2r", job("r2r-a")),
        thread.submit("p2r", job("p2r-b")),
        thread.submit("r2r", job("r2r-c")),
        thread.submit("p2r", job("p2r-d")),
    ]
    gate.set()
    thread.stop(timeout=10)
    assert order == ["p2r-b", "p2r-d", "r2r-a", "r2r-c"]
    assert f0.result() == "first" and all(f.done() for f in futures)
    with pytest.raises(WeightSyncThreadError, match="after the weight-sync thread was stopped"):
        thread.submit("p2r", first)


@pytest.mark.timeout(30)
def test_the_thread_holds_payload_egress_around_each_job_and_reports_failures() -> None:
    packer = RecordingPacker()
    seen: list[bool] = []

    @contextmanager
    def bracket(name: str) -> Iterator[None]:
        with weight_sync_bracket(None, [packer], name=name, pause=False, hold=True):
            yield

    thread = WeightSyncThread(bracket)
    ok = thread.submit("p2r", lambda: seen.append(packer.egress_gate.held))

    def fail() -> None:
        raise ValueError("a transfer failed")

    bad = thread.submit("r2r", fail)
    thread.stop(timeout=10)
    assert ok.result() is None and seen == [True]
    assert not packer.egress_gate.held
    with pytest.raises(ValueError, match="a transfer failed"):
        bad.result()
    assert "1 failed" in repr(thread)


@pytest.mark.timeout(30)
def test_stop_fails_clearly_when_a_job_does_not_finish() -> None:
    release = threading.Event()
    thread = WeightSyncThread(_plain_bracket)
    thread.submit("p2r", lambda: release.wait(10))
    try:
        with pytest.raises(WeightSyncThreadError, match=r"did not drain and stop within 0\.2 s"):
            thread.stop(timeout=0.2)
    finally:
        release.set()
        thread.stop(timeout=10)


def test_stop_runs_the_device_fence_after_draining() -> None:
    log: list[str] = []
    thread = WeightSyncThread(_plain_bracket, fence=lambda timeout: log.append("fence"))
    thread.submit("p2r", lambda: log.append("job"))
    thread.stop(timeout=10)
    assert log == ["job", "fence"]
