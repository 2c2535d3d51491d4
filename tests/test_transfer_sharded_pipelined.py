"""The pipelined sharded relay between real processes (gloo, loopback): two trainer ranks
holding FSDP shards push to the first of two replicas of two tensor-parallel ranks, whose every
rank passes each bucket of its slice on to the same rank of the other replica as soon as its
tensors have arrived (``ShardedTransfer(pipelined_relay=True)``), through the rollout worker.

It overlaps the hops (the first bucket goes on before the last arrives, where the two-hop relay
waits for all of them), lands bit-identically in place and staged, and its verdict makes a
staged version land on every rank of every replica or on none: a relay rank killed mid-bucket
leaves nothing torn, and the other position, whose own hop went through, discards too (the
two-hop relay, which has no verdict, leaves that position on the new version: the mix)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
from sharded_helpers import equal, large_model, rows_to_columns, served

from rollout_sync import RolloutWorker, SyncMode
from rollout_sync.errors import WeightTransferError
from rollout_sync.sharded_groups import ShardedSyncGroups, build_sharded_sync_groups
from rollout_sync.testing import (
    FaultSchedule,
    IdleFlatRollout,
    Kill,
    SyncOutcome,
    run_group,
    transfer_fault_hooks,
)
from rollout_sync.transfer import TransferConfig, TransferHooks, TransferPlan
from rollout_sync.worker import P2R, R2R

TRAINERS = (0, 1)
REPLICAS = ((2, 3), (4, 5))
LIMIT_S = 15.0
FAST_S = 5.0


def _job(rank: int, *, pipelined: bool, mode: SyncMode, faults: bool) -> dict[str, Any]:
    """Versions 1 and 2 through the worker; with ``faults`` the R2R transfers get fault hooks
    (version 2 is where the test's kill strikes)."""
    trainer_layout, replica_layout = rows_to_columns()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, REPLICAS, timeout_s=LIMIT_S)
    config = TransferConfig(bucket_bytes=64 * 1024, checksums=True, timeout_s=LIMIT_S)
    store = torch.distributed.distributed_c10d._get_default_store()
    replica_ranks = [r for ranks in REPLICAS for r in ranks]
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=config)
        assert transfer is not None
        errors = []
        for version in (1, 2):
            try:
                transfer.send(trainer_layout.shard(large_model(version), rank), version=version)
            except WeightTransferError as exc:
                errors.append(exc)
        store.set(f"trainer_done/{rank}", "1")
        # Rank 0 hosts the job's store: it stays up until the replicas are done.
        store.wait([f"done/{r}" for r in replica_ranks if r != 3], datetime.timedelta(seconds=60))
        return {"errors": errors}
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(large_model(0), k))
    events: list[tuple[str, int, float]] = []
    p2r = groups.p2r_transfer(plan, config=config, pipelined_relay=pipelined)
    r2r = groups.r2r_transfer(config=config)
    if p2r is not None:  # the relay's arrivals, and what it passes on, in time
        p2r.hooks = TransferHooks(
            after_receive=lambda n, b: events.append(("p2r arrived", n, time.monotonic()))
        )
    worker = RolloutWorker(backend, mode=mode, p2r=p2r, r2r=r2r, weight_sync_timeout=LIMIT_S)
    out: dict[str, Any] = {}
    try:
        command = P2R(step=1, relay=True) if j == 0 else R2R(step=1)
        if j == 0 and r2r is not None:
            r2r.hooks = TransferHooks(
                after_pack=lambda n, b: events.append(("r2r packed", n, time.monotonic()))
            )
        result = worker.handle(command)
        assert result.ok, result.error
        out["v1"] = equal(served(backend), replica_layout.shard(large_model(1), k))
        out["events"] = list(events)
        if faults and r2r is not None:
            r2r.hooks = transfer_fault_hooks()  # the victim's sends, its leaf's arrivals
        started = time.monotonic()
        command = P2R(step=2, relay=True) if j == 0 else R2R(step=2)
        out["v2"] = SyncOutcome.of(
            worker.handle(command), backend, elapsed_s=time.monotonic() - started
        )
        out["whole"] = {
            v: equal(served(backend), replica_layout.shard(large_model(v), k)) for v in (1, 2)
        }
        return out
    finally:
        worker.close(10)
        store.wait([f"trainer_done/{r}" for r in TRAINERS], datetime.timedelta(seconds=60))
        store.set(f"done/{rank}", "1")


