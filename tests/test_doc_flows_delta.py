"""docs/delta.md's trainer flow, as the page writes it: one keyword on the callback.

A trainer and two replicas over gloo on loopback. The trainer's ``WeightBroadcastCallback``
(``delta=True, full_every=2``) announces every step on the replicas' command queues and pushes
through a plain ``TransferWeightPusher``; the replicas are ``RolloutWorker.run()`` loops with
nothing delta-specific. Then the trainer swaps in a new pusher built plainly (``use_pusher``, as
after a recovery): the callback turns deltas on in it, so its first push goes whole
(``first``), the next by delta.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from rollout_sync import RolloutWorker, build_sync_groups
from rollout_sync.testing import EventLog, RecordingRollout, run_group, weights_digest
from rollout_sync.trainer import TransferWeightPusher, WeightBroadcastCallback
from rollout_sync.transfer import TransferStats
from rollout_sync.transfer.delta_sync import WholeReason
from rollout_sync.worker import WorkerCommandChannel

pytestmark = pytest.mark.multiprocess

SHAPES = {"embed": (64, 256), "layer.weight": (128, 130), "norm": (130,)}
STEPS = 4
"""Steps 1-4 through the first pusher (keyframes at 1 and 3), 5-6 through the second."""


def _step(weights: Mapping[str, torch.Tensor], step: int) -> None:
    """A small training step: about 1 % of each tensor's bf16 elements change."""
    gen = torch.Generator().manual_seed(step)
    for tensor in weights.values():
        flat = tensor.view(-1)
        changed = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
        flat[changed] = (flat[changed].float() * 1.01 + 0.001).to(torch.bfloat16)


def _trainer(queues: dict[int, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    groups = build_sync_groups(trainer=0, replicas=[1, 2], timeout_s=30)
    channel = WorkerCommandChannel.for_groups(groups, queues)
    pusher = TransferWeightPusher(groups.p2r_transfer(), barrier=groups.p2r_barrier)
    callback = WeightBroadcastCallback(
        lambda: dict(weights),
        pusher=pusher,
        channel=channel,
        delta=True,  # docs/delta.md: "one keyword on the callback"
        full_every=2,
        timer=None,
        sync_on_run_begin=False,
        report_every_step=True,
    )
    kinds: list[tuple[str, str | None]] = []
    metrics: list[dict[str, Any]] = []

    def step(step: int) -> None:
        _step(weights, step)
        report = callback.step_end(step, train_metrics={"loss": 1.0})
        assert report is not None
        metrics.append(report)
        stats = callback.pusher.last_stats  # type: ignore[attr-defined]
        kinds.append((stats.sync_kind, stats.whole_reason))

    for s in range(1, STEPS + 1):
        step(s)
    # As after a recovery: the new job's pusher, built plainly (docs/distributed.md); the
    # callback turns deltas on in it, and it has no base yet.
    callback.use_pusher(
        TransferWeightPusher(groups.p2r_transfer(), barrier=groups.p2r_barrier),
        channel=channel,
    )
    for s in range(STEPS + 1, STEPS + 3):
        step(s)
    callback.train_end(STEPS + 2)
    return {
        "kinds": kinds,
        "deltas": [m["weight_sync_delta_count"] for m in metrics],
        "bytes": [m["weight_sync_bytes"] for m in metrics],
        "digest": weights_digest(weights),
    }


def _replica(rank: int, queues: dict[int, Any]) -> dict[str, Any]:
    rollout = RecordingRollout(
        EventLog(), {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    )
    groups = build_sync_groups(trainer=0, replicas=[1, 2], timeout_s=30)
    received: list[tuple[str, int, str]] = []

    def on_transfer(stats: TransferStats, tensors: Mapping[str, torch.Tensor]) -> None:
        if stats.role in ("receive", "relay"):
            received.append((stats.role, stats.version, stats.sync_kind))

    worker = RolloutWorker(
        rollout,
        p2r=groups.p2r_transfer(),
        p2r_barrier=groups.p2r_barrier,
        r2r=groups.r2r_transfer(),
        commands=queues[rank],
        on_transfer=on_transfer,
    )
    worker.run()
    worker.close(10)
    return {
        "failed": [r.error for r in worker.results if not r.ok],
        "version": rollout.weight_version,
        "torn": rollout.weights_torn,
        "received": received,
        "digest": weights_digest(rollout.served_weights()),
    }


def _job(rank: int, queues: dict[int, Any]) -> dict[str, Any]:
    return _trainer(queues) if rank == 0 else _replica(rank, queues)


@pytest.mark.timeout(90)
def test_the_callback_with_delta_and_full_every_as_docs_delta_md_writes_it() -> None:
    # The queues of the children's start method (forkserver under this suite's conftest): a
    # fork of this process, which other tests leave with threads, could inherit a held lock.
    method = os.environ.get("ROLLOUT_SYNC_TEST_START_METHOD", "forkserver")
    queues = {rank: multiprocessing.get_context(method).Queue() for rank in (1, 2)}
    results = run_group(_job, 3, (queues,), timeout_s=80, group_timeout_s=30, start_method=method)
    trainer = results[0]
    assert trainer["kinds"] == [
        ("whole", WholeReason.FIRST.value),
        ("delta", None),
        ("whole", WholeReason.KEYFRAME.value),  # full_every=2: syncs 1, 3, 5, ...
        ("delta", None),
        ("whole", WholeReason.FIRST.value),  # the new pusher starts without a base
        ("delta", None),
    ]
    # weight_sync_delta_count counts the pushes by delta; weight_sync_bytes what moved.
    assert trainer["deltas"] == [0, 1, 0, 1, 0, 1]
    whole = sum(torch.Size(s).numel() * 2 for s in SHAPES.values())
    assert [b == whole for b in trainer["bytes"]] == [True, False] * 3
    assert all(b < 0.1 * whole for b in trainer["bytes"][1::2])
    for rank in (1, 2):
        replica = results[rank]
        assert replica["failed"] == [], (rank, replica["failed"])
        assert (replica["version"], replica["torn"]) == (STEPS + 2, False), rank
        assert replica["digest"] == trainer["digest"], f"rank {rank} differs"
        kinds = [kind for _, _, kind in replica["received"]]
        assert kinds == ["whole", "delta"] * 3, (rank, replica["received"])
