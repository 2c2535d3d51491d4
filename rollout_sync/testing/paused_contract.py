"""One suite for the ``paused()`` contract, for every backend: describe yours, run the checks.

:meth:`RolloutBase.paused <rollout_sync.RolloutBase.paused>` promises: inside it no forward runs
and none starts; it is re-entrant, bounded by a timeout (raising
:class:`~rollout_sync.PauseTimeout`, a ``TimeoutError``, instead of hanging), always resumes on
exit (exceptions included), and is a no-op before the engine exists. As trio runs one generic
test over all of its locks, this module checks those promises on any backend: its author
describes how to drive it (a :class:`PausedContract`) and runs the checks of
:data:`PAUSED_CONTRACT_CHECKS` on it, parametrized in their own pytest
(``docs/backends.md``), or all at once with :func:`run_paused_contract`.

The checks, one clause of the contract each:

* :func:`check_noop_before_engine` - ``paused()`` on a backend whose engine does not exist
  returns, nested and with an exception in the body, and starts nothing.
* :func:`check_starts_parked_inside` - an engine started inside the body (lazy initialization
  in a sync) runs no forward until the body exits, then generates.
* :func:`check_reentrant` - nested pauses on one thread, and pauses on two threads, park once
  and resume when the outermost exits (or, for a backend whose pauses are serialized, a second
  thread's pause runs out of time while the first holds, and leaves it parked).
* :func:`check_bounded` - while a forward cannot end, ``paused(timeout)`` raises ``PauseTimeout``
  naming its limit, does not run the body, leaves nothing parked; generation goes on and the
  next pause works.
* :func:`check_parks_at_a_step_boundary` - a pause asked for during a forward waits for that
  forward and no more: it parks as soon as that forward ends.
* :func:`check_always_resumes` - an exception in the body propagates unchanged and generation
  resumes; an exception out of an inner pause leaves the outer one parked.
* :func:`check_no_forward_while_parked` - inside the body no forward runs; after it, they do.

A backend that cannot express a check says so: the check's :meth:`PausedCheck.skip_reason`
names the missing capability (no ``stall``, a backend that parks trivially, ...) or the reason
the contract gives in ``skip``, and the suite skips it with that reason, never silently.

Every blocking wait in a check is bounded by the contract's ``timeout`` (a backend that hangs
fails the check, it does not hang it); the sequencing is events and observed state. The one
window is ``quiet_s``: for a backend without a ``held_back`` witness the suite watches that long
for a forward that must not come while parked. A forward seen there is a definite violation;
none seen is evidence as strong as the window is long. A check that finds the contract broken
raises :class:`~rollout_sync.errors.PausedContractViolation` (an ``AssertionError``) naming the
backend, the check and what it saw.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import PausedContractViolation, PauseTimeout
from ..guard import SupportsPause

__all__ = [
    "PAUSED_CONTRACT_CHECKS",
    "CheckOutcome",
    "Parking",
    "PauseSharing",
    "PausedCheck",
    "PausedContract",
    "PausedContractReport",
    "check_always_resumes",
    "check_bounded",
    "check_no_forward_while_parked",
    "check_noop_before_engine",
    "check_parks_at_a_step_boundary",
    "check_reentrant",
    "check_starts_parked_inside",
    "run_paused_contract",
]

B = TypeVar("B", bound=SupportsPause)


class Parking(enum.Enum):
    """Whether a backend's generation runs on its own, so that ``paused()`` has work to do."""

    REAL = "real"
    """Generation runs on its own (a serving thread, a stream scheduler, an engine loop, or a
    blocking call on another thread): ``paused()`` really stops forwards."""
    TRIVIAL = "trivial"
    """Idle by construction: generation blocks the loop that runs weight-sync commands, so
    ``paused()`` has nothing to stop (the base class's default). The checks that watch forwards
    do not apply."""


