"""Shared pieces of the sharded transfer tests: a model large enough that sends wait for their
receives, its trainer (FSDP rows) and replica (tensor-parallel columns) layouts, and snapshots
of what a replica rank serves."""

from __future__ import annotations

import torch

from rollout_sync.testing import IdleFlatRollout
from rollout_sync.transfer import Layout


def large_model(version: int) -> dict[str, torch.Tensor]:
    """Eight 256x256 fp32 tensors (2 MiB): buckets too large for a socket's buffers, so a send
    waits for its receive, as on a real job."""
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)}


def rows_to_columns() -> tuple[Layout, Layout]:
    """Two trainer ranks holding rows of every tensor, replicas of two ranks serving columns:
    every replica rank takes regions from both trainer ranks."""
    model = large_model(0)
    trainer = Layout.build(model, 2, shard=dict.fromkeys(model, 0))
    replica = Layout.build(model, 2, shard=dict.fromkeys(model, 1))
    return trainer, replica


def served(backend: IdleFlatRollout) -> dict[str, torch.Tensor]:
    """A copy of what ``backend`` serves now."""
    return {n: t.clone() for n, t in backend.served_weights().items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names and, bit for bit, the same tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
