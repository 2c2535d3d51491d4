"""The pipelined relay and zero-copy buckets, between real processes (gloo on loopback, CPU).

Rank 0 is the trainer, rank 1 the relay (P2R receiver, R2R source), ranks 2 and 3 the leaves.
Every combination of relay (pipelined or not), zero-copy (flat storage or not), checksums (off,
verified before writing, verified after) and bucket layout (buckets that split the model at
unaligned tensors, buckets that align with tensors, one bucket) must land bit-identically; the
faults (a bad bucket, a relay or a trainer killed mid-pipeline, a rejected manifest) must end in
a clear error, bounded in time, with weights untouched or marked torn, never served torn.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import new_group, wait_work
from rollout_sync.errors import (
    ChecksumMismatchError,
    ManifestRejected,
    P2RBarrierMismatch,
    RelayForwardError,
    TornWeightsError,
    WeightMismatchError,
    WeightTransferError,
    WeightTransferTimeout,
)
from rollout_sync.flat import FlatWeights
from rollout_sync.testing import (
    ErrorReport,
    FaultSchedule,
    Kill,
    SyncOutcome,
    fault_point,
    run_group,
    transfer_fault_hooks,
    weights_digest,
)
from rollout_sync.transfer import TransferConfig, TransferHooks, WeightTransfer
from rollout_sync.worker import P2R, R2R, RolloutWorker, build_sync_groups

pytestmark = pytest.mark.multiprocess

WORLD = 4
"""Trainer, relay, two leaves."""

TIMEOUT_S = 4.0
"""The collective timeout of the fault tests: a failure noticed in time is well under it."""


def _mixed(version: int) -> dict[str, torch.Tensor]:
    """Tensors whose byte sizes are mostly not multiples of 64 (padding between them), of
    several dtypes, one larger than the small bucket size; values depend on the version."""
    gen = torch.Generator().manual_seed(100 + version)
    return {
        "embed.weight": torch.rand(300, generator=gen),  # 1200 bytes
        "norm.weight": torch.rand(100, generator=gen).to(torch.bfloat16),  # 200 bytes
        "steps": torch.randint(0, 1 << 40, (7,), generator=gen),  # 56 bytes, int64
        "layers.0.weight": torch.rand(2000, generator=gen),  # 8000 bytes > 1 KiB bucket
        "layers.0.bias": torch.rand(33, generator=gen),  # 132 bytes
        "head.weight": torch.rand(512, generator=gen),  # 2048 bytes
    }


def _aligned(version: int) -> dict[str, torch.Tensor]:
    """Sixteen 1 KiB tensors: with 4 KiB buckets every bucket is exactly four of them."""
    gen = torch.Generator().manual_seed(200 + version)
    return {f"blocks.{i}.weight": torch.rand(256, generator=gen) for i in range(16)}


_LAYOUTS = {
    "split": (_mixed, 1024),
    "aligned": (_aligned, 4096),
    "one_bucket": (_mixed, 1 << 20),
}
_CHECKSUMS = {"off": (False, True), "verify_before": (True, True), "verify_after": (True, False)}
_CASES = [
    (layout, pipelined, zero_copy, checksums)
    for layout in _LAYOUTS
    for pipelined in (False, True)
    for zero_copy in (False, True)
    for checksums in _CHECKSUMS
]


def _combinations_child(rank: int) -> list[dict[str, Any]]:
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    out: list[dict[str, Any]] = []
    if rank >= 1:
        # Storage that is not a flat byte buffer is the receivers' objection in the vote:
        # nothing is written anywhere and the source learns it at once.
        r2r = groups.r2r_transfer(config=TransferConfig(timeout_s=20))
        assert r2r is not None
        try:
            if r2r.is_source:
                r2r.send(_mixed(0), version=0)
            else:
                r2r.receive(_mixed(0), storage=torch.zeros(4))
        except (ValueError, ManifestRejected) as exc:
            out.append({"refused": ErrorReport.of(exc)})
    for version, (layout, pipelined, zero_copy, checksums) in enumerate(_CASES, start=1):
        make, bucket_bytes = _LAYOUTS[layout]
        on, before = _CHECKSUMS[checksums]
        config = TransferConfig(
            bucket_bytes=bucket_bytes,
            checksums=on,
            verify_before_write=before,
            zero_copy=zero_copy,
            timeout_s=20,
        )
        hooked: list[int] = []  # the hooks fire for every bucket, one-tensor buckets included

        def record(k: int, flat: torch.Tensor, hooked: list[int] = hooked) -> None:
            hooked.append(k)

        hooks = TransferHooks(after_pack=record, after_receive=record)
        p2r = groups.p2r_transfer(config=config, hooks=hooks)
        r2r = groups.r2r_transfer(config=config, hooks=hooks)
        # Every rank's tensors: the trainer's of this version, the replicas' of version 0,
        # either in flat storage (zero-copy) or each in its own allocation.
        weights = make(version if rank == 0 else 0)
        flat = FlatWeights.copy_of(weights) if zero_copy else None
        tensors = flat.tensors if flat is not None else weights
        storage = flat.storage if flat is not None else None
        if rank == 0:
            assert p2r is not None
            stats = p2r.send(tensors, version=version, storage=storage)
        elif rank == 1:
            assert p2r is not None and r2r is not None
            if pipelined:
                stats = p2r.relay(tensors, r2r, storage=storage)
            else:
                stats = p2r.receive(tensors, storage=storage)
                r2r.send(tensors, version=version, storage=storage)
        else:
            assert r2r is not None
            stats = r2r.receive(tensors, storage=storage)
        out.append(
            {
                "case": (layout, pipelined, zero_copy, checksums),
                "digest": weights_digest(tensors),
                "role": stats.role,
                "zero_copy_buckets": stats.zero_copy_buckets,
                "buckets": stats.buckets,
                "checksums_verified": stats.checksums_verified,
                "hooked": hooked,
            }
        )
    return out


@pytest.mark.timeout(180)
def test_every_combination_lands_bit_identically() -> None:
    results = run_group(_combinations_child, WORLD, timeout_s=150)
    for rank in (2, 3):
        refused = results[rank].pop(0)["refused"]
        assert refused.is_a(ValueError), refused
        assert refused.message.startswith("storage must be a contiguous 1-D uint8 tensor")
    assert results[1].pop(0)["refused"].is_a(ManifestRejected)
    for i, (layout, pipelined, zero_copy, checksums) in enumerate(_CASES):
        trainer = results[0][i]
        assert trainer["case"] == (layout, pipelined, zero_copy, checksums)
        for rank in (1, 2, 3):
            got = results[rank][i]
            assert got["digest"] == trainer["digest"], (rank, got["case"])
            staged_receive = _CHECKSUMS[checksums][0] and _CHECKSUMS[checksums][1]
            if zero_copy and not staged_receive:
                # Flat storage laid out like the buckets: every bucket lands in place.
                assert got["zero_copy_buckets"] == got["buckets"], (rank, got["case"])
            elif not zero_copy:
                assert got["zero_copy_buckets"] == 0, (rank, got["case"])
            if _CHECKSUMS[checksums][0]:
                assert got["checksums_verified"] == got["buckets"], (rank, got["case"])
        assert results[1][i]["role"] == ("relay" if pipelined else "receive")
        buckets = list(range(trainer["buckets"]))
        assert trainer["hooked"] == buckets and results[3][i]["hooked"] == buckets
        # The relay: its receive, and (sequential) its R2R send's packing.
        assert results[1][i]["hooked"] == (buckets if pipelined else buckets + buckets)
        if zero_copy:
            assert trainer["zero_copy_buckets"] == trainer["buckets"]
    if_split = [r for r in results[0] if r["case"][0] == "split"]
    assert all(r["buckets"] > 3 for r in if_split), "the split layout must have many buckets"


# -- faults through the worker -----------------------------------------------------------------


_LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def _trainer_weights(version: int) -> dict[str, torch.Tensor]:
    return tiny_lm_weights(_LM, seed=1000 + version)


def _worker(
    rank: int,
    groups: Any,
    config: TransferConfig,
    hooks: TransferHooks | None = None,
    *,
    barrier: bool = False,
):
    """A replica's backend and worker; rank 1 receives P2R (meeting the P2R barrier with
    ``barrier``) and is the R2R source."""
    backend = TorchLMBackend(_LM, pause_timeout=10)
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(config=config, hooks=hooks) if rank == 1 else None,
        p2r_barrier=groups.p2r_barrier if rank == 1 and barrier else None,
        r2r=groups.r2r_transfer(config=config, hooks=hooks),
        weight_sync_timeout=10,
    )
    return backend, worker


def _sync(rank: int, worker: RolloutWorker | None, p2r: WeightTransfer | None, version: int) -> Any:
    """One pipelined sync of ``version`` on every rank; the replicas' results."""
    if rank == 0:
        assert p2r is not None
        try:
            return p2r.send(_trainer_weights(version), version=version)
        except WeightTransferError as exc:
            return exc
    assert worker is not None
    command = P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
    return worker.handle(command)


