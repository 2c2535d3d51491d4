"""Buffered (the async modes): the transfer writes a weight buffer on a thread of its own; the
backend installs it at its own safe points.

Every P2R and R2R becomes a job on a :class:`~rollout_sync.buffer.WeightSyncThread` (P2R first),
run in the bracket with payload egress held and no pause, writing a
:class:`~rollout_sync.WeightBuffer` (a clone of the served weights). The backend's
``install_inference_sync`` swaps a complete version in at its next safe point
(:class:`~rollout_sync.buffer.SupportsWeightBuffer`); generation never pauses, and a failed
transfer publishes nothing, so the served weights stay whole. Before the engine runs, the first
version is installed on the weight-sync thread and the engine started with it.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._deadline import deadline_after, expired
from ..buffer import SupportsWeightBuffer, WeightBuffer, WeightSyncThread
from ..errors import InstallTimeout, RolloutSyncError, WeightTransferTimeout
from ..transfer import BUFFER_WRITE, TransferStats
from .commit import version_to_install
from .contract import InstallStrategy, SupportsWeightTransfer
from .mode import SyncMode

__all__ = ["Buffered"]

RESEED_QUEUE_FACTOR = 4
"""An async re-seed waits this many ``weight_sync_timeout`` s for the jobs queued before it."""


class Buffered(InstallStrategy):
    """Queue every sync on the weight-sync thread; write the buffer; publish complete versions.

    Raises (when built):
        TypeError: the backend cannot install a buffer (it lacks ``attach_weight_buffer``).
    """

    modes = (SyncMode.ASYNC_PER_GENERATION, SyncMode.ASYNC_PER_FORWARD)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        host = self.host
        if not isinstance(host.rollout, SupportsWeightBuffer):
            raise TypeError(
                f"{host.weight_sync_mode} needs a backend that installs a WeightBuffer at its "
                f"safe points (implement attach_weight_buffer, see SupportsWeightBuffer); "
                f"{type(host.rollout).__name__} does not"
            )
        self.weight_buffer: WeightBuffer | None = None
        self.sync_thread = WeightSyncThread(
            self._bracket, name=f"weight-sync-{id(host):x}", fence=host.weight_sync_fence
        )

    # -- the contract ----------------------------------------------------------------------

    def p2r(self, command: Any, forward: SupportsWeightTransfer | None) -> Any:
        return self.sync_thread.submit("p2r", lambda: self._p2r(forward))

    def r2r_receive(self, command: Any) -> Any:
        # The role is read when the job runs: use_groups() may have replaced the transfer.
        return self.sync_thread.submit("r2r", self._r2r)

    r2r_send = r2r_receive

    def receive(self, transfer: SupportsWeightTransfer, name: str) -> TransferStats:
        raise RolloutSyncError(
            "the async modes receive on the weight-sync thread (p2r/r2r_receive), for a "
            "backend that installs the buffer itself"
        )

    def reseed(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """On the weight-sync thread like any other job (a receive queues like a P2R, a send
        like an R2R), waiting for the jobs queued before it.

        Raises:
            WeightTransferTimeout: it did not finish within ``RESEED_QUEUE_FACTOR`` times the
                host's ``weight_sync_timeout``.
        """
        job = (
            (lambda: self._send(transfer))
            if transfer.is_source
            else (lambda: self._receive(transfer))
        )
        future = self.sync_thread.submit("r2r" if transfer.is_source else "p2r", job)
        limit = self.host.weight_sync_timeout * RESEED_QUEUE_FACTOR
        try:
            result: TransferStats = future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # not run later, on groups a next recovery has destroyed
            raise WeightTransferTimeout(
                f"the re-seed transfer on the weight-sync thread did not finish within "
                f"{limit:.1f} s",
                operation="reseed",
            ) from None
        return result

    def close(self, timeout: float) -> None:
        self.sync_thread.stop(timeout)

    def transferred(self, command: Any, stats: TransferStats) -> Mapping[str, torch.Tensor]:
        assert self.weight_buffer is not None  # a job that transferred made it
        return self.weight_buffer.tensors

    def wait_for_install(self, timeout: float) -> int:
        """Wait until a safe point installed the newest buffer version; the served version.

        Raises:
            InstallTimeout: the backend reached no safe point within ``timeout`` seconds.
        """
        rollout = self.host.rollout
        buffer = self.weight_buffer
        deadline = deadline_after(timeout)
        while buffer is not None:
            wanted = buffer.published_version
            if wanted is None or rollout.weight_version >= wanted:
                break
            if expired(deadline):
                raise InstallTimeout(
                    f"version {wanted} was not installed within {timeout:.1f} s (serving "
                    f"v{rollout.weight_version}); the backend reached no safe point"
                )
            time.sleep(0.001)  # polling the backend's version; installs happen on its thread
        return rollout.weight_version

    # -- the jobs (on the weight-sync thread) ----------------------------------------------

    def _bracket(self, name: str) -> AbstractContextManager[object]:
        """The weight-sync thread's bracket: egress held, generation not paused."""
        return self.bracket(name, pause=False, hold=self.host.guarded)

    def _ensure_buffer(self) -> WeightBuffer:
        """Initialize the engine and clone its served weights into the buffer (once)."""
        if self.weight_buffer is None:
            self.slot.ensure_engine()
            rollout = self.host.rollout
            self.weight_buffer = WeightBuffer(
                rollout.served_weights(),
                mode=self.host.weight_sync_mode,
                timeline=self.host.timeline,
                fence_timeout_s=self.host.weight_sync_timeout,
            )
            assert isinstance(rollout, SupportsWeightBuffer)
            rollout.attach_weight_buffer(self.weight_buffer)
        return self.weight_buffer

    def _receive(
        self, transfer: SupportsWeightTransfer, forward: SupportsWeightTransfer | None = None
    ) -> TransferStats:
        buffer = self._ensure_buffer()
        elsewhere: BaseException | None = None
        with buffer.write(self.host.weight_sync_timeout) as handle:
            try:
                stats = self.take(transfer, forward, handle.tensors, write_kind=BUFFER_WRITE)
            except BaseException as exc:
                landed = version_to_install(exc, None, alone=True)
                if landed is None:
                    raise
                # Every byte landed here intact; the failure was another rank's (or the
                # relay's next hop). Publish the version, and still report the failure.
                handle.version, elsewhere = landed, exc
            else:
                handle.version = stats.version
        if not self.slot.engine_started:
            # Not generating yet: install on this thread, then start with the new weights.
            buffer.install_into(self.host.rollout)
            self.slot.start_engine()
        if elsewhere is not None:
            raise elsewhere
        return stats

    def _p2r(self, forward: SupportsWeightTransfer | None) -> TransferStats:
        assert self.host.p2r is not None
        self.meet_trainer(forward)
        stats = self._receive(self.host.p2r, forward)
        self.keep_origin(stats)
        return stats

    def _r2r(self) -> TransferStats:
        r2r = self.host.r2r
        assert r2r is not None
        return self._send(r2r) if r2r.is_source else self._receive(r2r)

    def _send(self, transfer: SupportsWeightTransfer) -> TransferStats:
        """Send the newest complete buffer version (on the weight-sync thread)."""

        def newest() -> tuple[Mapping[str, torch.Tensor], int, torch.Tensor | None]:
            buffer = self.weight_buffer
            version = None if buffer is None else buffer.published_version
            if buffer is None or version is None:
                raise RolloutSyncError(
                    "R2R broadcast before this replica received any complete version "
                    "(send P2R first)"
                )
            # This thread is the buffer's only writer, so it is stable while it is read here.
            return buffer.tensors, version, None

        return self.send(transfer, newest)