class PauseSharing(enum.Enum):
    """What a pause on a second thread does while a first thread holds one."""

    SHARED = "shared"
    """It enters at once and shares the park: generation resumes when the last one exits
    (a :class:`~rollout_sync.Gate`'s shared exclusive side)."""
    SERIALIZED = "serialized"
    """It waits, bounded by its timeout, for the first to end (one pause at a time)."""


def _nothing(backend: Any) -> None:
    return None


@dataclass(frozen=True)
class PausedContract(Generic[B]):
    """How the suite drives one backend: how to build it, start it, watch it and hold it up.

    Only ``name``, ``new`` and ``engine_exists`` are always needed. A backend that really parks
    (:attr:`Parking.REAL`) also needs ``forwards`` and a way to generate (``start`` or
    ``running``). Each optional observer or lever that is missing makes the checks that need it
    skip, with a reason that names it.
    """

    name: str
    """How reports and failures name the backend."""
    new: Callable[[], B]
    """A backend whose engine does not exist yet (cheap: nothing started)."""
    engine_exists: Callable[[B], bool]
    """Whether the backend's engine exists (initialized, started) now."""
    parking: Parking = Parking.REAL
    start: Callable[[B], None] | None = None
    """Create the engine of a :attr:`new` backend and set generation going: for a backend that
    really parks, forwards must keep coming on their own until :attr:`stop` (queue long
    requests, start the serving thread). Also called inside a pause, by
    :func:`check_starts_parked_inside`."""
    stop: Callable[[B], None] = _nothing
    """Stop and release what :attr:`start` started; also called on a backend never started."""
    running: Callable[[], AbstractContextManager[B]] | None = None
    """A backend already generating, for the ``with`` body, instead of ``new`` + ``start`` +
    ``stop`` (an engine a test module shares because it is slow to start)."""
    forwards: Callable[[B], int] | None = None
    """Forwards (decode steps, serving steps) run so far. Counted by the time the step ends, so
    that when ``paused()`` returns no forward is left to count."""
    parked: Callable[[B], bool] | None = None
    """The backend's own word on whether generation is parked now."""
    held_back: Callable[[B], bool] | None = None
    """Whether generation is held back now: its next forward is waiting for the pause to end (a
    serving thread blocked at the step boundary), or there is nothing to run. With it, the suite
    proves no forward runs while parked by waiting for this, not by watching ``quiet_s``."""
    parks: Callable[[B], int] | None = None
    """Times generation went from running to parked (nested and shared pauses count once)."""
    pause_pending: Callable[[B], bool] | None = None
    """Whether a pause is waiting to park now (``paused()`` entered, body not yet): what
    :func:`check_parks_at_a_step_boundary` waits for before it lets the held forward end."""
    stall: Callable[[B], AbstractContextManager[object]] | None = None
    """Hold generation up for the ``with`` body, so that it cannot park: a forward that cannot
    end until the body exits (or an engine kept busy between two steps); entered once it holds.
    Inside it the suite reads ``parked`` and ``pause_pending``, and ``forwards`` only in
    :func:`check_parks_at_a_step_boundary` (an engine call that the stall would block is fine
    for a backend without ``pause_pending``)."""
    sharing: PauseSharing = PauseSharing.SHARED
    step_boundary: bool = True
    """Whether a pause parks at the step boundary (``False``: it drains whole generations)."""
    timeout: float = 30.0
    """Seconds, the limit of every wait in a check (the pauses it expects to succeed included)."""
    short_timeout: float = 0.2
    """Seconds, the limit of a pause a check expects to run out of time."""
    late_s: float = 2.0
    """How late, in seconds, a pause that runs out of time may return after its limit."""
    quiet_s: float = 0.25
    """Seconds to watch for a forward while parked, for a backend without ``held_back``."""
    skip: Mapping[str, str] = field(default_factory=dict)
    """Check name -> why it does not apply to this backend (shown as the skip reason)."""

    def __post_init__(self) -> None:
        problems = []
        if self.parking is Parking.REAL:
            if self.forwards is None:
                problems.append("a backend that really parks needs forwards= (forwards so far)")
            if self.start is None and self.running is None:
                problems.append("a backend that really parks needs start= or running=")
        if not 0 < self.short_timeout < self.timeout:
            problems.append(
                f"need 0 < short_timeout < timeout, got {self.short_timeout!r} and {self.timeout!r}"
            )
        if not (self.late_s > 0 and self.quiet_s > 0):
            problems.append(
                f"late_s and quiet_s must be > 0, got {self.late_s!r}, {self.quiet_s!r}"
            )
        unknown = sorted(set(self.skip) - {check.name for check in PAUSED_CONTRACT_CHECKS})
        if unknown:
            problems.append(f"skip= names no check: {unknown} (the checks: {_CHECK_NAMES})")
        if problems:
            raise ValueError(f"PausedContract {self.name!r}: " + "; ".join(problems))

    @classmethod
    def for_threaded_backend(
        cls, name: str, new: Callable[[], Any], **overrides: Any
    ) -> PausedContract[Any]:
        """The contract of a :class:`~rollout_sync.ThreadedRolloutBackend` (``new`` builds one).

        Forwards are its served steps; it is parked while its generation gate is held; the
        stall is a section of that gate held by the suite (to a pause, a forward in progress).
        ``overrides`` replace any field.
        """
        fields: dict[str, Any] = {
            "engine_exists": lambda b: b.running,
            "start": lambda b: b.start(),
            "stop": lambda b: b.stop(),
            "forwards": lambda b: b.statistics().steps_served,
            "parked": lambda b: b.generation_gate.held,
            "held_back": lambda b: b.generation_gate.statistics().sections_waiting > 0,
            "parks": lambda b: b.generation_gate.statistics().exclusive_acquired,
            "pause_pending": lambda b: b.generation_gate.statistics().exclusive_waiting > 0,
            "stall": lambda b: b.generation_gate.section(),
        }
        fields.update(overrides)
        return cls(name=name, new=new, **fields)


