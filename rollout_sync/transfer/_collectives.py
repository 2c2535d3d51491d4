"""A :class:`~rollout_sync.transfer.WeightTransfer`'s group: its collectives, each waited for
with a bound (:func:`wait_transfer_work`), timeline spans, and the all-rank votes every transfer
step ends with (the manifest vote's rejections and whole-version requests included)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..distributed import GroupCollectives, wait_work
from ..errors import (
    CollectiveError,
    CollectiveTimeout,
    ManifestRejected,
    WeightTransferError,
    WeightTransferTimeout,
)
from ..trace import SpanKind, Timeline
from ._barrier import (
    ABORT,
    UNKNOWN_VERSION,
    VOTE_BARRIER_SKIPPED,
    VOTE_NO,
    VOTE_WHOLE,
    VOTE_YES,
    barrier_mismatch,
)
from ._pipeline import _Link
from .config import TransferConfig, TransferHooks

__all__ = ["TransferCollectives", "wait_transfer_work"]


def wait_transfer_work(
    work: dist.Work | None,
    op: str,
    timeout_s: float,
    group: dist.ProcessGroup | None,
    ranks: tuple[int, ...],
    version: int | None,
    written: int,
) -> None:
    """Wait for one of a transfer's operations (:func:`~rollout_sync.distributed.wait_work`),
    its failure raised as the transfer's own error, saying how many target tensors this rank
    had written (``written``) by then.

    Raises:
        WeightTransferTimeout: it did not complete within ``timeout_s``.
        WeightTransferError: a peer failed (typically died) before that.
    """
    try:
        wait_work(work, operation=op, timeout_s=timeout_s, group=group, ranks=ranks)
    except CollectiveTimeout as exc:
        raise WeightTransferTimeout(
            f"{exc} [{written} target tensor(s) written before it failed]",
            operation=op,
            version=version,
            tensors_written=written,
        ) from exc
    except CollectiveError as exc:
        raise WeightTransferError(
            f"{exc} [{written} target tensor(s) written before it failed]",
            operation=op,
            version=version,
            tensors_written=written,
        ) from exc


class TransferCollectives:
    """Bounded collectives and votes over a transfer's group (a part of
    :class:`~rollout_sync.transfer.WeightTransfer`, which sets these fields)."""

    group: dist.ProcessGroup | None
    src: int
    """The source's rank (global, or the group rank of a standalone group)."""
    config: TransferConfig
    timeline: Timeline | None
    hooks: TransferHooks
    collectives: GroupCollectives
    ranks: tuple[int, ...]
    rank: int
    """This process's rank, numbered as ``src``."""
    device: torch.device
    """Where buckets and vote tensors live."""

    def abort(self, reason: str, *, version: int | None = None) -> None:
        """Tell the receivers waiting for this transfer's manifest that none is coming.

        On the source only, in place of :meth:`send` (a source that cannot send, say because
        its own weights are torn): every receiver raises :class:`ManifestRejected` at once,
        writing nothing, instead of waiting out the timeout. ``version``: the version that is
        not coming, if the source knows it (the receivers' message names it). A failure to
        deliver the abort (a receiver already dead) is not raised: the reason to abort is the
        error to report.
        """
        what = "a version" if version is None else f"version {version}"
        op = f"send {what} from rank {self.src} to ranks {list(self.ranks)}"
        word = UNKNOWN_VERSION if version is None else version
        header = torch.tensor([ABORT, word], dtype=torch.int64, device=self.device)
        try:
            self._collective(
                lambda: self.collectives.broadcast(header, self.src),
                f"{op}: abort ({reason})",
                version=version,
                written=0,
            )
        except WeightTransferError:
            pass

    def _broadcast_manifest(self, data: bytes, version: int, op: str) -> None:
        header = torch.tensor([len(data), version], dtype=torch.int64, device=self.device)
        self._collective(
            lambda: self.collectives.broadcast(header, self.src),
            f"{op}: manifest header",
            version=version,
            written=0,
        )
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._collective(
            lambda: self.collectives.broadcast(payload, self.src),
            f"{op}: manifest",
            version=version,
            written=0,
        )

    # -- a receiver ----------------------------------------------------------------------------

    @property
    def is_source(self) -> bool:
        return self.rank == self.src

    @contextmanager
    def _write_span(self, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(SpanKind.WEIGHT_WRITE, name):
                yield

    def _collective(
        self, launch: Callable[[], dist.Work | None], op: str, *, version: int | None, written: int
    ) -> None:
        with self._span(op):
            work = launch()
            assert work is not None
            self._wait(work, op, version, written)

    def _wait(self, work: dist.Work, op: str, version: int | None, written: int) -> None:
        wait_transfer_work(
            work, op, self.config.timeout_s, self.group, self.ranks, version, written
        )

    def _link(self) -> _Link:
        """This transfer as the pipeline drives it (its group, its bounded wait and vote)."""

        def vote_ranks(ok: bool, op: str, version: int | None) -> list[int]:
            return self._vote_ranks(ok=ok, op=op, version=version, written=0)

        return _Link(self.src, self.collectives, self.timeline, self.device, self._wait, vote_ranks)

    @contextmanager
    def _span(self, name: str) -> Iterator[None]:
        if self.timeline is None:
            yield
        else:
            with self.timeline.span(SpanKind.WEIGHT_COLLECTIVE, name, src=self.src):
                yield

    def _vote_ranks(self, *, ok: bool, op: str, version: int | None, written: int) -> list[int]:
        """All-gather an ok flag; the global ranks that said no."""
        votes = self._gather_votes(
            VOTE_YES if ok else VOTE_NO, op=op, version=version, written=written
        )
        return [rank for rank, vote in zip(self.ranks, votes, strict=True) if vote != VOTE_YES]

    def _gather_votes(self, vote: int, *, op: str, version: int | None, written: int) -> list[int]:
        """All-gather a vote (``VOTE_YES``, ``VOTE_NO``, ...); every rank's, in rank order."""
        mine = torch.tensor([vote], dtype=torch.int32, device=self.device)
        votes = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in self.ranks]
        self._collective(
            lambda: self.collectives.all_gather(votes, mine),
            op,
            version=version,
            written=written,
        )
        return [int(v) for v in torch.cat(votes).tolist()]  # one device-to-host copy

    def _vote(
        self,
        *,
        ok: bool,
        op: str,
        version: int | None,
        written: int,
        reject_message: str,
        own_error: BaseException | None = None,
        whole_allowed: bool = False,
        want_whole: bool = False,
    ) -> bool:
        """Vote; raise ``own_error`` if this rank said no, :class:`ManifestRejected` if another
        did (:class:`~rollout_sync.errors.P2RBarrierMismatch` on the source, if a replica voted
        from inside a P2R barrier this source skipped). Every rank learns the outcome, so none
        is left waiting on the next collective.

        On a delta's manifest (``whole_allowed``) a receiver may vote for the whole version
        instead (``want_whole``, :data:`VOTE_WHOLE`): returns whether any rank did (and none
        said no), when every rank expects the same version again, whole."""
        vote = VOTE_WHOLE if want_whole and ok else (VOTE_YES if ok else VOTE_NO)
        votes = self._gather_votes(vote, op=op, version=version, written=written)
        if own_error is not None:
            raise own_error
        skipped = [r for r, v in zip(self.ranks, votes, strict=True) if v == VOTE_BARRIER_SKIPPED]
        if skipped and self.is_source:
            raise barrier_mismatch(
                "trainer",
                trainer=self.src,
                replica=skipped[0],
                operation=op,
                version=version,
                detail=" (it voted on this manifest from inside its barrier)",
            )
        accepted = (VOTE_YES, VOTE_WHOLE) if whole_allowed else (VOTE_YES,)
        failed = [r for r, v in zip(self.ranks, votes, strict=True) if v not in accepted]
        if failed:
            raise ManifestRejected(
                f"{op}: ranks {failed} {reject_message} (see their logs for the problems)",
                operation=op,
                version=version,
                rejected_by=failed,
            )
        return VOTE_WHOLE in votes
