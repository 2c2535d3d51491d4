"""The install-strategy contract: what every way of landing a version provides, and what it
reads of the receiver that owns it.

A strategy (:class:`InstallStrategy`) takes one receiver's weight-sync commands: it receives a
version into its target (the served tensors, a staging copy, a buffer), sends from it as the
R2R source, installs what is pending, discards what a recovery voids, closes, and reports its
memory. It reads its receiver through :class:`SyncHost` (the transfers, the guard's settings)
and writes the engine through the receiver's :class:`~rollout_sync.sync.slot.EngineSlot`. The
wire (:class:`SupportsWeightTransfer`) is the transfer's: the strategy hands it a target.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from typing_extensions import Self, get_protocol_members

from ..backend import RolloutBase
from ..errors import RolloutSyncError
from ..guard import SyncReport, WeightSyncBracket, reported_bracket
from ..lora import require_adapter
from ..staging import StagingArea, check_two_communicators
from ..trace import Timeline
from ..transfer import OriginChecksums, TransferStats
from ..transfer.delta_sync import DeltaTarget, DigestCache, EncodedDelta
from .mode import SyncMode
from .slot import EngineSlot, reload_received

__all__ = [
    "InstallStrategy",
    "StrategyStatistics",
    "SupportsWeightTransfer",
    "SyncHost",
    "Target",
    "check_transfer",
    "recorded",
    "takes_deltas",
]


@runtime_checkable
class SupportsWeightTransfer(Protocol):
    """One rank's side of a weight transfer, as the worker drives it: what P2R and R2R take.

    :class:`~rollout_sync.WeightTransfer` is the implementation; a fake of your own (an
    in-process wire, a recording transfer) qualifies by having these members. The worker calls
    ``receive`` into the served tensors (or an async-mode buffer) on a receiving rank, ``send``
    on the source, ``relay`` for ``P2R(relay=True)`` (passing each bucket on through its R2R
    transfer, of the same kind), and ``abort`` on a source that cannot send, so that its
    receivers fail at once instead of at their limit. A failed ``receive`` raises a
    :class:`~rollout_sync.transfer.WeightTransferError` saying how many tensors it wrote.
    ``verify`` (optional for a transfer of your own: one whose ``receive`` lacks it is not
    given it) checks what landed before the commit vote.
    """

    @property
    def is_source(self) -> bool:
        """Whether this rank sends (the R2R source replica, the trainer of a P2R)."""
        ...

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = ...,
        write_kind: str = ...,
        storage: torch.Tensor | None = ...,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = ...,
    ) -> TransferStats: ...

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: Self,
        *,
        allow_subset: bool = ...,
        write_kind: str = ...,
        storage: torch.Tensor | None = ...,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = ...,
    ) -> TransferStats: ...

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = ...,
        origin: OriginChecksums | None = ...,
        storage: torch.Tensor | None = ...,
    ) -> TransferStats: ...

    def abort(self, reason: str, *, version: int | None = ...) -> None: ...


def recorded(bracket: WeightSyncBracket, stats: TransferStats) -> TransferStats:
    """``stats``, after saying in ``bracket``'s report what its transfer moved."""
    bracket.record_transfer(stats)
    return stats


def takes_deltas(transfer: object) -> bool:
    """Whether ``transfer`` moves delta syncs: its class says so (``delta_syncs = True``: a
    :class:`~rollout_sync.WeightTransfer`, a tree relay and a sharded transfer do; the Fast-LLM
    stream moves whole versions; a transfer of your own need not)."""
    return bool(getattr(transfer, "delta_syncs", False))


def check_transfer(name: str, transfer: object, owner: str = "RolloutWorker") -> None:
    """Refuse, at construction, a transfer the strategies could not drive."""
    if transfer is not None and not isinstance(transfer, SupportsWeightTransfer):
        members = sorted(get_protocol_members(SupportsWeightTransfer))
        missing = [m for m in members if not hasattr(transfer, m)]
        raise TypeError(
            f"{owner}({name}=...) needs a weight transfer (a WeightTransfer, or an object "
            f"with the members of rollout_sync.worker.SupportsWeightTransfer); "
            f"{type(transfer).__name__} lacks {missing}"
        )


