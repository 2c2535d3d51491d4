"""The learning loop: a real RL trainer on the replicas' own rollouts, with in-flight updates.

* :mod:`~rollout_sync.learn.task`: the toy task and its verifiable reward.
* :mod:`~rollout_sync.learn.rollouts`: rollouts as the replicas send them, grouped, with
  staleness by version.
* :mod:`~rollout_sync.learn.loss`: group-relative advantages, truncated importance weights.
* :mod:`~rollout_sync.learn.policy`: the fp32 master, AdamW, the served bf16 copy.
* :mod:`~rollout_sync.learn.models`: the models the learner trains (the tiny torch LM, a
  transformers causal LM such as the vLLM replicas' Llama) and what an engine's registration
  says the learning job trains on it (:class:`LearnerModel`).
* :class:`LearnConfig`: the knobs ``rollout-sync demo --learn`` runs with (docs/learning.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .loss import PolicyLoss, group_advantages, truncated_importance_loss
from .models import CausalLMPolicy, LearnerModel, PolicyModel, TinyLMPolicy
from .policy import LearnerStep, PolicyLearner, TokenStep, sequence_logprobs
from .rollouts import (
    GROUP_KEY,
    InvalidRollout,
    Rollout,
    RolloutGroups,
    TakenGroups,
    rollout_from_payload,
    rollout_payload,
)
from .task import TokenSetTask

__all__ = [
    "GROUP_KEY",
    "CausalLMPolicy",
    "InvalidRollout",
    "LearnConfig",
    "LearnerModel",
    "LearnerStep",
    "PolicyLearner",
    "PolicyLoss",
    "PolicyModel",
    "Rollout",
    "RolloutGroups",
    "TakenGroups",
    "TinyLMPolicy",
    "TokenSetTask",
    "TokenStep",
    "group_advantages",
    "rollout_from_payload",
    "rollout_payload",
    "sequence_logprobs",
    "truncated_importance_loss",
]


@dataclass(frozen=True)
class LearnConfig:
    """How the main job learns (``rollout-sync demo --learn``)."""

    lr: float = 3e-3
    """AdamW's learning rate on the fp32 master (0: a frozen policy, the counterfactual)."""
    max_staleness: int = 4
    """Sequences more than this many versions behind the trainer are dropped (by their oldest
    token: :mod:`~rollout_sync.learn.rollouts`)."""
    group_size: int = 8
    """Samples per prompt (the group of the advantages)."""
    groups_per_step: int = 8
    """Groups a training step takes (rounded up to a multiple of the replicas when
    synchronous, each replica generating its share)."""
    completion_tokens: int = 8
    temperature: float = 1.0
    importance_cap: float = 2.0
    """Truncation of the importance weights."""
    importance_weights: bool = True
    """``False``: the loss ignores the behaviour log-probabilities (the benchmark's third arm)."""
    inflight: bool = True
    """Generation runs through training steps and syncs; ``False``: synchronous (each replica
    generates its share of a step's groups on the current version, then waits, idle, for the
    next version; on-policy)."""
    task: TokenSetTask = field(default_factory=TokenSetTask)

    def __post_init__(self) -> None:
        problems = []
        if self.lr < 0:
            problems.append(f"lr must be at least 0, got {self.lr}")
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be at least 0, got {self.max_staleness}")
        if self.group_size < 2 or self.groups_per_step < 1 or self.completion_tokens < 1:
            problems.append(
                "group_size must be at least 2, groups_per_step and completion_tokens at least 1"
            )
        if self.temperature <= 0 or self.importance_cap <= 0:
            problems.append("temperature and importance_cap must be positive")
        if problems:
            raise ValueError("invalid LearnConfig: " + "; ".join(problems))

    def step_groups(self, replicas: int) -> int:
        """Groups per training step: synchronous, a whole share per replica."""
        if self.inflight:
            return self.groups_per_step
        return self.replica_share(replicas) * replicas

    def replica_share(self, replicas: int) -> int:
        """Synchronous: the groups each replica generates per version."""
        return -(-self.groups_per_step // replicas)
