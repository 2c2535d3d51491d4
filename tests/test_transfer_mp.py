"""P2R / R2R weight transfer between real processes: gloo on loopback, CPU.

Every test spawns a small group with ``run_group`` (children report their tracebacks), gives
every collective a timeout, and asserts in the parent on what the children returned: the
package's own exceptions, whole (they pickle with their attributes), or typed outcomes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from rollout_sync.distributed import init_process_group
from rollout_sync.errors import (
    ChecksumMismatchError,
    ManifestError,
    ManifestRejected,
    TornWeightsError,
    WeightMismatchError,
    WeightTransferError,
    WeightTransferTimeout,
)
from rollout_sync.testing import (
    FaultSchedule,
    Kill,
    SyncOutcome,
    TornReadBackend,
    VersionStampedModel,
    find_free_port,
    run_group,
    run_processes,
    transfer_fault_hooks,
    weights_digest,
)
from rollout_sync.trace import SpanKind, Timeline
from rollout_sync.transfer import (
    OriginChecksums,
    TransferConfig,
    TransferHooks,
    WeightTransfer,
    named_weights,
)
from rollout_sync.worker import P2R, R2R, RolloutWorker, build_sync_groups

pytestmark = pytest.mark.multiprocess


def _model(version: float, n: int = 12, numel: int = 300) -> dict[str, torch.Tensor]:
    """A model whose bytes depend on ``version`` and on every element's position."""
    gen = torch.Generator().manual_seed(1234)
    return {f"layers.{i}.weight": torch.rand(numel, generator=gen) + version for i in range(n)}


# -- bad manifests -----------------------------------------------------------------------------

_CASES = ["wrong_name", "wrong_shape", "wrong_dtype", "missing", "one_replica_differs"]


def _bad_manifest_child(rank: int) -> list[tuple[Any, ...]]:
    transfer = WeightTransfer(None, 0, config=TransferConfig(bucket_bytes=1024, timeout_s=10))
    out: list[tuple[Any, ...]] = []
    if rank == 0:
        for i, case in enumerate(_CASES):
            weights = _model(10 + i)
            if case == "wrong_name":
                weights["layers.99.weight"] = weights.pop("layers.1.weight")
            elif case == "wrong_shape":
                weights["layers.1.weight"] = torch.zeros(7, 3)
            elif case == "wrong_dtype":
                weights["layers.1.weight"] = weights["layers.1.weight"].double()
            elif case == "missing":
                weights.pop("layers.1.weight")
            try:
                transfer.send(weights, version=10 + i)
                out.append((case, None))
            except ManifestRejected as exc:
                out.append((case, exc))
            # The group is still usable: a good sync right after goes through everywhere.
            transfer.send(_model(20 + i), version=20 + i)
        return out
    served = {name: torch.zeros_like(t) for name, t in _model(0).items()}
    for i, case in enumerate(_CASES):
        target = dict(served)
        if case == "one_replica_differs" and rank == 2:
            target["layers.1.weight"] = torch.zeros(5)  # this replica's model differs
        before = weights_digest(served)
        started = time.monotonic()
        error: Exception | None = None
        try:
            transfer.receive(target)
        except (WeightMismatchError, ManifestRejected) as exc:
            error = exc
        untouched = weights_digest(served) == before
        elapsed_s = time.monotonic() - started
        transfer.receive(served)
        good = weights_digest(served) == weights_digest(_model(20 + i))
        out.append((case, error, untouched, elapsed_s, good))
    return out


