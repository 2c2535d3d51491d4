"""A vLLM worker extension for tests: it can hold the engine between two steps on request.

Pass ``engine_kwargs={"worker_extension_cls": STALLING_WORKER_EXTENSION}`` in a
:class:`~rollout_sync.backends.vllm.VLLMEngineConfig` to get it; everything else is the
production :class:`~rollout_sync.backends.vllm_worker.RolloutSyncWorkerExtension`.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..backends.vllm_worker import RolloutSyncWorkerExtension

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
