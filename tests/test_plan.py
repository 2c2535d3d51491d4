"""`rollout-sync plan` (rollout_sync.plan): every design ranked by refit and by stall, the memory
each needs and whether it fits, a recommendation among the implemented designs that fit, the
documented 1T fleet's numbers equal to FLEET_1T's, the model read from its files, and every bad
input refused in one line with exit code 2 before anything is computed."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.demos.cli import main
from rollout_sync.plan import (
    FleetSpec,
    ModelSpec,
    build_plan,
    delta_bytes,
    model_from_config,
    parse_bytes,
    parse_rate,
)
from rollout_sync.scale import FLEET_1T, Fleet, SyncCosts, Topology, estimate

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]

FLEET_1T_ARGV = (
    "--params 1e12 --dtype bfloat16 --tensors 70000 --trainer-ranks 256 --replicas 4 "
    "--gpus-per-replica 32 --nic 50GB/s"
).split()
"""The documented 1T fleet (docs/scale.md), as FLEET_1T is."""

FLEET_70B_ARGV = (
    "--params 70e9 --tensors 4900 --trainer-ranks 64 --replicas 8 --gpus-per-replica 4 "
    "--nic 50GB/s --free-memory 20GB"
).split()

SMALL_ARGV = "--params 8e9 --tensors 560 --trainer-ranks 16 --replicas 2 --nic 50GB/s".split()
"""A fleet whose plan takes a fraction of a second (the 1T one takes seconds on two cores)."""

REQUIRED_KEYS = {"name", "implemented", "refit_s", "stall_s", "memory_bytes_per_gpu", "fits"}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


def _json(argv: list[str]) -> dict[str, Any]:
    code, out, _ = _run([*argv, "--json"])
    assert code == 0
    (line,) = out.strip().splitlines()  # one JSON object, nothing else
    value: dict[str, Any] = json.loads(line)
    return value


@pytest.fixture(scope="module")
def fleet_1t() -> dict[str, Any]:
    return _json(FLEET_1T_ARGV)


def _by_name(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in plan["designs"]}


# -- the documented fleet ---------------------------------------------------------------------


def test_the_documented_fleet_is_fleet_1ts_numbers(fleet_1t: dict[str, Any]) -> None:
    designs = _by_name(fleet_1t)
    assert len(designs) == 3 * len(Topology)  # the alias SHARDED is not a design of its own
    for design in fleet_1t["designs"]:
        assert design.keys() >= REQUIRED_KEYS
        assert design["implemented"] is Topology(design["topology"]).implemented
        assert design["fits"] is None  # no --free-memory
    for e in FLEET_1T.estimates():
        where = "staged in host memory" if e.scenario.staged else "in place"
        design = designs[f"{e.topology.value}, {where}"]
        assert (design["refit_s"], design["stall_s"]) == (e.refit_s, e.stall_s)
        assert design["phases"] == {p.name: p.seconds for p in e.phases}
        assert design["busiest_link_bytes"] == e.busiest_link_bytes
    # Staged in device memory: the same transfer, installed by an HBM copy.
    device = replace(FLEET_1T.costs, install_bytes_per_s=FLEET_1T.device_install_bytes_per_s)
    for topology in Topology:
        e = estimate(topology, FLEET_1T.scenario(staged=True), device)
        design = designs[f"{topology.value}, staged in device memory"]
        assert (design["refit_s"], design["stall_s"]) == (e.refit_s, e.stall_s)
        assert design["staging_bytes_per_gpu"] == 62_500_000_000
        assert design["memory_bytes_per_gpu"] == 62_500_000_000 + 2 * (32 << 20)
    two_hop = designs["sharded_two_hop, in place"]
    assert round(two_hop["refit_s"], 2) == 2.56 and two_hop["memory_bytes_per_gpu"] == 64 << 20
    assert designs["sharded_two_hop, staged in host memory"]["host_memory_bytes_per_gpu"] == (
        62_500_000_000
    )
    assert fleet_1t["speed_of_light_s"] == FLEET_1T.speed_of_light_s
    assert fleet_1t["model"]["model_bytes"] == FLEET_1T.model_bytes


def test_the_designs_are_ranked_by_refit_and_by_stall(fleet_1t: dict[str, Any]) -> None:
    refits = [d["refit_s"] for d in fleet_1t["designs"]]
    assert refits == sorted(refits)
    assert fleet_1t["by_refit"] == [d["name"] for d in fleet_1t["designs"]]
    stalls = [_by_name(fleet_1t)[name]["stall_s"] for name in fleet_1t["by_stall"]]
    assert stalls == sorted(stalls) and sorted(fleet_1t["by_stall"]) == sorted(fleet_1t["by_refit"])
    assert fleet_1t["by_refit"][0] == "sharded_pipelined, in place"
    assert fleet_1t["by_stall"][0] == "sharded_pipelined, staged in device memory"


def test_the_words_say_the_ranking_the_recommendation_and_the_assumptions() -> None:
    code, out, _ = _run(SMALL_ARGV)
    assert code == 0
    plan = _json(SMALL_ARGV)
    table = out.split("by refit")[1].split("by stall")[0]
    listed = [
        name for line in table.splitlines() for name in plan["by_refit"] if f" {name} " in line
    ]
    assert listed == plan["by_refit"]
    by_stall = out.split("\nby stall\n")[1].split("where the time goes")[0]
    assert [n for line in by_stall.splitlines() for n in plan["by_stall"] if f" {n} " in line] == (
        plan["by_stall"]
    )
    assert f"recommended: {plan['recommended']}\n  why: {plan['reason']}" in out
    for name, _source in FLEET_1T.sources:
        if name not in ("model_bytes", "tensors", "trainer_gpus, replicas, gpus_per_replica"):
            assert f"\n  {name}: " in out.split("assumptions")[1]
    assert "wire: P2R link" in out.split("where the time goes")[1]


# -- memory and the recommendation ------------------------------------------------------------


def test_fits_is_the_memory_per_gpu_against_free_memory() -> None:
    plan = _by_name(_json(FLEET_70B_ARGV))
    shard = 140_000_000_000 // 4
    buckets = 2 * (32 << 20)
    for design in plan.values():
        staging = design["staging"]
        expected = buckets + (shard if staging == "device" else 0)
        assert design["memory_bytes_per_gpu"] == expected
        assert design["host_memory_bytes_per_gpu"] == (shard if staging == "host" else 0)
        assert design["fits"] is (expected <= 20e9)
    assert plan["sharded_two_hop, staged in device memory"]["fits"] is False
    roomy = _by_name(_json([*FLEET_70B_ARGV, "--free-memory", "40GB"]))
    assert all(d["fits"] for d in roomy.values())


def test_the_recommendation_is_among_the_implemented_designs_that_fit() -> None:
    plan = _json(FLEET_70B_ARGV)
    chosen = _by_name(plan)[plan["recommended"]]
    assert plan["recommended"] == "sharded_pipelined, in place"
    assert chosen["implemented"] and chosen["fits"]
    faster = [d for d in plan["designs"] if d["refit_s"] < chosen["refit_s"]]
    assert all(not d["implemented"] or not d["fits"] for d in faster)
    assert "fit in 20 GB per GPU" in plan["reason"]
    # 20 GB holds no second copy of a GPU's 35 GB: the staged-in-device designs do not fit.
    assert not _by_name(plan)["sharded_pipelined, staged in device memory"]["fits"]
    # With room for it, device staging takes 9% longer here (its install): outside the 5%.
    roomy = _json([*FLEET_70B_ARGV, "--free-memory", "40GB"])
    assert roomy["recommended"] == "sharded_pipelined, in place"


def test_a_staged_design_within_5_percent_of_the_refit_is_chosen_for_its_stall() -> None:
    # At 25 GB/s per NIC the 1T fleet's wire doubles, and device staging's install (0.09 s)
    # is within 5% of the fastest refit, for a stall of 0.14 s instead of the whole transfer.
    slow = _json([*FLEET_1T_ARGV[: FLEET_1T_ARGV.index("--nic")], "--nic", "25GB/s"])
    designs = _by_name(slow)
    fastest, staged = designs["sharded_pipelined, in place"], designs[slow["recommended"]]
    assert slow["recommended"] == "sharded_pipelined, staged in device memory"
    assert (
        staged["refit_s"] <= 1.05 * fastest["refit_s"]
        and staged["stall_s"] < 0.1 * (fastest["stall_s"])
    )
    assert "Within 5% of the fastest refit" in slow["reason"]
    assert "memory not checked" in slow["reason"]  # no --free-memory: 62.6 GB per GPU


def test_without_room_for_anything_none_is_recommended() -> None:
    # Where no implemented design fits, none is recommended, and the reason says why.
    none = _json([*SMALL_ARGV, "--free-memory", "1MB"])
    assert none["recommended"] is None and "No implemented design fits in 1 MB" in none["reason"]


def test_implemented_comes_from_the_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    """A topology the package does not run is modelled only, and never recommended."""
    after = _json(FLEET_70B_ARGV)
    assert all(d["implemented"] for d in after["designs"] if not d["delta"])
    monkeypatch.setattr(
        Topology, "implemented", property(lambda self: self is not Topology.SHARDED_PIPELINED)
    )
    before = _json(FLEET_70B_ARGV)
    assert not _by_name(before)["sharded_pipelined, in place"]["implemented"]
    assert before["recommended"] == "sharded_two_hop, in place"
    assert "modelled only" in before["reason"]


def test_delta_designs_are_implemented_but_over_the_pipelined_sharded_relay() -> None:
    plan = _json([*FLEET_70B_ARGV, "--changed-fraction", "0.01"])
    deltas = [d for d in plan["designs"] if d["delta"]]
    assert len(deltas) == len(Topology) and len(plan["designs"]) == 4 * len(Topology)
    encoded = 2 * 0.01 * 140e9  # bf16: a 16-bit position and a 16-bit value per element
    for d in deltas:
        pipelined = d["topology"] == Topology.SHARDED_PIPELINED.value
        assert d["implemented"] is not pipelined and d["staging"] == "device"
        assert d["sync_bytes"] == pytest.approx(encoded)
        assert d["staging_bytes_per_gpu"] == pytest.approx(encoded / 4, abs=1)
    recommended = _by_name(plan)[plan["recommended"]]
    assert recommended["delta"] and recommended["implemented"]  # a delta, where one runs
    assert plan["designs"][0]["delta"]  # the fastest refit: a delta
    assert plan["changed_fraction"] == 0.01 and "delta" in plan["assumptions"]
    model = ModelSpec.of(10, 1, "float32")
    assert delta_bytes(model, 0.5) == 5 * (2 + 4)


def test_a_trainer_within_one_node_gathers_over_nvlink() -> None:
    """Fleet.scenario's gather divides by the ranks beyond one node: 2 to 8 ranks are planned
    with NVLink alone, one rank with no gather."""
    refits = {}
    for ranks in (1, 2, 8, 9):
        plan = build_plan(ModelSpec.of(8e9, 560), FleetSpec(ranks, 2, 1, 50e9))
        refits[ranks] = plan.design("one_source, in place").refit_s
        gather = plan.design("one_source, in place").estimate.scenario.gather
        assert (gather is None) is (ranks == 1)
    assert refits[1] <= refits[2] and refits[8] <= refits[9]


# -- the inputs -------------------------------------------------------------------------------


def test_units_are_decimal_and_bits_are_a_lower_case_b() -> None:
    assert parse_rate("400Gb/s") == parse_rate("50GB/s") == 50e9
    assert parse_rate("800 MB/s") == 800e6 and parse_rate("1.6Tb/s") == 200e9
    assert parse_bytes("20GB") == 20 * 10**9 and parse_bytes("20GiB") == 20 << 30
    assert parse_bytes("512 MB") == 512 * 10**6
    bits = _json([*SMALL_ARGV[:-1], "400Gb/s"])
    assert bits["designs"] == _json(SMALL_ARGV)["designs"]
    assert bits["fleet"]["nic_bytes_per_s"] == 50e9


def test_a_safetensors_index_gives_the_bytes_and_the_tensors(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    names = {f"model.layers.{i}.weight": "model-00001-of-00002.safetensors" for i in range(291)}
    index.write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}, "weight_map": names}))
    plan = _json(["--model", str(index), "--replicas", "2", "--nic", "50GB/s"])
    assert plan["model"]["model_bytes"] == 16_060_522_496 and plan["model"]["tensors"] == 291
    assert plan["model"]["params"] == 16_060_522_496 // 2 and not plan["model"]["estimated"]
    assert "safetensors index" in plan["model"]["source"]
    fp8 = _json(["--model", str(index), "--dtype", "fp8", "--replicas", "2", "--nic", "50GB/s"])
    assert fp8["model"]["params"] == 16_060_522_496  # bytes as the index says; fp8 is 1 each


LLAMA_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "vocab_size": 128256,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V3 = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "vocab_size": 129280,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
}


def test_a_config_json_gives_an_estimate_and_says_so(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    argv = ["--model", str(config), "--replicas", "8", "--gpus-per-replica", "4", "--nic", "50GB/s"]
    plan = _json(argv)
    # Llama-3-70B: 70.55B parameters in 723 tensors (its safetensors index lists 723).
    assert plan["model"]["params"] == 70_553_706_496 and plan["model"]["tensors"] == 723
    assert plan["model"]["estimated"] and plan["model"]["dtype"] == "bfloat16"
    code, out, _ = _run(argv)
    assert code == 0 and "(an estimate)" in out.splitlines()[0]
    # A mixture of experts with multi-head latent attention: DeepSeek-V3's 671B (without its
    # multi-token-prediction layer), 256 experts x 3 projections in each of 58 MoE layers.
    moe = model_from_config(DEEPSEEK_V3)
    assert moe.params == pytest.approx(671e9, rel=0.002)
    assert 58 * 256 * 3 < moe.tensors < 58 * 256 * 3 + 1000
    tied = model_from_config({**LLAMA_70B, "tie_word_embeddings": True})
    assert moe.dtype == "bfloat16" and tied.params == 70_553_706_496 - 128256 * 8192
    assert model_from_config({"text_config": LLAMA_70B}).params == 70_553_706_496


BAD_INPUTS = [
    (["--params", "0", "--tensors", "5", "--replicas", "2", "--nic", "50GB/s"], "--params"),
    (["--params=-1e9", "--tensors", "5", "--replicas", "2", "--nic", "50GB/s"], "> 0"),
    (["--params", "big", "--tensors", "5", "--replicas", "2", "--nic", "50GB/s"], "number"),
    (["--params", "1e9", "--tensors", "0", "--replicas", "2", "--nic", "50GB/s"], "--tensors"),
    (["--params", "1e9", "--tensors", "5", "--replicas", "0", "--nic", "50GB/s"], "--replicas"),
    ([*SMALL_ARGV, "--gpus-per-replica", "0"], "--gpus-per-replica must be at least 1"),
    ([*SMALL_ARGV, "--trainer-ranks", "-2"], "--trainer-ranks must be at least 1"),
    ([*SMALL_ARGV, "--trainer-ranks", "2.5"], "not a whole number"),
    ([*SMALL_ARGV, "--dtype", "int4"], "--dtype: unknown dtype 'int4'"),
    (["--model", "config.json", "--dtype", "int4", *SMALL_ARGV[4:]], "--dtype: unknown"),
    (["--params=0.5", *SMALL_ARGV[2:]], "--params: the parameter count must be >= 1"),
    ([*SMALL_ARGV[:-1], "50GBps"], "'50GBps' is not a rate"),
    ([*SMALL_ARGV[:-1], "fast"], "'fast' is not a rate"),
    ([*SMALL_ARGV[:-1], "50"], "'50' is not a rate"),
    ([*SMALL_ARGV[:-1], "0GB/s"], "a rate must be > 0"),
    ([*SMALL_ARGV, "--free-memory", "20Gb"], "not a size in bytes"),
    ([*SMALL_ARGV, "--free-memory", "0GB"], "at least 1 byte"),
    ([*SMALL_ARGV, "--free-memory", "lots"], "not a size in bytes"),
    ([*SMALL_ARGV, "--bucket-mb", "0"], "--bucket-mb must be a number > 0"),
    ([*SMALL_ARGV, "--changed-fraction", "0"], "--changed-fraction must be in (0, 1]"),
    ([*SMALL_ARGV, "--changed-fraction", "1.5"], "--changed-fraction must be in (0, 1]"),
    ([*SMALL_ARGV, "--changed-fraction", "some"], "not a number"),
    ([*SMALL_ARGV, "--model", "config.json"], "give the model one way"),
    (["--replicas", "2", "--nic", "50GB/s"], "give the model"),
    (["--params", "1e9", "--replicas", "2", "--nic", "50GB/s"], "give the model"),
    (["--params", "1e9", "--tensors", "5", "--nic", "50GB/s"], "--replicas is required"),
    (["--params", "1e9", "--tensors", "5", "--replicas", "2"], "--nic is required"),
]
"""Every refusal: its flags and what its line says."""


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``rollout-sync plan argv`` is refused with (exit code 2, nothing on
    stdout)."""
    with pytest.raises(SystemExit) as refused:
        main(["plan", *argv])
    assert refused.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("rollout-sync plan: ")
    return line


