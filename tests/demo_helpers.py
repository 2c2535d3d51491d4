"""Shared pieces of the `rollout-sync demo` command-line tests: the job replaced by a stand-in
that records the config the command line built and returns a clean report."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_sync.demos import cli
from rollout_sync.demos.distributed import DistributedDemoConfig

CLEAN_REPORT = {
    "guarded": True,
    "torn_reads": 0,
    "egress_overlaps": 0,
    "bit_identical": True,
    "payloads_lost": 0,
}
"""What a job with nothing wrong reports, as far as the command's verdict reads it."""


def capture_demo_configs(
    monkeypatch: pytest.MonkeyPatch, **report: Any
) -> list[DistributedDemoConfig]:
    """Replace the job the command runs (``cli.run_distributed_demo``): nothing starts, each
    call's config is appended to the returned list, and each returns :data:`CLEAN_REPORT`
    with ``report``'s keys added."""
    seen: list[DistributedDemoConfig] = []

    def run(config: DistributedDemoConfig, timeline: object, **_: object) -> dict[str, Any]:
        seen.append(config)
        return {**CLEAN_REPORT, **report}

    monkeypatch.setattr(cli, "run_distributed_demo", run)
    return seen
