"""Sharded transfers between real processes (gloo, loopback): two trainer ranks holding FSDP
shards push to replicas of two tensor-parallel ranks, through the trainer callback and the
rollout worker, as a job runs them. Every byte leaves the trainer rank that owns it once; a
bad plan, bad tensors or a bad bucket is refused; a trainer rank killed mid-plan leaves no
replica rank serving torn weights."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
from sharded_helpers import equal, large_model, rows_to_columns, served

from rollout_sync import RolloutWorker, WeightBroadcastCallback
from rollout_sync.errors import (
    ChecksumMismatchError,
    ManifestRejected,
    TornWeightsError,
    TransferPlanMismatch,
    WeightMismatchError,
    WeightTransferError,
)
from rollout_sync.sharded_groups import ShardedSyncGroups, build_sharded_sync_groups
from rollout_sync.testing import (
    FaultSchedule,
    IdleFlatRollout,
    Kill,
    SyncOutcome,
    fault_point,
    run_group,
    transfer_fault_hooks,
)
from rollout_sync.trainer import TransferWeightPusher
from rollout_sync.transfer import (
    Layout,
    ShardedTransfer,
    TransferConfig,
    TransferHooks,
    TransferPlan,
    WeightTransfer,
)
from rollout_sync.worker import P2R, R2R

TRAINERS = (0, 1)


def _model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    shapes = {
        "embed": (32, 16),
        "q": (16, 16),
        "k": (16, 16),
        "v": (16, 16),
        "o": (16, 16),
        "up": (48, 16),
        "down": (16, 48),
        "norm": (16,),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _layouts() -> tuple[Layout, Layout]:
    model = _model(0)
    # The trainer: FSDP2-style, every tensor cut along dim 0 over its two ranks.
    trainer = Layout.build(model, 2, shard={n: 0 for n in model})
    # A replica of two tensor-parallel ranks: q/k/v column-parallel and fused, o and down
    # row-parallel, up column-parallel, the embedding vocab-parallel, the norm replicated.
    replica = Layout.build(
        model,
        2,
        shard={"embed": 0, "q": 0, "k": 0, "v": 0, "o": 1, "up": 0, "down": 1},
        fuse={"qkv": (("q", "k", "v"), 0)},
    )
    return trainer, replica


def _job_child(rank: int) -> dict[str, Any]:
    """Trainers 0, 1; replicas [2, 3] and [4, 5]."""
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3), (4, 5)], timeout_s=20)
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=20)
    out: dict[str, Any] = {}
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=config)
        assert transfer is not None
        version_weights = {"v": 1}

        def weights() -> dict[str, torch.Tensor]:
            return trainer_layout.shard(_model(version_weights["v"]), rank)

        callback = WeightBroadcastCallback(
            weights, pusher=TransferWeightPusher(transfer), sync_on_run_begin=False
        )
        callback.sync(step=1)  # version 1, through the callback, on both trainer ranks at once
        out["sent"] = callback.pusher.last_stats.nbytes  # type: ignore[attr-defined]
        # A plan mismatch: rank 3 builds its transfer with another bucket size.
        out["mismatch"] = _raised(lambda: transfer.send(weights(), version=2))
        # Rank 2 serves a tensor of the wrong shape: refused everywhere.
        out["rejected"] = _raised(lambda: transfer.send(weights(), version=2))
        # A bucket of trainer rank 1's corrupted after its checksum: the receiver refuses it.
        if rank == 1:
            transfer.hooks = TransferHooks(
                after_pack=lambda k, b: b[:4].fill_(7) if k == 1 else None
            )
        version_weights["v"] = 2
        out["corrupt"] = _raised(lambda: transfer.send(weights(), version=2))
        transfer.hooks = TransferHooks()
        version_weights["v"] = 3
        callback.sync(step=3)  # the group is still usable
        return out
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(_model(0), k))
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(plan, config=config),
        r2r=groups.r2r_transfer(config=config),
        weight_sync_timeout=20,
    )
    try:
        if j == 0:
            assert worker.handle(P2R(step=1, relay=True)).ok
        else:
            assert worker.handle(R2R(step=1)).ok
        out["v1"] = equal(served(backend), replica_layout.shard(_model(1), k))
        if j == 0:
            p2r = worker.p2r
            assert isinstance(p2r, ShardedTransfer)
            other = TransferConfig(bucket_bytes=2048, checksums=True, timeout_s=20)
            odd = groups.p2r_transfer(plan, config=other if rank == 3 else config)
            assert odd is not None
            before = served(backend)
            out["mismatch"] = _raised(lambda: odd.receive(backend.served_weights()))
            bad = dict(backend.served_weights())
            if rank == 2:
                bad["norm"] = torch.zeros(3)
            out["rejected"] = _raised(lambda: p2r.receive(bad))
            out["untouched"] = equal(served(backend), before)
            result = worker.handle(P2R(step=2))
            out["corrupt"] = SyncOutcome.of(result, backend)
            assert worker.handle(P2R(step=3, relay=True)).ok
        else:
            assert worker.handle(R2R(step=3)).ok
        out["v3"] = equal(served(backend), replica_layout.shard(_model(3), k))
        out["version"] = backend.weight_version
    finally:
        worker.close(10)
    return out


def _raised(call: Any) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # reported to the parent whole: the package's errors pickle
        return exc
    return None


@pytest.mark.timeout(120)
def test_a_sharded_trainer_pushes_to_tensor_parallel_replicas_through_callback_and_worker() -> None:
    results = run_group(_job_child, 6, timeout_s=120, group_timeout_s=20)
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    # Every replica rank holds exactly its slice of version 1, then of version 3.
    for rank in (2, 3, 4, 5):
        assert results[rank]["v1"] and results[rank]["v3"], rank
        assert results[rank]["version"] == 2, rank  # the callback's second push
    # Each trainer rank sent only what the plan gives it: about half the bytes, and together
    # each byte of the replica once (the replicated norm once per tensor-parallel rank).
    model_bytes = sum(t.numel() * 4 for t in _model(0).values())
    sent = [results[r]["sent"] for r in TRAINERS]
    assert sent == [plan.bytes_sent(0), plan.bytes_sent(1)]
    assert sum(sent) == model_bytes + 16 * 4  # the norm twice
    assert max(sent) <= 0.55 * model_bytes
    # A plan mismatch is refused on every rank of the P2R group before any byte moves.
    for rank in (0, 1, 2, 3):
        exc = results[rank]["mismatch"]
        assert isinstance(exc, TransferPlanMismatch), (rank, exc)
        assert exc.rejected_by == (3,)
    # A tensor that does not match the layout: its rank's own error, everyone else refuses.
    assert isinstance(results[2]["rejected"], WeightMismatchError)
    assert "norm" in str(results[2]["rejected"])
    for rank in (0, 1, 3):
        exc = results[rank]["rejected"]
        assert isinstance(exc, ManifestRejected) and exc.rejected_by == (2,), (rank, exc)
    assert results[2]["untouched"] and results[3]["untouched"]
    # A corrupted bucket: the rank that got it refuses it and stays servable only if it wrote
    # nothing; nobody commits version 2.
    outcomes = [results[r]["corrupt"] for r in (2, 3)]
    assert any(o.failed_with(ChecksumMismatchError) for o in outcomes)
    assert all(o.error is not None and o.version == 1 for o in outcomes)
    for rank in (0, 1):
        assert isinstance(results[rank]["corrupt"], WeightTransferError)


KILLED_LIMIT_S = 15.0
"""The killed-trainer test's transfer limit: every survivor must fail well inside it."""
FAST_S = 5.0
"""A failure seen "at once": a dead peer's closed connection, or a peer's abort flag."""


