"""The demo's stream LM replica: the tiny torch LM generating without end, kept fed with
prompts, shipping every finished generation to the trainer over the payload transport
(:class:`StreamingLM`). The ``torch_lm`` engine (:mod:`rollout_sync.demos.engines`) builds
it; the learning job's replica (:mod:`rollout_sync.demos.learning`) builds on it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..backends.torch_lm import TorchLMStreamBackend
from ..backends.torch_lm.tensor_parallel import TensorParallel
from ..errors import ShutdownTimeout
from ..payload import PayloadSender
from ..scheduler import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SchedulerTimeout,
)
from ..trace import Timeline
from .job import DEMO_ADAPTER, DistributedDemoConfig

__all__ = ["StreamingLM"]


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
