"""``rollout-sync demo --learn``: the main job with a trainer that learns from the replicas' own
rollouts (:mod:`rollout_sync.learn`; docs/learning.md).

* **Replicas** (:class:`LearningLM`): the stream LM, serving the served dtype (bfloat16), fed
  with the task's prompts a group at a time (``group_size`` samples of one prompt, each with a
  seed of its own) and shipping each finished sample as a rollout payload: prompt, completion,
  behaviour log-probabilities (after temperature) and every token's weight version. In flight
  (the default) the queue is kept full through training steps and syncs; synchronously, each
  replica generates its share of a step's groups on the version it serves, then waits, idle (a
  ``generation_idle`` span), for the next version.
* **Trainer** (:class:`LearningTrainer`): an fp32 master and AdamW
  (:class:`~rollout_sync.learn.PolicyLearner`); each step waits for enough whole, fresh groups
  (:class:`~rollout_sync.learn.RolloutGroups`), steps on them and hands the served copy to the
  job's usual push.
* **Report** (:func:`learning_report`): the reward curve, staleness, what staleness dropped, the
  importance weights, the changed fraction per sync, tokens per second and how long replicas
  idled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from ..errors import LearningStarved, PayloadTimeout
from ..learn import (
    InvalidRollout,
    LearnConfig,
    PolicyLearner,
    RolloutGroups,
    rollout_from_payload,
    rollout_payload,
)
from ..metrics import percentile
from ..payload import PayloadReceiver, PayloadSender, ReceivedPayload
from ..scheduler import GenerationRequest, GenerationResult, SamplingParams, SchedulerTimeout
from ..trace import Span, SpanKind, Timeline
from .job import DistributedDemoConfig
from .streaming_lm import StreamingLM

__all__ = [
    "LearningLM",
    "LearningTrainer",
    "check_learning_config",
    "learning_report",
]

LEARNING_ENGINES = ("torch_lm",)
"""The engines the learning job runs: the trainer's master is their model."""


def _learn_of(config: DistributedDemoConfig) -> LearnConfig:
    if config.learn is None:
        raise ValueError("the learning job needs DistributedDemoConfig.learn")
    return config.learn


def check_learning_config(config: DistributedDemoConfig) -> None:
    """Refuse a learning job the trainer cannot run.

    Raises:
        ValueError: an engine the trainer has no master of, several trainer ranks or
            tensor-parallel replicas (one fp32 master on one rank), ``lora``, an async mode, or
            prompts and completions longer than the model's context.
    """
    learn = _learn_of(config)
    problems = []
    if config.backend not in LEARNING_ENGINES:
        problems.append(
            f"the trainer learns the model of {list(LEARNING_ENGINES)}, not of engine "
            f"{config.backend!r}"
        )
    if config.sharded:
        problems.append(
            "the trainer keeps one fp32 master on one rank and the replicas serve it whole "
            f"(trainer_ranks={config.trainer_ranks}, tp={config.tp}): use 1 and 1"
        )
    if config.lora:
        problems.append("the trainer trains the whole model, not a LoRA adapter")
    if config.mode.is_async:
        problems.append(f"the learning job runs the sync or staged mode, not {config.mode.value!r}")
    if learn.task.vocab_size != config.model.vocab_size:
        problems.append(
            f"the task's vocabulary ({learn.task.vocab_size}) is not the model's "
            f"({config.model.vocab_size})"
        )
    if learn.task.prompt_length + learn.completion_tokens > config.model.max_seq_len:
        problems.append("a prompt and its completion exceed the model's max_seq_len")
    if problems:
        raise ValueError("the learning job cannot run: " + "; ".join(problems))


