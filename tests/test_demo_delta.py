"""`rollout-sync demo --delta`: a trainer taking real AdamW steps at a realistic learning rate
sends most versions as deltas to replicas serving bf16, every replica still bit-identical; the
report counts the delta and whole syncs, the bytes a delta moved over the whole version's, and
why each whole sync went whole (the fallbacks, counted honestly); options the job cannot send
deltas with are refused before anything starts."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from demo_helpers import capture_demo_configs

from rollout_sync.demos import cli
from rollout_sync.demos.cli import main
from rollout_sync.demos.distributed import DistributedDemoConfig, check_demo_config
from rollout_sync.demos.report import delta_report
from rollout_sync.transfer.delta_sync import WholeReason

FIRST = WholeReason.FIRST.value
NOT_SMALLER = WholeReason.NOT_SMALLER.value


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_demo_delta_sends_most_versions_by_delta_and_stays_bit_identical(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README's `./run.sh demo --delta --full-every N`, shorter: the first sync and every N-th
    go whole (`first`, `keyframe`), every other version by delta, a percent or so of the whole
    model, on every replica (P2R and R2R), and every replica ends, and is after every version,
    bit-identical to the trainer."""
    code = main(["demo", "--delta", "--full-every", "4", "--steps", "8", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert report["failed_commands"] == 0, report["errors"]
    assert report["bit_identical"] is True and report["step_mismatches"] == 0
    assert report["versions_checked"] == 3 * 8 and report["final_versions"] == [8, 8, 8]
    assert report["torn_reads"] == 0 and report["torn_forwards_detected"] == 0
    assert report["payloads_lost"] == 0 and report["payloads_invalid"] == 0
    # Versions 1..8: version 1 whole (the first) and 5 whole (the keyframe) on each of the
    # three replicas, the other six by delta; no fallback besides.
    assert report["full_sync_reasons"] == {"first": 3, "keyframe": 3}, report["full_sync_reasons"]
    assert (report["full_syncs"], report["delta_syncs"]) == (3 * 2, 3 * 6)
    assert 0 < report["delta_bytes_over_full_p50"] < 0.15
    assert 0 < report["changed_fraction_p50"] < 0.05  # lr 1e-6: a few bf16 roundings flip
    assert report["bytes_per_sync"] < report["model_mb"] * 1e6 * 0.15
    assert re.search(r"\nfull_sync_reasons +first 3 \(first sync: no committed base", out)
    assert re.search(r"\n +keyframe 3 \(keyframe: every full_every-th sync is whole\)", out)
    assert "OK:" in out


def _stats(
    role: str, version: int, kind: str, nbytes: int, reason: str | None = None
) -> dict[str, Any]:
    return {
        "role": role,
        "version": version,
        "sync_kind": kind,
        "whole_reason": reason,
        "nbytes": nbytes,
        "full_nbytes": 1000 if kind == "delta" else None,
    }


def test_the_delta_report_counts_every_fallback_with_its_reason() -> None:
    """`--learn --delta` as the report builder sees it: the versions the replicas received, by
    kind; the fallbacks counted by reason, an R2R that went whole because its P2R did counted
    by the trainer's reason for that version (its own stats give none), the initial push
    included; the ratio over the delta syncs only."""
    trainer = {
        "first_push": _stats("send", 1, "whole", 1000, FIRST),
        "transfers": [
            _stats("send", 2, "whole", 1000, NOT_SMALLER),
            _stats("send", 3, "delta", 700),
            _stats("send", 4, "whole", 1000, NOT_SMALLER),
        ],
    }
    source = {
        "transfers": [
            _stats("receive", 1, "whole", 1000, FIRST),
            _stats("send", 1, "whole", 1000),  # the R2R it sent: not a version it received
            _stats("receive", 2, "whole", 1000, NOT_SMALLER),
            _stats("receive", 3, "delta", 700),
            _stats("receive", 4, "whole", 1000, NOT_SMALLER),
        ]
    }
    leaf = {
        "transfers": [
            _stats("receive", 1, "whole", 1000),
            _stats("receive", 2, "whole", 1000),
            _stats("receive", 3, "delta", 650),
            _stats("receive", 4, "whole", 1000, WholeReason.RECEIVER.value),
        ]
    }
    report = delta_report(trainer, [source, leaf])
    assert report == {
        "delta_syncs": 2,
        "full_syncs": 6,
        "delta_bytes_over_full_p50": pytest.approx(0.675),
        "full_sync_reasons": {"not_smaller": 3, "first": 2, "receiver": 1},
    }
    text = cli._format_report({"guarded": True, **report})
    assert re.search(r"\nfull_sync_reasons +not_smaller 3 \(the delta is not smaller", text)
    assert re.search(r"\n +first 2 \(first sync: no committed base", text)
    assert re.search(r"\n +receiver 1 \(a receiver asked for the whole version", text)
    # No delta at all: no ratio to give, said so.
    whole = delta_report(trainer, [{"transfers": source["transfers"][:2]}])
    assert whole["delta_syncs"] == 0 and whole["delta_bytes_over_full_p50"] is None
    assert "delta_bytes_over_full_p50  n/a" in cli._format_report({**whole, "x": 0})
    # The noise-free trainer's changed fractions, when it ran.
    stepped = delta_report({**trainer, "next_tokens": {"changed_fractions": [0.1, 0.3]}}, [])
    assert stepped["changed_fraction_p50"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--delta"], {"delta_lr": 1e-6, "full_every": None, "learn_lr": None}),
        (["--delta", "--lr", "3e-6", "--full-every", "5"], {"delta_lr": 3e-6, "full_every": 5}),
        # --learn keeps its own default learning rate; --delta only changes the wire.
        (["--learn", "--delta"], {"learn_lr": 3e-3}),
        (["--learn", "--delta", "--lr", "1e-3", "--staged"], {"learn_lr": 1e-3}),
    ],
)
def test_the_delta_options_reach_the_job(
    argv: list[str], want: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = capture_demo_configs(monkeypatch)
    assert main(["demo", *argv]) == 0
    (config,) = seen
    assert config.delta and config.model.dtype == torch.bfloat16  # the replicas serve bf16
    assert config.steps == (40 if "--learn" in argv else 30)
    if "delta_lr" in want:
        assert config.delta_lr == want["delta_lr"]
    if "full_every" in want:
        assert config.full_every == want["full_every"]
    if "learn_lr" in want:
        assert (config.learn.lr if config.learn else None) == want["learn_lr"]


def test_without_delta_the_demo_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = capture_demo_configs(monkeypatch)
    assert main(["demo"]) == 0
    (config,) = seen
    assert not config.delta and config.full_every is None
    assert config.model.dtype == torch.float32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--full-every", "4"], "--full-every is the keyframe interval of --delta: add --delta"),
        (["--delta", "--full-every", "0"], "--full-every must be at least 1, not 0"),
        (["--delta", "--in-process"], "drop --in-process"),
        (["--delta", "--trainer", "fast-llm"], "the Fast-LLM wire sends whole tensors"),
        (["--delta", "--trainer-ranks", "2"], "no AdamW master to take small steps"),
        (["--delta", "--tp", "2"], "no AdamW master to take small steps"),
        (["--delta", "--lora"], "a --lora adapter goes whole: drop --lora"),
        (["--delta", "--backend", "torn_read"], "torn_read has none: use --backend torch_lm"),
        (["--delta", "--mode", "async_per_forward"], "torn_read has none"),
    ],
)
def test_what_cannot_send_deltas_is_refused_in_one_line_before_anything_starts(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen = capture_demo_configs(monkeypatch)
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not seen


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "1e-6"], "--lr needs --learn or --delta"),
        (["--delta", "--lr", "-1"], "--lr must be at least 0"),
        (["--delta", "--max-staleness", "2"], "--max-staleness needs --learn"),
    ],
)
def test_the_learning_rate_goes_with_learn_or_delta(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["demo", *argv])


def test_the_config_check_refuses_what_the_job_cannot_send_deltas_with() -> None:
    check_demo_config(DistributedDemoConfig(delta=True, full_every=3))
    for config, message in (
        (DistributedDemoConfig(full_every=3), "pass delta=True"),
        (DistributedDemoConfig(delta=True, trainer_ranks=2), "no AdamW master"),
        (DistributedDemoConfig(delta=True, lora=True), "an adapter moves whole"),
        (DistributedDemoConfig(delta=True, backend="torn_read"), "has none"),
        (DistributedDemoConfig(delta=True, delta_lr=-1.0), "delta_lr must be at least 0"),
    ):
        with pytest.raises(ValueError, match=message):
            check_demo_config(config)