def _killed_child(rank: int) -> dict[str, Any]:
    """Trainers 0, 1; replica 0 = ranks 2, 3 (P2R, then the R2R source), replica 1 = 4, 5.

    Version 2's P2R: trainer rank 1 dies between two buckets of a receiving rank (after some
    replica rank took its first bucket, before its second leaves). Then the R2R of version 2,
    then a re-seed of replica 0 from replica 1's whole version 1 over the R2R group."""
    trainer_layout, replica_layout = rows_to_columns()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3), (4, 5)], timeout_s=KILLED_LIMIT_S)
    config = TransferConfig(bucket_bytes=64 * 1024, checksums=True, timeout_s=KILLED_LIMIT_S)
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=config)
        assert transfer is not None
        transfer.send(trainer_layout.shard(large_model(1), rank), version=1)
        transfer.hooks = transfer_fault_hooks()  # trainer rank 1 dies mid-version 2
        started = time.monotonic()
        error = _raised(
            lambda: transfer.send(trainer_layout.shard(large_model(2), rank), version=2)
        )
        elapsed = time.monotonic() - started
        store.set("trainer_done", "1")
        # Rank 0 hosts the job's store (the abort flag, the fault's signal): it stays up
        # until the replicas are done.
        store.wait([f"done/{r}" for r in (2, 3, 4, 5)], datetime.timedelta(seconds=60))
        return {"error": error, "elapsed": elapsed}
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(large_model(0), k))
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(plan, config=config),
        r2r=groups.r2r_transfer(config=config),
        weight_sync_timeout=KILLED_LIMIT_S,
    )
    out: dict[str, Any] = {}
    try:
        if j == 0:
            assert worker.handle(P2R(step=1)).ok
        assert worker.handle(R2R(step=1)).ok
        if j == 0:
            assert isinstance(worker.p2r, ShardedTransfer)
            worker.p2r.hooks = transfer_fault_hooks()  # after_receive k: the kill's signal
            started = time.monotonic()
            out["p2r"] = SyncOutcome.of(
                worker.handle(P2R(step=2)), backend, elapsed_s=time.monotonic() - started
            )
            out["written"] = _written(backend, replica_layout, k)
        started = time.monotonic()
        out["r2r"] = SyncOutcome.of(
            worker.handle(R2R(step=2)), backend, elapsed_s=time.monotonic() - started
        )
        out["servable"] = _servable(backend)
        # Recovery: replica 0 is re-seeded from replica 1 (whole at version 1) over the R2R
        # group, untouched by the dead trainer rank.
        r2r = worker.r2r
        assert isinstance(r2r, WeightTransfer)
        reseed = WeightTransfer(r2r.group, groups.replicas[1][k], config=config)
        stats = worker.reseed(reseed)
        out["reseeded"] = (stats.version, backend.weight_version, _servable(backend))
        out["whole_v1"] = equal(served(backend), replica_layout.shard(large_model(1), k))
        return out
    finally:
        worker.close(10)
        # No replica rank leaves (closing its connections, which a waiting trainer rank would
        # see at once) before the surviving trainer rank's send ended on its own.
        store.wait(["trainer_done"], datetime.timedelta(seconds=60))
        store.set(f"done/{rank}", "1")


