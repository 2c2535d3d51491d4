"""Stage, then swap (``SyncMode.STAGED``): generation goes on during the wire and parks only for
the install; a failed transfer leaves the served weights untouched; a version lands on every
replica of a sync or on none; the NCCL rule; the staging area's memory."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch_lm_helpers import (  # noqa: F401 - one_torch_thread is an autouse fixture
    ForwardCounter,
    greedy_continuation,
    one_torch_thread,
    tiny_config,
    weights_of,
)

from rollout_sync import SyncMode
from rollout_sync.backends.torch_lm import TorchLMStreamBackend
from rollout_sync.demos.distributed import version_skew_ms_max
from rollout_sync.errors import (
    ChecksumMismatchError,
    StagedCommitAborted,
    TwoCommunicatorsRefused,
    WeightTransferError,
)
from rollout_sync.sharded_groups import TreeRelay
from rollout_sync.staging import StagingArea, StagingState, check_two_communicators
from rollout_sync.testing import EventLog, RecordingRollout, run_group, weights_digest
from rollout_sync.trace import Span, SpanKind, Timeline, token_rates_in_windows
from rollout_sync.transfer import ShardedTransfer, TransferConfig, TransferHooks, TransferStats
from rollout_sync.weights import check_weights_match, specs_of
from rollout_sync.worker import P2R, R2R, RolloutWorker, build_sync_groups


class WireTransfer:
    """An in-process P2R: copies ``weights`` of ``version`` into the targets, tensor by tensor.

    ``midway`` runs after the first half of the tensors is written (the wire is "busy"),
    ``fail_after=k`` raises after ``k`` tensors, as a dead peer would, and ``complete`` raises
    after all of them, as when another replica of the sync failed."""

    is_source = False
    backend = "gloo"

    def __init__(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.version = version
        self.weights = weights
        self.midway: Any = None
        self.fail_after: int | None = None
        self.complete = False
        self.targets: list[Mapping[str, torch.Tensor]] = []

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
    ) -> TransferStats:
        self.targets.append(into)
        check_weights_match(specs_of(self.weights), into, require_all=not allow_subset)
        for i, (name, tensor) in enumerate(self.weights.items()):
            if i == self.fail_after:
                raise WeightTransferError(
                    "peer died", operation="wire", version=self.version, tensors_written=i
                )
            if i == len(self.weights) // 2 and self.midway is not None:
                self.midway()
            into[name].copy_(tensor)
        n = len(self.weights)
        if self.complete:
            raise WeightTransferError(
                "rank 9 failed",
                operation="wire",
                version=self.version,
                tensors_written=n,
                complete=True,
            )
        return TransferStats.build(
            role="receive",
            version=self.version,
            tensors=n,
            buckets=1,
            nbytes=0,
            manifest_s=0.0,
            transfer_s=0.0,
            total_s=0.0,
            tensors_written=n,
        )

    def relay(self, *args: Any, **kwargs: Any) -> TransferStats:
        raise NotImplementedError

    def send(self, *args: Any, **kwargs: Any) -> TransferStats:
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        pass


def _stream_worker(mode: SyncMode) -> tuple[TorchLMStreamBackend, RolloutWorker]:
    config = tiny_config()
    backend = TorchLMStreamBackend(config, timeline=Timeline())
    return backend, RolloutWorker(backend, mode=mode, weight_sync_timeout=20)


def _sync(worker: RolloutWorker, transfer: WireTransfer) -> Any:
    worker.p2r = transfer
    result = worker.handle(P2R(step=transfer.version))
    if not result.ok:
        raise result.exception  # type: ignore[misc]
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [SyncMode.STAGED, SyncMode.SYNC])
def test_staged_generation_runs_during_the_wire_and_the_tokens_are_exact(mode: SyncMode) -> None:
    """Staged: the stream LM keeps decoding while the transfer is half-way, parks only for the
    install, and every sequence has version 1's greedy tokens up to the install and version
    2's continuation after. In place (SYNC), nothing decodes during the wire: the same test
    can tell the two apart."""
    config = tiny_config()
    backend, worker = _stream_worker(mode)
    try:
        _sync(worker, WireTransfer(1, weights_of(config, 1)))  # starts the engine
        forwards = ForwardCounter(backend)
        prompts = {
            backend.put(p, max_new_tokens=40): tuple(p) for p in ([1, 2, 3], [4, 5, 6, 7], [8])
        }
        assert forwards.wait_for(3, 20), "decoding did not start"
        during: list[int] = []

        def midway() -> None:
            start = forwards.count
            # Staged, three forwards come at once; parked (in place) none can, so this wait
            # runs out on purpose and counts what came.
            forwards.wait_for(start + 3, 2.0)
            during.append(forwards.count - start)

        wire = WireTransfer(2, weights_of(config, 2))
        wire.midway = midway
        result = _sync(worker, wire)
        results = {r.request_id: r for r in (backend.scheduler.get(30) for _ in prompts)}
    finally:
        worker.close(20)
    report = worker.last_weight_sync_report
    assert report is not None and report.error is None
    served = backend.served_weights()
    if mode is SyncMode.SYNC:
        assert during == [0], "in place, generation is parked for the whole wire"
        name = next(iter(served))
        assert wire.targets[0][name].data_ptr() == served[name].data_ptr()
        assert report.stall_s > 0.5 * report.handler_s
        return
    assert during[0] >= 3, "staged, generation went on while the wire was busy"
    # The wire wrote the staging area, not the served tensors; the install copied it in.
    assert wire.targets[0] is worker.staging.tensors  # type: ignore[union-attr]
    assert all(torch.equal(served[n], t) for n, t in weights_of(config, 2).items())
    assert result.weight_version == 2 and result.committed_at is not None
    assert 0 < report.stall_s < report.total_s and report.paused
    assert report.to_metrics()["rollout_sync/stall_ms"] == report.stall_s * 1e3
    assert worker.statistics().staging_bytes == worker.staging.nbytes > 0  # type: ignore[union-attr]
    for rid, prompt in prompts.items():
        r = results[rid]
        assert r.ok and len(r.tokens) == 40
        n_old = r.token_weight_versions.count(1)
        assert r.token_weight_versions == (1,) * n_old + (2,) * (40 - n_old)
        assert n_old >= 3 and r.straddled_sync
        assert r.tokens[:n_old] == greedy_continuation(config, weights_of(config, 1), prompt, n_old)
        assert r.tokens[n_old:] == greedy_continuation(
            config, weights_of(config, 2), [*prompt, *r.tokens[:n_old]], 40 - n_old
        )
    assert backend.statistics().torn_forwards == 0
    assert backend.timeline is not None and backend.timeline.overlaps() == []


def _recording(version: int = 0) -> RecordingRollout:
    return RecordingRollout(EventLog(), {"a": torch.full((4,), 0.0), "b": torch.full((3,), 0.0)})


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4,), value), "b": torch.full((3,), value)}


@pytest.mark.timeout(30)
def test_a_failed_staged_transfer_leaves_the_served_weights_untouched() -> None:
    rollout = _recording()
    worker = RolloutWorker(rollout, mode=SyncMode.STAGED)
    _sync(worker, WireTransfer(1, _weights(1.0)))
    before = {n: t.clone() for n, t in rollout.served_weights().items()}
    rollout.log = EventLog()
    broken = WireTransfer(2, _weights(2.0))
    broken.fail_after = 1
    with pytest.raises(StagedCommitAborted, match="keeps serving version 1") as caught:
        _sync(worker, broken)
    assert caught.value.kept_version == 1 and caught.value.tensors_written == 0
    assert isinstance(caught.value.__cause__, WeightTransferError)
    assert rollout.weight_version == 1 and not rollout.weights_torn
    assert all(torch.equal(rollout.served_weights()[n], t) for n, t in before.items())
    assert "pause:enter" not in rollout.log.events, "nothing was installed, so nothing parked"
    staging = worker.staging
    assert staging is not None and staging.state is StagingState.VOID
    assert worker.statistics().staged_discarded == 1
    # The next sync starts from the served weights again and lands.
    _sync(worker, WireTransfer(3, _weights(3.0)))
    assert rollout.weight_version == 3 and staging.refreshes == 1
    assert torch.equal(rollout.served_weights()["b"], torch.full((3,), 3.0))


@pytest.mark.timeout(30)
def test_a_reseed_runs_in_place_and_the_next_staged_subset_builds_on_it() -> None:
    """A recovery's re-seed writes the served weights in place (parked) in staged mode too;
    the staging copy no longer mirrors them, so the next staged sync, a subset, starts from
    the re-seeded weights, not from the stale copy."""
    rollout = _recording()
    worker = RolloutWorker(rollout, mode=SyncMode.STAGED)
    _sync(worker, WireTransfer(1, _weights(1.0)))
    rollout.log = EventLog()
    stats = worker.reseed(WireTransfer(5, _weights(5.0)))
    assert stats.version == 5 and rollout.weight_version == 5
    assert rollout.log.events[:1] == ["pause:enter"], "the re-seed ran parked"
    subset = WireTransfer(6, {"a": torch.full((4,), 6.0)})
    result = _sync(worker, subset)
    assert result.weight_version == 6
    assert torch.equal(rollout.served_weights()["a"], torch.full((4,), 6.0))
    assert torch.equal(rollout.served_weights()["b"], torch.full((3,), 5.0))
    assert worker.statistics().staged_discarded == 0, "nothing staged was thrown away"


class _BreaksOnce(RecordingRollout):
    """A background engine whose first load of a staged version fails part-way (torn)."""

    def __init__(self) -> None:
        super().__init__(EventLog(), {"a": torch.zeros(4), "b": torch.zeros(3)})
        self.loads = 0

    def start(self) -> None:
        self.log.add("start")

    def stop(self, timeout: float = 30.0) -> None:
        self.log.add("stop")

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        self.loads += 1
        if self.loads == 2:
            self.served_weights()["a"].fill_(-1.0)
            raise RuntimeError("the engine's loader died part-way")
        super().load_weights(weights, require_all=require_all)


@pytest.mark.timeout(30)
def test_a_failed_install_parks_a_background_engine_until_a_version_installs() -> None:
    """An install that tears the weights after the vote keeps a background engine parked (it
    must not resume on torn weights); the next staged version that installs lets it go."""
    rollout = _BreaksOnce()
    worker = RolloutWorker(rollout, mode=SyncMode.STAGED)
    _sync(worker, WireTransfer(1, _weights(1.0)))
    with pytest.raises(RuntimeError, match="part-way"):
        _sync(worker, WireTransfer(2, _weights(2.0)))
    assert rollout.weights_torn
    events = rollout.log.events
    assert events.count("pause:enter") == events.count("pause:exit") + 1, "held parked"
    _sync(worker, WireTransfer(3, _weights(3.0)))
    assert not rollout.weights_torn and rollout.weight_version == 3
    events = rollout.log.events
    assert events.count("pause:enter") == events.count("pause:exit"), "let go"
    worker.close(10)


def test_the_staging_area_keeps_a_staged_version_as_the_base_of_the_next() -> None:
    served = _weights(0.0)
    area = StagingArea(served)
    assert area.nbytes == 7 * 4 and area.state is StagingState.SERVED
    area.begin(served)
    area.tensors["a"].fill_(5.0)
    area.staged(5)
    area.begin(served)  # a subset sync on top of a staged version keeps its bytes
    assert torch.equal(area.tensors["a"], torch.full((4,), 5.0)) and area.staged_version is None
    area.discard()
    area.begin(served)  # void: the served weights are copied back in first
    assert torch.equal(area.tensors["a"], served["a"]) and area.refreshes == 1
    with pytest.raises(RuntimeError, match="nothing is staged"):
        area.install_into(_recording())


class _NcclForwards(RecordingRollout):
    def forward_collectives(self) -> frozenset[str]:
        return frozenset({"nccl"})


def test_a_staged_nccl_receive_beside_nccl_forwards_is_refused() -> None:
    nccl = WireTransfer(1, _weights(1.0))
    nccl.backend = "nccl"  # type: ignore[misc]
    rollout = _NcclForwards(EventLog())
    with pytest.raises(TwoCommunicatorsRefused, match="two NCCL communicators") as caught:
        RolloutWorker(rollout, mode=SyncMode.STAGED, p2r=nccl)
    assert "SyncMode.SYNC" in str(caught.value) and "gloo" in str(caught.value)
    with pytest.raises(TwoCommunicatorsRefused):
        check_two_communicators(rollout, [None, nccl], SyncMode.ASYNC_PER_FORWARD)
    # Every transfer the worker drives says its backend, sharded ones and tree relays too.
    assert all(hasattr(cls, "backend") for cls in (ShardedTransfer, TreeRelay))
    # Parked (SYNC), or over gloo, or beside forwards without NCCL collectives: allowed.
    RolloutWorker(rollout, mode=SyncMode.SYNC, p2r=nccl)
    RolloutWorker(rollout, mode=SyncMode.STAGED, p2r=WireTransfer(1, _weights(1.0)))
    RolloutWorker(_recording(), mode=SyncMode.STAGED, p2r=nccl)


# -- every replica or none, across processes ---------------------------------------------------


def _corrupt(index: int, flat: torch.Tensor) -> None:
    flat.view(torch.uint8)[:8].add_(1)


def _two_phase_job(rank: int) -> dict[str, Any]:
    """Rank 0 trains; 1..3 are replicas, 1 the P2R target. Two syncs, each corrupted on rank
    3's R2R receive: the first with the two-phase commit, the second without."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(checksums=True, timeout_s=20)
    out: dict[str, Any] = {}
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        for version in (1, 2):
            p2r.send(_weights(float(version)), version=version)
        return out
    rollout = _recording()
    hooks = TransferHooks(after_receive=_corrupt) if rank == 3 else None
    for version, all_or_none in ((1, True), (2, False)):
        worker = RolloutWorker(
            rollout,
            mode=SyncMode.STAGED,
            p2r=groups.p2r_transfer(config=config),
            r2r=groups.r2r_transfer(config=config, hooks=hooks),
            all_or_none=all_or_none,
        )
        errors = []
        if rank == 1:
            p2r = worker.handle(P2R(step=version))
            assert p2r.ok, p2r.error
            assert rollout.weight_version == 0, "held until the R2R vote"
            assert p2r.committed_at is None, "the P2R committed nothing: it holds the version"
        r2r = worker.handle(R2R(step=version))
        if not r2r.ok:
            assert r2r.exception is not None
            errors.append(r2r.exception)
        out[version] = {
            "version": rollout.weight_version,
            "digest": weights_digest(rollout.served_weights()),
            "torn": rollout.weights_torn,
            "errors": [type(e).__name__ for e in errors],
            "failed_ranks": [list(getattr(e, "failed_ranks", ())) for e in errors],
        }
    return out


