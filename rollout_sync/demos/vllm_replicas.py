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

**The learning job** (``rollout-sync demo --learn --backend vllm``; docs/learning.md): each
replica is a :class:`VLLMLearningReplica`, serving :data:`LEARN_SERVED_DTYPE` with
``logprobs_mode="processed_logprobs"`` (each token's log-probability after temperature, as it
was sampled) and fed by a :class:`~rollout_sync.demos.learning.GroupFeed`: the task's prompts a
group at a time, every sample seeded, each finished one shipped as a rollout. The trainer's
master is the same tiny Llama in float32, a transformers ``LlamaForCausalLM`` drawn with a
learnable init (:data:`LEARN_INIT_STD`) from the job's seed, as the replicas' checkpoint is
(:func:`vllm_learner_model`).
"""

from __future__ import annotations

import collections
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..backends import EngineHandle, EngineRequest
from ..backends.vllm import (
    VLLMAsyncBackend,
    VLLMEngineConfig,
    VLLMGeneration,
    VLLMLoRASettings,
    VLLMRequest,
    vllm_lora_shapes,
)
from ..errors import GenerationTimeout, ShutdownTimeout
from ..learn import rollout_payload
from ..learn.models import CausalLMPolicy, LearnerModel
from ..lora import LoRAConfig
from ..payload import PayloadSender
from ..testing.tiny_llama import TINY_LLAMA, build_tiny_llama, tiny_llama
from ..trace import SpanKind, Timeline
from .job import (
    DEMO_ADAPTER,
    VLLM_LEARN_LR,
    VLLM_START_S,
    DistributedDemoConfig,
    drift_each_step,
)
from .learning import GroupFeed, PromptGroup
from .vllm import RequestFeeder

__all__ = [
    "LEARN_INIT_STD",
    "LEARN_SERVED_DTYPE",
    "VLLM_START_S",
    "VLLMLearningReplica",
    "VLLMReplica",
    "vllm_adapter_model",
    "vllm_learner_model",
    "vllm_replica_engine",
    "vllm_trainer_model",
]

_REPLICA_MODEL_SEED = 0
_TRAINER_MODEL_SEED = 1

LEARN_SERVED_DTYPE = torch.bfloat16
"""What the learning job's vLLM replicas serve, and so what its trainer pushes. vLLM for CPU
0.32 serves bfloat16 here (an x86 CPU with AVX-512 BF16 and AMX): its sampled tokens'
log-probabilities agree with a transformers forward of the same weights within 0.01
(docs/learning.md), and the native weight transfer writes and reads back bf16 tensors."""

LEARN_INIT_STD = 0.02
"""The learning job's tiny Llama is drawn with transformers' init scale (std 0.02: near-uniform
sampling, a reward near chance at step 0), not the peaked std 0.5 of the other vLLM demos."""


class _Feeder(Protocol):
    """What generates on a replica once started: a thread of its own."""

    def start(self) -> None: ...

    def stop(self, timeout: float) -> None: ...

    def counts(self) -> dict[str, int]: ...


class VLLMReplica(VLLMAsyncBackend):
    """A :class:`VLLMAsyncBackend` that generates on its own once started (a
    :class:`~rollout_sync.worker.BackgroundEngine`) and ships each finished request through
    ``sender``.

    :meth:`stop` stops feeding, ships what was in flight and collects the engine's spans;
    :meth:`shutdown` (after the report is taken) stops the engine and removes the checkpoint
    directory. The checkpoint, the engine's settings and the feeder are this class's
    (:meth:`write_checkpoint`, :meth:`engine_config`, :meth:`build_feeder`): the learning
    job's replica, :class:`VLLMLearningReplica`, changes them.
    """

    def __init__(
        self,
        demo: DistributedDemoConfig,
        sender: PayloadSender,
        timeline: Timeline,
        seed: int,
    ) -> None:
        self._checkpoint = tempfile.TemporaryDirectory(prefix="rollout_sync_vllm_replica_")
        self.write_checkpoint(demo, Path(self._checkpoint.name))
        super().__init__(
            self.engine_config(demo, self._checkpoint.name),
            timeline=timeline,
            pause_timeout=demo.timeout_s,
            init_timeout=VLLM_START_S,
            rpc_timeout=demo.timeout_s,
        )
        if demo.lora:
            adapter, _ = vllm_adapter_model(demo)
            self.add_adapter(DEMO_ADAPTER, adapter)
        self.feeder: _Feeder = self.build_feeder(demo, sender, seed)

    def write_checkpoint(self, demo: DistributedDemoConfig, directory: Path) -> None:
        """The checkpoint the engine starts from: the tiny random Llama (version 0)."""
        build_tiny_llama(directory, seed=_REPLICA_MODEL_SEED)

    def engine_config(self, demo: DistributedDemoConfig, directory: str) -> VLLMEngineConfig:
        """float32 (with ``delta``, :data:`LEARN_SERVED_DTYPE`: what the trainer's AdamW master
        is served in), a 64 MiB KV cache, an adapter slot with ``--lora``."""
        lora = VLLMLoRASettings(max_adapters=1, max_lora_rank=demo.lora_rank) if demo.lora else None
        dtype = str(LEARN_SERVED_DTYPE).removeprefix("torch.") if demo.delta else "float32"
        return VLLMEngineConfig(directory, dtype=dtype, kv_cache_memory_bytes=64 << 20, lora=lora)

    def build_feeder(
        self, demo: DistributedDemoConfig, sender: PayloadSender, seed: int
    ) -> _Feeder:
        """Requests of mixed length (greedy), ``max_concurrent`` in flight."""
        rng = random.Random(seed)
        lengths = [rng.randint(demo.min_new_tokens, demo.max_new_tokens) for _ in range(4096)]
        return RequestFeeder(
            self,
            _ship_to(sender, demo.timeout_s),
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


class VLLMLearningReplica(VLLMReplica):
    """A replica of the learning job on vLLM: the tiny Llama drawn with a learnable init from
    the job's seed (the trainer's master, :func:`vllm_learner_model`, is the same), served in
    :data:`LEARN_SERVED_DTYPE` with ``processed_logprobs``, fed by a
    :class:`~rollout_sync.demos.learning.GroupFeed` (:class:`_RolloutFeeder`)."""

    def __init__(
        self,
        demo: DistributedDemoConfig,
        sender: PayloadSender,
        timeline: Timeline,
        seed: int,
        rank: int,
    ) -> None:
        if demo.learn is None:
            raise ValueError("VLLMLearningReplica runs the learning job: give the config learn=")
        self.rank = rank
        super().__init__(demo, sender, timeline, seed)

    def write_checkpoint(self, demo: DistributedDemoConfig, directory: Path) -> None:
        build_tiny_llama(directory, seed=demo.seed, std=LEARN_INIT_STD)

    def engine_config(self, demo: DistributedDemoConfig, directory: str) -> VLLMEngineConfig:
        return VLLMEngineConfig(
            directory,
            dtype=str(LEARN_SERVED_DTYPE).removeprefix("torch."),
            kv_cache_memory_bytes=64 << 20,
            logprobs_mode="processed_logprobs",
        )

    def build_feeder(
        self, demo: DistributedDemoConfig, sender: PayloadSender, seed: int
    ) -> _RolloutFeeder:
        self.rollouts = _RolloutFeeder(self, demo, sender, seed, self.rank)
        return self.rollouts

    def commit_weight_version(self, version: int) -> None:
        super().commit_weight_version(version)
        self.rollouts.feed.version_committed()


class _RolloutFeeder:
    """The learning replica's feeder: a :class:`~rollout_sync.demos.learning.GroupFeed` on a
    thread of its own over the replica's requests. Each sample is ``SamplingParams(temperature,
    max_tokens=completion_tokens, logprobs=0, seed, ignore_eos=True)``: a completion of exactly
    ``completion_tokens`` tokens with each token's log-probability; each finished one is
    shipped as a rollout (:func:`~rollout_sync.learn.rollout_payload`, ``request_id`` beside).
    :meth:`stop` stops feeding, then waits for the samples in flight and ships them."""

    def __init__(
        self,
        replica: VLLMReplica,
        demo: DistributedDemoConfig,
        sender: PayloadSender,
        seed: int,
        rank: int,
    ) -> None:
        assert demo.learn is not None and replica.timeline is not None
        self.replica, self.sender, self.timeout_s = replica, sender, demo.timeout_s
        self.learn = demo.learn
        self.error: BaseException | None = None
        self._in_flight: collections.deque[tuple[VLLMRequest, PromptGroup]] = collections.deque()
        self._counts = dict.fromkeys(("results_straddled_sync", "results_failed"), 0)
        self.feed = GroupFeed(
            demo.learn,
            replicas=demo.replicas,
            rank=rank,
            rng=random.Random(seed),
            room=2 * demo.max_concurrent,
            timeline=replica.timeline,
            timeout_s=demo.timeout_s,
            stopping=threading.Event(),
            put=self._put,
            backlog=lambda: len(self._in_flight),
            take=self._take,
            weight_version=lambda: replica.weight_version,
        )
        self._thread = threading.Thread(target=self._run, name="vllm-learning-feeder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def stop(self, timeout: float) -> None:
        """Stop feeding; ship what is in flight. Raises :class:`ShutdownTimeout` after
        ``timeout`` and :class:`RuntimeError` (chained) if the feeder had failed."""
        self.feed.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ShutdownTimeout(
                f"the learning replica's feeder did not stop within {timeout:.1f} s"
            )
        if self.error is not None:
            raise RuntimeError("the learning replica's feeder failed") from self.error

    def _run(self) -> None:
        try:
            self.feed.run()
            deadline = time.monotonic() + self.timeout_s
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._take(left)  # what was in flight at the stop; the rest ends at shutdown
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self.error = exc

    def _put(self, group: PromptGroup) -> None:
        from vllm import SamplingParams

        for seed in group.seeds:
            params = SamplingParams(
                temperature=self.learn.temperature,
                max_tokens=self.learn.completion_tokens,
                logprobs=0,
                seed=seed,
                ignore_eos=True,
            )
            self._in_flight.append((self.replica.submit(group.prompt, params), group))

    def _take(self, timeout: float) -> int:
        """Ship the samples that finished, oldest first, waiting up to ``timeout`` for the
        oldest in flight."""
        if not self._in_flight:
            self.feed.stopping.wait(timeout)
            return 0
        try:
            self._in_flight[0][0].result(timeout)
        except GenerationTimeout:
            return 0
        done: list[tuple[VLLMRequest, PromptGroup]] = []
        running: collections.deque[tuple[VLLMRequest, PromptGroup]] = collections.deque()
        for entry in self._in_flight:  # one read of done each: one may finish meanwhile
            (done if entry[0].done else running).append(entry)
        self._in_flight = running
        for request, group in done:
            self._ship(request.result(0), group)
        return len(done)

    def _ship(self, result: VLLMGeneration, group: PromptGroup) -> None:
        if not result.ok:
            self._counts["results_failed"] += 1  # never shipped as a rollout
            return
        tensors, metadata = rollout_payload(
            group.group,
            result.prompt_token_ids,
            result.token_ids,
            result.token_logprobs,
            result.token_weight_versions,
        )
        self.sender.register_payload(
            tensors, {**metadata, "request_id": result.request_id}, timeout=self.timeout_s
        )
        self._counts["results_straddled_sync"] += result.straddled


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
    """The ``vllm`` engine's factory: a :class:`VLLMReplica` (a :class:`VLLMLearningReplica`
    when the config has ``learn``) shipping through the request's sender, its counters, and
    its ``shutdown`` as the handle's ``close``."""
    config: DistributedDemoConfig = request.config
    timeline = request.timeline
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # One intra-op thread per engine: the replicas' engines share the machine's cores, and
    # OpenMP pools that spin-wait against each other slow every decode step many times over.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank = dist.get_rank()
    seed = config.seed * 1009 + rank
    replica = (
        VLLMLearningReplica(config, request.sender, timeline, seed, rank)
        if config.learn is not None
        else VLLMReplica(config, request.sender, timeline, seed)
    )

    def counters() -> dict[str, int]:
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
            **replica.feeder.counts(),
        }

    return EngineHandle(replica, counters, close=replica.shutdown)