def _pipelined_job(rank: int) -> dict[str, Any]:
    return _job(rank, pipelined=True, mode=SyncMode.SYNC, faults=False)


def _two_hop_job(rank: int) -> dict[str, Any]:
    return _job(rank, pipelined=False, mode=SyncMode.SYNC, faults=False)


def _first_pass_before_last_arrival(events: list[tuple[str, int, float]]) -> bool:
    """Whether the relay passed its first bucket on before its last one arrived."""
    arrived = [t for what, _, t in events if what == "p2r arrived"]
    packed = [t for what, _, t in events if what == "r2r packed"]
    return bool(arrived and packed) and min(packed) < max(arrived)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("job", "overlaps"), [(_pipelined_job, True), (_two_hop_job, False)])
def test_the_pipelined_relay_passes_buckets_on_as_they_arrive_and_lands_bit_identical(
    job: Any, overlaps: bool
) -> None:
    results = run_group(job, 6, timeout_s=120, group_timeout_s=LIMIT_S)
    for rank in (2, 3, 4, 5):
        assert results[rank]["v1"], rank
        outcome = results[rank]["v2"]
        assert outcome.error is None and outcome.version == 2, (rank, outcome)
        assert results[rank]["whole"][2], rank
    for rank in (2, 3):  # each relay rank: the hops overlap only when pipelined
        assert _first_pass_before_last_arrival(results[rank]["events"]) is overlaps, rank
    assert all(not results[r]["errors"] for r in TRAINERS)


def _killed_job(rank: int, pipelined: bool) -> dict[str, Any]:
    return _job(rank, pipelined=pipelined, mode=SyncMode.STAGED, faults=True)


def _killed_pipelined(rank: int) -> dict[str, Any]:
    return _killed_job(rank, True)


def _killed_two_hop(rank: int) -> dict[str, Any]:
    return _killed_job(rank, False)


# Relay rank 3 (the first replica's second rank) dies after packing bucket 3 of its R2R, once
# its leaf, rank 5, took bucket 1: mid-bucket of the second hop.
RELAY_KILLED = FaultSchedule(Kill(3, "after_pack", 3, after="after_receive:1"))


@pytest.mark.timeout(120)
def test_a_relay_rank_killed_mid_bucket_leaves_every_staged_replica_on_its_version() -> None:
    results = run_group(
        _killed_pipelined, 6, timeout_s=120, group_timeout_s=LIMIT_S, faults=RELAY_KILLED
    )
    # Nothing torn, nothing installed: every surviving replica rank still serves version 1,
    # byte for byte, and learned of the death within moments, not at its limit. Rank 4's own
    # hop (from rank 2) went through: the verdict is what keeps it on version 1.
    for rank in (2, 4, 5):
        outcome = results[rank]["v2"]
        assert outcome.failed_with(WeightTransferError), (rank, outcome)
        assert outcome.servable is True and outcome.version == 1, (rank, outcome)
        assert outcome.elapsed_s < FAST_S, (rank, outcome)
        assert results[rank]["whole"][1], rank
    for rank in TRAINERS:
        assert len(results[rank]["errors"]) == 1, results[rank]


@pytest.mark.timeout(120)
def test_without_the_verdict_the_same_kill_leaves_the_replicas_on_mixed_versions() -> None:
    """The two-hop relay, whose hops each commit on their own: the counterfactual."""
    results = run_group(
        _killed_two_hop, 6, timeout_s=120, group_timeout_s=LIMIT_S, faults=RELAY_KILLED
    )
    # Position 0 (ranks 2 and 4) installed version 2; position 1's leaf (rank 5) did not.
    assert results[2]["v2"].version == 2 and results[4]["v2"].version == 2
    assert results[5]["v2"].version == 1 and results[5]["v2"].failed_with(WeightTransferError)


def test_a_pipelined_sharded_relay_refuses_a_relay_tree() -> None:
    trainer_layout, replica_layout = rows_to_columns()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    tree = ShardedSyncGroups(TRAINERS, ((2, 3), (4, 5), (6, 7)), None, (), fanout=1)
    with pytest.raises(ValueError, match="relay tree"):
        tree.p2r_transfer(plan, pipelined_relay=True)
