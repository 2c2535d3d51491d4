"""P2R / R2R weight transfer between real processes: gloo on loopback, CPU.

Every test spawns a small group with ``run_processes`` (children report their tracebacks),
gives every collective a timeout, and asserts in the parent on what the children returned.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from conftest import wait_until

from rollout_sync.distributed import init_process_group
from rollout_sync.errors import (
    ChecksumMismatchError,
    ManifestRejected,
    TornWeightsError,
    WeightMismatchError,
    WeightTransferError,
    WeightTransferTimeout,
)
from rollout_sync.testing import (
    TornReadBackend,
    VersionStampedModel,
    find_free_port,
    run_processes,
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


def _run(
    target: Any, world: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> dict[int, Any]:
    return run_processes(
        target, world, (find_free_port(), *args), timeout_s=timeout, intra_op_threads=1, **kwargs
    )


def _init(rank: int, world: int, port: int, timeout_s: float = 20.0) -> None:
    init_process_group(
        rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s
    )


def _model(version: float, n: int = 12, numel: int = 300) -> dict[str, torch.Tensor]:
    """A model whose bytes depend on ``version`` and on every element's position."""
    gen = torch.Generator().manual_seed(1234)
    return {f"layers.{i}.weight": torch.rand(numel, generator=gen) + version for i in range(n)}


# -- bad manifests -----------------------------------------------------------------------------

_CASES = ["wrong_name", "wrong_shape", "wrong_dtype", "missing", "one_replica_differs"]


def _bad_manifest_child(rank: int, port: int) -> list[tuple[Any, ...]]:
    _init(rank, 3, port)
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
                out.append((case, "sent"))
            except ManifestRejected as exc:
                out.append((case, "ManifestRejected", exc.rejected_by))
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
        try:
            transfer.receive(target)
            out.append((case, "received"))
        except WeightMismatchError as exc:
            out.append((case, "WeightMismatchError", tuple(exc.problems)))
        except ManifestRejected as exc:
            out.append((case, "ManifestRejected", exc.rejected_by))
        out.append(
            (case, "untouched", weights_digest(served) == before, time.monotonic() - started)
        )
        transfer.receive(served)
        out.append((case, "good_sync", weights_digest(served) == weights_digest(_model(20 + i))))
    return out


@pytest.mark.timeout(60)
def test_bad_manifests_fail_everywhere_and_write_nothing() -> None:
    results = _run(_bad_manifest_child, 3)
    sender = {case: rest for case, *rest in results[0]}
    for case in ["wrong_name", "wrong_shape", "wrong_dtype", "missing"]:
        assert sender[case] == ["ManifestRejected", (1, 2)], case
    assert sender["one_replica_differs"] == ["ManifestRejected", (2,)]
    for rank in (1, 2):
        rows = results[rank]
        for case in _CASES:
            outcome = next(
                r for r in rows if r[0] == case and r[1] not in ("untouched", "good_sync")
            )
            untouched = next(r for r in rows if r[0] == case and r[1] == "untouched")
            good = next(r for r in rows if r[0] == case and r[1] == "good_sync")
            assert untouched[2], f"rank {rank} {case}: served weights were written"
            assert untouched[3] < 5.0, f"rank {rank} {case}: the rejection took too long"
            assert good[2], f"rank {rank} {case}: the next good sync did not land"
            if case == "one_replica_differs" and rank == 1:
                assert outcome[1:] == ("ManifestRejected", (2,))
                continue
            assert outcome[1] == "WeightMismatchError", (rank, case, outcome)
            problems = "\n".join(outcome[2])
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


def _layouts_child(rank: int, port: int, checksums: bool) -> dict[str, Any]:
    _init(rank, 2, port)
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
    results = _run(_layouts_child, 2, checksums)
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


def _subset_refused_child(rank: int, port: int) -> str:
    _init(rank, 2, port)
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=10))
    weights = _model(1)
    if rank == 0:
        try:
            transfer.send(
                {"layers.0.weight": weights["layers.0.weight"]}, version=1, require_all=False
            )
        except ManifestRejected as exc:
            return f"rejected by {exc.rejected_by}"
        return "sent"
    served = {k: torch.zeros_like(v) for k, v in weights.items()}
    try:
        transfer.receive(served, allow_subset=False)
    except ValueError as exc:
        return (
            f"{type(exc).__name__}: {exc}"
            if not any(t.any() for t in served.values())
            else "written!"
        )
    return "received"


