"""The learning loop's toy task: a verifiable reward a tiny model measurably learns in seconds.

A prompt is a task token ``t`` (one of :attr:`TokenSetTask.tasks`) followed by filler tokens;
each task names a disjoint set of :attr:`~TokenSetTask.set_size` target tokens; the reward of a
completion is the fraction of its tokens that fall in its task's set. A policy that ignores the
prompt scores the chance rate (``set_size / vocab_size``); one that reads the task token and
emits its set scores 1. The reward is computed from the tokens alone, in microseconds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TokenSetTask"]


@dataclass(frozen=True)
class TokenSetTask:
    """The task's shape. Task tokens are ``0 .. tasks - 1``; filler tokens are drawn from
    ``tasks .. first_target - 1``; task ``t``'s targets are ``first_target + t * set_size``
    onwards, ``set_size`` of them."""

    vocab_size: int = 128
    tasks: int = 4
    set_size: int = 8
    filler_tokens: int = 2
    first_target: int = 64

    def __post_init__(self) -> None:
        problems = []
        if self.tasks < 1 or self.set_size < 1 or self.filler_tokens < 0:
            problems.append("tasks and set_size must be at least 1, filler_tokens at least 0")
        if self.first_target <= self.tasks:
            problems.append(f"first_target ({self.first_target}) must leave filler tokens")
        if self.first_target + self.tasks * self.set_size > self.vocab_size:
            problems.append(
                f"{self.tasks} target sets of {self.set_size} from {self.first_target} do not "
                f"fit a vocabulary of {self.vocab_size}"
            )
        if problems:
            raise ValueError("invalid TokenSetTask: " + "; ".join(problems))

    @property
    def chance(self) -> float:
        """The expected reward of uniformly random tokens."""
        return self.set_size / self.vocab_size

    @property
    def prompt_length(self) -> int:
        return 1 + self.filler_tokens

    def prompt(self, rng: random.Random) -> tuple[int, ...]:
        """A prompt: a task token, then filler."""
        task = rng.randrange(self.tasks)
        filler = (rng.randrange(self.tasks, self.first_target) for _ in range(self.filler_tokens))
        return (task, *filler)

    def targets(self, task: int) -> range:
        """Task ``task``'s target tokens."""
        start = self.first_target + task * self.set_size
        return range(start, start + self.set_size)

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """The fraction of ``completion``'s tokens in the set of ``prompt``'s task (0 for an
        empty completion).

        Raises:
            ValueError: ``prompt`` does not start with a task token.
        """
        if not prompt or not 0 <= prompt[0] < self.tasks:
            raise ValueError(
                f"a prompt of this task starts with a task token in 0..{self.tasks - 1}, got "
                f"{tuple(prompt)[:1]}"
            )
        if not completion:
            return 0.0
        targets = self.targets(prompt[0])
        return sum(token in targets for token in completion) / len(completion)
