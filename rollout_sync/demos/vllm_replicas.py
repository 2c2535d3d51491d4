"""vLLM replicas for the multi-process demo: ``rollout-sync demo --backend vllm``.

The engine ``vllm``: :mod:`rollout_sync.demos.distributed` registers it by name and imports
this module only when a replica or the trainer first needs it (:func:`vllm_replica_engine`,
:func:`vllm_trainer_model`, :func:`vllm_adapter_model`). Each replica process serves a tiny
random Llama (built locally, the same checkpoint on every replica) on vLLM's ``AsyncLLM``
(:class:`~rollout_sync.backends.vllm.VLLMAsyncBackend`, whose engine core is a process of its
own) and keeps requests of mixed length decoding throughout; every finished request goes to the
trainer over the payload transport with the weight version of each of its tokens.

Weights: the trainer's P2R lands in the first replica's receive buffers, and the replica loads
them into its engine through vLLM's native weight-transfer API (``init_weight_transfer_engine``
/ ``start`` / ``update`` / ``finish``) with this package's ``"rollout_sync"`` engine; the
first replica then sends the same tensors R2R to the others, which load them the same way.
Every load is validated before the engine starts its reload and read back after, inside the
guard's bracket (pause at a step boundary, payload egress held). The trainer's weights are the
same tiny Llama, drawn from another seed and moved every step.

With ``--staged`` (``SyncMode.STAGED``) each replica's
:class:`~rollout_sync.worker.RolloutWorker` receives the P2R and R2R transfers into a staging
copy of the weights (host memory, in the replica's process) while its engine keeps decoding,
with payload egress held; generation is parked only for the install: the native load of the
staged copy into the engine (over the local gloo group to the engine's worker), vLLM's reload,
the read-back and the version commit. Every replica installs a version or none does.

Torn reads are the engine's forwards that overlap an engine-side weight write (its spans are
collected into the replica's timeline); the engine has no detector of its own.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..backends import EngineHandle, EngineRequest
from ..backends.vllm import (
    VLLMAsyncBackend,
    VLLMEngineConfig,
    VLLMGeneration,
    VLLMLoRASettings,
    vllm_lora_shapes,
)
from ..lora import LoRAConfig
from ..payload import PayloadSender
from ..testing.tiny_llama import TINY_LLAMA, build_tiny_llama
from ..trace import SpanKind, Timeline
from .job import DEMO_ADAPTER, VLLM_START_S, DistributedDemoConfig, drift_each_step
from .vllm import RequestFeeder

__all__ = [
    "VLLM_START_S",
    "VLLMReplica",
    "vllm_adapter_model",
    "vllm_replica_engine",
    "vllm_trainer_model",
]

_REPLICA_MODEL_SEED = 0
_TRAINER_MODEL_SEED = 1


class VLLMReplica(VLLMAsyncBackend):
    """A :class:`VLLMAsyncBackend` that generates on its own once started (a
    :class:`~rollout_sync.worker.BackgroundEngine`) and ships each finished request.

    ``ship(result)`` runs on the feeder's thread. :meth:`stop` stops feeding, ships what was in
    flight and collects the engine's spans; :meth:`shutdown` (after the report is taken) stops
    the engine and removes the checkpoint directory.
    """

    def __init__(
        self,
        demo: DistributedDemoConfig,
        ship: Callable[[VLLMGeneration], None],
        timeline: Timeline,
        seed: int,
    ) -> None:
        self._checkpoint = tempfile.TemporaryDirectory(prefix="rollout_sync_vllm_replica_")
        build_tiny_llama(Path(self._checkpoint.name), seed=_REPLICA_MODEL_SEED)
        lora = VLLMLoRASettings(max_adapters=1, max_lora_rank=demo.lora_rank) if demo.lora else None
        super().__init__(
            VLLMEngineConfig(
                self._checkpoint.name, dtype="float32", kv_cache_memory_bytes=64 << 20, lora=lora
            ),
            timeline=timeline,
            pause_timeout=demo.timeout_s,
            init_timeout=VLLM_START_S,
            rpc_timeout=demo.timeout_s,
        )
        if demo.lora:
            adapter, _ = vllm_adapter_model(demo)
            self.add_adapter(DEMO_ADAPTER, adapter)
        rng = random.Random(seed)
        lengths = [rng.randint(demo.min_new_tokens, demo.max_new_tokens) for _ in range(4096)]
        self.feeder = RequestFeeder(
            self,
            ship,
            streams=demo.max_concurrent,
            max_tokens=lambda n: lengths[n % len(lengths)],
            timeout_s=demo.timeout_s,
            # --lora: every request on the adapter. vLLM for CPU 0.32 computes the base-model
            # rows of a batch that mixes them with adapter rows on the adapter in its last slot
            # (tests/test_vllm_lora.py keeps that as a strict xfail), so the batch is not mixed.
            adapter=DEMO_ADAPTER if demo.lora else None,
        )

    def start(self) -> None:
        self.feeder.start()

    def stop(self, timeout: float = 60.0) -> None:
        try:
            self.feeder.stop(timeout)
        finally:
            if self.is_initialized:
                self.collect_engine_spans()

    def shutdown(self, timeout: float = 60.0) -> None:
        try:
            super().shutdown(timeout)
        finally:
            self._checkpoint.cleanup()


def _ship_to(sender: PayloadSender, timeout_s: float) -> Callable[[VLLMGeneration], None]:
    def ship(result: VLLMGeneration) -> None:
        if not result.ok:
            return  # counted by the engine's counters, never shipped as a rollout
        sender.register_payload(
            {
                "tokens": torch.tensor(result.token_ids, dtype=torch.int64),
                "weight_versions": torch.tensor(result.token_weight_versions, dtype=torch.int64),
            },
            {
                "request_id": result.request_id,
                "prompt_tokens": len(result.prompt_token_ids),
                "admitted_version": result.admitted_version,
                "completed_version": result.completed_version,
                "straddled_sync": result.straddled,
            },
            timeout=timeout_s,
        )

    return ship


def vllm_replica_engine(request: EngineRequest) -> EngineHandle:
    """The ``vllm`` engine's factory: a :class:`VLLMReplica` shipping through the request's
    sender, its counters, and its ``shutdown`` as the handle's ``close``."""
    config: DistributedDemoConfig = request.config
    timeline = request.timeline
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # One intra-op thread per engine: the replicas' engines share the machine's cores, and
    # OpenMP pools that spin-wait against each other slow every decode step many times over.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    replica = VLLMReplica(
        config,
        _ship_to(request.sender, config.timeout_s),
        timeline,
        seed=config.seed * 1009 + dist.get_rank(),
    )

    def counters() -> dict[str, int]:
        results = replica.feeder.results
        forwards = [
            s
            for s in timeline.spans(SpanKind.FORWARD)
            if s.name == "forward" and s.pid == os.getpid()
        ]
        return {
            "forwards": len(forwards),
            "torn_forwards": 0,
            "generation_pauses": replica.statistics().pauses if replica.is_initialized else 0,
            "installs": 0,
            "results_straddled_sync": sum(r.ok and r.straddled for r in results),
            "results_failed": sum(not r.ok for r in results),
        }

    return EngineHandle(replica, counters, close=replica.shutdown)


def vllm_adapter_model(
    config: DistributedDemoConfig,
) -> tuple[LoRAConfig, dict[str, tuple[int, int]]]:
    """``--lora``: an adapter on every linear layer of the tiny Llama's decoder layers."""
    shapes = vllm_lora_shapes(TINY_LLAMA)  # the replicas' checkpoint config
    rank = config.lora_rank
    return LoRAConfig(rank, 2.0 * rank, tuple(shapes), torch.float32), shapes


def vllm_trainer_model(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """The trainer's tiny Llama (another seed than the replicas' version 0), moved every step."""
    with tempfile.TemporaryDirectory(prefix="rollout_sync_vllm_trainer_") as tmp:
        weights = dict(sorted(build_tiny_llama(Path(tmp), seed=_TRAINER_MODEL_SEED).items()))
    return weights, drift_each_step(weights, seed=config.seed + 2)
