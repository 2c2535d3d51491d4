"""Flat weight storage: laid out the way a transfer's buckets are, adopted in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.backends import TinyLMConfig, TorchLMBackend
from rollout_sync.flat import ALIGN_BYTES, FlatWeights
from rollout_sync.transfer import WeightManifest

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 700), st.sampled_from(range(len(_DTYPES)))),
        min_size=1,
        max_size=12,
    ),
    bucket_bytes=st.integers(ALIGN_BYTES, 6000),
)
def test_every_bucket_is_one_span_of_flat_storage(
    sizes: list[tuple[int, int]], bucket_bytes: int
) -> None:
    """Whatever the sizes and the bucket size, the manifest's bucket k is the bytes
    ``[base_k, base_k + bucket_nbytes[k])`` of the storage, each tensor at ``base_k + offset``:
    what lets a transfer receive a bucket straight into flat storage."""
    tensors = {f"t{i}": torch.zeros(n, dtype=_DTYPES[d]) for i, (n, d) in enumerate(sizes)}
    flat = FlatWeights.zeros_like(tensors)
    manifest = WeightManifest.build(tensors, bucket_bytes=bucket_bytes)
    base_ptr = flat.storage.data_ptr()
    assert flat.storage.numel() % ALIGN_BYTES == 0
    for k, entries in enumerate(manifest.buckets):
        base = flat.tensors[entries[0].name].data_ptr() - base_ptr - entries[0].offset
        assert base >= 0 and base + manifest.bucket_nbytes[k] <= flat.storage.numel()
        for e in entries:
            assert flat.tensors[e.name].data_ptr() - base_ptr == base + e.offset


def test_copy_of_holds_the_values_and_zero_padding() -> None:
    tensors = {"a": torch.arange(5, dtype=torch.float32), "b": torch.arange(3, dtype=torch.int64)}
    flat = FlatWeights.copy_of(tensors)
    assert all(torch.equal(flat.tensors[n], t) for n, t in tensors.items())
    assert flat.storage[20:64].eq(0).all()  # padding after a's 20 bytes
    assert flat.holds(flat.tensors["b"]) and not flat.holds(tensors["b"])


def test_adopt_moves_module_parameters_in_place() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    params = dict(module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    flat = FlatWeights.adopt(params)
    for name, param in module.named_parameters():
        assert param is params[name]  # the same Parameter objects
        assert torch.equal(param, before[name])
        assert flat.holds(param)
    flat.storage.fill_(0)  # a write into the storage is a write into the module
    assert all(p.eq(0).all() for p in module.parameters())
    out = module(torch.ones(2, 5))  # and the module still runs
    assert out.shape == (2, 3)


def test_adopt_moves_a_tied_tensor_once() -> None:
    shared = torch.rand(10)
    flat = FlatWeights.adopt({"emb": shared, "head": shared, "bias": torch.rand(3)})
    assert flat.tensors["emb"] is flat.tensors["head"] is shared
    assert flat.holds(shared) and shared.data_ptr() == flat.storage.data_ptr()
    assert flat.storage.numel() == 2 * 64  # 40 + 12 bytes, each aligned: no second copy


def test_flat_storage_refuses_mixed_devices_and_sparse_tensors() -> None:
    with pytest.raises(ValueError, match="dense"):
        FlatWeights.zeros_like({"s": torch.eye(3).to_sparse()})
    with pytest.raises(ValueError, match="at least one"):
        FlatWeights.zeros_like({})
    with pytest.raises(ValueError, match="one device"):
        FlatWeights.adopt({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")})


def test_the_torch_lm_declares_its_flat_storage_and_generates_from_it() -> None:
    config = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    flat = TorchLMBackend(config)
    plain = TorchLMBackend(config, flat_weights=False)
    storage = flat.flat_weight_storage()
    assert storage is not None and plain.flat_weight_storage() is None
    assert all(
        storage.data_ptr() <= t.data_ptr() < storage.data_ptr() + storage.numel()
        for t in flat.served_weights().values()
    )
    # Same seed, same weights, same tokens, whichever way the weights are stored.
    assert all(torch.equal(flat.served_weights()[n], t) for n, t in plain.served_weights().items())
    got = [flat.model(*_step_inputs(config))[0], plain.model(*_step_inputs(config))[0]]
    assert torch.equal(got[0], got[1])


def _step_inputs(config: TinyLMConfig) -> tuple[torch.Tensor, ...]:
    tokens = torch.tensor([[1, 2, 3]])
    positions = torch.arange(3).unsqueeze(0)
    h, dh = config.n_heads, config.head_dim
    past = torch.zeros(config.n_layers, 1, h, 0, dh)
    return (
        tokens,
        positions,
        past,
        past.clone(),
        torch.zeros(1, 0, dtype=torch.bool),
        (torch.ones(1, 3, dtype=torch.bool)),
    )
