"""Shared test helpers: bounded waits on observable state, never bare sleeps."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from rollout_sync.testing.processes import use_start_method

# Every multi-process test's children are forked from one fork server that imported torch and
# the package once, instead of each importing them (seconds per child on two cores).
if os.environ.get("ROLLOUT_SYNC_TEST_START_METHOD", "forkserver") == "forkserver":
    use_start_method("forkserver", preload=["torch", "torch.distributed", "rollout_sync"])


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Wait for a state another thread reaches (a bounded poll on observable state).

    Only where the code under test offers no event to wait on: where it does (a hook, a
    callback, a threading.Event of the test's own), wait on that instead."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what or predicate}")
        time.sleep(0.001)  # a bounded poll of state that offers no event to wait on


class ThreadRunner:
    """Runs callables on daemon threads and re-raises their errors at join."""

    def __init__(self) -> None:
        self._threads: list[tuple[threading.Thread, list[BaseException]]] = []

    def start(self, fn: Callable[[], object], name: str = "test-thread") -> threading.Thread:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append((t, errors))
        return t

    def join_all(self, timeout: float = 10.0) -> list[BaseException]:
        errors: list[BaseException] = []
        for t, errs in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise AssertionError(f"thread {t.name} did not finish within {timeout} s")
            errors.extend(errs)
        self._threads.clear()
        return errors


@pytest.fixture
def threads() -> ThreadRunner:
    return ThreadRunner()
