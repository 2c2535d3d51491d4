"""What the trainer learns from: the replicas' own rollouts, as they sent them, grouped.

A replica ships each finished generation as a payload (:func:`rollout_payload`): the prompt, the
completion, every token's behaviour log-probability (after temperature, as it was sampled) and
weight version, and the id of its group (the samples of one prompt). The trainer turns each
payload back into a :class:`Rollout` (:func:`rollout_from_payload`, refusing inconsistent ones)
and collects them in :class:`RolloutGroups` until a group is whole; a step takes whole groups,
oldest first, and drops the sequences too stale to learn from.

Staleness is counted per sequence, by its oldest token: ``trainer_version - min(versions)``. A
token's own version is not the whole story: its keys and values for every earlier token were
computed when those tokens were, under their (older) weights, so a sequence is as stale as its
oldest token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRollout

__all__ = [
    "GROUP_KEY",
    "InvalidRollout",
    "Rollout",
    "RolloutGroups",
    "TakenGroups",
    "rollout_from_payload",
    "rollout_payload",
]

GROUP_KEY = "group"
"""The payload metadata key naming a rollout's group."""


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt, as the replica generated it."""

    group: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    behaviour_logprobs: torch.Tensor
    """float32 ``[len(tokens)]``: each token's log-probability under the distribution it was
    sampled from (after temperature)."""
    versions: torch.Tensor
    """int64 ``[len(tokens)]``: the weight version each token was sampled under."""

    def staleness(self, trainer_version: int) -> int:
        """Versions behind ``trainer_version``, by the oldest token."""
        return trainer_version - int(self.versions.min())


def rollout_payload(
    group: str,
    prompt: Sequence[int],
    tokens: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata a replica registers with its payload sender for one rollout."""
    return (
        {
            "prompt": torch.tensor(list(prompt), dtype=torch.int64),
            "tokens": torch.tensor(list(tokens), dtype=torch.int64),
            "logprobs": torch.tensor(list(logprobs), dtype=torch.float32),
            "weight_versions": torch.tensor(list(versions), dtype=torch.int64),
        },
        {GROUP_KEY: group},
    )


def rollout_from_payload(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> Rollout:
    """The rollout a payload carries.

    Raises:
        InvalidRollout: a part is missing, the lengths disagree, a log-probability is not
            finite or above 0, or the group is not a non-empty string.
    """
    missing = [k for k in ("prompt", "tokens", "logprobs", "weight_versions") if k not in tensors]
    group = metadata.get(GROUP_KEY)
    if missing or not isinstance(group, str) or not group:
        raise InvalidRollout(
            f"a rollout payload carries prompt, tokens, logprobs, weight_versions and a "
            f"{GROUP_KEY!r}: missing {missing or [GROUP_KEY]}"
        )
    prompt, tokens = tensors["prompt"].reshape(-1), tensors["tokens"].reshape(-1)
    logprobs = tensors["logprobs"].reshape(-1).to(torch.float32)
    versions = tensors["weight_versions"].reshape(-1).to(torch.int64)
    if not prompt.numel() or not tokens.numel():
        raise InvalidRollout("a rollout needs a prompt and at least one generated token")
    if not logprobs.numel() == versions.numel() == tokens.numel():
        raise InvalidRollout(
            f"a rollout's tokens ({tokens.numel()}), logprobs ({logprobs.numel()}) and "
            f"weight_versions ({versions.numel()}) must have one entry per token"
        )
    if not bool(torch.isfinite(logprobs).all()) or bool((logprobs > 0).any()):
        raise InvalidRollout("a rollout's behaviour log-probabilities must be finite and <= 0")
    return Rollout(
        group, tuple(prompt.tolist()), tuple(tokens.tolist()), logprobs.clone(), versions.clone()
    )


@dataclass(frozen=True)
class TakenGroups:
    """What one training step takes: whole groups, fresh enough (what staleness dropped is
    counted on the :class:`RolloutGroups`)."""

    groups: list[list[Rollout]]
    staleness: list[int]
    """Of every sequence taken, versions behind the trainer."""


class RolloutGroups:
    """Rollouts collected into groups of ``group_size``; whole groups wait, oldest first.

    :meth:`take` drops, per sequence, what is more than ``max_staleness`` versions behind the
    trainer, and a group left with fewer than two sequences (nothing to compare a reward with).
    Not thread-safe: the trainer's loop owns it.
    """

    def __init__(self, group_size: int, max_staleness: int) -> None:
        if group_size < 2:
            raise ValueError(f"a group needs at least two samples, got group_size={group_size}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be at least 0, got {max_staleness}")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self._forming: dict[str, list[Rollout]] = {}
        self._whole: deque[list[Rollout]] = deque()
        self.sequences_dropped = 0
        self.tokens_dropped = 0

    def add(self, rollout: Rollout) -> None:
        members = self._forming.setdefault(rollout.group, [])
        members.append(rollout)
        if len(members) == self.group_size:
            self._whole.append(self._forming.pop(rollout.group))

    @property
    def whole(self) -> int:
        """Whole groups waiting (some may still be dropped as stale)."""
        return len(self._whole)

    def _drop_stale(self, trainer_version: int) -> None:
        kept: deque[list[Rollout]] = deque()
        for group in self._whole:
            fresh = [r for r in group if r.staleness(trainer_version) <= self.max_staleness]
            if len(fresh) < 2:
                fresh = []
            self.sequences_dropped += len(group) - len(fresh)
            self.tokens_dropped += sum(len(r.tokens) for r in group) - sum(
                len(r.tokens) for r in fresh
            )
            if fresh:
                kept.append(fresh)
        self._whole = kept

    def ready(self, count: int, trainer_version: int) -> bool:
        """Whether ``count`` groups fresh enough for ``trainer_version`` are waiting (the stale
        ones are dropped on the way)."""
        self._drop_stale(trainer_version)
        return len(self._whole) >= count

    def take(self, count: int, trainer_version: int) -> TakenGroups:
        """Up to ``count`` groups, oldest first, fresh enough for ``trainer_version``."""
        self._drop_stale(trainer_version)
        groups = [self._whole.popleft() for _ in range(min(count, len(self._whole)))]
        return TakenGroups(groups, [r.staleness(trainer_version) for g in groups for r in g])
