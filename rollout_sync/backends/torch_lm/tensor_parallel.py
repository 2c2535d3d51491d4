"""Tensor parallelism for the embedded engine: a replica of several ranks, each serving a slice.

Megatron's split, on the tiny LM's blocks: the attention's fused ``qkv`` and the MLP's ``fc1``
are *column-parallel* (each rank holds its heads' rows of q, of k and of v, and its rows of
``fc1``), ``proj`` and ``fc2`` are *row-parallel* (each rank holds the matching columns; their
partial outputs are summed with one all-reduce over the replica's group, then the bias is
added). Embeddings, norms, biases of the row-parallel linears and the head are replicated. So
each rank holds about ``1 / tp`` of every block, and a block costs two all-reduces (attention
and MLP) per forward.

:func:`tiny_lm_layout` is that split as a :class:`~rollout_sync.transfer.Layout`: what a
:class:`~rollout_sync.transfer.TransferPlan` needs to send each rank its slice, and what a
trainer's whole tensors are cut by (:meth:`~rollout_sync.transfer.Layout.shard`).
:class:`TensorParallel` is the replica's group, with bounded all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..._deadline import wait_collective
from ...distributed import group_ranks
from ...transfer import Layout
from ...weights import WeightSpec

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "TensorParallel", "tiny_lm_layout"]

COLUMN_PARALLEL = ("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias")
"""Per block: cut along dim 0 (``qkv`` in three sections, q, k and v)."""
ROW_PARALLEL = ("proj.weight", "fc2.weight")
"""Per block: cut along dim 1; their outputs are summed over the group."""


@dataclass(frozen=True)
class TensorParallel:
    """A replica's tensor-parallel group as one rank sees it.

    ``rank`` and ``size`` are this rank's position in the replica and the replica's size;
    ``group`` holds the replica's ranks (gloo on CPU; NCCL on GPU). Every all-reduce waits at
    most ``timeout_s``: a dead or stuck peer rank is a
    :class:`~rollout_sync.errors.CollectiveError` / ``CollectiveTimeout``, not a hang.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    timeout_s: float = 60.0
    ranks: tuple[int, ...] = ()
    """The group's global ranks (for messages)."""
    agree_timeout_s: float = 600.0
    """How long the ranks may wait for each other to agree on their weights after a sync (see
    :meth:`agree`): the slowest rank's sync, not one collective, so longer than ``timeout_s``."""

    @classmethod
    def of(
        cls,
        group: dist.ProcessGroup | None,
        *,
        timeout_s: float = 60.0,
        agree_timeout_s: float = 600.0,
    ) -> TensorParallel:
        """This process's place in ``group`` (registered with the default group)."""
        ranks = group_ranks(group)
        return cls(
            group, ranks.index(dist.get_rank()), len(ranks), timeout_s, ranks, agree_timeout_s
        )

    def agree(self, servable: bool, version: int) -> list[tuple[bool, int]]:
        """Every rank's ``(servable, version)``, in rank order (an all-gather on the group's
        CPU side, waited for at most :attr:`agree_timeout_s`)."""
        mine = torch.tensor([int(servable), version], dtype=torch.int64)
        rows = [torch.zeros(2, dtype=torch.int64) for _ in range(self.size)]
        work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        wait_collective(
            [work],
            operation="tensor-parallel agreement on the replica's weights",
            timeout_s=self.agree_timeout_s,
            ranks=self.ranks,
        )
        return [(bool(r[0]), int(r[1])) for r in torch.stack(rows).tolist()]

    def all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        if self.size == 1:
            return tensor
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        wait_collective(
            [work],
            operation=f"tensor-parallel all-reduce ({what})",
            timeout_s=self.timeout_s,
            ranks=self.ranks,
        )
        return tensor


def tiny_lm_layout(specs: list[WeightSpec], n_layers: int, tp: int) -> Layout:
    """How a tiny LM of ``n_layers`` blocks (its whole tensors ``specs``) lies on ``tp`` ranks.

    Raises:
        ValueError: a split tensor does not divide evenly over ``tp`` (the heads, ``d_ff``).
    """
    shard: dict[str, int] = {}
    sections: dict[str, int] = {}
    for i in range(n_layers):
        for name in COLUMN_PARALLEL:
            shard[f"blocks.{i}.{name}"] = 0
        for name in ROW_PARALLEL:
            shard[f"blocks.{i}.{name}"] = 1
        sections[f"blocks.{i}.qkv.weight"] = 3
        sections[f"blocks.{i}.qkv.bias"] = 3
    by_name = {s.name: s for s in specs}
    uneven = [
        f"{name} ({by_name[name].shape[dim] // sections.get(name, 1)} along dim {dim})"
        for name, dim in shard.items()
        if (by_name[name].shape[dim] // sections.get(name, 1)) % tp
    ]
    if uneven:
        raise ValueError(f"tensor parallelism over {tp} ranks needs even splits: {uneven}")
    return Layout.build(specs, tp, shard=shard, sections=sections)