# -- the checks -----------------------------------------------------------------------------------


def check_noop_before_engine(contract: PausedContract[Any]) -> None:
    """``paused()`` on a backend whose engine does not exist returns and starts nothing.

    Nested, with an exception in the body (which propagates unchanged), and on a second thread;
    every call must return within ``timeout``.
    """
    run = _Run(contract, "check_noop_before_engine")
    backend = contract.new()
    try:
        if contract.engine_exists(backend):
            raise ValueError(
                f"PausedContract {contract.name!r}: new() must return a backend whose engine does "
                "not exist yet"
            )
        inside: list[bool] = []
        error = RuntimeError("paused-contract: the body raised")

        def pauses() -> None:
            with backend.paused(run.limit), backend.paused(run.limit):
                inside.append(contract.engine_exists(backend))
            try:
                with backend.paused(run.limit):
                    raise error
            except RuntimeError as exc:
                if exc is not error:
                    raise
            else:
                raise run.violation("an exception raised in the body did not propagate")

        for thread in ("one thread", "another thread"):
            attempt = _Attempt(pauses, f"paused-contract-{thread}").start()
            if not attempt.done.wait(run.limit):
                raise run.violation(
                    f"paused() on a backend without an engine did not return within "
                    f"{run.limit:g} s (on {thread})"
                )
            if attempt.error is not None:
                if isinstance(attempt.error, PausedContractViolation):
                    raise attempt.error
                raise run.violation(
                    "paused() on a backend without an engine failed: "
                    f"{type(attempt.error).__name__}: {attempt.error}"
                ) from attempt.error
        if any(inside) or contract.engine_exists(backend):
            raise run.violation("paused() on a backend without an engine started the engine")
    finally:
        contract.stop(backend)


def check_starts_parked_inside(contract: PausedContract[Any]) -> None:
    """An engine started inside the body (lazy initialization in a sync) begins parked.

    No forward runs until the body exits; then generation runs. For a backend that parks
    trivially: starting inside the body works.
    """
    run = _Run(contract, "check_starts_parked_inside")
    start = run.require(contract.start, "start")
    backend = contract.new()
    try:
        with backend.paused(run.limit):
            start(backend)
            if not contract.engine_exists(backend):
                raise run.violation("start() inside the pause did not create the engine")
            before = run.forwards(backend)
            run.still_held(backend, before, "after the engine started inside the pause")
        run.generating(backend, before, "after the pause its engine started in ended")
    finally:
        contract.stop(backend)