@pytest.mark.parametrize(("argv", "says"), BAD_INPUTS)
def test_a_bad_input_is_refused_in_one_line_with_exit_code_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _refusal(argv, capsys)


def test_a_missing_or_invalid_model_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = ["--replicas", "2", "--nic", "50GB/s"]
    missing = _refusal(["--model", str(tmp_path / "nope.json"), *fleet], capsys)
    assert "--model: cannot read" in missing and "nope.json" in missing
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not JSON" in _refusal(["--model", str(bad), *fleet], capsys)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"architectures": ["X"]}))
    assert "neither a safetensors index" in _refusal(["--model", str(other), *fleet], capsys)
    no_size = tmp_path / "index.json"
    no_size.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "a.safetensors"}}))
    assert "metadata.total_size" in _refusal(["--model", str(no_size), *fleet], capsys)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"metadata": {"total_size": 10}, "weight_map": {}}))
    assert "weight_map must name" in _refusal(["--model", str(empty), *fleet], capsys)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_70B, "vocab_size": None}))
    assert "vocab_size is missing" in _refusal(["--model", str(config), *fleet], capsys)


# -- the picture ------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "plan.png"
    code, out, _ = _run([*SMALL_ARGV, "--changed-fraction", "0.02", "--plot", str(picture)])
    assert code == 0 and f"plot: {picture}" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = _run([*SMALL_ARGV, "--json", "--plot", str(picture)])
    assert code == 0 and json.loads(out) and f"plot: {picture}" in err