@pytest.mark.timeout(60)
def test_a_receiver_can_refuse_subset_syncs() -> None:
    results = _run(_subset_refused_child, 2)
    assert results[0] == "rejected by (1,)"
    assert "requires a full sync" in results[1]


def _abort_child(rank: int, port: int) -> str:
    _init(rank, 2, port)
    transfer = WeightTransfer(None, 0, config=TransferConfig(timeout_s=10))
    if rank == 0:
        try:
            transfer.send({"s": torch.eye(3).to_sparse()}, version=1)
        except ValueError as exc:
            return f"source: {type(exc).__name__}"
        return "sent"
    started = time.monotonic()
    try:
        transfer.receive({"s": torch.zeros(3, 3)})
    except ManifestRejected as exc:
        return f"{exc.rejected_by} {time.monotonic() - started:.1f}"
    return "received"


@pytest.mark.timeout(60)
def test_a_source_that_cannot_build_a_manifest_aborts_its_peers_fast() -> None:
    results = _run(_abort_child, 2)
    assert results[0] == "source: ManifestError"
    rejected_by, seconds = results[1].split(" ")
    assert rejected_by == "(0,)" and float(seconds) < 5.0


# -- checksums ---------------------------------------------------------------------------------


def _corrupt_child(rank: int, port: int) -> dict[str, Any]:
    _init(rank, 3, port)
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=10)

    def flip(k: int, flat: torch.Tensor) -> None:
        if k == 1:
            flat[17] ^= 0x40  # one bit, as a bad NIC or a stray write would

    hooks = TransferHooks(after_receive=flip if rank == 2 else None)
    transfer = WeightTransfer(None, 0, config=config, hooks=hooks)
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            transfer.send(_model(1), version=1)
        except ChecksumMismatchError as exc:
            out["error"] = (type(exc).__name__, exc.failed_ranks)
        hooks.after_receive = None
        out["next"] = transfer.send(_model(2), version=2).version
        return out
    served = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    try:
        transfer.receive(served)
    except ChecksumMismatchError as exc:
        out["error"] = (
            type(exc).__name__,
            exc.buckets,
            exc.failed_ranks,
            exc.targets_torn,
            exc.complete,
            str(exc),
        )
    hooks.after_receive = None
    stats = transfer.receive(served)
    out["next"] = (stats.version, weights_digest(served) == weights_digest(_model(2)))
    return out


@pytest.mark.timeout(60)
def test_a_corrupted_bucket_is_caught_and_every_rank_learns_it() -> None:
    results = _run(_corrupt_child, 3)
    assert results[0]["error"] == ("ChecksumMismatchError", (2,))
    name, buckets, failed, torn, complete, text = results[2]["error"]
    assert (name, buckets, failed, torn, complete) == (
        "ChecksumMismatchError",
        (1,),
        (2,),
        True,
        False,
    )
    assert "bucket 1 arrived with checksum" in text
    # Rank 1 received every byte intact: its weights are a complete version, not torn.
    name, buckets, failed, torn, complete, _ = results[1]["error"]
    assert (buckets, failed, torn, complete) == ((), (2,), False, True)
    # And the group recovers with the next sync.
    assert results[0]["next"] == 2
    assert results[1]["next"] == (2, True) and results[2]["next"] == (2, True)


def _origin_child(rank: int, port: int) -> dict[str, Any]:
    _init(rank, 3, port)
    groups = build_sync_groups(0, [1, 2], timeout_s=10)
    config = TransferConfig(bucket_bytes=1024, checksums=True, timeout_s=10)
    p2r = groups.p2r_transfer(config=config)
    r2r = groups.r2r_transfer(config=config)
    if rank == 0:
        assert p2r is not None
        p2r.send(_model(1), version=1)
        return {}
    served = {k: torch.zeros_like(v) for k, v in _model(0).items()}
    assert r2r is not None
    if rank == 1:
        assert p2r is not None
        stats = p2r.receive(served)
        assert stats.bucket_checksums is not None
        origin = OriginChecksums(stats.version, stats.layout, stats.bucket_checksums)
        served["layers.3.weight"][5] += 1.0  # the replica's copy goes bad after it arrived
        try:
            r2r.send(served, version=1, origin=origin)
        except ChecksumMismatchError as exc:
            return {"error": exc.failed_ranks}
        return {"error": None}
    try:
        r2r.receive(served)
    except ChecksumMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.timeout(60)
