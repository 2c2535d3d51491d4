"""The emulated NIC paces what a rank receives as well as what it sends, and charges a broadcast
as gloo sends it.

The bookkeeping (a link's reservations, a message's arrival, gloo's binomial tree) is checked
on its own against hand-worked numbers and against gloo's own loop; then one job of four
processes (gloo on loopback) runs the patterns the cost model relies on: three ranks sending
into one (the ingress floor, not the egress one), and a broadcast to three members charged as
gloo's tree (the root sends two copies and the first member forwards one) or as NCCL's chain
(one copy), each taking the time ``rollout_sync.scale`` gives it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollout_sync.scale import Broadcast, Link
from rollout_sync.testing import EmulatedNic, PacedCollectives, PacedShardedTransfer, run_group
from rollout_sync.testing.emulated_nic import gloo_tree
from rollout_sync.transfer import ShardedTransfer

RATE = 20e6
LATENCY = 1e-3
BUCKET = 128 << 10
MESSAGES = 8
"""Per sender in the many-to-one pattern; broadcasts per algorithm in the other."""


# -- the bookkeeping ---------------------------------------------------------------------------


def test_a_receiver_takes_messages_from_several_senders_back_to_back_at_its_ingress_rate() -> None:
    nic = EmulatedNic(Link(1e6, 0.01))
    # Three senders each put 1 MB on their own egress at once, [0, 1] s: the receiver's
    # ingress takes them one after another, so they arrive at 1, 2 and 3 s (plus the latency).
    arrivals = [nic.arrival(1_000_000, (0.0, 1.0, 0.01)) for _ in range(3)]
    assert arrivals == pytest.approx([1.01, 2.01, 3.01])
    # A message whose sender's egress was the slower side arrives when its egress finished.
    assert nic.arrival(1_000_000, (10.0, 15.0, 0.01)) == pytest.approx(15.01)
    s = nic.statistics()
    assert (s.received, s.bytes_received, s.ingress_busy_s) == (4, 4_000_000, pytest.approx(4.0))
    assert (s.bytes_sent, s.busy_s) == (0, 0.0)  # full duplex: the egress is untouched


def test_the_ingress_can_be_its_own_link_and_egress_and_ingress_are_independent() -> None:
    nic = EmulatedNic(Link(1e6, 0.01), ingress=Link(2e6, 0.02))
    assert nic.reserve_egress(1_000_000, not_before=0.0) == pytest.approx((0.0, 1.0))
    assert nic.reserve_ingress(1_000_000, not_before=0.0) == pytest.approx((0.0, 0.5))
    # The larger latency of the two ends counts.
    assert nic.arrival(1_000_000, (0.0, 1.0, 0.01)) == pytest.approx(1.02)
    assert "ingress 2 MB/s" in repr(nic)


def _gloo_edges(members: int) -> set[tuple[int, int, int]]:
    """(round, sender, receiver) of ``gloo::broadcast`` (gloo/broadcast.cc) from root 0."""
    edges = set()
    dim = math.ceil(math.log2(members)) if members > 1 else 0
    mask = (1 << dim) - 1
    for i in range(dim):
        mask ^= 1 << i
        for vrank in range(members):
            peer = vrank ^ (1 << i)
            if vrank & mask == 0 and peer < members and vrank & (1 << i) == 0:
                edges.add((i, vrank, peer))
    return edges


@pytest.mark.parametrize("members", range(1, 18))
def test_the_tree_is_gloos_and_the_model_counts_its_copies_and_hops(members: int) -> None:
    edges = set()
    depth = [0] * members
    for vrank in range(members):
        parent, children = gloo_tree(vrank, members)
        if parent is not None:
            depth[vrank] = depth[parent] + 1
        for child in children:
            edges.add((child.bit_length() - 1, vrank, child))  # sent in round log2(child - v)
    assert edges == _gloo_edges(members)
    copies = max(len(gloo_tree(v, members)[1]) for v in range(members))
    assert copies == Broadcast.GLOO.copies(members) == len(gloo_tree(0, members)[1])
    assert max(depth) == Broadcast.GLOO.hops(members)
    assert Broadcast.CHAIN.copies(members) == (1 if members > 1 else 0)


# -- on real processes -------------------------------------------------------------------------


def _timed(fn: Any) -> list[float]:
    dist.barrier()
    start = time.monotonic()
    fn()
    return [start, time.monotonic()]


def _nic_child(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tensor = torch.full((BUCKET,), rank, dtype=torch.uint8)
    # Ranks 0-2 each send MESSAGES buckets to rank 3, which takes them interleaved (as a
    # sharded receiver does): its ingress carries three senders' bytes.
    nic = EmulatedNic(Link(RATE, LATENCY))
    ops = PacedCollectives(None, nic)

    def many_to_one() -> None:
        if rank < 3:
            works = [ops.send(tensor, 3, k) for k in range(MESSAGES)]
        else:
            inbox = [torch.empty(BUCKET, dtype=torch.uint8) for _ in range(3 * MESSAGES)]
            works = [ops.recv(inbox[3 * k + s], s, k) for k in range(MESSAGES) for s in range(3)]
        for work in works:
            assert work.wait()
        if rank == 3:
            assert [int(t[0]) for t in inbox[:3]] == [0, 1, 2]

    out["many_to_one"] = _timed(many_to_one)
    out["many_to_one_nic"] = nic.statistics()
    # Rank 0 broadcasts MESSAGES buckets to ranks 1-3, paced as gloo sends them, then as a
    # chain, each with NICs of their own.
    for algorithm in Broadcast:
        nic = EmulatedNic(Link(RATE, LATENCY))
        ops = PacedCollectives(None, nic, broadcast=algorithm)

        def broadcast(ops: PacedCollectives = ops) -> None:
            works = [ops.broadcast(tensor, 0) for _ in range(MESSAGES)]
            for work in works:
                assert work.wait()
            assert int(tensor[0]) == 0

        out[algorithm.value] = _timed(broadcast)
        out[f"{algorithm.value}_nic"] = nic.statistics()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ingress_and_broadcasts_take_the_time_the_model_gives_them() -> None:
    values = run_group(_nic_child, 4, timeout_s=100, group_timeout_s=30)

    def span(key: str) -> float:
        return max(v[key][1] for v in values.values()) - min(v[key][0] for v in values.values())

    # Three senders into one: the receiver's ingress, 3 x MESSAGES buckets, bounds the hop, not
    # any sender's egress (MESSAGES buckets, a third of it).
    ingress_floor = 3 * MESSAGES * BUCKET / RATE + LATENCY  # 0.16 s
    assert 0.97 * ingress_floor <= span("many_to_one") <= 1.4 * ingress_floor
    receiver = values[3]["many_to_one_nic"]
    assert receiver.received == 3 * MESSAGES and receiver.bytes_received == 3 * MESSAGES * BUCKET
    for sender in (0, 1, 2):
        stats = values[sender]["many_to_one_nic"]
        assert stats.sends == MESSAGES and stats.bytes_sent == MESSAGES * BUCKET
        assert stats.bytes_received == 0

    # Gloo's tree to 3 receivers: the root sends 2 copies of each bucket, rank 1 forwards 1 to
    # rank 3; each receiver's ingress takes one. The model's link for it: half the rate, two
    # latencies (rank 3 is two hops from the root).
    sent = {r: values[r]["gloo_nic"].bytes_sent // BUCKET for r in range(4)}
    assert sent == {0: 2 * MESSAGES, 1: MESSAGES, 2: 0, 3: 0}
    assert values[0]["gloo_nic"].broadcasts == MESSAGES
    assert all(values[r]["gloo_nic"].bytes_received == MESSAGES * BUCKET for r in (1, 2, 3))
    tree = Broadcast.GLOO.link(Link(RATE, LATENCY), 4)
    predicted = MESSAGES * BUCKET / tree.rate_bytes_per_s + tree.latency_s  # 0.107 s
    assert 0.97 * predicted <= span("gloo") <= 1.4 * predicted
    # NCCL's chain: the root's egress carries each bucket once, in half the time.
    sent = {r: values[r]["chain_nic"].bytes_sent // BUCKET for r in range(4)}
    assert sent == {0: MESSAGES, 1: 0, 2: 0, 3: 0}
    chain = MESSAGES * BUCKET / RATE + LATENCY
    assert 0.97 * chain <= span("chain") <= 1.4 * chain
    assert span("chain") < 0.75 * span("gloo")


def test_a_paced_sharded_transfer_passes_other_keywords_to_the_sharded_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ShardedTransfer's own options (a pipelined relay) reach it unchanged."""
    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def record(self: Any, group: Any, plan: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise Built  # the rest needs a process group: what was passed is the point

    monkeypatch.setattr(ShardedTransfer, "__init__", record)
    with pytest.raises(Built):
        PacedShardedTransfer(
            None,
            object(),  # type: ignore[arg-type]
            source_ranks=(0,),
            target_ranks=(1,),
            nic=EmulatedNic(Link(1e6)),
            pipelined_relay=True,
        )
    assert seen["pipelined_relay"] is True