def test_without_matplotlib_plot_is_refused_before_anything_is_computed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    picture = tmp_path / "plan.png"
    # Checked first: the bad --nic behind it is not even read.
    line = _refusal([*SMALL_ARGV[:-1], "fast", "--plot", str(picture)], capsys)
    assert "--plot: drawing the plan needs matplotlib" in line
    assert "pip install 'rollout-sync[plot]'" in line and not picture.exists()
    folder = _refusal([*SMALL_ARGV, "--plot", str(tmp_path / "no" / "p.png")], capsys)
    assert "needs matplotlib" in folder


def test_plot_into_a_missing_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    line = _refusal([*SMALL_ARGV, "--plot", str(tmp_path / "no" / "p.png")], capsys)
    assert "no folder" in line


# -- the sources and the docs -----------------------------------------------------------------


def test_every_constant_of_the_1t_fleet_names_its_source() -> None:
    named = {part.strip() for name, _ in FLEET_1T.sources for part in name.split(",")}
    constants = {f.name for f in fields(Fleet)} - {"name", "costs", "sources"}
    constants |= {f.name for f in fields(SyncCosts)}
    assert sorted(constants - named) == []
    assert all(source.strip() for _, source in FLEET_1T.sources)


def _doc_runs() -> list[tuple[list[str], str]]:
    """Each ``$ rollout-sync plan ...`` block of docs/scale.md: its flags and its output."""
    text = (ROOT / "docs" / "scale.md").read_text()
    runs = []
    for block in re.findall(r"```text\n(\$ rollout-sync plan .*?)\n```", text, re.S):
        command, _, output = block.partition("\n")
        runs.append((command.split()[3:], output))
    return runs


def test_the_docs_show_the_plans_real_output() -> None:
    runs = _doc_runs()
    assert len(runs) >= 2
    for argv, output in runs:
        code, out, _ = _run(argv)
        assert code == 0
        assert out.rstrip("\n") == output, f"docs/scale.md's output of {argv} is stale: paste it"


def test_the_docs_json_is_the_plans(fleet_1t: dict[str, Any]) -> None:
    text = (ROOT / "docs" / "scale.md").read_text()
    shown = [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", text, re.S)]
    designs = [d for d in shown if "name" in d]
    assert designs, "docs/scale.md shows no design of the 1T fleet's --json"
    for design in designs:
        assert design == _by_name(fleet_1t)[design["name"]]
    assert designs[0]["name"] == fleet_1t["recommended"]
