"""The learner: an fp32 master copy of the policy, AdamW, and the served copy it ships.

:class:`PolicyLearner` holds the policy's weights in float32 (the master, which the optimizer
updates: the tiny torch LM, or any :class:`~rollout_sync.learn.models.PolicyModel` such as a
transformers Llama) and a copy in the served dtype (bfloat16 by default): the tensors the
trainer pushes to the replicas, rewritten from the master after every step, and the count of
their elements that changed (what a delta sync would ship). A step scores each rollout with the
task's reward (from the tokens the replica generated), computes group-relative advantages,
recomputes every generated token's log-probability under the master at the replicas'
temperature, and takes one AdamW step on the truncated importance-weighted loss
(:mod:`rollout_sync.learn.loss`). :meth:`PolicyLearner.next_token_step` takes an AdamW step on a
plain next-token loss instead (pretraining-like steps on given tokens, for a trainer with no
task: ``rollout-sync demo --delta``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends.torch_lm import TinyCausalLM, TinyLMConfig
from .loss import group_advantages, truncated_importance_loss
from .models import PolicyModel, TinyLMPolicy
from .rollouts import Rollout
from .task import TokenSetTask

__all__ = ["LearnerStep", "PolicyLearner", "TokenStep", "sequence_logprobs"]


def _policy(model: PolicyModel | TinyCausalLM) -> PolicyModel:
    if isinstance(model, PolicyModel):
        return model
    if isinstance(model, TinyCausalLM):
        return TinyLMPolicy(model)
    raise TypeError(
        f"the learner computes log-probabilities of a PolicyModel (TinyLMPolicy, "
        f"CausalLMPolicy) or a TinyCausalLM, not {type(model).__name__}: wrap a transformers "
        "causal LM in rollout_sync.learn.models.CausalLMPolicy"
    )


def sequence_logprobs(
    model: PolicyModel | TinyCausalLM,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability under ``model`` given its prompt and the tokens
    before it, at ``temperature``: ``([B, T] float32, [B, T] bool mask of real tokens)``, ``T``
    the longest completion. One forward over the whole batch (no cache)."""
    if temperature <= 0:
        raise ValueError(f"log-probabilities of samples need a temperature above 0: {temperature}")
    policy = _policy(model)
    rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    batch, width = len(rows), max(len(r) for r in rows)
    if width > policy.max_seq_len:
        raise ValueError(f"a sequence of {width} tokens exceeds max_seq_len {policy.max_seq_len}")
    tokens = torch.zeros(batch, width, dtype=torch.long)
    real = torch.zeros(batch, width, dtype=torch.bool)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
        real[b, : len(row)] = True
    logits = policy.logits(tokens, real)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    longest = max(len(c) for c in completions)
    out = torch.zeros(batch, longest)
    mask = torch.zeros(batch, longest, dtype=torch.bool)
    for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        n, start = len(completion), len(prompt)
        # The logits at position i predict the token at i + 1.
        picked = logp[b, start - 1 : start - 1 + n].gather(1, torch.tensor(completion).unsqueeze(1))
        out[b, :n] = picked.squeeze(1)
        mask[b, :n] = True
    return out, mask


@dataclass(frozen=True)
class LearnerStep:
    """What one training step did."""

    reward: float
    """Mean reward of the rollouts trained on."""
    loss: float
    sequences: int
    tokens: int
    ratios: list[float]
    """Every token's importance ratio (current over behaviour, untruncated)."""
    clipped: int
    changed_fraction: float
    """Elements of the served copy that changed (bit for bit) with this step."""


@dataclass(frozen=True)
class TokenStep:
    """What one next-token step (:meth:`PolicyLearner.next_token_step`) did."""

    loss: float
    """Mean cross-entropy of the tokens predicted, before the step."""
    tokens: int
    """Tokens predicted (each sequence's length less one, summed)."""
    changed_fraction: float
    """Elements of the served copy that changed (bit for bit) with this step."""


