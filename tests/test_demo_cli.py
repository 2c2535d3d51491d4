"""`rollout-sync demo`: the report, its JSON line, the unguarded run and the trace file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demo_helpers import capture_demo_configs

from rollout_sync.demos import cli
from rollout_sync.demos.cli import main

pytestmark = pytest.mark.timeout(120)

REPORT_KEYS = {
    "syncs",
    "forwards",
    "torn_reads",
    "forward_write_overlaps",
    "egress_overlaps",
    "time_to_park_ms_p50",
    "time_to_park_ms_p99",
    "sync_ms_p50",
    "sync_ms_p99",
}


def test_demo_json_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "out.json"
    assert main(["demo", "--in-process", "--syncs", "20", "--json", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert REPORT_KEYS <= report.keys()
    assert report["syncs"] == 20 and report["torn_reads"] == 0
    assert "OK:" in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_demo_unguarded_shows_torn_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--in-process", "--syncs", "40", "--unguarded", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["torn_reads"] > 0


def test_the_fake_models_in_process_report_counts_forward_write_overlaps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--in-process", "--backend", "torn_read", "--syncs", "20", "--json"]
    assert main(argv) == 0
    guarded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert REPORT_KEYS <= guarded.keys() and guarded["forward_write_overlaps"] == 0
    assert main([*argv, "--unguarded"]) == 0
    out = capsys.readouterr().out
    unguarded = json.loads(out.strip().splitlines()[-1])
    assert unguarded["forward_write_overlaps"] > 0
    assert f"{unguarded['forward_write_overlaps']} forward/weight-write overlaps" in out


def test_a_lost_payload_fails_the_run_guarded_or_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean = {
        "guarded": True,
        "torn_reads": 0,
        "egress_overlaps": 0,
        "forward_write_overlaps": 0,
        "failed_commands": 0,
        "bit_identical": True,
        "payloads_lost": 0,
        "payloads_invalid": 0,
    }
    report: dict[str, object] = {}
    monkeypatch.setattr(cli, "run_distributed_demo", lambda config, timeline, **launch: report)
    report.update(clean)
    assert main(["demo"]) == 0 and "OK:" in capsys.readouterr().out
    for flags in ([], ["--unguarded"]):
        report.update(clean, guarded=not flags, payloads_lost=2)
        assert main(["demo", *flags]) == 1
        assert (
            "FAIL: 2 payload(s) lost between the replicas and the trainer."
            in capsys.readouterr().out
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launcher", "ray", "--in-process"], "does not run with --in-process"),
        (["--launcher", "torchrun", "--backend", "vllm"], "--backend vllm"),
        (["--ray-address", "auto"], "--ray-address needs --launcher ray"),
        (["--staged", "--in-process"], "runs the multi-process demo: drop --in-process"),
        (["--staged", "--mode", "async_per_forward"], "--staged is --mode staged"),
        (["--staged", "--tp", "2"], "sync mode only: drop --mode staged"),
        (["--lora", "--in-process"], "--lora runs the multi-process demo"),
        (["--lora", "--trainer", "fast-llm"], "drop --trainer fast-llm"),
        (["--lora", "--backend", "torn_read"], "serves no LoRA adapter"),
    ],
)
def test_launcher_options_that_cannot_go_together_are_refused(
    argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["demo", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads"),
        (["--tp", "0"], "--trainer-ranks and --tp must be at least 1"),
        (["--trainer-ranks", "0"], "--trainer-ranks and --tp must be at least 1"),
        (["--trainer-ranks", "2", "--backend", "torn_read"], "torch_lm engine only"),
        (["--tp", "2", "--mode", "async_per_forward"], "sync mode only: drop --mode"),
        (["--trainer-ranks", "2", "--in-process"], "drop --in-process"),
        (["--tp", "2", "--trainer", "fast-llm"], "drop --trainer fast-llm"),
        (["--launcher", "torchrun", "--tp", "3"], "does not divide"),
    ],
)
def test_sharded_options_the_job_cannot_run_are_refused_before_anything_starts(
    argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["demo", *argv])


def test_the_sharded_options_reach_the_job_and_its_report_names_the_layout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = capture_demo_configs(monkeypatch, replicas=3, trainer_ranks=2, tp=2, processes=8)
    assert main(["demo", "--trainer-ranks", "2", "--tp", "2", "--json"]) == 0
    (config,) = seen
    assert isinstance(config, cli.DistributedDemoConfig)
    assert (config.trainer_ranks, config.tp, config.replicas) == (2, 2, 3)
    out = capsys.readouterr().out
    assert (
        "2 trainer ranks (FSDP shards) -> 3 replicas x 2 tensor-parallel ranks (8 processes)" in out
    )
    assert json.loads(out.strip().splitlines()[-1])["tp"] == 2


@pytest.mark.parametrize(
    ("argv", "mode", "lora"),
    [
        (["--staged"], "staged", False),
        (["--mode", "staged"], "staged", False),
        (["--lora"], "sync", True),
        (["--staged", "--lora", "--backend", "vllm"], "staged", True),
    ],
)
def test_the_staged_and_lora_options_reach_the_job(
    argv: list[str], mode: str, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--staged` is `--mode staged` on the stream LM (the default engine) and on vLLM, and
    `--lora` reaches the job as documented (docs/staged.md, docs/lora.md)."""
    seen = capture_demo_configs(monkeypatch)
    assert main(["demo", "--json", *argv]) == 0
    (config,) = seen
    assert (config.mode.value, config.lora) == (mode, lora)
    assert config.backend == ("vllm" if "vllm" in argv else "torch_lm")
