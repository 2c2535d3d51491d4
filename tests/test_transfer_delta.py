"""Delta syncs over a real group (gloo on loopback): rank 0 the trainer, ranks 1 and 2 replicas.

One run of the group goes through the cases in order, each checked on every rank: the first
sync goes whole, the next ones by delta and bit-identical to the trainer's version; a replica
that holds another version makes the sync whole for its group (and ends bit-identical); a
keyframe goes whole; every hostile delta (positions out of range, unsorted, repeated, a wrong
digest, a truncated packed delta, a tensor the replica does not serve, a wrong base) is refused
before any write, named, the replica keeps its version, and the next sync lands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from delta_helpers import break_apply

from rollout_sync import SyncMode
from rollout_sync.errors import (
    ChecksumMismatchError,
    DeltaRefused,
    ManifestRejected,
)
from rollout_sync.testing import (
    EventLog,
    FaultSchedule,
    Kill,
    RecordingRollout,
    run_group,
    transfer_fault_hooks,
)
from rollout_sync.trainer import TransferWeightPusher, WeightBroadcastCallback
from rollout_sync.transfer import TransferConfig, TransferHooks, TransferStats, WeightTransfer
from rollout_sync.transfer.delta import BLOCK_ELEMENTS, pack_delta, unpack_delta
from rollout_sync.transfer.delta_sync import (
    DeltaEncoder,
    DeltaTarget,
    DigestCache,
    EncodedDelta,
    WholeReason,
)
from rollout_sync.worker import P2R, R2R, RolloutWorker, build_sync_groups

pytestmark = pytest.mark.multiprocess

SHAPES = {"embed": (3, BLOCK_ELEMENTS), "layer.weight": (257, 300), "norm": (300,)}


def _version(version: int) -> dict[str, torch.Tensor]:
    """bf16 weights whose versions differ in about 2 % of the elements (all, for version 1)."""
    gen = torch.Generator().manual_seed(0)
    out = {n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n, shape in SHAPES.items()}
    for step in range(2, version + 1):
        gen = torch.Generator().manual_seed(step)
        for tensor in out.values():
            flat = tensor.view(-1)
            changed = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)]
            flat[changed] = (flat[changed].float() * 1.01 + 0.001).to(torch.bfloat16)
    return out


def _hostile(encoded: EncodedDelta, case: str) -> EncodedDelta:
    """``encoded`` made wrong in one way."""
    name = "layer.weight"
    entries = list(encoded.header.entries)
    packed = dict(encoded.packed)
    at = next(i for i, e in enumerate(entries) if e.name == name)
    delta = unpack_delta(packed[name], numel=entries[at].numel, dtype=torch.bfloat16)
    if case in ("out_of_range", "unsorted", "repeated"):
        # The last block of this 77100-element tensor holds 11564: offset 65535 is past it.
        k = len(delta.blocks) - 1 if case == "out_of_range" else 0
        block = delta.blocks[k]
        payload = block.payload.clone()
        offsets = payload[: 2 * block.count].view(torch.int16)  # 16-bit words
        if case == "out_of_range":
            offsets[-1] = -1  # the bits of 65535
        elif case == "unsorted":
            offsets[0], offsets[1] = offsets[1].clone(), offsets[0].clone()
        else:
            offsets[1] = offsets[0]
        blocks = list(delta.blocks)
        blocks[k] = dataclasses.replace(block, payload=payload)
        packed[name] = pack_delta(dataclasses.replace(delta, blocks=tuple(blocks)))
    elif case == "wrong_digest":
        a, b = entries[at].digest
        entries[at] = dataclasses.replace(entries[at], digest=(a, (b + 1) % 1000))
    elif case == "truncated":
        packed[name] = packed[name][:-3]
    elif case == "not_served":
        entries[at] = dataclasses.replace(entries[at], name="lm_head.weight")
        packed = {("lm_head.weight" if n == name else n): t for n, t in packed.items()}
    elif case == "wrong_base":
        header = dataclasses.replace(encoded.header, base_version=encoded.header.base_version - 1)
        return dataclasses.replace(encoded, header=header)
    header = dataclasses.replace(encoded.header, entries=tuple(entries))
    return dataclasses.replace(encoded, header=header, packed=packed)


HOSTILE = ["out_of_range", "unsorted", "repeated", "wrong_digest", "truncated", "not_served"]


def _child(rank: int) -> list[tuple[Any, ...]]:
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=20, checksums=True))
    log: list[tuple[Any, ...]] = []
    if rank == 0:
        encoder = DeltaEncoder(full_every=10)  # the eleventh sync is a keyframe
        version = 0

        def push(weights: dict[str, torch.Tensor], delta: Any = None) -> Any:
            nonlocal version
            version += 1
            encoded = (
                encoder.encode(weights, version)
                if delta is None
                else delta(encoder.encode(weights, version))
            )
            try:
                stats = transfer.send(weights, version=version, delta=encoded)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return exc
            sent = encoded if stats.sync_kind == "delta" else None
            encoder.committed(weights, version, sent)  # type: ignore[arg-type]
            return stats

        for step in (1, 2, 3, 4):  # whole, delta, delta (replica 2 re-seeded: whole), delta
            stats = push(_version(step))
            log.append(("sync", version, stats.sync_kind, stats.whole_reason, stats.nbytes))
        for case in HOSTILE:
            weights = _version(version + 1)
            error = push(weights, lambda e, case=case: _hostile(e, case))
            log.append((case, version, error))
            version -= 1  # the version was refused: the next sync sends it again
        stats = push(_version(version + 1))  # the eleventh sync: a keyframe
        log.append(("sync", version, stats.sync_kind, stats.whole_reason, stats.nbytes))
        stats = push(_version(version + 1))
        log.append(("sync", version, stats.sync_kind, stats.whole_reason, stats.nbytes))
        wrong = push(_version(version + 1), lambda e: _hostile(e, "wrong_base"))
        log.append(("wrong_base", version, wrong.sync_kind, wrong.whole_reason, wrong.nbytes))
        log.append(("extra", encoder.extra_bytes))
        return log
    served = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in SHAPES.items()}
    digests = DigestCache()
    held: int | None = None

    def take() -> Any:
        nonlocal held
        target = DeltaTarget(served, held, digests)
        try:
            stats = transfer.receive(served, delta=target)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return exc
        held = stats.version
        return stats

    for step in (1, 2, 3, 4):
        if step == 3 and rank == 2:
            held = None  # re-seeded from elsewhere: it holds no version the trainer knows
        stats = take()
        exact = all(torch.equal(served[n], t) for n, t in _version(step).items())
        log.append(("sync", stats.version, stats.sync_kind, stats.whole_reason, exact))
    for case in HOSTILE:
        before = {n: t.clone() for n, t in served.items()}
        error = take()
        untouched = all(torch.equal(before[n], served[n]) for n in served)
        log.append((case, held, error, untouched))
    for _ in range(3):
        stats = take()
        exact = all(torch.equal(served[n], t) for n, t in _version(held).items())
        log.append(("sync", stats.version, stats.sync_kind, stats.whole_reason, exact))
    return log


def test_deltas_land_bit_identical_fall_back_whole_and_refuse_hostile_input() -> None:
    results = run_group(_child, 3, timeout_s=120)
    trainer, replicas = results[0], [results[1], results[2]]
    kinds = [(v, kind, reason) for tag, v, kind, reason, _ in trainer[:4]]
    assert kinds == [
        (1, "whole", WholeReason.FIRST.value),
        (2, "delta", None),
        (3, "whole", WholeReason.RECEIVER.value),  # replica 2 held another version
        (4, "delta", None),
    ]
    full = sum(torch.Size(s).numel() * 2 for s in SHAPES.values())
    delta_bytes = trainer[3][4]
    assert 0 < delta_bytes < 0.15 * full  # 2 % changed: about 4 % of the bytes
    for log in replicas:
        for tag, version, kind, _reason, exact in log[:4]:
            assert exact, (tag, version, kind)
        assert [entry[2] for entry in log[:4]] == ["whole", "delta", "whole", "delta"]
    for i, case in enumerate(HOSTILE):
        _, _, error = trainer[4 + i]
        assert isinstance(error, ChecksumMismatchError | ManifestRejected), (case, error)
        for log in replicas:
            tag, held, refused, untouched = log[4 + i]
            assert tag == case and held == 4 and untouched, (case, refused)
            # Every case is this receiver's own refusal, before any write.
            assert type(refused) is DeltaRefused and refused.tensors_written == 0, (case, refused)
            expected = {
                "out_of_range": "out of range",
                "unsorted": "not strictly increasing",
                "repeated": "not strictly increasing",
                "wrong_digest": "would not equal the sender's version",
                "truncated": "truncated",
                "not_served": "'lm_head.weight' is not served here",
            }[case]
            assert expected in str(refused), (case, str(refused))
    tail = trainer[4 + len(HOSTILE) :]
    assert [(kind, reason) for _, _, kind, reason, _ in tail[:3]] == [
        ("whole", WholeReason.KEYFRAME.value),
        ("delta", None),
        ("whole", WholeReason.RECEIVER.value),  # a delta on a base nobody holds
    ]
    assert tail[3] == ("extra", full)  # one served-dtype copy of what it sends
    for log in replicas:
        assert all(exact for *_, exact in log[4 + len(HOSTILE) :])


# -- the worker's paths: in place and staged, P2R then R2R, and the pipelined relay -------------


def _corrupt_once(armed: list[bool]) -> Any:
    def corrupt(index: int, flat: torch.Tensor) -> None:
        if armed and armed.pop():
            flat.view(torch.uint8)[:8].add_(1)

    return corrupt


def _worker_job(rank: int) -> dict[str, Any]:
    """Rank 0 trains (a TransferWeightPusher with deltas); 1..3 are replicas, 1 the P2R target.
    Per mode, four versions: v1 and v2 by P2R then R2R; v2's R2R is corrupted on rank 3, which
    keeps v1 (two-phase off); v3 and v4 by the pipelined relay, where rank 3, a version behind,
    makes v3 whole for everyone, and v4 goes by delta again."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(checksums=True, timeout_s=20)
    out: dict[str, Any] = {}
    for mode in (SyncMode.SYNC, SyncMode.STAGED):
        if rank == 0:
            # In place, the documented callback; staged, a pusher of one's own.
            pusher = TransferWeightPusher(
                groups.p2r_transfer(config=config), delta=mode is SyncMode.STAGED
            )
            pushed = {"version": 0}
            callback = WeightBroadcastCallback(
                lambda pushed=pushed: _version(pushed["version"]),
                pusher=pusher,
                timer=None,
                delta=True,
                sync_on_run_begin=False,
            )
            kinds, metrics = [], []
            for version in (1, 2, 3, 4):
                if mode is SyncMode.SYNC:
                    pushed["version"] = version
                    assert callback.sync(step=version) == version
                    metrics.append(callback.report())
                else:
                    pusher.push_weights(_version(version), version=version, timeout=20)
                stats = pusher.last_stats
                kinds.append((stats.sync_kind, stats.whole_reason, stats.nbytes))
            out[mode.value] = {"kinds": kinds, "metrics": metrics}
            continue
        rollout = RecordingRollout(
            EventLog(),
            _version(0)
            if mode is SyncMode.SYNC
            else {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()},
        )
        armed: list[bool] = []
        hooks = TransferHooks(after_receive=_corrupt_once(armed)) if rank == 3 else None
        checked: list[tuple[int, bool]] = []

        def on_transfer(
            stats: TransferStats,
            tensors: Mapping[str, torch.Tensor],
            checked: list[tuple[int, bool]] = checked,
        ) -> None:
            # What a check sees of each version received, staged deltas not yet installed too.
            if stats.role in ("receive", "relay"):
                want = _version(stats.version)
                exact = all(torch.equal(tensors[n], want[n]) for n in want)
                checked.append((stats.version, exact))

        worker = RolloutWorker(
            rollout,
            mode=mode,
            p2r=groups.p2r_transfer(config=config),
            r2r=groups.r2r_transfer(config=config, hooks=hooks),
            all_or_none=False,
            on_transfer=on_transfer,
        )
        reports = []
        for version in (1, 2, 3, 4):
            armed[:] = [version == 2]
            relay = version >= 3
            if rank == 1:
                result = worker.handle(P2R(step=version, relay=relay))
                assert result.ok, result.error
                reports.append(worker.last_weight_sync_report)
            if not relay or rank != 1:  # the leaves receive the relay's R2R too
                result = worker.handle(R2R(step=version))
                reports.append(worker.last_weight_sync_report)
            exact = all(
                torch.equal(rollout.served_weights()[n], t) for n, t in _version(version).items()
            )
            reports.append(("after", version, rollout.weight_version, exact, rollout.weights_torn))
        out[mode.value] = [
            r if isinstance(r, tuple) else (r.handler, r.sync_kind, r.whole_reason, r.error is None)
            for r in reports
        ]
        out[mode.value + "_staging"] = worker.statistics().staging_bytes
        out[mode.value + "_checked"] = checked
        worker.close(10)
    return out


