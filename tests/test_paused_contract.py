"""The paused() contract suite (rollout_sync.testing.paused_contract) on every backend here.

One generic test runs every check on every backend, as trio's one lock test runs over eight
locks: RolloutBase's default, ThreadedRolloutBackend, the testing fakes that are backends, the
torch LM blocking and stream backends, RolloutTaskScheduler, and both vLLM backends (one engine
each for the module, skipped without vLLM). cosmos-rl's pause target runs the same suite in
tests/cosmos_rl_env/test_paused_contract.py (it needs cosmos-rl's own scheduler).

Then each check is shown to fail: a deliberately broken backend per clause (one that resumes
when the inner pause exits, one that ignores its timeout, ...) and the check that catches it.
"""

from __future__ import annotations

import math
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import wait_until
from torch_lm_helpers import one_torch_thread, tiny_config  # noqa: F401 - an autouse fixture
from vllm_helpers import World, running_world  # first: it sets the environment vLLM reads

from rollout_sync import (
    Gate,
    PauseTimeout,
    RolloutBase,
    RolloutTaskScheduler,
    ThreadedRolloutBackend,
    Timeline,
)
from rollout_sync.backends.torch_lm import TorchLMBackend, TorchLMStreamBackend
from rollout_sync.backends.vllm import VLLMBlockingBackend
from rollout_sync.errors import PausedContractViolation
from rollout_sync.testing import (
    AsyncTornReadBackend,
    EventLog,
    RecordingRollout,
    TornReadBackend,
    VersionStampedModel,
)
from rollout_sync.testing.paused_contract import (
    PAUSED_CONTRACT_CHECKS,
    Parking,
    PausedCheck,
    PausedContract,
    PauseSharing,
    check_always_resumes,
    check_bounded,
    check_no_forward_while_parked,
    check_noop_before_engine,
    check_parks_at_a_step_boundary,
    check_reentrant,
    check_starts_parked_inside,
    run_paused_contract,
)

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30.0
"""Seconds, the bound of every wait in the honest backends' checks."""


# -- the backends ----------------------------------------------------------------------------


class MinimalBackend(RolloutBase):
    """The least a backend writes: served weights. Its paused() is RolloutBase's default."""

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return {}


class SteppingBackend(ThreadedRolloutBackend):
    """A backend serving on its own thread, each serving step a tenth of a millisecond."""

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return {}

    def serve_step(self) -> None:
        torch.ones(64).sum()  # the step's work
        threading.Event().wait(1e-4)  # and its duration


