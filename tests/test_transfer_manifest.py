"""The weight manifest, bucket layout and checksums, without any process group."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_sync.errors import ManifestError
from rollout_sync.transfer import (
    ALIGN_BYTES,
    OriginChecksums,
    WeightManifest,
    bucket_checksum,
    named_weights,
)


def _weights() -> dict[str, torch.Tensor]:
    return {
        "embed": torch.zeros(100, 16),
        "norm": torch.zeros(3, dtype=torch.bfloat16),
        "steps": torch.zeros((), dtype=torch.int64),
        "head": torch.zeros(16, 100).t(),
    }


def test_layout_aligns_every_tensor_and_respects_the_bucket_size() -> None:
    weights = _weights()
    manifest = WeightManifest.build(weights, bucket_bytes=4096)
    for e in manifest.entries:
        assert e.offset % ALIGN_BYTES == 0
        assert e.offset + e.nbytes <= manifest.bucket_nbytes[e.bucket]
        assert e.nbytes == weights[e.name].numel() * weights[e.name].element_size()
    assert manifest.nbytes == sum(t.numel() * t.element_size() for t in weights.values())
    # embed (6400 B) is larger than a bucket: it gets one of its own; head likewise.
    assert manifest.num_buckets == 3
    assert [e.bucket for e in manifest.entries] == [0, 1, 1, 2]


def test_many_small_tensors_fill_few_buckets() -> None:
    weights = {f"p{i}": torch.zeros(64) for i in range(1000)}  # 256 B each
    manifest = WeightManifest.build(weights, bucket_bytes=64 << 10)
    assert manifest.num_buckets == 4
    assert all(len(b) == 256 for b in manifest.buckets[:3])


def test_bytes_round_trip_and_are_stable() -> None:
    manifest = WeightManifest.build(
        _weights(), bucket_bytes=4096, require_all=False, checksums=True
    )
    data = manifest.to_bytes()
    again = WeightManifest.from_bytes(data)
    assert again == manifest
    assert again.layout == manifest.layout
    # The version is not part of the layout bytes: an unchanged model encodes identically.
    assert (
        WeightManifest.build(
            _weights(), bucket_bytes=4096, require_all=False, checksums=True
        ).to_bytes()
        == data
    )


def test_origin_checksums_are_kept_only_for_the_same_layout() -> None:
    manifest = WeightManifest.build(_weights(), bucket_bytes=4096)
    origin = OriginChecksums(3, manifest.layout, ((1, 2), (3, 4), (5, 6)))
    kept = WeightManifest.build(_weights(), bucket_bytes=4096, origin=origin)
    assert kept.origin == origin
    other = WeightManifest.build(_weights(), bucket_bytes=1 << 20, origin=origin)
    assert other.origin is None
    assert WeightManifest.from_bytes(kept.to_bytes()).origin == origin


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format=99),
        lambda d: d["entries"][0].__setitem__(2, "torch.notadtype"),
        lambda d: d["entries"][0].__setitem__(4, 3),  # misaligned offset
        lambda d: d["entries"][0].__setitem__(5, 12),  # nbytes does not fit the shape
        lambda d: d["entries"][0].__setitem__(3, 7),  # bucket out of range
        lambda d: d.pop("entries"),
        lambda d: d.update(entries=[]),
    ],
)
def test_malformed_manifests_are_rejected(mutate: object) -> None:
    doc = json.loads(WeightManifest.build(_weights(), bucket_bytes=4096).to_bytes())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(ManifestError):
        WeightManifest.from_bytes(json.dumps(doc).encode())


def test_garbage_bytes_are_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="undecodable"):
        WeightManifest.from_bytes(b"\xff\x00 not json")


def test_build_refuses_empty_and_sparse() -> None:
    with pytest.raises(ManifestError, match="at least one"):
        WeightManifest.build({}, bucket_bytes=4096)
    with pytest.raises(ManifestError, match="dense"):
        WeightManifest.build({"s": torch.eye(3).to_sparse()}, bucket_bytes=4096)


def test_padding_lists_the_uncovered_ranges() -> None:
    manifest = WeightManifest.build({"a": torch.zeros(3), "b": torch.zeros(16)}, bucket_bytes=4096)
    assert manifest.padding == (((12, 64),),)
    assert manifest.bucket_nbytes == (128,)


def test_checksum_catches_a_flipped_bit_and_moved_words() -> None:
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    base = bucket_checksum(data)
    assert torch.equal(base, bucket_checksum(data.clone()))
    flipped = data.clone()
    flipped[5000] ^= 1
    assert not torch.equal(base, bucket_checksum(flipped))
    swapped = data.clone().view(torch.int32)
    a, b = swapped[10].clone(), swapped[2000].clone()
    swapped[10], swapped[2000] = b, a
    if not torch.equal(a, b):
        assert not torch.equal(base, bucket_checksum(swapped.view(torch.uint8)))


def test_checksum_has_no_overflow_on_extreme_values() -> None:
    data = torch.full((4 << 20,), 0xFF, dtype=torch.uint8)
    first = bucket_checksum(data)
    data[-1] = 0x7F
    assert not torch.equal(first, bucket_checksum(data))


def test_named_weights_trainable_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[1].weight.requires_grad_(False)
    everything = named_weights(model)
    trainable = named_weights(model, trainable_only=True)
    assert set(everything) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(trainable) == {"0.weight", "0.bias", "1.bias"}
    assert all(not t.requires_grad for t in trainable.values())
    # Views, not copies: a transfer reads (and a receiver writes) the parameters themselves.
    assert trainable["0.weight"].data_ptr() == model[0].weight.data_ptr()
