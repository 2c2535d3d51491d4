"""The refit cost model's arithmetic on hand-worked cases, and the emulated NIC it is checked with.

``rollout_sync.scale`` composes a sync's time from its parts; the cases here are small enough to
work out on paper: one link and one bucket, a pipeline of two hops against the same two hops in
series, two alternating buffers that hold a pipeline back, the sharded two-hop design against its
pipelined variant. The emulated NIC (``rollout_sync.testing.emulated_nic``) paces a real transfer
at its set rate, and a small real relay and a small real sharded sync land near what the model
predicts (loosely: ``benchmarks/scale.py`` is where the figure lives). The real transfers run on
threads of this process, each in its own standalone gloo group, so no process is spawned.
"""

from __future__ import annotations

import ast
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_sync.distributed import find_free_port, standalone_group
from rollout_sync.flat import FlatWeights
from rollout_sync.scale import (
    FLEET_1T,
    Broadcast,
    Link,
    Phase,
    Scenario,
    Stage,
    SyncCosts,
    Topology,
    estimate,
    pipeline,
)
from rollout_sync.testing import EmulatedNic, PacedWeightTransfer
from rollout_sync.testing.emulated_nic import STAMP_TAG, PacedCollectives, PacedShardedTransfer
from rollout_sync.trace import SpanKind, Timeline
from rollout_sync.transfer import Layout, TransferConfig, TransferPlan

LATENCY = 0.01


def _scenario(**changes: Any) -> Scenario:
    base: dict[str, Any] = {
        "model_bytes": 1_000_000,
        "bucket_bytes": 1_000_000,
        "replicas": 1,
        "nic": Link(1e6, LATENCY),
        "trainer_packs": False,
    }
    return Scenario(**{**base, **changes})


# -- the arithmetic ---------------------------------------------------------------------------


def test_one_link_one_bucket() -> None:
    # Header, manifest and manifest vote, then the bucket (1 MB at 1 MB/s, then the latency),
    # then the commit vote: four control collectives of one latency each.
    e = estimate(Topology.ONE_SOURCE, _scenario())
    assert e.refit_s == pytest.approx(4 * LATENCY + 1.0 + LATENCY)
    assert e.stall_s == e.refit_s  # in place: parked for all of it
    assert e.busiest_link_bytes == 1_000_000
    assert dict((p.name, p.seconds) for p in e.phases) == pytest.approx(
        {"park": 0.0, "control": 0.04, "wire: P2R link": 1.0, "pipeline": 0.01}
    )
    assert sum(p.seconds for p in e.phases) == pytest.approx(e.refit_s)


def test_one_link_one_bucket_with_every_cost() -> None:
    costs = SyncCosts(
        collective_s=0.002,
        manifest_s_per_tensor=0.001,
        copy_bytes_per_s=1e7,
        install_s=0.005,
        install_bytes_per_s=1e7,
        park_s=0.02,
    )
    scenario = _scenario(tensors=10, trainer_packs=True)
    control = 4 * (LATENCY + 0.002) + 10 * 0.001
    wire = 0.1 + 1.0 + LATENCY  # pack at 10 MB/s, the link, its latency
    in_place = estimate(Topology.ONE_SOURCE, scenario, costs)
    assert in_place.refit_s == pytest.approx(0.02 + control + wire)
    assert in_place.stall_s == in_place.refit_s
    staged = estimate(
        Topology.ONE_SOURCE, _scenario(tensors=10, trainer_packs=True, staged=True), costs
    )
    install = 0.005 + 0.1
    assert staged.stall_s == pytest.approx(0.02 + install)  # park, then install
    assert staged.refit_s == pytest.approx(control + wire + 0.02 + install)
    assert staged.phase_s("install") == pytest.approx(install)


