"""A declarative fault schedule for multi-process tests: "rank r dies at point p, step s".

A test states its faults up front and hands them to
:func:`~rollout_sync.testing.run_processes` (or :func:`~rollout_sync.testing.run_group`); the
children's code marks where a fault may strike with :func:`fault_point` (or passes
:func:`transfer_fault_hooks` to a transfer), and the harness does the rest: the named rank dies
there, and its exit is expected rather than reported as a failure. A child run without a
schedule, and any process outside the harness, passes every fault point untouched.

Modelled on torchft's fault injector: the schedule is data, the test reads as its scenario.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch

from ..transfer import TransferHooks

__all__ = ["FaultSchedule", "Kill", "fault_point", "transfer_fault_hooks"]

KILLED_EXIT_CODE = 17
"""The exit code a :class:`Kill` uses unless it names one."""


@dataclass(frozen=True)
class Kill:
    """Process ``rank`` dies at ``point`` on step ``step``: ``os._exit(exit_code)``, so no
    ``finally`` runs and its connections drop as a crashed process's do.

    For a point that passes its own index (a bucket's, for :func:`transfer_fault_hooks`),
    ``step`` is that index: the first pass with it strikes. For a point passed without one, it
    is how many times this process passed the point before (0: the first time).

    Raises:
        ValueError: a negative rank or step, an empty point, or exit code 0 (a clean exit).
    """

    rank: int
    point: str
    step: int = 0
    exit_code: int = KILLED_EXIT_CODE

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0 or not self.point:
            raise ValueError(f"{self}: needs a rank >= 0, a step >= 0 and a named point")
        if self.exit_code == 0:
            raise ValueError(f"{self}: exit code 0 is a clean exit, not a death")


class FaultSchedule:
    """The faults of one run: at most one :class:`Kill` per rank (a process dies once)."""

    def __init__(self, *kills: Kill) -> None:
        ranks = [kill.rank for kill in kills]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a process dies once: two kills name the same rank in {kills}")
        self.kills = kills

    def __repr__(self) -> str:
        return f"FaultSchedule({', '.join(map(repr, self.kills))})"

    @property
    def expected_exits(self) -> dict[int, int]:
        """``rank -> exit code`` of every process this schedule kills."""
        return {kill.rank: kill.exit_code for kill in self.kills}

    def for_rank(self, rank: int) -> Kill | None:
        """The kill scheduled for process ``rank``, if any."""
        return next((kill for kill in self.kills if kill.rank == rank), None)


# -- inside a child ------------------------------------------------------------------------------

_kill_here: Kill | None = None
_passes: Counter[str] = Counter()


def install(schedule: FaultSchedule | None, rank: int) -> None:
    """Arm this process's kill, if the schedule has one for ``rank`` (the harness calls this
    in each child before the target runs)."""
    global _kill_here
    _kill_here = schedule.for_rank(rank) if schedule is not None else None
    _passes.clear()


def fault_point(point: str, step: int | None = None) -> None:
    """Mark a place a fault may strike: die here if this process's :class:`Kill` says so.

    ``step`` is the point's own index (a bucket's, a round's); without one the point counts
    its passes. A no-op in a process the harness did not arm.
    """
    kill = _kill_here
    if kill is None or kill.point != point:
        return
    if step is None:
        step = _passes[point]
        _passes[point] += 1
    if step == kill.step:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(kill.exit_code)


def transfer_fault_hooks() -> TransferHooks:
    """:class:`~rollout_sync.transfer.TransferHooks` whose ``after_pack`` and ``after_receive``
    are fault points of those names, stepped by bucket index: ``Kill(r, "after_pack", 3)`` kills
    rank ``r`` after it packed bucket 3 of a send, before the bucket leaves."""

    def after_pack(bucket: int, flat: torch.Tensor) -> None:
        fault_point("after_pack", bucket)

    def after_receive(bucket: int, flat: torch.Tensor) -> None:
        fault_point("after_receive", bucket)

    return TransferHooks(after_pack=after_pack, after_receive=after_receive)