def _bad_bucket_child(rank: int, hop: str) -> tuple[SyncOutcome, tuple[bool, int, bool], str]:
    """The corrupted sync's outcome, then the clean one's (ok, version, servable) and digest."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, checksums=True, timeout_s=10)
    hooks = TransferHooks()

    def flip(k: int, flat: torch.Tensor) -> None:
        if k == 2:
            flat[5] ^= 0xFF

    p2r = groups.p2r_transfer(config=config, hooks=hooks) if rank == 0 else None
    backend, worker = (None, None) if rank == 0 else _worker(rank, groups, config, hooks)
    recovered, digest = (True, 2, True), weights_digest(_trainer_weights(2))
    try:
        if hop == "p2r" and rank == 0:
            hooks.after_pack = flip  # corrupted after the checksum: on the wire to the relay
        if hop == "relay" and rank == 1:
            hooks.after_receive = flip  # corrupted in the relay's buffer, before it forwards
        result = _sync(rank, worker, p2r, 1)
        hooks.after_pack = hooks.after_receive = None
        outcome = SyncOutcome.of(result, backend)
        # A clean sync recovers every replica, bit-identically.
        result = _sync(rank, worker, p2r, 2)
        if backend is not None:
            recovered = (result.ok, backend.weight_version, not backend.weights_torn)
            digest = weights_digest(backend.served_weights())
    finally:
        if worker is not None:
            worker.close(10)
    return outcome, recovered, digest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hop", ["p2r", "relay"])
def test_a_bad_bucket_in_the_pipelined_relay_is_caught_on_every_downstream_replica(
    hop: str,
) -> None:
    results = run_group(_bad_bucket_child, WORLD, (hop,), timeout_s=90)
    outcomes = {rank: outcome for rank, (outcome, _, _) in results.items()}
    for rank in (2, 3):
        leaf = outcomes[rank]
        assert leaf.failed_with(ChecksumMismatchError), leaf.error
        assert leaf.error is not None and "bucket 2 arrived with checksum" in leaf.error.message
        assert leaf.servable is False  # buckets 0 and 1 were written: torn, refused
    assert outcomes[1].failed_with(ChecksumMismatchError) and outcomes[1].servable is False
    assert outcomes[0].failed_with(ChecksumMismatchError)  # the commit vote said so
    # A clean sync recovered every replica, bit-identically.
    assert {rank: result[1:] for rank, result in results.items()} == {
        rank: ((True, 2, True), results[0][2]) for rank in range(WORLD)
    }


def _linger(survivors: Any) -> None:
    """Survivors wait for each other before exiting, so that no failure seen by a leaf is
    just another survivor's process ending."""
    if survivors is not None:
        work = torch.distributed.barrier(group=survivors, async_op=True)
        wait_work(work, operation="linger", timeout_s=30)


