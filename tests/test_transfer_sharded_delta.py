"""Delta syncs over sharded transfers between real processes (gloo, loopback): two trainer ranks
holding FSDP rows push region deltas to a replica of two tensor-parallel ranks (fused qkv,
row- and column-parallel, a replicated norm: regions cut across tensors, an uneven plan).

One run goes through the cases in order, each checked on every rank: the first sync goes
whole, the next ones by delta and bit-identical to the trainer's version on every target
rank; a target that holds another version (re-seeded, or other bytes under the same number)
makes the sync whole, in the same call; every hostile payload (positions out of range,
unsorted, repeated, a wrong digest, a truncated payload) is refused before any write by the
rank that got it, the rank that applied its own part restores it, both keep their version,
and the next sync lands. A second run kills a trainer rank mid-delta: the targets keep their
version, untouched. A third drives it all through the pusher and the worker, in place and
staged, with a second replica fed by the relay's R2R delta.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

import pytest
import torch
from test_transfer_sharded import _layouts, _model

from rollout_sync import RolloutWorker, SyncMode
from rollout_sync.errors import DeltaRefused, WeightTransferError
from rollout_sync.sharded_groups import build_sharded_sync_groups
from rollout_sync.testing import (
    FaultSchedule,
    IdleFlatRollout,
    Kill,
    run_group,
    transfer_fault_hooks,
)
from rollout_sync.trainer import TransferWeightPusher
from rollout_sync.transfer import ShardedTransfer, TransferConfig, TransferPlan
from rollout_sync.transfer._sharded_delta import ShardedDelta, ShardedReceivedDelta
from rollout_sync.transfer.delta import BlockKind, pack_delta, unpack_delta
from rollout_sync.transfer.delta_sync import DeltaTarget, DigestCache, WholeReason
from rollout_sync.worker import P2R, R2R

pytestmark = pytest.mark.multiprocess

TRAINERS = (0, 1)
LIMIT_S = 15.0
FAST_S = 5.0
CONFIG = TransferConfig(bucket_bytes=256, checksums=True, timeout_s=LIMIT_S)
"""Small buckets: every pair's payload goes in several chunks."""


