"""rollout_sync: ship new policy weights into running rollout engines, safely and measured.

The root namespace is the public API by role (docs/api.md): what a backend author subclasses,
what a framework decorates its command handlers with and runs its replicas on, what a payload
packer implements, what the trainer side calls, and the errors to catch. Everything else is
importable from its module (``rollout_sync.transfer``, ``rollout_sync.payload``,
``rollout_sync.backends.torch_lm``, ...); ``rollout_sync.testing`` is the conformance kit.

Names that this root exported before 0.2.0 and no longer does still resolve until 0.3.0, with a
:class:`DeprecationWarning` naming the module to import them from.

``__version__`` is the installed distribution's version (``pyproject.toml``, one source).
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _distribution_version
from typing import Any as _Any

from ._moved import resolve_moved as _resolve_moved

# Backend authors: engines and their safe points.
from .backend import KVCachePolicy as KVCachePolicy
from .backend import RolloutBase as RolloutBase
from .backend import ThreadedRolloutBackend as ThreadedRolloutBackend
from .buffer import SupportsWeightBuffer as SupportsWeightBuffer
from .buffer import WeightBuffer as WeightBuffer
from .buffer import install_inference_sync as install_inference_sync

# Payload packers.
from .egress import SupportsFlushPendingSends as SupportsFlushPendingSends
from .egress import SupportsHoldSends as SupportsHoldSends
from .egress import payload_egress_held as payload_egress_held

# Errors to catch.
from .errors import EgressHoldTimeout as EgressHoldTimeout
from .errors import PauseTimeout as PauseTimeout
from .errors import RolloutSyncError as RolloutSyncError
from .errors import TornWeightsError as TornWeightsError
from .errors import WeightMismatchError as WeightMismatchError
from .errors import WeightTransferError as WeightTransferError
from .errors import WorkerContractError as WorkerContractError
from .gate import Gate as Gate
from .guard import SyncReport as SyncReport
from .guard import WeightSyncWorker as WeightSyncWorker
from .guard import holds_payload_egress as holds_payload_egress
from .guard import pauses_generation as pauses_generation
from .guard import weight_sync_bracket as weight_sync_bracket
from .guard import weight_sync_handler as weight_sync_handler
from .metrics import WeightSyncTimer as WeightSyncTimer
from .payload import NCCLRolloutMixin as NCCLRolloutMixin
from .payload import PayloadReceiver as PayloadReceiver
from .payload import PayloadSender as PayloadSender
from .payload import new_payload_groups as new_payload_groups
from .scheduler import DecodeEngine as DecodeEngine
from .scheduler import GenerationRequest as GenerationRequest
from .scheduler import GenerationResult as GenerationResult
from .scheduler import RolloutTaskScheduler as RolloutTaskScheduler
from .scheduler import SamplingParams as SamplingParams

# Frameworks: the guard on their handlers.
from .sync.mode import SyncMode as SyncMode

# Seeing what happened.
from .trace import SpanKind as SpanKind
from .trace import Timeline as Timeline

# The trainer side.
from .trainer import TrainerCallback as TrainerCallback
from .trainer import TrainerCallbacks as TrainerCallbacks
from .trainer import TransferWeightPusher as TransferWeightPusher
from .trainer import WeightBroadcastCallback as WeightBroadcastCallback
from .trainer import merge_step_metrics as merge_step_metrics
from .transfer import TransferConfig as TransferConfig
from .transfer import WeightTransfer as WeightTransfer

# Frameworks: replicas, their commands and groups.
from .worker import P2R as P2R
from .worker import R2R as R2R
from .worker import RolloutWorker as RolloutWorker
from .worker import Stop as Stop
from .worker import SyncGroups as SyncGroups
from .worker import WorkerCommandChannel as WorkerCommandChannel
from .worker import build_sync_groups as build_sync_groups

try:
    __version__ = _distribution_version("rollout-sync")
except _PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "P2R",
    "R2R",
    "DecodeEngine",
    "EgressHoldTimeout",
    "Gate",
    "GenerationRequest",
    "GenerationResult",
    "KVCachePolicy",
    "NCCLRolloutMixin",
    "PauseTimeout",
    "PayloadReceiver",
    "PayloadSender",
    "RolloutBase",
    "RolloutSyncError",
    "RolloutTaskScheduler",
    "RolloutWorker",
    "SamplingParams",
    "SpanKind",
    "Stop",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "SupportsWeightBuffer",
    "SyncGroups",
    "SyncMode",
    "SyncReport",
    "ThreadedRolloutBackend",
    "Timeline",
    "TornWeightsError",
    "TrainerCallback",
    "TrainerCallbacks",
    "TransferConfig",
    "TransferWeightPusher",
    "WeightBroadcastCallback",
    "WeightBuffer",
    "WeightMismatchError",
    "WeightSyncTimer",
    "WeightSyncWorker",
    "WeightTransfer",
    "WeightTransferError",
    "WorkerCommandChannel",
    "WorkerContractError",
    "build_sync_groups",
    "holds_payload_egress",
    "install_inference_sync",
    "merge_step_metrics",
    "new_payload_groups",
    "pauses_generation",
    "payload_egress_held",
    "weight_sync_bracket",
    "weight_sync_handler",
]

_MOVED: dict[str, str] = {
    "BackendStatistics": "backend",
    "TinyCausalLM": "backends.torch_lm",
    "TinyLMConfig": "backends.torch_lm",
    "TorchLMBackend": "backends.torch_lm",
    "TorchLMStatistics": "backends.torch_lm",
    "TorchLMStreamBackend": "backends.torch_lm",
    "tiny_lm_weights": "backends.torch_lm",
    "PauseMode": "backends.vllm",
    "VLLMAsyncBackend": "backends.vllm",
    "VLLMBackendStatistics": "backends.vllm",
    "VLLMBlockingBackend": "backends.vllm",
    "VLLMEngineConfig": "backends.vllm",
    "VLLMGeneration": "backends.vllm",
    "VLLMRequest": "backends.vllm",
    "BufferStatistics": "buffer",
    "InstallReport": "buffer",
    "WeightSyncThread": "buffer",
    "init_process_group": "distributed",
    "new_group": "distributed",
    "wait_work": "distributed",
    "EgressHoldReport": "egress",
    "ChecksumMismatchError": "errors",
    "ChildFailure": "errors",
    "CollectiveError": "errors",
    "CollectiveTimeout": "errors",
    "EngineCallTimeout": "errors",
    "FenceTimeout": "errors",
    "GateTimeout": "errors",
    "GroupProcessError": "errors",
    "HarvestTimeout": "errors",
    "IngressHoldTimeout": "errors",
    "ManifestError": "errors",
    "ManifestRejected": "errors",
    "MetricKeyCollisionError": "errors",
    "PayloadBackpressureTimeout": "errors",
    "PayloadTimeout": "errors",
    "PayloadTransportError": "errors",
    "PayloadsExhausted": "errors",
    "SchedulerTimeout": "errors",
    "VLLMUnavailableError": "errors",
    "WeightBroadcastError": "errors",
    "WeightSyncThreadError": "errors",
    "WeightTransferTimeout": "errors",
    "WeightsNotLandedError": "errors",
    "WouldBlock": "errors",
    "GateStatistics": "gate",
    "WeightSyncBracket": "guard",
    "device_fence": "guard",
    "DurationSummary": "metrics",
    "Measurement": "metrics",
    "TimedSample": "metrics",
    "TimerClock": "metrics",
    "TimerStatistics": "metrics",
    "TimingEvent": "metrics",
    "cuda_timing_event": "metrics",
    "percentile": "metrics",
    "summarize": "metrics",
    "MetricsLogger": "metrics_logging",
    "log_metrics": "metrics_logging",
    "PayloadGroups": "payload",
    "ReceivedPayload": "payload",
    "ReceiverStatistics": "payload",
    "SenderStatistics": "payload",
    "FinishReason": "scheduler",
    "ParkReport": "scheduler",
    "SchedulerStatistics": "scheduler",
    "SequenceState": "scheduler",
    "StepReport": "scheduler",
    "find_free_port": "testing",
    "run_processes": "testing",
    "Overlap": "trace",
    "Span": "trace",
    "find_overlaps": "trace",
    "BroadcastCommandChannel": "trainer",
    "BroadcastWeightPusher": "trainer",
    "CommandChannel": "trainer",
    "CommandKind": "trainer",
    "QueueCommandChannel": "trainer",
    "WeightBroadcastStatistics": "trainer",
    "WeightPusher": "trainer",
    "WeightSyncCommand": "trainer",
    "OriginChecksums": "transfer",
    "TransferHooks": "transfer",
    "TransferStats": "transfer",
    "WeightManifest": "transfer",
    "named_weights": "transfer",
    "WeightSpec": "weights",
    "check_weights_match": "weights",
    "BackgroundEngine": "worker",
    "CommandResult": "worker",
    "CommandSource": "worker",
    "WorkerStatistics": "worker",
}
"""Names the root exported before 0.2.0, by the module of ``rollout_sync`` that has them now."""


def __getattr__(name: str) -> _Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_sync' has no attribute {name!r}")
    return _resolve_moved(__name__, f"{__name__}.{module}", name)