@pytest.mark.timeout(60)
def test_bad_manifests_fail_everywhere_and_write_nothing() -> None:
    results = run_group(_bad_manifest_child, 3, timeout_s=60)
    assert all([case for case, *_ in results[rank]] == _CASES for rank in range(3))
    for case, rejected in results[0]:
        assert isinstance(rejected, ManifestRejected), case
        assert rejected.rejected_by == ((2,) if case == "one_replica_differs" else (1, 2)), case
    for rank in (1, 2):
        for case, error, untouched, elapsed_s, good in results[rank]:
            assert untouched, f"rank {rank} {case}: served weights were written"
            assert elapsed_s < 5.0, f"rank {rank} {case}: the rejection took too long"
            assert good, f"rank {rank} {case}: the next good sync did not land"
            if case == "one_replica_differs" and rank == 1:
                assert isinstance(error, ManifestRejected) and error.rejected_by == (2,)
                continue
            assert isinstance(error, WeightMismatchError), (rank, case, error)
            problems = "\n".join(error.problems)
            expected = {
                "wrong_name": "layers.99.weight: not a served weight",
                "wrong_shape": "layers.1.weight: shape [7, 3] does not match",
                "wrong_dtype": "layers.1.weight: dtype torch.float64 does not match",
                "missing": "layers.1.weight: missing",
                "one_replica_differs": "layers.1.weight: shape [300] does not match served [5]",
            }[case]
            assert expected in problems


# -- subsets, layouts, non-contiguous targets --------------------------------------------------


def _mixed_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(300, 64),  # 76.8 kB: larger than a bucket, sent in place
        torch.nn.Linear(64, 33),
        torch.nn.LayerNorm(33),
        torch.nn.Linear(33, 7, bias=False),
    )
    model[2].weight.requires_grad_(False)  # frozen: not in a trainable_only sync
    model.register_buffer("steps", torch.tensor(5, dtype=torch.int64))
    model[1].to(torch.bfloat16)
    return model


def _layouts_child(rank: int, checksums: bool) -> dict[str, Any]:
    config = TransferConfig(bucket_bytes=16 << 10, checksums=checksums, timeout_s=10)
    transfer = WeightTransfer(None, 0, config=config)
    model = _mixed_model()
    if rank == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        full = transfer.send(named_weights(model), version=1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        subset = transfer.send(
            named_weights(model, trainable_only=True), version=2, require_all=False
        )
        return {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "buckets": full.buckets,
            "subset_tensors": subset.tensors,
        }
    # The replica serves transposed (non-contiguous) copies of the two 2-D Linear weights.
    served: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 2 and name != "0.weight":
            served[name] = torch.zeros(tensor.shape[1], tensor.shape[0], dtype=tensor.dtype).t()
        else:
            served[name] = torch.zeros_like(tensor)
    assert not served["1.weight"].is_contiguous()
    transfer.receive(served)
    after_full = {k: v.clone() for k, v in served.items()}
    frozen_before = served["2.weight"].clone()
    stats = transfer.receive(served)
    return {
        "after_full": after_full,
        "served": served,
        "written": stats.tensors_written,
        "frozen_unchanged": torch.equal(frozen_before, served["2.weight"]),
        "verified": stats.checksums_verified,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksums", [False, True])
def test_full_then_trainable_only_into_non_contiguous_mixed_dtype_targets(checksums: bool) -> None:
    results = run_group(_layouts_child, 2, (checksums,), timeout_s=60)
    trainer, replica = results[0], results[1]
    expected = trainer["state"]
    # Full sync (version 1): every tensor, bit-identical (trainer state at v1 = v2 minus 1 on
    # parameters; compare the subset sync's result below for parameters, buffers here).
    assert torch.equal(replica["after_full"]["steps"], expected["steps"])
    # Trainable-only sync (version 2): the trainable parameters equal the trainer's v2, the
    # frozen LayerNorm weight was not sent and kept its v1 value.
    for name in ("0.weight", "1.weight", "1.bias", "2.bias", "3.weight"):
        assert torch.equal(replica["served"][name], expected[name]), name
        assert replica["served"][name].dtype == expected[name].dtype
    assert replica["frozen_unchanged"]
    assert torch.equal(replica["served"]["2.weight"], expected["2.weight"] - 1.0)
    assert replica["written"] == trainer["subset_tensors"] == 5
    assert trainer["buckets"] >= 2
    if checksums:
        assert replica["verified"] >= 1


def _subset_refused_child(rank: int) -> tuple[Exception | None, bool]:
    """What the sync raised here, and whether the served weights stayed untouched."""
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=10))
    weights = _model(1)
    served = {k: torch.zeros_like(v) for k, v in weights.items()}
    try:
        if rank == 0:
            subset = {"layers.0.weight": weights["layers.0.weight"]}
            transfer.send(subset, version=1, require_all=False)
        else:
            transfer.receive(served, allow_subset=False)
    except (ManifestRejected, ValueError) as exc:
        return exc, not any(t.any() for t in served.values())
    return None, not any(t.any() for t in served.values())