@dataclass(frozen=True)
class Target:
    """What a sync command writes: the model's weights (``adapter`` None) or one LoRA
    adapter's slot."""

    adapter: str | None = None
    step: int | None = field(default=None, compare=False)
    """The command's step (for messages about a version whose number never arrived)."""

    @classmethod
    def of(cls, command: object) -> Target:
        return cls(getattr(command, "adapter", None), getattr(command, "step", None))

    def served(self, rollout: RolloutBase) -> Mapping[str, torch.Tensor]:
        if self.adapter is None:
            return rollout.served_weights()
        return require_adapter(rollout, self.adapter).served_adapter(self.adapter)

    def version(self, rollout: RolloutBase) -> int:
        if self.adapter is None:
            return rollout.weight_version
        return require_adapter(rollout, self.adapter).adapter_version(self.adapter)

    def verify_kwargs(
        self, rollout: RolloutBase, transfer: SupportsWeightTransfer
    ) -> dict[str, Any]:
        """What a staged receive checks before its commit vote: an adapter's ``lora_alpha``
        (data no manifest describes), so a set every replica would refuse at install is voted
        down and the trainer never sees success for it. A transfer written before ``verify``
        existed is not given it (the install still refuses the set, after the vote)."""
        if self.adapter is None or "verify" not in inspect.signature(transfer.receive).parameters:
            return {}
        config = require_adapter(rollout, self.adapter).adapter_config(self.adapter)
        context = f"adapter {self.adapter!r}"
        return {"verify": lambda staged: config.check_alpha(staged, context=context)}

    def staging(self, rollout: RolloutBase, device: torch.device | str | None) -> StagingArea:
        if self.adapter is None:
            return StagingArea.of(rollout, device=device)
        return StagingArea(self.served(rollout), device=device)

    def __str__(self) -> str:
        return "the weights" if self.adapter is None else f"adapter {self.adapter!r}"


class SyncHost(Protocol):
    """What a strategy reads of the receiver that owns it (:class:`~rollout_sync.RolloutWorker`,
    the Fast-LLM receiver): its transfers, the guard's settings (it is the
    :class:`~rollout_sync.guard.WeightSyncWorker` the bracket reads) and its checks."""

    rollout: RolloutBase
    p2r_barrier: Callable[[float], None] | None
    timeline: Timeline | None
    weight_sync_timeout: float
    allow_subset: bool
    staging_device: torch.device | str | None
    all_or_none: bool
    last_weight_sync_report: SyncReport | None

    @property
    def p2r(self) -> SupportsWeightTransfer | None: ...

    @property
    def r2r(self) -> SupportsWeightTransfer | None: ...

    @property
    def weight_sync_mode(self) -> SyncMode: ...

    @property
    def guarded(self) -> bool: ...

    def payload_egress_components(self) -> Sequence[object]: ...

    def on_weight_sync_report(self, report: SyncReport) -> None: ...

    def weight_sync_fence(self, timeout: float | None) -> None: ...


@dataclass(frozen=True)
class StrategyStatistics:
    """A strategy's memory and what it threw away (``WorkerStatistics`` adds them up)."""

    staging_bytes: int = 0
    staged_discarded: int = 0