def test_origin_checksums_catch_a_replica_that_forwards_bad_bytes() -> None:
    results = _run(_origin_child, 3)
    assert results[1]["error"] == (2,)
    assert "differ from what it received" in results[2]["error"]


# -- a peer dies or hangs mid-transfer ---------------------------------------------------------


def _killed_child(rank: int, port: int) -> dict[str, Any]:
    _init(rank, 3, port, timeout_s=10)
    groups = build_sync_groups(0, [1, 2], timeout_s=10)
    config = TransferConfig(bucket_bytes=2048, timeout_s=10)

    def die(k: int, flat: torch.Tensor) -> None:
        if k == 4:
            os._exit(17)  # the trainer crashes after shipping four buckets

    if rank == 0:
        p2r = groups.p2r_transfer(config=config, hooks=TransferHooks())
        assert p2r is not None
        p2r.send(_model(1), version=1)
        p2r.hooks.after_pack = die
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
            started = time.monotonic()
            result = worker.handle(P2R(step=2))
            out["elapsed"] = time.monotonic() - started
            out["error"] = result.error
            out["exception"] = type(result.exception).__name__
            out["torn"] = backend.weights_torn
            torn_at = time.monotonic_ns()
            try:
                backend.check_servable()
                out["servable"] = True
            except TornWeightsError as exc:
                out["servable"] = str(exc)
            # Recovery: replica 2 still holds version 1 whole; it broadcasts it back.
            assert worker.r2r is not None
            worker.r2r = WeightTransfer(worker.r2r.group, 2, config=config)
            recovered = worker.handle(R2R(step=1))
            recovered_at = time.monotonic_ns()
            out["recovered"] = (recovered.ok, backend.weight_version, backend.weights_torn)
            # Generation resumes after the complete sync (bounded wait for a forward).
            seen = model.forwards
            wait_until(lambda: model.forwards > seen, 10, "generation to resume")
            out["resumed"] = model.forwards > seen
            # While torn, no forward started.
            out["forwards_while_torn"] = sum(
                1 for s in timeline.spans(SpanKind.FORWARD) if torn_at <= s.start_ns < recovered_at
            )
        else:
            assert worker.handle(R2R(step=1)).ok
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
    results = _run(_killed_child, 3, expected_exits={0: 17})
    rep = results[1]
    assert rep["exception"] == "WeightTransferError"
    assert "bucket" in rep["error"] and "on the group of ranks [0, 1]" in rep["error"]
    assert "peer most likely died" in rep["error"], "a dead peer must not read as a timeout"
    assert rep["elapsed"] < 10.0, "the dead peer was not noticed within the timeout"
    assert rep["torn"] is True
    assert "refuses to generate" in rep["servable"]
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


def _hung_child(rank: int, port: int) -> dict[str, Any]:
    _init(rank, 2, port)
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
        return {
            "error": type(exc).__name__,
            "text": str(exc),
            "elapsed": time.monotonic() - started,
            "written": exc.tensors_written,
        }
    return {"error": None, "elapsed": time.monotonic() - started}


@pytest.mark.timeout(60)
def test_a_hung_peer_times_out_with_a_clear_error() -> None:
    results = _run(_hung_child, 2)
    rep = results[1]
    assert rep["error"] == WeightTransferTimeout.__name__
    assert "did not complete within 1.0 s" in rep["text"]
    assert 0.9 < rep["elapsed"] < 2.5
    assert rep["written"] > 0  # buckets 0 and 1 had landed: the targets are torn


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
    assert _run(_cuda_child, 2, "gloo") == {0: True, 1: True}


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
    assert _run(_cuda_child, 2, "nccl") == {0: True, 1: True}
