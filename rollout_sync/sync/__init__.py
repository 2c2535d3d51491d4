"""How a received version becomes the served one: one install strategy per :class:`SyncMode`.

Two axes stay apart. **How a version lands** is the strategy, chosen once per receiver from its
mode (:data:`STRATEGIES`):

* :class:`~rollout_sync.sync.in_place.InPlace` (``SYNC``): the transfer writes the served
  tensors, generation paused throughout; a failure after a write tears them.
* :class:`~rollout_sync.sync.staged.Staged` (``STAGED``, and every LoRA adapter whatever the
  mode): the transfer writes a staging copy while generation goes on; generation parks only to
  install; every replica of the sync installs or none does.
* :class:`~rollout_sync.sync.buffered.Buffered` (the async modes): the transfer writes a
  :class:`~rollout_sync.WeightBuffer` on a weight-sync thread; the backend installs it at its
  own safe points.

**What the wire carries** is the transfer's business (whole tensors today, a delta encoding
next): a strategy hands its target to ``transfer.receive`` / ``relay`` and reads the outcome,
so an encoding composes with every strategy.

The pieces every strategy shares, each written once:

* :class:`~rollout_sync.sync.slot.EngineSlot`: the engine's slot (start and stop the engine,
  commit a version, settle a failed receive, reload what landed, the torn park).
* :func:`~rollout_sync.sync.commit.version_to_install`: the one place that turns a commit vote
  (a transfer's outcome) into install-or-discard.
* :func:`~rollout_sync.guard.reported_bracket`: the bracket, then its report delivered.
* :meth:`~rollout_sync.sync.contract.InstallStrategy.check_transfers`: the NCCL rule.

Adding a sync mode is one new module here (a subclass of
:class:`~rollout_sync.sync.contract.InstallStrategy`), its :class:`SyncMode` member, and its
entry in :data:`STRATEGIES` (docs/architecture.md walks through it).

This package's ``__init__`` imports :mod:`.mode` alone eagerly (the guard imports
:class:`SyncMode` from here); the rest is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .mode import SyncMode as SyncMode

if TYPE_CHECKING:
    from .buffered import Buffered as Buffered
    from .commit import version_to_install as version_to_install
    from .contract import InstallStrategy as InstallStrategy
    from .contract import SupportsWeightTransfer as SupportsWeightTransfer
    from .contract import SyncHost as SyncHost
    from .contract import Target as Target
    from .in_place import InPlace as InPlace
    from .slot import EngineSlot as EngineSlot
    from .staged import Staged as Staged
    from .table import STRATEGIES as STRATEGIES
    from .table import strategy_for as strategy_for

__all__ = [
    "STRATEGIES",
    "Buffered",
    "EngineSlot",
    "InPlace",
    "InstallStrategy",
    "Staged",
    "SupportsWeightTransfer",
    "SyncHost",
    "SyncMode",
    "Target",
    "strategy_for",
    "version_to_install",
]

_LAZY = {
    "Buffered": ".buffered",
    "version_to_install": ".commit",
    "InstallStrategy": ".contract",
    "SupportsWeightTransfer": ".contract",
    "SyncHost": ".contract",
    "Target": ".contract",
    "InPlace": ".in_place",
    "EngineSlot": ".slot",
    "Staged": ".staged",
    "STRATEGIES": ".table",
    "strategy_for": ".table",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
