"""The demo's engines, registered by name: ``torch_lm`` (the tiny torch LM under the stream
scheduler), ``torn_read`` (a fake model stamped with its version) and ``vllm`` (a tiny Llama
on vLLM, imported only when a replica builds it).

Imported by :mod:`rollout_sync.demos.distributed`, which every replica process of the demo
imports: a replica looks its engine up in its own registry
(:func:`~rollout_sync.backends.registered_engine`), so the registration must happen at import.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..backends import (
    EngineHandle,
    EngineRequest,
    InProcessRequest,
    register_engine,
)
from ..backends.torch_lm import TinyCausalLM, tiny_lm_lora_shapes
from ..backends.torch_lm.tensor_parallel import TensorParallel
from ..backends.vllm import require_vllm
from ..learn import LearnConfig
from ..learn.models import LearnerModel, TinyLMPolicy
from ..lora import LoRAConfig
from ..payload import (
    PayloadSender,
)
from ..sync.mode import SyncMode
from ..testing import (
    AsyncTornReadBackend,
    TornReadBackend,
    VersionStampedModel,
)
from ..trace import (
    Timeline,
)
from ..transfer import Layout
from .in_process import InProcessDemoConfig, run_in_process_demo
from .job import (
    DEMO_ADAPTER,
    VLLM_START_S,
    DistributedDemoConfig,
    drift_each_step,
    drift_shards_each_step,
)
from .learning import LearningLM
from .sharded import (
    trainer_layout,
)
from .stream import StreamDemoConfig, run_stream_demo
from .streaming_lm import StreamingLM


def _torch_lm_engine(request: EngineRequest) -> EngineHandle:
    """The ``torch_lm`` engine's factory: the stream LM, kept fed, shipping to the trainer."""
    return streaming_lm(request.config, request.timeline, request.sender)


def streaming_lm(
    config: DistributedDemoConfig,
    timeline: Timeline,
    sender: PayloadSender | None,
    tp: TensorParallel | None = None,
) -> EngineHandle:
    """The stream LM of a replica (``tp``: of one rank of a tensor-parallel replica; a
    follower rank ships nothing and has no ``sender``)."""
    seed = config.seed * 1009 + dist.get_rank()
    engine: StreamingLM
    if config.learn is not None:
        assert sender is not None and tp is None  # the learning job is the plain job
        engine = LearningLM(config, timeline, sender, seed, dist.get_rank())
    else:
        engine = StreamingLM(config, timeline, sender, seed=seed, tp=tp)
    if config.lora:
        lora, _ = _torch_lm_adapter(config)
        engine.add_adapter(DEMO_ADAPTER, lora)

    def counters() -> dict[str, int]:
        stats = engine.statistics()
        out = {
            "forwards": stats.forwards,
            "torn_forwards": stats.torn_forwards,
            "generation_pauses": engine.scheduler.statistics().pauses,
            "installs": 0,
            **engine.results,
        }
        if engine.lockstep is not None and engine.follower:
            out["tp_steps_mirrored"] = engine.lockstep.steps_mirrored
        return out

    return EngineHandle(engine, counters)


_TRAINER_SEED = 1
"""The trainer's TinyLM is seeded ``config.seed + 1`` (apart from the replicas' version 0)..."""
_DRIFT_SEED = 2
"""... and moved each step with noise seeded ``config.seed + 2``."""