def _version(version: int) -> dict[str, torch.Tensor]:
    """Version 1 is the test model; each later one changes about 3 % of every tensor."""
    out = _model(1)
    for step in range(2, version + 1):
        gen = torch.Generator().manual_seed(1000 + step)
        for tensor in out.values():
            flat = tensor.view(-1)
            changed = torch.randperm(flat.numel(), generator=gen)[: max(2, flat.numel() // 32)]
            flat[changed] += 0.25
    return out


def _hostile(encoded: ShardedDelta, case: str, plan: TransferPlan) -> ShardedDelta:
    """``encoded`` (source rank 1's) with its payload to target rank 0 made wrong in one way."""
    moves = plan.pair(1, 0)
    payload = encoded.payloads[0].clone()
    count = int(payload[8:16].view(torch.int64))
    table = payload[16 : 16 + 24 * count].view(torch.int64).view(-1, 3)
    at = 16 + 24 * count
    for row in range(count):  # the first region with a block of positions, two at least
        nbytes = int(table[row, 0])
        if nbytes:
            numel = 1
            for start, stop in moves[row].target_box:
                numel *= stop - start
            packed = payload[at : at + nbytes].clone()
            delta = unpack_delta(packed, numel=numel, dtype=torch.float32)
            block = delta.blocks[0]
            if block.kind is BlockKind.POSITIONS and block.count >= 2:
                break
        at += nbytes + (-nbytes % 8)
    else:
        raise AssertionError("no region with a block of two positions or more")
    if case == "wrong_digest":
        table[row, 2] += 1
    elif case == "truncated":
        payload = payload[:-8]
    else:
        offsets = block.payload.clone()
        words = offsets[: 2 * block.count].view(torch.int16)
        if case == "out_of_range":
            words[-1] = -1  # the bits of 65535, past the region's end
        elif case == "unsorted":
            words[0], words[1] = words[1].clone(), words[0].clone()
        else:
            words[1] = words[0]
        blocks = (dataclasses.replace(block, payload=offsets), *delta.blocks[1:])
        repacked = pack_delta(dataclasses.replace(delta, blocks=blocks))
        assert repacked.numel() == nbytes
        payload[at : at + nbytes] = repacked
    return dataclasses.replace(encoded, payloads={**encoded.payloads, 0: payload})


HOSTILE = {
    "out_of_range": "out of range",
    "unsorted": "not strictly increasing",
    "repeated": "not strictly increasing",
    "wrong_digest": "would not equal the sender's version",
    "truncated": "truncated",
}


def _outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - reported to the test whole
        return exc


class _FailingPuts(DigestCache):
    """A digest cache whose ``put`` raises once ``fail`` is set: an apply that fails after its
    writes, with an error of a type nobody raises on purpose."""

    fail = False

    def put(self, name: str, version: int, digest: tuple[int, int]) -> None:
        if self.fail:
            raise RuntimeError("injected: the digest cache broke")
        super().put(name, version, digest)


def _raw_child(rank: int) -> list[tuple[Any, ...]]:
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3)], timeout_s=LIMIT_S)
    transfer = groups.p2r_transfer(plan, config=CONFIG)
    assert transfer is not None
    log: list[tuple[Any, ...]] = []
    if rank in TRAINERS:
        encoder = transfer.delta_encoder()
        version = 0

        def push(tamper: str | None = None) -> Any:
            nonlocal version
            version += 1
            weights = trainer_layout.shard(_version(version), rank)
            encoded = encoder.encode(weights, version)
            if tamper is not None and rank == 1:
                assert isinstance(encoded, ShardedDelta)
                encoded = _hostile(encoded, tamper, plan)
            stats = _outcome(lambda: transfer.send(weights, version=version, delta=encoded))
            if isinstance(stats, Exception):
                version -= 1  # refused: the next sync sends it again
                return stats
            sent = encoded if stats.sync_kind == "delta" else None
            encoder.committed(weights, version, sent)
            return (stats.version, stats.sync_kind, stats.whole_reason, stats.nbytes)

        for _ in range(5):  # whole, delta, whole (re-seeded), whole (other bytes), delta
            log.append(push())
        for case in HOSTILE:
            log.append((case, push(case)))
        log.append(push())
        log.append(("apply_fails_late", push()))
        log.append(("extra", encoder.extra_bytes, trainer_layout.local_specs(rank)))
        return log
    k = rank - 2
    served = replica_layout.shard(_model(0), k)
    digests: DigestCache = _FailingPuts()
    held: int | None = 0

    def take() -> Any:
        nonlocal held
        target = DeltaTarget(served, held, digests)
        stats = _outcome(lambda: transfer.receive(served, delta=target))
        if isinstance(stats, Exception):
            return stats
        held = stats.version
        exact = all(
            torch.equal(served[n], t) for n, t in replica_layout.shard(_version(held), k).items()
        )
        return (stats.version, stats.sync_kind, stats.whole_reason, exact)

    for step in range(1, 6):
        if step == 3 and rank == 3:
            held = None  # re-seeded from elsewhere: it holds no version the trainer knows
        if step == 4 and rank == 3:
            # Other bytes under the right number (restored from elsewhere): its fresh digests
            # of its regions differ from the trainer's base.
            digests = DigestCache()
            next(iter(served.values())).view(-1)[0] += 1.0
        log.append(take())
    for case in HOSTILE:
        before = {n: t.clone() for n, t in served.items()}
        error = take()
        untouched = all(torch.equal(before[n], served[n]) for n in served)
        log.append((case, held, error, untouched))
    log.append(take())
    if isinstance(digests, _FailingPuts) and rank == 2:
        digests.fail = True
    before = {n: t.clone() for n, t in served.items()}
    error = take()
    log.append(("apply_fails_late", error, all(torch.equal(before[n], served[n]) for n in served)))
    return log


@pytest.mark.timeout(120)
def test_sharded_deltas_land_bit_identical_fall_back_whole_and_refuse_hostile_input() -> None:
    results = run_group(_raw_child, 4, timeout_s=110, group_timeout_s=LIMIT_S)
    first = WholeReason.FIRST.value
    receiver = WholeReason.RECEIVER.value
    expected = [
        (1, "whole", first),
        (2, "delta", None),
        (3, "whole", receiver),  # rank 3 held no version
        (4, "whole", receiver),  # rank 3's bytes differed: its regions' fingerprints
        (5, "delta", None),
    ]
    for rank in TRAINERS:
        log = results[rank]
        assert [entry[:3] for entry in log[:5]] == expected, rank
        _, _, specs = log[-1]
        full = sum(s.nbytes for s in specs.values())
        assert log[-1][1] == full  # one copy of its local tensors
        assert 0 < log[1][3] < 0.5 * full, log[1]  # the delta's bytes: a fraction
        for i, case in enumerate(HOSTILE):
            tag, error = log[5 + i]
            assert tag == case and isinstance(error, WeightTransferError), (rank, case, error)
        assert log[5 + len(HOSTILE)][:3] == (6, "delta", None), rank
        tag, error = log[6 + len(HOSTILE)]
        assert tag == "apply_fails_late" and isinstance(error, WeightTransferError), error
    for rank in (2, 3):
        log = results[rank]
        assert [entry[:3] for entry in log[:5]] == expected, rank
        assert all(entry[3] for entry in log[:5]), rank  # bit-identical each time
        for i, case in enumerate(HOSTILE):
            tag, held, error, untouched = log[5 + i]
            assert tag == case and held == 5 and untouched, (rank, case, error)
            assert isinstance(error, WeightTransferError), (rank, case, error)
            assert error.tensors_written == 0, (rank, case, error)
            if rank == 2:  # the rank that got the bad payload names the problem
                assert isinstance(error, DeltaRefused), (case, error)
                assert HOSTILE[case] in str(error), (case, str(error))
        assert log[-2] == (6, "delta", None, True), rank
        # An apply that failed after its writes (not by a refusal): rank 2 is torn and says
        # so, never "nothing was written"; rank 3 put its own part back.
        tag, error, untouched = log[-1]
        assert tag == "apply_fails_late" and isinstance(error, WeightTransferError), error
        if rank == 2:
            assert not isinstance(error, DeltaRefused), error
            assert error.tensors_written > 0 and not untouched, error
        else:
            assert error.tensors_written == 0 and untouched, error


