"""In place (``SyncMode.SYNC``): the transfer writes the served tensors, generation parked.

The whole sync runs in the guard's bracket (pause, egress hold, fence): lazy engine start, the
P2R barrier and the transfer. A version that lands whole is committed; a failure after a write
leaves the weights torn and generation parked until a complete version commits (fail closed:
:func:`~rollout_sync.sync.slot.settle_failed_receive`). The R2R source only reads the served
tensors, so its send holds payload egress and lets generation run.
"""

from __future__ import annotations

from typing import Any

from ..transfer import TransferStats
from .contract import InstallStrategy, SupportsWeightTransfer, recorded
from .mode import SyncMode

__all__ = ["InPlace"]


class InPlace(InstallStrategy):
    """Receive into the served tensors under the whole bracket (``guarded``: unguarded, no
    pause nor hold, to show the hazards)."""

    modes = (SyncMode.SYNC,)

    def p2r(self, command: Any, forward: SupportsWeightTransfer | None) -> TransferStats:
        with self.bracket("_receive_p2r", pause=self.host.guarded, hold=self.host.guarded) as b:
            return recorded(b, self.receive_p2r(forward))

    def r2r_receive(self, command: Any) -> TransferStats:
        with self.bracket("_receive_r2r", pause=self.host.guarded, hold=self.host.guarded) as b:
            return recorded(b, self.receive_r2r())

    def r2r_send(self, command: Any) -> TransferStats:
        with self.bracket("_send_r2r", pause=False, hold=self.host.guarded) as b:
            return recorded(b, self.send_r2r())

    def receive(self, transfer: SupportsWeightTransfer, name: str) -> TransferStats:
        with self.bracket(name, pause=self.host.guarded, hold=self.host.guarded) as b:
            return recorded(b, self.receive_in_place(transfer))