@pytest.mark.timeout(60)
def test_a_receiver_can_refuse_subset_syncs() -> None:
    results = run_group(_subset_refused_child, 2, timeout_s=60)
    (rejected, _), (refusal, untouched) = results[0], results[1]
    assert isinstance(rejected, ManifestRejected) and rejected.rejected_by == (1,)
    assert isinstance(refusal, ValueError) and "requires a full sync" in str(refusal)
    assert untouched


def _abort_child(rank: int) -> tuple[Exception | None, float]:
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=10))
    started = time.monotonic()
    try:
        if rank == 0:
            transfer.send({"s": torch.eye(3).to_sparse()}, version=1)
        else:
            transfer.receive({"s": torch.zeros(3, 3)})
    except (ValueError, ManifestRejected) as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_source_that_cannot_build_a_manifest_aborts_its_peers_fast() -> None:
    results = run_group(_abort_child, 2, timeout_s=60)
    (source, _), (peer, seconds) = results[0], results[1]
    assert isinstance(source, ManifestError)
    assert isinstance(peer, ManifestRejected) and peer.rejected_by == (0,) and seconds < 5.0


# -- checksums ---------------------------------------------------------------------------------


def _corrupt_child(rank: int) -> tuple[ChecksumMismatchError | None, tuple[int, bool]]:
    """The corrupted sync's error, then the next sync's (version, landed bit-identically)."""
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=10)

    def flip(k: int, flat: torch.Tensor) -> None:
        if k == 1:
            flat[17] ^= 0x40  # one bit, as a bad NIC or a stray write would

    hooks = TransferHooks(after_receive=flip if rank == 2 else None)
    transfer = WeightTransfer(None, 0, config=config, hooks=hooks)
    served = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    error: ChecksumMismatchError | None = None
    try:
        if rank == 0:
            transfer.send(_model(1), version=1)
        else:
            transfer.receive(served)
    except ChecksumMismatchError as exc:
        error = exc
    hooks.after_receive = None
    if rank == 0:
        return error, (transfer.send(_model(2), version=2).version, True)
    stats = transfer.receive(served)
    return error, (stats.version, weights_digest(served) == weights_digest(_model(2)))


@pytest.mark.timeout(60)
def test_a_corrupted_bucket_is_caught_and_every_rank_learns_it() -> None:
    results = run_group(_corrupt_child, 3, timeout_s=60)
    errors = {rank: error for rank, (error, _) in results.items()}
    assert errors[0] is not None and errors[0].failed_ranks == (2,)
    bad = errors[2]
    assert bad is not None
    assert (bad.buckets, bad.failed_ranks, bad.targets_torn, bad.complete) == (
        (1,),
        (2,),
        True,
        False,
    )
    assert "bucket 1 arrived with checksum" in str(bad)
    # Rank 1 received every byte intact: its weights are a complete version, not torn.
    intact = errors[1]
    assert intact is not None
    assert (intact.buckets, intact.failed_ranks, intact.targets_torn, intact.complete) == (
        (),
        (2,),
        False,
        True,
    )
    # And the group recovers with the next sync.
    assert [results[rank][1] for rank in range(3)] == [(2, True)] * 3