# -- a trainer rank killed mid-delta ------------------------------------------------------------


def _killed_child(rank: int) -> dict[str, Any]:
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3)], timeout_s=LIMIT_S)
    transfer = groups.p2r_transfer(plan, config=CONFIG)
    assert transfer is not None
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank in TRAINERS:
        encoder = transfer.delta_encoder()
        weights = trainer_layout.shard(_version(1), rank)
        encoder.encode(weights, 1)
        transfer.send(weights, version=1)
        encoder.committed(weights, 1, None)
        weights = trainer_layout.shard(_version(2), rank)
        encoded = encoder.encode(weights, 2)
        transfer.hooks = transfer_fault_hooks()  # trainer rank 1 dies mid-delta
        started = time.monotonic()
        error = _outcome(lambda: transfer.send(weights, version=2, delta=encoded))
        elapsed = time.monotonic() - started
        store.set("trainer_done", "1")
        store.wait([f"done/{r}" for r in (2, 3)], datetime.timedelta(seconds=60))
        return {"error": error, "elapsed": elapsed}
    k = rank - 2
    served = replica_layout.shard(_model(0), k)
    digests = DigestCache()
    transfer.receive(served, delta=DeltaTarget(served, 0, digests))
    transfer.hooks = transfer_fault_hooks()
    started = time.monotonic()
    error = _outcome(lambda: transfer.receive(served, delta=DeltaTarget(served, 1, digests)))
    elapsed = time.monotonic() - started
    v1 = all(torch.equal(served[n], t) for n, t in replica_layout.shard(_version(1), k).items())
    store.wait(["trainer_done"], datetime.timedelta(seconds=60))
    store.set(f"done/{rank}", "1")
    return {"error": error, "elapsed": elapsed, "v1": v1}


@pytest.mark.timeout(120)
def test_a_trainer_rank_killed_mid_delta_leaves_every_target_on_its_version() -> None:
    results = run_group(
        _killed_child,
        4,
        timeout_s=110,
        group_timeout_s=LIMIT_S,
        faults=FaultSchedule(Kill(1, "after_pack", 1, after="after_receive:0")),
    )
    for rank in (2, 3):
        error = results[rank]["error"]
        assert isinstance(error, WeightTransferError), (rank, error)
        assert error.tensors_written == 0 and not error.targets_torn, (rank, error)
        assert results[rank]["v1"], rank  # untouched: version 1, bit for bit
        assert results[rank]["elapsed"] < FAST_S, results[rank]
    assert isinstance(results[0]["error"], WeightTransferError), results[0]


# -- through the pusher and the worker ---------------------------------------------------------


