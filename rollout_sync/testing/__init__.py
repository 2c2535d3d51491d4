"""The conformance kit: real small fakes, tiny models and a process harness, for tests.

Like ``trio.testing``, everything here is for checking weight-sync code, never for running it
in production; the production classes carry no test switches, and what exists only to prove a
race lives here as a subclass.

* Fakes (:mod:`.fakes`): :class:`VersionStampedModel` (a torn-read detector),
  :class:`TornReadBackend` / :class:`AsyncTornReadBackend`, :class:`RecordingRollout`,
  :class:`RecordingPacker` / :class:`FlushOnlyPacker` / :class:`PlainPacker`, :class:`EventLog`,
  :class:`FakeCudaStream` / :class:`FakeCudaEvent`, :func:`count_host_syncs`.
* Races rebuilt on purpose: :class:`CheckThenActScheduler` (:mod:`.scheduler`),
  :class:`StallingWorkerExtension` (:mod:`.vllm_worker`, a vLLM engine that can be held between
  steps).
* The ``paused()`` contract suite (:mod:`.paused_contract`): describe a backend in a
  :class:`PausedContract` and run :data:`PAUSED_CONTRACT_CHECKS` on it (parametrized in pytest)
  or :func:`run_paused_contract`; :class:`Parking` and :class:`PauseSharing` say how it parks.
* Harness (:mod:`.harness`, :mod:`.processes`, :mod:`.faults`, :mod:`.outcomes`):
  :class:`InProcessWorker`, :func:`weights_digest`, :func:`run_processes`, :func:`run_group`,
  :func:`find_free_port`, :class:`ChildFailure`; a declarative :class:`FaultSchedule` of
  :class:`Kill` s at :func:`fault_point` s (:func:`transfer_fault_hooks`); what a child
  reports: :class:`ErrorReport` (an exception) and :class:`SyncOutcome` (how a rank's sync
  ended).
* Links (:mod:`.emulated_nic`): :class:`EmulatedNic`, :class:`PacedCollectives`,
  :class:`PacedWeightTransfer` (a transfer whose collectives are paced at a set rate and latency,
  so that benchmarks on one machine compete for modelled links), :class:`PacedShardedTransfer`
  (the same for a sharded transfer's point-to-point buckets), :class:`NicStatistics`.
* Models (:mod:`.tiny_llama`): :func:`build_tiny_llama`, :func:`tiny_llama`,
  :func:`random_llama_weights`, :class:`greedy_reference`, :func:`find_sync_split`
  (``transformers`` imported lazily).
"""

from ..errors import ChildFailure as ChildFailure
from ..errors import GroupProcessError as GroupProcessError
from .emulated_nic import EmulatedNic as EmulatedNic
from .emulated_nic import NicStatistics as NicStatistics
from .emulated_nic import PacedCollectives as PacedCollectives
from .emulated_nic import PacedShardedTransfer as PacedShardedTransfer
from .emulated_nic import PacedWeightTransfer as PacedWeightTransfer
from .fakes import AsyncTornReadBackend as AsyncTornReadBackend
from .fakes import EventLog as EventLog
from .fakes import FakeCudaEvent as FakeCudaEvent
from .fakes import FakeCudaStream as FakeCudaStream
from .fakes import FlushOnlyPacker as FlushOnlyPacker
from .fakes import ForwardResult as ForwardResult
from .fakes import HostSyncCount as HostSyncCount
from .fakes import IdleFlatRollout as IdleFlatRollout
from .fakes import InstallRecord as InstallRecord
from .fakes import PlainPacker as PlainPacker
from .fakes import RecordingPacker as RecordingPacker
from .fakes import RecordingRollout as RecordingRollout
from .fakes import TornReadBackend as TornReadBackend
from .fakes import VersionStampedModel as VersionStampedModel
from .fakes import count_host_syncs as count_host_syncs
from .faults import FaultSchedule as FaultSchedule
from .faults import Kill as Kill
from .faults import fault_point as fault_point
from .faults import transfer_fault_hooks as transfer_fault_hooks
from .harness import InProcessWorker as InProcessWorker
from .harness import weights_digest as weights_digest
from .outcomes import ErrorReport as ErrorReport
from .outcomes import SyncOutcome as SyncOutcome
from .paused_contract import PAUSED_CONTRACT_CHECKS as PAUSED_CONTRACT_CHECKS
from .paused_contract import Parking as Parking
from .paused_contract import PausedCheck as PausedCheck
from .paused_contract import PausedContract as PausedContract
from .paused_contract import PausedContractReport as PausedContractReport
from .paused_contract import PauseSharing as PauseSharing
from .paused_contract import run_paused_contract as run_paused_contract
from .processes import find_free_port as find_free_port
from .processes import run_group as run_group
from .processes import run_processes as run_processes
from .scheduler import CheckThenActScheduler as CheckThenActScheduler
from .tiny_llama import TINY_LLAMA as TINY_LLAMA
from .tiny_llama import build_tiny_llama as build_tiny_llama
from .tiny_llama import find_sync_split as find_sync_split
from .tiny_llama import greedy_reference as greedy_reference
from .tiny_llama import random_llama_weights as random_llama_weights
from .tiny_llama import tiny_llama as tiny_llama
from .vllm_worker import STALLING_WORKER_EXTENSION as STALLING_WORKER_EXTENSION
from .vllm_worker import StallingWorkerExtension as StallingWorkerExtension

__all__ = [
    "PAUSED_CONTRACT_CHECKS",
    "STALLING_WORKER_EXTENSION",
    "TINY_LLAMA",
    "AsyncTornReadBackend",
    "CheckThenActScheduler",
    "ChildFailure",
    "EmulatedNic",
    "ErrorReport",
    "EventLog",
    "FakeCudaEvent",
    "FakeCudaStream",
    "FaultSchedule",
    "FlushOnlyPacker",
    "ForwardResult",
    "GroupProcessError",
    "HostSyncCount",
    "IdleFlatRollout",
    "InProcessWorker",
    "InstallRecord",
    "Kill",
    "NicStatistics",
    "PacedCollectives",
    "PacedShardedTransfer",
    "PacedWeightTransfer",
    "Parking",
    "PauseSharing",
    "PausedCheck",
    "PausedContract",
    "PausedContractReport",
    "PlainPacker",
    "RecordingPacker",
    "RecordingRollout",
    "StallingWorkerExtension",
    "SyncOutcome",
    "TornReadBackend",
    "VersionStampedModel",
    "build_tiny_llama",
    "count_host_syncs",
    "fault_point",
    "find_free_port",
    "find_sync_split",
    "greedy_reference",
    "random_llama_weights",
    "run_group",
    "run_paused_contract",
    "run_processes",
    "tiny_llama",
    "transfer_fault_hooks",
    "weights_digest",
]
