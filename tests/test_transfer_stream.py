"""``WeightTransfer.stream`` on a standalone group: buckets handed to a loader as they arrive.

The receiving side of vLLM's native weight transfer: the loader keeps references to the tensors
it was given (as vLLM's layerwise reload does until a layer is complete), so no bucket buffer
may be reused. Groups are made with ``standalone_group`` (no default group), as inside a vLLM
worker, and address ranks in the group's own numbering.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_sync.distributed import GroupCollectives, standalone_group
from rollout_sync.errors import (
    ChecksumMismatchError,
    ManifestRejected,
    WeightMismatchError,
    WeightTransferError,
)
from rollout_sync.testing import ErrorReport, find_free_port, run_processes
from rollout_sync.transfer import TransferConfig, WeightManifest, WeightTransfer

pytestmark = pytest.mark.multiprocess


def _model(version: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"layers.{i}.weight": torch.rand(64, 8, generator=gen) + version for i in range(10)}


def _expected() -> dict[str, torch.Tensor]:
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in _model(0).items()}


def _stream_child(rank: int, port: int) -> dict[str, Any]:
    group = standalone_group("127.0.0.1", port, rank, 3, timeout_s=20)
    # 2 KiB buckets: one tensor each, so ten buffers that a reusing receiver would recycle.
    transfer = WeightTransfer(group, 0, config=TransferConfig(bucket_bytes=2048, timeout_s=20))
    out: dict[str, Any] = {"rank": transfer.rank, "standalone": transfer.collectives.standalone}
    if rank == 0:
        out["first"] = transfer.send(_model(1), version=1).buckets
        try:
            transfer.send(_model(2), version=2)
        except ManifestRejected as exc:
            out["rejected_by"] = list(exc.rejected_by)
        try:
            transfer.send(_model(3), version=3)
        except ChecksumMismatchError as exc:
            out["failed_ranks"] = list(exc.failed_ranks)
        transfer.send(_model(4), version=4)
        return out

    held: list[tuple[str, torch.Tensor]] = []
    begun: list[int] = []
    streaming = [1]  # the version being streamed (the manifest does not carry it)

    def load(names: list[str], tensors: list[torch.Tensor]) -> None:
        held.extend(zip(names, tensors, strict=True))  # kept, as a layerwise reload keeps them

    def begin(manifest: WeightManifest) -> None:
        begun.append(streaming[0])

    stats = transfer.stream(_expected(), load, begin=begin)
    out["loaded_exact"] = all(torch.equal(t, _model(1)[n]) for n, t in held) and len(held) == 10
    out["buffers"] = len({t.untyped_storage().data_ptr() for _, t in held})
    out["role"], out["written"] = stats.role, stats.tensors_written

    # Version 2: rank 2 objects to the manifest; nobody begins or loads.
    held.clear()
    streaming[0] = 2

    def refuse(manifest: WeightManifest) -> None:
        raise WeightMismatchError(["layers.0.weight: refused by the test"], context="test")

    try:
        transfer.stream(_expected(), load, begin=begin, accept=refuse if rank == 2 else None)
    except (ManifestRejected, WeightMismatchError) as exc:
        out["v2"] = exc
    out["v2_loaded"] = len(held)

    # Version 3: rank 1's loader fails at the third bucket; it keeps receiving and votes no.
    calls = [0]

    def failing(names: list[str], tensors: list[torch.Tensor]) -> None:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise RuntimeError("the model refused a tensor")

    try:
        transfer.stream(_expected(), failing)
    except WeightTransferError as exc:
        out["v3"], out["v3_cause"] = exc, ErrorReport.of_optional(exc.__cause__)
    out["v3_calls"] = calls[0]

    # Version 4: the group is still usable.
    held.clear()
    streaming[0] = 4
    transfer.stream(_expected(), load, begin=begin)
    out["v4_exact"] = all(torch.equal(t, _model(4)[n]) for n, t in held) and len(held) == 10
    out["begun"] = begun
    return out


@pytest.mark.timeout(120)
def test_stream_hands_every_bucket_in_its_own_buffer_and_votes_like_receive() -> None:
    results = run_processes(
        _stream_child, 3, (find_free_port(),), timeout_s=100, intra_op_threads=1
    )
    source, ok_rank, refusing = results[0], results[1], results[2]
    assert source["standalone"] and [results[r]["rank"] for r in range(3)] == [0, 1, 2]
    assert source["first"] == 10
    for r in (ok_rank, refusing):
        assert r["loaded_exact"] and r["role"] == "stream" and r["written"] == 10
        # Ten buckets, ten buffers: the tensors a loader keeps are never overwritten.
        assert r["buffers"] == 10
        assert r["v2_loaded"] == 0 and r["begun"] == [1, 4]
        assert r["v4_exact"]
    assert source["rejected_by"] == [2]
    assert type(refusing["v2"]) is WeightMismatchError
    assert type(ok_rank["v2"]) is ManifestRejected
    # The failing loader: this rank's own error, chained; stops loading, keeps receiving.
    assert type(ok_rank["v3"]) is WeightTransferError
    assert ok_rank["v3_cause"].is_a(RuntimeError)
    assert ok_rank["v3_cause"].message == "the model refused a tensor"
    assert ok_rank["v3_calls"] == 3 and ok_rank["v3"].tensors_written == 3
    assert source["failed_ranks"] == [1]
    # The other receiver got the whole version, and learns of rank 1's failure.
    assert type(refusing["v3"]) is ChecksumMismatchError and refusing["v3_calls"] == 10


def _ahead_child(rank: int, port: int) -> dict[str, Any]:
    group = standalone_group("127.0.0.1", port, rank, 2, timeout_s=20)
    transfer = WeightTransfer(
        group, 0, config=TransferConfig(bucket_bytes=2048, checksums=True, timeout_s=20)
    )
    if rank == 0:
        transfer.send(_model(1), version=1)
        try:
            transfer.send(_model(2), version=2)
        except ChecksumMismatchError as exc:
            return {"failed_ranks": list(exc.failed_ranks)}
        return {}
    out: dict[str, Any] = {}
    held: dict[str, torch.Tensor] = {}
    try:  # refused before anything is received: the group stays in step
        transfer.stream(_expected(), lambda n, t: held.update(zip(n, t, strict=True)), ahead=-1)
    except ValueError as exc:
        out["negative_ahead"] = str(exc)
    transfer.stream(_expected(), lambda n, t: held.update(zip(n, t, strict=True)), ahead=4)
    out["exact"] = all(torch.equal(t, _model(1)[n]) for n, t in held.items()) and len(held) == 10
    out["buffers"] = len({t.untyped_storage().data_ptr() for t in held.values()})
    # Bucket 3 corrupted on arrival: its checksum (taken on a thread beside the loader) is
    # checked before the loader sees it, so the loader gets buckets 0-2 and nothing after.
    loaded: list[str] = []

    def corrupt(k: int, flat: torch.Tensor) -> None:
        if k == 3:
            flat[5] ^= 1

    transfer.hooks.after_receive = corrupt
    try:
        transfer.stream(_expected(), lambda names, _: loaded.extend(names), ahead=4)
    except WeightTransferError as exc:
        out["corrupt_error"], out["corrupt_written"] = type(exc), exc.tensors_written
    out["corrupt_loaded"] = loaded
    return out


@pytest.mark.timeout(60)
def test_stream_with_buckets_ahead_checks_each_before_the_loader_sees_it() -> None:
    """``stream(ahead=4)``: four buckets on the wire while the loader works, each in a buffer
    of its own; a bucket corrupted on arrival never reaches the loader (its checksum runs on a
    thread beside the loader, and is checked first)."""
    results = run_processes(_ahead_child, 2, (find_free_port(),), timeout_s=50, intra_op_threads=1)
    out = results[1]
    assert results[0] == {"failed_ranks": [1]}
    assert "ahead must be 0 or more" in out["negative_ahead"]
    assert out["exact"] and out["buffers"] == 10
    assert out["corrupt_loaded"] == [f"layers.{i}.weight" for i in range(3)]
    assert out["corrupt_error"] is ChecksumMismatchError and out["corrupt_written"] == 3


def _collectives_child(rank: int, port: int) -> tuple[int, list[int], int]:
    group = standalone_group("127.0.0.1", port, rank, 2, timeout_s=20)
    ops = GroupCollectives(group)
    value = torch.tensor([10 + rank])
    ops.broadcast(value, 1).wait()
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    ops.all_gather(gathered, torch.tensor([rank])).wait()
    return int(value.item()), [int(g.item()) for g in gathered], ops.rank


@pytest.mark.timeout(60)
def test_standalone_group_collectives_use_group_ranks() -> None:
    results = run_processes(_collectives_child, 2, (find_free_port(),), timeout_s=50)
    assert results == {0: (11, [0, 1], 0), 1: (11, [0, 1], 1)}


# -- a delta, rebuilt from a host copy of the base (vLLM for CPU cannot apply one in place) ----


def _stepped(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with 4 elements of layers 0, 3, 4 and 7 changed."""
    gen = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in weights.items()}
    for i in (0, 3, 4, 7):
        flat = out[f"layers.{i}.weight"].view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[:4]] += 1.0
    return out