def test_a_pipeline_of_two_hops_against_the_same_hops_in_series() -> None:
    # 4 buckets of 0.25 s on each of two links with 10 ms latency.
    scenario = _scenario(bucket_bytes=250_000, replicas=2)
    relay = estimate(Topology.PIPELINED_RELAY, scenario)
    # Two manifests and two votes before the first bucket (6 latencies); the buckets through
    # both links: (4 + 1) x 0.25 s and two latencies; the last commit vote.
    assert relay.refit_s == pytest.approx(6 * LATENCY + 5 * 0.25 + 2 * LATENCY + LATENCY)
    one_source = estimate(Topology.ONE_SOURCE, scenario)
    # Each hop alone: 3 control, 4 x 0.25 s, one latency, the commit vote.
    assert one_source.refit_s == pytest.approx(2 * (3 * LATENCY + 1.0 + LATENCY + LATENCY))
    assert one_source.refit_s / relay.refit_s == pytest.approx(2.10 / 1.34)
    assert relay.busiest_link_bytes == one_source.busiest_link_bytes == 1_000_000


def test_a_gloo_broadcast_costs_its_root_a_copy_per_round_of_its_binomial_tree() -> None:
    # 1 MB to 3 replicas. P2R (two members) is one copy whatever the algorithm; R2R to the
    # other two is one copy by NCCL's chain, two by gloo's tree (the root sends to each).
    chain = estimate(Topology.ONE_SOURCE, _scenario(replicas=3))
    gloo = estimate(Topology.ONE_SOURCE, _scenario(replicas=3, broadcast="gloo"))
    p2r = 3 * LATENCY + 1.0 + LATENCY + LATENCY
    assert chain.refit_s == pytest.approx(2 * p2r)
    assert gloo.refit_s == pytest.approx(p2r + 3 * LATENCY + 2.0 + LATENCY + LATENCY)
    assert gloo.phase_s("wire: R2R link") == pytest.approx(2.0)
    assert (chain.busiest_link_bytes, gloo.busiest_link_bytes) == (1_000_000, 2_000_000)
    assert gloo.scenario.broadcast is Broadcast.GLOO
    # To 4 replicas: still two copies from the root, but the fourth is two hops away, so the
    # header, the manifest and the buckets take two latencies each.
    four = estimate(Topology.ONE_SOURCE, _scenario(replicas=4, broadcast=Broadcast.GLOO))
    assert four.refit_s == pytest.approx(
        p2r + 2 * LATENCY * 2 + LATENCY + 2.0 + 2 * LATENCY + LATENCY
    )
    # The pipelined relay to 3 replicas: its R2R link, two copies of every bucket, is the
    # bottleneck: the first bucket's P2R (0.25 s), then 4 buckets of 0.5 s, not (4 + 1) x 0.25.
    relay = estimate(
        Topology.PIPELINED_RELAY, _scenario(bucket_bytes=250_000, replicas=3, broadcast="gloo")
    )
    assert relay.refit_s == pytest.approx(6 * LATENCY + 0.25 + 2.0 + 2 * LATENCY + LATENCY)
    assert Broadcast.GLOO.link(Link(1e6, LATENCY), 3) == Link(0.5e6, LATENCY)
    assert Broadcast.CHAIN.link(Link(1e6, LATENCY), 8) == Link(1e6, LATENCY)
    with pytest.raises(ValueError, match="broadcast"):
        _scenario(broadcast="tree")


def _sharded(**changes: Any) -> Scenario:
    # 2 MB over 2 trainer ranks into replicas of 2 GPUs: 1 MB per trainer rank and per GPU, in
    # buckets of 0.5 s on a 1 MB/s link.
    base: dict[str, Any] = {
        "model_bytes": 2_000_000,
        "bucket_bytes": 500_000,
        "replicas": 2,
        "trainer_ranks": 2,
        "gpus_per_replica": 2,
    }
    return _scenario(**{**base, **changes})