def _written(backend: IdleFlatRollout, layout: Layout, k: int) -> bool:
    """Whether any element of this replica rank's tensors differs from version 1."""
    return not equal(served(backend), layout.shard(large_model(1), k))


def _servable(backend: IdleFlatRollout) -> bool | str:
    try:
        backend.check_servable()
    except TornWeightsError as exc:
        return str(exc)
    return True


@pytest.mark.timeout(120)
def test_a_trainer_rank_killed_between_two_buckets_fails_every_rank_fast_and_closed() -> None:
    results = run_group(
        _killed_child,
        6,
        timeout_s=120,
        group_timeout_s=KILLED_LIMIT_S,
        faults=FaultSchedule(Kill(1, "after_pack", 1, after="after_receive:0")),
    )
    # Item 1: every replica rank fails with the transfer's typed error, at once; one that
    # wrote anything is torn and refuses to serve; one that wrote nothing serves version 1.
    wrote = []
    for rank in (2, 3):
        p2r = results[rank]["p2r"]
        assert p2r.failed_with(WeightTransferError), (rank, p2r)
        assert p2r.elapsed_s < FAST_S, (rank, p2r)
        if results[rank]["written"]:
            wrote.append(rank)
            assert p2r.servable is False, (rank, p2r)
            assert "refuses to generate" in results[rank]["servable"]
            # A torn source never sends: its R2R aborts at once.
            assert results[rank]["r2r"].failed_with(TornWeightsError), results[rank]["r2r"]
        else:
            assert p2r.servable is True and p2r.version == 1, (rank, p2r)
    assert wrote, "the kill struck after a receiving rank's first bucket: something was written"
    # Item 2: the surviving trainer rank learns of the death through the abort flag, at once.
    assert isinstance(results[0]["error"], WeightTransferError), results[0]
    assert results[0]["elapsed"] < FAST_S, results[0]
    # The R2R receivers of a torn source hear its abort at once: nothing is written there.
    for rank in (4, 5):
        r2r = results[rank]["r2r"]
        source = rank - 2
        if source in wrote:
            assert r2r.failed_with(ManifestRejected), (rank, r2r)
            assert r2r.elapsed_s < FAST_S, (rank, r2r)
        assert r2r.servable is True and r2r.version == 1, (rank, r2r)
    # Nothing committed version 2 anywhere; the re-seed makes replica 0 whole again.
    for rank in (2, 3):
        assert results[rank]["reseeded"] == (1, 1, True), results[rank]
    assert all(results[r]["whole_v1"] for r in (2, 3, 4, 5))