def check_reentrant(contract: PausedContract[Any]) -> None:
    """Nested pauses and pauses on two threads park once and resume when the outermost exits.

    For :attr:`PauseSharing.SERIALIZED`: a second thread's pause runs out of time (with
    ``PauseTimeout``) while the first holds, and the first stays parked.
    """
    run = _Run(contract, "check_reentrant")
    with _running(contract) as backend:
        run.generating(backend, run.forwards(backend), "before pausing")
        parks = run.parks(backend)
        with backend.paused(run.limit):
            before = run.forwards(backend)
            with backend.paused(run.limit):
                with backend.paused(run.limit):
                    pass
                run.still_held(backend, before, "after the innermost of three pauses exited")
            run.still_held(backend, before, "after an inner pause exited, inside the outer one")
        run.generating(backend, before, "after the outermost of nested pauses exited")
        run.parked_times(backend, parks, 1, "nested pauses on one thread")
        if contract.sharing is PauseSharing.SHARED:
            _shared_across_threads(run, backend)
        else:
            _serialized_across_threads(run, backend)


def _shared_across_threads(run: _Run, backend: Any) -> None:
    parks = run.parks(backend)
    entered, leave = threading.Event(), threading.Event()

    def second() -> None:
        with backend.paused(run.limit), backend.paused(run.limit):
            entered.set()
            if not leave.wait(run.limit):
                raise run.violation("the check never let the second thread's pause end")

    with backend.paused(run.limit):
        before = run.forwards(backend)
        other = _Attempt(second, "paused-contract-second").start()
        if not entered.wait(run.limit):
            other.done.wait(run.limit)
            raise run.violation(
                "a second thread's pause did not enter within "
                f"{run.limit:g} s while the first thread held one (the contract says SHARED; "
                "say SERIALIZED if a second thread waits)",
                other.error,
            )
    try:
        run.still_held(
            backend, before, "after the first thread's pause exited, the second's still held"
        )
    finally:
        leave.set()
    if not other.done.wait(run.limit):
        raise run.violation(f"the second thread's pause did not exit within {run.limit:g} s")
    if other.error is not None:
        raise run.violation("the second thread's pause failed", other.error)
    run.generating(backend, before, "after the last of two threads' pauses exited")
    run.parked_times(backend, parks, 1, "pauses on two threads")


def _serialized_across_threads(run: _Run, backend: Any) -> None:
    with backend.paused(run.limit):
        before = run.forwards(backend)
        run.short_pause_times_out(
            backend,
            "the first thread held a pause",
            hint=" (the contract says SERIALIZED; say SHARED if pauses share the park)",
        )
        run.still_held(backend, before, "after a second thread's pause ran out of time")
    run.generating(backend, before, "after the first thread's pause exited")
    after = _Attempt(lambda: _enter_and_exit(backend, run.limit), "paused-contract-after")
    if not after.start().done.wait(run.limit) or after.error is not None:
        raise run.violation(
            "a second thread could not pause once the first thread's pause had ended",
            after.error,
        )


