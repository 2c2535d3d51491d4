"""Deprecated stand-in for :mod:`rollout_sync.backends.vllm.worker`.

Every name read here warns and resolves to the new module's; moved in 0.2.0, gone in 0.3.0.
"""

from typing import Any

from .._moved import resolve_moved


def __getattr__(name: str) -> Any:
    return resolve_moved(__name__, "rollout_sync.backends.vllm.worker", name)
