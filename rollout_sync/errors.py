"""The exceptions rollout_sync raises, in one place so callers can catch them by family.

Every timeout error is a :class:`TimeoutError` and names the operation, the limit and what was
still in the way, so a log line alone tells what hung.
"""

from __future__ import annotations

__all__ = [
    "EgressHoldTimeout",
    "FenceTimeout",
    "GateTimeout",
    "HarvestTimeout",
    "IngressHoldTimeout",
    "MetricKeyCollisionError",
    "PauseTimeout",
    "PayloadBackpressureTimeout",
    "PayloadTimeout",
    "PayloadTransportError",
    "PayloadsExhausted",
    "RolloutSyncError",
    "TornWeightsError",
    "WeightBroadcastError",
    "WouldBlock",
]


class RolloutSyncError(Exception):
    """Base class of every error rollout_sync raises on purpose."""


class WouldBlock(RolloutSyncError):
    """A ``*_nowait`` call could not proceed without waiting."""


class GateTimeout(RolloutSyncError, TimeoutError):
    """A :class:`~rollout_sync.Gate` wait ran past its limit.

    Attributes:
        operation: what was being waited for, in words.
        timeout: the limit, in seconds.
        sections_running: sections still inside the gate when the wait gave up.
    """

    def __init__(self, message: str, *, operation: str, timeout: float, sections_running: int):
        super().__init__(message)
        self.operation = operation
        self.timeout = timeout
        self.sections_running = sections_running


class PauseTimeout(GateTimeout):
    """Generation did not park within the limit (a forward kept running)."""


class EgressHoldTimeout(GateTimeout):
    """Payload egress could not be held or flushed within the limit (a send kept running)."""


class IngressHoldTimeout(GateTimeout):
    """Payload receives could not be held or flushed within the limit (a receive kept running)."""


class PayloadTimeout(RolloutSyncError, TimeoutError):
    """A payload transport wait ran past its limit (a receive, a drain, a close).

    Attributes:
        operation: what was being waited for, in words.
        timeout: the limit, in seconds.
    """

    def __init__(self, message: str, *, operation: str, timeout: float) -> None:
        super().__init__(message)
        self.operation = operation
        self.timeout = timeout


class PayloadBackpressureTimeout(PayloadTimeout):
    """A payload could not be registered: the sender's registry stayed full past the limit.

    Nothing was evicted to make room; the payload was not registered and may be retried.
    """


class PayloadTransportError(RolloutSyncError):
    """The payload transport broke (a peer went away, the protocol was violated) or is closed."""


class PayloadsExhausted(PayloadTransportError):
    """Every payload sender has closed and every payload it sent was taken: the stream ended."""


class FenceTimeout(RolloutSyncError, TimeoutError):
    """The device fence after a weight sync did not complete within the limit."""


class TornWeightsError(RolloutSyncError):
    """The served weights are known to be a mix of two versions; generation is refused.

    Raised after a synchronous weight transfer failed part-way. The only way out is a complete,
    successful sync.
    """


class HarvestTimeout(RolloutSyncError, TimeoutError):
    """An explicit wait for a timer's pending samples ran past its limit.

    Only :meth:`~rollout_sync.WeightSyncTimer.drain` waits; harvesting never does.

    Attributes:
        timeout: the limit, in seconds.
        pending: samples whose end event was still incomplete when the wait gave up.
    """

    def __init__(self, message: str, *, timeout: float, pending: int) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.pending = pending


class MetricKeyCollisionError(RolloutSyncError, ValueError):
    """Two sources of a step's metrics use the same key; nothing was merged.

    Attributes:
        key: the metric name both used.
        first: the source that had it first (``"train_metrics"`` or a callback's name).
        second: the source that tried to add it again.
    """

    def __init__(self, message: str, *, key: str, first: str, second: str) -> None:
        super().__init__(message)
        self.key = key
        self.first = first
        self.second = second


class WeightBroadcastError(RolloutSyncError):
    """A trainer-side weight broadcast or its command announcement failed or timed out.

    Raised with the operation, the limit and the process group in the message; the cause (the
    backend's own error) is chained.
    """
