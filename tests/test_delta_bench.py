"""benchmarks/delta.py, quick: a small Llama's steps at lr 1e-6 and 3e-6 change a fraction of
the served bf16 elements strictly between 0 and 1, more at the larger rate; the encoded delta is
smaller than the whole model and round-trips; the 1T fleet's delta design beats its full one in
the cost model. Every key the benchmark prints is named in its docstring."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.timeout(60)
def test_a_quick_delta_run_measures_a_small_changed_fraction_and_a_smaller_delta(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("delta")
    assert bench.main(["--quick", "--steps", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert 0 < report["changed_fraction"] < report["changed_fraction_3e-6"] < 1
    assert 0 < report["delta_bytes_over_full"] < 1
    assert report["round_trip"] is True
    assert report["trainer_extra_bytes_over_weights"] == pytest.approx(1.0)
    assert report["model_bytes"] == 2 * report["model_params"]
    assert report["measured_steps"] == [2, 3]
    for rows in (report["steps_1e-6"], report["steps_3e-6"]):
        assert [r["step"] for r in rows] == report["measured_steps"]
        assert all(0 < r["changed_fraction"] < 1 and r["round_trip"] for r in rows)
    # Part 3: the syncs moved those versions, by delta and whole, bit-identical.
    assert report["bit_identical"] is True
    assert [s["kind"] for s in report["syncs"]] == ["whole", "delta", "whole", "delta", "whole"]
    assert 0 < report["staging_bytes_over_weights"] < report["full_staging_bytes_over_weights"]
    # The pick stays on an implemented topology.
    assert report["fleet_1t_delta_design"].endswith("delta staged in device memory")
    assert 0 < report["fleet_1t_delta_refit_s"] < report["fleet_1t_full_refit_s"]
    assert 0 < report["fleet_1t_delta_stall_s"]
    assert "delta" not in report["fleet_1t_full_design"]

    named = set(re.findall(r"``([a-z0-9_.-]+)``", bench.__doc__ or ""))
    assert set(report) - named == set()
