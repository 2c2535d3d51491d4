"""``rollout-sync demo --learn``: the main job with a trainer that learns from the replicas' own
rollouts (:mod:`rollout_sync.learn`; docs/learning.md).

* **Replicas**: fed with the task's prompts a group at a time (``group_size`` samples of one
  prompt, each with a seed of its own) and shipping each finished sample as a rollout payload:
  prompt, completion, behaviour log-probabilities (after temperature) and every token's weight
  version. In flight (the default) the queue is kept full through training steps and syncs;
  synchronously, each replica generates its share of a step's groups on the version it serves,
  then waits, idle (a ``generation_idle`` span), for the next version. :class:`GroupFeed` is
  that logic, whatever the engine; :class:`LearningLM` runs it on the stream LM (``torch_lm``),
  :class:`~rollout_sync.demos.vllm_replicas.VLLMLearningReplica` on vLLM (``vllm``).
* **Trainer** (:class:`LearningTrainer`): an fp32 master of the model the engine's registration
  names (its ``learner``: :class:`~rollout_sync.learn.models.LearnerModel`) and AdamW
  (:class:`~rollout_sync.learn.PolicyLearner`); each step waits for enough whole, fresh groups
  (:class:`~rollout_sync.learn.RolloutGroups`), steps on them and hands the served copy to the
  job's usual push.
* **Report** (:func:`learning_report`): the reward curve, staleness, what staleness dropped, the
  importance weights, the changed fraction per sync, tokens per second and how long replicas
  idled.

Also here, :class:`NextTokenTrainer`: the trainer's step of ``rollout-sync demo --delta`` without
``--learn``, a real AdamW step on the same fp32 master (a next-token loss on random tokens), so
the versions the job pushes differ as training makes them differ.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..backends import registered_engine, registered_engines
from ..errors import LearningStarved, PayloadTimeout
from ..learn import (
    InvalidRollout,
    LearnConfig,
    PolicyLearner,
    RolloutGroups,
    TokenSetTask,
    rollout_from_payload,
    rollout_payload,
)
from ..learn.models import LearnerModel
from ..metrics import percentile
from ..payload import PayloadReceiver, PayloadSender, ReceivedPayload
from ..scheduler import GenerationRequest, GenerationResult, SamplingParams, SchedulerTimeout
from ..trace import Span, SpanKind, Timeline
from .job import DistributedDemoConfig
from .streaming_lm import StreamingLM

__all__ = [
    "GroupFeed",
    "LearningLM",
    "LearningTrainer",
    "NextTokenTrainer",
    "PromptGroup",
    "check_learning_config",
    "learner_model",
    "learning_engines",
    "learning_report",
]


def learning_engines() -> list[str]:
    """The registered engines the learning job runs on: those registered with a ``learner``."""
    return [n for n in registered_engines() if registered_engine(n).learner is not None]


def learner_model(config: DistributedDemoConfig) -> LearnerModel:
    """What the learning job trains on ``config.backend``: its registration's ``learner``.

    Raises:
        KeyError: no engine is registered under that name.
        ValueError: the engine was registered without a ``learner``; the message names those
            with one.
    """
    learner = registered_engine(config.backend).learner
    if learner is None:
        raise ValueError(
            f"engine {config.backend!r} was registered without a learner (the trainer has no "
            f"master of its model); the learning job runs on {learning_engines()}"
        )
    return learner(config)


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
    model: LearnerModel | None = None
    try:
        model = learner_model(config)
    except ValueError as exc:
        problems.append(str(exc))
    if config.sharded:
        problems.append(
            "the trainer keeps one fp32 master on one rank and the replicas serve it whole "
            f"(trainer_ranks={config.trainer_ranks}, tp={config.tp}): use 1 and 1"
        )
    if config.lora:
        problems.append("the trainer trains the whole model, not a LoRA adapter")
    if config.mode.is_async:
        problems.append(f"the learning job runs the sync or staged mode, not {config.mode.value!r}")
    if model is not None and learn.task.vocab_size != model.vocab_size:
        problems.append(
            f"the task's vocabulary ({learn.task.vocab_size}) is not the model's "
            f"({model.vocab_size} on {config.backend}): LearnConfig(task=TokenSetTask("
            f"vocab_size={model.vocab_size}))"
        )
    if model is not None and (
        learn.task.prompt_length + learn.completion_tokens > model.max_seq_len
    ):
        problems.append("a prompt and its completion exceed the model's max_seq_len")
    if problems:
        raise ValueError("the learning job cannot run: " + "; ".join(problems))


@dataclass(frozen=True)
class PromptGroup:
    """One group a replica generates: ``prompt`` sampled once per seed in ``seeds``."""

    group: str
    """The group's id, unique in the job (``"rank:n"``): a rollout's
    :data:`~rollout_sync.learn.GROUP_KEY`."""
    prompt: tuple[int, ...]
    seeds: tuple[int, ...]


class GroupFeed:
    """What a learning replica's feeder thread runs, whatever its engine: the task's prompts a
    group at a time, in flight or synchronously (:attr:`LearnConfig.inflight
    <rollout_sync.learn.LearnConfig.inflight>`).

    The engine is reached through three callables: ``put(group)`` submits the group's samples
    and returns at once; ``backlog()`` counts the samples submitted and not yet taken;
    ``take(timeout)`` ships the samples that finished, waiting up to ``timeout`` seconds for
    the first, and returns how many it took (0: none finished). ``weight_version()`` is the
    version the engine serves.

    * **In flight**: whole groups keep the backlog at ``room`` samples (at least one group);
      the engine generates through training steps and syncs.
    * **Synchronously**: each version as it lands (the trainer's first push included: the
      engine's own version 0 is never generated on), this replica's share of a step's groups,
      shipped; then idle, a ``generation_idle`` span in ``timeline``, until the next version
      (the owner calls :meth:`version_committed` on every commit).

    Every wait is bounded (``0.05`` s a take, so a stop is seen; ``4 * timeout_s`` for a
    version). Prompts and seeds are drawn from ``rng``: a prompt, then one seed per sample.
    """

    def __init__(
        self,
        learn: LearnConfig,
        *,
        replicas: int,
        rank: int,
        rng: random.Random,
        room: int,
        timeline: Timeline,
        timeout_s: float,
        stopping: threading.Event,
        put: Callable[[PromptGroup], None],
        backlog: Callable[[], int],
        take: Callable[[float], int],
        weight_version: Callable[[], int],
    ) -> None:
        self.learn = learn
        self.replicas = replicas
        self.rank = rank
        self.room = max(room, learn.group_size)
        self.timeline = timeline
        self.timeout_s = timeout_s
        self.stopping = stopping
        self._rng = rng
        self._put, self._backlog, self._take = put, backlog, take
        self._weight_version = weight_version
        self._groups_put = 0
        self._versions = threading.Condition()

    def __repr__(self) -> str:
        how = "in flight" if self.learn.inflight else "synchronous"
        return f"<GroupFeed rank {self.rank} {how}: {self._groups_put} groups put>"

    def next_group(self) -> PromptGroup:
        learn, rng = self.learn, self._rng
        prompt = learn.task.prompt(rng)
        group = f"{self.rank}:{self._groups_put}"
        self._groups_put += 1
        return PromptGroup(
            group, prompt, tuple(rng.getrandbits(32) for _ in range(learn.group_size))
        )

    def version_committed(self) -> None:
        """The engine committed a version: a synchronous feed waiting for one goes on."""
        with self._versions:
            self._versions.notify_all()

    def stop(self) -> None:
        """Stop feeding: a feed waiting for a version sees it now."""
        self.stopping.set()
        self.version_committed()

    def run(self) -> None:
        """Feed until :meth:`stop`; raises what the engine's callables raise."""
        if self.learn.inflight:
            self._in_flight()
        else:
            self._synchronously()

    def _in_flight(self) -> None:
        size = self.learn.group_size
        while not self.stopping.is_set():
            while self._backlog() + size <= self.room:
                self._put(self.next_group())
            self._take(0.05)  # bounded: a stop is seen

    def _synchronously(self) -> None:
        share = self.learn.replica_share(self.replicas)
        served = 0  # the engine's own version 0: the trainer pushes its weights first
        while not self.stopping.is_set():
            idle_since = time.monotonic_ns()
            with self._versions:
                self._versions.wait_for(
                    partial(self._moved_on_from, served), timeout=self.timeout_s * 4
                )
            self.timeline.add_span(SpanKind.GENERATION_IDLE, "waiting for weights", idle_since)
            if self.stopping.is_set():
                return
            served = self._weight_version()
            for _ in range(share):
                self._put(self.next_group())
            finished = 0
            while finished < share * self.learn.group_size and not self.stopping.is_set():
                finished += self._take(0.05)  # bounded: a stop is seen

    def _moved_on_from(self, version: int) -> bool:
        return self._weight_version() != version or self.stopping.is_set()


class LearningLM(StreamingLM):
    """A replica of the learning job on the stream LM: its feeder runs a :class:`GroupFeed`,
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
        self.feed = GroupFeed(
            self.learn,
            replicas=config.replicas,
            rank=rank,
            rng=self._rng,
            room=2 * self.scheduler.max_concurrent,
            timeline=timeline,
            timeout_s=config.timeout_s,
            stopping=self._stopping,
            put=self._put_group,
            backlog=self._backlog,
            take=self._take,
            weight_version=lambda: self.weight_version,
        )

    def commit_weight_version(self, version: int) -> None:
        super().commit_weight_version(version)
        self.feed.version_committed()

    def stop(self, timeout: float = 30.0, *, finish_active: bool = False) -> None:
        self.feed.stop()
        super().stop(timeout, finish_active=finish_active)

    def _put_group(self, group: PromptGroup) -> None:
        for seed in group.seeds:
            request = GenerationRequest(
                group.prompt,
                max_new_tokens=self.learn.completion_tokens,
                sampling=SamplingParams(temperature=self.learn.temperature, seed=seed),
            )
            self._group_of[self.put(request)] = group.group

    def _backlog(self) -> int:
        backlog = self.scheduler.statistics()
        return backlog.queued + backlog.active

    def _take(self, timeout: float) -> int:
        try:
            first = self.scheduler.get(timeout=timeout)
        except SchedulerTimeout:
            return 0
        results = [first, *self.get_all()]
        self._ship(results, self.demo.timeout_s)
        return len(results)

    def _feed(self) -> None:
        try:
            self.feed.run()
        except BaseException as exc:  # kept: stop() raises it
            self._feeder_error = exc

    def _ship(self, results: Sequence[GenerationResult], timeout: float) -> None:
        try:
            super()._ship(results, timeout)
        finally:  # shipped, cancelled or failed: each request's group is done with
            for result in results:
                self._group_of.pop(result.request_id, None)

    def _payload(self, result: GenerationResult) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, metadata = rollout_payload(
            self._group_of[result.request_id],
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
        model = learner_model(config)
        self.learner = PolicyLearner(
            model.build(),
            task=learn.task,
            lr=learn.lr,
            served_dtype=model.served_dtype,
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
            "importance_weight_p50": percentile(self.ratios, 50),
            "importance_weight_p99": percentile(self.ratios, 99),
            "clipped_fraction": self.clipped / len(self.ratios) if self.ratios else 0.0,
            "changed_fractions": self.changed_fractions,
            "received_tokens": self.received_tokens,
            "rollouts_invalid": self.invalid,
            "window_ns": self.window_ns,
        }


class NextTokenTrainer:
    """The trainer's step under ``--delta`` without ``--learn``: one real AdamW step (betas
    0.9/0.999, eps 1e-8, no weight decay) on the fp32 master of the model the engine's
    registration names (its ``learner``) at ``config.delta_lr``, on the next-token loss of a
    batch of random tokens (:meth:`~rollout_sync.learn.PolicyLearner.next_token_step`), then
    the served copy (:attr:`weights`, in the learner's served dtype) refreshed.

    Adding noise to every element changes every element; a training step at a realistic
    learning rate changes the few whose served rounding flips, which is what a delta sync
    ships. The batch (:data:`BATCH` rows of up to :data:`WIDTH` tokens) is drawn from
    ``config.seed``."""

    BATCH = 8
    WIDTH = 33

    def __init__(self, config: DistributedDemoConfig) -> None:
        model = learner_model(config)
        self.learner = PolicyLearner(
            model.build(),
            task=TokenSetTask(vocab_size=model.vocab_size),  # unused by next-token steps
            lr=config.delta_lr,
            served_dtype=model.served_dtype,
        )
        self.lr = config.delta_lr
        self.vocab_size = model.vocab_size
        self.width = min(self.WIDTH, model.max_seq_len)
        self._tokens = torch.Generator().manual_seed(config.seed + 5)
        self.losses: list[float] = []
        self.changed_fractions: list[float] = []

    def __repr__(self) -> str:
        return f"<NextTokenTrainer {len(self.losses)} steps at lr {self.lr:g}>"

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The served copy: what the job pushes, rewritten in place by every step."""
        return self.learner.served

    def step(self, step: int) -> None:
        """Training step ``step``: one AdamW step on a fresh batch of random tokens."""
        tokens = torch.randint(0, self.vocab_size, (self.BATCH, self.width), generator=self._tokens)
        result = self.learner.next_token_step(tokens)
        self.losses.append(result.loss)
        self.changed_fractions.append(result.changed_fraction)

    def report(self) -> dict[str, Any]:
        """Plain values for the report (they cross processes)."""
        return {"losses": self.losses, "changed_fractions": self.changed_fractions}


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