def _killed_child(rank: int, victim: int, informed: bool = True) -> SyncOutcome:
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([r for r in range(WORLD) if r != victim], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    hooks = TransferHooks()
    if not informed:
        # The unguarded relay: its source dies and it just raises, sending nothing more.
        monkeypatch_relay_fill_off()
    p2r = groups.p2r_transfer(config=config, hooks=hooks) if rank == 0 else None
    backend, worker = (None, None) if rank == 0 else _worker(rank, groups, config, hooks)
    try:
        first = _sync(rank, worker, p2r, 1)
        assert rank == 0 or first.ok, first.error
        faults = transfer_fault_hooks()  # on every rank; only the victim's process is armed
        hooks.after_pack, hooks.after_receive = faults.after_pack, faults.after_receive
        started = time.monotonic()
        result = _sync(rank, worker, p2r, 2)
        outcome = SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started)
        _linger(survivors)
    finally:
        if worker is not None:
            worker.close(10)
    return outcome


_TRAINER_DIES = Kill(0, "after_pack", 3, after="after_receive:1")
"""The trainer dies between two buckets of the relay: it took bucket 1, bucket 3 never leaves."""
_RELAY_DIES = Kill(1, "after_receive", 3)


def _run_killed(kill: Kill, informed: bool = True) -> dict[int, SyncOutcome]:
    return run_group(
        _killed_child,
        WORLD,
        (kill.rank, informed),
        timeout_s=90,
        group_timeout_s=10,
        faults=FaultSchedule(kill),
    )


