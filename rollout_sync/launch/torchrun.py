"""torchrun as a launcher: this process's :class:`~rollout_sync.launch.job.JobContext` from the
environment torchrun (or any launcher that sets ``RANK`` and ``WORLD_SIZE``) gives it.

docs/deploy.md has the commands for one host and across nodes.
"""

from __future__ import annotations

import os

from .job import JobContext, JobLayout

__all__ = ["torchrun_context"]


def torchrun_context(trainer: int = 0, *, layout: JobLayout | None = None) -> JobContext:
    """This process's :class:`JobContext` under torchrun (or any launcher that sets ``RANK``
    and ``WORLD_SIZE``, with ``MASTER_ADDR`` / ``MASTER_PORT`` for the ``env://`` rendezvous);
    ``trainer`` is the trainer's rank.

    ``layout``: the job's layout when it is not the plain one (a sharded job:
    :meth:`JobLayout.sharded`); torchrun must have started exactly its ``world_size``
    processes. ``None``: ``JobLayout(WORLD_SIZE, trainer)``.

    Raises:
        RuntimeError: the environment has no ``RANK`` / ``WORLD_SIZE`` (not under torchrun).
        ValueError: ``WORLD_SIZE`` is not ``layout.world_size``.
    """
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as missing:
        raise RuntimeError(
            f"torchrun_context: {missing.args[0]} is not set; run this under torchrun "
            "(torchrun --standalone --nproc-per-node N ...) or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT"
        ) from None
    if layout is None:
        layout = JobLayout(world_size, trainer)
    elif layout.world_size != world_size:
        raise ValueError(
            f"torchrun started {world_size} processes for a job of {layout.world_size} "
            f"({layout.describe()}): pass --nproc-per-node {layout.world_size} (in all, across "
            "nodes)"
        )
    return JobContext(rank, layout, "env://", launcher="torchrun")