def check_bounded(contract: PausedContract[Any]) -> None:
    """While a forward cannot end, ``paused(timeout)`` runs out of time cleanly.

    It raises :class:`~rollout_sync.PauseTimeout` (a ``TimeoutError``) that names its limit and
    the operation, not before the limit and not much after it (``late_s``); it never runs the
    body and leaves nothing parked. Once the forward ends, generation goes on and a pause parks
    again.
    """
    run = _Run(contract, "check_bounded")
    stall = run.require(contract.stall, "stall")
    with _running(contract) as backend:
        run.generating(backend, run.forwards(backend), "before pausing")
        parks = run.parks(backend)
        with stall(backend):
            run.short_pause_times_out(
                backend, "a forward was held", hint=": it did not wait for the forward to end"
            )
            if contract.parked is not None and contract.parked(backend):
                raise run.violation("a pause that ran out of time left generation parked")
        held = run.forwards(backend)
        run.generating(backend, held, "after a pause ran out of time and the forward ended")
        run.parked_times(backend, parks, 0, "a pause that ran out of time")
        with backend.paused(run.limit):
            before = run.forwards(backend)
            run.still_held(backend, before, "in the first pause after one ran out of time")
        run.generating(backend, before, "after the pause that followed a timed-out one")


def check_parks_at_a_step_boundary(contract: PausedContract[Any]) -> None:
    """A pause asked for during a forward waits for that forward, and parks once it ends.

    At most one more forward is counted by the time the body runs (the one in progress), and
    none after.
    """
    run = _Run(contract, "check_parks_at_a_step_boundary")
    stall = run.require(contract.stall, "stall")
    pending = run.require(contract.pause_pending, "pause_pending")
    with _running(contract) as backend:
        run.generating(backend, run.forwards(backend), "before pausing")
        entered, leave = threading.Event(), threading.Event()
        seen: list[int] = []

        def pause() -> None:
            with backend.paused(run.limit):
                seen.append(run.forwards(backend))
                entered.set()
                if not leave.wait(run.limit):
                    raise run.violation("the check never let its pause end")

        with stall(backend):
            attempt = _Attempt(pause, "paused-contract-boundary").start()
            if not _wait_until(lambda: pending(backend) or entered.is_set(), run.limit):
                raise run.violation(f"a pause was not waiting to park within {run.limit:g} s")
            if entered.is_set():
                leave.set()
                raise run.violation("a pause entered its body while a forward was held")
            # Counted once the pause waits: from here on only forwards already in progress
            # (the held one, and any other running beside it) may end before it parks.
            held = run.forwards(backend)
        try:
            if not entered.wait(run.limit):
                raise run.violation(
                    f"did not park within {run.limit:g} s after the forward in progress ended"
                )
            more = seen[0] - held
            if more > 1:
                raise run.violation(
                    f"parked only after {more} more forwards: it waited out more than the "
                    "forward in progress (a drain? then say step_boundary=False)"
                )
            run.still_held(backend, seen[0], "in a pause that waited for a forward")
        finally:
            leave.set()
        if not attempt.done.wait(run.limit) or attempt.error is not None:
            raise run.violation("the pause that waited for a forward failed", attempt.error)
        run.generating(backend, seen[0], "after the pause that waited for a forward")


def check_always_resumes(contract: PausedContract[Any]) -> None:
    """An exception in the body propagates unchanged, and generation resumes.

    Raised through two nested pauses (an ``Exception`` and a ``BaseException``), and raised out
    of an inner pause only: then the outer one stays parked until it exits.
    """
    run = _Run(contract, "check_always_resumes")
    with _running(contract) as backend:
        run.generating(backend, run.forwards(backend), "before pausing")
        for error in (RuntimeError("paused-contract: body failed"), SystemExit("body exited")):
            try:
                with backend.paused(run.limit):
                    before = run.forwards(backend)
                    with backend.paused(run.limit):
                        raise error
            except BaseException as exc:  # noqa: BLE001 - compared with what the body raised
                if exc is not error:
                    raise run.violation(
                        f"the body raised {type(error).__name__}, but "
                        f"{type(exc).__name__}: {exc} came out of paused()",
                        exc,
                    ) from exc
            else:
                raise run.violation(
                    f"paused() swallowed the {type(error).__name__} its body raised"
                )
            if contract.parked is not None and contract.parked(backend):
                raise run.violation(
                    f"generation stayed parked after the body raised {type(error).__name__}"
                )
            run.generating(
                backend, before, f"after the body raised {type(error).__name__} in a pause"
            )
        error = RuntimeError("paused-contract: inner body failed")
        with backend.paused(run.limit):
            before = run.forwards(backend)
            try:
                with backend.paused(run.limit):
                    raise error
            except RuntimeError as exc:
                if exc is not error:
                    raise
            run.still_held(
                backend, before, "after an inner pause exited with an exception, inside the outer"
            )
        run.generating(backend, before, "after the outer pause exited")


