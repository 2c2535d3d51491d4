"""A P2R barrier only one side takes fails fast and clearly on both sides, writes nothing, and
leaves the pair usable: the trainer's ``TransferWeightPusher(barrier=groups.p2r_barrier)`` and
the replica's ``RolloutWorker(p2r_barrier=groups.p2r_barrier)`` on gloo over loopback, one
round per configuration, in order, on the same groups and worker.

Before the barrier carried a word saying what it is, both directions hung until the collective
limit on both sides (the barrier on one side met the manifest header on the other) and then
called the group unusable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from rollout_sync import P2R, RolloutWorker, TransferConfig, TransferWeightPusher, build_sync_groups
from rollout_sync.errors import P2RBarrierMismatch
from rollout_sync.testing import EventLog, RecordingRollout, SyncOutcome, run_group, weights_digest

LIMIT_S = 5.0
"""Every collective's limit. A mismatch must be reported in well under it."""


@dataclass(frozen=True)
class Round:
    trainer: bool
    """The trainer's pusher takes the barrier."""
    replica: bool
    """The replica's worker takes the barrier."""
    missing_on: Literal["trainer", "replica"] | None
    """The side both must name as taking no barrier; ``None``: the sync goes through."""
    trainer_aborts: bool = False
    """The trainer's send aborts (bad storage: ``ValueError``) before any manifest."""


ROUNDS = (
    Round(trainer=True, replica=False, missing_on="replica"),
    Round(trainer=False, replica=True, missing_on="trainer"),
    Round(trainer=False, replica=True, missing_on="trainer", trainer_aborts=True),
    Round(trainer=True, replica=True, missing_on=None),
    Round(trainer=False, replica=False, missing_on=None),
)


FIXES = {
    "replica": "give RolloutWorker p2r_barrier=groups.p2r_barrier, or drop barrier=",
    "trainer": "give the trainer's TransferWeightPusher barrier=groups.p2r_barrier, or drop",
}
"""What each side's error tells its reader to do, by the side that takes no barrier."""


def _weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {"embed.weight": torch.randn(8, 4, generator=gen), "bias": torch.randn(4, generator=gen)}


def _round(rank: int) -> list[tuple[SyncOutcome, Exception | None, str]]:
    """Each round's outcome on this rank, its error (whole), and the served weights' digest."""
    groups = build_sync_groups(trainer=0, replicas=[1], timeout_s=LIMIT_S)
    transfer = groups.p2r_transfer(config=TransferConfig(timeout_s=LIMIT_S))
    assert transfer is not None
    rollout = RecordingRollout(EventLog(), weights=_weights(0))
    worker = RolloutWorker(rollout, p2r=transfer, weight_sync_timeout=LIMIT_S)
    outcomes = []
    for version, r in enumerate(ROUNDS, start=1):
        dist.barrier()  # on the default group: both sides start the round together
        start = time.monotonic()
        if rank == 0:
            pusher = TransferWeightPusher(
                transfer, barrier=groups.p2r_barrier if r.trainer else None
            )
            error: Exception | None = None
            try:
                if r.trainer_aborts:
                    transfer.send(_weights(version), version=version, storage=torch.zeros(1))
                else:
                    pusher.push_weights(_weights(version), version=version, timeout=LIMIT_S)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                error = exc
            outcome = SyncOutcome.of(error, elapsed_s=time.monotonic() - start)
            outcomes.append((outcome, error, ""))
            continue
        worker.p2r_barrier = groups.p2r_barrier if r.replica else None
        result = worker.handle(P2R(step=version))
        outcome = SyncOutcome.of(result, rollout, elapsed_s=time.monotonic() - start)
        digest = weights_digest(rollout.served_weights())
        outcomes.append((outcome, result.exception, digest))
    return outcomes


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_one_sided_p2r_barrier_fails_fast_on_both_sides_and_the_pair_goes_on() -> None:
    values = run_group(_round, 2, timeout_s=75, group_timeout_s=LIMIT_S * 4)
    served, committed = weights_digest(_weights(0)), 0
    for version, (r, (trainer, trainer_error, _), (replica, replica_error, digest)) in enumerate(
        zip(ROUNDS, values[0], values[1], strict=True), start=1
    ):
        where = f"round {version}: {r}"
        if r.missing_on is not None:
            fix = FIXES[r.missing_on]
            if r.trainer_aborts:  # it reports its own reason; the replica names the barrier
                assert type(trainer_error) is ValueError, (where, trainer_error)
            for side, error in ((trainer, trainer_error), (replica, replica_error))[
                r.trainer_aborts :
            ]:
                assert isinstance(error, P2RBarrierMismatch), (where, error)
                assert error.missing_on == r.missing_on and fix in str(error), where
                assert side.elapsed_s < LIMIT_S / 2, (where, side.elapsed_s)
        else:
            assert trainer.ok and replica.ok, (where, trainer_error, replica_error)
            served, committed = weights_digest(_weights(version)), version
        # A refused round wrote nothing: the last round's weights and version, whole.
        assert (digest, replica.version, replica.servable) == (served, committed, True), where