def test_the_sharded_two_hop_design_is_p2r_by_shards_then_r2r_per_gpu_in_series() -> None:
    two_hop = estimate(Topology.SHARDED_TWO_HOP, _sharded())
    # P2R: the plan vote, two buckets of 0.5 s through the busiest first link (1 MB of each
    # trainer rank's and into each GPU) and its latency, the commit vote.
    p2r = LATENCY + 1.0 + LATENCY + LATENCY
    # R2R, after it: each GPU's 1 MB broadcast to the same GPU of the other replica, a hop as
    # one source's (header, manifest, vote; the buckets and the latency; the commit vote).
    r2r = 3 * LATENCY + 1.0 + LATENCY + LATENCY
    assert two_hop.refit_s == pytest.approx(p2r + r2r)  # 2.08 s
    assert dict((p.name, p.seconds) for p in two_hop.phases) == pytest.approx(
        {
            "park": 0.0,
            "control": 6 * LATENCY,
            "wire: P2R link": 1.0,
            "pipeline": 2 * LATENCY,
            "wire: R2R link": 1.0,
        }
    )
    assert two_hop.busiest_link_bytes == 1_000_000
    assert two_hop.implemented and "not implemented" not in str(two_hop)
    # The pipelined variant overlaps the hops: 7c + (n + 1) b/R + 2a = 0.07 + 1.5 + 0.02.
    pipelined = estimate(Topology.SHARDED_PIPELINED, _sharded())
    assert pipelined.refit_s == pytest.approx(1.59)
    assert pipelined.implemented and "not implemented" not in str(pipelined)
    assert Topology.SHARDED is Topology.SHARDED_PIPELINED  # its name from before
    assert Topology("sharded") is Topology.SHARDED_PIPELINED  # and its value from before
    # With one replica, P2R alone.
    assert estimate(Topology.SHARDED_TWO_HOP, _sharded(replicas=1)).refit_s == pytest.approx(p2r)
    # On gloo, R2R to 3 replicas sends each GPU's shard twice from the first replica's GPU.
    gloo = estimate(Topology.SHARDED_TWO_HOP, _sharded(replicas=3, broadcast="gloo"))
    assert gloo.phase_s("wire: R2R link") == pytest.approx(2.0)
    assert gloo.refit_s == pytest.approx(p2r + r2r + 1.0)
    assert gloo.busiest_link_bytes == 2_000_000


def test_the_sharded_first_link_is_the_busier_of_trainer_egress_and_gpu_ingress() -> None:
    # One trainer rank sends all 2 MB: its link, not the GPUs', bounds P2R (2 s); R2R is still
    # each GPU's 1 MB.
    one_trainer = estimate(Topology.SHARDED_TWO_HOP, _sharded(trainer_ranks=1))
    assert one_trainer.refit_s == pytest.approx(3 * LATENCY + 2.0 + 5 * LATENCY + 1.0)
    assert one_trainer.busiest_link_bytes == 2_000_000
    # Four trainer ranks into GPUs of 1 MB each: the GPUs' ingress bounds it, as with two.
    four = estimate(Topology.SHARDED_TWO_HOP, _sharded(trainer_ranks=4))
    assert four.refit_s == pytest.approx(estimate(Topology.SHARDED_TWO_HOP, _sharded()).refit_s)


