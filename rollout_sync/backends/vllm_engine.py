"""Deprecated stand-in for :mod:`rollout_sync.backends.vllm.engine`.

Every name read here warns and resolves to the new module's; kept for one release.
"""

from typing import Any

from .._moved import resolve_moved


def __getattr__(name: str) -> Any:
    return resolve_moved(__name__, "rollout_sync.backends.vllm.engine", name)
