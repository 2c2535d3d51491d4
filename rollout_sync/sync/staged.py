"""Staged (``SyncMode.STAGED``, and every LoRA adapter whatever the mode): stage, then swap.

The transfer writes a :class:`~rollout_sync.staging.StagingArea` (one per target: the weights,
each adapter) while generation goes on, payload egress held for its collectives; generation
parks only for the install (:meth:`~rollout_sync.guard.WeightSyncBracket.stalled`). The
transfer's commit vote decides for every replica of the sync
(:func:`~rollout_sync.sync.commit.version_to_install`): each installs, or none does and each
raises :class:`~rollout_sync.errors.StagedCommitAborted`.

The P2R target of a job with R2R keeps what it staged until the R2R it sends from the staging
area has been voted on (the R2R's vote covers every replica); a relay's vote covers both hops,
so a relay, or a lone replica, installs at once. Re-seeds run in place, parked.

**A delta** (:mod:`rollout_sync.transfer.delta_sync`) stages only its packed bytes: no staging
copy is made for it (one made by an earlier whole version is dropped once a delta installs,
and made again by the next whole one). It is checked and proven before the commit vote; the
install applies it to the served weights, parked, as the whole install copies them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ..errors import RolloutSyncError, StagedCommitAborted, WeightMismatchError
from ..guard import WeightSyncBracket
from ..staging import StagingArea, check_two_communicators
from ..transfer import BUFFER_WRITE, TransferStats
from ..transfer.delta_sync import MadeOnFirstUse, ReceivedDelta
from .commit import version_to_install
from .contract import (
    InstallStrategy,
    StrategyStatistics,
    SupportsWeightTransfer,
    Target,
    recorded,
    takes_deltas,
)
from .mode import SyncMode
from .slot import reload_received

__all__ = ["Staged"]


class Staged(InstallStrategy):
    """Receive into a staging copy per target; install under a short park once every replica
    of the sync voted yes (``all_or_none``: the host's)."""

    modes = (SyncMode.STAGED,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stagings: dict[str | None, StagingArea] = {}
        """Staging copies by target: the weights (``None``; ``SyncMode.STAGED``) and each LoRA
        adapter (always staged), built by the first sync of each."""
        self.pending: dict[str | None, ReceivedDelta] = {}
        """A proven delta waiting for its install, by target (the weights only)."""

    # -- the contract ----------------------------------------------------------------------

    def p2r(self, command: Any, forward: SupportsWeightTransfer | None) -> TransferStats:
        return self._staged(self._stage_p2r, command, forward)

    def r2r_receive(self, command: Any) -> TransferStats:
        return self._staged(self._stage_r2r_receive, command, None)

    def r2r_send(self, command: Any) -> TransferStats:
        return self._staged(self._stage_r2r_send, command, None)

    def receive(self, transfer: SupportsWeightTransfer, name: str) -> TransferStats:
        with self.bracket(name, pause=False, hold=self.host.guarded, mode=SyncMode.STAGED) as b:
            return recorded(b, self._stage(b, transfer, None, install=True, target=Target()))

    def discard(self) -> None:
        super().discard()
        for staging in self.stagings.values():
            staging.discard()  # a version staged on the old groups was never voted on
        self.pending.clear()
        self.last_delta = None

    def statistics(self) -> StrategyStatistics:
        stagings = tuple(self.stagings.values())  # a snapshot: the loop thread may add one
        pending = tuple(self.pending.values())
        return StrategyStatistics(
            staging_bytes=sum(s.nbytes for s in stagings) + sum(p.nbytes for p in pending),
            staged_discarded=sum(s.discarded for s in stagings),
        )

    def transferred(self, command: Any, stats: TransferStats) -> Mapping[str, torch.Tensor]:
        target = Target.of(command)
        pending = self.pending.get(target.adapter)
        if pending is not None and pending.version == stats.version and stats.role != "send":
            # A delta staged and not installed yet (the P2R target waits for its R2R's vote):
            # neither the served weights nor an older staging copy hold the version received.
            # The version it makes, on a copy made if the callback reads it; the delta stays
            # pending.
            served = target.served(self.host.rollout)
            return MadeOnFirstUse(partial(_with_delta, served, pending))
        staging = self.stagings.get(target.adapter)
        if staging is not None and stats.role != "send":
            return staging.tensors
        return target.served(self.host.rollout)

    def before_in_place_write(self) -> None:
        staging = self.stagings.get(None)
        if staging is not None:
            staging.discard()  # the served weights change under it: it mirrors them no more

    def for_adapter(self, command: Any) -> Staged:
        """This strategy, for an adapter's command, once the command may run: never in an
        async mode (its weight-sync thread runs collectives on the same groups, so the two
        could interleave); and an adapter is staged in every mode, so its receive runs beside
        the forwards: the NCCL rule applies as to a staged sync, whatever the host's mode.

        Raises:
            RolloutSyncError: the host is in an async mode.
            TwoCommunicatorsRefused: the NCCL rule.
        """
        what = f"{type(command).__name__}(adapter={command.adapter!r})"
        mode = self.host.weight_sync_mode
        if mode.is_async:
            raise RolloutSyncError(
                f"{what} on a worker in {mode.value} mode: adapter syncs run in the sync or "
                "staged modes only (an async mode's weight-sync thread shares the groups)"
            )
        check_two_communicators(
            self.host.rollout,
            (self.host.p2r, self.host.r2r),
            SyncMode.STAGED,
            what=what,
            remedy="An adapter is always received beside generation: give the P2R and R2R "
            "transfers a gloo group (RolloutWorker(staging_device='cpu'))",
        )
        return self

    # -- the bodies ------------------------------------------------------------------------

    def _staged(
        self,
        body: Callable[[WeightSyncBracket, Any, SupportsWeightTransfer | None], TransferStats],
        command: Any,
        forward: SupportsWeightTransfer | None,
    ) -> TransferStats:
        """Run a staged body in a bracket that holds payload egress for the transfer but does
        not pause; the body parks generation only to install. Unguarded: neither."""
        name = body.__name__.lstrip("_")
        with self.bracket(name, pause=False, hold=self.host.guarded, mode=SyncMode.STAGED) as b:
            return recorded(b, body(b, command, forward))

    def _stage_p2r(
        self, bracket: WeightSyncBracket, command: Any, forward: SupportsWeightTransfer | None
    ) -> TransferStats:
        """Stage the trainer's version. It is installed at once when this replica is the only
        one, or when it relays (the relay's R2R vote covers every replica); else it waits for
        the R2R this replica sends next, whose vote decides for all."""
        assert self.host.p2r is not None
        self.meet_trainer(forward)
        install = forward is not None or self.host.r2r is None
        target = Target.of(command)
        stats = self._stage(bracket, self.host.p2r, forward, install=install, target=target)
        if target.adapter is None:
            self.keep_origin(stats)
        return stats

    def _stage_r2r_receive(
        self, bracket: WeightSyncBracket, command: Any, forward: SupportsWeightTransfer | None
    ) -> TransferStats:
        assert self.host.r2r is not None
        return self._stage(bracket, self.host.r2r, None, install=True, target=Target.of(command))

    def _stage_r2r_send(
        self, bracket: WeightSyncBracket, command: Any, forward: SupportsWeightTransfer | None
    ) -> TransferStats:
        """Send the version staged by the P2R (or, with none staged, the served one); install
        the staged one once every receiver voted yes, discard it otherwise."""
        r2r = self.host.r2r
        assert r2r is not None
        target = Target.of(command)
        pending = self.pending.get(target.adapter)
        if pending is not None:
            # Pass on the delta the P2R brought; a receiver on another base asks for the whole
            # version, made then (the staging copy, with the delta applied).
            whole = MadeOnFirstUse(partial(self._materialize, target, pending))
            try:
                stats = self.send(r2r, lambda: (whole, pending.version, None))
            except BaseException as exc:
                self._settle(bracket, target, exc, pending.version, whole_here=True)
                raise  # pragma: no cover - _settle always raises
            self._install(bracket, target)
            return stats
        staging = self.stagings.get(target.adapter)
        version = staging.staged_version if staging is not None else None
        if staging is None or version is None:
            return self.send(r2r, partial(self.served_to_send, target))
        staged = staging
        try:
            stats = self.send(r2r, lambda: (staged.tensors, version, staged.storage))
        except BaseException as exc:
            self._settle(bracket, target, exc, version, whole_here=True)
            raise  # pragma: no cover - _settle always raises
        self._install(bracket, target)
        return stats

    def _stage(
        self,
        bracket: WeightSyncBracket,
        transfer: SupportsWeightTransfer,
        forward: SupportsWeightTransfer | None,
        *,
        install: bool,
        target: Target,
    ) -> TransferStats:
        """Receive ``transfer`` into ``target``'s staging area while generation goes on;
        install the version if ``install``, else keep it staged. A failure discards it: the
        served tensors were never touched. An adapter's set must be whole."""
        self.slot.ensure_engine()
        rollout = self.host.rollout
        delta = self.delta_target(target, apply=False) if takes_deltas(transfer) else None
        self.pending.pop(target.adapter, None)

        def staging_copy() -> tuple[Mapping[str, torch.Tensor], torch.Tensor | None]:
            staging = self._staging_for(target)
            staging.begin(target.served(rollout))
            return staging.tensors, staging.storage

        # With deltas on, the staging copy is made only if the version comes whole.
        into: Any = staging_copy
        storage = None
        if delta is None:
            into, storage = staging_copy()
        try:
            stats = self.take(
                transfer,
                forward,
                into,
                storage=storage,
                write_kind=BUFFER_WRITE,
                allow_subset=self.host.allow_subset and target.adapter is None,
                delta=delta,
                **target.verify_kwargs(rollout, transfer),
            )
        except BaseException as exc:
            if delta is not None and delta.pending is not None:
                self.pending[target.adapter] = delta.pending  # whole here, failed elsewhere
            self._settle(bracket, target, exc, getattr(exc, "version", None))
            raise  # pragma: no cover - _settle always raises
        if delta is not None and delta.pending is not None:
            self.pending[target.adapter] = delta.pending
        else:
            self.stagings[target.adapter].staged(stats.version)
        if target.adapter is None:
            self.keep_delta(stats, delta)
        if install:
            self._install(bracket, target)
        return stats

    def _settle(
        self,
        bracket: WeightSyncBracket,
        target: Target,
        exc: BaseException,
        version: int | None,
        *,
        whole_here: bool = False,
    ) -> None:
        """A staged sync failed with ``exc``: install what the commit rule still lets this
        replica install (two-phase off, and the version whole here), else discard; raise."""
        staging = self.stagings.get(target.adapter)
        alone = not self.host.all_or_none
        landed = version_to_install(exc, version, alone=alone, whole_here=whole_here)
        pending = self.pending.get(target.adapter)
        if landed is not None and (pending is not None or staging is not None):
            if pending is None and staging is not None and staging.staged_version is None:
                staging.staged(landed)
            self._install(bracket, target)  # two-phase off: this replica serves it regardless
            raise exc
        if staging is not None:
            staging.discard()
        self.pending.pop(target.adapter, None)
        if not isinstance(exc, Exception) or not self.host.all_or_none:
            raise exc
        raise self._commit_aborted(exc, version, target) from exc

    def _install(self, bracket: WeightSyncBracket, target: Target) -> None:
        """Park generation, copy the staged version into the served weights, fence the copy,
        commit it; then let generation go on.

        It runs after every replica voted yes, so a failure here leaves this replica behind the
        others (the in-doubt window of docs/staged.md): generation did not park in time (the
        version stays staged, the served weights untouched), or the engine's ``load_weights``
        failed part-way (the weights are torn, and a background engine stays parked until a
        complete version commits). Either is raised."""
        if target.adapter in self.pending:
            self._install_delta(bracket, self.pending.pop(target.adapter))
            return
        staging = self.stagings[target.adapter]
        rollout = self.host.rollout
        slot = self.slot
        with bracket.stalled(pause=self.host.guarded):
            try:
                staging.install_into(
                    rollout,
                    adapter=target.adapter,
                    fence=partial(self.host.weight_sync_fence, self.host.weight_sync_timeout),
                )
            except BaseException:
                slot.park_if_torn(self.host.weight_sync_timeout)
                raise
        slot.landed()  # install_into committed it

    def _install_delta(self, bracket: WeightSyncBracket, received: ReceivedDelta) -> None:
        """Park generation, apply the proven delta to the served weights (hand them to an
        engine that keeps its own copy), fence, commit; then let generation go on. The staging
        copy of an earlier whole version mirrors the served weights no more: it is dropped (a
        delta stages its packed bytes only). A failed apply restores what it wrote (nothing is
        torn); a failure after it (the engine's load, the fence) leaves the weights torn."""
        rollout = self.host.rollout
        self.stagings.pop(None, None)
        with bracket.stalled(pause=self.host.guarded):
            try:
                received.apply(self.digests)
            except BaseException as exc:
                if received.undo:  # its restore failed too: what it lists is still written
                    self._torn(received, "applying it failed, and so did putting it back", exc)
                raise
            try:
                reload_received(rollout, received.targets)
                self.host.weight_sync_fence(self.host.weight_sync_timeout)
            except BaseException as exc:
                self._torn(received, "failed after it was applied", exc)
                raise
            rollout.commit_weight_version(received.version)
        self.slot.landed()

    def _torn(self, received: ReceivedDelta, what: str, exc: BaseException) -> None:
        self.host.rollout.mark_weights_torn(
            f"installing the delta of version {received.version}: {what}: "
            f"{type(exc).__name__}: {exc}"
        )
        self.slot.park_if_torn(self.host.weight_sync_timeout)

    def _materialize(self, target: Target, pending: ReceivedDelta) -> Mapping[str, torch.Tensor]:
        """The pending delta's version whole: the staging copy of the served weights with
        the delta applied (an R2R receiver asked for it)."""
        staging = self._staging_for(target)
        staging.begin(target.served(self.host.rollout))
        pending.apply_to(staging.tensors)
        staging.staged(pending.version)
        return staging.tensors

    def _staging_for(self, target: Target) -> StagingArea:
        staging = self.stagings.get(target.adapter)
        if staging is None:
            staging = self.stagings[target.adapter] = target.staging(
                self.host.rollout, self.host.staging_device
            )
        return staging

    def _commit_aborted(
        self, exc: Exception, version: int | None, target: Target
    ) -> StagedCommitAborted:
        failed = tuple(getattr(exc, "failed_ranks", ()))
        problems = exc.problems if isinstance(exc, WeightMismatchError) else None
        first_line = "; ".join(problems[:3]) if problems else (str(exc).splitlines() or [""])[0]
        why = (
            f"rank(s) {list(failed)} voted no"
            if failed
            else f"the transfer failed: {type(exc).__name__}: {first_line}"
        )
        kept = target.version(self.host.rollout)
        if version is not None:
            what = f"version {version}"
        elif target.step is not None:  # the manifest never arrived: name the step instead
            what = f"the version of step {target.step}"
        else:
            what = "the version being synced"
        return StagedCommitAborted(
            f"{what} of {target} is installed on no replica of this sync (two-phase commit): "
            f"{why}. This replica keeps serving version {kept}; its served weights were not "
            "touched",
            operation=getattr(exc, "operation", "staged receive"),
            version=version,
            failed_ranks=failed,
            kept_version=kept,
        )


def _with_delta(
    served: Mapping[str, torch.Tensor], pending: ReceivedDelta
) -> Mapping[str, torch.Tensor]:
    """A copy of ``served`` with ``pending`` applied: the version a staged delta makes."""
    made = {n: t.detach().clone() for n, t in served.items()}
    pending.apply_to(made)
    return made
