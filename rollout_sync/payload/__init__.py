"""Rollout results to the trainer ("payloads"), over transfers whose egress a weight sync holds.

Weights are a *transfer* (:mod:`rollout_sync.transfer`); rollout results are a *payload*:
token ids, logprobs, rewards, any tensors plus small metadata, sent point-to-point from every
rollout replica to the trainer on process groups of their own.

* :mod:`.sender` - :class:`PayloadSender` (bounded registry, sender pool, ``hold_sends`` and
  ``flush_pending_sends``), :class:`NCCLRolloutMixin`, :func:`new_payload_groups`.
* :mod:`.receiver` - :class:`PayloadReceiver` (credit-based, ``hold_receives``).
* ``_wire`` - frames, packing, and what both ends share (private).

See docs/transport.md.
"""

from .receiver import PayloadReceiver as PayloadReceiver
from .receiver import ReceivedPayload as ReceivedPayload
from .receiver import ReceiverStatistics as ReceiverStatistics
from .sender import NCCLRolloutMixin as NCCLRolloutMixin
from .sender import PayloadGroups as PayloadGroups
from .sender import PayloadSender as PayloadSender
from .sender import SenderStatistics as SenderStatistics
from .sender import new_payload_groups as new_payload_groups

__all__ = [
    "NCCLRolloutMixin",
    "PayloadGroups",
    "PayloadReceiver",
    "PayloadSender",
    "ReceivedPayload",
    "ReceiverStatistics",
    "SenderStatistics",
    "new_payload_groups",
]