@pytest.mark.timeout(120)
def test_a_relay_killed_mid_pipeline_leaves_its_leaves_with_a_clear_error_never_served_torn() -> (
    None
):
    results = _run_killed(_RELAY_DIES)
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf.failed_with(WeightTransferError), leaf.error
        assert leaf.error is not None and "peer most likely died" in leaf.error.message
        assert leaf.elapsed_s < TIMEOUT_S / 2, "the dead relay was not noticed in time"
        # Buckets 0-2 landed in place (zero-copy into flat storage) before the relay died.
        assert leaf.servable is False and leaf.version == 1
    assert results[0].failed_with(WeightTransferError)
    assert results[0].elapsed_s < TIMEOUT_S / 2


@pytest.mark.timeout(120)
def test_a_trainer_killed_mid_pipeline_fails_the_leaves_fast_through_the_relay() -> None:
    results = _run_killed(_TRAINER_DIES)
    relay = results[1]
    assert relay.failed_with(WeightTransferError) and relay.error is not None
    assert "peer most likely died" in relay.error.message
    assert relay.servable is False
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf.failed_with(WeightTransferError) and leaf.error is not None
        assert "source rank 1 reported that it failed mid-transfer" in leaf.error.message
        # The relay sent the rest as zeros and voted no: the leaves fail within the relay's
        # own detection time, well under the collective timeout.
        assert leaf.elapsed_s < TIMEOUT_S / 2
        assert leaf.servable is False and leaf.version == 1


@pytest.mark.timeout(120)
def test_without_the_fill_the_leaves_of_a_failed_relay_wait_out_the_timeout() -> None:
    """The test above can fail: a relay that only raises leaves its leaves waiting."""
    results = _run_killed(_TRAINER_DIES, informed=False)
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf.failed_with(WeightTransferTimeout), leaf.error
        assert leaf.elapsed_s >= TIMEOUT_S
        assert leaf.servable is False  # still never served torn


def _unexpected_child(rank: int) -> tuple[str, float]:
    """The relay's own receive raises an error of no transfer type (a hook, at bucket 2): what
    each rank raised, and after how long."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)

    def broken(k: int, flat: torch.Tensor) -> None:
        if k == 2:
            raise RuntimeError("the relay broke")

    hooks = TransferHooks(after_receive=broken if rank == 1 else None)
    p2r = groups.p2r_transfer(config=config, hooks=hooks)
    r2r = groups.r2r_transfer(config=config, hooks=hooks)
    weights = _mixed(1 if rank == 0 else 0)
    start = time.monotonic()
    try:
        if rank == 0:
            assert p2r is not None
            p2r.send(weights, version=1)
        elif rank == 1:
            assert p2r is not None and r2r is not None
            p2r.relay(weights, r2r)
        else:
            assert r2r is not None
            r2r.receive(weights)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        elapsed = time.monotonic() - start
        if rank == 1:
            # Alive past the leaves' limit: what they see is the relay's word, not its exit.
            time.sleep(TIMEOUT_S * 1.5)
        return type(exc).__name__, elapsed
    return "", time.monotonic() - start


@pytest.mark.timeout(120)
def test_a_relay_failing_with_an_unexpected_error_still_fails_its_leaves_fast() -> None:
    """Not only the transfer's own errors: the relay sends the rest void and votes no, so its
    leaves fail well under the collective timeout (they waited it out before)."""
    results = run_group(_unexpected_child, WORLD, (), timeout_s=90)
    assert results[1][0] == "RuntimeError"
    for rank in (2, 3):
        name, elapsed = results[rank]
        assert name == "WeightTransferError" and elapsed < TIMEOUT_S / 2, results[rank]


def monkeypatch_relay_fill_off() -> None:
    """In a child process: the relay no longer sends the void rest after its source died."""
    from rollout_sync.transfer import _pipeline

    _pipeline._Forward.fill = lambda self: None  # type: ignore[method-assign]


# -- a relay whose P2R barrier fails ------------------------------------------------------------


def _barrier_mismatch_child(rank: int) -> list[SyncOutcome]:
    """Two rounds of a pipelined sync where the relay takes the P2R barrier and the trainer
    does not: round 1 as shipped, round 2 with the relay's abort disabled (the counterfactual:
    its leaves are not told)."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    # The replicas leave together: a relay that exits early would close its leaves' waits.
    replicas = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    out: list[SyncOutcome] = []
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        return [SyncOutcome.of(_sync(rank, None, p2r, version)) for version in (1, 2)]
    backend, worker = _worker(rank, groups, config, barrier=True)
    try:
        for version in (1, 2):
            if version == 2:
                WeightTransfer.abort = lambda self, reason, version=0: None  # type: ignore[method-assign]
            started = time.monotonic()
            result = worker.handle(
                P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
            )
            out.append(SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started))
        wait_work(
            torch.distributed.barrier(group=replicas, async_op=True),
            operation="replicas leave",
            timeout_s=30,
        )
    finally:
        worker.close(10)
    return out