def _chain_child(rank: int) -> dict[str, Any]:
    """Trainers 0, 1; replicas [2, 3] -> [4, 5] -> [6, 7]: a relay chain (fanout 1)."""
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    replicas = [(2, 3), (4, 5), (6, 7)]
    groups = build_sharded_sync_groups(TRAINERS, replicas, timeout_s=20, fanout=1)
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=20)
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=config)
        assert transfer is not None
        transfer.send(trainer_layout.shard(_model(1), rank), version=1)
        return {}
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(_model(0), k))
    roles: list[str] = []
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(plan, config=config),
        r2r=groups.r2r_transfer(config=config),
        weight_sync_timeout=20,
        on_transfer=lambda stats, tensors: roles.append(stats.role),
    )
    try:
        command = P2R(step=1, relay=True) if j == 0 else R2R(step=1)
        result = worker.handle(command)
        assert result.ok, result.error
    finally:
        worker.close(10)
    whole = equal(served(backend), replica_layout.shard(_model(1), k))
    return {"roles": roles, "whole": whole, "version": backend.weight_version}


@pytest.mark.timeout(90)
def test_replicas_relay_rank_to_rank_along_a_chain() -> None:
    results = run_group(_chain_child, 8, timeout_s=90, group_timeout_s=20)
    for rank in range(2, 8):
        assert results[rank]["whole"] and results[rank]["version"] == 1, rank
    # The first and the middle replica pass their slices on; the last only receives.
    assert [results[r]["roles"] for r in range(2, 8)] == [["relay"]] * 4 + [["receive"]] * 2


def _tree_killed_child(rank: int) -> dict[str, Any]:
    """The chain of ``_chain_child`` with the large model; version 2's inner relay rank 4 dies
    between two buckets of its leaf rank 6 (after rank 6 took bucket 1)."""
    trainer_layout, replica_layout = rows_to_columns()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3), (4, 5), (6, 7)], fanout=1)
    config = TransferConfig(bucket_bytes=64 * 1024, checksums=True, timeout_s=KILLED_LIMIT_S)
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=config)
        assert transfer is not None
        for version in (1, 2):
            transfer.send(trainer_layout.shard(large_model(version), rank), version=version)
        store.wait([f"done/{r}" for r in (2, 3, 5, 6, 7)], datetime.timedelta(seconds=60))
        return {}
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(large_model(0), k))
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(plan, config=config),
        r2r=groups.r2r_transfer(config=config),
        weight_sync_timeout=KILLED_LIMIT_S,
    )
    try:
        command = P2R if j == 0 else R2R
        assert worker.handle(command(step=1, **({"relay": True} if j == 0 else {}))).ok
        incoming = getattr(worker.r2r, "incoming", worker.r2r)
        assert isinstance(incoming, WeightTransfer)
        if rank == 4:  # the victim: its own bucket arrivals are its kill's fault point
            incoming.hooks = transfer_fault_hooks()
        if rank == 6:  # the leaf: each bucket it takes is announced to the victim
            incoming.hooks = TransferHooks(after_receive=lambda k, b: fault_point("leaf", k))
        started = time.monotonic()
        result = worker.handle(command(step=2, **({"relay": True} if j == 0 else {})))
        outcome = SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started)
        written = not equal(served(backend), replica_layout.shard(large_model(1), k))
        return {"outcome": outcome, "written": written, "servable": _servable(backend)}
    finally:
        worker.close(10)
        store.set(f"done/{rank}", "1")