def torch_lm_trainer(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """The trainer's TinyLM: seeded apart from the replicas' version 0, moved every step."""
    model = TinyCausalLM.build(config.model, seed=config.seed + _TRAINER_SEED)
    weights = {name: param.detach() for name, param in model.named_parameters()}
    return weights, drift_each_step(weights, seed=config.seed + _DRIFT_SEED)


def torch_lm_learner(config: DistributedDemoConfig) -> LearnerModel:
    """What ``--learn`` trains on ``torch_lm``: the tiny LM of ``config.model`` (its seed's
    weights, which the replicas start from), served in ``config.model.dtype``."""
    model = config.model
    return LearnerModel(
        build=partial(TinyLMPolicy.build, model),
        served_dtype=model.dtype,
        vocab_size=model.vocab_size,
        max_seq_len=model.max_seq_len,
        lr=LearnConfig.lr,
    )


def torch_lm_trainer_shards(
    config: DistributedDemoConfig, rank: int
) -> tuple[Layout, dict[str, torch.Tensor], Callable[[int], None]]:
    """Trainer rank ``rank``'s part of :func:`torch_lm_trainer`: the trainer's layout (FSDP,
    dim 0 over ``config.trainer_ranks`` ranks), this rank's shards of the same model, and an
    ``advance`` that moves them exactly as the whole model moves (:func:`drift_shards_each_step`),
    so the whole model at every version is the one a replay of the trainer model gives. The
    whole model exists only while the shards are cut from it."""
    whole, _ = torch_lm_trainer(config)
    layout = trainer_layout(whole, config.trainer_ranks)
    shards = layout.shard(whole, rank)
    del whole
    advance = drift_shards_each_step(shards, layout, rank, seed=config.seed + _DRIFT_SEED)
    return layout, shards, advance


class _SenderPacker:
    """A TornReadBackend's packer: each forward's payload registered with the sender."""

    def __init__(self, sender: PayloadSender) -> None:
        self.sender = sender

    def submit(self, payload: Any, timeout: float | None = None) -> None:
        self.sender.register_payload(
            {"weight_versions": torch.tensor(payload["versions"], dtype=torch.int64)},
            timeout=timeout,
        )


def _torn_read_engine(request: EngineRequest) -> EngineHandle:
    """The ``torn_read`` engine's factory: the version-stamped fake model, one payload a
    forward."""
    config: DistributedDemoConfig = request.config
    timeline = request.timeline
    model = VersionStampedModel(config.num_tensors, config.numel, timeline=timeline)
    packer = _SenderPacker(request.sender)
    backend: TornReadBackend
    if config.mode is SyncMode.SYNC:
        backend = TornReadBackend(
            model, packer=packer, pause_timeout=config.timeout_s, timeline=timeline
        )
    else:
        backend = AsyncTornReadBackend(
            model, packer=packer, pause_timeout=config.timeout_s, timeline=timeline
        )

    def counters() -> dict[str, int]:
        return {
            "forwards": model.forwards,
            "torn_forwards": model.torn_reads,
            "generation_pauses": backend.generation_gate.statistics().exclusive_acquired,
            "installs": len(backend.installs) if isinstance(backend, AsyncTornReadBackend) else 0,
        }

    return EngineHandle(backend, counters)


def _torn_read_trainer(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """Version ``v`` is ``v + pattern`` with the pattern in [0, 0.5): the stamp a forward reads
    (``int(x)``) is ``v``, and the bytes differ from element to element, so the bit-identical
    check compares real data, not a constant."""
    gen = torch.Generator().manual_seed(config.seed)
    names = [f"layers.{i}.weight" for i in range(config.num_tensors)]
    pattern = {n: torch.rand(config.numel, generator=gen) * 0.5 for n in names}
    weights = {n: torch.zeros(config.numel) for n in names}

    def advance(step: int) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                torch.add(pattern[name], float(step), out=tensor)

    return weights, advance


def _torch_lm_adapter(
    config: DistributedDemoConfig,
) -> tuple[LoRAConfig, dict[str, tuple[int, int]]]:
    """``--lora``: an adapter on every linear layer of the tiny LM's blocks."""
    shapes = tiny_lm_lora_shapes(config.model)
    rank = config.lora_rank
    return LoRAConfig(rank, 2.0 * rank, tuple(shapes), config.model.dtype), shapes


def _stream_demo(request: InProcessRequest) -> dict[str, Any]:
    """``--in-process --backend torch_lm``: the stream demo."""
    config = StreamDemoConfig(syncs=request.syncs, guarded=request.guarded, stream=request.stream)
    return run_stream_demo(config, request.timeline)


def _torn_read_demo(request: InProcessRequest) -> dict[str, Any]:
    """``--in-process --backend torn_read``: the threads-only demo."""
    config = InProcessDemoConfig(syncs=request.syncs, guarded=request.guarded)
    return run_in_process_demo(config, request.timeline)


# vllm: each callable imports its module when called (vLLM itself only when an engine starts).


def _vllm_engine(request: EngineRequest) -> EngineHandle:
    from .vllm_replicas import vllm_replica_engine

    return vllm_replica_engine(request)


def _vllm_trainer(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    from .vllm_replicas import vllm_trainer_model

    return vllm_trainer_model(config)


def _vllm_learner(config: DistributedDemoConfig) -> LearnerModel:
    from .vllm_replicas import vllm_learner_model

    return vllm_learner_model(config)


def _vllm_adapter(config: DistributedDemoConfig) -> tuple[LoRAConfig, dict[str, tuple[int, int]]]:
    from .vllm_replicas import vllm_adapter_model

    return vllm_adapter_model(config)


def _vllm_demo(request: InProcessRequest) -> dict[str, Any]:
    """``--in-process --backend vllm``: one engine in this process."""
    from .vllm import VLLMDemoConfig, run_vllm_demo

    return run_vllm_demo(
        VLLMDemoConfig(syncs=request.syncs, guarded=request.guarded), request.timeline
    )


register_engine(
    "torch_lm",
    _torch_lm_engine,
    trainer_model=torch_lm_trainer,
    modes=(SyncMode.SYNC, SyncMode.STAGED),
    adapter=_torch_lm_adapter,
    learner=torch_lm_learner,
    in_process=_stream_demo,
)
register_engine(
    "torn_read",
    _torn_read_engine,
    trainer_model=_torn_read_trainer,
    modes=SyncMode,
    in_process=_torn_read_demo,
)
register_engine(
    "vllm",
    _vllm_engine,
    trainer_model=_vllm_trainer,
    modes=(SyncMode.SYNC, SyncMode.STAGED),
    start_s=VLLM_START_S,
    starts_processes=True,
    default_replicas=2,
    launchers=("local",),
    adapter=_vllm_adapter,
    learner=_vllm_learner,
    requires=require_vllm,
    in_process=_vllm_demo,
)