def check_no_forward_while_parked(contract: PausedContract[Any]) -> None:
    """Generation runs on its own; inside the body no forward runs; after it, generation runs."""
    run = _Run(contract, "check_no_forward_while_parked")
    with _running(contract) as backend:
        run.generating(backend, run.forwards(backend), "before pausing (is it generating?)")
        with backend.paused(run.limit):
            before = run.forwards(backend)
            run.still_held(backend, before, "inside a pause")
        run.generating(backend, before, "after the pause exited")


# -- the list, and running it --------------------------------------------------------------------


def _needs_real_parking(contract: PausedContract[Any]) -> str | None:
    if contract.parking is Parking.TRIVIAL:
        return (
            "parks trivially (idle by construction: generation blocks the caller's loop), so "
            "there is no forward of its own to watch or hold up"
        )
    return None


def _needs(*fields: str, real: bool = False) -> Callable[[PausedContract[Any]], str | None]:
    def reason(contract: PausedContract[Any]) -> str | None:
        if real and (why := _needs_real_parking(contract)) is not None:
            return why
        missing = [f for f in fields if getattr(contract, f) is None]
        if missing:
            return f"the contract gives no {' / '.join(missing)} (see PausedContract)"
        return None

    return reason


def _needs_step_boundary(contract: PausedContract[Any]) -> str | None:
    if not contract.step_boundary:
        return "drains whole generations by design (step_boundary=False)"
    return _needs("stall", "pause_pending", real=True)(contract)


@dataclass(frozen=True)
class PausedCheck:
    """One check of the suite: its name, the clause it checks, and when it does not apply.

    Call it with a :class:`PausedContract`; it raises ``ValueError`` (with the reason) on a
    contract it does not apply to, so ask :meth:`skip_reason` first, or use
    :func:`run_paused_contract`.
    """

    name: str
    clause: str
    check: Callable[[PausedContract[Any]], None]
    needs: Callable[[PausedContract[Any]], str | None]

    def skip_reason(self, contract: PausedContract[Any]) -> str | None:
        """Why this check does not apply to ``contract`` (``None``: it does)."""
        given = contract.skip.get(self.name)
        return given if given is not None else self.needs(contract)

    def __call__(self, contract: PausedContract[Any]) -> None:
        reason = self.skip_reason(contract)
        if reason is not None:
            raise ValueError(f"{self.name} does not apply to {contract.name}: {reason}")
        self.check(contract)

    def __str__(self) -> str:
        return self.name


PAUSED_CONTRACT_CHECKS: tuple[PausedCheck, ...] = (
    PausedCheck(
        "check_noop_before_engine",
        "a no-op before the engine exists",
        check_noop_before_engine,
        _needs(),
    ),
    PausedCheck(
        "check_starts_parked_inside",
        "an engine started inside a pause begins parked",
        check_starts_parked_inside,
        _needs("start"),
    ),
    PausedCheck("check_reentrant", "re-entrant", check_reentrant, _needs()),
    PausedCheck(
        "check_bounded",
        "bounded by a timeout",
        check_bounded,
        _needs("stall", real=True),
    ),
    PausedCheck(
        "check_parks_at_a_step_boundary",
        "parks at a step boundary",
        check_parks_at_a_step_boundary,
        _needs_step_boundary,
    ),
    PausedCheck(
        "check_always_resumes",
        "always resumes, exceptions included",
        check_always_resumes,
        _needs(),
    ),
    PausedCheck(
        "check_no_forward_while_parked",
        "no forward runs while parked",
        check_no_forward_while_parked,
        _needs(real=True),
    ),
)
"""Every check, in the order :func:`run_paused_contract` runs them; parametrize over it."""

