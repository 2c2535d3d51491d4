"""The install-strategy contract, run over every row of the strategy table (as the paused()
contract runs over every backend): through a RolloutWorker on an engine that serves on its own
thread, a version lands whole; a failed receive leaves the served weights untouched (staged,
buffered) or torn and refused (in place), never served mixed; a version one replica got whole
while another failed lands on none (staged) or is taken as whole (in place, buffered: nothing
to roll back); the install is fenced with generation parked; statistics add up."""

from __future__ import annotations

import pytest
from test_staged import WireTransfer  # an in-process wire

from rollout_sync.errors import StagedCommitAborted, TornWeightsError, WeightTransferError
from rollout_sync.sync import STRATEGIES, SyncMode, strategy_for
from rollout_sync.sync.contract import InstallStrategy
from rollout_sync.testing import AsyncTornReadBackend, VersionStampedModel
from rollout_sync.worker import P2R, RolloutWorker

pytestmark = pytest.mark.timeout(60)

MODES = sorted(STRATEGIES, key=lambda m: m.value)


class Fenced(RolloutWorker):
    """Records, at each fence, whether generation was parked and which version is served."""

    fences: list[tuple[bool, int]]

    def weight_sync_fence(self, timeout: float | None) -> None:
        stamp = int(self.rollout.served_weights()["layers.0.weight"][0])
        parked = self.rollout.statistics().parked  # type: ignore[attr-defined]
        self.fences = [*getattr(self, "fences", []), (parked, stamp)]


def _sync(worker: RolloutWorker, wire: WireTransfer) -> object:
    worker.p2r = wire
    result = worker.handle(P2R(step=wire.version))
    future = result.value
    if hasattr(future, "result"):  # an async job: wait for it, then for the install
        error: Exception | None = None
        try:
            future.result(timeout=30)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the job's outcome, as handle's would be
            error = exc
        worker.wait_for_install(30)  # a version published all the same is installed too
        return error
    return result.exception


def _served(model: VersionStampedModel) -> set[int]:
    return {int(v) for t in model.weights.values() for v in t.unique()}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_every_strategy_keeps_the_contract(mode: SyncMode) -> None:
    assert issubclass(strategy_for(mode), InstallStrategy) and mode in strategy_for(mode).modes
    model = VersionStampedModel(4, 64, read_gap_s=0.0)
    backend = AsyncTornReadBackend(model, pause_timeout=20)
    worker = Fenced(backend, mode=mode, weight_sync_timeout=20)
    try:
        # A version lands whole (and, where it parks, the install is fenced parked).
        assert _sync(worker, WireTransfer(1, model.stamped(1))) is None
        assert _served(model) == {1} and backend.weight_version == 1
        if not mode.is_async:
            assert (True, 1) in worker.fences  # the install fenced before generation resumed

        # A receive that fails after two writes: torn and refused in place, else untouched.
        broken = WireTransfer(2, model.stamped(2))
        broken.fail_after = 2
        error = _sync(worker, broken)
        assert isinstance(error, WeightTransferError)
        assert backend.weight_version == 1
        if mode is SyncMode.SYNC:
            assert backend.weights_torn
            with pytest.raises(TornWeightsError):
                backend.check_servable()
        else:
            assert not backend.weights_torn and _served(model) == {1}

        # Whole here while another replica failed: none installs it when staged (two-phase);
        # in place and buffered there is nothing to roll back to, so it is taken as whole.
        whole = WireTransfer(3, model.stamped(3))
        whole.complete = True
        error = _sync(worker, whole)
        assert isinstance(error, WeightTransferError)
        if mode is SyncMode.STAGED:
            assert isinstance(error, StagedCommitAborted) and error.kept_version == 1
            assert backend.weight_version == 1 and _served(model) == {1}
        else:
            assert backend.weight_version == 3 and _served(model) == {3}
            assert not backend.weights_torn
        assert model.torn_reads == 0

        # Statistics add up: three syncs, two failed; a staged one's memory is one copy.
        worker.close(20)
        stats = worker.statistics()
        assert (stats.commands, stats.syncs, stats.failed_syncs) == (3, 1, 2)
        assert stats.sync_reports_total >= 3
        weights = sum(t.numel() * t.element_size() for t in model.weights.values())
        assert stats.staging_bytes == (weights if mode is SyncMode.STAGED else 0)
        assert stats.staged_discarded == (2 if mode is SyncMode.STAGED else 0)
    finally:
        worker.close(20)
