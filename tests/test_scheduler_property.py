"""Property test: random interleavings of admissions, decode steps and weight syncs.

The harness drives the scheduler by hand, so every interleaving is exact and reproducible: a
schedule is a list of operations, and ``sync_mid_step`` stops a decode step's forward between
two blocks (an event-controlled layer hook), lets a sync start from another thread, and only
then lets the forward go on. With the guard, the sync waits for the step to finish (it parks at
the step boundary) and nothing is ever torn; with the guard off, the same harness writes the
weights in the middle of the forward and hypothesis finds the torn read.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, find, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from torch_lm_helpers import (  # noqa: F401 - one_torch_thread is an autouse fixture
    Runner,
    SyncWorker,
    full_forward_argmax,
    one_torch_thread,
    tiny_config,
    wait_until,
    weights_of,
)

from rollout_sync import GenerationResult, SpanKind, Timeline
from rollout_sync.backends.torch_lm import TorchLMStreamBackend

CONFIG = tiny_config(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=32)

Op = tuple[Any, ...]

ops = st.one_of(
    st.tuples(
        st.just("put"),
        st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=6),
        st.integers(1, 6),
    ),
    st.tuples(st.just("step")),
    st.tuples(st.just("sync")),
    st.tuples(st.just("sync_mid_step"), st.integers(0, CONFIG.n_layers)),
)
schedules = st.lists(ops, min_size=1, max_size=24)


@dataclass
class Outcome:
    torn_forwards: int
    forward_write_overlaps: int
    put_ids: list[int]
    results: list[GenerationResult]
    syncs: int


def run_schedule(schedule: Sequence[Op], *, guarded: bool) -> Outcome:
    """Play ``schedule`` on a fresh stream backend, driven by hand; then finish every request."""
    timeline = Timeline()
    backend = TorchLMStreamBackend(CONFIG, max_concurrent=3, timeline=timeline)
    scheduler = backend.scheduler
    worker = SyncWorker(backend, timeline)
    sync = worker.receive_weights if guarded else worker.receive_weights_unguarded
    weights = {0: weights_of(CONFIG, 0)}
    put_ids: list[int] = []

    def next_version() -> int:
        version = len(weights)
        weights[version] = weights_of(CONFIG, version)
        return version

    for op in schedule:
        kind = op[0]
        if kind == "put":
            put_ids.append(scheduler.put(op[1], max_new_tokens=op[2]))
        elif kind == "step":
            scheduler.step(timeout=10)
        elif kind == "sync":
            version = next_version()
            sync(version, weights[version])
        else:
            version = next_version()
            stats = scheduler.statistics()
            if not (stats.active or stats.queued):
                sync(version, weights[version])  # no forward to interleave with
            else:
                if currently_in_test_context():
                    event("a sync landed inside a forward with work in flight")
                _sync_inside_a_step(backend, op[1], lambda v=version: sync(v, weights[v]))
    while scheduler.statistics().active or scheduler.statistics().queued:
        scheduler.step(timeout=10)
    forward_writes = [o for o in timeline.overlaps() if o.first.kind == SpanKind.FORWARD]
    return Outcome(
        backend.torn_forwards, len(forward_writes), put_ids, scheduler.get_all(), len(weights) - 1
    )


def _sync_inside_a_step(backend: TorchLMStreamBackend, layer: int, do_sync: Any) -> None:
    """Run one step on a thread, hold its forward before block ``layer``, run the sync."""
    at_layer, release = threading.Event(), threading.Event()

    def hold(index: int) -> None:
        if index == layer and not at_layer.is_set():
            at_layer.set()
            assert release.wait(10), "the driver never released the forward"

    backend.layer_hook = hold
    try:
        stepping = Runner(lambda: backend.scheduler.step(timeout=10), "step")
        assert at_layer.wait(10), "the step never reached the layer"
        syncing = Runner(do_sync, "sync")
        # Guarded, the sync parks: it waits at the gate for this step. Unguarded it just writes.
        wait_until(
            lambda: (
                syncing.done.is_set() or backend.generation_gate.statistics().exclusive_waiting > 0
            ),
            10,
            "the sync to write or to wait for the step",
        )
        release.set()
        stepping.join()
        syncing.join()
    finally:
        release.set()
        backend.layer_hook = None


def check_guarded(outcome: Outcome) -> None:
    assert outcome.torn_forwards == 0
    assert outcome.forward_write_overlaps == 0
    results = {r.request_id: r for r in outcome.results}
    assert sorted(results) == sorted(outcome.put_ids), "every request ends as one result"
    for r in results.values():
        assert r.ok, r.error
        versions = r.token_weight_versions
        assert list(versions) == sorted(versions), "versions only move forward"
        assert r.admitted_weight_version == versions[0]
        assert r.completed_weight_version == versions[-1]
        assert r.straddled_sync == (versions[0] != versions[-1])
        assert r.recomputes == len(set(versions)) - 1
        # Recompute policy: each token is the greedy choice of the weights it was produced
        # under, from the whole context before it, as if those weights had always been served.
        context = [*r.prompt, *r.tokens]
        for version in set(versions):
            predicted = full_forward_argmax(CONFIG, version, context)
            for i, (token, v) in enumerate(zip(r.tokens, versions, strict=True)):
                if v == version:
                    assert token == predicted[len(r.prompt) + i - 1], (
                        f"request {r.request_id} token {i} is not v{v}'s greedy choice"
                    )


PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(300)
@PROPERTY_SETTINGS
@given(schedules)
def test_guarded_interleavings_never_tear_and_keep_every_contract(schedule: list[Op]) -> None:
    check_guarded(run_schedule(schedule, guarded=True))


@pytest.mark.timeout(300)
def test_with_the_guard_off_the_same_harness_finds_a_torn_read() -> None:
    found = find(
        schedules,
        lambda schedule: run_schedule(schedule, guarded=False).torn_forwards > 0,
        settings=settings(
            max_examples=200,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    # The minimal counterexample: a request in flight and a sync landing inside its forward.
    assert [op[0] for op in found] == ["put", "sync_mid_step"]
    outcome = run_schedule(found, guarded=False)
    assert outcome.torn_forwards == 1 and outcome.forward_write_overlaps == 1
    # The very same schedule, guarded, is clean.
    check_guarded(run_schedule(found, guarded=True))


def test_a_sync_mid_step_is_exercised_with_work_in_flight() -> None:
    """The harness's interleaving is what it claims: guarded, the sync waited for the step."""
    schedule: list[Op] = [("put", [1, 2, 3], 4), ("step",), ("sync_mid_step", 1), ("step",)]
    outcome = run_schedule(schedule, guarded=True)
    (result,) = outcome.results
    assert result.token_weight_versions == (0, 0, 1, 1)
    check_guarded(outcome)
