"""Stage, then swap: a copy of the served weights that a sync receives into while generation
goes on, installed under a pause that covers only the copy and the version commit.

A staged sync (:attr:`~rollout_sync.SyncMode.STAGED`) runs the whole transfer - manifest,
buckets, checksums, votes - into a :class:`StagingArea`, with payload egress held for its
collectives but generation running. Only a verified, complete version is installed: the
:class:`~rollout_sync.RolloutWorker` parks generation
(:meth:`~rollout_sync.guard.WeightSyncBracket.stalled`), copies the staging area into the
served tensors through the engine's own ``load_weights`` and commits the version. A transfer
that fails or is aborted never touches the served weights: nothing is torn, nothing needs
re-seeding.

**Every replica or none** (two-phase): the transfer's commit vote is an all-gather over every
rank of the sync, so each replica learns whether all of them staged the version whole. A
replica installs only if all voted yes; otherwise each keeps serving its old version and raises
:class:`~rollout_sync.errors.StagedCommitAborted`, naming the ranks that voted no.

**Memory**: one copy of the served weights per replica, on their device or (``device="cpu"``)
in host memory; :attr:`StagingArea.nbytes` says how much, and
:class:`~rollout_sync.worker.WorkerStatistics` reports it as ``staging_bytes``. A worker that
cannot afford it runs ``SyncMode.SYNC`` (in place, parked for the whole transfer).

**The NCCL rule**: a staged receive runs beside the engine's forwards. Where those forwards do
their own NCCL collectives (tensor parallelism) and the transfer is NCCL too, two communicators
would be in flight on one device at once: :func:`check_two_communicators` refuses that
configuration with :class:`~rollout_sync.errors.TwoCommunicatorsRefused`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .backend import RolloutBase
from .errors import TwoCommunicatorsRefused, WeightMismatchError
from .flat import FlatWeights
from .lora import require_adapter
from .sync.mode import SyncMode

__all__ = [
    "StagingArea",
    "StagingState",
    "check_two_communicators",
    "forward_collectives",
]


class StagingState(enum.Enum):
    """What a :class:`StagingArea` holds."""

    SERVED = "served"
    """An exact copy of the served weights (built so, or just installed)."""
    STAGED = "staged"
    """A complete, verified version not yet installed (:attr:`StagingArea.staged_version`)."""
    VOID = "void"
    """Unknown bytes: a receive is writing it, or one failed or was discarded."""


class StagingArea:
    """One copy of a replica's served weights, for staged syncs to receive into.

    The sync thread that receives is its only writer; the install reads it under the pause.
    The bytes are void while a receive writes them; :meth:`begin` first copies the served
    weights back in when they are void from an earlier failure, so that a subset sync
    (``trainable_only``) leaves the names it does not carry as they are served.

    Args:
        served: the served tensors to copy (names, shapes, dtypes kept).
        device: where the copy lives; default each tensor's own device. ``"cpu"`` stages
            through host memory (for a gloo transfer beside NCCL tensor-parallel forwards).
        flat: lay the copy out as :class:`~rollout_sync.flat.FlatWeights` (one buffer), so
            that a transfer receives into it without staging copies of its own
            (:attr:`storage`). Use it when the served weights are flat too.
    """

    def __init__(
        self,
        served: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        flat: bool = False,
    ) -> None:
        if not served:
            raise ValueError("a StagingArea needs at least one served tensor to copy")
        self.storage: torch.Tensor | None = None
        with torch.no_grad():
            if flat:
                copy = FlatWeights.copy_of(served, device=device)
                self.storage = copy.storage
                self.tensors: dict[str, torch.Tensor] = copy.tensors
            else:
                self.tensors = {
                    name: t.detach().to(device=device or t.device, copy=True)
                    for name, t in served.items()
                }
        self._nbytes = (
            int(self.storage.numel() * self.storage.element_size())
            if self.storage is not None
            else sum(t.numel() * t.element_size() for t in self.tensors.values())
        )
        self._state = StagingState.SERVED
        self._version: int | None = None
        self._receiving = False
        self.installs = 0
        """Versions installed from this area."""
        self.discarded = 0
        """Receives whose bytes were thrown away (failed, or voted down by another replica)."""
        self.refreshes = 0
        """Copies of the served weights taken again after a void receive."""

    @classmethod
    def of(cls, rollout: RolloutBase, *, device: torch.device | str | None = None) -> StagingArea:
        """The staging area for ``rollout``'s served weights: flat when the engine's are
        (:meth:`~rollout_sync.RolloutBase.flat_weight_storage`) and ``device`` is theirs."""
        served = rollout.served_weights()
        storage = rollout.flat_weight_storage()
        flat = storage is not None and (device is None or torch.device(device) == storage.device)
        return cls(served, device=device, flat=flat)

    def __repr__(self) -> str:
        held = f"v{self._version}" if self._state is StagingState.STAGED else self._state.value
        return f"<StagingArea {held}, {self.nbytes / 1e6:.2f} MB, {self.installs} installs>"

    @property
    def nbytes(self) -> int:
        """The memory the copy takes (fixed when it was made)."""
        return self._nbytes

    @property
    def state(self) -> StagingState:
        return self._state

    @property
    def staged_version(self) -> int | None:
        """The verified version waiting to be installed, or ``None``."""
        return self._version if self._state is StagingState.STAGED else None

    def begin(self, served: Mapping[str, torch.Tensor]) -> None:
        """Make the area ready for a receive, which may write any of it: the bytes are void
        from here until :meth:`staged`. If they were void already (an earlier receive failed
        or was discarded), the served weights are copied back in first. A staged version not
        yet installed is kept as the base of the next one (its bytes are newer than the
        served weights')."""
        if self._state is StagingState.VOID:
            with torch.no_grad():
                for name, tensor in self.tensors.items():
                    tensor.copy_(served[name])
            self.refreshes += 1
        self._state = StagingState.VOID
        self._version = None
        self._receiving = True

    def staged(self, version: int) -> None:
        """Record that a receive landed ``version`` here whole and verified."""
        self._state = StagingState.STAGED
        self._version = version
        self._receiving = False

    def discard(self) -> None:
        """Throw away what the area holds: a receive in progress or a staged version (counted
        in :attr:`discarded`), or the copy of the served weights (they are about to change
        under it: not counted)."""
        if self._receiving or self._state is StagingState.STAGED:
            self.discarded += 1
        self._state = StagingState.VOID
        self._version = None
        self._receiving = False

    def install_into(
        self,
        rollout: RolloutBase,
        *,
        adapter: str | None = None,
        fence: Callable[[], None] | None = None,
    ) -> int:
        """Copy the staged version into ``rollout``'s served tensors (or, with ``adapter``,
        into that LoRA adapter's slot), run ``fence`` (the copy's device work completes), and
        commit the version; returns it. Call with generation parked (the worker calls it inside
        :meth:`~rollout_sync.guard.WeightSyncBracket.stalled`).

        The copy goes through the engine's ``load_weights`` (``load_adapter``), which checks
        every name, shape and dtype before it writes and records the write as the engine
        records any.

        Raises:
            RuntimeError: nothing is staged.
            WeightMismatchError: the staged tensors do not fit the served ones; nothing was
                written (the staged version is thrown away).
            Whatever else the load or the fence raises. A failure part-way leaves the served
            weights torn (marked so; an engine's own ``load_weights`` may have marked them).
        """
        version = self.staged_version
        if version is None:
            raise RuntimeError(f"install_into: nothing is staged ({self!r})")
        what = "the weights" if adapter is None else f"adapter {adapter!r}"
        try:
            if adapter is None:
                rollout.load_weights(self.tensors, require_all=False)
            else:
                # A failed load tears the adapter's slot alone (the engine's own bookkeeping:
                # SupportsLoRA.check_adapter_servable); the model's weights serve on.
                require_adapter(rollout, adapter).load_adapter(adapter, self.tensors)
        except BaseException as exc:
            changed_nothing = (
                isinstance(exc, WeightMismatchError) or getattr(exc, "torn", None) is False
            )
            if adapter is None and not rollout.weights_torn and not changed_nothing:
                rollout.mark_weights_torn(
                    f"installing staged version {version} of {what} failed part-way: "
                    f"{type(exc).__name__}: {exc}"
                )
            self.discard()
            raise
        if fence is not None:
            try:
                fence()
            except BaseException as exc:
                # The device did not finish the copy: what it holds is unknown.
                rollout.mark_weights_torn(
                    f"the install of staged version {version} of {what} did not complete on "
                    f"the device: {type(exc).__name__}: {exc}"
                )
                self.discard()
                raise
        if adapter is None:
            rollout.commit_weight_version(version)
        else:
            require_adapter(rollout, adapter).commit_adapter_version(adapter, version)
        self._state = StagingState.SERVED
        self._version = None
        self.installs += 1
        return version


def forward_collectives(rollout: object) -> frozenset[str]:
    """The backends of the collectives ``rollout``'s forwards run (tensor parallelism), as its
    ``forward_collectives()`` declares them; empty when it declares none."""
    declared = getattr(rollout, "forward_collectives", None)
    if declared is None:
        return frozenset()
    return frozenset(str(b).lower() for b in declared())


def transfer_backend(transfer: object) -> str | None:
    """A weight transfer's process-group backend (``"gloo"``, ``"nccl"``), if it says."""
    backend = getattr(transfer, "backend", None)
    return None if backend is None else str(backend).lower()


_REMEDY = (
    "Choose mode=SyncMode.SYNC (the receive runs with generation parked), or build the weight "
    "transfer over a gloo group (staging through host memory: "
    "RolloutWorker(staging_device='cpu'))"
)


def check_two_communicators(
    rollout: object,
    transfers: Iterable[Any],
    mode: SyncMode,
    *,
    what: str = "RolloutWorker",
    remedy: str = _REMEDY,
) -> None:
    """Refuse a receive beside forwards that would put two NCCL communicators on one device.

    In ``SYNC`` mode the receive runs parked, so no forward collective is in flight beside it:
    always allowed. In ``STAGED`` and the async modes the receive runs while the engine
    generates: refused when the engine's forwards use NCCL collectives
    (:func:`forward_collectives`) and any of ``transfers`` runs over NCCL.

    ``what`` names the refused component in the message, ``remedy`` says what to choose
    instead (default: the rollout worker's choices).

    Raises:
        TwoCommunicatorsRefused: see above.
    """
    if mode is SyncMode.SYNC:
        return
    forwards = forward_collectives(rollout)
    if "nccl" not in forwards:
        return
    on_nccl = [t for t in transfers if t is not None and transfer_backend(t) == "nccl"]
    if on_nccl:
        raise TwoCommunicatorsRefused(
            f"{what}(mode={mode.value!r}): the receive would run over NCCL while "
            f"{type(rollout).__name__}'s forwards run their own NCCL collectives (tensor "
            "parallelism): two NCCL communicators in flight on one device at once, which can "
            f"deadlock or corrupt both. {remedy}"
        )