@pytest.mark.timeout(120)
def test_an_inner_relay_killed_between_two_buckets_of_its_leaf_leaves_the_leaf_torn() -> None:
    results = run_group(
        _tree_killed_child,
        8,
        timeout_s=120,
        group_timeout_s=KILLED_LIMIT_S,
        faults=FaultSchedule(Kill(4, "after_receive", 3, after="leaf:1")),
    )
    leaf = results[6]["outcome"]
    assert leaf.failed_with(WeightTransferError) and leaf.elapsed_s < FAST_S, leaf
    assert results[6]["written"], "the leaf took buckets 0 and 1 before its relay died"
    assert leaf.servable is False and leaf.version == 1, leaf
    assert "refuses to generate" in results[6]["servable"]
    # The root relay received version 2 whole from the trainers: its forward failed, so it
    # commits and reports (RelayForwardError); the other position's chain is untouched.
    assert results[2]["outcome"].failed_with(WeightTransferError)
    assert results[2]["outcome"].version == 2 and results[2]["outcome"].servable is True
    for rank in (3, 5, 7):
        assert results[rank]["outcome"].error is None and results[rank]["outcome"].version == 2


def test_a_relay_tree_of_fanout_two_is_a_heap_and_fanout_none_one_broadcast() -> None:
    replicas = tuple((r,) for r in range(1, 8))
    tree = ShardedSyncGroups((0,), replicas, None, (), fanout=2)
    assert [tree.children(j) for j in range(7)] == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert [tree.parent(j) for j in range(7)] == [None, 0, 0, 1, 1, 2, 2]
    flat = ShardedSyncGroups((0,), replicas, None, ())
    assert flat.children(0) == [1, 2, 3, 4, 5, 6] and flat.parent(6) == 0
    with pytest.raises(ValueError, match="fanout >= 1"):
        build_sharded_sync_groups((0,), replicas, fanout=0)


def _write_fails_child(rank: int) -> dict[str, Any]:
    """Trainers 0, 1; one replica of ranks 2, 3. Rank 2's handling of its second bucket raises
    an error of a type nobody raises on purpose (after its first bucket was written)."""
    trainer_layout, replica_layout = rows_to_columns()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3)], timeout_s=KILLED_LIMIT_S)
    config = TransferConfig(bucket_bytes=64 * 1024, checksums=True, timeout_s=KILLED_LIMIT_S)
    transfer = groups.p2r_transfer(plan, config=config)
    assert transfer is not None
    started = time.monotonic()
    if rank in TRAINERS:
        error = _raised(
            lambda: transfer.send(trainer_layout.shard(large_model(1), rank), version=1)
        )
        return {"error": error, "elapsed": time.monotonic() - started}

    def broken(k: int, bucket: torch.Tensor) -> None:
        if rank == 2 and k == 1:
            raise RuntimeError("the engine's copy failed")

    transfer.hooks = TransferHooks(after_receive=broken)
    into = replica_layout.shard(large_model(0), rank - 2)
    error = _raised(lambda: transfer.receive(into))
    return {"error": error, "elapsed": time.monotonic() - started}


@pytest.mark.timeout(120)
def test_a_write_that_fails_part_way_tears_its_rank_and_fails_every_rank_fast() -> None:
    """Fail closed, and nobody waits out a limit: the failing rank keeps receiving (its sources
    are not left blocked), votes no and raises the transfer's typed error saying it wrote; its
    peers fail at the commit vote, at once."""
    results = run_group(_write_fails_child, 4, timeout_s=120, group_timeout_s=KILLED_LIMIT_S)
    own = results[2]["error"]
    assert isinstance(own, WeightTransferError) and own.targets_torn, own
    assert "RuntimeError" in str(own)  # the cause, named (chained in the process)
    for rank in (0, 1, 2, 3):
        assert isinstance(results[rank]["error"], WeightTransferError), results[rank]
        assert results[rank]["elapsed"] < FAST_S, results[rank]
