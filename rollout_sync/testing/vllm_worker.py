"""A vLLM worker extension for tests: it can hold the engine between two steps on request.

Pass ``engine_kwargs={"worker_extension_cls": STALLING_WORKER_EXTENSION}`` in a
:class:`~rollout_sync.backends.vllm.VLLMEngineConfig` to get it; everything else is the
production :class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..backends.vllm.worker import RolloutSyncWorkerExtension

__all__ = ["STALLING_WORKER_EXTENSION", "StallingWorkerExtension"]

STALLING_WORKER_EXTENSION = "rollout_sync.testing.vllm_worker.StallingWorkerExtension"
"""The ``worker_extension_cls`` that names :class:`StallingWorkerExtension`."""


class StallingWorkerExtension(RolloutSyncWorkerExtension):
    """The production worker extension plus :meth:`rollout_sync_stall`, a way to keep the engine
    busy between two steps for as long as a test wants (to show a pause timing out)."""

    def rollout_sync_stall(self, started_path: str, release_path: str, limit_s: float) -> bool:
        """Hold the engine between two steps until ``release_path`` exists.

        Touches ``started_path`` first. Returns whether it was released within ``limit_s``.
        """
        Path(started_path).touch()
        deadline = time.monotonic() + limit_s
        release = Path(release_path)
        while not release.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)  # polling a file from another process; nothing to wait on
        return True


def _register_flawed_engine() -> None:
    """Make the flawed engines of :mod:`rollout_sync.testing.vllm_engines` available in this
    worker (vLLM imports this module there before it builds the weight-transfer engine)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .vllm_engines import FLAWED_ENGINE_NAME

    if FLAWED_ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            FLAWED_ENGINE_NAME,
            "rollout_sync.testing.vllm_engines",
            "FlawedWeightTransferEngine",
        )


if "vllm" in sys.modules:
    _register_flawed_engine()
