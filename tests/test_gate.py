"""The Gate: sections vs exclusive holds, writer preference, timeouts, statistics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import pytest
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync import Gate, PauseTimeout
from rollout_sync.errors import GateTimeout, WouldBlock

pytestmark = pytest.mark.timeout(30)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_uncontended_sections_and_statistics() -> None:
    gate = Gate("generation", section_noun="forward")
    with gate.section():
        with gate.section():
            s = gate.statistics()
            assert s.sections_running == 2 and s.holders == 0
            assert repr(gate) == "<Gate 'generation' open: 2 forwards, 0 waiting>"
    s = gate.statistics()
    assert s.sections_running == 0 and s.sections_entered == 2


def test_exclusive_waits_for_running_section_and_keeps_new_ones_out() -> None:
    gate = Gate()
    gate.enter_section()
    acquired = threading.Event()
    release = threading.Event()

    def sync() -> None:
        with gate.exclusive(timeout=10):
            acquired.set()
            release.wait(10)

    t, errors = in_thread(sync)
    wait_until(lambda: gate.statistics().exclusive_waiting == 1)
    assert not acquired.is_set()
    # Writer preference: with a holder waiting, no new section may start.
    with pytest.raises(WouldBlock):
        gate.enter_section_nowait()
    assert "closing" in repr(gate)
    gate.exit_section()
    assert acquired.wait(10)
    with pytest.raises(WouldBlock):
        gate.enter_section_nowait()
    release.set()
    t.join(10)
    assert not errors
    with gate.section():
        pass
    assert gate.statistics().exclusive_acquired == 1


def test_section_waits_out_the_hold() -> None:
    gate = Gate()
    gate.acquire_exclusive()
    started = threading.Event()

    def forward() -> None:
        with gate.section(timeout=10):
            started.set()

    t, errors = in_thread(forward)
    wait_until(lambda: gate.statistics().sections_waiting == 1)
    assert not started.is_set()
    gate.release_exclusive()
    assert started.wait(10)
    t.join(10)
    assert not errors


def test_back_to_back_holds_cannot_starve_a_waiting_section() -> None:
    """The release hands the gate to the sections that waited through the hold, so a holder
    that re-acquires at once must wait for them (one section), not overtake them."""
    gate = Gate()
    gate.acquire_exclusive()
    ran = threading.Event()

    def forward() -> None:
        with gate.section(timeout=10):
            ran.set()

    t, errors = in_thread(forward)
    wait_until(lambda: gate.statistics().sections_waiting == 1)
    gate.release_exclusive()
    with pytest.raises(WouldBlock):
        gate.acquire_exclusive_nowait()  # the waiting forward was admitted by the release
    gate.acquire_exclusive(timeout=10)  # ...and a blocking re-acquire waits it out
    assert ran.is_set()
    gate.release_exclusive()
    t.join(10)
    assert not errors
    assert gate.statistics().sections_entered == 1


def test_exclusive_is_reentrant_and_shared_between_threads() -> None:
    gate = Gate()
    with gate.exclusive():
        with gate.exclusive():
            assert gate.held_by_current_thread
        assert gate.held
        inside = threading.Event()
        leave = threading.Event()

        def other_holder() -> None:
            with gate.exclusive(timeout=5):
                inside.set()
                leave.wait(10)

        t, errors = in_thread(other_holder)
        assert inside.wait(10), "a second holder is admitted while the gate is held"
        assert gate.statistics().holders == 2
    # The first holder left; the second still holds: sections stay out.
    with pytest.raises(WouldBlock):
        gate.enter_section_nowait()
    leave.set()
    t.join(10)
    assert not errors
    gate.enter_section_nowait()
    gate.exit_section()


def test_exclusive_timeout_names_what_is_running_and_restores_the_gate() -> None:
    gate = Gate("generation", section_noun="forward", close_verb="park", timeout_error=PauseTimeout)
    gate.enter_section()
    gate.enter_section()
    waiter_done = threading.Event()

    def blocked_forward() -> None:
        # Starts while the sync is waiting, so it is held back; it must get in afterwards.
        with gate.section(timeout=10):
            waiter_done.set()

    start = time.monotonic()
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            gate.acquire_exclusive(timeout=0.3)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=sync)
    t.start()
    wait_until(lambda: gate.statistics().exclusive_waiting == 1)
    t2, errors2 = in_thread(blocked_forward)
    t.join(10)
    elapsed = time.monotonic() - start
    assert len(errors) == 1 and isinstance(errors[0], PauseTimeout)
    err = errors[0]
    assert isinstance(err, TimeoutError) and isinstance(err, GateTimeout)
    assert str(err) == "generation did not park within 0.3 s (2 forwards still running)"
    assert err.sections_running == 2 and err.timeout == 0.3
    assert elapsed < 5
    assert waiter_done.wait(10), "sections held back by the failed sync start again"
    t2.join(10)
    assert not errors2
    gate.exit_section()
    gate.exit_section()
    assert gate.statistics().timeouts == 1 and not gate.held


def test_section_inside_own_hold_is_an_error_not_a_deadlock() -> None:
    gate = Gate()
    with gate.exclusive():
        with pytest.raises(RuntimeError, match="wait for itself"):
            gate.enter_section()


def test_wait_idle_is_a_flush_not_a_hold() -> None:
    gate = Gate()
    gate.enter_section()
    flushed = threading.Event()
    t, errors = in_thread(lambda: (gate.wait_idle(10), flushed.set()))
    wait_until(lambda: gate._idle_waiting == 1)
    gate.enter_section_nowait()  # a flush does not keep new sections out
    gate.exit_section()
    assert not flushed.is_set()
    gate.exit_section()
    assert flushed.wait(10)
    t.join(10)
    assert not errors


def test_misuse_is_reported() -> None:
    gate = Gate()
    with pytest.raises(RuntimeError):
        gate.exit_section()
    with pytest.raises(RuntimeError):
        gate.release_exclusive()
    with pytest.raises(ValueError):
        gate.acquire_exclusive(timeout=-1)
    with pytest.raises(ValueError):
        Gate(default_timeout=0)


def test_infinite_timeout_is_allowed() -> None:
    gate = Gate()
    with gate.exclusive(timeout=math.inf):
        pass
    with gate.section(timeout=math.inf):
        pass


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["section", "exclusive"]), min_size=2, max_size=12))
def test_no_section_ever_runs_while_held(ops: list[str]) -> None:
    """Threads doing a random mix of sections and holds never see both at once."""
    gate = Gate(default_timeout=20)
    lock = threading.Lock()
    state = {"sections": 0, "holders": 0, "violations": 0}
    barrier = threading.Barrier(len(ops))

    def note(key: str, delta: int) -> None:
        with lock:
            state[key] += delta
            if state["sections"] and state["holders"]:
                state["violations"] += 1

    def run(op: str) -> None:
        barrier.wait(10)
        for _ in range(20):
            if op == "section":
                with gate.section():
                    note("sections", 1)
                    note("sections", -1)
            else:
                with gate.exclusive():
                    note("holders", 1)
                    note("holders", -1)

    threads = [threading.Thread(target=run, args=(op,)) for op in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert state["violations"] == 0
    s = gate.statistics()
    assert s.sections_running == 0 and s.holders == 0 and s.exclusive_waiting == 0