class LoopingTorchLM(TorchLMBackend):
    """TorchLMBackend's blocking generate(), called again and again on a thread of its own: a
    caller that is not the loop running syncs, so its gate parks generate between two steps."""

    def start(self) -> None:
        self.ensure_initialized()
        self._stopping = threading.Event()
        self._loop = threading.Thread(target=self._generate_forever, daemon=True)
        self._loop.start()

    def _generate_forever(self) -> None:
        while not self._stopping.is_set():
            self.generate([[1, 2, 3], [4, 5]], max_new_tokens=40, timeout=TIMEOUT)

    def stop(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            self._stopping.set()
            loop.join(TIMEOUT)
            assert not loop.is_alive(), "the generate loop did not stop"


@contextmanager
def held_forward(engine: TorchLMBackend) -> Iterator[None]:
    """Hold the engine's next forward at its first block until the ``with`` body exits."""
    holding, release = threading.Event(), threading.Event()

    def hook(index: int) -> None:
        if index == 0 and not release.is_set():
            holding.set()
            assert release.wait(TIMEOUT), "the held forward was never released"

    engine.layer_hook = hook
    try:
        assert holding.wait(TIMEOUT), "no forward started"
        yield
    finally:
        release.set()
        engine.layer_hook = None


def _feed(put: Callable[..., int]) -> None:
    # Requests enough for every check to see generation running from start to end.
    for i in range(800):
        put([1 + i % 40, 2, 3], max_new_tokens=40)


def _start_stream(backend: TorchLMStreamBackend) -> None:
    _feed(backend.put)
    backend.start()


def _start_scheduler(scheduler: RolloutTaskScheduler) -> None:
    _feed(scheduler.put)
    scheduler.start()


def _gate_observers(gate_of: Callable[[Any], Gate]) -> dict[str, Any]:
    return {
        "parked": lambda b: gate_of(b).held,
        "held_back": lambda b: gate_of(b).statistics().sections_waiting > 0,
        "parks": lambda b: gate_of(b).statistics().exclusive_acquired,
        "pause_pending": lambda b: gate_of(b).statistics().exclusive_waiting > 0,
    }


def _trivial(name: str, new: Callable[[], RolloutBase]) -> PausedContract[Any]:
    return PausedContract(
        name=name,
        new=new,
        engine_exists=lambda b: b.is_initialized,
        parking=Parking.TRIVIAL,
        start=lambda b: b.ensure_initialized(),
    )


def rollout_base_default(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return _trivial("RolloutBase", MinimalBackend)


def threaded_backend(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract.for_threaded_backend(
        "ThreadedRolloutBackend", SteppingBackend, timeout=TIMEOUT
    )


def torn_read_backend(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract.for_threaded_backend(
        "TornReadBackend",
        lambda: TornReadBackend(VersionStampedModel(num_tensors=4, numel=64)),
        timeout=TIMEOUT,
    )


def async_torn_read_backend(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract.for_threaded_backend(
        "AsyncTornReadBackend",
        lambda: AsyncTornReadBackend(VersionStampedModel(num_tensors=4, numel=64)),
        timeout=TIMEOUT,
    )


def recording_rollout(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return _trivial("RecordingRollout", lambda: RecordingRollout(EventLog()))


def torch_lm_generate(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="TorchLMBackend (generate on another thread)",
        new=lambda: LoopingTorchLM(tiny_config()),
        engine_exists=lambda b: b.is_initialized,
        start=lambda b: b.start(),
        stop=lambda b: b.stop(),
        forwards=lambda b: b.statistics().forwards,
        stall=held_forward,
        timeout=TIMEOUT,
        **_gate_observers(lambda b: b.generation_gate),
    )


def torch_lm_stream(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="TorchLMStreamBackend",
        new=lambda: TorchLMStreamBackend(tiny_config(), max_concurrent=2),
        engine_exists=lambda b: b.is_initialized or b.scheduler.started,
        start=_start_stream,
        stop=lambda b: b.stop(TIMEOUT),
        forwards=lambda b: b.statistics().forwards,
        stall=held_forward,
        timeout=TIMEOUT,
        **_gate_observers(lambda b: b.generation_gate),
    )


def rollout_task_scheduler(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="RolloutTaskScheduler",
        new=lambda: RolloutTaskScheduler(TorchLMBackend(tiny_config()), max_concurrent=2),
        engine_exists=lambda s: s.started,
        start=_start_scheduler,
        stop=lambda s: s.stop(TIMEOUT),
        forwards=lambda s: s.statistics().steps,
        stall=lambda s: held_forward(s.engine),
        timeout=TIMEOUT,
        **_gate_observers(lambda s: s.gate),
    )


# -- the vLLM backends: one engine each for the module -----------------------------------------


@pytest.fixture(scope="module")
def vllm_async_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World[Any]]:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from rollout_sync.backends.vllm import VLLMAsyncBackend

    with running_world(
        VLLMAsyncBackend,
        tmp_path_factory.mktemp("contract_async_llama"),
        model_seed=5,
        weights_seed=5000,
        pause_timeout=60.0,
        rpc_timeout=60.0,
    ) as world:
        yield world


@pytest.fixture(scope="module")
def vllm_blocking_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World[Any]]:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    with running_world(
        VLLMBlockingBackend,
        tmp_path_factory.mktemp("contract_blocking_llama"),
        model_seed=6,
        weights_seed=6000,
    ) as world:
        yield world


def _unstarted_vllm(backend_class: type) -> Any:
    from rollout_sync.backends.vllm import VLLMEngineConfig

    return backend_class(VLLMEngineConfig(Path(tempfile.mkdtemp())), timeline=Timeline())


@contextmanager
def _stalled_engine(backend: Any) -> Iterator[None]:
    """Hold the engine between two steps (the stalling worker extension's RPC) for the body."""
    files = Path(tempfile.mkdtemp())
    started, release = files / "started", files / "release"
    engine = backend.engine

    async def stall() -> object:
        return await engine.collective_rpc(
            "rollout_sync_stall", args=(str(started), str(release), TIMEOUT)
        )

    thread = threading.Thread(target=lambda: backend.run_on_loop(stall(), 2 * TIMEOUT, "stall"))
    thread.start()
    try:
        # The engine touches the file: there is no event to wait on across it.
        wait_until(started.exists, TIMEOUT, "the engine to start the stall")
        yield
    finally:
        release.touch()
        thread.join(2 * TIMEOUT)


@contextmanager
def _decoding(backend: Any) -> Iterator[Any]:
    """The module's engine, with one request after another decoding until the body exits."""
    from rollout_sync.backends.vllm import greedy_params

    lock = threading.Lock()
    stopping = False
    current: list[Any] = []

    def feed() -> None:
        while True:
            with lock:  # no request is submitted once the body has exited
                if stopping:
                    return
                current[:] = [backend.submit([1, 2, 3], greedy_params(1500))]
            current[0].result(timeout=5 * TIMEOUT)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        wait_until(
            lambda: bool(current) and len(current[0].tokens()) > 1, TIMEOUT, "the first tokens"
        )
        yield backend
    finally:
        with lock:
            stopping = True
        if current:
            backend.abort(current[0])
        feeder.join(TIMEOUT)
        assert not feeder.is_alive(), "the request feeder did not stop"


def vllm_async(request: pytest.FixtureRequest) -> PausedContract[Any]:
    pytest.importorskip("vllm")
    from rollout_sync.backends.vllm import VLLMAsyncBackend

    world: World[Any] = request.getfixturevalue("vllm_async_world")
    return PausedContract(
        name="VLLMAsyncBackend",
        new=lambda: _unstarted_vllm(VLLMAsyncBackend),
        engine_exists=lambda b: b.is_initialized,
        stop=lambda b: b.shutdown() if b is not world.backend else None,
        running=lambda: _decoding(world.backend),
        forwards=lambda b: b.engine_forward_count(),
        parked=lambda b: b.parked,
        parks=lambda b: b.statistics().pauses,
        stall=_stalled_engine,
        sharing=PauseSharing.SERIALIZED,
        timeout=60.0,
        late_s=5.0,
        quiet_s=0.5,
        skip={
            "check_starts_parked_inside": (
                "a second engine started inside a pause costs ~30 s here; "
                "tests/test_vllm_async.py::test_lazy_start_inside_a_sync_begins_parked_and_resumes "
                "checks it on that module's engine"
            )
        },
    )


def vllm_blocking(request: pytest.FixtureRequest) -> PausedContract[Any]:
    pytest.importorskip("vllm")
    world: World[Any] = request.getfixturevalue("vllm_blocking_world")
    return PausedContract(
        name="VLLMBlockingBackend",
        new=lambda: _unstarted_vllm(VLLMBlockingBackend),
        engine_exists=lambda b: b.is_initialized,
        parking=Parking.TRIVIAL,
        stop=lambda b: b.shutdown() if b is not world.backend else None,
        running=lambda: nullcontext(world.backend),
        skip={
            "check_starts_parked_inside": (
                "a second engine costs ~30 s here, and a blocking engine started inside a "
                "pause generates nothing of its own"
            )
        },
    )


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], PausedContract[Any]]] = {
    "RolloutBase": rollout_base_default,
    "ThreadedRolloutBackend": threaded_backend,
    "TornReadBackend": torn_read_backend,
    "AsyncTornReadBackend": async_torn_read_backend,
    "RecordingRollout": recording_rollout,
    "TorchLMBackend": torch_lm_generate,
    "TorchLMStreamBackend": torch_lm_stream,
    "RolloutTaskScheduler": rollout_task_scheduler,
    "VLLMAsyncBackend": vllm_async,
    "VLLMBlockingBackend": vllm_blocking,
}
_SLOW = {"VLLMAsyncBackend", "VLLMBlockingBackend"}


@pytest.mark.parametrize("check", PAUSED_CONTRACT_CHECKS, ids=str)
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=(pytest.mark.vllm, pytest.mark.timeout(420)))
        if name in _SLOW
        else name
        for name in BACKENDS
    ],
)
def test_every_backend_keeps_the_paused_contract(
    backend: str, check: PausedCheck, request: pytest.FixtureRequest
) -> None:
    contract = BACKENDS[backend](request)
    reason = check.skip_reason(contract)
    if reason is not None:
        pytest.skip(reason)
    check(contract)