@pytest.mark.timeout(120)
def test_the_worker_takes_deltas_in_place_and_staged_and_a_replica_behind_gets_the_whole() -> None:
    results = run_group(_worker_job, 4, timeout_s=110, group_timeout_s=20)
    for mode in ("sync", "staged"):
        kinds = results[0][mode]["kinds"]
        assert [kind[:2] for kind in kinds] == [
            ("whole", WholeReason.FIRST.value),
            ("delta", None),
            ("whole", WholeReason.RECEIVER.value),  # rank 3 still holds version 1
            ("delta", None),
        ], mode
        if mode == "sync":  # the callback's metrics: the bytes that moved, the deltas counted
            metrics = results[0][mode]["metrics"]
            assert [m["weight_sync_delta_count"] for m in metrics] == [0, 1, 0, 1]
            assert [m["weight_sync_bytes"] for m in metrics] == [k[2] for k in kinds]
            assert metrics[1]["weight_sync_bytes"] < 0.15 * metrics[0]["weight_sync_bytes"]
        for rank in (1, 2, 3):
            after = [r for r in results[rank][mode] if r[0] == "after"]
            served = [(v, held, torn) for _, v, held, _, torn in after]
            behind = rank == 3
            assert served == [
                (1, 1, False),
                (2, 1 if behind else 2, False),
                (3, 3, False),
                (4, 4, False),
            ], (mode, rank)
            assert all(exact for _, v, held, exact, _ in after if v == held), (mode, rank)
            checked = results[rank][mode + "_checked"]
            assert checked and all(exact for _, exact in checked), (mode, rank, checked)
            syncs = [r for r in results[rank][mode] if r[0] != "after"]
            kinds = [kind for _, kind, _, _ in syncs]
            if rank == 1:  # P2R, R2R send, P2R, R2R send (rank 3 failed it), relay, relay
                assert kinds == ["whole", "whole", "delta", None, "whole", "delta"], mode
            else:
                assert kinds[0] == "whole" and kinds[-1] == "delta", (mode, rank, kinds)
        # Staged, a delta stages its packed bytes only: no staging copy is kept.
        assert results[2][mode + "_staging"] < 0.2 * sum(
            torch.Size(s).numel() * 2 for s in SHAPES.values()
        ), mode


