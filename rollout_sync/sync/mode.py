"""How a sync reaches the served weights: :class:`SyncMode`, one member per install strategy.

A mode is chosen once per receiver (``RolloutWorker(mode=...)``) and picks its install strategy
(:data:`rollout_sync.sync.STRATEGIES`). Importable from :mod:`rollout_sync.guard` (its old home)
and from the package root.
"""

from __future__ import annotations

import enum

__all__ = ["SyncMode"]


class SyncMode(enum.Enum):
    """How a sync reaches the served weights."""

    SYNC = "sync"
    """Write the served tensors in place: generation is paused for the sync."""
    ASYNC_PER_GENERATION = "async_per_generation"
    """Write a buffer clone; it is installed before each generation call. No pause."""
    ASYNC_PER_FORWARD = "async_per_forward"
    """Write a buffer clone; it is installed before each policy forward. No pause."""
    STAGED = "staged"
    """Stage, then swap: a :class:`~rollout_sync.RolloutWorker` receives into a staging copy
    of the served weights while generation goes on (payload egress held), and pauses only to
    install it and commit the version; every replica of a sync installs or none does
    (:mod:`rollout_sync.staging`). A handler decorated with :func:`weight_sync_handler` on a
    worker in this mode is paused throughout, as in ``SYNC``: it may write the served tensors."""

    @property
    def pauses_generation(self) -> bool:
        """Whether the guard's decorators pause generation for a handler in this mode."""
        return self in (SyncMode.SYNC, SyncMode.STAGED)

    @property
    def is_async(self) -> bool:
        """An async mode: a weight buffer installed at the backend's own safe points."""
        return self in (SyncMode.ASYNC_PER_GENERATION, SyncMode.ASYNC_PER_FORWARD)