def test_the_blocking_backends_keep_the_base_pause() -> None:
    """Idle by construction: their paused() is RolloutBase's no-op, not an override."""
    for backend_class in (MinimalBackend, VLLMBlockingBackend):
        assert backend_class.paused is RolloutBase.paused, backend_class


def test_run_paused_contract_reports_what_passed_and_what_was_skipped_and_why() -> None:
    report = run_paused_contract(_trivial("RolloutBase", MinimalBackend))
    assert report.passed == [
        "check_noop_before_engine",
        "check_starts_parked_inside",
        "check_reentrant",
        "check_always_resumes",
    ]
    assert set(report.skipped) == {
        "check_bounded",
        "check_parks_at_a_step_boundary",
        "check_no_forward_while_parked",
    }
    assert all("parks trivially" in why for why in report.skipped.values())
    assert str(report).startswith("RolloutBase: 4 passed, 3 skipped")


def test_a_contract_that_cannot_be_driven_is_refused_and_a_check_that_does_not_apply_says_why() -> (
    None
):
    with pytest.raises(ValueError, match=r"needs forwards=.*needs start= or running="):
        PausedContract(name="x", new=MinimalBackend, engine_exists=lambda b: False)
    with pytest.raises(ValueError, match=r"skip= names no check: \['check_bounde'\]"):
        _contract_of(SteppingBackend, skip={"check_bounde": "typo"})
    trivial = _trivial("RolloutBase", MinimalBackend)
    with pytest.raises(ValueError, match="check_bounded does not apply to RolloutBase: parks"):
        check_bounded(trivial)
    no_stall = _contract_of(SteppingBackend, stall=None)
    (bounded,) = [c for c in PAUSED_CONTRACT_CHECKS if c.name == "check_bounded"]
    assert bounded.skip_reason(no_stall) == "the contract gives no stall (see PausedContract)"


