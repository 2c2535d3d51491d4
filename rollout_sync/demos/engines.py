"""The demo's engines, registered by name: ``torch_lm`` (the tiny torch LM under the stream
scheduler), ``torn_read`` (a fake model stamped with its version) and ``vllm`` (a tiny Llama
on vLLM, imported only when a replica builds it).

Imported by :mod:`rollout_sync.demos.distributed`, which every replica process of the demo
imports: a replica looks its engine up in its own registry
(:func:`~rollout_sync.backends.registered_engine`), so the registration must happen at import.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..backends import (
    EngineHandle,
    EngineRequest,
    InProcessRequest,
    register_engine,
)
from ..backends.torch_lm import TinyCausalLM, TorchLMStreamBackend, tiny_lm_lora_shapes
from ..backends.torch_lm.tensor_parallel import TensorParallel
from ..backends.vllm import require_vllm
from ..errors import ShutdownTimeout
from ..lora import LoRAConfig
from ..payload import (
    PayloadSender,
)
from ..scheduler import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SchedulerTimeout,
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
from .sharded import (
    trainer_layout,
)
from .stream import StreamDemoConfig, run_stream_demo


class StreamingLM(TorchLMStreamBackend):
    """The tiny LM generating without end, shipping every finished generation to the trainer.

    A feeder thread keeps the scheduler's queue at twice ``max_concurrent`` prompts, takes the
    results and registers each finished one with the payload sender (blocking, with the
    config's timeout, while the sender's registry is full). The scheduler never waits for the
    feeder, so a pause never waits for the payload transport. :meth:`stop` stops the feeder,
    then the scheduler, then ships what is left.

    With ``tp``, one rank of a tensor-parallel replica: the leader feeds and ships as above; a
    follower (no ``sender``) only mirrors the leader's steps on its slice.
    """

    def __init__(
        self,
        config: DistributedDemoConfig,
        timeline: Timeline,
        sender: PayloadSender | None,
        seed: int,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(
            config.model,
            max_concurrent=config.max_concurrent,
            pause_timeout=config.timeout_s,
            timeline=timeline,
            tp=tp,
        )
        if (sender is None) != self.follower:
            raise ValueError("a replica's leader ships payloads through a sender; a follower not")
        self.demo = config
        self.sender = sender
        self.results: dict[str, int] = dict.fromkeys(
            ("results_straddled_sync", "results_cancelled", "results_failed"), 0
        )
        self._rng = random.Random(seed)
        self._stopping = threading.Event()
        self._feeder: threading.Thread | None = None
        self._feeder_error: BaseException | None = None

    def start(self) -> None:
        super().start()
        if self.follower:
            return
        self._feeder = threading.Thread(target=self._feed, name="demo-feeder", daemon=True)
        self._feeder.start()

    def stop(self, timeout: float = 30.0, *, finish_active: bool = False) -> None:
        """Stop feeding, stop the scheduler (unfinished requests are cancelled), ship the rest.

        Raises:
            ShutdownTimeout: the feeder did not stop within ``timeout`` (stuck registering?).
            RuntimeError: the feeder had failed (its error is chained).
        """
        deadline = time.monotonic() + timeout
        self._stopping.set()
        try:
            if self._feeder is not None:
                self._feeder.join(timeout)
                if self._feeder.is_alive():
                    raise ShutdownTimeout(
                        f"the demo's feeder thread did not stop within "
                        f"{timeout:.1f} s (blocked registering a payload?)"
                    )
        finally:
            super().stop(max(0.0, deadline - time.monotonic()), finish_active=finish_active)
        if not self.follower:
            self._ship(self.get_all(), max(0.0, deadline - time.monotonic()))
        if self._feeder_error is not None:
            raise RuntimeError("the demo's feeder thread failed") from self._feeder_error

    def _feed(self) -> None:
        try:
            while not self._stopping.is_set():
                backlog = self.scheduler.statistics()
                for _ in range(2 * self.scheduler.max_concurrent - backlog.queued - backlog.active):
                    self.put(self._request())
                try:
                    # Bounded so that a stop is seen while nothing finishes (a long sync).
                    first = self.scheduler.get(timeout=0.05)
                except SchedulerTimeout:
                    continue
                self._ship([first, *self.get_all()], self.demo.timeout_s)
        except BaseException as exc:  # kept: stop() raises it
            self._feeder_error = exc

    def _request(self) -> GenerationRequest:
        rng, cfg = self._rng, self.demo
        prompt = tuple(rng.randrange(cfg.model.vocab_size) for _ in range(rng.randint(2, 12)))
        return GenerationRequest(
            prompt,
            max_new_tokens=rng.randint(cfg.min_new_tokens, cfg.max_new_tokens),
            sampling=SamplingParams(temperature=1.0, seed=rng.getrandbits(32)),
            # --lora: every other generation on the adapter the trainer trains.
            adapter=DEMO_ADAPTER if cfg.lora and rng.random() < 0.5 else None,
        )

    def _payload(self, result: GenerationResult) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a finished generation ships: token ids, logprobs and every token's weight
        version as tensors, small metadata beside them."""
        tensors = {
            "tokens": torch.tensor(result.tokens, dtype=torch.int64),
            "logprobs": torch.tensor(result.logprobs, dtype=torch.float32),
            "weight_versions": torch.tensor(result.token_weight_versions, dtype=torch.int64),
        }
        metadata = {
            "request_id": result.request_id,
            "prompt_tokens": len(result.prompt),
            "admitted_version": result.admitted_weight_version,
            "completed_version": result.completed_weight_version,
            "straddled_sync": result.straddled_sync,
        }
        return tensors, metadata

    def _ship(self, results: Sequence[GenerationResult], timeout: float) -> None:
        assert self.sender is not None  # the leader's (or a plain replica's)
        for result in results:
            if result.finish_reason is FinishReason.CANCELLED:
                self.results["results_cancelled"] += 1
                continue
            if not result.ok:
                self.results["results_failed"] += 1
                continue
            tensors, metadata = self._payload(result)
            self.sender.register_payload(tensors, metadata, timeout=timeout)
            self.results["results_straddled_sync"] += result.straddled_sync


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
        from .learning import LearningLM  # which builds on this module

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
    requires=require_vllm,
    in_process=_vllm_demo,
)
