"""Registers the ``"rollout_sync"`` weight-transfer engines with vLLM's factories.

vLLM selects a weight-transfer engine by name (``weight_transfer_config={"backend": ...}``) from
two registries: the worker side (``WeightTransferEngineFactory``, in every engine process) and
the trainer side (``WeightTransferTrainerFactory``). :func:`register_engines` adds this
package's engines to both, lazily (by module path: nothing is imported until vLLM builds one).

It runs three ways, so every process that may build an engine has it:

* as a ``vllm.general_plugins`` entry point (``pyproject.toml``), which vLLM loads in every
  process it starts (engine core, workers) and in ``vllm serve``;
* on import of the worker extension module
  (:mod:`rollout_sync.backends.vllm.worker`), which vLLM imports in each worker before it
  builds the engine, for installs where entry points are not visible (a checkout on
  ``PYTHONPATH``);
* by hand, in a trainer process, before ``WeightTransferTrainerFactory.trainer_init``
  (importing :mod:`rollout_sync.backends.vllm.trainer` does it).

Idempotent: a name already registered is left as it is.
"""

from __future__ import annotations

__all__ = ["ENGINE_NAME", "register_engines"]

ENGINE_NAME = "rollout_sync"
"""The name both engines are registered under: ``weight_transfer_config={"backend": ...}``."""


def register_engines() -> None:
    """Register the worker-side and trainer-side ``"rollout_sync"`` engines (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            ENGINE_NAME, "rollout_sync.backends.vllm.engine", "RolloutSyncWeightTransferEngine"
        )
    if ENGINE_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            ENGINE_NAME, "rollout_sync.backends.vllm.trainer", "RolloutSyncTrainerEngine"
        )