# -- a trainer killed mid-delta ----------------------------------------------------------------


def _killed_delta_job(rank: int) -> dict[str, Any]:
    """Rank 0 sends version 1 whole, then dies after packing the last bucket of version 2's
    delta (once the replica took the one before); rank 1 receives in place."""
    groups = build_sync_groups(0, [1], timeout_s=10)
    config = TransferConfig(bucket_bytes=4096, timeout_s=10, checksums=True)
    if rank == 0:
        pusher = TransferWeightPusher(groups.p2r_transfer(config=config), delta=True)
        pusher.push_weights(_version(1), version=1, timeout=10)
        assert isinstance(pusher.transfer, WeightTransfer)
        pusher.transfer.hooks = transfer_fault_hooks()
        pusher.push_weights(_version(2), version=2, timeout=10)
        return {}
    rollout = RecordingRollout(
        EventLog(), {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    )
    worker = RolloutWorker(rollout, p2r=groups.p2r_transfer(config=config), weight_sync_timeout=10)
    try:
        assert worker.handle(P2R(step=1)).ok
        assert isinstance(worker.p2r, WeightTransfer)
        worker.p2r.hooks = transfer_fault_hooks()
        result = worker.handle(P2R(step=2))
        served = rollout.served_weights()
        return {
            "error": None if result.ok else type(result.exception).__name__,
            "written": getattr(result.exception, "tensors_written", None),
            "torn": rollout.weights_torn,
            "version": rollout.weight_version,
            "exact": all(torch.equal(served[n], t) for n, t in _version(1).items()),
        }
    finally:
        worker.close(10)


@pytest.mark.timeout(60)
def test_a_trainer_killed_mid_delta_leaves_the_replica_whole_on_its_version() -> None:
    """The same kill tears a replica mid-whole-sync (tests/test_transfer_mp.py); a delta is
    written only once it arrived whole and was proven, so the replica keeps serving version 1
    exactly: nothing written, not torn."""
    results = run_group(
        _killed_delta_job,
        2,
        timeout_s=60,
        group_timeout_s=10,
        # The delta's buckets: embed's (16 kB), layer.weight's (6 kB), norm's. The replica took
        # the second; the third never leaves.
        faults=FaultSchedule(Kill(0, "after_pack", 2, after="after_receive:1")),
    )
    assert results[1] == {
        "error": "WeightTransferError",
        "written": 0,
        "torn": False,
        "version": 1,
        "exact": True,
    }


# -- an apply that fails part-way and whose restore fails too: torn, and said so --------------


@pytest.mark.timeout(60)
def test_an_apply_whose_restore_also_failed_reports_the_targets_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delta's apply fails at its second tensor and putting the first back fails as well:
    the receive must not say that nothing was written (the worker would go on serving a mix
    of versions), but count the delta's tensors as written, so the targets are torn. Two ranks
    of a standalone gloo group, in threads of this process."""
    import threading

    from rollout_sync.distributed import standalone_group
    from rollout_sync.errors import WeightTransferError
    from rollout_sync.testing import find_free_port

    base, new = _version(1), _version(2)
    encoder = DeltaEncoder()
    encoder.encode(base, 1)
    encoder.committed(base, 1, None)
    encoded = encoder.encode(new, 2)
    assert isinstance(encoded, EncodedDelta)
    served = {n: t.clone() for n, t in base.items()}
    break_apply(monkeypatch, restore_too=True)
    port, out = find_free_port(), {}

    def run(rank: int) -> None:
        group = standalone_group("127.0.0.1", port, rank, 2, timeout_s=20)
        transfer = WeightTransfer(group, 0, config=TransferConfig(timeout_s=20))
        try:
            if rank == 0:
                out[0] = transfer.send(new, version=2, delta=encoded)
            else:
                out[1] = transfer.receive(served, delta=DeltaTarget(served, 1, DigestCache()))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    error = out[1]
    assert isinstance(error, WeightTransferError), error
    assert error.tensors_written == len(SHAPES) and error.targets_torn, error
    assert "applying the delta failed" in str(error)
    assert not torch.equal(served["embed"], base["embed"])  # the first tensor stays written
    assert isinstance(out[0], ChecksumMismatchError)  # the replica voted no


def test_a_staged_install_whose_apply_and_restore_failed_leaves_the_weights_torn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A staged replica installs a pending delta: the apply fails at its second tensor and
    putting the first back fails too. The served weights mix two versions, so they are marked
    torn (before the mend they stayed untorn, still labelled version 1)."""
    import contextlib
    import types

    from rollout_sync.sync.slot import EngineSlot
    from rollout_sync.sync.staged import Staged
    from rollout_sync.transfer import delta_sync

    base, new = _version(1), _version(2)
    encoder = DeltaEncoder()
    encoder.encode(base, 1)
    encoder.committed(base, 1, None)
    encoded = encoder.encode(new, 2)
    assert isinstance(encoded, EncodedDelta)
    rollout = RecordingRollout(EventLog(), {n: t.clone() for n, t in base.items()})
    rollout.commit_weight_version(1)
    host = types.SimpleNamespace(
        rollout=rollout, guarded=True, weight_sync_timeout=5.0, weight_sync_fence=lambda t: None
    )
    strategy = Staged(host, EngineSlot(rollout, "test"))
    target = DeltaTarget(rollout.served_weights(), 1, strategy.digests, apply=False)
    received = delta_sync.ReceivedDelta.check(2, encoded.header, encoded.packed, target)
    break_apply(monkeypatch, restore_too=True)
    bracket = types.SimpleNamespace(stalled=lambda pause: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="stayed away"):
        strategy._install_delta(bracket, received)  # type: ignore[arg-type]
    assert rollout.weights_torn and rollout.weight_version == 1
