"""The strategy table: which :class:`~rollout_sync.sync.contract.InstallStrategy` lands a
version for each :class:`~rollout_sync.sync.mode.SyncMode`. A new mode is a new module, its
member, and a row here."""

from __future__ import annotations

from collections.abc import Mapping

from .buffered import Buffered
from .contract import InstallStrategy
from .in_place import InPlace
from .mode import SyncMode
from .staged import Staged

__all__ = ["STRATEGIES", "strategy_for"]

STRATEGIES: Mapping[SyncMode, type[InstallStrategy]] = {
    SyncMode.SYNC: InPlace,
    SyncMode.STAGED: Staged,
    SyncMode.ASYNC_PER_GENERATION: Buffered,
    SyncMode.ASYNC_PER_FORWARD: Buffered,
}


def strategy_for(mode: SyncMode) -> type[InstallStrategy]:
    """The strategy class of ``mode``.

    Raises:
        ValueError: ``mode`` has no strategy (a member added without its row in the table).
    """
    try:
        return STRATEGIES[mode]
    except KeyError:
        raise ValueError(
            f"no install strategy for {mode!r}: add its module and its row to "
            "rollout_sync.sync.table.STRATEGIES"
        ) from None
