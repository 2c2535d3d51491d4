"""The one place that turns a transfer's commit vote into install-or-discard.

A transfer ends with a commit vote over every rank of the sync. Its outcome reaches a receiver
as the transfer returning (every rank voted yes) or raising. Whether the version is then
installed on this replica is decided here, for every strategy, as torchft's
``Manager.should_commit`` is the one place that decides a commit:

* the transfer returned: install;
* it raised, but proves this rank received the version whole (``complete``: another rank voted
  no, or the relay's next hop failed): install only where a replica may install alone, which
  the every-replica-or-none rule forbids (``all_or_none``; a staged replica then discards).
  In place there is nothing to roll back to: the bytes are the version, so it commits;
* anything else (a death, a bad bucket here, a refusal): discard.
"""

from __future__ import annotations

from ..errors import WeightTransferError

__all__ = ["version_to_install"]


def version_to_install(
    error: BaseException | None, version: int | None, *, alone: bool, whole_here: bool = False
) -> int | None:
    """The version this replica installs after its part of a sync ended.

    ``version`` when the sync succeeded (``error`` is ``None``). After a failed transfer, only
    where ``alone`` lets a replica install without the others (in place, buffered, or two-phase
    turned off) and this replica holds the version whole: the failed transfer proves it
    (``complete``: the failure was another rank's), or ``whole_here`` says so (the R2R source,
    whose own copy is the version whatever its receivers did). Else ``None``: discard.
    """
    if error is None:
        return version
    if not (alone and isinstance(error, WeightTransferError)):
        return None
    if whole_here:
        return version
    return error.version if error.complete else None