def test_the_sharded_p2r_always_packs_and_unpacks_and_checks_each_gpus_tensors() -> None:
    costs = SyncCosts(copy_bytes_per_s=1e7, manifest_s_per_tensor=0.001)
    # Regions of shards are always copied, flat storage or not: the first bucket's pack (0.05 s
    # at 10 MB/s) before the link, the last one's unpack after it. R2R from flat storage: none.
    plain = _sharded(tensors=10, trainer_packs=False, replica_copies=False)
    e = estimate(Topology.SHARDED_TWO_HOP, plain, costs)
    p2r = 0.05 + 1.0 + LATENCY + 0.05
    r2r = 1.0 + LATENCY
    # Each GPU holds 5 of the 10 tensors: P2R checks them before its vote, R2R validates them.
    control = 6 * LATENCY + 2 * 5 * 0.001
    assert e.refit_s == pytest.approx(control + p2r + r2r)
    # Tensor parallel, each GPU holds a slice of all 10: twice the checks.
    tp = estimate(Topology.SHARDED_TWO_HOP, _sharded(tensors=10, tensors_per_gpu=10), costs)
    assert tp.refit_s - e.refit_s == pytest.approx(2 * 5 * 0.001)
    # Staged: the park and the install of the GPU's 1 MB (0.1 s at 10 MB/s) after it.
    staged = estimate(
        Topology.SHARDED_TWO_HOP,
        _sharded(staged=True),
        SyncCosts(install_bytes_per_s=1e7, park_s=0.02),
    )
    assert staged.stall_s == pytest.approx(0.02 + 0.1)
    assert staged.refit_s == pytest.approx(2.08 + 0.02 + 0.1)


def test_two_alternating_buffers_hold_a_slow_pack_back() -> None:
    # Pack 0.3 s per bucket into two buffers, each freed when the link (0.2 s, 0.5 s latency)
    # delivered its bucket: bucket 2 waits for bucket 0 to arrive at 1.0 s.
    pack = Stage("pack", rate_bytes_per_s=1 / 0.3, buffers=2, freed_by="link")
    link = Stage("link", rate_bytes_per_s=1 / 0.2, latency_s=0.5)
    assert pipeline([pack, link], [1, 1, 1]).finish_s == pytest.approx(1.0 + 0.3 + 0.2 + 0.5)
    unbounded = Stage("pack", rate_bytes_per_s=1 / 0.3)
    run = pipeline([unbounded, link], [1, 1, 1])
    assert run.finish_s == pytest.approx(0.9 + 0.2 + 0.5)
    assert run.busy_at("link") == pytest.approx(0.6)


def test_the_fleet_is_bound_by_one_nic_until_it_is_sharded() -> None:
    estimates = {(e.topology, e.scenario.staged): e for e in FLEET_1T.estimates()}
    one_nic = FLEET_1T.model_bytes / FLEET_1T.nic.rate_bytes_per_s  # 40 s
    relay = estimates[(Topology.PIPELINED_RELAY, True)]
    assert relay.implemented and relay.refit_s > one_nic
    assert estimates[(Topology.ONE_SOURCE, False)].refit_s > 2 * one_nic
    light = FLEET_1T.speed_of_light_s
    assert light == pytest.approx(1.25)
    # Sharded, two hops (implemented): each hop one GPU's 62.5 GB through its NIC, in series.
    two_hop = estimates[(Topology.SHARDED_TWO_HOP, False)]
    assert two_hop.implemented
    assert two_hop.phase_s("wire: P2R link") == pytest.approx(light)
    assert two_hop.phase_s("wire: R2R link") == pytest.approx(light)
    assert 2 * light < two_hop.refit_s < 5.0  # the first bar
    assert two_hop.busiest_link_bytes == FLEET_1T.model_bytes // FLEET_1T.gpus_per_replica
    staged = estimates[(Topology.SHARDED_TWO_HOP, True)]
    assert staged.refit_s < 5.0 and staged.stall_s == pytest.approx(relay.stall_s)
    # Pipelining the sharded relay brings it near the speed of light.
    pipelined = estimates[(Topology.SHARDED_PIPELINED, False)]
    assert pipelined.implemented
    assert light < pipelined.refit_s < 1.6 * light
    # Staged, the stall is the park and the install; in place, the whole transfer.
    assert relay.stall_s == pytest.approx(relay.phase_s("park") + relay.phase_s("install"))
    assert estimates[(Topology.PIPELINED_RELAY, False)].stall_s > one_nic


def test_inputs_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="rate"):
        Link(0.0)
    with pytest.raises(ValueError, match="replicas"):
        _scenario(replicas=0)
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        SyncCosts(copy_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="tensors_per_gpu"):
        _scenario(tensors_per_gpu=0)
    assert Phase("wire", 1.0).seconds == 1.0


