"""`rollout-sync demo --backend torch_lm [--stream]`: the real tiny LM racing weight syncs."""

from __future__ import annotations

import json

import pytest

from rollout_sync.demos.cli import main


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "blocking"])
def test_torch_lm_demo_is_clean_when_guarded(
    stream: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--in-process", "--backend", "torch_lm", "--syncs", "25", "--json"]
    assert main([*argv, "--stream"] if stream else argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["backend"] == "torch_lm" and report["stream"] is stream
    assert report["syncs"] == 25
    assert report["torn_reads"] == 0
    assert report["forward_write_overlaps"] == 0
    assert report["egress_overlaps"] == 0
    assert report["results_failed"] == 0
    assert report["payloads_sent"] == report["results"]
    if stream:
        assert report["results_straddled_sync"] > 0, "syncs landed on generations in flight"
    assert "OK:" in out


def test_stream_needs_the_torch_lm_backend() -> None:
    with pytest.raises(SystemExit, match="--stream needs --backend torch_lm"):
        main(["demo", "--stream", "--syncs", "1"])
