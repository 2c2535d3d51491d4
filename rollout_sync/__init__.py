"""rollout_sync: ship new policy weights into running rollout engines, safely and measured.

The public API is flat: everything a user needs is importable from here.
"""

from .backend import BackendStatistics as BackendStatistics
from .backend import RolloutBase as RolloutBase
from .backend import ThreadedRolloutBackend as ThreadedRolloutBackend
from .egress import EgressHoldReport as EgressHoldReport
from .egress import SupportsFlushPendingSends as SupportsFlushPendingSends
from .egress import SupportsHoldSends as SupportsHoldSends
from .egress import payload_egress_held as payload_egress_held
from .errors import EgressHoldTimeout as EgressHoldTimeout
from .errors import FenceTimeout as FenceTimeout
from .errors import GateTimeout as GateTimeout
from .errors import IngressHoldTimeout as IngressHoldTimeout
from .errors import PauseTimeout as PauseTimeout
from .errors import PayloadBackpressureTimeout as PayloadBackpressureTimeout
from .errors import PayloadsExhausted as PayloadsExhausted
from .errors import PayloadTimeout as PayloadTimeout
from .errors import PayloadTransportError as PayloadTransportError
from .errors import RolloutSyncError as RolloutSyncError
from .errors import TornWeightsError as TornWeightsError
from .errors import WouldBlock as WouldBlock
from .gate import Gate as Gate
from .gate import GateStatistics as GateStatistics
from .guard import SyncMode as SyncMode
from .guard import SyncReport as SyncReport
from .guard import WeightSyncBracket as WeightSyncBracket
from .guard import device_fence as device_fence
from .guard import holds_payload_egress as holds_payload_egress
from .guard import pauses_generation as pauses_generation
from .guard import weight_sync_bracket as weight_sync_bracket
from .guard import weight_sync_handler as weight_sync_handler
from .metrics import DurationSummary as DurationSummary
from .metrics import percentile as percentile
from .metrics import summarize as summarize
from .receiver import PayloadReceiver as PayloadReceiver
from .receiver import ReceivedPayload as ReceivedPayload
from .receiver import ReceiverStatistics as ReceiverStatistics
from .trace import Overlap as Overlap
from .trace import Span as Span
from .trace import SpanKind as SpanKind
from .trace import Timeline as Timeline
from .trace import find_overlaps as find_overlaps
from .transport import NCCLRolloutMixin as NCCLRolloutMixin
from .transport import PayloadGroups as PayloadGroups
from .transport import PayloadSender as PayloadSender
from .transport import SenderStatistics as SenderStatistics
from .transport import new_payload_groups as new_payload_groups
from .weights import WeightMismatchError as WeightMismatchError
from .weights import WeightSpec as WeightSpec
from .weights import check_weights_match as check_weights_match

__version__ = "0.1.0"

__all__ = [
    "BackendStatistics",
    "DurationSummary",
    "EgressHoldReport",
    "EgressHoldTimeout",
    "FenceTimeout",
    "Gate",
    "GateStatistics",
    "GateTimeout",
    "IngressHoldTimeout",
    "NCCLRolloutMixin",
    "Overlap",
    "PauseTimeout",
    "PayloadBackpressureTimeout",
    "PayloadGroups",
    "PayloadReceiver",
    "PayloadSender",
    "PayloadTimeout",
    "PayloadTransportError",
    "PayloadsExhausted",
    "ReceivedPayload",
    "ReceiverStatistics",
    "RolloutBase",
    "RolloutSyncError",
    "SenderStatistics",
    "Span",
    "SpanKind",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "SyncMode",
    "SyncReport",
    "ThreadedRolloutBackend",
    "Timeline",
    "TornWeightsError",
    "WeightMismatchError",
    "WeightSpec",
    "WeightSyncBracket",
    "WouldBlock",
    "check_weights_match",
    "device_fence",
    "find_overlaps",
    "holds_payload_egress",
    "new_payload_groups",
    "pauses_generation",
    "payload_egress_held",
    "percentile",
    "summarize",
    "weight_sync_bracket",
    "weight_sync_handler",
]
