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