@pytest.mark.timeout(120)
def test_a_relay_whose_p2r_barrier_fails_tells_its_leaves_at_once() -> None:
    results = run_group(_barrier_mismatch_child, WORLD, timeout_s=90, group_timeout_s=10)
    assert len(results[0]) == 2
    assert all(sync.failed_with(P2RBarrierMismatch) for sync in results[0])
    informed, uninformed = zip(*(results[rank] for rank in (1, 2, 3)), strict=True)
    assert informed[0].failed_with(P2RBarrierMismatch), informed[0].error
    for leaf in informed[1:]:
        assert leaf.failed_with(ManifestRejected) and leaf.error is not None
        assert "aborted" in leaf.error.message
        assert leaf.elapsed_s < TIMEOUT_S / 2, "the leaves were not told in time"
    # Without the abort the leaves wait out their limit: the check above can fail.
    for leaf in uninformed[1:]:
        assert leaf.failed_with(WeightTransferTimeout), leaf.error
        assert leaf.elapsed_s >= TIMEOUT_S
    for replica in (*informed, *uninformed):
        assert replica.version == 0 and replica.servable  # nothing written anywhere


def _trainer_dies_at_barrier_child(rank: int) -> list[SyncOutcome]:
    """Version 1 syncs through the pipelined relay, P2R barrier on both sides; at version 2
    the trainer dies at its barrier, with the relay and the leaves waiting."""
    from rollout_sync.trainer import TransferWeightPusher

    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None

        def barrier(timeout_s: float) -> None:
            fault_point("p2r_barrier")
            groups.p2r_barrier(timeout_s)

        pusher = TransferWeightPusher(p2r, barrier=barrier)
        for version in (1, 2):
            pusher.push_weights(_trainer_weights(version), version=version, timeout=10)
        return []
    backend, worker = _worker(rank, groups, config, barrier=True)
    try:
        out: list[SyncOutcome] = []
        for version in (1, 2):
            started = time.monotonic()
            result = worker.handle(
                P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
            )
            out.append(SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started))
        _linger(survivors)
        return out
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
def test_a_trainer_dying_at_the_p2r_barrier_fails_the_relays_leaves_at_once() -> None:
    results = run_group(
        _trainer_dies_at_barrier_child,
        WORLD,
        timeout_s=90,
        group_timeout_s=10,
        faults=FaultSchedule(Kill(0, "p2r_barrier", step=1)),  # at version 2's barrier
    )
    relay_v1, relay_v2 = results[1]
    assert relay_v1.ok, relay_v1.error
    assert not relay_v2.ok and relay_v2.elapsed_s < TIMEOUT_S / 2
    for rank in (2, 3):
        v1, v2 = results[rank]
        assert v1.ok, v1.error
        assert v2.failed_with(ManifestRejected) and v2.error is not None
        assert "aborted the transfer before sending a manifest" in v2.error.message
        assert v2.elapsed_s < TIMEOUT_S / 2, "the leaves were not told in time"
    for rank in (1, 2, 3):  # nothing written: every replica still serves version 1, whole
        assert (results[rank][1].version, results[rank][1].servable) == (1, True)


