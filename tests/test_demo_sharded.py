"""The main job sharded: trainer ranks holding FSDP shards push each region straight to the
replica rank that serves it, replicas of tensor-parallel ranks stream generations and ship
them to the trainer's first rank, and every rank ends (and is after every version) holding
exactly its part of the trainer's model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_sync.demos.distributed import (
    DistributedDemoConfig,
    demo_layout,
    demo_limit_s,
    run_distributed_demo,
)
from rollout_sync.demos.sharded import expected_digests
from rollout_sync.launch import JobLayout, Role
from rollout_sync.sharded_groups import ShardedCommandChannel
from rollout_sync.trace import SpanKind, Timeline
from rollout_sync.trainer import CommandChannel, CommandKind, WeightSyncCommand
from rollout_sync.worker import P2R, R2R, Stop

_FAST = {"step_interval_s": 0.05, "timeout_s": 20.0}
ROOT = Path(__file__).resolve().parents[1]


def test_a_sharded_layout_puts_the_trainer_first_then_each_replica() -> None:
    layout = JobLayout.sharded(trainer_ranks=2, replicas=3, replica_size=2)
    assert layout.world_size == 8 and layout.is_sharded
    assert layout.trainers == (0, 1) and layout.trainer == 0
    assert layout.replica_groups == ((2, 3), (4, 5), (6, 7))
    assert layout.leaders == (2, 4, 6) and layout.replicas == (2, 3, 4, 5, 6, 7)
    assert [layout.role_of(r) for r in range(8)] == [Role.TRAINER] * 2 + [Role.REPLICA] * 6
    assert layout.describe() == "2 trainer ranks, 3 replicas x 2 ranks (8 processes)"
    # The plain layout reads as before.
    plain = JobLayout(4)
    assert not plain.is_sharded and plain.trainers == (0,)
    assert plain.replica_groups == ((1,), (2,), (3,)) and plain.leaders == (1, 2, 3)
    with pytest.raises(ValueError, match="do not make whole replicas of 2"):
        JobLayout(5, trainer_ranks=2, replica_size=2)
    # The demo's layout follows its config.
    assert demo_layout(DistributedDemoConfig(trainer_ranks=2, tp=2)) == layout
    assert demo_layout(DistributedDemoConfig(replicas=3)) == JobLayout(4)
    sharded = DistributedDemoConfig(trainer_ranks=2, tp=2)
    assert demo_limit_s(sharded) > demo_limit_s(DistributedDemoConfig())


@pytest.mark.parametrize("pipelined_relay", [False, True], ids=["p2r_then_r2r", "relay"])
def test_every_replica_rank_gets_the_command_of_its_position(pipelined_relay: bool) -> None:
    queues: dict[int, list[object]] = {r: [] for r in range(2, 8)}

    class Sink:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            queues[self.rank].append(item)

    channel = ShardedCommandChannel(
        {r: Sink(r) for r in queues},
        [(2, 3), (4, 5), (6, 7)],
        pipelined_relay=pipelined_relay,
    )
    assert isinstance(channel, CommandChannel)
    channel.announce(WeightSyncCommand(CommandKind.WEIGHTS, 5, 5), timeout=1)
    channel.announce(WeightSyncCommand(CommandKind.STOP, 5, 5), timeout=1)
    for rank in (2, 3):  # the first replica's ranks: the P2R, then each sends its slice on
        expected = [P2R(step=5, relay=True)] if pipelined_relay else [P2R(step=5), R2R(step=5)]
        assert queues[rank] == [*expected, Stop()]
    for rank in (4, 5, 6, 7):
        assert queues[rank] == [R2R(step=5), Stop()]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipelined_relay", [False, True], ids=["p2r_then_r2r", "pipelined"])
def test_the_sharded_demo_is_clean_bit_identical_and_loses_no_payload(
    pipelined_relay: bool,
) -> None:
    """`--trainer-ranks 2 --tp 2`, and with `--pipelined-relay` the pipelined sharded relay."""
    timeline = Timeline()
    steps = 4
    # Short generations: every leader finishes (and ships) some within the run's steps however
    # loaded the machine is (a tensor-parallel decode step all-reduces twice per block).
    config = DistributedDemoConfig(
        replicas=2,
        steps=steps,
        trainer_ranks=2,
        tp=2,
        checksums=True,
        min_new_tokens=2,
        max_new_tokens=8,
        pipelined_relay=pipelined_relay,
        **_FAST,
    )
    report = run_distributed_demo(config, timeline)
    assert report["trainer_ranks"] == 2 and report["tp"] == 2 and report["processes"] == 6
    assert report["failed_commands"] == 0, report["errors"]
    # Every rank of every replica checked its slice at every version, and each trainer rank
    # its shards; the replay they are checked against is the trainer model's own.
    assert report["versions_checked"] == 2 * 2 * steps
    assert report["step_mismatches"] == 0 and report["trainer_shard_mismatches"] == 0
    assert report["bit_identical"]
    assert report["final_versions"] == [steps] * 2
    # Per step: the first replica's P2R, then an R2R on each (relayed: its P2R passes it on).
    assert report["syncs"] == steps * (2 if pipelined_relay else 1 + 2)
    assert report["torn_reads"] == 0 and report["torn_forwards_detected"] == 0
    assert report["forward_write_overlaps"] == 0 and report["egress_overlaps"] == 0
    assert timeline.overlaps() == []
    # The followers ran the leaders' steps; only the leaders shipped payloads, all received.
    assert report["tp_steps_mirrored"] > 0
    assert report["forwards"] >= 2 * report["tp_steps_mirrored"]
    assert report["payloads_sent"] > 0 and report["payloads_lost"] == 0
    assert report["payloads_received"] == report["payloads_sent"]
    assert report["payloads_invalid"] == 0
    # One lane per process, each named for its place in the job.
    names = set(timeline.process_names().values())
    assert {"trainer rank 0", "trainer rank 1", "replica 1 rank 1"} <= names
    writes = {s.pid for s in timeline.spans(SpanKind.WEIGHT_WRITE)}
    assert len(writes) == 4  # every replica rank wrote its slice
    assert report["model_mb"] == pytest.approx(expected_digests(config).model_nbytes / 1e6)


@pytest.mark.launcher
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_sharded_demo_under_torchrun_starts_every_rank_and_reports_once() -> None:
    """``--launcher torchrun`` starts trainer_ranks + replicas x tp processes; the trainer's
    first rank gathers and reports, its other rank and every replica rank do not."""
    argv = ["--launcher", "torchrun", "--trainer-ranks", "2", "--tp", "2", "--replicas", "2"]
    child = subprocess.Popen(
        [sys.executable, "-m", "rollout_sync.demos.cli", "demo", *argv, "--steps", "3", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=200)
    finally:
        if child.poll() is None:  # overstayed: torchrun and its ranks go with it
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate(timeout=30)
    assert child.returncode == 0, err[-3000:]
    assert out.count("rollout-sync demo report") == 1, "only the trainer's first rank reports"
    report = json.loads(out.strip().splitlines()[-1])
    assert report["launcher"] == "torchrun" and report["processes"] == 6
    assert report["trainer_ranks"] == 2 and report["tp"] == 2
    assert report["failed_commands"] == 0, report["errors"]
    assert report["torn_reads"] == 0 and report["bit_identical"]
    assert report["payloads_lost"] == 0 and report["versions_checked"] == 12