# -- each check can fail: a broken backend per clause ------------------------------------------


class StartsTheEngine(SteppingBackend):
    """Starts its engine to park it: paused() before the engine exists is no longer a no-op."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        if not self.running:
            self.start()
        with super().paused(timeout):
            yield


class IdleUntilStarted(SteppingBackend):
    """Parks only an engine that runs at entry: one started inside the body serves at once."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        if not self.running:
            yield
            return
        with super().paused(timeout):
            yield


class ResumesAtTheInnerExit(SteppingBackend):
    """Not re-entrant: the inner pause's exit resumes generation while the outer body runs."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        gate = self.generation_gate
        if not gate.held:
            gate.acquire_exclusive(timeout)
        try:
            yield
        finally:
            if gate.held_by_current_thread:
                gate.release_exclusive()


class IgnoresItsTimeout(SteppingBackend):
    """Waits for ever for the step in progress, whatever the timeout."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        with self.generation_gate.exclusive(math.inf):
            yield


class RaisesABareTimeoutError(SteppingBackend):
    """Runs out of time with the builtin TimeoutError, not the package's PauseTimeout."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        try:
            self.generation_gate.acquire_exclusive(timeout)
        except PauseTimeout as exc:
            raise TimeoutError(str(exc)) from None
        try:
            yield
        finally:
            self.generation_gate.release_exclusive()


class ParksLate(SteppingBackend):
    """Lets three more steps run after the step in progress before it parks (a drain in
    disguise). It learns that the step in progress ended from the stall below."""

    def __init__(self) -> None:
        super().__init__()
        self.pause_asked = False
        self.stall_over = threading.Event()
        self._steps_left = 0
        self._three_served = threading.Event()

    def serve_step(self) -> None:
        super().serve_step()
        if self.stall_over.is_set() and self._steps_left > 0:
            self._steps_left -= 1  # only this serving thread counts down
            if self._steps_left == 0:
                self._three_served.set()

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        self.pause_asked = True
        self._three_served.clear()
        self._steps_left = 3
        try:
            assert self.stall_over.wait(TIMEOUT), "the stall never ended"
            assert self._three_served.wait(TIMEOUT), "three more steps never ran"
            with super().paused(timeout):
                yield
        finally:
            self.pause_asked = False


@contextmanager
def _section_then_tell(backend: ParksLate) -> Iterator[None]:
    with backend.generation_gate.section():
        yield
    backend.stall_over.set()


class NeverResumesAfterAnError(SteppingBackend):
    """Releases the park after the body only if the body returned: no ``finally``."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        self.generation_gate.acquire_exclusive(timeout)
        yield
        self.generation_gate.release_exclusive()


