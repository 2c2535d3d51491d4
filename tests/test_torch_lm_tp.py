"""The embedded LM served by a replica of two tensor-parallel ranks (gloo, loopback): its greedy
output equals the unsharded model's, before and after a sharded sync from a trainer of two
FSDP-style ranks that sends each replica rank only its slice."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_sync import RolloutWorker
from rollout_sync.backends.tensor_parallel import TensorParallel
from rollout_sync.backends.torch_lm import (
    TinyLMConfig,
    TorchLMBackend,
    tiny_lm_tp_layout,
    tiny_lm_weights,
)
from rollout_sync.distributed import new_group
from rollout_sync.sharded_groups import build_sharded_sync_groups
from rollout_sync.testing import run_group
from rollout_sync.transfer import Layout, TransferConfig, TransferPlan
from rollout_sync.worker import P2R

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
PROMPTS = [[1, 2, 3], [5, 8, 13, 21, 34], [7]]
TOLERANCE = 1e-4
"""Logprobs of the sharded model may differ from the unsharded one's in the last bits (the
row-parallel sums are added in another order); tokens must be equal."""


def _greedy(backend: TorchLMBackend) -> tuple[list[list[int]], list[list[float]]]:
    results = backend.generate(PROMPTS, max_new_tokens=8, timeout=30)
    return [list(r.tokens) for r in results], [list(r.logprobs) for r in results]


def _unsharded(seed: int) -> tuple[list[list[int]], list[list[float]]]:
    backend = TorchLMBackend(LM)
    backend.load_weights(tiny_lm_weights(LM, seed))
    return _greedy(backend)


def _child(rank: int) -> dict[str, Any]:
    trainer_layout = Layout.build(tiny_lm_weights(LM, 0), 2, shard=_fsdp(LM))
    plan = TransferPlan.between(trainer_layout, tiny_lm_tp_layout(LM, 2))
    groups = build_sharded_sync_groups((0, 1), [(2, 3)], timeout_s=20)
    tp_group = new_group([2, 3], timeout_s=20)
    config = TransferConfig(bucket_bytes=4096, checksums=True, timeout_s=20)
    transfer = groups.p2r_transfer(plan, config=config)
    assert transfer is not None
    if rank < 2:
        transfer.send(trainer_layout.shard(tiny_lm_weights(LM, 7), rank), version=1)
        return {}
    backend = TorchLMBackend(LM, tp=TensorParallel.of(tp_group, timeout_s=20))
    out: dict[str, Any] = {"before": _greedy(backend)}
    worker = RolloutWorker(backend, p2r=transfer, weight_sync_timeout=20)
    try:
        assert worker.handle(P2R(step=1)).ok
    finally:
        worker.close(10)
    out["after"] = _greedy(backend)
    out["slice"] = {n: t.clone() for n, t in backend.served_weights().items()}
    return out


def _fsdp(config: TinyLMConfig) -> dict[str, int]:
    return {n: 0 for n, t in tiny_lm_weights(config, 0).items() if t.dim()}


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(
        torch.allclose(torch.tensor(x), torch.tensor(y), atol=TOLERANCE)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.timeout(120)
def test_a_tensor_parallel_replica_generates_like_the_whole_model_before_and_after_a_sync() -> None:
    results = run_group(_child, 4, timeout_s=120, group_timeout_s=20)
    layout = tiny_lm_tp_layout(LM, 2)
    for rank in (2, 3):
        local = layout.shard(tiny_lm_weights(LM, 7), rank - 2)
        assert results[rank]["slice"].keys() == local.keys()
        assert all(torch.equal(results[rank]["slice"][n], local[n]) for n in local)
    for when, seed in (("before", LM.seed), ("after", 7)):
        tokens, logprobs = _unsharded(seed)
        for rank in (2, 3):
            got_tokens, got_logprobs = results[rank][when]
            assert got_tokens == tokens, (when, rank)
            assert _close(got_logprobs, logprobs), (when, rank)
    assert results[2]["before"][0] != results[2]["after"][0]


def test_a_model_that_does_not_split_evenly_is_refused() -> None:
    config = TinyLMConfig(vocab_size=64, d_model=24, n_layers=1, n_heads=3, d_ff=64)
    with pytest.raises(ValueError, match="needs even splits"):
        tiny_lm_tp_layout(config, 2)