def _origin_child(rank: int) -> ChecksumMismatchError | None:
    groups = build_sync_groups(0, [1, 2], timeout_s=10)
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=10)
    p2r = groups.p2r_transfer(config=config)
    r2r = groups.r2r_transfer(config=config)
    if rank == 0:
        assert p2r is not None
        p2r.send(_model(1), version=1)
        return None
    served = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    assert r2r is not None
    if rank == 1:
        assert p2r is not None
        stats = p2r.receive(served)
        assert stats.bucket_checksums is not None
        origin = OriginChecksums(stats.version, stats.layout, stats.bucket_checksums)
        served["layers.3.weight"][5] += 1.0  # the replica's copy goes bad after it arrived
    try:
        if rank == 1:
            r2r.send(served, version=1, origin=origin)
        else:
            r2r.receive(served)
    except ChecksumMismatchError as exc:
        return exc
    return None


@pytest.mark.timeout(60)
def test_origin_checksums_catch_a_replica_that_forwards_bad_bytes() -> None:
    results = run_group(_origin_child, 3, timeout_s=60)
    assert results[1] is not None and results[1].failed_ranks == (2,)
    assert "differ from what it received" in str(results[2])


# -- a peer dies or hangs mid-transfer ---------------------------------------------------------


def _killed_child(rank: int) -> dict[str, Any]:
    groups = build_sync_groups(0, [1, 2], timeout_s=10)
    config = TransferConfig(bucket_bytes=2048, timeout_s=10)
    if rank == 0:
        p2r = groups.p2r_transfer(config=config)
        assert p2r is not None
        p2r.send(_model(1), version=1)
        p2r.hooks = transfer_fault_hooks()  # the trainer crashes after shipping four buckets
        p2r.send(_model(2), version=2)
        return {}
    timeline = Timeline()
    model = VersionStampedModel(12, 300, timeline=timeline, read_gap_s=0.0)
    backend = TornReadBackend(model, pause_timeout=10, timeline=timeline)
    worker = RolloutWorker(
        backend,
        p2r=groups.p2r_transfer(config=config),
        r2r=groups.r2r_transfer(config=config),
        timeline=timeline,
        weight_sync_timeout=10,
    )
    out: dict[str, Any] = {}
    try:
        if rank == 1:
            assert worker.handle(P2R(step=1)).ok
            assert worker.handle(R2R(step=1)).ok
            assert isinstance(worker.p2r, WeightTransfer)
            worker.p2r.hooks = transfer_fault_hooks()  # after_receive k: the kill's signal
            started = time.monotonic()
            result = worker.handle(P2R(step=2))
            out["failed"] = SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started)
            torn_at = time.monotonic_ns()
            try:
                backend.check_servable()
                out["servable"] = True
            except TornWeightsError as exc:
                out["servable"] = str(exc)
            # A torn source never sends: its R2R aborts, and replica 2 hears it at once.
            out["r2r_from_torn"] = SyncOutcome.of(worker.handle(R2R(step=2)), backend)
            # Recovery: replica 2 still holds version 1 whole; it broadcasts it back.
            assert worker.r2r is not None
            worker.r2r = WeightTransfer(worker.r2r.group, 2, config=config)
            recovered = worker.handle(R2R(step=1))
            recovered_at = time.monotonic_ns()
            out["recovered"] = (recovered.ok, backend.weight_version, backend.weights_torn)
            # Generation resumes after the complete sync (bounded wait for a forward).
            seen = model.forwards
            out["resumed"] = model.wait_for_forwards(seen + 1, timeout=10) > seen
            # While torn, no forward started.
            out["forwards_while_torn"] = sum(
                1 for s in timeline.spans(SpanKind.FORWARD) if torn_at <= s.start_ns < recovered_at
            )
        else:
            assert worker.handle(R2R(step=1)).ok
            started = time.monotonic()
            result = worker.handle(R2R(step=2))
            out["r2r"] = SyncOutcome.of(result, backend, elapsed_s=time.monotonic() - started)
            worker.r2r = WeightTransfer(groups.r2r, 2, config=config)
            assert worker.handle(R2R(step=1)).ok
        out["digest"] = weights_digest(backend.served_weights())
        out["torn_reads"] = model.torn_reads
        out["overlaps"] = len(timeline.overlaps())
    finally:
        worker.close(10)
    return out