class SwallowsTheBodysError(SteppingBackend):
    """Resumes, but swallows what the body raised ("a failed sync must not crash the loop")."""

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        with self.generation_gate.exclusive(timeout):
            try:
                yield
            except Exception:  # noqa: BLE001 - the bug this backend shows
                pass


class HoldsTheWrongGate(SteppingBackend):
    """Holds a gate of its own (and says it is parked) while its steps run in another."""

    def __init__(self) -> None:
        super().__init__()
        self.own_gate = Gate.for_generation("serving step", timeout=TIMEOUT)

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        with self.own_gate.exclusive(timeout):
            yield


def _release_and_stop(backend: SteppingBackend) -> None:
    """Stop a broken backend even if it left its gate held by this thread."""
    while backend.generation_gate.held_by_current_thread:
        backend.generation_gate.release_exclusive()
    backend.stop(5.0)


def _contract_of(backend_class: type[SteppingBackend], **overrides: Any) -> PausedContract[Any]:
    fields: dict[str, Any] = {"timeout": 3.0, "late_s": 1.0, "stop": _release_and_stop}
    fields.update(overrides)
    return PausedContract.for_threaded_backend(backend_class.__name__, backend_class, **fields)


BROKEN: list[tuple[Callable[[PausedContract[Any]], None], PausedContract[Any], str]] = [
    (check_noop_before_engine, _contract_of(StartsTheEngine), "started the engine"),
    (
        check_starts_parked_inside,
        _contract_of(IdleUntilStarted),
        r"after the engine started inside the pause: the backend says generation is not parked",
    ),
    (
        check_reentrant,
        _contract_of(ResumesAtTheInnerExit),
        r"after the innermost of three pauses exited: the backend says generation is not parked",
    ),
    (
        check_bounded,
        _contract_of(IgnoresItsTimeout),
        r"paused\(0\.2\) was still waiting 1\.2 s after it was called.*does not honour its "
        r"timeout",
    ),
    (
        check_bounded,
        _contract_of(RaisesABareTimeoutError),
        r"raised TimeoutError .* not rollout_sync's PauseTimeout",
    ),
    (
        check_parks_at_a_step_boundary,
        _contract_of(ParksLate, pause_pending=lambda b: b.pause_asked, stall=_section_then_tell),
        r"parked only after [3-9] more forwards",
    ),
    (
        check_always_resumes,
        _contract_of(NeverResumesAfterAnError),
        r"generation stayed parked after the body raised RuntimeError",
    ),
    (
        check_always_resumes,
        _contract_of(SwallowsTheBodysError),
        r"paused\(\) swallowed the RuntimeError its body raised",
    ),
    (
        check_no_forward_while_parked,
        # Its own word is its own gate: only the forwards show it parks nothing.
        _contract_of(HoldsTheWrongGate, parked=lambda b: b.own_gate.held),
        r"inside a pause: \d+ forward\(s\) ran while generation was parked",
    ),
    (
        check_no_forward_while_parked,
        # The real scheduler with its guard off (guard_steps=False, the knob that measures the
        # guard's cost): paused() holds the gate, the steps no longer enter it.
        PausedContract(
            name="RolloutTaskScheduler(guard_steps=False)",
            new=lambda: RolloutTaskScheduler(
                TorchLMBackend(tiny_config()), max_concurrent=2, guard_steps=False
            ),
            engine_exists=lambda s: s.started,
            start=_start_scheduler,
            stop=lambda s: s.stop(TIMEOUT),
            forwards=lambda s: s.statistics().steps,
            timeout=3.0,
            **_gate_observers(lambda s: s.gate),
        ),
        r"inside a pause: \d+ forward\(s\) ran while generation was parked",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("check", "contract", "message"), BROKEN, ids=[c.name for _, c, _ in BROKEN]
)
def test_each_check_catches_the_backend_that_breaks_its_clause(
    check: Callable[[PausedContract[Any]], None], contract: PausedContract[Any], message: str
) -> None:
    with pytest.raises(PausedContractViolation, match=message) as caught:
        check(contract)
    assert isinstance(caught.value, AssertionError)
    assert (caught.value.backend, caught.value.check) == (contract.name, check.__name__)
    # The same check passes on the honest backend the broken one was made from.
    check(_contract_of(SteppingBackend))
