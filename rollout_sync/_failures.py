"""How one process of a group failed: the record :class:`~rollout_sync.errors.GroupProcessError`
carries. Not an exception, so it lives apart from them; import it from
:mod:`rollout_sync.errors` (or :mod:`rollout_sync.testing`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChildFailure"]


@dataclass(frozen=True)
class ChildFailure:
    """How one process of a group failed (carried by
    :class:`~rollout_sync.errors.GroupProcessError`)."""

    rank: int
    exitcode: int | None
    """``None``: still running when it was killed for overstaying (or not a local process)."""
    error: str
    """The process's formatted traceback, or what its launcher observed."""

    @classmethod
    def overstayed(
        cls, rank: int, *, past_limit: bool, limit_s: float, grace_s: float, group: str
    ) -> ChildFailure:
        """A process killed while still running: past the ``group``'s limit, or ``grace_s``
        after another process failed."""
        why = (
            f"killed after the {group}'s limit of {limit_s:.1f} s"
            if past_limit
            else f"killed {grace_s:.1f} s after another rank failed"
        )
        return cls(rank, None, f"still running: {why}")
