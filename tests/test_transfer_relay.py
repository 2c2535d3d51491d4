"""The pipelined relay and zero-copy buckets, between real processes (gloo on loopback, CPU).

Rank 0 is the trainer, rank 1 the relay (P2R receiver, R2R source), ranks 2 and 3 the leaves.
Every combination of relay (pipelined or not), zero-copy (flat storage or not), checksums (off,
verified before writing, verified after) and bucket layout (buckets that split the model at
unaligned tensors, buckets that align with tensors, one bucket) must land bit-identically; the
faults (a bad bucket, a relay or a trainer killed mid-pipeline, a rejected manifest) must end in
a clear error, bounded in time, with weights untouched or marked torn, never served torn.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from rollout_sync.backends import TinyLMConfig, TorchLMBackend, tiny_lm_weights
from rollout_sync.distributed import init_process_group, new_group, wait_work
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
from rollout_sync.testing import find_free_port, run_processes, weights_digest
from rollout_sync.transfer import TransferConfig, TransferHooks, WeightTransfer
from rollout_sync.worker import P2R, R2R, RolloutWorker, build_sync_groups

pytestmark = pytest.mark.multiprocess

WORLD = 4
"""Trainer, relay, two leaves."""

TIMEOUT_S = 4.0
"""The collective timeout of the fault tests: a failure noticed in time is well under it."""


def _run(target: Any, *args: Any, timeout: float = 90.0, **kwargs: Any) -> dict[int, Any]:
    return run_processes(
        target, WORLD, (find_free_port(), *args), timeout_s=timeout, intra_op_threads=1, **kwargs
    )


def _init(rank: int, port: int, timeout_s: float = 20.0) -> None:
    init_process_group(
        rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s
    )


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


def _combinations_child(rank: int, port: int) -> list[dict[str, Any]]:
    _init(rank, port)
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
            out.append({"refused": f"{type(exc).__name__}: {exc}"})
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
    results = _run(_combinations_child, timeout=150)
    for rank in (2, 3):
        refused = results[rank].pop(0)["refused"]
        assert refused.startswith("ValueError: storage must be a contiguous 1-D uint8 tensor")
    assert results[1].pop(0)["refused"].startswith("ManifestRejected: ")
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


def _sync(rank: int, worker: RolloutWorker, p2r: WeightTransfer | None, version: int) -> Any:
    """One pipelined sync of ``version`` on every rank; the replicas' results."""
    if rank == 0:
        assert p2r is not None
        try:
            return p2r.send(_trainer_weights(version), version=version)
        except WeightTransferError as exc:
            return exc
    command = P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
    return worker.handle(command)


def _outcome(result: Any, backend: TorchLMBackend | None) -> dict[str, Any]:
    """What one rank's sync ended in: the trainer's exception (or stats), a replica's result."""
    if backend is None:
        return {"error": type(result).__name__}
    return {
        "error": type(result.exception).__name__,
        "text": result.error,
        "servable": (not backend.weights_torn),
        "version": backend.weight_version,
    }


def _bad_bucket_child(rank: int, port: int, hop: str) -> dict[str, Any]:
    _init(rank, port)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, checksums=True, timeout_s=10)
    hooks = TransferHooks()

    def flip(k: int, flat: torch.Tensor) -> None:
        if k == 2:
            flat[5] ^= 0xFF

    p2r = groups.p2r_transfer(config=config, hooks=hooks) if rank == 0 else None
    backend, worker = (None, None) if rank == 0 else _worker(rank, groups, config, hooks)
    out: dict[str, Any] = {}
    try:
        if hop == "p2r" and rank == 0:
            hooks.after_pack = flip  # corrupted after the checksum: on the wire to the relay
        if hop == "relay" and rank == 1:
            hooks.after_receive = flip  # corrupted in the relay's buffer, before it forwards
        result = _sync(rank, worker, p2r, 1)  # type: ignore[arg-type]
        hooks.after_pack = hooks.after_receive = None
        out.update(_outcome(result, backend))
        # A clean sync recovers every replica, bit-identically.
        result = _sync(rank, worker, p2r, 2)  # type: ignore[arg-type]
        if rank != 0:
            assert backend is not None
            out["recovered"] = (result.ok, backend.weight_version, (not backend.weights_torn))
            out["digest"] = weights_digest(backend.served_weights())
        else:
            out["digest"] = weights_digest(_trainer_weights(2))
    finally:
        if worker is not None:
            worker.close(10)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hop", ["p2r", "relay"])