def _delta_child(rank: int, port: int) -> dict[str, Any]:
    import dataclasses

    from rollout_sync.errors import DeltaRefused
    from rollout_sync.transfer.delta_sync import DeltaEncoder, DeltaTarget, DigestCache

    group = standalone_group("127.0.0.1", port, rank, 2, timeout_s=20)
    # 4 KiB buckets: the rebuilt tensors go to the loader in two calls.
    transfer = WeightTransfer(group, 0, config=TransferConfig(bucket_bytes=4096, timeout_s=20))
    v1 = _model(1)
    v2 = _stepped(v1, 1)
    v3 = _stepped(v2, 2)
    out: dict[str, Any] = {}
    if rank == 0:
        encoder = DeltaEncoder()
        sends: list[Any] = []
        for version, weights, hostile in (
            (1, v1, False),
            (2, v2, False),
            (3, v3, False),
            (3, v3, True),
            (3, v3, False),
        ):
            encoded = encoder.encode(weights, version)
            if hostile:
                assert not isinstance(encoded, str)
                entries = list(encoded.header.entries)
                a, b = entries[1].digest
                entries[1] = dataclasses.replace(entries[1], digest=(a, b ^ 1))
                header = dataclasses.replace(encoded.header, entries=tuple(entries))
                encoded = dataclasses.replace(encoded, header=header)
            try:
                stats = transfer.send(weights, version=version, delta=encoded)
            except ChecksumMismatchError as exc:
                sends.append(("failed", list(exc.failed_ranks)))
                continue
            sends.append((stats.sync_kind, stats.nbytes))
            encoder.committed(weights, version, encoded if stats.sync_kind == "delta" else None)
        out["sends"] = sends
        return out

    host: dict[str, torch.Tensor] = {}
    cache = DigestCache()
    loaded: list[list[str]] = []
    begun: list[int] = []
    fail = [False]

    def load(names: list[str], tensors: list[torch.Tensor]) -> None:
        if fail[0]:
            raise RuntimeError("the model refused a tensor")
        loaded.append(list(names))
        for name, tensor in zip(names, tensors, strict=True):
            host.setdefault(name, tensor.clone()).copy_(tensor)  # whole: refresh the copy
            out.setdefault("exact", []).append(torch.equal(tensor, _current[0][name]))

    def begin(manifest: WeightManifest) -> None:
        begun.append(1)

    _current = [v1]
    transfer.stream(_expected(), load, begin=begin)  # version 1, whole
    loaded.clear()
    begun.clear()

    # Version 2 by delta: the changed tensors, rebuilt, in two loader calls after begin.
    _current[0] = v2
    stats = transfer.stream(
        _expected(), load, begin=begin, delta=DeltaTarget(host, 1, cache, apply=True)
    )
    out["v2"] = (stats.sync_kind, stats.tensors_written, loaded[:], len(begun))
    out["v2_host"] = all(torch.equal(host[n], v2[n]) for n in v2)

    # Version 3: the loader fails; the host copy is restored bit for bit.
    _current[0] = v3
    fail[0] = True
    try:
        transfer.stream(
            _expected(), load, begin=begin, delta=DeltaTarget(host, 2, cache, apply=True)
        )
    except WeightTransferError as exc:
        out["v3_failed"] = (type(exc).__name__, exc.tensors_written)
    out["v3_host_restored"] = all(torch.equal(host[n], v2[n]) for n in v2)
    fail[0] = False

    # Version 3 with a wrong digest: refused at the proof; nothing begun, loaded or written.
    loaded.clear()
    begun.clear()
    try:
        transfer.stream(
            _expected(), load, begin=begin, delta=DeltaTarget(host, 2, cache, apply=True)
        )
    except DeltaRefused as exc:
        out["hostile"] = (str(exc), len(loaded), len(begun), exc.tensors_written)
    out["hostile_host"] = all(torch.equal(host[n], v2[n]) for n in v2)

    # Staged (apply=False): kept pending, nothing loaded; applied later it is version 3.
    target = DeltaTarget(host, 2, cache, apply=False)
    stats = transfer.stream(_expected(), load, begin=begin, delta=target)
    out["staged"] = (stats.sync_kind, len(loaded), len(begun), target.pending is not None)
    assert target.pending is not None
    target.pending.apply(cache)
    out["staged_host"] = all(torch.equal(host[n], v3[n]) for n in v3)
    return out