# -- a torn R2R source aborts -------------------------------------------------------------------


def _torn_source_child(rank: int, informed: bool) -> SyncOutcome | None:
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    if not informed:
        WeightTransfer.abort = lambda self, reason, version=0: None  # type: ignore[method-assign]
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        p2r.send(_trainer_weights(1), version=1)
        p2r.hooks = transfer_fault_hooks()  # the trainer dies mid-P2R: the relay is torn
        p2r.send(_trainer_weights(2), version=2)
        return None
    backend, worker = _worker(rank, groups, config)
    try:
        if rank == 1:
            assert worker.handle(P2R(step=1)).ok
        assert worker.handle(R2R(step=1)).ok
        if rank == 1:
            assert not worker.handle(P2R(step=2)).ok
            assert backend.weights_torn
        started = time.monotonic()
        result = worker.handle(R2R(step=2))  # the relay is torn: it must not send
        _linger(survivors)
        return SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started)
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("informed", [True, False], ids=["abort_header", "no_abort_header"])
def test_a_torn_r2r_source_aborts_so_its_receivers_fail_at_once(informed: bool) -> None:
    results = run_group(
        _torn_source_child,
        WORLD,
        (informed,),
        timeout_s=90,
        group_timeout_s=10,
        faults=FaultSchedule(Kill(0, "after_pack", 3)),
    )
    assert results[1] is not None and results[1].failed_with(TornWeightsError)
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf is not None and leaf.error is not None
        # Untouched either way: the manifest never came.
        assert leaf.version == 1 and leaf.servable is True
        if informed:
            assert leaf.failed_with(ManifestRejected), leaf.error
            # The torn source has no version to send: the message names none (not "0").
            assert "aborted the transfer before sending a manifest" in leaf.error.message
            assert leaf.elapsed_s < 1.0
        else:
            assert leaf.failed_with(WeightTransferTimeout), leaf.error
            assert leaf.elapsed_s >= TIMEOUT_S


def _rejected_child(rank: int, who: int) -> tuple[SyncOutcome, bool, ErrorReport | None]:
    """The sync's outcome, whether the weights are untouched, and the failure's cause."""
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, timeout_s=10)
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        return SyncOutcome.of(_sync(rank, None, p2r, 1)), True, None
    shape = _LM if rank != who else TinyLMConfig(**{**_LM.__dict__, "vocab_size": 65})
    backend = TorchLMBackend(shape, pause_timeout=10)
    before = weights_digest(backend.served_weights())
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(config=config),
        r2r=groups.r2r_transfer(config=config),
        weight_sync_timeout=10,
    )
    try:
        started = time.monotonic()
        result = worker.handle(P2R(step=1, relay=True) if rank == 1 else R2R(step=1))
        return (
            SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started),
            weights_digest(backend.served_weights()) == before,
            ErrorReport.of_optional(getattr(result.exception, "cause", None)),
        )
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
def test_a_leaf_that_rejects_the_manifest_gets_nothing_and_the_relay_still_takes_it() -> None:
    results = run_group(_rejected_child, WORLD, (3,), timeout_s=90)
    (leaf3, untouched3, _), (leaf2, untouched2, _) = results[3], results[2]
    assert leaf3.failed_with(WeightMismatchError) and untouched3
    assert leaf2.failed_with(ManifestRejected) and untouched2
    relay, _, cause = results[1]
    assert relay.failed_with(RelayForwardError) and cause and cause.is_a(ManifestRejected)
    assert relay.version == 1  # received whole, committed, and the failure reported
    assert results[0][0].ok  # the trainer's P2R succeeded


@pytest.mark.timeout(120)
def test_a_relay_that_rejects_the_manifest_tells_its_leaves_at_once() -> None:
    results = run_group(_rejected_child, WORLD, (1,), timeout_s=90)
    relay, untouched, _ = results[1]
    assert relay.failed_with(WeightMismatchError) and untouched
    assert results[0][0].failed_with(ManifestRejected)
    for rank in (2, 3):
        leaf, untouched, _ = results[rank]
        assert leaf.failed_with(ManifestRejected) and untouched and leaf.version == 0
        assert leaf.elapsed_s < 5.0
