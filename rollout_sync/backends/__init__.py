"""Rollout backends that ship with rollout_sync.

``torch_lm`` is the embedded default: a tiny causal LM in plain torch, for tests and the demo.
The public names are re-exported from :mod:`rollout_sync`.
"""

from .torch_lm import KVCachePolicy as KVCachePolicy
from .torch_lm import TinyCausalLM as TinyCausalLM
from .torch_lm import TinyLMConfig as TinyLMConfig
from .torch_lm import TorchLMBackend as TorchLMBackend
from .torch_lm import TorchLMStatistics as TorchLMStatistics
from .torch_lm import TorchLMStreamBackend as TorchLMStreamBackend
from .torch_lm import tiny_lm_weights as tiny_lm_weights

__all__ = [
    "KVCachePolicy",
    "TinyCausalLM",
    "TinyLMConfig",
    "TorchLMBackend",
    "TorchLMStatistics",
    "TorchLMStreamBackend",
    "tiny_lm_weights",
]
