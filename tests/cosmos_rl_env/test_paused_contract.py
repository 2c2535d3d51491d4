"""The paused() contract suite on cosmos-rl 0.4.7's pause target (CosmosGenerationPause).

What the guard pauses on a cosmos rollout worker is a :class:`CosmosGenerationPause` over
cosmos's own ``RolloutTaskScheduler`` (thread mode, its own event loop) and the backend: here
the suite of ``rollout_sync.testing.paused_contract`` runs on it, one contract per strategy:

* ``park`` - stream generation, a backend with its own ``paused()`` (``ParkingStepEngine``):
  admission stops and the backend parks its generations at a step boundary;
* ``drain`` - stream generation, a backend without one (``StepEngine``): admission stops and
  active generations run to their end (0.4.7's behaviour);
* ``backend`` - ``rollout.mode = "sync"`` (no scheduler), a backend with its own ``paused()``,
  its generations driven on a thread of their own;
* ``none`` - sync mode, a backend without ``paused()``: idle by construction.

It runs in .venv-cosmos (cosmos's scheduler is cosmos's code), like the rest of this directory.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import pytest

if importlib.util.find_spec("cosmos_rl") is None:
    pytest.skip("cosmos-rl 0.4.7 is tested in .venv-cosmos", allow_module_level=True)

from rollout_sync.testing import cosmos_rl as harness  # noqa: E402, I001

from cosmos_rl.rollout.worker.asynchronous.rollout_task_scheduler import (  # noqa: E402
    RolloutTask,
    RolloutTaskScheduler,
)

from rollout_sync.integrations.cosmos_rl import CosmosGenerationPause  # noqa: E402
from rollout_sync.testing.paused_contract import (  # noqa: E402
    PAUSED_CONTRACT_CHECKS,
    Parking,
    PausedCheck,
    PausedContract,
)

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30.0
SMALL = {"steps": 16, "width": 1024, "step_work": 32}
"""A small engine (a 1024-float served tensor, a 32x32 matmul per step): many steps per check,
little CPU."""


class SyncModeEngine(harness.ParkingStepEngine):
    """``rollout.mode = "sync"``: nothing schedules generations, so a thread of the test runs
    them one after another (cosmos's main loop would, between commands)."""

    def drive(self) -> None:
        self.init_engine(quantization=None, seed=0, load_format="dummy")
        self._stopping = threading.Event()
        self._driver = threading.Thread(target=self._generate_forever, daemon=True)
        self._driver.start()

    def _generate_forever(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while not self._stopping.is_set():
                loop.run_until_complete(self.rollout_generation([{}], None, None, None))
        finally:
            loop.close()

    def halt(self) -> None:
        driver = getattr(self, "_driver", None)
        if driver is not None:
            self._stopping.set()
            driver.join(TIMEOUT)
            assert not driver.is_alive(), "the generation driver did not stop"


def _stream(engine: harness.StepEngine) -> CosmosGenerationPause:
    scheduler = RolloutTaskScheduler(
        rollout_engine=engine, data_packer=None, max_concurrent_requests=2, check_interval=0.001
    )
    return CosmosGenerationPause(scheduler, engine)


def _start_stream(pause: CosmosGenerationPause) -> None:
    # Generations enough for every check to see generation running from start to end; the
    # ones still queued when the scheduler stops are published as empty results.
    pause.scheduler.put_rollout_batch(
        [RolloutTask(idx=i, payload={"prompt": i}) for i in range(5000)]
    )
    pause.scheduler.start(
        lambda engine: engine.init_engine(quantization=None, seed=0, load_format="dummy"),
        wait_initialized=True,
    )


def _stop_stream(pause: CosmosGenerationPause) -> None:
    pause.scheduler.stop(wait=True, shutdown_engine=False)


class _HeldStep:
    """A decode step held (on cosmos's event loop) until the ``with`` body exits."""

    def __init__(self, engine: harness.StepEngine) -> None:
        self.engine = engine
        self.holding, self.release = threading.Event(), threading.Event()

    def _hook(self) -> None:
        if not self.release.is_set():
            self.holding.set()
            assert self.release.wait(TIMEOUT), "the held step was never released"

    def __enter__(self) -> None:
        self.engine.step_hook = self._hook
        assert self.holding.wait(TIMEOUT), "no decode step started"

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.engine.step_hook = None


def _engine_exists(pause: CosmosGenerationPause) -> bool:
    return bool(pause.backend.is_engine_initialized())


def park(request: pytest.FixtureRequest) -> PausedContract[Any]:
    def parked(p: CosmosGenerationPause) -> bool:
        return bool(p.scheduler.is_paused()) and p.backend.parking

    return PausedContract(
        name="CosmosGenerationPause (park)",
        new=lambda: _stream(harness.ParkingStepEngine(**SMALL)),
        engine_exists=_engine_exists,
        start=_start_stream,
        stop=_stop_stream,
        forwards=lambda p: p.backend.steps_run,
        parked=parked,
        held_back=lambda p: p.backend.steps_waiting > 0 or p.scheduler.active_tasks() == 0,
        pause_pending=lambda p: p.backend.parking,
        stall=lambda p: _HeldStep(p.backend),
        timeout=TIMEOUT,
        skip={"check_starts_parked_inside": _STARTS_UNPAUSED},
    )


_STARTS_UNPAUSED = (
    "by design: a pause entered before cosmos's scheduler runs pauses nothing (a backend parked "
    "then would hold the generations cosmos's own drain waits for); the scheduler starts in the "
    "first sync's handler and cosmos's _paused_async_live_weights drains what it runs then "
    "(tests/cosmos_rl_env/test_cosmos_rl.py::"
    "test_generations_queued_before_the_first_sync_are_not_torn_guarded)"
)


def drain(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="CosmosGenerationPause (drain)",
        new=lambda: _stream(harness.StepEngine(**SMALL)),
        engine_exists=_engine_exists,
        start=_start_stream,
        stop=_stop_stream,
        forwards=lambda p: p.backend.steps_run,
        parked=lambda p: bool(p.scheduler.is_paused()),
        # Admission is closed and the active generations have ended: nothing can step.
        held_back=lambda p: p.scheduler.active_tasks() == 0,
        stall=lambda p: _HeldStep(p.backend),
        step_boundary=False,
        timeout=TIMEOUT,
        skip={"check_starts_parked_inside": _STARTS_UNPAUSED},
    )


def backend_pause(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="CosmosGenerationPause (backend, sync mode)",
        new=lambda: CosmosGenerationPause(None, SyncModeEngine(**SMALL)),
        engine_exists=_engine_exists,
        start=lambda p: p.backend.drive(),
        stop=lambda p: p.backend.halt(),
        forwards=lambda p: p.backend.steps_run,
        parked=lambda p: p.backend.parking,
        held_back=lambda p: p.backend.steps_waiting > 0,
        pause_pending=lambda p: p.backend.parking,
        stall=lambda p: _HeldStep(p.backend),
        timeout=TIMEOUT,
    )


def no_pause(request: pytest.FixtureRequest) -> PausedContract[Any]:
    return PausedContract(
        name="CosmosGenerationPause (none, sync mode)",
        new=lambda: CosmosGenerationPause(None, harness.StepEngine(**SMALL)),
        engine_exists=_engine_exists,
        parking=Parking.TRIVIAL,
        start=lambda p: p.backend.init_engine(quantization=None, seed=0, load_format="dummy"),
    )


STRATEGIES: dict[str, Callable[[pytest.FixtureRequest], PausedContract[Any]]] = {
    "park": park,
    "drain": drain,
    "backend": backend_pause,
    "none": no_pause,
}


@pytest.mark.parametrize("check", PAUSED_CONTRACT_CHECKS, ids=str)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_cosmos_pause_target_keeps_the_paused_contract(
    strategy: str, check: PausedCheck, request: pytest.FixtureRequest
) -> None:
    contract = STRATEGIES[strategy](request)
    reason = check.skip_reason(contract)
    if reason is not None:
        pytest.skip(reason)
    check(contract)


def test_each_strategy_is_the_one_its_contract_names() -> None:
    """The contracts above drive the strategy they are named after (not all one path)."""
    for name, build in STRATEGIES.items():
        contract = build(None)  # type: ignore[arg-type]
        pause = contract.new()
        if contract.start is not None:
            contract.start(pause)
        try:
            with pause.paused(TIMEOUT):
                assert pause.strategy == name, (name, pause.strategy)
        finally:
            contract.stop(pause)