# -- the emulated NIC, on real transfers --------------------------------------------------------


def _on_threads(targets: list[Callable[[], Any]], timeout_s: float = 30.0) -> list[Any]:
    """Run each target on a thread of its own; their values, or the first error raised."""
    values: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            values[i] = targets[i]()
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a transfer thread hung"
    if errors:
        raise errors[0]
    return values


def _model(tensors: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((numel,), float(i)) for i in range(tensors)}


@pytest.mark.timeout(60)
def test_the_emulated_nic_delivers_its_rate_on_one_transfer() -> None:
    rate, bucket = 20e6, 512 << 10
    port = find_free_port()
    config = TransferConfig(bucket_bytes=bucket, timeout_s=20)

    def member(rank: int) -> tuple[float, float]:
        group = standalone_group("127.0.0.1", port, rank, 2, timeout_s=20)
        timeline = Timeline()
        nic = EmulatedNic(Link(rate))
        transfer = PacedWeightTransfer(group, 0, nic=nic, config=config, timeline=timeline)
        weights = _model(16, 1 << 16)  # 4 MiB: 8 buckets
        for version in (1, 2):  # the second, with the manifest caches warm
            if rank == 0:
                stats = transfer.send(weights, version=version)
            else:
                stats = transfer.receive(weights)
        # The second transfer's 8 buckets arrive one every bucket / rate.
        spans = timeline.spans(SpanKind.WEIGHT_COLLECTIVE)
        arrived = [span.end_ns / 1e9 for span in spans if span.name.startswith("bucket ")][-8:]
        steady = 7 * bucket / (arrived[-1] - arrived[0])
        return steady, stats.nbytes / stats.transfer_s

    for steady, whole in _on_threads([lambda: member(0), lambda: member(1)]):
        assert 0.9 * rate <= steady <= 1.1 * rate
        assert whole <= 1.02 * rate  # the pacing binds: never faster than the link


@pytest.mark.timeout(60)
def test_a_small_relay_lands_near_the_models_prediction() -> None:
    rate, latency, bucket = 10e6, 1e-3, 256 << 10
    p2r_port, r2r_port = find_free_port(), find_free_port()
    config = TransferConfig(bucket_bytes=bucket, timeout_s=20)
    weights = _model(16, 1 << 15)  # 2 MiB: 8 buckets
    start = threading.Barrier(3)
    ends: dict[str, list[float]] = {"trainer": [], "relay": [], "leaf": []}
    starts: list[float] = []

    def timed(name: str, sync: Callable[[], object]) -> None:
        for _ in range(2):  # the second, with the manifest caches warm
            if start.wait(timeout=20) == 0:
                starts.append(time.monotonic())
            sync()
            ends[name].append(time.monotonic())

    def trainer() -> None:
        group = standalone_group("127.0.0.1", p2r_port, 0, 2, timeout_s=20)
        p2r = PacedWeightTransfer(group, 0, nic=EmulatedNic(Link(rate, latency)), config=config)
        version = iter((1, 2))
        timed("trainer", lambda: p2r.send(weights, version=next(version)))

    def relay() -> None:
        nic = EmulatedNic(Link(rate, latency))
        p2r = PacedWeightTransfer(
            standalone_group("127.0.0.1", p2r_port, 1, 2, timeout_s=20), 0, nic=nic, config=config
        )
        r2r = PacedWeightTransfer(
            standalone_group("127.0.0.1", r2r_port, 0, 2, timeout_s=20), 0, nic=nic, config=config
        )
        flat = FlatWeights.zeros_like(weights)
        timed("relay", lambda: p2r.relay(flat.tensors, r2r, storage=flat.storage))

    def leaf() -> None:
        group = standalone_group("127.0.0.1", r2r_port, 1, 2, timeout_s=20)
        r2r = PacedWeightTransfer(group, 0, nic=EmulatedNic(Link(rate, latency)), config=config)
        flat = FlatWeights.zeros_like(weights)
        timed("leaf", lambda: r2r.receive(flat.tensors, storage=flat.storage))

    _on_threads([trainer, relay, leaf])
    measured = max(times[1] for times in ends.values()) - starts[1]
    scenario = Scenario(
        model_bytes=sum(t.numel() * 4 for t in weights.values()),
        bucket_bytes=bucket,
        replicas=2,
        nic=Link(rate, latency),
        tensors=len(weights),
    )
    predicted = estimate(Topology.PIPELINED_RELAY, scenario).refit_s  # links alone
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def _layouts(weights: dict[str, torch.Tensor]) -> tuple[Layout, Layout]:
    """Two trainer ranks holding half the rows of every tensor; replicas of two ranks holding
    alternately half the rows and half the columns: every trainer rank sends to both."""
    trainer = Layout.build(weights, 2, shard={name: 0 for name in weights})
    replica = Layout.build(weights, 2, shard={name: i % 2 for i, name in enumerate(weights)})
    return trainer, replica


