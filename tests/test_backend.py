"""RolloutBase's default pause, and a backend serving on its own thread that really parks."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch
from conftest import ThreadRunner, wait_until

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


def test_base_pause_does_nothing_and_is_reentrant() -> None:
    engine = BlockingEngine()
    with engine.paused():
        with engine.paused(timeout=0.01):
            pass
    with pytest.raises(KeyError):
        with engine.paused():
            raise KeyError("body error propagates")


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


def test_torn_weights_refuse_generation_until_a_commit() -> None:
    engine = BlockingEngine()
    engine.check_servable()
    engine.mark_weights_torn("P2R failed after 2 of 5 buckets")
    with pytest.raises(TornWeightsError, match="2 of 5 buckets"):
        engine.check_servable()
    engine.commit_weight_version(7)
    engine.check_servable()
    assert engine.weight_version == 7


def test_threaded_backend_parks_between_steps(threads: ThreadRunner) -> None:
    backend = SteppedBackend()
    backend.start()
    assert backend.in_step.wait(10)
    parked = threading.Event()
    leave = threading.Event()

    def sync() -> None:
        with backend.paused(timeout=10):
            parked.set()
            assert leave.wait(10)

    threads.start(sync)
    wait_until(lambda: backend.generation_gate.statistics().exclusive_waiting == 1)
    assert not parked.is_set(), "the pause waits for the step in progress"
    steps_before = backend.statistics().steps_served
    backend.in_step.clear()
    backend.proceed.set()
    assert parked.wait(10)
    # Parked: the serving thread is waiting at the gate, not inside a step.
    wait_until(lambda: backend.generation_gate.statistics().sections_waiting == 1)
    assert not backend.in_step.is_set()
    assert backend.statistics().parked
    assert backend.statistics().steps_served == steps_before + 1
    leave.set()
    assert not threads.join_all()
    assert backend.in_step.wait(10), "serving resumes after the pause"
    backend.block_steps = False
    backend.proceed.set()
    backend.stop()


def test_threaded_backend_pause_is_noop_before_start_and_start_inside_begins_parked() -> None:
    backend = SteppedBackend()
    with backend.paused(timeout=0.5):
        assert not backend.running
        backend.start()  # lazy init inside a sync: the thread must not serve yet
        wait_until(lambda: backend.generation_gate.statistics().sections_waiting == 1)
        assert not backend.in_step.is_set()
    assert backend.in_step.wait(10)
    backend.block_steps = False
    backend.proceed.set()
    backend.stop()


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


def test_threaded_backend_resumes_after_exception_in_pause() -> None:
    backend = SteppedBackend()
    backend.block_steps = False
    backend.start()
    with pytest.raises(ValueError):
        with backend.paused(timeout=10):
            with backend.paused(timeout=10):  # re-entrant
                raise ValueError("transfer failed")
    assert not backend.generation_gate.held
    backend.in_step.clear()
    assert backend.in_step.wait(10), "serving resumes after the pause that raised"
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
