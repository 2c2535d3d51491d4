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


# The sync mode's run is the learning test's below (every check of the job, in sync mode, with
# the trainer learning): one engine start fewer.
@pytest.mark.parametrize("flags", [["--staged"], ["--lora"]], ids=["staged", "lora"])
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
    if flags:  # every case
        # Staged (the model's weights) or an adapter (always staged): generation is parked
        # for the install into the engine only, not for the wire.
        assert report["stall_ms_p50"] < report["sync_ms_p50"]
    if flags == ["--lora"]:
        # Only the adapter moved, and what every replica served of it is the trainer's.
        assert report["lora"] and 0 < report["adapter_mb"] < report["model_mb"] / 4
        assert report["bytes_per_sync"] == pytest.approx(report["adapter_mb"] * 1e6)


def test_demo_learn_on_vllm_learns_from_the_replicas_rollouts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rollout-sync demo --learn --backend vllm`, as documented: the trainer's fp32 Llama
    master learns from the rollouts two bf16 vLLM replicas generated in flight (each token's
    log-probability after temperature, vLLM's processed_logprobs); every check of the job
    holds and the reward climbs in the default 40 steps (~70 s, two engine starts included)."""
    assert main(["demo", "--learn", "--backend", "vllm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["backend"], report["replicas"], report["steps"]) == ("vllm", 2, 40)
    assert report["torn_reads"] == 0 and report["bit_identical"] is True
    assert report["payloads_lost"] == 0 and report["failed_commands"] == 0
    assert report["rollouts_invalid"] == 0 and report["results_failed"] == 0
    chance = 8 / 512
    assert report["reward_last"] >= max(3 * chance, report["reward_first"] + 0.2)
    assert report["staleness_p99"] <= 4  # --max-staleness's default: older was dropped
    # The replicas' behaviour log-probabilities (bf16, after temperature) and the fp32
    # master's agree: the ratios sit at 1, apart from staleness.
    assert abs(report["importance_weight_p50"] - 1) < 0.05
    assert math.isfinite(report["importance_weight_p99"]) and report["clipped_fraction"] < 0.1
    assert report["tokens_per_s"] > 0 and 0 <= report["replica_idle_fraction"] < 1
