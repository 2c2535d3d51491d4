"""The logging / W&B adapter, the metric names docs/metrics.md documents, and the exports."""

from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_sync import SyncMode, SyncReport, WeightBroadcastCallback
from rollout_sync.metrics_logging import MetricsLogger, log_metrics
from rollout_sync.trainer import QueueCommandChannel

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


class _FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.run: object | None = None
        self.logged: list[tuple[dict[str, Any], int | None]] = []

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((dict(data), step))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> _FakeWandb:
    module = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_metrics_go_to_logging_as_one_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = MetricsLogger(prefix="training/", use_wandb=False)
    with caplog.at_level(logging.INFO, logger="rollout_sync.metrics"):
        logger({"weight_sync_time_ms": 12.3456789, "weight_sync_count": 2}, step=7)
    (record,) = caplog.records
    assert record.getMessage() == (
        "step 7: training/weight_sync_count=2 training/weight_sync_time_ms=12.3457"
    )


def test_without_an_active_run_wandb_is_not_called(fake_wandb: _FakeWandb) -> None:
    MetricsLogger()({"x": 1.0}, step=1)
    assert fake_wandb.logged == []


def test_with_an_active_run_metrics_go_to_wandb(fake_wandb: _FakeWandb) -> None:
    fake_wandb.run = object()
    logger = MetricsLogger(prefix="rollout/")
    logger({"rollout_sync/time_to_park_ms": 1.5}, step=3)
    logger({"y": 2})
    logger({})
    assert fake_wandb.logged == [
        ({"rollout/rollout_sync/time_to_park_ms": 1.5}, 3),
        ({"rollout/y": 2}, None),
    ]


def test_use_wandb_false_never_touches_it(fake_wandb: _FakeWandb) -> None:
    fake_wandb.run = object()
    MetricsLogger(use_wandb=False)({"x": 1.0}, step=1)
    assert fake_wandb.logged == []


def test_log_metrics_uses_a_shared_logger(
    fake_wandb: _FakeWandb, caplog: pytest.LogCaptureFixture
) -> None:
    fake_wandb.run = object()
    with caplog.at_level(logging.INFO, logger="rollout_sync.metrics"):
        log_metrics({"a": 1}, 5, prefix="p/")
    assert fake_wandb.logged == [({"p/a": 1}, 5)]
    assert "p/a=1" in caplog.text


def test_docs_list_every_metric_name_emitted() -> None:
    """docs/metrics.md names every key the trainer callback and SyncReport produce."""
    text = DOCS.read_text()
    documented = set(re.findall(r"`([a-z_/]+_(?:ms|count|bytes|version|max))`", text))
    report = SyncReport("h", SyncMode.SYNC, True, 1, 0, 0.001, 0.002, 0.003, 0.0, 0.006)
    channel = QueueCommandChannel()

    def push(weights: Any, *, version: int, timeout: float) -> None:
        channel.receive(timeout)

    callback = WeightBroadcastCallback(
        lambda: {"w": torch.zeros(2)}, pusher=push, channel=channel, sync_on_run_begin=False
    )
    emitted = set(report.to_metrics()) | set(callback.step_end(1, None, True, {}) or {})
    assert emitted <= documented, f"undocumented: {sorted(emitted - documented)}"
