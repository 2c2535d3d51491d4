"""The models the learner trains, behind one small interface: the logits of whole sequences.

:class:`PolicyModel` is what :class:`~rollout_sync.learn.PolicyLearner` and
:func:`~rollout_sync.learn.sequence_logprobs` need of a causal LM: the float32 module (the
master the optimizer updates; its parameter names are the served tensors' names) and one
forward over a batch of right-padded sequences. Two come with the package:

* :class:`TinyLMPolicy`: the tiny torch LM the ``torch_lm`` replicas serve.
* :class:`CausalLMPolicy`: a transformers causal LM, such as the ``LlamaForCausalLM`` the
  ``vllm`` replicas serve (its parameters are named like the checkpoint's tensors, which is how
  vLLM's loader names them).

:class:`LearnerModel` is what an engine's registration says the learning job trains on it
(:func:`~rollout_sync.backends.register_engine`'s ``learner``): how to build the master as the
replicas start (version 0), the dtype the replicas serve, the vocabulary and context, and the
learning rate that learns the toy task in the default steps.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.torch_lm import TinyCausalLM, TinyLMConfig

__all__ = ["CausalLMPolicy", "LearnerModel", "PolicyModel", "TinyLMPolicy"]


class PolicyModel(ABC):
    """A causal LM the learner trains: its float32 ``module`` and the logits of whole sequences.

    Built around a module whose every parameter is float32 (the master): anything else is a
    :class:`ValueError` naming the parameter, since the optimizer would step a lower precision.
    """

    def __init__(self, module: torch.nn.Module, *, vocab_size: int, max_seq_len: int) -> None:
        low = [n for n, p in module.named_parameters() if p.dtype != torch.float32]
        if low:
            raise ValueError(
                f"{type(self).__name__}: the learner's master is float32; parameters "
                f"{low[:3]}{' ...' if len(low) > 3 else ''} are not (build the module in "
                "float32 and serve a cast copy)"
            )
        self.module = module
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len

    def __repr__(self) -> str:
        params = sum(p.numel() for p in self.module.parameters())
        return (
            f"<{type(self).__name__} {type(self.module).__name__}: {params} parameters, "
            f"vocab {self.vocab_size}, context {self.max_seq_len}>"
        )

    @abstractmethod
    def logits(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """``[B, W, vocab]`` logits of every position of ``tokens`` (``[B, W]`` int64, each row
        right-padded; ``real`` marks its real tokens): position ``i`` predicts token ``i + 1``.
        With gradient, in one forward, no cache."""


class TinyLMPolicy(PolicyModel):
    """The tiny torch LM (:class:`~rollout_sync.backends.torch_lm.TinyCausalLM`)."""

    module: TinyCausalLM

    def __init__(self, module: TinyCausalLM) -> None:
        cfg = module.config
        super().__init__(module, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len)

    @classmethod
    def build(cls, config: TinyLMConfig) -> TinyLMPolicy:
        """The float32 master of the model ``config`` describes (its seed's weights)."""
        return cls(TinyCausalLM.build(dataclasses.replace(config, dtype=torch.float32)))

    def logits(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        cfg = self.module.config
        batch, width = tokens.shape
        empty = torch.zeros(cfg.n_layers, batch, cfg.n_heads, 0, cfg.head_dim, dtype=cfg.dtype)
        positions = torch.arange(width).expand(batch, width)
        no_past = torch.zeros(batch, 0, dtype=torch.bool)
        logits: torch.Tensor = self.module(tokens, positions, empty, empty, no_past, real)[0]
        return logits


class CausalLMPolicy(PolicyModel):
    """A transformers causal LM (``AutoModelForCausalLM``'s kind: ``model(input_ids,
    attention_mask=...).logits``), such as ``LlamaForCausalLM``."""

    def __init__(self, module: Any) -> None:
        config = getattr(module, "config", None)
        if not isinstance(module, torch.nn.Module) or config is None:
            raise TypeError(
                f"CausalLMPolicy wraps a transformers causal LM (a torch module with a "
                f"config), not {type(module).__name__}"
            )
        super().__init__(
            module,
            vocab_size=int(config.vocab_size),
            max_seq_len=int(config.max_position_embeddings),
        )

    def logits(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.module(input_ids=tokens, attention_mask=real.long()).logits
        return logits


@dataclass(frozen=True)
class LearnerModel:
    """What the learning job trains on an engine (its registration's ``learner``): checked
    against a :class:`~rollout_sync.learn.LearnConfig` before anything starts, built in the
    trainer's process."""

    build: Callable[[], PolicyModel]
    """The float32 master with the weights the replicas start from (version 0)."""
    served_dtype: torch.dtype
    """What the replicas serve, and so what the trainer pushes (the master, cast)."""
    vocab_size: int
    max_seq_len: int
    lr: float
    """AdamW's learning rate that learns the toy task in ``rollout-sync demo --learn``'s default
    steps (``--lr`` overrides it)."""

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise TypeError(f"LearnerModel: build must be callable, not {self.build!r}")
        if not self.served_dtype.is_floating_point:
            raise ValueError(f"LearnerModel: served_dtype {self.served_dtype} is not a float type")
        if self.vocab_size < 1 or self.max_seq_len < 1 or not self.lr >= 0:
            raise ValueError(
                f"LearnerModel: vocab_size ({self.vocab_size}) and max_seq_len "
                f"({self.max_seq_len}) must be at least 1, lr ({self.lr}) at least 0"
            )
