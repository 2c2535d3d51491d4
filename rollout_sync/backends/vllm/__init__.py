"""vLLM as a rollout engine: one engine, in parts, each a module of its own.

* :mod:`.backend` - the backends a rollout worker drives: :class:`VLLMAsyncBackend` (stream
  generation on ``AsyncLLM``, parked at a step boundary) and :class:`VLLMBlockingBackend` (the
  offline ``LLM``, idle by construction between ``generate`` calls).
* :mod:`.access` - how a backend reaches its started engine, one object per engine type
  (:class:`~.access.AsyncLLMAccess`, :class:`~.access.LLMAccess`).
* :mod:`.write` - the write path: :class:`VLLMWritePlan` (the write options, checked together
  when a backend is built) and the writer that validates, ships, reads back and reports torn.
* :mod:`.config` - how an engine is started (:class:`VLLMEngineConfig`, :class:`PauseMode`)
  and vLLM imported on demand (:func:`require_vllm`).
* :mod:`.lora` - LoRA adapters written from memory: the backends' adapter table, the engine
  side's install and slot read-back (:func:`~.lora.vllm_lora_shapes`, :func:`~.lora.expected_slot`).
* :mod:`.generations` - requests and their results dated by weight version
  (:class:`VLLMRequest`, :class:`VLLMGeneration`).
* :mod:`.calls` - calls into an engine from other threads, bounded (:func:`run_coroutine`,
  :func:`park_engine`); below both the backends and the clients.
* :mod:`.worker` - the worker extension vLLM loads into each of its workers
  (:class:`~.worker.RolloutSyncWorkerExtension`): validated writes, read-back checks.
* :mod:`.engine` - the ``"rollout_sync"`` weight-transfer engine vLLM runs in its workers
  (:class:`~.engine.RolloutSyncWeightTransferEngine`).
* :mod:`.trainer` - its trainer side (:class:`~.trainer.RolloutSyncTrainerEngine`).
* :mod:`.client` - clients of vLLM's native weight-transfer API, and the guarded one
  (:class:`~.client.GuardedWeightSyncClient`).
* :mod:`.park` - a park flag vLLM's scheduler reads between steps (:class:`~.park.ParkFlag`).
* :mod:`.plugin` - the ``vllm.general_plugins`` entry point that registers the engines.

Importing this package does not import vLLM; each part imports it when used.
"""

from ...backend import KVCachePolicy as KVCachePolicy
from ...errors import EngineCallTimeout as EngineCallTimeout
from ...errors import VLLMUnavailableError as VLLMUnavailableError
from ...errors import WeightsNotLandedError as WeightsNotLandedError
from .backend import VLLMAsyncBackend as VLLMAsyncBackend
from .backend import VLLMBackendStatistics as VLLMBackendStatistics
from .backend import VLLMBlockingBackend as VLLMBlockingBackend
from .calls import park_engine as park_engine
from .calls import run_coroutine as run_coroutine
from .config import INSTALL_HINT as INSTALL_HINT
from .config import PauseMode as PauseMode
from .config import VLLMEngineConfig as VLLMEngineConfig
from .config import VLLMLoRASettings as VLLMLoRASettings
from .config import greedy_params as greedy_params
from .config import require_vllm as require_vllm
from .generations import VLLMGeneration as VLLMGeneration
from .generations import VLLMRequest as VLLMRequest
from .lora import vllm_lora_shapes as vllm_lora_shapes
from .write import VLLMWritePlan as VLLMWritePlan

__all__ = [
    "EngineCallTimeout",
    "KVCachePolicy",
    "PauseMode",
    "VLLMAsyncBackend",
    "VLLMBackendStatistics",
    "VLLMBlockingBackend",
    "VLLMEngineConfig",
    "VLLMGeneration",
    "VLLMLoRASettings",
    "VLLMRequest",
    "VLLMUnavailableError",
    "VLLMWritePlan",
    "WeightsNotLandedError",
    "greedy_params",
    "park_engine",
    "require_vllm",
    "run_coroutine",
    "vllm_lora_shapes",
]
