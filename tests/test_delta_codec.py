"""Deltas of one tensor (rollout_sync.transfer.delta): the smallest encoding per block, the new
version exactly after the apply, every malformed delta refused before any write, the
overwritten values restorable, and a digest moved by the changed elements alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from delta_helpers import break_apply

from rollout_sync.errors import DeltaError
from rollout_sync.transfer.delta import (
    BLOCK_ELEMENTS,
    BlockKind,
    DeltaBlock,
    TensorDelta,
    apply_delta,
    check_delta,
    encode_delta,
    linear_digest,
)


def _pair(numel: int, fraction: float, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g).to(dtype)
    new = base.clone()
    changed = torch.randperm(numel, generator=g)[: int(fraction * numel)]
    new[changed] = (new[changed].float() + 0.25).to(dtype)
    return base, new


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize(
    ("fraction", "kind", "bytes_over_dense"),
    [
        (0.02, BlockKind.POSITIONS, 0.04),
        (0.3, BlockKind.BITMASK, 0.3625),
        (1.0, BlockKind.DENSE, 1.0),
    ],
)
def test_each_block_takes_its_smallest_encoding_and_lands_bit_exact(
    fraction: float, kind: BlockKind, bytes_over_dense: float
) -> None:
    base, new = _pair(4 * BLOCK_ELEMENTS, fraction)
    delta = encode_delta(base, new)
    assert {b.kind for b in delta.blocks} == {kind}
    assert delta.nbytes / (base.numel() * 2) == pytest.approx(bytes_over_dense, rel=1e-3)
    target = base.clone()
    apply_delta(target, delta)
    assert torch.equal(_bits(target), _bits(new))
    assert not encode_delta(new, new).blocks  # nothing changed, nothing sent


def test_changes_are_bit_for_bit() -> None:
    base = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.float32)
    new = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.float32)
    delta = encode_delta(base, new)
    assert delta.changed == 1  # -0.0 is another value; a NaN of the same bits is not
    target = base.clone()
    apply_delta(target, delta)
    assert torch.equal(_bits(target), _bits(new))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_digest_moves_from_the_changed_elements_alone_and_restore_undoes(
    dtype: torch.dtype,
) -> None:
    base, new = _pair(3 * BLOCK_ELEMENTS + 17, 0.01, dtype)
    target = base.clone()
    before = linear_digest(target)
    overwritten = apply_delta(target, encode_delta(base, new))
    assert overwritten.digest_update(before) == linear_digest(new) != before
    overwritten.restore()
    assert torch.equal(_bits(target), _bits(base))


def _corrupt(delta: TensorDelta, **change: object) -> TensorDelta:
    first = dataclasses.replace(delta.blocks[0], **change)
    return dataclasses.replace(delta, blocks=(first, *delta.blocks[1:]))


def _positions(*offsets: int, values: int = 0) -> torch.Tensor:
    head = torch.tensor(offsets, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    return torch.cat([head, torch.zeros(2 * len(offsets), dtype=torch.uint8)])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda d: _corrupt(d, payload=_positions(5, 3)), "not strictly increasing"),
        (lambda d: _corrupt(d, payload=_positions(4, 4)), "not strictly increasing"),
        (lambda d: _corrupt(d, payload=d.blocks[0].payload[:-1]), "truncated"),
        (lambda d: _corrupt(d, index=99), "out of range"),
        (lambda d: dataclasses.replace(d, blocks=(d.blocks[1], d.blocks[0])), "out of order"),
        (lambda d: dataclasses.replace(d, numel=d.numel + 1), "a delta of"),
        (lambda d: dataclasses.replace(d, dtype=torch.float16), "a delta of"),
    ],
)
def test_a_malformed_delta_is_refused_before_anything_is_written(build, message: str) -> None:
    base, new = _pair(2 * BLOCK_ELEMENTS, 0.001)
    delta = encode_delta(base, new)
    if "increasing" in message:  # two positions, in a block of positions
        delta = _corrupt(delta, count=2)
    target = base.clone()
    with pytest.raises(DeltaError, match=message):
        apply_delta(target, build(delta), name="layers.0.w")
    assert torch.equal(_bits(target), _bits(base))


def test_a_position_past_the_last_block_end_is_refused() -> None:
    base, new = _pair(BLOCK_ELEMENTS + 10, 0.0)
    new[-1] = 7.0
    delta = encode_delta(base, new)
    assert delta.blocks[0].index == 1
    bad = dataclasses.replace(
        delta, blocks=(DeltaBlock(1, BlockKind.POSITIONS, 1, _positions(10)),)
    )
    with pytest.raises(DeltaError, match="out of range"):
        check_delta(bad, base)


@pytest.mark.parametrize("after_write", [False, True], ids=["before-write", "mid-write"])
def test_an_apply_that_fails_part_way_puts_back_what_it_wrote(
    monkeypatch: pytest.MonkeyPatch, after_write: bool
) -> None:
    """ReceivedDelta.apply writes tensor by tensor; an error at the second (before its write,
    or once the write had begun) leaves both restored bit for bit and nothing listed to undo
    (so the receive reports nothing written), and the digest cache is not moved."""
    from rollout_sync.transfer import delta_sync
    from rollout_sync.transfer.delta_sync import DeltaEncoder, DeltaTarget, DigestCache

    base = {"a": _pair(3 * BLOCK_ELEMENTS, 0.0)[0], "b": _pair(1000, 0.0, seed=1)[0]}
    new = {"a": _pair(3 * BLOCK_ELEMENTS, 0.05)[1], "b": _pair(1000, 0.05, seed=1)[1]}
    encoder = DeltaEncoder()
    encoder.encode(base, 1)
    encoder.committed(base, 1, None)
    encoded = encoder.encode(new, 2)
    assert not isinstance(encoded, delta_sync.WholeReason)
    served = {n: t.clone() for n, t in base.items()}
    cache = DigestCache()
    target = DeltaTarget(served, 1, cache)
    received = delta_sync.ReceivedDelta.check(2, encoded.header, encoded.packed, target)
    real = delta_sync.apply_changes
    calls = break_apply(monkeypatch, after_write=after_write)
    with pytest.raises(RuntimeError, match="device went away"):
        received.apply(cache)
    assert len(calls) == 2 and not received.undo
    assert all(torch.equal(_bits(served[n]), _bits(base[n])) for n in base)
    assert all(cache.digests[n][0] == 1 for n in base)  # still the base's, not moved
    monkeypatch.setattr(delta_sync, "apply_changes", real)
    assert received.apply(cache) == 2
    assert all(torch.equal(_bits(served[n]), _bits(new[n])) for n in new)
