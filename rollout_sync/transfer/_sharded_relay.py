"""The sharded relays: :class:`~rollout_sync.transfer.ShardedTransfer`'s ``relay()``, written
apart from the transfer's own send and receive.

The plain relay receives this rank's part whole, then sends it through an R2R
:class:`~rollout_sync.WeightTransfer` (a delta goes on as a delta). The pipelined one
(``pipelined_relay=True``): each of the first replica's ranks passes every bucket of its slice
on to the same rank of the other replicas (an R2R :class:`~rollout_sync.WeightTransfer`, sent
in steps: :meth:`~rollout_sync.WeightTransfer.begin_send`) as soon as every tensor in it has
arrived from the trainer ranks, two-phase (the protocol is in
:mod:`rollout_sync.transfer.sharded`'s docstring). :class:`Relay` is a part of
``ShardedTransfer`` (it runs on the transfer's own receive, plan vote, receive steps and commit
vote); :class:`_Arrivals` is the pipelined relay's view of its receive.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial

import torch

from ..errors import (
    ChecksumMismatchError,
    RelayForwardError,
    WeightMismatchError,
    WeightTransferError,
)
from ..trace import SpanKind
from ..weights import WeightSpec
from ._sharded_buckets import _Bucket, _Progress
from ._sharded_delta import DeltaDecision
from ._sharded_delta_transfer import _applied
from .config import TransferStats
from .delta_sync import DeltaTarget, MadeOnFirstUse
from .weight_transfer import StepwiseSend, Targets

__all__ = ["Relay"]


def _forward_failed(error: Exception, version: int) -> WeightTransferError:
    """A pipelined relay's own failure to pass a version on (not a peer's), typed."""
    failed = WeightTransferError(
        f"passing version {version} on failed on this rank: {type(error).__name__}: {error}",
        operation=f"forward version {version}",
        version=version,
    )
    failed.__cause__ = error
    return failed


class _Arrivals:
    """A pipelined relay's view of its receive: which of its tensors have arrived whole.

    Drives the receive (:meth:`ShardedTransfer._receive_steps`) only as far as the next hop
    needs; a collective's failure stops it (:attr:`failure`), a bucket that arrived corrupted
    stops the writing (the receive goes on, so no source is left waiting)."""

    def __init__(self, specs: Mapping[str, WeightSpec], steps: Iterator[_Bucket | None]) -> None:
        self.missing = {name: spec.nbytes for name, spec in specs.items()}
        self.steps = steps
        self.failure: WeightTransferError | None = None
        self.done = False

    def until_complete(self, names: Sequence[str], progress: _Progress) -> bool:
        """Receive until every tensor of ``names`` this rank receives has arrived whole;
        whether they all did (``False``: they never will)."""
        while any(self.missing.get(n, 0) > 0 for n in names):
            if self.done or self.failure is not None or not progress.writing:
                return False
            self._step()
        return True

    def drain(self) -> None:
        """Take every bucket still to come (unless a collective failed)."""
        while not self.done and self.failure is None:
            self._step()

    def _step(self) -> None:
        try:
            bucket = next(self.steps)
        except StopIteration:
            self.done = True
            return
        except WeightTransferError as exc:
            self.failure = exc
            return
        if bucket is not None:
            for slot in bucket.slots:
                self.missing[slot.move.target_local] -= slot.move.nbytes


class Relay(abc.ABC):
    """The relays (plain and pipelined) of a :class:`~rollout_sync.transfer.ShardedTransfer` (a
    part of it: the members below are the transfer's, named here so that this part says what
    it uses)."""

    rank: int
    pipelined_relay: bool
    _specs: Mapping[str, WeightSpec]

    @abc.abstractmethod
    def _receive(
        self,
        into: Targets,
        allow_subset: bool,
        write_kind: str,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None,
        delta: DeltaTarget | None,
    ) -> tuple[TransferStats, Mapping[str, torch.Tensor] | None]: ...

    @abc.abstractmethod
    def _check(
        self, tensors: Mapping[str, torch.Tensor], what: str, *, require_all: bool
    ) -> WeightMismatchError | None: ...

    @abc.abstractmethod
    def _target_columns(
        self, target: DeltaTarget | None, *, relaying: bool = False
    ) -> list[int]: ...

    @abc.abstractmethod
    def _plan_vote(
        self,
        version: int | None,
        own: WeightMismatchError | None,
        columns: list[int],
        target: DeltaTarget | None = None,
    ) -> tuple[int, DeltaDecision]: ...

    @abc.abstractmethod
    def _receive_steps(
        self, into: Mapping[str, torch.Tensor], version: int, progress: _Progress, write_kind: str
    ) -> Iterator[_Bucket | None]: ...

    @abc.abstractmethod
    def _commit_vote(
        self,
        version: int,
        progress: _Progress,
        failure: WeightTransferError | None,
        *,
        receiving: bool,
        forwarded: bool | None = None,
    ) -> list[int]: ...

    @abc.abstractmethod
    def _stats(
        self,
        role: str,
        version: int,
        progress: _Progress,
        start: float,
        voted: float,
        end: float,
        decision: DeltaDecision = ...,
    ) -> TransferStats: ...

    def relay(
        self,
        into: Targets,
        forward: object,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive as :meth:`receive` does, then send what arrived through ``forward`` (an R2R
        :class:`~rollout_sync.WeightTransfer` between this rank and the same rank of the other
        replicas). Not pipelined: the second hop starts when the first is complete. A delta
        goes on as a delta of this rank's local tensors (``delta.received``); a receiver that
        asks for the whole version gets it from the tensors that now hold it (staged, a copy
        of the served ones with the delta applied, made only then).

        With ``pipelined_relay``, :meth:`_relay_pipelined` instead: each bucket of
        ``forward`` goes out as soon as its tensors have arrived (the module docstring); it
        passes whole versions on, so a sync through it goes whole
        (:attr:`~rollout_sync.transfer.delta_sync.WholeReason.RELAY`).

        Raises:
            RelayForwardError: the receive completed (``complete``), passing it on failed.
        """
        if self.pipelined_relay:
            return self._relay_pipelined(
                into, forward, allow_subset, write_kind, storage, verify, delta
            )
        try:
            stats, tensors = self._receive(into, allow_subset, write_kind, verify, delta)
        except (WeightTransferError, WeightMismatchError) as exc:
            abort = getattr(forward, "abort", None)
            if abort is not None:  # the downstream replicas fail now, not at their limit
                version = getattr(exc, "version", None)
                abort(f"the relay's receive failed: {type(exc).__name__}", version=version)
            raise
        send: Callable[..., TransferStats] = getattr(forward, "send")  # noqa: B009
        extra: dict[str, object] = {}
        if stats.sync_kind == "delta":
            assert delta is not None and delta.received is not None
            extra["delta"] = delta.received
            if tensors is None:  # kept pending: the whole version only if a receiver asks
                tensors, storage = MadeOnFirstUse(partial(_applied, into, delta)), None
        assert tensors is not None
        try:
            sent = send(tensors, version=stats.version, storage=storage, **extra)
        except WeightTransferError as exc:
            raise RelayForwardError(
                f"received version {stats.version} whole, but passing it on failed: {exc}",
                operation=f"relay version {stats.version}",
                version=stats.version,
                tensors_written=stats.tensors_written,
                cause=exc,
            ) from exc
        # Both hops, one after the other: the relay's time is the receive's and the send's.
        return replace(
            stats,
            role="relay",
            transfer_s=stats.transfer_s + sent.total_s,
            total_s=stats.total_s + sent.total_s,
        )

    def _relay_pipelined(
        self,
        into: Targets,
        forward: object,
        allow_subset: bool,
        write_kind: str,
        storage: torch.Tensor | None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """The pipelined relay, per rank (the module docstring): receive this rank's part and
        pass each bucket of ``forward`` (an R2R :class:`~rollout_sync.WeightTransfer` this rank
        is the source of) on as soon as its tensors have all arrived; then the R2R commit vote
        (this rank's yes: its part arrived whole), the P2R commit vote (every rank of this hop:
        its part whole, and passed on), and the verdict to the R2R group: commit only if every
        rank of both hops said yes.

        It passes whole versions on: with ``delta`` it asks for the whole version at the plan
        vote (:attr:`~rollout_sync.transfer.delta_sync.WholeReason.RELAY`), and ``into``, if a
        function, makes its targets at once.

        Raises:
            RelayForwardError: this rank's part arrived whole, passing it on failed.
            WeightTransferError (``complete``): this rank's part arrived and went on whole; the
                version does not commit everywhere (another relay's next hop failed).
            Otherwise as :meth:`receive`.
        """
        start = time.perf_counter()
        own: WeightMismatchError | None = None
        if callable(into):
            try:
                into, storage = into()
            except Exception as exc:  # noqa: BLE001 - this rank's objection, voted below
                own = WeightMismatchError(
                    [f"making the targets failed: {type(exc).__name__}: {exc}"],
                    context=f"the pipelined relay on rank {self.rank}",
                )
                into = {}
        own = own or self._check(into, "served weights", require_all=not allow_subset)
        begin_send = getattr(forward, "begin_send", None)
        if own is None and begin_send is None:
            own = WeightMismatchError(
                [f"the next hop {forward!r} cannot send in steps (no begin_send)"],
                context=f"the pipelined relay on rank {self.rank}",
            )
        try:
            version, decision = self._plan_vote(
                None, own, self._target_columns(delta, relaying=True)
            )
        except (WeightTransferError, WeightMismatchError) as exc:
            abort = getattr(forward, "abort", None)
            if abort is not None:  # the downstream replicas fail now, not at their limit
                reason = f"the relay's receive failed: {type(exc).__name__}"
                abort(reason, version=getattr(exc, "version", None))
            raise
        voted = time.perf_counter()
        assert begin_send is not None
        steps: StepwiseSend | None = None
        forward_error: WeightTransferError | None = None
        try:
            steps = begin_send(into, version=version, storage=storage, decision=True)
        except WeightTransferError as exc:  # a downstream rank refused the manifest, or died
            forward_error = exc
        except Exception as exc:  # noqa: BLE001 - this rank's own: begin_send aborted them
            forward_error = _forward_failed(exc, version)
        progress = _Progress()
        arriving = _Arrivals(self._specs, self._receive_steps(into, version, progress, write_kind))
        if steps is not None:
            for k in range(steps.num_buckets):
                whole = forward_error is None and arriving.until_complete(
                    steps.bucket_names(k), progress
                )
                try:
                    steps.launch(k) if whole else steps.launch_void(k)
                except WeightTransferError as exc:  # a downstream rank died or timed out
                    forward_error, steps = exc, None
                    break
                except Exception as exc:  # noqa: BLE001 - packing failed here: the rest go void
                    forward_error = _forward_failed(exc, version)
        arriving.drain()  # every source's buckets are taken, whatever happened downstream
        if arriving.failure is None and progress.writing and verify is not None:
            try:
                verify(into)
            except Exception as exc:  # noqa: BLE001 - this rank's refusal: voted, then raised
                progress.refusal = exc
        whole = arriving.failure is None and progress.writing and progress.refusal is None
        if steps is not None:
            try:
                # Yes only if what went on is the version: not after a local forwarding failure.
                refused = steps.vote(ok=whole and forward_error is None)
            except WeightTransferError as exc:
                forward_error, steps = exc, None
            else:
                if refused:
                    forward_error = ChecksumMismatchError(
                        f"ranks {refused} failed to receive version {version} from relay rank "
                        f"{self.rank}",
                        operation=steps.op,
                        version=version,
                        tensors_written=0,
                        buckets=(),
                        failed_ranks=refused,
                    )
        commits = False
        try:
            not_forwarded = self._commit_vote(
                version,
                progress,
                arriving.failure,
                receiving=True,
                forwarded=whole and forward_error is None,
            )
            commits = not not_forwarded
        finally:
            if steps is not None and steps.voted_yes:
                try:
                    steps.decide(commit=commits)
                except WeightTransferError as exc:
                    forward_error = forward_error or exc
        written = len(progress.tensors_written)
        if forward_error is not None:
            raise RelayForwardError(
                f"received version {version} whole on rank {self.rank}, but passing it on "
                f"failed: {forward_error}",
                operation=f"relay version {version}",
                version=version,
                tensors_written=written,
                cause=forward_error,
            ) from forward_error
        if not commits:
            raise WeightTransferError(
                f"version {version} reached rank {self.rank} whole and went on, but relay "
                f"rank(s) {not_forwarded} could not pass it on: it does not commit everywhere",
                operation=f"relay version {version}",
                version=version,
                tensors_written=written,
                complete=True,
            )
        end = time.perf_counter()
        return self._stats("relay", version, progress, start, voted, end, decision)
