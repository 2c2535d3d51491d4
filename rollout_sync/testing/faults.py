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

import datetime
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..transfer import TransferHooks

__all__ = ["FaultSchedule", "Kill", "fault_point", "transfer_fault_hooks"]

KILLED_EXIT_CODE = 17
"""The exit code a :class:`Kill` uses unless it names one."""

AFTER_LIMIT_S = 30.0
"""How long a :class:`Kill` with ``after`` waits for that pass before it fails loudly."""

_PASSED_KEY = "rollout_sync/testing/fault_passed/"


@dataclass(frozen=True)
class Kill:
    """Process ``rank`` dies at ``point`` on step ``step``: ``os._exit(exit_code)``, so no
    ``finally`` runs and its connections drop as a crashed process's do.

    For a point that passes its own index (a bucket's, for :func:`transfer_fault_hooks`),
    ``step`` is that index: the first pass with it strikes. For a point passed without one, it
    is how many times this process passed the point before (0: the first time).

    ``after`` (``"point:step"``) orders the death after another process's pass of that fault
    point: the dying process waits there, at most :data:`AFTER_LIMIT_S`, until some other
    process of the job passed ``point`` at ``step`` (told through the job's default store, so
    only in a :func:`~rollout_sync.testing.run_group` child). ``Kill(1, "after_pack", 1,
    after="after_receive:0")`` kills a sender between two buckets of its receiver: the
    receiver took bucket 0, bucket 1 never comes. A race no more.

    Raises:
        ValueError: a negative rank or step, an empty point, exit code 0 (a clean exit), or an
            ``after`` not of the form ``"point:step"``.
    """

    rank: int
    point: str
    step: int = 0
    exit_code: int = KILLED_EXIT_CODE
    after: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0 or not self.point:
            raise ValueError(f"{self}: needs a rank >= 0, a step >= 0 and a named point")
        if self.exit_code == 0:
            raise ValueError(f"{self}: exit code 0 is a clean exit, not a death")
        if self.after is not None:
            point, _, step = self.after.rpartition(":")
            if not point or not step.isdigit():
                raise ValueError(f"{self}: after must be 'point:step', got {self.after!r}")


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
_awaited: frozenset[str] = frozenset()
"""The ``after`` passes some process's kill waits for: this process announces them."""
_passes: Counter[str] = Counter()


def install(schedule: FaultSchedule | None, rank: int) -> None:
    """Arm this process's kill, if the schedule has one for ``rank`` (the harness calls this
    in each child before the target runs)."""
    global _kill_here, _awaited
    _kill_here = schedule.for_rank(rank) if schedule is not None else None
    kills = schedule.kills if schedule is not None else ()
    _awaited = frozenset(k.after for k in kills if k.after is not None and k.rank != rank)
    _passes.clear()


def fault_point(point: str, step: int | None = None) -> None:
    """Mark a place a fault may strike: die here if this process's :class:`Kill` says so.

    ``step`` is the point's own index (a bucket's, a round's); without one the point counts
    its passes. A no-op in a process the harness did not arm.
    """
    kill = _kill_here
    if kill is None and not _awaited:
        return
    if step is None:
        step = _passes[point]
        _passes[point] += 1
    if f"{point}:{step}" in _awaited:
        try:
            dist.distributed_c10d._get_default_store().set(f"{_PASSED_KEY}{point}:{step}", "1")
        except RuntimeError:  # DistNetworkError too: the store's host is the process that
            pass  # waited for this and died before it answered; its kill is the point anyway
    if kill is None or kill.point != point or step != kill.step:
        return
    if kill.after is not None:
        store = dist.distributed_c10d._get_default_store()
        store.wait([f"{_PASSED_KEY}{kill.after}"], datetime.timedelta(seconds=AFTER_LIMIT_S))
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
