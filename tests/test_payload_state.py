"""The payload transport's bookkeeping and wire format, without processes or threads.

The sender pool's and the receiver's state are plain synchronous objects that take the time as
an argument, so holds, deadlines, deferrals and credit are driven here step by step, with a
clock the test owns. The sender pool's sequences drive a state that asserts every invariant it
documents after each operation (:class:`_CheckedPoolState`), so they check them at every step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync import NCCLRolloutMixin, SupportsHoldSends, SyncReport, weight_sync_handler
from rollout_sync.errors import EgressHoldTimeout, PayloadPeerTimeout, PayloadTransportError
from rollout_sync.payload._wire import (
    COALESCE_BYTES,
    MAX_BATCH,
    FrameKind,
    TransportEnd,
    coalesce,
    make_frame,
    pack_payload,
    read_frame,
    unpack_payload,
)
from rollout_sync.payload.receiver import ReceivedPayload, _ReceiverState
from rollout_sync.payload.sender import (
    _NEXT_PHASES,
    _Expire,
    _Offer,
    _PoolPhase,
    _SendPoolState,
)
from rollout_sync.testing import EventLog, RecordingRollout

S = 1_000_000_000  # one second in ns
CPU = torch.device("cpu")


def _checked(operation: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(operation)
    def run(self: _SendPoolState, *args: Any, **kwargs: Any) -> Any:
        try:
            return operation(self, *args, **kwargs)
        finally:
            # A refused operation too must leave the state whole.
            self.check_invariants()

    return run


class _CheckedPoolState(_SendPoolState):
    """A pool state that asserts every documented invariant after each of its operations."""

    def __init__(self, capacity: int, max_in_flight: int) -> None:
        super().__init__(capacity, max_in_flight)
        self.check_invariants()


_OPERATIONS = sorted(
    name
    for name, member in vars(_SendPoolState).items()
    if inspect.isfunction(member) and not name.startswith("_") and name != "check_invariants"
)
for _name in _OPERATIONS:
    setattr(_CheckedPoolState, _name, _checked(getattr(_SendPoolState, _name)))


def _register(state: _SendPoolState, n: int) -> list[int]:
    seqs = []
    for _ in range(n):
        assert state.try_reserve()
        seqs.append(state.commit(torch.zeros(16, dtype=torch.uint8)))
    return seqs


def _offer(work: object) -> _Offer:
    assert isinstance(work, _Offer), work
    return work


# -- the sender pool's state -------------------------------------------------------------------


def test_offers_take_the_oldest_payloads_against_the_oldest_credit() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=4)
    assert _register(state, 6) == [0, 1, 2, 3, 4, 5]
    assert state.next_work(0) is None  # no credit yet
    state.add_request(7, credits=3, timeout_ns=10 * S, now_ns=0)
    state.add_request(8, credits=5, timeout_ns=10 * S, now_ns=0)
    first = _offer(state.next_work(0))
    assert [e.seq for e in first.entries] == [0, 1, 2, 3]  # max_in_flight, not all credit
    assert first.first_request_id == 7
    assert state.next_work(0) is None  # one offer in flight at a time
    state.on_reply(first.offer_id, FrameKind.ACCEPT, 0)
    state.offer_accepted(first)
    state.offer_completed(first)
    assert [(r.request_id, r.credits) for r in state.requests] == [(8, 4)]
    second = _offer(state.next_work(0))
    assert [e.seq for e in second.entries] == [4, 5]
    assert second.first_request_id == 8


def test_registry_counts_unsent_in_flight_and_reserved_payloads() -> None:
    state = _CheckedPoolState(capacity=3, max_in_flight=2)
    _register(state, 2)
    state.add_request(0, credits=2, timeout_ns=S, now_ns=0)
    offer = _offer(state.next_work(0))
    assert state.occupancy == 2  # in flight still occupies the registry
    assert state.try_reserve()
    assert not state.try_reserve()  # reserved by a producer still packing counts too
    state.cancel_reservation()
    state.on_reply(offer.offer_id, FrameKind.ACCEPT, 0)
    state.offer_accepted(offer)
    state.offer_completed(offer)
    assert state.occupancy == 0 and state.all_sent()


def test_a_hold_stops_launching_and_a_request_keeps_its_time_through_it() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=8)
    state.add_request(1, credits=1, timeout_ns=1 * S, now_ns=0)
    state.begin_hold(now_ns=S // 2)  # 0.5 s of the request's 1 s used
    _register(state, 1)  # arrives while held: queued
    assert state.next_work(10 * S) is None  # held: nothing launches, nothing expires
    assert state.next_wakeup_s(10 * S) is None
    state.end_hold(now_ns=10 * S)
    # 0.4 s after the hold ended the request has used 0.9 s of its 1 s: still served.
    offer = _offer(state.next_work(10 * S + 4 * S // 10))
    assert offer.first_request_id == 1 and offer.entries[0].seq == 0


def test_without_a_hold_the_same_request_expires_before_it_is_served() -> None:
    """The counterpart of the test above: the deadline is real when nothing holds."""
    state = _CheckedPoolState(capacity=8, max_in_flight=8)
    state.add_request(1, credits=1, timeout_ns=1 * S, now_ns=0)
    _register(state, 1)
    state.add_request(2, credits=1, timeout_ns=10 * S, now_ns=0)
    work = state.next_work(2 * S)
    assert isinstance(work, _Expire) and work.requests == ((1, 1),)
    assert state.requests_expired == 1
    # An expired request is never served; the next live one is.
    assert _offer(state.next_work(2 * S)).first_request_id == 2


def test_wakeup_tracks_the_earliest_deadline_on_the_request_clock() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=8)
    state.add_request(1, credits=1, timeout_ns=3 * S, now_ns=0)
    state.add_request(2, credits=1, timeout_ns=1 * S, now_ns=0)
    assert state.next_wakeup_s(0) == pytest.approx(1.0)
    state.begin_hold(S // 2)
    state.end_hold(5 * S)
    assert state.next_wakeup_s(5 * S) == pytest.approx(0.5)


def test_a_deferred_offer_goes_back_in_order_and_waits_for_resume() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=2)
    _register(state, 3)
    state.add_request(1, credits=3, timeout_ns=1 * S, now_ns=0)
    offer = _offer(state.next_work(0))
    state.on_reply(offer.offer_id, FrameKind.DEFER, S // 2)
    state.offer_returned(offer)
    assert [e.seq for e in state.unsent] == [0, 1, 2]
    assert state.flushed(offer.ticket)
    assert state.next_work(60 * S) is None  # deferred: nothing launches, deadline stands still
    state.receiver_resumed(60 * S)
    again = _offer(state.next_work(60 * S))
    assert [e.seq for e in again.entries] == [0, 1] and again.first_request_id == 1
    assert state.offers_deferred == 1


def test_an_abandoned_offer_goes_back_at_the_head() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=2)
    _register(state, 3)
    state.add_request(1, credits=3, timeout_ns=S, now_ns=0)
    offer = _offer(state.next_work(0))
    state.offer_returned(offer)
    assert [e.seq for e in state.unsent] == [0, 1, 2]
    assert state.in_flight is None and state.flushed(offer.ticket)


def test_an_answer_to_an_offer_not_in_flight_is_a_protocol_error() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=2)
    with pytest.raises(PayloadTransportError, match="offer 3"):
        state.on_reply(3, FrameKind.ACCEPT, 0)


def test_flush_waits_only_for_the_offer_in_flight_at_the_call() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=1)
    _register(state, 2)
    state.add_request(1, credits=2, timeout_ns=S, now_ns=0)
    assert state.flush_target() is None
    first = _offer(state.next_work(0))
    target = state.flush_target()
    assert target == first.ticket and not state.flushed(target)
    state.on_reply(first.offer_id, FrameKind.ACCEPT, 0)
    state.offer_accepted(first)
    state.offer_completed(first)
    _offer(state.next_work(0))  # a later offer does not delay the earlier flush
    assert state.flushed(target)


# A random schedule of everything that can happen to a pool, checked against its invariants
# (the state checks every documented one after each operation) and against a model of it.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), st.integers(1, 4)),
        st.tuples(st.just("request"), st.integers(1, 5), st.integers(1, 4)),
        st.tuples(st.just("hold")),
        st.tuples(st.just("unhold")),
        st.tuples(st.just("launch"), st.sampled_from(["accept", "defer", "abandon"])),
        st.tuples(st.just("resume")),
        st.tuples(st.just("tick"), st.integers(0, 3)),
        st.tuples(st.just("ack"), st.integers(0, 3)),
        st.tuples(st.just("life"), st.sampled_from(["close", "bye", "fail", "stop"])),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, capacity=st.integers(1, 6), max_in_flight=st.integers(1, 4))
def test_random_schedules_keep_order_and_lose_nothing(
    ops: list[tuple[Any, ...]], capacity: int, max_in_flight: int
) -> None:
    state = _CheckedPoolState(capacity, max_in_flight)
    now = 0
    holds = 0
    sent: list[int] = []
    registered = 0
    next_request = 0
    deadlines: dict[int, int] = {}  # request id -> its deadline on a clock that stops when held
    for op in ops:
        kind = op[0]
        if kind == "register":
            for _ in range(int(op[1])):
                if state.try_reserve():
                    state.commit(torch.zeros(1, dtype=torch.uint8))
                    registered += 1
        elif kind == "request":
            state.add_request(next_request, int(op[1]), int(op[2]) * S, now)
            deadlines[next_request] = state.request_clock(now) + int(op[2]) * S
            next_request += 1
        elif kind == "hold":
            state.begin_hold(now)
            holds += 1
        elif kind == "unhold" and holds:
            state.end_hold(now)
            holds -= 1
        elif kind == "resume":
            state.receiver_resumed(now)
        elif kind == "ack":  # the receiver acknowledges all but the last few sent
            state.acknowledge(max(0, state.sent - int(op[1])))
        elif kind == "life":
            _lifecycle_step(state, op[1])
        elif kind == "tick":
            now += int(op[1]) * S // 2
        elif kind == "launch":
            work = state.next_work(now)
            if holds or state.receiver_deferred or not state.running:
                assert work is None, "launched while held, deferred, failed or stopped"
            if isinstance(work, _Offer):
                assert work.count <= max_in_flight
                clock = state.request_clock(now)
                assert deadlines[work.first_request_id] > clock, "served an expired request"
                if op[1] == "accept":
                    state.on_reply(work.offer_id, FrameKind.ACCEPT, now)
                    state.offer_accepted(work)
                    state.offer_completed(work)
                    sent.extend(e.seq for e in work.entries)
                elif op[1] == "defer":
                    state.on_reply(work.offer_id, FrameKind.DEFER, now)
                    state.offer_returned(work)
                else:
                    state.offer_returned(work)
        assert state.occupancy <= capacity
        assert sent == list(range(len(sent))), "sent out of order or twice"
        assert len(sent) + len(state.unsent) == registered, "a payload was lost"
        assert (state.sent, state.registered) == (len(sent), registered)
        assert state.tickets_done == state.tickets_issued  # every offer finished
        not_acknowledged = [e.seq for e in state.not_acknowledged()]
        assert not_acknowledged == list(range(state.acknowledged, registered))


def _lifecycle_step(state: _SendPoolState, event: str) -> None:
    """Take ``event`` where the sender would: each move only from where it is legal."""
    phase = state.phase
    if event == "close" and phase is _PoolPhase.OPEN:
        state.begin_close()
    elif event == "bye" and phase is _PoolPhase.CLOSING:
        state.bye_acknowledged(0)
    elif event == "fail":
        state.fail(RuntimeError("a thread died"))
    elif event == "stop" and phase in (_PoolPhase.BYE_ACKED, _PoolPhase.FAILED):
        state.stop()


# -- the pool state's invariants and lifecycle -------------------------------------------------


def test_the_checked_state_checks_after_every_operation() -> None:
    mutators = {
        "try_reserve", "cancel_reservation", "commit", "add_request", "begin_hold", "end_hold",
        "receiver_resumed", "next_work", "on_reply", "offer_returned", "offer_accepted",
        "offer_completed", "acknowledge", "begin_close", "bye_acknowledged", "fail", "stop",
    }  # fmt: skip
    assert mutators <= set(_OPERATIONS)
    state = _CheckedPoolState(capacity=2, max_in_flight=1)
    with pytest.raises(AssertionError, match="reserved -1 >= 0"):
        state.cancel_reservation()  # a cancel without a reservation breaks the registry count


def _busy_state() -> _SendPoolState:
    """A pool with something everywhere: sent (one acknowledged), in flight, unsent, a slot
    reserved, a hold in force, credit left."""
    state = _SendPoolState(capacity=8, max_in_flight=2)
    _register(state, 5)
    state.add_request(0, credits=8, timeout_ns=10 * S, now_ns=0)
    offer = _offer(state.next_work(0))
    state.on_reply(offer.offer_id, FrameKind.ACCEPT, 0)
    state.offer_accepted(offer)
    state.offer_completed(offer)
    state.acknowledge(1)
    _offer(state.next_work(0))
    assert state.try_reserve()
    state.begin_hold(S)
    assert ([e.seq for e in state.unacknowledged], state.sent, [e.seq for e in state.unsent]) == (
        [1],
        2,
        [4],
    )
    state.check_invariants()
    return state


def _set(name: str, value: object) -> Callable[[_SendPoolState], None]:
    return lambda state: setattr(state, name, value)


_CORRUPTIONS: dict[str, tuple[Callable[[_SendPoolState], None], str]] = {
    "a negative reservation": (_set("reserved", -1), r"reserved -1 >= 0"),
    "more slots used than capacity": (_set("reserved", 8), r"occupancy 11 .* <= capacity 8"),
    "a registration held nowhere": (
        _set("next_seq", 6),
        r"\[2, 3\] then unsent \[4\] are the payloads 3\.\.5",
    ),
    "a sent payload forgotten": (lambda s: s.unacknowledged.clear(), r"unacknowledged \[\]"),
    "acknowledged beyond registered": (_set("acknowledged", 9), r"acknowledged 9 within 0\.\.5"),
    "an offer newer than the one in flight": (_set("tickets_issued", 3), r"is the newest of 3"),
    "an answer that is no answer": (_set("reply", FrameKind.RESUME), r"ACCEPT or DEFER"),
    "a spent request kept": (lambda s: setattr(s.requests[0], "credits", 0), r"grants >= 1"),
    "more holds than taken": (_set("holds", 2), r"holds 2 within 0\.\.1"),
    "a hold that stops no clock": (_set("_stopped_since", None), r"request clock stopped"),
    "a deferral without a DEFER": (_set("receiver_deferred", True), r"only after a DEFER"),
    "failed without an error": (_set("_phase", _PoolPhase.FAILED), r"keeps its error"),
    "an error while open": (_set("_error", RuntimeError("x")), r"OPEN sender has no error"),
    "a transfer counted twice": (_set("transfers", 2), r"transfers 2 <= tickets_done 1"),
    "a timeout without a wait": (_set("backpressure_timeouts", 1), r"backpressure_timeouts 1"),
    "negative bytes": (_set("bytes_sent", -1), r"running totals >= 0: \{'bytes_sent': -1\}"),
}


@pytest.mark.parametrize("corruption", _CORRUPTIONS)
def test_check_invariants_catches_a_corrupted_state(corruption: str) -> None:
    corrupt, message = _CORRUPTIONS[corruption]
    state = _busy_state()
    corrupt(state)
    with pytest.raises(AssertionError, match=message):
        state.check_invariants()


def test_the_phase_table_is_the_documented_lifecycle() -> None:
    P = _PoolPhase
    assert {(a, b) for a, targets in _NEXT_PHASES.items() for b in targets} == {
        (P.OPEN, P.CLOSING),
        (P.CLOSING, P.BYE_ACKED),
        (P.BYE_ACKED, P.STOPPED),
        (P.OPEN, P.FAILED),
        (P.CLOSING, P.FAILED),
        (P.BYE_ACKED, P.FAILED),
        (P.FAILED, P.STOPPED),
    }


_PATHS: dict[str, list[str]] = {
    "open": [],
    "closing": ["begin_close"],
    "goodbye acknowledged": ["begin_close", "bye_acknowledged"],
    "failed while open": ["fail"],
    "failed while closing": ["begin_close", "fail"],
    "stopped": ["begin_close", "bye_acknowledged", "stop"],
    "stopped after failing": ["begin_close", "fail", "stop"],
}
"""Every phase, reached by the moves the sender makes, and where it matters by more than one
way."""

_LEGAL: dict[tuple[_PoolPhase, str], _PoolPhase] = {
    (_PoolPhase.OPEN, "begin_close"): _PoolPhase.CLOSING,
    (_PoolPhase.CLOSING, "bye_acknowledged"): _PoolPhase.BYE_ACKED,
    (_PoolPhase.BYE_ACKED, "stop"): _PoolPhase.STOPPED,
    (_PoolPhase.FAILED, "stop"): _PoolPhase.STOPPED,
}
"""The lifecycle written out: (phase, move) -> the phase it leads to; nothing else moves."""


def _take(state: _SendPoolState, move: str) -> None:
    if move == "fail":
        state.fail(RuntimeError("a thread died"))
    elif move == "bye_acknowledged":
        state.bye_acknowledged(0)
    else:
        getattr(state, move)()


def _reach(path: str) -> _SendPoolState:
    state = _CheckedPoolState(capacity=4, max_in_flight=2)
    for move in _PATHS[path]:
        _take(state, move)
    return state


@pytest.mark.parametrize("move", ["begin_close", "bye_acknowledged", "stop"])
@pytest.mark.parametrize("path", _PATHS)
def test_a_lifecycle_move_is_made_only_where_the_lifecycle_allows_it(path: str, move: str) -> None:
    state = _reach(path)
    before, error = state.phase, state.error
    target = _LEGAL.get((before, move))
    if target is not None:
        _take(state, move)
        assert state.phase is target
        return
    if move == "bye_acknowledged" and error is not None:
        _take(state, move)  # an acknowledgment after a failure: the failure stands
    elif move == "bye_acknowledged":  # the receiver answered a goodbye nobody awaits
        with pytest.raises(PayloadTransportError, match="rank 0 acknowledged a goodbye while") as e:
            _take(state, move)
        assert e.value.peer == 0
    else:  # the sender's own close() would be wrong
        with pytest.raises(RuntimeError, match=f"no move from {before.name} to"):
            _take(state, move)
    assert (state.phase, state.error) == (before, error)


@pytest.mark.parametrize("path", _PATHS)
def test_a_failure_is_kept_in_any_phase_only_the_first_and_stops_launching(path: str) -> None:
    state = _reach(path)
    _register(state, 1)
    state.add_request(0, credits=1, timeout_ns=S, now_ns=0)
    first = state.error
    state.fail(ValueError("a later failure"))
    assert state.error is first if first is not None else isinstance(state.error, ValueError)
    stopped = state.phase is _PoolPhase.STOPPED
    assert stopped == path.startswith("stopped") and (stopped or state.phase is _PoolPhase.FAILED)
    assert not state.running and state.next_work(0) is None


def test_only_the_offer_in_flight_can_finish() -> None:
    state = _CheckedPoolState(capacity=4, max_in_flight=1)
    _register(state, 2)
    state.add_request(0, credits=2, timeout_ns=S, now_ns=0)
    first = _offer(state.next_work(0))
    state.offer_returned(first)
    again = _offer(state.next_work(0))  # the same payload, a new offer
    with pytest.raises(RuntimeError, match=f"offer {first.offer_id} finished, but the offer"):
        state.offer_completed(first)
    assert state.in_flight is again and state.sent == 0


# -- the receiver's state ----------------------------------------------------------------------


def _offer_words(offer_id: int, first_seq: int, count: int, request_id: int) -> list[int]:
    words = make_frame(
        FrameKind.OFFER, offer_id, first_seq, count, request_id, sizes=[10] * count
    ).tolist()
    return list(words)


def test_receiver_grants_only_room_it_has_in_chunks() -> None:
    state = _ReceiverState([1], window=8, request_timeout_us=1000)
    assert state.grant(1) == (0, 8)
    assert state.grant(1) is None  # all room granted
    accepted = state.on_offer(1, _offer_words(0, 0, 3, 0), can_accept=True)
    assert accepted is not None and accepted.request_ids == (0, 0, 0)
    assert state.grant(1) is None  # in flight, then queued: still no room
    state.on_received(accepted, [_payload(1, i) for i in range(3)])
    assert state.grant(1) is None
    for _ in range(2):
        state.take()
    assert state.grant(1) == (1, 2)  # a quarter window freed: granted in one request


def _payload(rank: int, seq: int) -> ReceivedPayload:
    return ReceivedPayload(rank, seq, {}, {}, 0, 10)


def test_receiver_rejects_offers_beyond_credit_or_out_of_order() -> None:
    state = _ReceiverState([1], window=4, request_timeout_us=1000)
    state.grant(1)
    with pytest.raises(PayloadTransportError, match="credit for 4"):
        state.on_offer(1, _offer_words(0, 0, 5, 0), can_accept=True)
    with pytest.raises(PayloadTransportError, match="expected 0"):
        state.on_offer(1, _offer_words(0, 2, 1, 0), can_accept=True)


def test_receiver_defers_while_held_and_resumes_each_deferred_sender_once() -> None:
    state = _ReceiverState([1, 2], window=4, request_timeout_us=1000)
    state.grant(1)
    state.grant(2)
    state.begin_hold()
    state.begin_hold()
    assert state.on_offer(1, _offer_words(0, 0, 1, 0), can_accept=False) is None
    assert state.on_offer(2, _offer_words(0, 0, 1, 1), can_accept=False) is None
    assert state.end_hold() == []  # another hold is still in force
    assert state.end_hold() == [1, 2]
    assert state.deferred == set()
    # A deferred offer used no credit: the same offer is accepted later.
    assert state.on_offer(1, _offer_words(1, 0, 1, 0), can_accept=True) is not None


def test_receiver_mirrors_expiry_and_lost_count() -> None:
    state = _ReceiverState([1], window=4, request_timeout_us=1000)
    state.grant(1)
    state.on_expired(1, 0, 4)
    assert state.requests_expired == 1 and state.peers[1].outstanding == 0
    with pytest.raises(PayloadTransportError, match="unknown request"):
        state.on_expired(1, 0, 4)
    state.on_bye(1, total=3)
    assert state.all_closed and state.lost == 3


def test_a_payload_is_acknowledged_once_the_trainer_moves_on_from_it() -> None:
    state = _ReceiverState([1], window=8, request_timeout_us=1000)
    state.grant(1)
    accepted = state.on_offer(1, _offer_words(0, 0, 3, 0), can_accept=True)
    assert accepted is not None
    state.on_received(accepted, [_payload(1, i) for i in range(3)])
    state.acknowledge_taken()  # get() #1 starts: nothing taken yet
    state.take()
    assert state.peers[1].acknowledged == 0  # handed out, but the trainer has not moved on
    state.acknowledge_taken()  # get() #2 starts
    state.take()
    assert state.peers[1].acknowledged == 1


def test_a_failed_sender_counts_what_it_had_in_flight_as_lost_and_the_rest_goes_on() -> None:
    state = _ReceiverState([1, 2], window=8, request_timeout_us=1000)
    state.grant(1)
    state.grant(2)
    accepted = state.on_offer(1, _offer_words(0, 0, 3, 0), can_accept=True)
    assert accepted is not None and state.flush_target() is not None
    state.on_peer_failed(1, "closed")
    # The accepted transfer will never complete: lost, and no flush waits for it.
    assert state.lost == 3 and state.flushed(accepted.ticket)
    assert state.grant(1) is None and not state.all_closed  # sender 2 goes on
    state.on_bye(2, total=0)
    assert state.all_closed


def test_the_sender_keeps_what_is_not_acknowledged_to_send_it_again() -> None:
    state = _CheckedPoolState(capacity=8, max_in_flight=2)
    _register(state, 5)
    state.add_request(0, credits=8, timeout_ns=10 * S, now_ns=0)
    for _ in range(2):
        offer = _offer(state.next_work(0))
        state.on_reply(offer.offer_id, FrameKind.ACCEPT, 0)
        state.offer_accepted(offer)
        state.offer_completed(offer)
    state.acknowledge(1)
    assert [e.seq for e in state.not_acknowledged()] == [1, 2, 3, 4]  # sent 1-3, unsent 4
    with pytest.raises(
        PayloadTransportError, match="acknowledged 9 payloads, this sender launched 4"
    ):
        state.acknowledge(9)


class _End(TransportEnd):
    """A transport end with nothing but the shared failure handling."""

    def __init__(self) -> None:
        super().__init__(
            name="test",
            default_timeout=1.0,
            hold_timeout_error=EgressHoldTimeout,
            failure_subject="the test end",
        )
        self._state = _SendPoolState(capacity=1, max_in_flight=1)
        self._conditions = ()


@pytest.mark.parametrize("kind", [PayloadTransportError, PayloadPeerTimeout])
def test_every_call_after_a_peer_failure_names_the_peer_and_the_cause(kind: type) -> None:
    end = _End()
    cause = "timeout" if kind is PayloadPeerTimeout else "closed"
    end._fail(kind("the connection to rank 3 failed", peer=3, cause=cause))
    with pytest.raises(PayloadTransportError) as caught:
        end._raise_if_failed("send a payload")
    assert (caught.value.peer, caught.value.cause) == (3, cause)
    assert isinstance(caught.value, TimeoutError) == (kind is PayloadPeerTimeout)
    assert "cannot send a payload: the test end failed" in str(caught.value)


# -- the wire ----------------------------------------------------------------------------------


def test_payload_round_trips_every_dtype_and_shape() -> None:
    tensors = {
        "tokens": torch.arange(7, dtype=torch.int64),
        "logprobs": torch.randn(7),
        "reward": torch.tensor(1.5),  # 0-dim
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(2, 3).half(),
        "bf16": torch.randn(5).bfloat16(),
        "strided": torch.arange(12).reshape(3, 4).t(),  # not contiguous
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
    }
    meta = {"prompt_id": "p-17", "turn": 3, "score": 0.25, "tags": ["a", "b"]}
    buffer = pack_payload(tensors, meta, CPU)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    out, out_meta = unpack_payload(buffer.clone())
    assert out_meta == meta
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(out[name], tensor), name


def test_pack_rejects_bad_input_with_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"dense torch\.Tensor"):
        pack_payload({"x": [1, 2]}, None, CPU)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="names must be str"):
        pack_payload({1: torch.zeros(1)}, None, CPU)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="JSON-serialisable"):
        pack_payload({}, {"t": torch.zeros(1)}, CPU)
    with pytest.raises(ValueError, match="unsupported dtype"):
        pack_payload({"q": torch.zeros(1, dtype=torch.uint16)}, None, CPU)


def test_frames_round_trip_and_reject_other_protocols() -> None:
    frame = make_frame(FrameKind.OFFER, 4, 10, 3, 2, sizes=[100, 200, 300])
    kind, words = read_frame(frame, peer=1)
    assert kind is FrameKind.OFFER and words[1:5] == [4, 10, 3, 2]
    assert words[8:11] == [100, 200, 300]
    frame[7] = 99
    with pytest.raises(PayloadTransportError, match="protocol version 99"):
        read_frame(frame, peer=1)
    with pytest.raises(ValueError):
        make_frame(FrameKind.OFFER, sizes=[1] * (MAX_BATCH + 1))


def test_coalesced_payloads_split_back_into_aligned_views() -> None:
    payloads = [
        (
            {
                "tokens": torch.arange(n, dtype=torch.int64),
                "logprobs": torch.randn(n).double(),
                "flag": torch.tensor(n % 2 == 0),
            },
            {"n": n},
        )
        for n in (1, 3, 7, 0, 12)
    ]
    buffers = [pack_payload(t, m, CPU) for t, m in payloads]
    message = coalesce(buffers)
    assert message is not None and message.numel() == sum(b.numel() for b in buffers)
    parts = torch.split(message.clone(), [b.numel() for b in buffers])
    for part, (tensors, meta) in zip(parts, payloads, strict=True):
        out, out_meta = unpack_payload(part)
        assert out_meta == meta
        assert all(torch.equal(out[k], v) for k, v in tensors.items())
    assert coalesce(buffers[:1]) is None  # nothing to gain from one payload
    assert coalesce([torch.zeros(COALESCE_BYTES, dtype=torch.uint8)] * 2) is None


# -- the mixin, where the guard looks for it ---------------------------------------------------


class _MixedRollout(NCCLRolloutMixin, RecordingRollout):
    """A backend that mixes in the transport."""


class _Worker:
    weight_sync_fence = None

    def __init__(self, rollout: RecordingRollout) -> None:
        self.rollout = rollout
        self.reports: list[SyncReport] = []

    def on_weight_sync_report(self, report: SyncReport) -> None:
        self.reports.append(report)

    @weight_sync_handler
    def receive_weights(self) -> None:
        pass


class _MixedWorker(NCCLRolloutMixin, _Worker):
    """A worker that mixes in the transport."""


@pytest.mark.parametrize(
    ("rollout_mixed", "worker_mixed", "held"),
    [(True, False, 1), (False, True, 1), (True, True, 2), (False, False, 0)],
)
def test_the_guard_finds_the_mixin_on_the_backend_or_the_worker(
    rollout_mixed: bool, worker_mixed: bool, held: int
) -> None:
    log = EventLog()
    rollout = _MixedRollout(log) if rollout_mixed else RecordingRollout(log)
    worker = _MixedWorker(rollout) if worker_mixed else _Worker(rollout)
    worker.receive_weights()
    (report,) = worker.reports
    assert report.egress_held == held and report.egress_flushed == 0
    assert isinstance(rollout, SupportsHoldSends) == rollout_mixed


def test_the_mixin_before_its_transport_exists_holds_nothing_and_says_what_to_do() -> None:
    mixed = _MixedRollout(EventLog())
    with mixed.hold_sends(timeout=0.1):
        mixed.flush_pending_sends(timeout=0.1)
    with pytest.raises(RuntimeError, match="init_payload_transport"):
        mixed.register_payload({"x": torch.zeros(1)})
    mixed.close_payload_transport()  # nothing to close: no error
