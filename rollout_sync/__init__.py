"""rollout_sync: ship new policy weights into running rollout engines, safely and measured.

The public API is flat: everything a user needs is importable from here.
"""

from .backend import BackendStatistics as BackendStatistics
from .backend import KVCachePolicy as KVCachePolicy
from .backend import RolloutBase as RolloutBase
from .backend import ThreadedRolloutBackend as ThreadedRolloutBackend
from .backends import TinyCausalLM as TinyCausalLM
from .backends import TinyLMConfig as TinyLMConfig
from .backends import TorchLMBackend as TorchLMBackend
from .backends import TorchLMStatistics as TorchLMStatistics
from .backends import TorchLMStreamBackend as TorchLMStreamBackend
from .backends import tiny_lm_weights as tiny_lm_weights
from .backends.vllm import EngineCallTimeout as EngineCallTimeout
from .backends.vllm import PauseMode as PauseMode
from .backends.vllm import VLLMAsyncBackend as VLLMAsyncBackend
from .backends.vllm import VLLMBackendStatistics as VLLMBackendStatistics
from .backends.vllm import VLLMBlockingBackend as VLLMBlockingBackend
from .backends.vllm import VLLMEngineConfig as VLLMEngineConfig
from .backends.vllm import VLLMGeneration as VLLMGeneration
from .backends.vllm import VLLMRequest as VLLMRequest
from .backends.vllm import VLLMUnavailableError as VLLMUnavailableError
from .backends.vllm import WeightsNotLandedError as WeightsNotLandedError
from .buffer import BufferStatistics as BufferStatistics
from .buffer import InstallReport as InstallReport
from .buffer import SupportsWeightBuffer as SupportsWeightBuffer
from .buffer import WeightBuffer as WeightBuffer
from .buffer import WeightSyncThread as WeightSyncThread
from .buffer import WeightSyncThreadError as WeightSyncThreadError
from .buffer import install_inference_sync as install_inference_sync
from .distributed import ChildFailure as ChildFailure
from .distributed import CollectiveError as CollectiveError
from .distributed import CollectiveTimeout as CollectiveTimeout
from .distributed import GroupProcessError as GroupProcessError
from .distributed import find_free_port as find_free_port
from .distributed import init_process_group as init_process_group
from .distributed import new_group as new_group
from .distributed import run_processes as run_processes
from .distributed import wait_work as wait_work
from .egress import EgressHoldReport as EgressHoldReport
from .egress import SupportsFlushPendingSends as SupportsFlushPendingSends
from .egress import SupportsHoldSends as SupportsHoldSends
from .egress import payload_egress_held as payload_egress_held
from .errors import EgressHoldTimeout as EgressHoldTimeout
from .errors import FenceTimeout as FenceTimeout
from .errors import GateTimeout as GateTimeout
from .errors import HarvestTimeout as HarvestTimeout
from .errors import IngressHoldTimeout as IngressHoldTimeout
from .errors import MetricKeyCollisionError as MetricKeyCollisionError
from .errors import PauseTimeout as PauseTimeout
from .errors import PayloadBackpressureTimeout as PayloadBackpressureTimeout
from .errors import PayloadsExhausted as PayloadsExhausted
from .errors import PayloadTimeout as PayloadTimeout
from .errors import PayloadTransportError as PayloadTransportError
from .errors import RolloutSyncError as RolloutSyncError
from .errors import TornWeightsError as TornWeightsError
from .errors import WeightBroadcastError as WeightBroadcastError
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
from .metrics import Measurement as Measurement
from .metrics import TimedSample as TimedSample
from .metrics import TimerClock as TimerClock
from .metrics import TimerStatistics as TimerStatistics
from .metrics import TimingEvent as TimingEvent
from .metrics import WeightSyncTimer as WeightSyncTimer
from .metrics import cuda_timing_event as cuda_timing_event
from .metrics import percentile as percentile
from .metrics import summarize as summarize
from .metrics_logging import MetricsLogger as MetricsLogger
from .metrics_logging import log_metrics as log_metrics
from .receiver import PayloadReceiver as PayloadReceiver
from .receiver import ReceivedPayload as ReceivedPayload
from .receiver import ReceiverStatistics as ReceiverStatistics
from .scheduler import DecodeEngine as DecodeEngine
from .scheduler import FinishReason as FinishReason
from .scheduler import GenerationRequest as GenerationRequest
from .scheduler import GenerationResult as GenerationResult
from .scheduler import ParkReport as ParkReport
from .scheduler import RolloutTaskScheduler as RolloutTaskScheduler
from .scheduler import SamplingParams as SamplingParams
from .scheduler import SchedulerStatistics as SchedulerStatistics
from .scheduler import SchedulerTimeout as SchedulerTimeout
from .scheduler import SequenceState as SequenceState
from .scheduler import StepReport as StepReport
from .trace import Overlap as Overlap
from .trace import Span as Span
from .trace import SpanKind as SpanKind
from .trace import Timeline as Timeline
from .trace import find_overlaps as find_overlaps
from .trainer import BroadcastCommandChannel as BroadcastCommandChannel
from .trainer import BroadcastWeightPusher as BroadcastWeightPusher
from .trainer import CommandChannel as CommandChannel
from .trainer import CommandKind as CommandKind
from .trainer import QueueCommandChannel as QueueCommandChannel
from .trainer import TrainerCallback as TrainerCallback
from .trainer import TrainerCallbacks as TrainerCallbacks
from .trainer import TransferWeightPusher as TransferWeightPusher
from .trainer import WeightBroadcastCallback as WeightBroadcastCallback
from .trainer import WeightBroadcastStatistics as WeightBroadcastStatistics
from .trainer import WeightPusher as WeightPusher
from .trainer import WeightSyncCommand as WeightSyncCommand
from .trainer import merge_step_metrics as merge_step_metrics
from .transfer import ChecksumMismatchError as ChecksumMismatchError
from .transfer import ManifestError as ManifestError
from .transfer import ManifestRejected as ManifestRejected
from .transfer import OriginChecksums as OriginChecksums
from .transfer import TransferConfig as TransferConfig
from .transfer import TransferHooks as TransferHooks
from .transfer import TransferStats as TransferStats
from .transfer import WeightManifest as WeightManifest
from .transfer import WeightTransfer as WeightTransfer
from .transfer import WeightTransferError as WeightTransferError
from .transfer import WeightTransferTimeout as WeightTransferTimeout
from .transfer import named_weights as named_weights
from .transport import NCCLRolloutMixin as NCCLRolloutMixin
from .transport import PayloadGroups as PayloadGroups
from .transport import PayloadSender as PayloadSender
from .transport import SenderStatistics as SenderStatistics
from .transport import new_payload_groups as new_payload_groups
from .weights import WeightMismatchError as WeightMismatchError
from .weights import WeightSpec as WeightSpec
from .weights import check_weights_match as check_weights_match
from .worker import P2R as P2R
from .worker import R2R as R2R
from .worker import BackgroundEngine as BackgroundEngine
from .worker import CommandResult as CommandResult
from .worker import CommandSource as CommandSource
from .worker import RolloutWorker as RolloutWorker
from .worker import Stop as Stop
from .worker import SyncGroups as SyncGroups
from .worker import WorkerStatistics as WorkerStatistics
from .worker import build_sync_groups as build_sync_groups