@pytest.mark.timeout(60)
def test_a_small_sharded_sync_lands_near_the_models_prediction() -> None:
    # 2 trainer ranks -> 2 replicas of 2 ranks: P2R by shards (PacedShardedTransfer), then each
    # first-replica rank relays its shard to the same rank of the second (PacedWeightTransfer).
    # Slow enough that the paced links, not six processes' software on two cores, set the time
    # (at 5 MB/s a loaded run once measured 26% over the links alone).
    rate, latency, bucket = 2.5e6, 1e-3, 256 << 10
    p2r_port, r2r_ports = find_free_port(), [find_free_port(), find_free_port()]
    config = TransferConfig(bucket_bytes=bucket, timeout_s=20)

    def model(version: int) -> dict[str, torch.Tensor]:
        return {f"w{i}": torch.full((32, 1024), float(10 * version + i)) for i in range(16)}

    trainer_layout, replica_layout = _layouts(model(0))
    plan = TransferPlan.between(trainer_layout, replica_layout)
    start = threading.Barrier(6)
    ends: list[float] = []
    starts: list[float] = []
    served: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    nics: dict[int, EmulatedNic] = {}

    def timed(sync: Callable[[int], object]) -> None:
        for version in (1, 2):  # the second, with the manifest caches warm
            if start.wait(timeout=20) == 0:
                starts.append(time.monotonic())
            sync(version)
            if version == 2:
                ends.append(time.monotonic())

    def transfer(rank: int, nic: EmulatedNic) -> PacedShardedTransfer:
        group = standalone_group("127.0.0.1", p2r_port, rank, 4, timeout_s=20)
        return PacedShardedTransfer(
            group, plan, source_ranks=(0, 1), target_ranks=(2, 3), nic=nic, config=config
        )

    def trainer(rank: int) -> None:
        nics[rank] = nic = EmulatedNic(Link(rate, latency))
        p2r = transfer(rank, nic)
        timed(lambda v: p2r.send(trainer_layout.shard(model(v), rank), version=v))

    def replica(j: int, k: int) -> None:
        nic = EmulatedNic(Link(rate, latency))
        r2r_group = standalone_group("127.0.0.1", r2r_ports[k], j, 2, timeout_s=20)
        r2r = PacedWeightTransfer(r2r_group, 0, nic=nic, config=config)
        flat = FlatWeights.zeros_like(replica_layout.shard(model(0), k))
        served[(j, k)] = flat.tensors
        if j == 0:
            p2r = transfer(2 + k, nic)
            timed(lambda v: p2r.relay(flat.tensors, r2r, storage=flat.storage))
        else:
            timed(lambda v: r2r.receive(flat.tensors, storage=flat.storage))

    _on_threads(
        [
            lambda: trainer(0),
            lambda: trainer(1),
            *(lambda j=j, k=k: replica(j, k) for j in (0, 1) for k in (0, 1)),
        ]
    )
    for (_, k), tensors in served.items():  # every rank serves its slice of version 2
        want = replica_layout.shard(model(2), k)
        assert all(torch.equal(tensors[name], want[name]) for name in want)
    for rank in (0, 1):  # each trainer rank's link carried its own regions, twice
        stats = nics[rank].statistics()
        assert stats.bytes_sent == 2 * plan.bytes_sent(rank) and stats.broadcasts == 0
        assert stats.sends > 0
    measured = max(ends) - starts[1]
    model_bytes = sum(t.numel() * 4 for t in model(0).values())
    scenario = Scenario(
        model_bytes=model_bytes,
        bucket_bytes=bucket,
        replicas=2,
        nic=Link(rate, latency),
        tensors=16,
        trainer_ranks=2,
        gpus_per_replica=2,
        tensors_per_gpu=16,
    )
    predicted = estimate(Topology.SHARDED_TWO_HOP, scenario).refit_s  # links alone
    assert model_bytes / rate <= measured  # two hops of half the model each: paced
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def test_a_paced_send_refuses_a_tag_its_arrival_stamp_would_collide_with() -> None:
    group = standalone_group("127.0.0.1", find_free_port(), 0, 1, timeout_s=10)
    ops = PacedCollectives(group, EmulatedNic(Link(1e6)))
    with pytest.raises(ValueError, match="tag"):
        ops.send(torch.zeros(1), 0, STAMP_TAG)
    with pytest.raises(ValueError, match="tag"):
        ops.recv(torch.zeros(1), 0, -1)
    assert ops.nic.statistics().sends == 0


