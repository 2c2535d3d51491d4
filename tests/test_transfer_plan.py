"""Layouts and transfer plans, in one process: every target element is covered exactly once,
from a source rank that holds it, and the regions land where the target layout says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.transfer import Layout, TransferPlan
from rollout_sync.transfer.layout import chunk_bounds, region_of
from rollout_sync.transfer.sharded import _buckets, _check_coverage
from rollout_sync.weights import WeightSpec


def _whole(specs: list[WeightSpec]) -> dict[str, torch.Tensor]:
    """Distinct values everywhere, so a misplaced element shows."""
    out, base = {}, 0
    for s in specs:
        out[s.name] = (torch.arange(s.numel, dtype=torch.float64) + base).view(s.shape).to(s.dtype)
        base += s.numel
    return out


def _apply(plan: TransferPlan, whole: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Run the plan in memory: targets filled from the sources' shards, and a count of how often
    each target element was written."""
    sources = [plan.source.shard(whole, r) for r in range(plan.source.world)]
    targets, counts = [], []
    for r in range(plan.target.world):
        specs = plan.target.local_specs(r)
        targets.append({n: torch.full(s.shape, -1, dtype=s.dtype) for n, s in specs.items()})
        counts.append({n: torch.zeros(s.shape, dtype=torch.int32) for n, s in specs.items()})
    for m in plan.moves:
        src = region_of(sources[m.source][m.source_local], m.source_box)
        region_of(targets[m.target][m.target_local], m.target_box).copy_(src)
        region_of(counts[m.target][m.target_local], m.target_box).add_(1)
    return targets, counts


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[Layout, Layout]:
    n = draw(st.integers(1, 4))
    specs = [
        WeightSpec(
            f"t{i}",
            tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3))),
            draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        )
        for i in range(n)
    ]

    def side() -> Layout:
        ranks = draw(st.integers(1, 4))
        shard, sections = {}, {}
        for s in specs:
            if not s.shape:  # a scalar is replicated
                continue
            dim = draw(st.one_of(st.none(), st.integers(0, len(s.shape) - 1)))
            if dim is not None:
                shard[s.name] = dim
                if s.shape[dim] % 2 == 0 and draw(st.booleans()):
                    sections[s.name] = 2
        fuse = {}
        # Fuse two tensors of one dtype that can be concatenated along dim 0 on every rank.
        pairs = [
            (a, b)
            for a in specs
            for b in specs
            if a.name < b.name
            and a.dtype == b.dtype
            and len(a.shape) == len(b.shape) > 0
            and a.shape[1:] == b.shape[1:]
            and shard.get(a.name, 0) == 0
            and shard.get(b.name, 0) == 0
        ]
        if pairs and draw(st.booleans()):
            a, b = draw(st.sampled_from(pairs))
            fuse["fused"] = ((a.name, b.name), 0)
        return Layout.build(specs, ranks, shard=shard, fuse=fuse, sections=sections)

    return side(), side()


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_a_plan_covers_every_target_element_exactly_once_with_the_right_bytes(
    layouts: tuple[Layout, Layout],
) -> None:
    source, target = layouts
    plan = TransferPlan.between(source, target)
    whole = _whole(list(source.specs))
    targets, counts = _apply(plan, whole)
    for r in range(target.world):
        expected = target.shard(whole, r)
        for name, tensor in targets[r].items():
            assert torch.equal(tensor, expected[name]), (r, name)
            assert bool((counts[r][name] == 1).all()), (r, name, counts[r][name])
    # No source rank sends any element twice to one target rank: per target the moves' bytes
    # are exactly what it holds.
    for r in range(target.world):
        assert plan.bytes_received(r) == target.local_nbytes(r)
    assert TransferPlan.between(source, target).digest == plan.digest


def test_a_replicated_source_spreads_the_bytes_over_its_ranks() -> None:
    specs = [WeightSpec(f"w{i}", (64, 16), torch.float32) for i in range(8)]
    plan = TransferPlan.between(Layout.build(specs, 2), Layout.build(specs, 1))
    assert plan.bytes_sent(0) == plan.bytes_sent(1) == plan.nbytes // 2


def test_sharded_to_sharded_sends_each_rank_only_its_slice() -> None:
    specs = [WeightSpec("w", (8, 4), torch.float32), WeightSpec("norm", (4,), torch.float32)]
    source = Layout.build(specs, 2, shard={"w": 0, "norm": 0})
    target = Layout.build(specs, 2, shard={"w": 1})  # the norm replicated on the target
    plan = TransferPlan.between(source, target)
    w_bytes, norm_bytes = 8 * 4 * 4, 4 * 4
    # Each target rank gets half of w and all of the norm; each source rank sends a half of its
    # half of w to each target and its half of the norm to both.
    assert plan.bytes_received(0) == plan.bytes_received(1) == w_bytes // 2 + norm_bytes
    assert plan.bytes_sent(0) == plan.bytes_sent(1) == w_bytes // 2 + norm_bytes
    assert plan.nbytes == w_bytes + 2 * norm_bytes


