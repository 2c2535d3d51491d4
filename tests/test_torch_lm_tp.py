"""The embedded LM served by a replica of two tensor-parallel ranks (gloo, loopback): its greedy
output equals the unsharded model's, before and after a sharded sync from a trainer of two
FSDP-style ranks that sends each replica rank only its slice."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from rollout_sync import RolloutWorker
from rollout_sync.backends.torch_lm import (
    TinyLMConfig,
    TorchLMBackend,
    TorchLMStreamBackend,
    tiny_lm_tp_layout,
    tiny_lm_weights,
)
from rollout_sync.backends.torch_lm.tensor_parallel import TensorParallel
from rollout_sync.distributed import new_group
from rollout_sync.errors import TornWeightsError, WeightTransferError
from rollout_sync.sharded_groups import build_sharded_sync_groups
from rollout_sync.testing import run_group
from rollout_sync.transfer import Layout, TransferConfig, TransferHooks, TransferPlan
from rollout_sync.worker import P2R

LM = TinyLMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
PROMPTS = [[1, 2, 3], [5, 8, 13, 21, 34], [7]]
STEP_LIMIT_S = 5.0
"""The streaming replica's per-collective limit (TensorParallel.timeout_s)."""
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
    # One rank's weights become torn (a write that failed there alone): the next generate call
    # starts with the ranks' agreement, so both refuse, neither runs a forward on its own.
    if rank == 3:
        backend.mark_weights_torn("a write failed on this rank alone")
    reason = "disagree after a sync" if rank == 2 else "failed on this rank alone"
    with pytest.raises(TornWeightsError, match=reason) as refused:
        backend.generate(PROMPTS, max_new_tokens=2, timeout=30)
    out["refused"] = str(refused.value)
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


def _stream_child(rank: int) -> dict[str, Any]:
    """Trainer ranks 0, 1; one replica of ranks 2 (the leader) and 3, streaming."""
    trainer_layout = Layout.build(tiny_lm_weights(LM, 0), 2, shard=_fsdp(LM))
    plan = TransferPlan.between(trainer_layout, tiny_lm_tp_layout(LM, 2))
    groups = build_sharded_sync_groups((0, 1), [(2, 3)], timeout_s=20)
    # A long timeout: a follower waits on this group for the leader's next step while idle.
    tp_group = new_group([2, 3], timeout_s=3600)
    config = TransferConfig(bucket_bytes=4096, checksums=True, timeout_s=20)
    transfer = groups.p2r_transfer(plan, config=config)
    assert transfer is not None
    if rank < 2:
        for version, seed in ((1, 7), (2, 11)):
            transfer.send(trainer_layout.shard(tiny_lm_weights(LM, seed), rank), version=version)
        # Version 3 comes late (a slow upstream: longer than one TP collective's limit, well
        # inside the transfer's), and the leader gets a bad bucket of it.
        time.sleep(STEP_LIMIT_S + 1)  # on purpose: the slow upstream itself, not a wait
        with pytest.raises(WeightTransferError):
            transfer.send(trainer_layout.shard(tiny_lm_weights(LM, 13), rank), version=3)
        return {}
    backend = TorchLMStreamBackend(LM, tp=TensorParallel.of(tp_group, timeout_s=STEP_LIMIT_S))
    worker = RolloutWorker(backend, p2r=transfer, weight_sync_timeout=20)
    out: dict[str, Any] = {}
    try:
        assert worker.handle(P2R(step=1)).ok  # starts generation on both ranks, with version 1
        if backend.follower:
            with pytest.raises(RuntimeError, match="go to a tensor-parallel replica's leader"):
                backend.put(PROMPTS[0])
            assert worker.handle(P2R(step=2)).ok
        else:
            third_step = threading.Event()

            def slow_and_count(index: int) -> None:
                if index == 0 and backend.statistics().forwards >= 3:
                    third_step.set()
                time.sleep(0.002)  # widens each step on purpose: the sync lands mid-generation

            backend.layer_hook = slow_and_count
            for prompt in PROMPTS:
                backend.put(prompt, max_new_tokens=20)
            assert third_step.wait(20)
            assert worker.handle(P2R(step=2)).ok
            results = [backend.scheduler.get(timeout=30) for _ in PROMPTS]
            out["results"] = [(r.prompt, r.tokens, r.token_weight_versions) for r in results]
        # Version 3: the leader's first bucket arrives corrupted, so it writes nothing and
        # alone would still serve version 2, whole; the follower wrote its part: torn. The
        # replica agrees after the pause, once both syncs are over (not after one collective's
        # limit, which the slow version 3 outlasts): both refuse to generate.
        if not backend.follower:
            transfer.hooks = TransferHooks(
                after_receive=lambda k, b: b[:8].fill_(3) if k == 0 else None
            )
        failed = worker.handle(P2R(step=3))
        out["v3_error"] = type(failed.exception).__name__
        out["v3_torn"] = backend.weights_torn
        out["v3_reason"] = ""
        try:
            backend.check_servable()
        except TornWeightsError as exc:
            out["v3_reason"] = str(exc)
    finally:
        worker.close(20)
    stats = backend.statistics()
    out["torn_forwards"] = stats.torn_forwards
    out["version"] = backend.weight_version
    out["mirrored"] = backend.lockstep.steps_mirrored if backend.lockstep else 0
    out["error"] = backend.lockstep.error if backend.lockstep else None
    return out


def _continuation(seed: int, context: list[int], n: int) -> list[int]:
    backend = TorchLMBackend(LM)
    backend.load_weights(tiny_lm_weights(LM, seed))
    (result,) = backend.generate([context], max_new_tokens=n, timeout=30)
    return list(result.tokens)


@pytest.mark.timeout(120)
def test_a_streaming_tensor_parallel_replica_parks_every_rank_and_continues_on_new_weights() -> (
    None
):
    results = run_group(_stream_child, 4, timeout_s=120, group_timeout_s=20)
    leader, follower = results[2], results[3]
    assert leader["version"] == follower["version"] == 2
    assert leader["torn_forwards"] == follower["torn_forwards"] == 0
    assert follower["error"] is None and follower["mirrored"] > 3
    straddled = 0
    for prompt, tokens, versions in leader["results"]:
        old = [t for t, v in zip(tokens, versions, strict=True) if v == 1]
        assert versions == tuple(sorted(versions)) and set(versions) <= {1, 2}
        # The old weights' greedy tokens up to the sync, the new weights' continuation after.
        assert old == _continuation(7, list(prompt), len(old)) if old else True
        new = list(tokens[len(old) :])
        if new:
            assert new == _continuation(11, list(prompt) + old, len(new))
        straddled += bool(old) and bool(new)
    assert straddled, "no generation was in flight across the sync"
    assert leader["v3_error"] == "ChecksumMismatchError"
    assert follower["v3_error"] == "WeightTransferError"
    # The leader wrote nothing; it is torn only because the replica agreed it is.
    assert leader["v3_torn"] and follower["v3_torn"]
    assert "disagree after a sync" in leader["v3_reason"]


def test_a_model_that_does_not_split_evenly_is_refused() -> None:
    config = TinyLMConfig(vocab_size=64, d_model=24, n_layers=1, n_heads=3, d_ff=64)
    with pytest.raises(ValueError, match="needs even splits"):
        tiny_lm_tp_layout(config, 2)
