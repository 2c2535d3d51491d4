"""`rollout-sync demo --backend vllm`: a trainer process and two vLLM replica processes.

Each replica serves a tiny Llama on vLLM (its engine core a process of its own) and generates
throughout; the trainer's weights reach the first replica's engine through vLLM's native
weight-transfer API with the ``rollout_sync`` engine, and go on R2R to the second the same way.
One short run (engine start included, ~40 s on two cores).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from rollout_sync.demos.cli import main  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


@pytest.mark.parametrize("flags", [[], ["--staged"], ["--lora"]], ids=["sync", "staged", "lora"])
def test_the_multi_process_vllm_demo_reports_a_clean_guarded_run(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--backend", "vllm", "--steps", "4", "--json", *flags]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["mode"], report["backend"], report["guarded"]) == (
        "multi_process",
        "vllm",
        True,
    )
    assert report["replicas"] == 2
    # Each of 4 steps: replica 1 receives P2R and sends R2R, replica 2 receives the R2R.
    assert report["syncs"] == 12
    assert report["failed_commands"] == 0 and report["errors"] == []
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0
    assert report["bit_identical"] is True and report["versions_checked"] == 8
    assert report["final_versions"] == [4, 4]
    assert report["forwards"] > 0 and report["payloads_received"] > 0
    assert report["payloads_lost"] == 0 and report["payloads_invalid"] == 0
    assert report["generation_pauses"] >= 4
    assert report["decode_step_ms_p50"] > 0
    assert 0 < report["park_steps_p99"] < math.inf
    assert report["rollout_staleness_max"] >= report["rollout_staleness_p50"] >= 0
    assert "OK:" in out
    assert report["sync_mode"] == ("staged" if flags == ["--staged"] else "sync")
    if flags:
        # Staged (the model's weights) or an adapter (always staged): generation is parked
        # for the install into the engine only, not for the wire.
        assert report["stall_ms_p50"] < report["sync_ms_p50"]
    if flags == ["--lora"]:
        # Only the adapter moved, and what every replica served of it is the trainer's.
        assert report["lora"] and 0 < report["adapter_mb"] < report["model_mb"] / 4
        assert report["bytes_per_sync"] == pytest.approx(report["adapter_mb"] * 1e6)
