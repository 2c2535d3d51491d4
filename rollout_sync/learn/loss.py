"""The learning loop's loss: group-relative advantages and truncated importance weights.

**Advantages** (as GRPO): each prompt is sampled several times (a group); a sample's advantage is
its reward minus the group's mean, over the group's standard deviation (plus a small epsilon), so
a group whose samples all score alike teaches nothing. No KL term and no value model.

**Off-policy correction.** A rollout was sampled under the replica's weights of its version
(served in bf16), while the gradient is taken at the trainer's current fp32 master. Each token's
weight is the ratio of the current policy's probability over the behaviour probability the
replica sent, truncated at ``cap`` from above (truncated importance sampling, as in
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", Yao et al. 2025): the
weight multiplies the REINFORCE term and carries no gradient itself. Without the weights the
loss is plain on-policy REINFORCE applied to off-policy data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PolicyLoss", "group_advantages", "truncated_importance_loss"]

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``(r - mean(r)) / (std(r) + eps)`` over one group's rewards ``[G]`` (population std)."""
    rewards = rewards.to(torch.float32)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + ADVANTAGE_EPS)


@dataclass(frozen=True)
class PolicyLoss:
    """One step's loss and the importance weights it used."""

    loss: torch.Tensor
    ratios: torch.Tensor
    """Every real token's untruncated ratio ``exp(current - behaviour)``."""
    clipped: int
    """Tokens whose ratio exceeded the cap (with weights on, truncated to it)."""


def truncated_importance_loss(
    current: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    importance_weights: bool = True,
) -> PolicyLoss:
    """``-sum(w * A * log pi(token)) / tokens`` over the real tokens.

    Args:
        current: ``[B, T]`` log-probabilities of the sampled tokens under the policy being
            trained (with gradient).
        behaviour: ``[B, T]`` those the replica sampled them with.
        advantages: ``[B]``, one per sequence.
        mask: ``[B, T]`` bool, the real tokens.
        cap: the truncation of the weights (``w = min(ratio, cap)``).
        importance_weights: ``False``: ``w = 1`` (ratios still reported).
    """
    if cap <= 0:
        raise ValueError(f"the importance weight cap must be positive, got {cap}")
    real = mask.to(torch.float32)
    log_ratio = (current.detach() - behaviour).masked_fill(~mask, 0.0)
    ratios = log_ratio.exp()
    weights = ratios.clamp(max=cap) if importance_weights else torch.ones_like(ratios)
    per_token = weights * advantages.unsqueeze(1) * current * real
    loss = -per_token.sum() / real.sum().clamp(min=1.0)
    real_ratios = ratios[mask]
    return PolicyLoss(loss, real_ratios, int((real_ratios > cap).sum()))
