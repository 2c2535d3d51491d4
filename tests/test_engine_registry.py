"""One engine contract: engines registered by name (rollout_sync.backends) and what each provides
(rollout_sync.engine).

A toy engine registered by name runs through the path the demo builds replicas' engines on
(``build_engine``, ``trainer_model``, ``check_demo_config``) and through the command line's
choices (its default replica count, its launchers, its install check, its one-process demo),
with no process started. Importing the registry imports no engine: vLLM, and the demo's vLLM
replica module, stay out until a ``vllm`` engine is built. An unknown name is an error that lists
the registered ones.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, cast

import pytest
import torch
from demo_helpers import capture_demo_configs

from rollout_sync import RolloutBase, SyncMode, Timeline
from rollout_sync.backends import (
    EngineHandle,
    EngineRequest,
    InProcessRequest,
    engine_factory,
    register_engine,
    registered_engine,
    registered_engines,
    unregister_engine,
)
from rollout_sync.backends.torch_lm import TinyLMConfig, TorchLMBackend, TorchLMStreamBackend
from rollout_sync.demos import cli
from rollout_sync.demos.distributed import check_demo_config, demo_limit_s
from rollout_sync.demos.job import (
    DistributedDemoConfig,
    build_engine,
    register_demo_backend,
    trainer_model,
)
from rollout_sync.engine import EngineCapabilities
from rollout_sync.payload import PayloadSender
from rollout_sync.testing import AsyncTornReadBackend, VersionStampedModel

pytestmark = pytest.mark.timeout(120)

TOY = "toy"


class ToyEngine(RolloutBase):
    """The least an engine is: the tensors its forwards read (and the default no-op pause)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = {"policy.weight": torch.zeros(4, 4)}

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights


class ToyRegistration:
    """The toy engine's callables, recording what each was given."""

    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []
        self.in_process_requests: list[InProcessRequest] = []
        self.closed = 0

    def factory(self, request: EngineRequest) -> EngineHandle:
        self.requests.append(request)

        def close() -> None:
            self.closed += 1

        return EngineHandle(ToyEngine(), lambda: {"forwards": 0}, close=close)

    def trainer_model(self, config: Any) -> tuple[dict[str, torch.Tensor], Any]:
        weights = {"policy.weight": torch.ones(4, 4)}
        return weights, lambda step: weights["policy.weight"].fill_(float(step))

    def in_process(self, request: InProcessRequest) -> dict[str, Any]:
        self.in_process_requests.append(request)
        return {"guarded": request.guarded, "torn_reads": 0, "egress_overlaps": 0}


@pytest.fixture
def toy() -> Iterator[ToyRegistration]:
    registration = ToyRegistration()
    register_engine(
        TOY,
        registration.factory,
        trainer_model=registration.trainer_model,
        modes=(SyncMode.SYNC, SyncMode.STAGED),
        start_s=7.0,
        starts_processes=True,
        default_replicas=5,
        launchers=("local",),
        in_process=registration.in_process,
    )
    try:
        yield registration
    finally:
        unregister_engine(TOY)


def _no_sender() -> PayloadSender:
    return cast(PayloadSender, object())  # the toy engine ships nothing


# -- the demo's path -------------------------------------------------------------------------


def test_a_toy_engine_is_built_by_name_on_the_demos_path(toy: ToyRegistration) -> None:
    assert TOY in registered_engines()
    config = DistributedDemoConfig(backend=TOY, mode=SyncMode.STAGED)
    check_demo_config(config)
    timeline, sender = Timeline(), _no_sender()
    handle = build_engine(config, timeline, sender)
    (request,) = toy.requests
    assert request.config is config and request.timeline is timeline and request.sender is sender
    assert isinstance(handle.rollout, ToyEngine) and handle.counters() == {"forwards": 0}
    handle.close()
    assert toy.closed == 1
    weights, advance = trainer_model(config)
    advance(3)
    assert torch.equal(weights["policy.weight"], torch.full((4, 4), 3.0))
    # The engine's start allowance reaches the run's limit.
    assert demo_limit_s(config) == demo_limit_s(DistributedDemoConfig()) + 7.0
    assert engine_factory(TOY) == toy.factory


