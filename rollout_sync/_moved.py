"""Old import paths that keep working for one release: deprecated in :data:`DEPRECATED_IN`,
gone in :data:`REMOVED_IN`.

A module that moved leaves a stand-in at its old path. The stand-in's ``__getattr__`` (PEP 562)
calls :func:`resolve_moved`, which returns the very object the new module has and warns with a
:class:`DeprecationWarning` naming the new path, on every access (``from old import X``,
``old.X``, and the ``module.Class`` strings vLLM resolves from configuration). A name the new
module lacks raises :class:`AttributeError` naming both paths.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["DEPRECATED_IN", "REMOVED_IN", "resolve_moved"]

DEPRECATED_IN = "0.2.0"
"""The release whose paths moved (the package's version, ``rollout_sync.__version__``)."""
REMOVED_IN = "0.3.0"
"""The release without the old paths."""


def resolve_moved(old_module: str, new_module: str, name: str) -> Any:
    """``new_module.name``, warning that ``old_module.name`` is deprecated.

    Dunder lookups other than ``__all__`` (``__path__``, ``__wrapped__``, ...: probes by import
    machinery and tools) raise :class:`AttributeError` without a warning.
    """
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(new_module), name)
    except AttributeError:
        raise AttributeError(
            f"module {old_module!r} has no attribute {name!r} (it moved to {new_module!r}, "
            "which has no such name either)"
        ) from None
    warnings.warn(
        f"{old_module}.{name} is deprecated since {DEPRECATED_IN}: import it from {new_module} "
        f"(from {new_module} import {name}); the old path goes away in {REMOVED_IN}",
        DeprecationWarning,
        stacklevel=3,
    )
    return value
