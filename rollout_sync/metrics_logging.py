"""A tiny adapter that sends a metrics dict to ``logging`` and, when a run is active, to W&B.

Trainer and rollout side both produce flat ``{name: scalar}`` dicts (``step_end`` metrics,
:meth:`~rollout_sync.SyncReport.to_metrics`); docs/metrics.md lists the names. This writes one
log line per call and, if the ``wandb`` package is importable and ``wandb.run`` is active,
``wandb.log(metrics, step=step)``. ``wandb`` is imported lazily, on the first call, and only
if it is installed: rollout_sync does not depend on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = ["MetricsLogger", "log_metrics"]

_log = logging.getLogger("rollout_sync.metrics")


class MetricsLogger:
    """Logs metrics dicts; see the module docstring.

    Args:
        logger: where the line goes (default: the ``rollout_sync.metrics`` logger).
        level: the logging level of the line.
        prefix: prepended to every key, for both outputs (e.g. ``"training/"``).
        use_wandb: also log to W&B when it is importable and a run is active; False never
            imports or touches it.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        level: int = logging.INFO,
        prefix: str = "",
        use_wandb: bool = True,
    ) -> None:
        self.logger = logger if logger is not None else _log
        self.level = level
        self.prefix = prefix
        self.use_wandb = use_wandb
        self._wandb: ModuleType | None = None
        self._wandb_checked = False

    def __call__(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` (at ``step``, if given). Does nothing for an empty dict."""
        if not metrics:
            return
        named = {f"{self.prefix}{k}": v for k, v in metrics.items()}
        if self.logger.isEnabledFor(self.level):
            at = "" if step is None else f"step {step}: "
            body = " ".join(f"{k}={_format(v)}" for k, v in sorted(named.items()))
            self.logger.log(self.level, "%s%s", at, body)
        wandb = self._active_wandb()
        if wandb is not None:
            if step is None:
                wandb.log(named)
            else:
                wandb.log(named, step=step)

    def _active_wandb(self) -> ModuleType | None:
        if not self.use_wandb:
            return None
        if self._wandb is None:
            # Cheap to look up every time: a run started (and wandb imported) after this logger
            # was made is still found. The import attempt itself happens once.
            self._wandb = sys.modules.get("wandb")
            if self._wandb is None and not self._wandb_checked:
                self._wandb_checked = True
                self._wandb = _import_wandb()
        wandb = self._wandb
        if wandb is None or getattr(wandb, "run", None) is None:
            return None
        return wandb


def _import_wandb() -> ModuleType | None:
    """The ``wandb`` module if it is installed (already imported or importable), else None."""
    module = sys.modules.get("wandb")
    if module is not None:
        return module
    if importlib.util.find_spec("wandb") is None:
        return None
    try:
        return importlib.import_module("wandb")
    except Exception as exc:
        _log.warning(
            "wandb is installed but failed to import (%s); metrics go to logging only", exc
        )
        return None


def _format(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


_default_logger: MetricsLogger | None = None


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *, prefix: str = "") -> None:
    """Log ``metrics`` with a shared default :class:`MetricsLogger` (``prefix`` per call)."""
    global _default_logger
    if _default_logger is None:
        _default_logger = MetricsLogger()
    if prefix:
        metrics = {f"{prefix}{k}": v for k, v in metrics.items()}
    _default_logger(metrics, step)