@pytest.mark.timeout(90)
def test_a_trainer_killed_mid_transfer_leaves_a_torn_replica_that_refuses_to_generate() -> None:
    results = run_group(
        _killed_child,
        3,
        timeout_s=90,
        group_timeout_s=10,
        # Between two buckets of the replica: it took bucket 2, bucket 5 never leaves.
        faults=FaultSchedule(Kill(0, "after_pack", 4, after="after_receive:2")),
    )
    rep = results[1]
    failed = rep["failed"]
    assert failed.failed_with(WeightTransferError)
    text = failed.error.message
    assert "bucket" in text and "on the group of ranks [0, 1]" in text
    assert "peer most likely died" in text, "a dead peer must not read as a timeout"
    assert failed.elapsed_s < 10.0, "the dead peer was not noticed within the timeout"
    assert failed.servable is False
    assert "refuses to generate" in rep["servable"]
    assert rep["r2r_from_torn"].failed_with(TornWeightsError)
    leaf = results[2]["r2r"]
    assert leaf.failed_with(ManifestRejected) and leaf.elapsed_s < 5.0, leaf
    assert leaf.servable is True and leaf.version == 1  # nothing written, nothing committed
    assert rep["forwards_while_torn"] == 0
    assert rep["recovered"] == (True, 1, False)
    assert rep["resumed"]
    assert (
        rep["digest"]
        == results[2]["digest"]
        == weights_digest({k: v for k, v in _model(1).items()})
    )
    assert rep["torn_reads"] == 0 and results[2]["torn_reads"] == 0
    assert rep["overlaps"] == 0


def _hung_child(rank: int) -> tuple[WeightTransferError | None, float]:
    config = TransferConfig(bucket_bytes=1024, timeout_s=1.0)
    release = threading.Event()

    def hang(k: int, flat: torch.Tensor) -> None:
        if k == 2:
            release.wait(2.5)  # the trainer stalls (a stuck optimizer step, a GC pause)

    transfer = WeightTransfer(None, 0, config=config, hooks=TransferHooks(after_pack=hang))
    started = time.monotonic()
    try:
        if rank == 0:
            transfer.send(_model(1), version=1)
        else:
            transfer.receive({k: torch.zeros_like(v) for k, v in _model(0).items()})
    except WeightTransferError as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_hung_peer_times_out_with_a_clear_error() -> None:
    error, elapsed_s = run_group(_hung_child, 2, timeout_s=60)[1]
    assert isinstance(error, WeightTransferTimeout)
    assert "did not complete within 1.0 s" in str(error)
    assert 0.9 < elapsed_s < 2.5
    assert error.tensors_written > 0  # buckets 0 and 1 had landed: the targets are torn


# -- CUDA (skipped cleanly without a GPU; the same code path as gloo above) ---------------------


def _cuda_child(rank: int, port: int, backend: str) -> bool:
    torch.cuda.set_device(rank if backend == "nccl" else 0)
    init_process_group(
        rank=rank,
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        backend=backend,
        timeout_s=30,
    )
    transfer = WeightTransfer(
        None, 0, config=TransferConfig(bucket_bytes=4096, timeout_s=30, checksums=True)
    )
    weights = {k: v.cuda() for k, v in _model(3).items()}
    if rank == 0:
        transfer.send(weights, version=3)
        return True
    served = {k: torch.zeros_like(v) for k, v in weights.items()}
    transfer.receive(served)
    torch.cuda.synchronize()
    return all(torch.equal(served[k], weights[k]) for k in weights)


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gloo_transfer_into_cuda_targets() -> None:
    assert _run_cuda("gloo") == {0: True, 1: True}


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= 2
        and torch.distributed.is_nccl_available()
    ),
    reason="needs two CUDA devices and NCCL",
)
def test_nccl_transfer_between_two_gpus() -> None:
    assert _run_cuda("nccl") == {0: True, 1: True}


def _run_cuda(backend: str) -> dict[int, bool]:
    return run_processes(_cuda_child, 2, (find_free_port(), backend), timeout_s=90)
