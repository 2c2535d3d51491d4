"""rollout_sync: ship new policy weights into running rollout engines, safely and measured.

The public API is flat: everything a user needs is importable from here.
"""

from .backend import BackendStatistics as BackendStatistics
from .backend import RolloutBase as RolloutBase
from .backend import ThreadedRolloutBackend as ThreadedRolloutBackend
from .backends.vllm import EngineCallTimeout as EngineCallTimeout
from .backends.vllm import KVCachePolicy as KVCachePolicy
from .backends.vllm import PauseMode as PauseMode
from .backends.vllm import VLLMAsyncBackend as VLLMAsyncBackend
from .backends.vllm import VLLMBackendStatistics as VLLMBackendStatistics
from .backends.vllm import VLLMBlockingBackend as VLLMBlockingBackend
from .backends.vllm import VLLMEngineConfig as VLLMEngineConfig
from .backends.vllm import VLLMGeneration as VLLMGeneration
from .backends.vllm import VLLMRequest as VLLMRequest
from .backends.vllm import VLLMUnavailableError as VLLMUnavailableError
from .backends.vllm import WeightsNotLandedError as WeightsNotLandedError
from .egress import EgressHoldReport as EgressHoldReport
from .egress import SupportsFlushPendingSends as SupportsFlushPendingSends
from .egress import SupportsHoldSends as SupportsHoldSends
from .egress import payload_egress_held as payload_egress_held
from .errors import EgressHoldTimeout as EgressHoldTimeout
from .errors import FenceTimeout as FenceTimeout
from .errors import GateTimeout as GateTimeout
from .errors import PauseTimeout as PauseTimeout
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
from .trace import Overlap as Overlap
from .trace import Span as Span
from .trace import SpanKind as SpanKind
from .trace import Timeline as Timeline
from .trace import find_overlaps as find_overlaps
from .weights import WeightMismatchError as WeightMismatchError
from .weights import WeightSpec as WeightSpec
from .weights import check_weights_match as check_weights_match

__version__ = "0.1.0"

__all__ = [
    "BackendStatistics",
    "DurationSummary",
    "EgressHoldReport",
    "EgressHoldTimeout",
    "EngineCallTimeout",
    "FenceTimeout",
    "Gate",
    "GateStatistics",
    "GateTimeout",
    "KVCachePolicy",
    "Overlap",
    "PauseMode",
    "PauseTimeout",
    "RolloutBase",
    "RolloutSyncError",
    "Span",
    "SpanKind",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "SyncMode",
    "SyncReport",
    "ThreadedRolloutBackend",
    "Timeline",
    "TornWeightsError",
    "VLLMAsyncBackend",
    "VLLMBackendStatistics",
    "VLLMBlockingBackend",
    "VLLMEngineConfig",
    "VLLMGeneration",
    "VLLMRequest",
    "VLLMUnavailableError",
    "WeightMismatchError",
    "WeightSpec",
    "WeightSyncBracket",
    "WeightsNotLandedError",
    "WouldBlock",
    "check_weights_match",
    "device_fence",
    "find_overlaps",
    "holds_payload_egress",
    "pauses_generation",
    "payload_egress_held",
    "percentile",
    "summarize",
    "weight_sync_bracket",
    "weight_sync_handler",
]