class PolicyLearner:
    """An fp32 master of the policy, AdamW on it, and the served-dtype copy.

    ``model`` is the tiny LM's config (its master is built from ``model.seed``) or a
    :class:`~rollout_sync.learn.models.PolicyModel` holding the float32 master itself (a
    transformers Llama: :class:`~rollout_sync.learn.models.CausalLMPolicy`). ``served`` are
    the tensors to push (named like the master's parameters, which are the replicas' names, in
    ``served_dtype``); they hold version 0 (the master as built, cast) until the first
    :meth:`step`. ``lr == 0`` freezes the policy (a counterfactual: same loop, no learning).
    """

    def __init__(
        self,
        model: TinyLMConfig | PolicyModel,
        *,
        task: TokenSetTask,
        lr: float,
        served_dtype: torch.dtype = torch.bfloat16,
        temperature: float = 1.0,
        importance_cap: float = 2.0,
        importance_weights: bool = True,
    ) -> None:
        if lr < 0:
            raise ValueError(f"the learning rate must be at least 0, got {lr}")
        self.task = task
        self.temperature = temperature
        self.importance_cap = importance_cap
        self.importance_weights = importance_weights
        self.policy = TinyLMPolicy.build(model) if isinstance(model, TinyLMConfig) else model
        if not isinstance(self.policy, PolicyModel):
            raise TypeError(
                f"PolicyLearner trains a TinyLMConfig's model or a PolicyModel, not "
                f"{type(model).__name__}"
            )
        self.master = self.policy.module.train()
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        self.served: dict[str, torch.Tensor] = {
            name: param.detach().to(served_dtype).clone()
            for name, param in self.master.named_parameters()
        }

    @property
    def served_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.served.values())

    def step(self, groups: Sequence[Sequence[Rollout]]) -> LearnerStep:
        """One AdamW step on ``groups`` (each the samples of one prompt), then the served copy
        rewritten from the master.

        Raises:
            ValueError: no group, or a group of fewer than two samples.
        """
        if not groups or any(len(g) < 2 for g in groups):
            raise ValueError("a step needs at least one group of at least two samples")
        rollouts = [r for g in groups for r in g]
        rewards = [self.task.reward(r.prompt, r.tokens) for r in rollouts]
        advantages = torch.cat(
            [
                group_advantages(torch.tensor(rewards[i : i + len(g)]))
                for i, g in zip(_offsets(groups), groups, strict=True)
            ]
        )
        prompts, completions = [r.prompt for r in rollouts], [r.tokens for r in rollouts]
        current, mask = sequence_logprobs(self.policy, prompts, completions, self.temperature)
        behaviour = torch.zeros_like(current)
        for b, r in enumerate(rollouts):
            behaviour[b, : len(r.tokens)] = r.behaviour_logprobs
        result = truncated_importance_loss(
            current,
            behaviour,
            advantages,
            mask,
            cap=self.importance_cap,
            importance_weights=self.importance_weights,
        )
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        self.optimizer.step()
        return LearnerStep(
            reward=sum(rewards) / len(rewards),
            loss=float(result.loss.detach()),
            sequences=len(rollouts),
            tokens=int(mask.sum()),
            ratios=result.ratios.tolist(),
            clipped=result.clipped,
            changed_fraction=self._refresh_served(),
        )

    def next_token_step(self, tokens: torch.Tensor) -> TokenStep:
        """One AdamW step on the next-token loss of ``tokens`` (``[B, W]`` int64, every row
        real: position ``i`` predicts token ``i + 1``), then the served copy rewritten from the
        master. The same optimizer as :meth:`step`: the steps of a pretraining-like trainer,
        whose changed fractions are what a delta sync of real training ships.

        Raises:
            ValueError: ``tokens`` is not ``[B, W]`` integers with ``W >= 2`` and ``W`` within
                the model's context, or holds an id outside its vocabulary.
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"next_token_step takes [batch, width] integer token ids, not a "
                f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}"
            )
        batch, width = tokens.shape
        if batch < 1 or not 2 <= width <= self.policy.max_seq_len:
            raise ValueError(
                f"next_token_step needs at least one row of 2..{self.policy.max_seq_len} tokens "
                f"(max_seq_len), got shape {tuple(tokens.shape)}"
            )
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.policy.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.policy.vocab_size}) (vocab_size), got "
                f"{int(tokens.min())}..{int(tokens.max())}"
            )
        tokens = tokens.long()
        real = torch.ones(batch, width - 1, dtype=torch.bool)
        logits = self.policy.logits(tokens[:, :-1], real)
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return TokenStep(
            loss=float(loss.detach()),
            tokens=batch * (width - 1),
            changed_fraction=self._refresh_served(),
        )

    @torch.no_grad()
    def _refresh_served(self) -> float:
        changed = total = 0
        for name, param in self.master.named_parameters():
            served = self.served[name]
            new = param.detach().to(served.dtype)
            changed += int((_bits(new) != _bits(served)).sum())
            total += served.numel()
            served.copy_(new)
        return changed / total if total else 0.0


_SAME_SIZE_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (so -0.0 differs from 0.0, NaN
    equals itself)."""
    return tensor.view(_SAME_SIZE_INTEGER[tensor.element_size()])


def _offsets(groups: Sequence[Sequence[Rollout]]) -> list[int]:
    out, at = [], 0
    for group in groups:
        out.append(at)
        at += len(group)
    return out