class LearningLM(StreamingLM):
    """A replica of the learning job: the stream LM fed the task's prompts a group at a time,
    shipping rollouts (:func:`~rollout_sync.learn.rollout_payload`)."""

    def __init__(
        self,
        config: DistributedDemoConfig,
        timeline: Timeline,
        sender: PayloadSender,
        seed: int,
        rank: int,
    ) -> None:
        super().__init__(config, timeline, sender, seed)
        self.learn = _learn_of(config)
        self.rank = rank
        self._group_of: dict[int, str] = {}
        self._groups_put = 0
        self._versions = threading.Condition()

    def commit_weight_version(self, version: int) -> None:
        super().commit_weight_version(version)
        with self._versions:
            self._versions.notify_all()

    def stop(self, timeout: float = 30.0, *, finish_active: bool = False) -> None:
        self._stopping.set()
        with self._versions:  # a synchronous feeder waiting for a version sees the stop now
            self._versions.notify_all()
        super().stop(timeout, finish_active=finish_active)

    def _put_group(self) -> None:
        learn, rng = self.learn, self._rng
        prompt = learn.task.prompt(rng)
        group = f"{self.rank}:{self._groups_put}"
        self._groups_put += 1
        for _ in range(learn.group_size):
            request = GenerationRequest(
                prompt,
                max_new_tokens=learn.completion_tokens,
                sampling=SamplingParams(temperature=learn.temperature, seed=rng.getrandbits(32)),
            )
            self._group_of[self.put(request)] = group

    def _feed(self) -> None:
        try:
            if self.learn.inflight:
                self._feed_in_flight()
            else:
                self._feed_synchronously()
        except BaseException as exc:  # kept: stop() raises it
            self._feeder_error = exc

    def _feed_in_flight(self) -> None:
        """Whole groups keep the queue at twice ``max_concurrent`` (at least one group)."""
        size = self.learn.group_size
        room = max(2 * self.scheduler.max_concurrent, size)
        while not self._stopping.is_set():
            backlog = self.scheduler.statistics()
            while backlog.queued + backlog.active + size <= room:
                self._put_group()
                backlog = self.scheduler.statistics()
            try:
                first = self.scheduler.get(timeout=0.05)  # bounded: a stop is seen
            except SchedulerTimeout:
                continue
            self._ship([first, *self.get_all()], self.demo.timeout_s)

    def _feed_synchronously(self) -> None:
        """Each version as it lands (the trainer's first push included): this replica's share
        of a step's groups, shipped; then idle until the next version."""
        share = self.learn.replica_share(self.demo.replicas)
        served = 0  # the engine's own version 0: the trainer pushes its weights first
        while not self._stopping.is_set():
            idle_since = time.monotonic_ns()
            with self._versions:
                self._versions.wait_for(
                    partial(self._moved_on_from, served), timeout=self.demo.timeout_s * 4
                )
            assert self.timeline is not None
            self.timeline.add_span(SpanKind.GENERATION_IDLE, "waiting for weights", idle_since)
            if self._stopping.is_set():
                return
            served = self.weight_version
            for _ in range(share):
                self._put_group()
            finished = 0
            while finished < share * self.learn.group_size and not self._stopping.is_set():
                try:
                    first = self.scheduler.get(timeout=0.05)  # bounded: a stop is seen
                except SchedulerTimeout:
                    continue
                results = [first, *self.get_all()]
                finished += len(results)
                self._ship(results, self.demo.timeout_s)

    def _moved_on_from(self, version: int) -> bool:
        return self.weight_version != version or self._stopping.is_set()

    def _payload(self, result: GenerationResult) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, metadata = rollout_payload(
            self._group_of.pop(result.request_id),
            result.prompt,
            result.tokens,
            result.logprobs,
            result.token_weight_versions,
        )
        return tensors, {**metadata, "request_id": result.request_id}