__version__ = "0.1.0"

__all__ = [
    "P2R",
    "R2R",
    "BackendStatistics",
    "BackgroundEngine",
    "BroadcastCommandChannel",
    "BroadcastWeightPusher",
    "BufferStatistics",
    "ChecksumMismatchError",
    "ChildFailure",
    "CollectiveError",
    "CollectiveTimeout",
    "CommandChannel",
    "CommandKind",
    "CommandResult",
    "CommandSource",
    "DecodeEngine",
    "DurationSummary",
    "EgressHoldReport",
    "EgressHoldTimeout",
    "EngineCallTimeout",
    "FenceTimeout",
    "FinishReason",
    "Gate",
    "GateStatistics",
    "GateTimeout",
    "GenerationRequest",
    "GenerationResult",
    "GroupProcessError",
    "HarvestTimeout",
    "IngressHoldTimeout",
    "InstallReport",
    "KVCachePolicy",
    "ManifestError",
    "ManifestRejected",
    "Measurement",
    "MetricKeyCollisionError",
    "MetricsLogger",
    "NCCLRolloutMixin",
    "OriginChecksums",
    "Overlap",
    "ParkReport",
    "PauseMode",
    "PauseTimeout",
    "PayloadBackpressureTimeout",
    "PayloadGroups",
    "PayloadReceiver",
    "PayloadSender",
    "PayloadTimeout",
    "PayloadTransportError",
    "PayloadsExhausted",
    "QueueCommandChannel",
    "ReceivedPayload",
    "ReceiverStatistics",
    "RolloutBase",
    "RolloutSyncError",
    "RolloutTaskScheduler",
    "RolloutWorker",
    "SamplingParams",
    "SchedulerStatistics",
    "SchedulerTimeout",
    "SenderStatistics",
    "SequenceState",
    "Span",
    "SpanKind",
    "StepReport",
    "Stop",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "SupportsWeightBuffer",
    "SyncGroups",
    "SyncMode",
    "SyncReport",
    "ThreadedRolloutBackend",
    "TimedSample",
    "Timeline",
    "TimerClock",
    "TimerStatistics",
    "TimingEvent",
    "TinyCausalLM",
    "TinyLMConfig",
    "TorchLMBackend",
    "TorchLMStatistics",
    "TorchLMStreamBackend",
    "TornWeightsError",
    "TrainerCallback",
    "TrainerCallbacks",
    "TransferConfig",
    "TransferHooks",
    "TransferStats",
    "TransferWeightPusher",
    "VLLMAsyncBackend",
    "VLLMBackendStatistics",
    "VLLMBlockingBackend",
    "VLLMEngineConfig",
    "VLLMGeneration",
    "VLLMRequest",
    "VLLMUnavailableError",
    "WeightBroadcastCallback",
    "WeightBroadcastError",
    "WeightBroadcastStatistics",
    "WeightBuffer",
    "WeightManifest",
    "WeightMismatchError",
    "WeightPusher",
    "WeightSpec",
    "WeightSyncBracket",
    "WeightSyncCommand",
    "WeightSyncThread",
    "WeightSyncThreadError",
    "WeightSyncTimer",
    "WeightTransfer",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightsNotLandedError",
    "WorkerStatistics",
    "WouldBlock",
    "build_sync_groups",
    "check_weights_match",
    "cuda_timing_event",
    "device_fence",
    "find_free_port",
    "find_overlaps",
    "holds_payload_egress",
    "init_process_group",
    "install_inference_sync",
    "log_metrics",
    "merge_step_metrics",
    "named_weights",
    "new_group",
    "new_payload_groups",
    "pauses_generation",
    "payload_egress_held",
    "percentile",
    "run_processes",
    "summarize",
    "tiny_lm_weights",
    "wait_work",
    "weight_sync_bracket",
    "weight_sync_handler",
]
