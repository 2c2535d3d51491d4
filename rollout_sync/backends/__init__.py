"""Rollout engines behind :class:`~rollout_sync.RolloutBase`: engines only.

Each backend lives in its own module; import its names from there.

* :mod:`rollout_sync.backends.torch_lm` - the embedded default: a tiny causal LM in plain torch,
  blocking (:class:`~rollout_sync.backends.torch_lm.TorchLMBackend`) and streaming on the
  scheduler (:class:`~rollout_sync.backends.torch_lm.TorchLMStreamBackend`).
* :mod:`rollout_sync.backends.vllm` - vLLM (``pip install 'rollout-sync[vllm]'``), with its
  engine-side worker extension in :mod:`rollout_sync.backends.vllm.worker`. It imports vLLM
  lazily, so ``import rollout_sync`` works without it.
"""

from .torch_lm import TinyCausalLM as TinyCausalLM
from .torch_lm import TinyLMConfig as TinyLMConfig
from .torch_lm import TorchLMBackend as TorchLMBackend
from .torch_lm import TorchLMStatistics as TorchLMStatistics
from .torch_lm import TorchLMStreamBackend as TorchLMStreamBackend
from .torch_lm import tiny_lm_weights as tiny_lm_weights

__all__ = [
    "TinyCausalLM",
    "TinyLMConfig",
    "TorchLMBackend",
    "TorchLMStatistics",
    "TorchLMStreamBackend",
    "tiny_lm_weights",
]