class LearningTrainer:
    """The trainer's step under ``--learn``: wait for whole, fresh groups, take one AdamW step
    on them, refresh the served copy (:attr:`weights`, what the job pushes).

    ``count(payload, trainer_version)`` sees every payload taken (the job's payload checks)."""

    def __init__(
        self,
        config: DistributedDemoConfig,
        receiver: PayloadReceiver,
        count: Callable[[ReceivedPayload, int], None],
    ) -> None:
        learn = _learn_of(config)
        self.config = config
        self.receiver = receiver
        self.count = count
        self.learner = PolicyLearner(
            config.model,
            task=learn.task,
            lr=learn.lr,
            served_dtype=config.model.dtype,
            temperature=learn.temperature,
            importance_cap=learn.importance_cap,
            importance_weights=learn.importance_weights,
        )
        self.groups = RolloutGroups(learn.group_size, learn.max_staleness)
        self.per_step = learn.step_groups(config.replicas)
        self.invalid = 0
        self.rewards: list[float] = []
        self.staleness: list[int] = []
        self.ratios: list[float] = []
        self.clipped = 0
        self.changed_fractions: list[float] = []
        self.trained_tokens = 0
        self.received_tokens = 0
        self.window_ns = (0, 0)
        """From the first step's start to the last step's end (``time.monotonic_ns``)."""

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.learner.served

    def step(self, step: int, version: int) -> dict[str, Any]:
        """Training step ``step``, ``version`` the last version pushed: its metrics.

        Raises:
            LearningStarved: ``timeout_s`` passed before enough groups arrived.
        """
        started = time.monotonic_ns()
        deadline = time.monotonic() + self.config.timeout_s
        while not self.groups.ready(self.per_step, version):
            try:
                payload = self.receiver.get(max(0.0, deadline - time.monotonic()))
            except PayloadTimeout:
                raise LearningStarved(
                    f"training step {step} waited {self.config.timeout_s:.0f} s for "
                    f"{self.per_step} whole groups of rollouts at most "
                    f"{self.groups.max_staleness} versions old; {self.groups.whole} arrived"
                ) from None
            self.count(payload, version)
            tokens = payload.tensors.get("tokens")
            self.received_tokens += 0 if tokens is None else tokens.numel()
            try:
                self.groups.add(rollout_from_payload(payload.tensors, payload.meta))
            except InvalidRollout:
                self.invalid += 1
        taken = self.groups.take(self.per_step, version)
        result = self.learner.step(taken.groups)
        self.rewards.append(result.reward)
        self.staleness += taken.staleness
        self.ratios += result.ratios
        self.clipped += result.clipped
        self.changed_fractions.append(result.changed_fraction)
        self.trained_tokens += result.tokens
        self.window_ns = (self.window_ns[0] or started, time.monotonic_ns())
        return {
            "reward": result.reward,
            "loss": result.loss,
            "rollouts": result.sequences,
            "rollout_tokens": result.tokens,
        }

    def report(self) -> dict[str, Any]:
        """The trainer's part of :func:`learning_report` (plain values: it crosses processes)."""
        return {
            "rewards": self.rewards,
            "staleness": self.staleness,
            "tokens_dropped_stale": self.groups.tokens_dropped,
            "sequences_dropped_stale": self.groups.sequences_dropped,
            "importance_weight_p50": percentile(self.ratios, 50),
            "importance_weight_p99": percentile(self.ratios, 99),
            "clipped_fraction": self.clipped / len(self.ratios) if self.ratios else 0.0,
            "changed_fractions": self.changed_fractions,
            "trained_tokens": self.trained_tokens,
            "received_tokens": self.received_tokens,
            "rollouts_invalid": self.invalid,
            "window_ns": self.window_ns,
        }


def _fifth_mean(values: Sequence[float], last: bool) -> float:
    n = max(1, len(values) // 5)
    part = values[-n:] if last else values[:n]
    return sum(part) / len(part) if part else float("nan")


def idle_fraction(spans: Sequence[Span], window_ns: tuple[int, int]) -> float:
    """The share of ``window_ns`` covered by ``spans`` (their union, clipped to the window)."""
    start, end = window_ns
    if end <= start:
        return float("nan")
    covered, reach = 0, start
    for span in sorted(spans, key=lambda s: s.start_ns):
        lo, hi = max(span.start_ns, reach), min(span.end_ns, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def learning_report(
    trainer: Mapping[str, Any], replica_pids: Sequence[int], timeline: Timeline
) -> dict[str, Any]:
    """The report's learning keys: from the trainer's :meth:`LearningTrainer.report` (under
    ``trainer["learning"]``) and the replicas' spans in the merged ``timeline`` (each replica by
    its process id). ``tokens_per_s`` counts the completion tokens the trainer received while it
    trained; ``replica_idle_fraction`` is, averaged over the replicas, the share of that window a
    replica was parked or had nothing to generate."""
    learning = trainer["learning"]
    rewards = learning["rewards"]
    window = tuple(learning["window_ns"])
    idle_kinds = (SpanKind.PAUSE, SpanKind.GENERATION_IDLE)
    idle = [
        idle_fraction(
            [s for s in timeline.spans() if s.pid == pid and s.kind in idle_kinds], window
        )
        for pid in replica_pids
    ]
    seconds = (window[1] - window[0]) / 1e9
    return {
        "reward_first": _fifth_mean(rewards, last=False),
        "reward_last": _fifth_mean(rewards, last=True),
        "reward_curve": [round(r, 4) for r in rewards],
        "staleness_p50": percentile(learning["staleness"], 50),
        "staleness_p99": percentile(learning["staleness"], 99),
        "tokens_dropped_stale": learning["tokens_dropped_stale"],
        "importance_weight_p50": learning["importance_weight_p50"],
        "importance_weight_p99": learning["importance_weight_p99"],
        "clipped_fraction": learning["clipped_fraction"],
        "changed_fraction_p50": percentile(learning["changed_fractions"], 50),
        "tokens_per_s": learning["received_tokens"] / seconds if seconds > 0 else float("nan"),
        "replica_idle_fraction": sum(idle) / len(idle) if idle else float("nan"),
        "rollouts_invalid": learning["rollouts_invalid"],
    }