# -- the benchmark's JSON, documented -----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_every_key_the_benchmark_prints_is_listed_in_the_docs() -> None:
    # The keys of the summary dict benchmarks/scale.py prints as its last line.
    tree = ast.parse((ROOT / "benchmarks" / "scale.py").read_text())
    (summary,) = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "summary" for t in node.targets)
        and isinstance(node.value, ast.Dict)
    ]
    keys = {k.value for k in summary.keys if isinstance(k, ast.Constant)}
    assert len(keys) == len(summary.keys) and "max_prediction_error" in keys
    documented = set(re.findall(r"`([a-z0-9_]+)`", (ROOT / "docs" / "scale.md").read_text()))
    assert sorted(keys - documented) == []


def test_a_relay_tree_is_predicted_level_by_level() -> None:
    """``Scenario.fanout``: the sharded two-hop's R2R as a relay tree, each level a broadcast
    to a replica's children, pipelined; as wide as the fleet it is the one broadcast."""
    from rollout_sync.scale import tree_depth

    assert [tree_depth(7, f) for f in (1, 2, 3, 6)] == [6, 2, 2, 1]
    assert tree_depth(1, 2) == 0
    base = Scenario(
        model_bytes=10**9,
        bucket_bytes=10**7,
        replicas=7,
        nic=Link(1e9, 1e-3),
        trainer_ranks=2,
        gpus_per_replica=2,
    )
    flat = estimate(Topology.SHARDED_TWO_HOP, base)
    wide = estimate(Topology.SHARDED_TWO_HOP, replace(base, fanout=6))
    assert wide.refit_s == pytest.approx(flat.refit_s)
    chain = estimate(Topology.SHARDED_TWO_HOP, replace(base, fanout=1))
    # Six levels: the R2R wire once (pipelined), each level a bucket, a latency and its own
    # manifest and votes more.
    extra = chain.refit_s - flat.refit_s
    per_level = 10**7 / 1e9 + 1e-3 + 4 * 1e-3  # a bucket, a latency; header, manifest, 2 votes
    assert extra == pytest.approx(5 * per_level, rel=0.05)
    with pytest.raises(ValueError, match="fanout"):
        replace(base, fanout=0)