@pytest.mark.timeout(120)
def test_a_version_lands_on_every_replica_or_on_none() -> None:
    results = run_group(_two_phase_job, 4, timeout_s=90, group_timeout_s=20)
    first = {rank: results[rank][1] for rank in (1, 2, 3)}
    # Two-phase: rank 3's checksum failed, so no replica installed version 1.
    assert {r["version"] for r in first.values()} == {0}
    assert not any(r["torn"] for r in first.values())
    assert len({r["digest"] for r in first.values()}) == 1
    assert first[1]["errors"] == first[2]["errors"] == ["StagedCommitAborted"]
    assert first[1]["failed_ranks"] == first[2]["failed_ranks"] == [[3]]
    assert first[3]["errors"] == ["StagedCommitAborted"]
    # Without it, the same failure leaves a mixed fleet: ranks 1 and 2 serve version 2, rank 3
    # its old version 0.
    second = {rank: results[rank][2] for rank in (1, 2, 3)}
    assert [second[r]["version"] for r in (1, 2, 3)] == [2, 2, 0]
    assert second[3]["errors"] == [ChecksumMismatchError.__name__]
    assert not any(r["torn"] for r in second.values())


def test_version_skew_and_sync_window_token_rates_measure_what_the_report_says() -> None:
    # Per version, the spread of the times the replicas first served it or a later one.
    assert version_skew_ms_max([{1: 1.0, 2: 2.0}, {1: 1.004, 2: 2.010}]) == pytest.approx(10)
    assert version_skew_ms_max([{1: 1.0, 3: 3.0}, {2: 2.0, 3: 3.001}]) == pytest.approx(1000)
    assert version_skew_ms_max([{1: 5.0}]) == 0 and math.isnan(version_skew_ms_max([{}, {}]))
    # One process: 4 steps of batch 2 in a 1 s window, 2 steps of batch 2 in 3 s outside it.
    s = 1_000_000_000

    def span(kind: str, start: float, end: float, **args: Any) -> Span:
        return Span(kind, "x", int(start * s), int(end * s), 1, 1, args)

    forwards = [span(SpanKind.FORWARD, t, t + 0.1, batch=2) for t in (0.0, 2.0, 2.2, 2.4, 2.6)]
    forwards.append(span(SpanKind.FORWARD, 3.9, 4.0, batch=2))
    inside, outside = token_rates_in_windows(forwards, [span(SpanKind.SYNC, 2.0, 3.0)])
    assert inside == pytest.approx(8.0) and outside == pytest.approx(4 / 3)


@pytest.mark.timeout(30)
def test_a_decorated_in_place_handler_on_a_staged_worker_voids_the_staging_copy() -> None:
    """``receive_weights_p2r`` writes the served tensors in place in every mode; on a STAGED
    worker the staging copy then no longer mirrors them, so it is voided (a later staged sync
    starts from the served weights again, not from the older copy)."""
    rollout = _recording()
    worker = RolloutWorker(rollout, mode=SyncMode.STAGED)
    _sync(worker, WireTransfer(1, _weights(1.0)))
    staging = worker.staging
    assert staging is not None and staging.state is StagingState.SERVED
    worker.p2r = WireTransfer(2, _weights(2.0))
    worker.receive_weights_p2r(P2R(step=2))
    assert rollout.weight_version == 2
    assert torch.equal(rollout.served_weights()["a"], torch.full((4,), 2.0))
    assert staging.state is StagingState.VOID, "the copy still claims to mirror version 1"