def _worker_job(rank: int) -> dict[str, Any]:
    """Trainers 0, 1 push with ``TransferWeightPusher(delta=True)``; replica 0 (ranks 2, 3)
    relays its slices (``P2R(relay=True)``) to replica 1 (ranks 4, 5); versions 1-3, in
    place then staged."""
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3), (4, 5)], timeout_s=LIMIT_S)
    out: dict[str, Any] = {}
    for mode in (SyncMode.SYNC, SyncMode.STAGED):
        if rank in TRAINERS:
            transfer = groups.p2r_transfer(plan, config=CONFIG)
            assert isinstance(transfer, ShardedTransfer)
            pusher = TransferWeightPusher(transfer, delta=True)
            kinds = []
            for version in (1, 2, 3):
                weights = trainer_layout.shard(_version(version), rank)
                pusher.push_weights(weights, version=version, timeout=LIMIT_S)
                stats = pusher.last_stats
                assert stats is not None
                kinds.append((stats.sync_kind, stats.whole_reason))
            out[mode.value] = kinds
            continue
        j, k = groups.position(rank)  # type: ignore[misc]
        backend = IdleFlatRollout(replica_layout.shard(_model(0), k))
        worker = RolloutWorker(
            backend,
            mode=mode,
            p2r=groups.p2r_transfer(plan, config=CONFIG),
            r2r=groups.r2r_transfer(config=CONFIG),
            weight_sync_timeout=LIMIT_S,
        )
        reports = []
        try:
            for version in (1, 2, 3):
                result = worker.handle(
                    P2R(step=version, relay=True) if j == 0 else R2R(step=version)
                )
                assert result.ok, result.error
                report = worker.last_weight_sync_report
                assert report is not None
                exact = all(
                    torch.equal(backend.served_weights()[n], t)
                    for n, t in replica_layout.shard(_version(version), k).items()
                )
                reports.append((backend.weight_version, report.sync_kind, exact))
        finally:
            worker.close(10)
        out[mode.value] = reports
    return out


@pytest.mark.timeout(150)
def test_the_pusher_and_worker_take_sharded_deltas_in_place_and_staged_through_the_relay() -> None:
    results = run_group(_worker_job, 6, timeout_s=140, group_timeout_s=LIMIT_S)
    for mode in ("sync", "staged"):
        for rank in TRAINERS:
            assert results[rank][mode] == [
                ("whole", WholeReason.FIRST.value),
                ("delta", None),
                ("delta", None),
            ], (mode, rank)
        for rank in (2, 3, 4, 5):  # the relay's ranks and the R2R receivers alike
            assert results[rank][mode] == [
                (1, "whole", True),
                (2, "delta", True),
                (3, "delta", True),
            ], (mode, rank)


def _pipelined_job(rank: int) -> dict[str, Any]:
    """As ``_worker_job`` in place, with the pipelined relay: it passes whole versions on."""
    trainer_layout, replica_layout = _layouts()
    plan = TransferPlan.between(trainer_layout, replica_layout)
    groups = build_sharded_sync_groups(TRAINERS, [(2, 3), (4, 5)], timeout_s=LIMIT_S)
    if rank in TRAINERS:
        transfer = groups.p2r_transfer(plan, config=CONFIG)
        assert isinstance(transfer, ShardedTransfer)
        pusher = TransferWeightPusher(transfer, delta=True)
        kinds = []
        for version in (1, 2):
            weights = trainer_layout.shard(_version(version), rank)
            pusher.push_weights(weights, version=version, timeout=LIMIT_S)
            assert pusher.last_stats is not None
            kinds.append((pusher.last_stats.sync_kind, pusher.last_stats.whole_reason))
        return {"kinds": kinds}
    j, k = groups.position(rank)  # type: ignore[misc]
    backend = IdleFlatRollout(replica_layout.shard(_model(0), k))
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(plan, config=CONFIG, pipelined_relay=True),
        r2r=groups.r2r_transfer(config=CONFIG),
        weight_sync_timeout=LIMIT_S,
    )
    exact = []
    try:
        for version in (1, 2):
            command = P2R(step=version, relay=True) if j == 0 else R2R(step=version)
            assert worker.handle(command).ok
            expected = replica_layout.shard(_version(version), k)
            exact.append(
                all(torch.equal(backend.served_weights()[n], t) for n, t in expected.items())
            )
    finally:
        worker.close(10)
    return {"exact": exact}


@pytest.mark.timeout(120)
def test_the_pipelined_relay_asks_for_the_whole_version_and_says_why() -> None:
    results = run_group(_pipelined_job, 6, timeout_s=110, group_timeout_s=LIMIT_S)
    for rank in TRAINERS:
        assert results[rank]["kinds"] == [
            ("whole", WholeReason.FIRST.value),
            ("whole", WholeReason.RELAY.value),
        ], rank
    for rank in (2, 3, 4, 5):
        assert results[rank]["exact"] == [True, True], rank


def test_a_restore_that_fails_keeps_what_it_could_not_put_back() -> None:
    tensor = torch.zeros(4, dtype=torch.int32)
    received = ShardedReceivedDelta(2, 1, {"w": tensor}, [])
    good = (tensor, torch.tensor([0]), torch.tensor([7], dtype=torch.int32))
    bad = (tensor, torch.tensor([9]), torch.tensor([7], dtype=torch.int32))  # out of range
    received.undo += [good, bad]
    with pytest.raises(IndexError):
        received.restore()
    assert received.undo == [good, bad]  # nothing claimed back: the caller sees it is torn