def test_the_demo_refuses_what_the_toy_engine_did_not_register(toy: ToyRegistration) -> None:
    with pytest.raises(ValueError, match=r"engine 'toy' runs the sync modes \['staged', 'sync'\]"):
        check_demo_config(DistributedDemoConfig(backend=TOY, mode=SyncMode.ASYNC_PER_FORWARD))
    with pytest.raises(
        ValueError, match=r"serves no LoRA adapter \(lora: \['torch_lm', 'vllm'\]\)"
    ):
        check_demo_config(DistributedDemoConfig(backend=TOY, lora=True))
    register_engine(TOY, toy.factory, replace=True)  # no trainer model
    with pytest.raises(ValueError, match="registered without a trainer_model"):
        check_demo_config(DistributedDemoConfig(backend=TOY))


def test_the_command_line_asks_the_registered_engine_what_it_needs(
    toy: ToyRegistration, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = capture_demo_configs(monkeypatch)
    assert cli.main(["demo", "--backend", TOY]) == 0
    (config,) = seen
    assert config.backend == TOY and config.replicas == 5  # its default replica count
    assert config.timeout_s == DistributedDemoConfig.timeout_s + 7.0  # its start allowance
    # Its launchers: local only, and why.
    with pytest.raises(SystemExit, match=r"--backend toy \(whose replicas start engine processes"):
        cli.main(["demo", "--backend", TOY, "--launcher", "ray"])
    # Its one-process demo.
    assert cli.main(["demo", "--backend", TOY, "--in-process", "--syncs", "3", "--unguarded"]) == 0
    (request,) = toy.in_process_requests
    assert (request.syncs, request.guarded, request.stream) == (3, False, False)
    capsys.readouterr()


def test_an_engine_that_cannot_run_here_gives_its_install_hint_and_runs_nothing(
    toy: ToyRegistration, capsys: pytest.CaptureFixture[str]
) -> None:
    def requires() -> None:
        raise ImportError("toy needs the toy extra: pip install toy")

    engine = registered_engine(TOY)
    register_engine(
        TOY,
        toy.factory,
        trainer_model=engine.trainer_model,
        in_process=engine.in_process,
        requires=requires,
        replace=True,
    )
    assert cli.main(["demo", "--backend", TOY, "--in-process"]) == 2
    assert "rollout-sync demo --backend toy: toy needs the toy extra" in capsys.readouterr().err
    assert toy.in_process_requests == [] and toy.requests == []


def test_an_engine_without_a_one_process_demo_is_refused_in_process(
    toy: ToyRegistration,
) -> None:
    register_engine(TOY, toy.factory, replace=True)
    with pytest.raises(SystemExit, match=r"--backend toy has no one-process demo: drop"):
        cli.main(["demo", "--backend", TOY, "--in-process"])


# -- names ------------------------------------------------------------------------------------


def test_an_unknown_name_is_an_error_that_lists_the_registered_names() -> None:
    names = list(registered_engines())
    assert {"torch_lm", "torn_read", "vllm"} <= set(names)
    for lookup in (registered_engine, engine_factory, unregister_engine):
        with pytest.raises(KeyError, match=r"no engine is registered as 'nope'; registered: "):
            lookup("nope")
    with pytest.raises(KeyError) as caught:
        registered_engine("nope")
    assert repr(names) in str(caught.value) and "register_engine" in str(caught.value)
    with pytest.raises(SystemExit, match=r"unknown --backend 'nope'; known: \['torch_lm'"):
        cli.main(["demo", "--backend", "nope"])
    with pytest.raises(KeyError, match="registered: "):
        check_demo_config(DistributedDemoConfig(backend="nope"))


def test_a_registration_is_checked_when_it_is_made(toy: ToyRegistration) -> None:
    with pytest.raises(ValueError, match=r"registered as 'toy' already.*replace=True"):
        register_engine(TOY, toy.factory)
    with pytest.raises(ValueError, match="an engine's name is letters"):
        register_engine("two words", toy.factory)
    with pytest.raises(ValueError, match="modes must be one or more SyncMode"):
        register_engine("toy2", toy.factory, modes=())
    with pytest.raises(ValueError, match="start_s must be finite and >= 0"):
        register_engine("toy2", toy.factory, start_s=-1.0)
    with pytest.raises(ValueError, match="default_replicas must be at least 1"):
        register_engine("toy2", toy.factory, default_replicas=0)
    with pytest.raises(TypeError, match="the factory must be callable"):
        register_engine("toy2", cast(Any, "not a factory"))
    with pytest.raises(TypeError, match="learner must be callable"):
        register_engine("toy2", toy.factory, learner=cast(Any, "not a learner"))
    assert "toy2" not in registered_engines()
    assert repr(registered_engine(TOY)) == (
        "<RegisteredEngine 'toy': staged, sync; 5 replicas; local only; starts within 7 s; "
        "starts processes; trainer model; in-process>"
    )


def test_the_deprecated_demo_registration_still_registers_a_three_argument_factory() -> None:
    built: list[tuple[object, object, object]] = []

    def engine(config: Any, timeline: Timeline, sender: PayloadSender) -> EngineHandle:
        built.append((config, timeline, sender))
        return EngineHandle(ToyEngine(), dict)

    with pytest.warns(DeprecationWarning, match="rollout_sync.backends.register_engine"):
        register_demo_backend("old_toy", engine, ToyRegistration().trainer_model)
    try:
        config, timeline, sender = (
            DistributedDemoConfig(backend="old_toy"),
            Timeline(),
            _no_sender(),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_engine(config, timeline, sender)
        assert built == [(config, timeline, sender)]
    finally:
        unregister_engine("old_toy")


# -- no engine imported eagerly ---------------------------------------------------------------


def test_importing_the_registry_and_the_demo_imports_no_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import rollout_sync.backends as backends
        import rollout_sync.engine
        assert backends.registered_engines() == (), backends.registered_engines()
        import rollout_sync.demos.cli
        assert backends.registered_engines() == ("torch_lm", "torn_read", "vllm")
        assert backends.registered_engine("vllm").default_replicas == 2
        loaded = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        assert not loaded, loaded
        assert "rollout_sync.demos.vllm_replicas" not in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr


# -- what an engine provides --------------------------------------------------------------------


def test_capabilities_read_what_each_engine_provides_from_its_type() -> None:
    toy = EngineCapabilities.of(ToyEngine())
    assert not (toy.parks or toy.background or toy.weight_buffer or toy.lora or toy.flat_storage)
    assert toy.sync_modes == {SyncMode.SYNC, SyncMode.STAGED}
    assert repr(toy) == "<EngineCapabilities ToyEngine: required only; staged, sync>"

    stream = EngineCapabilities.of(TorchLMStreamBackend(TinyLMConfig()))
    assert stream.parks and stream.background and stream.lora and not stream.weight_buffer
    blocking = EngineCapabilities.of(TorchLMBackend(TinyLMConfig()))
    assert blocking.lora and not blocking.background
    assert repr(blocking) == (
        "<EngineCapabilities TorchLMBackend: parks, loads, flat storage, forward collectives, "
        "lora; staged, sync>"
    )

    buffered = EngineCapabilities.of(AsyncTornReadBackend(VersionStampedModel(2, 8)))
    assert buffered.weight_buffer and buffered.background and buffered.parks
    assert SyncMode.ASYNC_PER_FORWARD in buffered.sync_modes

    with pytest.raises(TypeError, match=r"an engine subclasses rollout_sync\.RolloutBase"):
        EngineCapabilities.of(cast(Any, object()))