@pytest.mark.timeout(120)
def test_stream_rebuilds_a_delta_from_a_host_copy_proven_before_any_load() -> None:
    results = run_processes(_delta_child, 2, (find_free_port(),), timeout_s=100, intra_op_threads=1)
    source, replica = results[0], results[1]
    changed = [f"layers.{i}.weight" for i in (0, 3, 4, 7)]
    sends = source["sends"]
    assert sends[0][0] == "whole" and sends[1][0] == "delta" and sends[1][1] < 512
    assert sends[2] == ("failed", [1]) and sends[3] == ("failed", [1])
    assert sends[4][0] == "delta"
    # Only the changed tensors, in bucket-sized calls, after begin; exactly version 2.
    kind, written, calls, begins = replica["v2"]
    assert kind == "delta" and written == 4 and begins == 1
    assert calls == [changed[:2], changed[2:]]
    assert all(replica["exact"]) and replica["v2_host"]
    assert replica["v3_failed"] == ("WeightTransferError", 2) and replica["v3_host_restored"]
    message, loads, begun, written = replica["hostile"]
    assert "layers.3.weight" in message and (loads, begun, written) == (0, 0, 0)
    assert replica["hostile_host"]
    assert replica["staged"] == ("delta", 0, 0, True) and replica["staged_host"]
