"""The engine's slot: the one object that starts and stops the engine, commits a version,
settles a failed receive and holds generation parked on torn weights.

Every receiver (the rollout worker, the Fast-LLM receiver) owns one :class:`EngineSlot` and every
install strategy writes through it, so the rules below hold whatever the strategy:

1. **Fail closed.** A failed in-place receive leaves the weights torn unless the transfer itself
   proves nothing was written (:func:`settle_failed_receive`).
2. **Torn weights are never served.** A background engine whose weights a receive tore stays
   parked (:class:`~rollout_sync.backend.TornWeightsPark`) until a complete version commits.
3. **A background engine starts inside its first sync**, after the version landed, so it
   begins with the new weights (parked, in place; serving, once a staged install is done).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..backend import RolloutBase, TornWeightsPark
from ..errors import ManifestError, WeightMismatchError, WeightTransferError
from .commit import version_to_install

__all__ = [
    "BackgroundEngine",
    "EngineSlot",
    "ProvesWrites",
    "reload_received",
    "settle_failed_receive",
]


@runtime_checkable
class BackgroundEngine(Protocol):
    """An engine that generates on its own once started (a stream scheduler, a threaded backend).

    The worker starts it inside the first sync's bracket (so it begins parked, with the new
    weights) and stops it in :meth:`RolloutWorker.close`.
    """

    def start(self) -> Any: ...

    def stop(self, timeout: float = ...) -> Any: ...


def reload_received(rollout: RolloutBase, served: Mapping[str, torch.Tensor]) -> None:
    """Hand tensors received in place into ``served`` to an engine that overrides
    ``load_weights`` (one that cannot serve the tensors it exposes). The default would find the
    same storage and copy nothing, after re-checking what the transfer already checked, so it
    is skipped."""
    if type(rollout).load_weights is not RolloutBase.load_weights:
        rollout.load_weights(served, require_all=False)


@runtime_checkable
class ProvesWrites(Protocol):
    """A transfer that can say, after its receive raised, that it wrote nothing into the
    target (one whose wire has errors of its own: the Fast-LLM stream)."""

    def wrote_nothing(self, error: BaseException) -> bool: ...


def settle_failed_receive(
    rollout: RolloutBase,
    served: Mapping[str, torch.Tensor],
    exc: BaseException,
    transfer: object = None,
) -> bool:
    """What an in-place receive into ``served`` that raised ``exc`` leaves behind (fail
    closed: only the transfer's own word clears a write).

    Every byte landed intact (a :class:`~rollout_sync.errors.WeightTransferError` that is
    ``complete``: the failure was another rank's): the version is whole, so it is reloaded and
    committed, and True returned. The transfer says nothing was written (its error's
    ``tensors_written`` is 0, or a :class:`~rollout_sync.errors.WeightMismatchError` or
    :class:`~rollout_sync.errors.ManifestError`, which the checks before any write raise):
    nothing changes. Anything else (tensors written, or an error of a type the transfer does not
    raise on purpose, which proves nothing) marks the weights torn, unless ``transfer`` proves
    it wrote nothing (:class:`ProvesWrites`). The caller raises ``exc`` either way.
    """
    if isinstance(transfer, ProvesWrites) and transfer.wrote_nothing(exc):
        return False
    if isinstance(exc, WeightTransferError):
        landed = version_to_install(exc, None, alone=True)  # in place: nothing to roll back
        if landed is not None:
            reload_received(rollout, served)
            rollout.commit_weight_version(landed)
            return True
        if exc.targets_torn:
            rollout.mark_weights_torn(
                f"{exc.tensors_written} tensor(s) of version {exc.version} were written before "
                f"the transfer failed: {type(exc).__name__}"
            )
        return False
    if not isinstance(exc, (WeightMismatchError, ManifestError)):
        rollout.mark_weights_torn(
            f"the receive failed with {type(exc).__name__} ({exc}), which does not say what "
            "was written: taken as written part-way"
        )
    return False


class EngineSlot:
    """``rollout``'s served slot, as its receiver (``owner``, for messages) drives it.

    Attributes:
        rollout: the engine.
        engine_started: whether this slot started a :class:`BackgroundEngine` (and will stop
            it).
        committed_at: ``time.time()`` of the last commit not yet taken by
            :meth:`take_committed_at` (``CommandResult.committed_at``).
    """

    def __init__(
        self, rollout: RolloutBase, owner: str, *, park_every_engine: bool = False
    ) -> None:
        self.rollout = rollout
        self.park_every_engine = park_every_engine
        """Keep any engine parked on torn weights, not only a :class:`BackgroundEngine` (a
        blocking engine's own calls already refuse torn weights)."""
        self.engine_started = False
        self.committed_at: float | None = None
        self.torn_park = TornWeightsPark(rollout, owner)
        """Parks a background engine from a receive that left its weights torn until a
        complete version commits (or :meth:`stop_engine`): it generates on its own, and need
        not look at ``weights_torn`` itself."""

    def __repr__(self) -> str:
        state = "started" if self.engine_started else "not started"
        return f"<EngineSlot {type(self.rollout).__name__} {state} v{self.rollout.weight_version}>"

    def ensure_engine(self) -> None:
        """Build the engine (once). Called inside the bracket by the first sync."""
        self.rollout.ensure_initialized()

    def start_engine(self) -> None:
        """Start a background engine after its first complete sync (inside the bracket, so in
        sync mode it begins parked and first generates with the new weights)."""
        if not self.engine_started and isinstance(self.rollout, BackgroundEngine):
            self.rollout.start()
            self.engine_started = True

    def stop_engine(self, timeout: float, *, what: str = "close()") -> None:
        """Let go a park on torn weights (an engine stops only unparked), then stop a
        background engine this slot started.

        Raises:
            RolloutSyncError: called on another thread than the one whose failed receive
                parked the engine (that thread must release the pause).
        """
        self.torn_park.check_thread(what)
        self.torn_park.release()
        if self.engine_started and isinstance(self.rollout, BackgroundEngine):
            self.engine_started = False
            self.rollout.stop(timeout)

    def landed(self, version: int | None = None) -> None:
        """A complete version is served now (committed by whoever wrote it, or here if
        ``version`` is given): note when, let go a torn park unless the weights are still
        torn (an adapter landed beside them), start a background engine."""
        if version is not None:
            self.rollout.commit_weight_version(version)
        self.committed_at = time.time()
        if not self.rollout.weights_torn:
            self.torn_park.release()
        self.start_engine()

    def take_committed_at(self) -> float | None:
        at, self.committed_at = self.committed_at, None
        return at

    def settle(
        self,
        served: Mapping[str, torch.Tensor],
        exc: BaseException,
        timeout: float,
        transfer: object = None,
    ) -> None:
        """After an in-place receive into ``served`` raised ``exc`` (inside the sync's bracket):
        commit a version that landed whole, else keep a background engine parked while its
        weights are torn (:func:`settle_failed_receive`)."""
        if settle_failed_receive(self.rollout, served, exc, transfer):
            self.landed()
        else:
            self.park_if_torn(timeout)

    def park_if_torn(self, timeout: float) -> None:
        """Keep generation parked while the weights are torn (inside the sync's pause), for a
        background engine (or any, with ``park_every_engine``)."""
        if self.park_every_engine or isinstance(self.rollout, BackgroundEngine):
            self.torn_park.hold_if_torn(timeout)
