"""benchmarks/sharded.py, small: the same model moved one-source and sharded (2 trainer ranks,
3 replicas of 2 tensor-parallel ranks); every replica rank ends bit-identical to its slice of
the trainer's model and the busiest sharded trainer rank sends about half of what the
one-source trainer sends. Memory and time are the full run's business, not this test's."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_small_sharded_run_is_bit_identical_and_halves_the_busiest_rank_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # On the path while the children start: they import the benchmark by this name.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("sharded")
    assert bench.main(["--mb", "4", "--bucket-mb", "0.25", "--syncs", "1", "--timeout", "20"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bit_identical"] is True
    assert report["targets_met"]["bit_identical"] is True
    assert report["busiest_rank_bytes_ratio"] <= 0.55
    assert report["sharded_sent_equals_plan"] is True
    assert (report["trainer_ranks"], report["tp"], report["replicas"]) == (2, 2, 3)
    # The transfer's own staging: two buffers of at most a bucket (larger regions are cut).
    assert report["largest_bucket_mb"] <= report["bucket_mb"]
    assert report["staging_mb_per_trainer_rank"] <= 2 * report["bucket_mb"] + 1e-3