def test_a_bad_bucket_in_the_pipelined_relay_is_caught_on_every_downstream_replica(
    hop: str,
) -> None:
    results = _run(_bad_bucket_child, hop)
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["error"] == ChecksumMismatchError.__name__, leaf["text"]
        assert "bucket 2 arrived with checksum" in leaf["text"]
        assert leaf["servable"] is False  # buckets 0 and 1 were written: torn, refused
    relay = results[1]
    assert relay["error"] == ChecksumMismatchError.__name__
    assert relay["servable"] is False
    assert results[0]["error"] == ChecksumMismatchError.__name__  # the commit vote said so
    for rank in (1, 2, 3):
        assert results[rank]["recovered"] == (True, 2, True)
        assert results[rank]["digest"] == results[0]["digest"]


def _linger(survivors: Any) -> None:
    """Survivors wait for each other before exiting, so that no failure seen by a leaf is
    just another survivor's process ending."""
    if survivors is not None:
        work = torch.distributed.barrier(group=survivors, async_op=True)
        wait_work(work, operation="linger", timeout_s=30)


def _killed_child(rank: int, port: int, victim: int, informed: bool = True) -> dict[str, Any]:
    _init(rank, port, timeout_s=10)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([r for r in range(WORLD) if r != victim], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    hooks = TransferHooks()
    if not informed:
        # The unguarded relay: its source dies and it just raises, sending nothing more.
        monkeypatch_relay_fill_off()

    def die(k: int, flat: torch.Tensor) -> None:
        if k == 3:
            os._exit(17)

    p2r = groups.p2r_transfer(config=config, hooks=hooks) if rank == 0 else None
    backend, worker = (None, None) if rank == 0 else _worker(rank, groups, config, hooks)
    out: dict[str, Any] = {}
    try:
        first = _sync(rank, worker, p2r, 1)  # type: ignore[arg-type]
        assert rank == 0 or first.ok, first.error
        if rank == victim == 0:
            hooks.after_pack = die
        if rank == victim == 1:
            hooks.after_receive = die
        started = time.monotonic()
        result = _sync(rank, worker, p2r, 2)  # type: ignore[arg-type]
        out["elapsed"] = time.monotonic() - started
        out.update(_outcome(result, backend))
        _linger(survivors)
    finally:
        if worker is not None:
            worker.close(10)
    return out


@pytest.mark.timeout(120)
def test_a_relay_killed_mid_pipeline_leaves_its_leaves_with_a_clear_error_never_served_torn() -> (
    None
):
    results = _run(_killed_child, 1, expected_exits={1: 17})
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["error"] == WeightTransferError.__name__, leaf["text"]
        assert "peer most likely died" in leaf["text"]
        assert leaf["elapsed"] < TIMEOUT_S / 2, "the dead relay was not noticed in time"
        # Buckets 0-2 landed in place (zero-copy into flat storage) before the relay died.
        assert leaf["servable"] is False and leaf["version"] == 1
    assert results[0]["error"] == WeightTransferError.__name__
    assert results[0]["elapsed"] < TIMEOUT_S / 2


@pytest.mark.timeout(120)
def test_a_trainer_killed_mid_pipeline_fails_the_leaves_fast_through_the_relay() -> None:
    results = _run(_killed_child, 0, expected_exits={0: 17})
    relay = results[1]
    assert relay["error"] == WeightTransferError.__name__
    assert "peer most likely died" in relay["text"]
    assert relay["servable"] is False
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["error"] == WeightTransferError.__name__, leaf["text"]
        assert "source rank 1 reported that it failed mid-transfer" in leaf["text"]
        # The relay sent the rest as zeros and voted no: the leaves fail within the relay's
        # own detection time, well under the collective timeout.
        assert leaf["elapsed"] < TIMEOUT_S / 2
        assert leaf["servable"] is False and leaf["version"] == 1


@pytest.mark.timeout(120)
def test_without_the_fill_the_leaves_of_a_failed_relay_wait_out_the_timeout() -> None:
    """The test above can fail: a relay that only raises leaves its leaves waiting."""
    results = _run(_killed_child, 0, False, expected_exits={0: 17})
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["error"] == WeightTransferTimeout.__name__, leaf["text"]
        assert leaf["elapsed"] >= TIMEOUT_S
        assert leaf["servable"] is False  # still never served torn


def monkeypatch_relay_fill_off() -> None:
    """In a child process: the relay no longer sends the void rest after its source died."""
    from rollout_sync.transfer import _pipeline

    _pipeline._Forward.fill = lambda self: None  # type: ignore[method-assign]


# -- a relay whose P2R barrier fails ------------------------------------------------------------


def _barrier_mismatch_child(rank: int, port: int) -> list[dict[str, Any]]:
    """Two rounds of a pipelined sync where the relay takes the P2R barrier and the trainer
    does not: round 1 as shipped, round 2 with the relay's abort disabled (the counterfactual:
    its leaves are not told)."""
    _init(rank, port, timeout_s=10)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    # The replicas leave together: a relay that exits early would close its leaves' waits.
    replicas = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    out: list[dict[str, Any]] = []
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        for version in (1, 2):
            try:
                p2r.send(_trainer_weights(version), version=version)
                out.append({"error": None})
            except WeightTransferError as exc:
                out.append({"error": type(exc).__name__})
        return out
    backend, worker = _worker(rank, groups, config, barrier=True)
    try:
        for version in (1, 2):
            if version == 2:
                WeightTransfer.abort = lambda self, reason, version=0: None  # type: ignore[method-assign]
            started = time.monotonic()
            result = worker.handle(
                P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
            )
            out.append(
                {
                    "error": None if result.ok else type(result.exception).__name__,
                    "text": result.error,
                    "elapsed": time.monotonic() - started,
                    "version": backend.weight_version,
                    "torn": backend.weights_torn,
                }
            )
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
    results = _run(_barrier_mismatch_child)
    assert results[0] == [{"error": P2RBarrierMismatch.__name__}] * 2
    informed, uninformed = zip(*(results[rank] for rank in (1, 2, 3)), strict=True)
    assert informed[0]["error"] == P2RBarrierMismatch.__name__, informed[0]["text"]
    for leaf in informed[1:]:
        assert leaf["error"] == ManifestRejected.__name__, leaf["text"]
        assert "aborted" in leaf["text"]
        assert leaf["elapsed"] < TIMEOUT_S / 2, "the leaves were not told in time"
    # Without the abort the leaves wait out their limit: the check above can fail.
    for leaf in uninformed[1:]:
        assert leaf["error"] == WeightTransferTimeout.__name__, leaf["text"]
        assert leaf["elapsed"] >= TIMEOUT_S
    for replica in (*informed, *uninformed):
        assert replica["version"] == 0 and not replica["torn"]  # nothing written anywhere


def _trainer_dies_at_barrier_child(rank: int, port: int) -> dict[str, Any]:
    """Version 1 syncs through the pipelined relay, P2R barrier on both sides; at version 2
    the trainer dies at its barrier, with the relay and the leaves waiting."""
    from rollout_sync.trainer import TransferWeightPusher

    _init(rank, port, timeout_s=10)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        TransferWeightPusher(p2r, barrier=groups.p2r_barrier).push_weights(
            _trainer_weights(1), version=1, timeout=10
        )

        def die(timeout_s: float) -> None:
            os._exit(17)

        TransferWeightPusher(p2r, barrier=die).push_weights(
            _trainer_weights(2), version=2, timeout=10
        )
        return {}
    backend, worker = _worker(rank, groups, config, barrier=True)
    try:
        out: dict[str, Any] = {}
        for version in (1, 2):
            started = time.monotonic()
            result = worker.handle(
                P2R(step=version, relay=True) if rank == 1 else R2R(step=version)
            )
            out[f"v{version}"] = {
                "error": None if result.ok else type(result.exception).__name__,
                "text": result.error,
                "elapsed": time.monotonic() - started,
            }
        out["version"] = backend.weight_version
        out["torn"] = backend.weights_torn
        _linger(survivors)
        return out
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
def test_a_trainer_dying_at_the_p2r_barrier_fails_the_relays_leaves_at_once() -> None:
    results = _run(_trainer_dies_at_barrier_child, expected_exits={0: 17})
    relay = results[1]
    assert relay["v1"]["error"] is None, relay["v1"]["text"]
    assert relay["v2"]["error"] is not None and relay["v2"]["elapsed"] < TIMEOUT_S / 2
    for rank in (2, 3):
        leaf = results[rank]
        assert leaf["v1"]["error"] is None, leaf["v1"]["text"]
        assert leaf["v2"]["error"] == ManifestRejected.__name__, leaf["v2"]["text"]
        assert "aborted the transfer before sending a manifest" in leaf["v2"]["text"]
        assert leaf["v2"]["elapsed"] < TIMEOUT_S / 2, "the leaves were not told in time"
    for rank in (1, 2, 3):  # nothing written: every replica still serves version 1, whole
        assert results[rank]["version"] == 1 and not results[rank]["torn"]


# -- a torn R2R source aborts -------------------------------------------------------------------


def _torn_source_child(rank: int, port: int, informed: bool) -> dict[str, Any]:
    _init(rank, port, timeout_s=10)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=10)
    survivors = new_group([1, 2, 3], timeout_s=30)
    config = TransferConfig(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    hooks = TransferHooks()
    if not informed:
        WeightTransfer.abort = lambda self, reason, version=0: None  # type: ignore[method-assign]

    def die(k: int, flat: torch.Tensor) -> None:
        if k == 3:
            os._exit(17)  # the trainer dies mid-P2R: the relay is torn

    if rank == 0:
        p2r = groups.p2r_transfer(config=config, hooks=hooks)
        assert p2r is not None
        p2r.send(_trainer_weights(1), version=1)
        hooks.after_pack = die
        p2r.send(_trainer_weights(2), version=2)
        return {}
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
        out = {
            "error": type(result.exception).__name__,
            "text": result.error,
            "elapsed": time.monotonic() - started,
            "version": backend.weight_version,
            "servable": (not backend.weights_torn),
        }
        _linger(survivors)
        return out
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("informed", [True, False], ids=["abort_header", "no_abort_header"])
def test_a_torn_r2r_source_aborts_so_its_receivers_fail_at_once(informed: bool) -> None:
    results = _run(_torn_source_child, informed, expected_exits={0: 17})
    assert results[1]["error"] == TornWeightsError.__name__
    for rank in (2, 3):
        leaf = results[rank]
        # Untouched either way: the manifest never came.
        assert leaf["version"] == 1 and leaf["servable"] is True
        if informed:
            assert leaf["error"] == ManifestRejected.__name__, leaf["text"]
            # The torn source has no version to send: the message names none (not "0").
            assert "aborted the transfer before sending a manifest" in leaf["text"], leaf["text"]
            assert leaf["elapsed"] < 1.0
        else:
            assert leaf["error"] == WeightTransferTimeout.__name__, leaf["text"]
            assert leaf["elapsed"] >= TIMEOUT_S


def _rejected_child(rank: int, port: int, who: int) -> dict[str, Any]:
    _init(rank, port)
    groups = build_sync_groups(0, [1, 2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, timeout_s=10)
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        try:
            p2r.send(_trainer_weights(1), version=1)
        except WeightTransferError as exc:
            return {"error": type(exc).__name__}
        return {"error": None}
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
        return {
            "ok": result.ok,
            "error": type(result.exception).__name__ if result.exception else None,
            "elapsed": time.monotonic() - started,
            "version": backend.weight_version,
            "untouched": weights_digest(backend.served_weights()) == before,
            "cause": type(getattr(result.exception, "cause", None)).__name__,
        }
    finally:
        worker.close(10)


@pytest.mark.timeout(120)
def test_a_leaf_that_rejects_the_manifest_gets_nothing_and_the_relay_still_takes_it() -> None:
    results = _run(_rejected_child, 3)
    assert results[3]["error"] == WeightMismatchError.__name__ and results[3]["untouched"]
    assert results[2]["error"] == ManifestRejected.__name__ and results[2]["untouched"]
    relay = results[1]
    assert relay["error"] == RelayForwardError.__name__ and relay["cause"] == "ManifestRejected"
    assert relay["version"] == 1  # received whole, committed, and the failure reported
    assert results[0]["error"] is None  # the trainer's P2R succeeded


@pytest.mark.timeout(120)
def test_a_relay_that_rejects_the_manifest_tells_its_leaves_at_once() -> None:
    results = _run(_rejected_child, 1)
    assert results[1]["error"] == WeightMismatchError.__name__ and results[1]["untouched"]
    assert results[0]["error"] == ManifestRejected.__name__
    for rank in (2, 3):
        assert results[rank]["error"] == ManifestRejected.__name__
        assert results[rank]["untouched"] and results[rank]["version"] == 0
        assert results[rank]["elapsed"] < 5.0