def test_fused_on_the_target_only() -> None:
    specs = [WeightSpec(n, (6, 4), torch.float32) for n in ("q", "k", "v")]
    source = Layout.build(specs, 3, shard={"q": 0, "k": 0, "v": 0})
    target = Layout.build(
        specs, 2, shard={"q": 0, "k": 0, "v": 0}, fuse={"qkv": (("q", "k", "v"), 0)}
    )
    assert target.local_specs(1)["qkv"].shape == (9, 4)
    whole = _whole(list(specs))
    targets, _ = _apply(TransferPlan.between(source, target), whole)
    assert torch.equal(
        targets[1]["qkv"],
        torch.cat([whole[n][3:] for n in ("q", "k", "v")]),
    )


def test_a_trainers_fused_qkv_reaches_each_tensor_parallel_rank_as_its_q_k_and_v_parts() -> None:
    specs = [WeightSpec("qkv", (12, 4), torch.float32), WeightSpec("scale", (), torch.float32)]
    trainer = Layout.build(specs, 2, shard={"qkv": 0})  # FSDP: rows 0-5 and 6-11
    replica = Layout.build(specs, 2, shard={"qkv": 0}, sections={"qkv": 3})
    whole = _whole(specs)
    targets, counts = _apply(TransferPlan.between(trainer, replica), whole)
    assert all(bool((c == 1).all()) for rank in counts for c in rank.values())
    rows = torch.cat([whole["qkv"][2:4], whole["qkv"][6:8], whole["qkv"][10:12]])
    assert torch.equal(targets[1]["qkv"], rows)
    assert torch.equal(targets[0]["scale"], whole["scale"])
    with pytest.raises(ValueError, match="cannot cut 12 into 5 equal sections"):
        Layout.build(specs, 2, shard={"qkv": 0}, sections={"qkv": 5})
    with pytest.raises(ValueError, match=r"sections \[4, 4\] do not add up to 12"):
        Layout.build(specs, 2, shard={"qkv": 0}, sections={"qkv": [4, 4]})


def test_layouts_of_different_tensors_are_refused() -> None:
    a = Layout.build([WeightSpec("w", (4, 4), torch.float32)], 1)
    b = Layout.build([WeightSpec("w", (4, 5), torch.float32)], 1)
    with pytest.raises(ValueError, match=r"w: \[4, 4\] torch.float32 in the source, \[4, 5\]"):
        TransferPlan.between(a, b)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard": {"nope": 0}}, "not one of the layout's tensors"),
        ({"shard": {"w": 2}}, "cannot shard along dim 2"),
        ({"fuse": {"f": (("w", "w"), 0)}}, "fused into both"),
        ({"fuse": {"f": (("w", "b"), 0)}}, "differ off dim 0"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict, message: str) -> None:
    specs = [WeightSpec("w", (4, 4), torch.float32), WeightSpec("b", (4, 3), torch.float32)]
    with pytest.raises(ValueError, match=message):
        Layout.build(specs, 2, **kwargs)


def test_chunk_bounds_match_torch_chunk() -> None:
    for size in range(0, 12):
        for parts in range(1, 6):
            chunks = torch.arange(size).chunk(parts) if size else ()
            lengths = [b - a for a, b in chunk_bounds(size, parts)]
            assert lengths[: len(chunks)] == [len(c) for c in chunks]
            assert sum(lengths) == size


def test_a_target_refuses_a_plan_that_does_not_cover_its_tensors_exactly_once() -> None:
    specs = [WeightSpec("w", (8, 4), torch.float32)]
    plan = TransferPlan.between(Layout.build(specs, 2, shard={"w": 0}), Layout.build(specs, 1))
    dtypes = {"w": torch.float32}
    whole = {s: _buckets(plan.pair(s, 0), dtypes, 64, True) for s in (0, 1)}
    _check_coverage(whole, plan.target.local_specs(0), 0)
    twice = [*plan.pair(0, 0), *plan.pair(0, 0)]
    for queues in (
        {0: whole[0]},  # rank 1's half missing
        {0: _buckets(twice, dtypes, 64, True), 1: whole[1]},  # rank 0's half twice
        {0: [dataclasses.replace(whole[0][0], slots=())], 1: whole[1]},
    ):
        with pytest.raises(ValueError, match="exactly once"):
            _check_coverage(queues, plan.target.local_specs(0), 0)