def vllm_adapter_model(
    config: DistributedDemoConfig,
) -> tuple[LoRAConfig, dict[str, tuple[int, int]]]:
    """``--lora``: an adapter on every linear layer of the tiny Llama's decoder layers."""
    shapes = vllm_lora_shapes(TINY_LLAMA)  # the replicas' checkpoint config
    rank = config.lora_rank
    return LoRAConfig(rank, 2.0 * rank, tuple(shapes), torch.float32), shapes


def vllm_learner_model(config: DistributedDemoConfig) -> LearnerModel:
    """What ``--learn`` trains on the ``vllm`` engine: the float32 tiny Llama the replicas'
    checkpoint holds (a transformers ``LlamaForCausalLM``, :data:`LEARN_INIT_STD`, the job's
    seed), served as :data:`LEARN_SERVED_DTYPE`, at
    :data:`~rollout_sync.demos.job.VLLM_LEARN_LR`."""
    return LearnerModel(
        build=partial(_llama_master, config.seed),
        served_dtype=LEARN_SERVED_DTYPE,
        vocab_size=int(TINY_LLAMA["vocab_size"]),
        max_seq_len=int(TINY_LLAMA["max_position_embeddings"]),
        lr=VLLM_LEARN_LR,
    )


def _llama_master(seed: int) -> CausalLMPolicy:
    return CausalLMPolicy(tiny_llama(seed=seed, std=LEARN_INIT_STD))


def vllm_trainer_model(
    config: DistributedDemoConfig,
) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """The trainer's tiny Llama (another seed than the replicas' version 0), moved every step."""
    with tempfile.TemporaryDirectory(prefix="rollout_sync_vllm_trainer_") as tmp:
        weights = dict(sorted(build_tiny_llama(Path(tmp), seed=_TRAINER_MODEL_SEED).items()))
    return weights, drift_each_step(weights, seed=config.seed + 2)
