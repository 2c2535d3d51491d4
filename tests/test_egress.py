"""The packer protocol and payload_egress_held."""

from __future__ import annotations

import threading

import pytest
from conftest import ThreadRunner, wait_until

from rollout_sync import (
    EgressHoldTimeout,
    SupportsFlushPendingSends,
    SupportsHoldSends,
    payload_egress_held,
)
from rollout_sync.testing import EventLog, FlushOnlyPacker, PlainPacker, RecordingPacker

pytestmark = pytest.mark.timeout(30)


def test_capabilities_are_detected_structurally() -> None:
    assert isinstance(RecordingPacker(), SupportsHoldSends)
    assert isinstance(RecordingPacker(), SupportsFlushPendingSends)
    assert not isinstance(FlushOnlyPacker(), SupportsHoldSends)
    assert isinstance(FlushOnlyPacker(), SupportsFlushPendingSends)
    assert not isinstance(PlainPacker(), SupportsHoldSends | SupportsFlushPendingSends)


def test_prefers_hold_falls_back_to_flush_ignores_plain_and_repeats() -> None:
    log = EventLog()
    holder, flusher, plain = RecordingPacker(log=log), FlushOnlyPacker(log=log), PlainPacker()
    with payload_egress_held(holder, None, flusher, plain, holder) as report:
        log.add("body")
        assert holder.egress_gate.held
    assert log.events == ["hold_sends:enter", "flush_pending_sends", "body", "hold_sends:exit"]
    assert (report.held, report.flushed) == (1, 1)
    assert not holder.egress_gate.held


def test_several_holders_release_in_reverse_and_on_error() -> None:
    log = EventLog()
    data, validation = RecordingPacker(log=log), RecordingPacker(log=log)
    with pytest.raises(RuntimeError):
        with payload_egress_held(data, validation):
            raise RuntimeError("barrier failed")
    assert log.events == [
        "hold_sends:enter",
        "hold_sends:enter",
        "hold_sends:exit",
        "hold_sends:exit",
    ]
    assert not data.egress_gate.held and not validation.egress_gate.held


def test_hold_that_cannot_drain_times_out_and_releases_earlier_holds() -> None:
    first, stuck = RecordingPacker(), RecordingPacker()
    stuck.egress_gate.enter_section()  # a send that never completes
    with pytest.raises(
        EgressHoldTimeout,
        match=r"payload egress did not hold within 0\.2 s "
        r"\(1 payload send still running\)",
    ):
        with payload_egress_held(first, stuck, timeout=0.2):
            pytest.fail("must not get here")
    assert not first.egress_gate.held and not stuck.egress_gate.held
    stuck.egress_gate.exit_section()


def test_held_sends_are_queued_in_order_and_launched_on_release(threads: ThreadRunner) -> None:
    packer = RecordingPacker(capacity=64).start()
    try:
        packer.submit(0)
        packer.wait_sent(1, timeout=10)
        assert packer.sent == [0]
        with payload_egress_held(packer) as report:
            assert report.held == 1
            for i in range(1, 11):
                packer.submit(i)
            # The sender has taken the next payload and waits at the gate; nothing is sent.
            wait_until(lambda: packer.egress_gate.statistics().sections_waiting == 1)
            assert packer.sent == [0]
        packer.wait_sent(11, timeout=10)
        assert packer.sent == list(range(11))
    finally:
        packer.stop()


def test_weight_sync_thread_and_main_loop_both_hold_egress(threads: ThreadRunner) -> None:
    packer = RecordingPacker(capacity=64).start()
    try:
        both_inside = threading.Barrier(2, timeout=10)
        main_may_leave = threading.Event()

        def weight_sync_thread() -> None:
            with payload_egress_held(packer, timeout=5):
                both_inside.wait()
                packer.submit("during sync-thread hold")
            main_may_leave.set()

        with payload_egress_held(packer, timeout=5):
            threads.start(weight_sync_thread)
            both_inside.wait()
            assert main_may_leave.wait(10)
            # The other holder left; this one still holds: nothing has been sent.
            assert packer.egress_gate.held and packer.sent == []
        assert not threads.join_all()
        packer.wait_sent(1, timeout=10)
        assert packer.sent == ["during sync-thread hold"]
    finally:
        packer.stop()
