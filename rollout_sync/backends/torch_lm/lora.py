"""LoRA adapters on the embedded engine: slots of their own, served per request.

Each adapter the engine serves has a :class:`AdapterSlot`: its manifest
(:class:`~rollout_sync.lora.LoRAConfig`), the tensors requests on it read (named as
:func:`~rollout_sync.lora.adapter_specs` names them), its version and two counters:

* ``epoch`` moves with every write and every commit, as the engine's weights epoch does for
  the base weights: a sequence on the adapter whose cache predates it is handled by the
  engine's KV policy at its next step; sequences on the base model or on other adapters keep
  theirs.
* ``seq`` is the slot's own seqlock (odd while a write runs): a forward that reads the slot
  samples it between its blocks, so a write that lands inside that forward is a torn read.

A batched forward adapts per row (:class:`LoRABatch`): each adapted linear layer's output gets
:func:`~rollout_sync.lora.lora_delta` added on the rows of the requests on that adapter, and
no other row is touched, so a request on the base model produces exactly the tokens it produces
with no adapter served. Tensor parallelism is out of scope: the engine refuses an adapter there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ...lora import ALPHA_KEY, LoRAConfig, adapter_specs, iter_modules, lora_delta


class ModelDims(Protocol):
    """What :func:`tiny_lm_lora_shapes` reads of a :class:`~rollout_sync.backends.torch_lm.
    TinyLMConfig` (named structurally: this module sits below the package that defines it)."""

    @property
    def d_model(self) -> int: ...

    @property
    def d_ff(self) -> int: ...

    @property
    def n_layers(self) -> int: ...


__all__ = ["LORA_TARGETS", "AdapterSlot", "LoRABatch", "tiny_lm_lora_shapes"]

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""The linear layers of each block an adapter may target (``"blocks.{i}.{name}"``)."""


def tiny_lm_lora_shapes(config: ModelDims) -> dict[str, tuple[int, int]]:
    """Every linear layer of ``config``'s model an adapter may target, by module path
    (``"blocks.0.qkv"``), as ``(in_features, out_features)``: what
    :func:`~rollout_sync.lora.adapter_specs` and :meth:`~rollout_sync.lora.LoRAConfig.check`
    take."""
    d, ff = config.d_model, config.d_ff
    per_block = {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, ff), "fc2": (ff, d)}
    return {
        f"blocks.{i}.{name}": per_block[name]
        for i in range(config.n_layers)
        for name in LORA_TARGETS
    }


class AdapterSlot:
    """One adapter's served tensors and bookkeeping (module docstring).

    The engine's write lock serializes writes to it; a forward only reads. Zeros at version 0:
    ``B = 0`` and ``alpha = 0`` add nothing until a version lands.
    """

    __slots__ = ("config", "epoch", "modules", "seq", "tensors", "torn", "version")

    def __init__(
        self, config: LoRAConfig, shapes: Mapping[str, tuple[int, int]], device: str
    ) -> None:
        self.config = config
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for name, spec in adapter_specs(config, shapes).items()
        }
        """What requests on the adapter read; writes land here in place."""
        self.modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            module: (self.tensors[a], self.tensors[b]) for module, a, b in iter_modules(config)
        }
        """``(A, B)`` per target module (views of :attr:`tensors`)."""
        self.version = 0
        self.epoch = 0
        """Moves with every write and commit: caches of sequences on the adapter older than
        it were computed under other adapter weights."""
        self.seq = 0
        """Odd while a write runs (the slot's seqlock)."""
        self.torn: str | None = None
        """Why the slot is torn (a write failed part-way), until a complete version commits."""

    @property
    def alpha(self) -> torch.Tensor:
        return self.tensors[ALPHA_KEY]


class LoRABatch:
    """Which rows of one batched forward read which adapter.

    Args:
        groups: ``(rows, slot)`` per adapter in the batch: the batch indices of its requests.
        device: where the forward runs.
    """

    def __init__(self, groups: Sequence[tuple[Sequence[int], AdapterSlot]], device: str) -> None:
        self.groups = [
            (torch.tensor(list(rows), dtype=torch.long, device=device), slot)
            for rows, slot in groups
        ]
        self.slots = [slot for _, slot in groups]

    def seqs(self) -> tuple[int, ...]:
        """The seqlock of every slot the forward reads (sampled between its blocks)."""
        return tuple(slot.seq for slot in self.slots)

    def apply(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the output of linear layer ``module`` on input ``x``, ``[B, P, out]``) with
        each adapter's delta added on its rows; other rows are returned untouched."""
        for rows, slot in self.groups:
            pair = slot.modules.get(module)
            if pair is None:
                continue
            a, b = pair
            delta = lora_delta(x.index_select(0, rows), a, b, slot.alpha, slot.config.rank)
            out = out.index_add(0, rows, delta)
        return out