class InstallStrategy(abc.ABC):
    """How one receiver's versions land; subclasses are one per :class:`SyncMode` (the
    table: :data:`~rollout_sync.sync.STRATEGIES`).

    The receiving methods take the command and return the handler's value (a
    :class:`~rollout_sync.transfer.TransferStats`, or a future in the async modes); each runs
    the whole sync, its bracket included. Shared wire steps (the P2R barrier, the relay's
    target, keeping the trainer's checksums, sending) are written here once.
    """

    modes: ClassVar[tuple[SyncMode, ...]]
    """The modes this strategy serves."""

    def __init__(self, host: SyncHost, slot: EngineSlot) -> None:
        self.host = host
        self.slot = slot
        self.origin: OriginChecksums | None = None
        """The trainer's bucket checksums of the last P2R, for the R2R that passes it on."""
        self.digests = DigestCache()
        """Digests of the served weights, for delta syncs (taken once after a whole sync)."""
        self.last_delta: EncodedDelta | None = None
        """The delta the last P2R brought, for the R2R that passes it on."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.host.weight_sync_mode.value}>"

    # -- the contract ----------------------------------------------------------------------

    @abc.abstractmethod
    def p2r(self, command: Any, forward: SupportsWeightTransfer | None) -> Any:
        """Receive the trainer's version (relaying it through ``forward`` if given)."""

    @abc.abstractmethod
    def r2r_receive(self, command: Any) -> Any:
        """Receive the R2R source's version."""

    @abc.abstractmethod
    def r2r_send(self, command: Any) -> Any:
        """Broadcast this replica's version (or the one it holds pending) to the others."""

    @abc.abstractmethod
    def receive(self, transfer: SupportsWeightTransfer, name: str) -> TransferStats:
        """Receive a version from ``transfer`` into this strategy's target and land it, in a
        bracket of its own named ``name`` (for a receiver of another wire: the Fast-LLM
        receiver's stream)."""

    def reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """Take part in a recovery's re-seed transfer: send the served version as its source,
        else receive it in place, parked (it lands whole or tears), whatever the mode: a
        replica being re-seeded serves nothing worth keeping. The async modes' strategy runs it
        on its weight-sync thread instead."""
        if transfer.is_source:
            with self.bracket("_send_reseed", pause=False, hold=True):
                return self.send(transfer, self.served_to_send)
        with self.bracket("_receive_reseed", pause=True, hold=True):
            return self.receive_in_place(transfer)

    def discard(self) -> None:
        """Throw away what is pending: the groups it came over are gone (a recovery)."""
        self.origin = None

    def close(self, timeout: float) -> None:  # noqa: B027 - optional: most hold no thread
        """Stop what the strategy runs of its own (a thread), within ``timeout``."""

    def statistics(self) -> StrategyStatistics:
        return StrategyStatistics()

    def transferred(self, command: Any, stats: TransferStats) -> Mapping[str, torch.Tensor]:
        """The tensors a successful command's transfer wrote or read (``on_transfer``)."""
        return Target.of(command).served(self.host.rollout)

    def check_transfers(self, transfers: Sequence[object]) -> None:
        """The NCCL rule for this strategy's receives (the host's mode says where they run).

        Raises:
            TwoCommunicatorsRefused: a receive beside NCCL forwards would run over NCCL.
        """
        check_two_communicators(self.host.rollout, transfers, self.host.weight_sync_mode)

    # -- shared steps ----------------------------------------------------------------------

    def relay_target(self, command: Any) -> SupportsWeightTransfer | None:
        """The R2R transfer a ``P2R(relay=True)`` passes the weights on through."""
        if not getattr(command, "relay", False):
            return None
        r2r = self.host.r2r
        if r2r is None or not r2r.is_source:
            raise RolloutSyncError(
                "P2R(relay=True) on a worker that is not the R2R source: only the replica that "
                "receives from the trainer and broadcasts R2R can relay"
            )
        return r2r

    def meet_trainer(self, forward: SupportsWeightTransfer | None) -> None:
        """The P2R barrier, inside the bracket: from here on this replica sends no payload
        until the sync ends, so the trainer may hold its receives. A relay whose barrier fails
        tells its leaves (already waiting for the R2R manifest) that no version is coming, so
        they fail at once instead of at their limit."""
        barrier = self.host.p2r_barrier
        if barrier is None:
            return
        try:
            barrier(self.host.weight_sync_timeout)
        except Exception as exc:
            if forward is not None:
                forward.abort(f"the relay's P2R barrier failed: {type(exc).__name__}")
            raise

    def keep_origin(self, stats: TransferStats) -> None:
        """Remember the trainer's bucket checksums, for a later R2R to pass on."""
        if stats.bucket_checksums is not None:
            self.origin = OriginChecksums(stats.version, stats.layout, stats.bucket_checksums)

    def delta_target(self, target: Target, *, apply: bool) -> DeltaTarget | None:
        """This replica's side of a delta sync into ``target``: its served weights, the
        version they hold (none while torn: a delta is then answered with a vote for the whole
        version) and their digests; ``apply``: write during the receive (in place), else keep
        it pending for the install. ``None`` for an adapter (they go whole)."""
        if target.adapter is not None:
            return None
        rollout = self.host.rollout
        version = None if rollout.weights_torn else rollout.weight_version
        return DeltaTarget(rollout.served_weights(), version, self.digests, apply=apply)

    def take(
        self,
        transfer: SupportsWeightTransfer,
        forward: SupportsWeightTransfer | None,
        into: Any,
        *,
        allow_subset: bool | None = None,
        delta: DeltaTarget | None = None,
        **kwargs: Any,
    ) -> TransferStats:
        """Receive ``transfer`` into ``into``, relaying it through ``forward`` if given
        (``allow_subset``: default the host's). ``delta``: passed to a transfer that takes
        deltas (``receive(delta=...)``); one of your own that does not is not given it, and
        its senders go whole."""
        subset = self.host.allow_subset if allow_subset is None else allow_subset
        if delta is not None and takes_deltas(transfer):
            kwargs["delta"] = delta
        if forward is None:
            return transfer.receive(into, allow_subset=subset, **kwargs)
        return transfer.relay(into, forward, allow_subset=subset, **kwargs)

    def send(
        self,
        transfer: SupportsWeightTransfer,
        what: Callable[[], tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]],
    ) -> TransferStats:
        """Send ``what()`` (weights, version, storage) as ``transfer``'s source. If this side
        cannot (torn weights, nothing received yet), the receivers, who are waiting for a
        manifest, are told at once (the abort header) before the error is raised."""
        try:
            weights, version, storage = what()
        except Exception as exc:
            transfer.abort(f"the source cannot send: {type(exc).__name__}: {exc}")
            raise
        origin = self.origin if self.origin is not None and self.origin.version == version else None
        last = self.last_delta
        if last is not None and last.version == version and takes_deltas(transfer):
            # Pass on the delta the P2R brought: a receiver on another base asks for the
            # whole version, which goes from ``weights``.
            return transfer.send(  # type: ignore[call-arg]
                weights, version=version, origin=origin, storage=storage, delta=last
            )
        return transfer.send(weights, version=version, origin=origin, storage=storage)

    def served_to_send(
        self, target: Target = Target()
    ) -> tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]:
        """What is served of ``target`` (the weights, or an adapter), its version and flat
        storage; refused while the weights are torn."""
        rollout = self.host.rollout
        rollout.check_servable()
        if target.adapter is not None:
            lora = require_adapter(rollout, target.adapter)
            lora.check_adapter_servable(target.adapter)
            return target.served(rollout), target.version(rollout), None
        return rollout.served_weights(), rollout.weight_version, rollout.flat_weight_storage()

    def receive_in_place(
        self, transfer: SupportsWeightTransfer, forward: SupportsWeightTransfer | None = None
    ) -> TransferStats:
        """Receive into the served tensors (generation parked by the caller's bracket):
        committed whole, or settled by the slot (torn, unless the transfer proves nothing was
        written; a version that landed whole here commits even when the sync failed
        elsewhere)."""
        slot = self.slot
        slot.torn_park.check_thread("a receive")
        slot.ensure_engine()
        rollout = self.host.rollout
        served = rollout.served_weights()
        storage = rollout.flat_weight_storage()
        self.before_in_place_write()
        delta = self.delta_target(Target(), apply=True)
        try:
            stats = self.take(transfer, forward, served, storage=storage, delta=delta)
        except BaseException as exc:
            slot.settle(served, exc, self.host.weight_sync_timeout, transfer)
            raise
        reload_received(rollout, served)
        slot.landed(stats.version)
        self.keep_delta(stats, delta)
        return stats

    def keep_delta(self, stats: TransferStats, delta: DeltaTarget | None) -> None:
        """Remember the delta a receive brought (none after a whole one), to pass on."""
        received = None if delta is None else delta.received
        self.last_delta = received if stats.sync_kind == "delta" else None

    # -- the in-place bodies: InPlace's, and the worker's decorated handlers' in every mode --

    def receive_p2r(self, forward: SupportsWeightTransfer | None) -> TransferStats:
        """The trainer's version into the served tensors (relayed through ``forward``)."""
        assert self.host.p2r is not None
        self.meet_trainer(forward)
        stats = self.receive_in_place(self.host.p2r, forward)
        self.keep_origin(stats)
        return stats

    def receive_r2r(self) -> TransferStats:
        """The R2R source's version into the served tensors."""
        assert self.host.r2r is not None
        return self.receive_in_place(self.host.r2r)

    def send_r2r(self) -> TransferStats:
        """Broadcast the served version to the others."""
        assert self.host.r2r is not None
        return self.send(self.host.r2r, self.served_to_send)

    def before_in_place_write(self) -> None:  # noqa: B027 - a hook: only staging needs it
        """Called before an in-place receive writes the served tensors."""

    def bracket(
        self, name: str, *, pause: bool, hold: bool, mode: SyncMode | None = None
    ) -> AbstractContextManager[WeightSyncBracket]:
        """The host's bracket for one sync, its report delivered (the one way, in the guard)."""
        return reported_bracket(self.host, name, pause=pause, hold=hold, mode=mode)