_CHECK_NAMES = [check.name for check in PAUSED_CONTRACT_CHECKS]


@dataclass(frozen=True)
class CheckOutcome:
    """What one check did: passed, or skipped with its reason."""

    check: str
    skipped: str | None = None
    """Why it was skipped, or ``None`` if it ran and passed."""


@dataclass(frozen=True)
class PausedContractReport:
    """What :func:`run_paused_contract` did, check by check."""

    backend: str
    outcomes: tuple[CheckOutcome, ...]

    @property
    def passed(self) -> list[str]:
        return [o.check for o in self.outcomes if o.skipped is None]

    @property
    def skipped(self) -> dict[str, str]:
        return {o.check: o.skipped for o in self.outcomes if o.skipped is not None}

    def __str__(self) -> str:
        lines = [f"{self.backend}: {len(self.passed)} passed, {len(self.skipped)} skipped"]
        lines += [f"  passed  {name}" for name in self.passed]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def run_paused_contract(contract: PausedContract[Any]) -> PausedContractReport:
    """Run every check that applies to ``contract``, in order; stop at the first violation.

    Raises:
        PausedContractViolation: a check found the contract broken.
    """
    outcomes = []
    for check in PAUSED_CONTRACT_CHECKS:
        reason = check.skip_reason(contract)
        if reason is None:
            check.check(contract)
        outcomes.append(CheckOutcome(check.name, reason))
    return PausedContractReport(contract.name, tuple(outcomes))


# -- machinery -----------------------------------------------------------------------------------


@contextmanager
def _running(contract: PausedContract[B]) -> Iterator[B]:
    """A generating backend for the ``with`` body (``running``, or ``new``, ``start``, ``stop``)."""
    if contract.running is not None:
        with contract.running() as backend:
            yield backend
        return
    backend = contract.new()
    try:
        if contract.start is not None:
            contract.start(backend)
        yield backend
    finally:
        contract.stop(backend)


def _enter_and_exit(backend: Any, timeout: float) -> None:
    with backend.paused(timeout):
        pass


def _wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate`` became true within ``timeout`` seconds (a bounded poll of state
    that offers no event to wait on; backs off from 1 ms to 20 ms between looks)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)
    return True


class _Attempt:
    """A call on a thread of its own, so that a pause that hangs fails the check, not hangs it."""

    def __init__(self, call: Callable[[], object], name: str) -> None:
        self._call = call
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.elapsed = math.nan
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> _Attempt:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self._call()
        except BaseException as exc:  # noqa: BLE001 - handed to the check
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - started
            self.done.set()


