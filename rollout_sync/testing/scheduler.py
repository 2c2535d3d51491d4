"""The check-then-act admission race, rebuilt on purpose so that tests can show it is real."""

from __future__ import annotations

from ..scheduler import RolloutTaskScheduler

__all__ = ["CheckThenActScheduler"]


class CheckThenActScheduler(RolloutTaskScheduler):
    """A :class:`~rollout_sync.RolloutTaskScheduler` that admits the classic, unsafe way.

    It checks "no pause is held" *outside* the step's gate section and admits right after the
    check. A pause that lands in between finds no decode step running, parks at once, and the
    admitted task starts inside it: the race the production scheduler closes by admitting inside
    the gate section. Use it only to prove that a test can catch that race.
    """

    def _admit_before_section(self) -> int:
        if self.gate.held:
            return 0
        return self._admit()

    def _admit_in_section(self) -> int:
        return 0
