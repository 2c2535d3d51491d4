"""vLLM with tensor parallelism (``tensor_parallel_size=2``, vLLM for CPU: two worker processes
over gloo) and the ``"rollout_sync"`` native weight transfer.

One engine for the module (``LLM`` behind a ``VLLMBlockingBackend``, a tiny random Llama in
float32). Each worker's ``"rollout_sync"`` engine receives every tensor whole and vLLM's own
loader keeps its shard; the read-back checks each worker's own shard. Greedy float32 decoding
makes the claims exact: tokens are compared with a plain transformers forward of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import (  # first: it sets the environment vLLM reads
    greedy_params,
)

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from rollout_sync.backends.vllm import VLLMBlockingBackend, VLLMEngineConfig
from rollout_sync.errors import WeightsNotLandedError
from rollout_sync.testing.tiny_llama import (
    build_tiny_llama,
    greedy_reference,
    random_llama_weights,
)

pytestmark = pytest.mark.vllm

TP = 2
PROMPTS = [[1, 5, 9, 33, 7], [200, 100, 50]]
TOKENS = 6
O_PROJ = "model.layers.1.self_attn.o_proj.weight"
"""A row-parallel weight: each worker holds half of its input columns."""
UP_PROJ = "model.layers.0.mlp.up_proj.weight"
"""A column-parallel weight packed into ``gate_up_proj``: each worker holds half of its rows."""


class TP2:
    """The module's engine and the weights of every version written to it."""

    def __init__(self, backend: VLLMBlockingBackend, model_dir: Path, initial: Any) -> None:
        self.backend = backend
        self.reference = greedy_reference(model_dir)
        self.shapes = {n: tuple(t.shape) for n, t in initial.items()}
        self.version = 0

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        return random_llama_weights(self.shapes, seed=4000 + version)

    def write(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.backend.load_weights(weights)
        self.version += 1
        self.backend.commit_weight_version(self.version)

    def check_generates(self, weights: Mapping[str, torch.Tensor]) -> None:
        results = self.backend.generate(PROMPTS, greedy_params(TOKENS), timeout=120)
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.ok
            assert list(result.token_ids) == self.reference(weights, prompt, TOKENS)

    def workers(self, method: Any, *args: Any) -> list[Any]:
        """``method(worker, *args)`` in every worker (rank order)."""
        return list(self.backend.llm.collective_rpc(method, timeout=60, args=args))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TP2]:
    model_dir = tmp_path_factory.mktemp("tiny_llama_tp2")
    initial = build_tiny_llama(model_dir, seed=41)
    backend = VLLMBlockingBackend(
        VLLMEngineConfig(
            model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20, tensor_parallel_size=TP
        ),
        rpc_timeout=60.0,
    )
    try:
        backend.ensure_initialized()  # the TP=1-only refusal was here
        yield TP2(backend, model_dir, initial)
    finally:
        backend.shutdown()


# -- run in the workers (collective_rpc pickles these by reference) ---------------------------


def _place(worker: Any) -> tuple[int, int, dict[str, str]]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    engine = worker.weight_transfer_engine
    plan = engine._plan
    return (
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
        {} if plan is None else dict(plan.unverifiable),
    )


def _shard_bytes(worker: Any) -> tuple[int, float]:
    """The bytes of this worker's shards of the checkpoint tensors, and what its engine received
    in the last update (MB)."""
    engine = worker.weight_transfer_engine
    nbytes = 0
    for name, probes in engine._plan.probes.items():
        spec = engine._expected[name]
        part = probes[0].local_part(torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        nbytes += part.numel() * part.element_size()
    return nbytes, float(engine.state()["last_mb"])


def _corrupt_next_load(worker: Any, rank: int, name: str, rows: Any, cols: Any) -> bool:
    """On tensor-parallel rank ``rank``, the next loads get ``name`` with ``[rows, cols]``
    changed after the engine took its witness (a flawed write); ``None``: undo."""
    from vllm.distributed import get_tensor_model_parallel_rank

    engine = worker.weight_transfer_engine
    engine.__dict__.pop("_load_into_model", None)
    if rows is None or get_tensor_model_parallel_rank() != rank:
        return False
    load = type(engine)._load_into_model

    def flawed(names: list[str], tensors: list[torch.Tensor]) -> None:
        changed = []
        for n, t in zip(names, tensors, strict=True):
            if n == name:
                t = t.clone()
                t[rows, cols] += 1.0
            changed.append(t)
        load(engine, names, changed)

    engine._load_into_model = flawed
    return True


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_each_tensor_parallel_worker_runs_its_own_engine_that_can_read_back_its_shard(
    tp2: TP2,
) -> None:
    served = tp2.backend._served
    assert served is not None and served.workers == TP
    places = tp2.workers(_place)
    assert [(rank, size) for rank, size, _ in places] == [(0, TP), (1, TP)]
    assert all(unverifiable == {} for _, _, unverifiable in places)


@pytest.mark.timeout(120)
def test_a_native_write_lands_in_every_worker_as_its_shard(tp2: TP2) -> None:
    new = tp2.weights(1)
    tp2.write(new)
    state = tp2.backend.native_transfer_state()
    assert state is not None
    assert (state["torn"], state["workers"]) == (None, TP)
    tp2.check_generates(new)
    # Every worker received every tensor whole; vLLM's loader kept its shard.
    whole = sum(t.numel() * t.element_size() for t in new.values())
    for shard, received_mb in tp2.workers(_shard_bytes):
        assert received_mb * 1e6 == pytest.approx(whole, rel=1e-6)
        assert shard < whole


@pytest.mark.timeout(120)
def test_the_read_back_catches_a_flawed_write_in_one_workers_shard(tp2: TP2) -> None:
    half = tp2.shapes[O_PROJ][1] // TP
    # Worker 1 loads o_proj with worker 0's columns changed: outside its shard, its loader
    # drops them, and the write lands.
    assert tp2.workers(_corrupt_next_load, 1, O_PROJ, slice(None), slice(0, half)) == [
        False,
        True,
    ]
    landed = tp2.weights(2)
    tp2.write(landed)
    # Now inside its shard (its half of the input columns; the first row of up_proj's second
    # half): worker 1's read-back, and only worker 1's, sees it.
    for name, rows, cols in (
        (O_PROJ, slice(None), slice(half, None)),
        (UP_PROJ, tp2.shapes[UP_PROJ][0] // TP, slice(None)),
    ):
        tp2.workers(_corrupt_next_load, 1, name, rows, cols)
        with pytest.raises(WeightsNotLandedError, match=name) as caught:
            tp2.write(tp2.weights(3))
        assert caught.value.torn and tp2.backend.weights_torn
        state = tp2.backend.native_transfer_state()
        assert state is not None and state["torn"] is not None
    tp2.workers(_corrupt_next_load, 1, "", None, None)
    repaired = tp2.weights(4)
    tp2.write(repaired)
    assert not tp2.backend.weights_torn
    tp2.check_generates(repaired)
