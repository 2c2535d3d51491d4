"""RolloutBase's weights, lazy start and torn state, and a backend serving on its own thread.

The paused() contract of both (re-entrant, bounded, always resumes, a no-op before the engine,
no forward while parked) is checked in tests/test_paused_contract.py, with every other backend.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch
from conftest import wait_until

from rollout_sync import (
    PauseTimeout,
    RolloutBase,
    ThreadedRolloutBackend,
    TornWeightsError,
    WeightMismatchError,
)

pytestmark = pytest.mark.timeout(30)


class BlockingEngine(RolloutBase):
    """An engine whose generate call blocks the caller: the base pause is right for it."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights


class SteppedBackend(ThreadedRolloutBackend):
    """Each serving step waits for the test's go-ahead, so the test controls where it is."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.in_step = threading.Event()
        self.proceed = threading.Event()
        self.block_steps = True

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return {}

    def serve_step(self) -> None:
        self.in_step.set()
        if self.block_steps:
            assert self.proceed.wait(20), "test never let the step finish"
            self.proceed.clear()


def test_base_load_weights_validates_everything_before_writing() -> None:
    engine = BlockingEngine()
    good_a = torch.ones(3)
    with pytest.raises(WeightMismatchError) as info:
        engine.load_weights({"a": good_a, "b": torch.ones(3, 3), "c": torch.ones(1)})
    assert len(info.value.problems) == 2
    assert "b: shape [3, 3] does not match served [2, 2]" in str(info.value)
    assert "c: not a served weight" in str(info.value)
    assert torch.equal(engine.weights["a"], torch.zeros(3)), "nothing written on a bad input"
    with pytest.raises(WeightMismatchError, match="missing"):
        engine.load_weights({"a": good_a})
    with pytest.raises(WeightMismatchError, match="dtype"):
        engine.load_weights({"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, 2)})
    engine.load_weights({"a": good_a}, require_all=False)
    assert torch.equal(engine.weights["a"], good_a)


def test_lazy_initialization_runs_once() -> None:
    calls = []

    class Lazy(BlockingEngine):
        def initialize(self) -> None:
            calls.append(1)

    engine = Lazy()
    assert not engine.is_initialized
    engine.ensure_initialized()
    engine.ensure_initialized()
    assert engine.is_initialized and calls == [1]


def test_an_engine_initialized_by_hand_is_never_built_twice() -> None:
    """``b.initialize()`` by hand, then a worker's ``ensure_initialized``: one engine, whatever
    the subclass chain does (a subclass's ``super().initialize()`` runs its part once)."""
    built: list[str] = []

    class Engine(BlockingEngine):
        def initialize(self) -> None:
            built.append("engine")

    class Tuned(Engine):
        def initialize(self) -> None:
            super().initialize()
            built.append("tuned")

    class Failing(BlockingEngine):
        tries = 0

        def initialize(self) -> None:
            Failing.tries += 1
            if Failing.tries == 1:
                raise RuntimeError("no device yet")
            built.append("failing")

    engine = Tuned()
    engine.initialize()
    assert engine.is_initialized and built == ["engine", "tuned"]
    engine.initialize()
    engine.ensure_initialized()
    assert built == ["engine", "tuned"]
    failing = Failing()
    with pytest.raises(RuntimeError, match="no device yet"):
        failing.initialize()
    assert not failing.is_initialized  # a failed build is not a build: the next one tries
    failing.ensure_initialized()
    failing.initialize()
    assert failing.is_initialized and built[-1:] == ["failing"] and Failing.tries == 2


def test_torn_weights_refuse_generation_until_a_commit() -> None:
    engine = BlockingEngine()
    engine.check_servable()
    engine.mark_weights_torn("P2R failed after 2 of 5 buckets")
    with pytest.raises(TornWeightsError, match="2 of 5 buckets"):
        engine.check_servable()
    engine.commit_weight_version(7)
    engine.check_servable()
    assert engine.weight_version == 7


def test_threaded_backend_pause_timeout_is_clear_and_serving_continues() -> None:
    backend = SteppedBackend()
    backend.start()
    assert backend.in_step.wait(10)
    with pytest.raises(PauseTimeout) as info:
        with backend.paused(timeout=0.2):
            pytest.fail("must not get here")
    assert str(info.value) == "generation did not park within 0.2 s (1 serving step still running)"
    assert not backend.generation_gate.held
    backend.block_steps = False
    backend.in_step.clear()
    backend.proceed.set()
    assert backend.in_step.wait(10), "serving continues after the failed pause"
    backend.stop()


def test_threaded_backend_serves_nothing_while_torn() -> None:
    backend = SteppedBackend()
    backend.block_steps = False
    with backend.paused(timeout=10):
        backend.mark_weights_torn("test")
        backend.start()
    n = backend.statistics().steps_served
    # Not serving: a bounded check that no step starts while torn.
    backend.in_step.clear()
    assert not backend.in_step.wait(0.3)
    assert backend.statistics().steps_served == n
    backend.commit_weight_version(1)
    assert backend.in_step.wait(10)
    backend.stop()


def test_serving_error_is_reraised_by_stop() -> None:
    class Failing(SteppedBackend):
        def serve_step(self) -> None:
            raise OSError("simulator crashed")

    backend = Failing()
    backend.start()
    wait_until(lambda: not backend.running)
    with pytest.raises(RuntimeError, match="serving thread failed") as info:
        backend.stop()
    assert isinstance(info.value.__cause__, OSError)