class _Run:
    """One check on one contract: its limits, observations, and violations named after both."""

    def __init__(self, contract: PausedContract[Any], check: str) -> None:
        reason = next(c for c in PAUSED_CONTRACT_CHECKS if c.name == check).skip_reason(contract)
        if reason is not None:
            raise ValueError(f"{check} does not apply to {contract.name}: {reason}")
        self.contract = contract
        self.check = check
        self.limit = contract.timeout

    def violation(self, what: str, cause: BaseException | None = None) -> PausedContractViolation:
        if cause is not None and not isinstance(cause, PausedContractViolation):
            what += f" ({type(cause).__name__}: {cause})"
        elif cause is not None:
            return cause
        return PausedContractViolation(
            f"{self.contract.name} breaks the paused() contract ({self.check}): {what}",
            backend=self.contract.name,
            check=self.check,
        )

    def require(self, lever: Any, name: str) -> Any:
        if lever is None:
            raise ValueError(f"{self.check} needs PausedContract.{name}")
        return lever

    def forwards(self, backend: Any) -> int:
        count = self.contract.forwards
        return 0 if count is None else count(backend)

    def parks(self, backend: Any) -> int:
        count = self.contract.parks
        return 0 if count is None else count(backend)

    def parked_times(self, backend: Any, before: int, expected: int, what: str) -> None:
        if self.contract.parks is None or self.contract.parking is Parking.TRIVIAL:
            return
        times = self.contract.parks(backend) - before
        if times != expected:
            raise self.violation(
                f"{what} parked generation {times} time(s), expected {expected} (a re-entrant "
                "pause parks once and resumes when the outermost exits)"
            )

    def generating(self, backend: Any, since: int, when: str) -> None:
        """Wait until a forward runs that ``since`` did not count (generation runs)."""
        count = self.contract.forwards
        if count is None or self.contract.parking is Parking.TRIVIAL:
            return
        if not _wait_until(lambda: count(backend) > since, self.limit):
            parked = self.contract.parked
            state = "" if parked is None else f"; the backend says parked={parked(backend)}"
            raise self.violation(
                f"{when}: no forward ran within {self.limit:g} s (forwards stayed at "
                f"{count(backend)}){state}: generation did not resume"
            )

    def still_held(self, backend: Any, before: int, where: str) -> None:
        """Generation is parked now: the backend says so and no forward has run since ``before``.

        With ``held_back``, waits until generation is held back (or a forward ran); without,
        watches ``quiet_s`` for a forward.
        """
        contract = self.contract
        if contract.parking is Parking.TRIVIAL:
            return
        if contract.parked is not None and not contract.parked(backend):
            raise self.violation(f"{where}: the backend says generation is not parked")
        count = contract.forwards
        if count is None:
            return
        held_back = contract.held_back
        if held_back is not None:
            if not _wait_until(lambda: held_back(backend) or count(backend) != before, self.limit):
                raise self.violation(
                    f"{where}: generation was neither held back nor running within {self.limit:g} s"
                )
        else:
            _wait_until(lambda: count(backend) != before, contract.quiet_s)
        ran = count(backend) - before
        if ran:
            raise self.violation(f"{where}: {ran} forward(s) ran while generation was parked")

    def short_pause_times_out(self, backend: Any, while_what: str, *, hint: str = "") -> None:
        """``paused(short_timeout)`` on another thread, while ``while_what``, gives up in time,
        never runs its body, and raises the PauseTimeout that names its limit."""
        short, late = self.contract.short_timeout, self.contract.late_s
        body_ran = threading.Event()

        def pause() -> None:
            with backend.paused(short):
                body_ran.set()

        attempt = _Attempt(pause, "paused-contract-short").start()
        if not attempt.done.wait(short + late):
            raise self.violation(
                f"paused({short:g}) was still waiting {short + late:g} s after it was called, "
                f"while {while_what}: it does not honour its timeout"
            )
        if body_ran.is_set():
            raise self.violation(f"paused({short:g}) entered its body while {while_what}{hint}")
        self.timed_out(attempt, short, f"a pause while {while_what}")

    def timed_out(self, attempt: _Attempt, limit: float, what: str) -> None:
        """``attempt`` raised the package's PauseTimeout, naming ``limit``, not before it."""
        error = attempt.error
        if error is None:
            raise self.violation(f"{what}: paused({limit:g}) returned without an error")
        if not isinstance(error, PauseTimeout):
            raise self.violation(
                f"{what}: raised {type(error).__name__} ({error}), not rollout_sync's "
                "PauseTimeout (a TimeoutError)",
                None,
            ) from error
        texts = {f"{limit:g}", f"{limit:.1f}", str(limit)}
        # A backend may hand what is left of its deadline to the wait that runs out (the
        # scheduler does): within a few percent of the limit is naming it.
        close = math.isclose(error.timeout, limit, rel_tol=0.05, abs_tol=0.005)
        if not close or not any(t in str(error) for t in texts):
            raise self.violation(
                f"{what}: its PauseTimeout does not name the limit {limit:g} s "
                f"(timeout={error.timeout!r}, message {str(error)!r})"
            )
        if not error.operation:
            raise self.violation(f"{what}: its PauseTimeout does not name the operation")
        if attempt.elapsed < limit / 2:
            raise self.violation(
                f"{what}: paused({limit:g}) gave up after {attempt.elapsed:.3f} s, well before "
                "its limit"
            )
