"""The one synchronization primitive: many *sections* versus an *exclusive* hold.

A section is a short piece of work that must not overlap a weight sync: a forward pass, one
decode step, a payload send. The exclusive side is the sync: while it is held no section runs
and none starts. Both hazards of weight sync are this one shape, so both use this one class.

Rules, in the order they matter:

* **Writer preference.** Once anybody waits for the exclusive hold, no new section starts, so a
  stream of sections cannot starve a sync. The wait for the hold is bounded by the longest
  section already running: one decode step, one send.
* **Hand-off on release.** When the last hold is released, every section that waited through
  it is admitted at once, before any later hold can start. So back-to-back syncs cannot starve
  generation either: between two holds, each waiting section gets its turn.
* **Exclusive is shared among holders.** Several threads may hold it at once (the weight-sync
  thread and the main loop both holding payload egress, say): they all want the same thing, no
  sections, so letting them overlap cannot break anything and cannot deadlock. It is re-entrant
  on a thread; the gate opens when the last hold is released.
* **Every wait is bounded.** ``timeout=None`` means the gate's ``default_timeout``; pass
  ``math.inf`` to wait for ever on purpose. Running out raises the gate's timeout error, which
  names the limit and what was still in the way.
* **Cheap when uncontended.** Entering and leaving a section is one lock round-trip each and a
  couple of integer updates; it sits on the decode hot path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

from ._deadline import deadline_after, limit_of, wait_arg
from .errors import EgressHoldTimeout, GateTimeout, PauseTimeout, WouldBlock

__all__ = ["DEFAULT_TIMEOUT_S", "Gate", "GateStatistics"]

DEFAULT_TIMEOUT_S = 300.0
"""The limit a wait gets when neither the call nor the gate names one."""


@dataclass(frozen=True)
class GateStatistics:
    """A snapshot of a :class:`Gate`, for logs, tests and reports."""

    name: str
    sections_running: int
    sections_waiting: int
    holders: int
    """Threads holding the exclusive side now."""
    exclusive_waiting: int
    sections_entered: int
    """Sections admitted since the gate was made."""
    exclusive_acquired: int
    """Times the gate went from open to held (re-entrant and shared holds not counted)."""
    timeouts: int


class Gate:
    """Many sections versus exclusive holders; see the module docstring for the rules.

    Args:
        name: what the gate protects, used in errors and ``repr`` ("generation").
        section_noun: what a section is, singular ("forward").
        close_verb: what closing the gate means to a reader of an error ("park").
        default_timeout: the limit, in seconds, of a wait called with ``timeout=None``.
        timeout_error: the :class:`GateTimeout` subclass raised when a wait runs out.
    """

    def __init__(
        self,
        name: str = "gate",
        *,
        section_noun: str = "section",
        close_verb: str = "close",
        default_timeout: float = DEFAULT_TIMEOUT_S,
        timeout_error: type[GateTimeout] = GateTimeout,
    ) -> None:
        if not default_timeout > 0:
            raise ValueError(f"Gate default_timeout must be > 0 seconds, got {default_timeout!r}")
        self.name = name
        self.section_noun = section_noun
        self.close_verb = close_verb
        self.default_timeout = default_timeout
        self.timeout_error = timeout_error
        self._lock = threading.Lock()
        self._opened = threading.Condition(self._lock)
        self._sections_done = threading.Condition(self._lock)
        self._sections = 0
        self._sections_waiting = 0
        self._exclusive_waiting = 0
        self._idle_waiting = 0
        self._holder_depth: dict[int, int] = {}
        self._handoffs = 0
        """Counts releases that admitted the waiting sections; a waiter compares it to its own."""
        self._sections_entered = 0
        self._exclusive_acquired = 0
        self._timeouts = 0
        self._section_context = _SectionContext(self, None)

    @classmethod
    def for_generation(cls, step_noun: str, *, timeout: float, name: str = "generation") -> Gate:
        """The gate generation steps run in: holding it parks generation, and a hold that
        cannot be had in time raises :class:`PauseTimeout` ("generation did not park ...")."""
        return cls(
            name,
            section_noun=step_noun,
            close_verb="park",
            default_timeout=timeout,
            timeout_error=PauseTimeout,
        )

    @classmethod
    def for_payloads(
        cls,
        transfer_noun: str,
        *,
        timeout: float,
        name: str = "payload egress",
        timeout_error: type[GateTimeout] = EgressHoldTimeout,
    ) -> Gate:
        """The gate payload transfers run in: holding it holds egress (on a receiver,
        ingress); a hold that cannot be had in time raises ``timeout_error``."""
        return cls(
            name,
            section_noun=transfer_noun,
            close_verb="hold",
            default_timeout=timeout,
            timeout_error=timeout_error,
        )

    # -- sections ------------------------------------------------------------------------------

    def enter_section(self, timeout: float | None = None) -> None:
        """Start a section, waiting while the gate is held or a holder is waiting.

        Raises:
            GateTimeout (the gate's ``timeout_error``): the gate stayed closed past the limit.
            RuntimeError: the calling thread holds the exclusive side (it would wait for itself).
        """
        with self._lock:
            if not self._holder_depth and not self._exclusive_waiting:
                self._sections += 1
                self._sections_entered += 1
                return
            self._enter_section_slow(timeout)

    def enter_section_nowait(self) -> None:
        """Start a section if the gate is open now; raise :class:`WouldBlock` otherwise."""
        with self._lock:
            if self._holder_depth or self._exclusive_waiting:
                raise WouldBlock(f"{self.name} is held: no {self.section_noun} may start now")
            self._sections += 1
            self._sections_entered += 1

    def exit_section(self) -> None:
        """End a section started by :meth:`enter_section`."""
        with self._lock:
            if self._sections <= 0:
                raise RuntimeError(f"{self.name}: exit_section() without a matching enter")
            self._sections -= 1
            if self._sections == 0 and (self._exclusive_waiting or self._idle_waiting):
                self._sections_done.notify_all()

    def section(self, timeout: float | None = None) -> _SectionContext:
        """Context-manager form of :meth:`enter_section` / :meth:`exit_section`."""
        if timeout is None:
            return self._section_context
        return _SectionContext(self, timeout)

    def _enter_section_slow(self, timeout: float | None) -> None:
        if threading.get_ident() in self._holder_depth:
            raise RuntimeError(
                f"a {self.section_noun} was started on {self.name} by the thread that holds it "
                "exclusively; it would wait for itself. Do the work outside the hold."
            )
        limit = limit_of(timeout, self.default_timeout)
        deadline = deadline_after(limit)
        handoff = self._handoffs
        self._sections_waiting += 1
        try:
            while self._holder_depth or self._exclusive_waiting:
                if self._handoffs != handoff:
                    return  # admitted (and counted) by the release we waited through
                if not self._opened.wait(wait_arg(deadline)):
                    if self._handoffs != handoff:
                        return
                    if self._holder_depth or self._exclusive_waiting:
                        self._timeouts += 1
                        raise self.timeout_error(
                            f"a {self.section_noun} could not start: {self.name} stayed held "
                            f"for more than {limit:.1f} s (a weight sync that long has likely "
                            "hung; raise the timeout if it is legitimately slow)",
                            operation=f"start a {self.section_noun}",
                            timeout=limit,
                            sections_running=self._sections,
                        )
            if self._handoffs == handoff:
                self._sections += 1
                self._sections_entered += 1
        finally:
            self._sections_waiting -= 1

    # -- the exclusive side --------------------------------------------------------------------

    def acquire_exclusive(self, timeout: float | None = None) -> None:
        """Hold the gate: wait until no section runs, keeping new ones out meanwhile.

        Re-entrant on a thread and shared with other holders (see the module docstring).

        Raises:
            GateTimeout (the gate's ``timeout_error``): sections were still running at the
            limit. The gate is left as it was: nothing held, waiting sections admitted again.
        """
        me = threading.get_ident()
        with self._lock:
            if self._admit_holder_now(me):
                return
            limit = limit_of(timeout, self.default_timeout)
            deadline = deadline_after(limit)
            self._exclusive_waiting += 1
            try:
                while self._sections:
                    if not self._sections_done.wait(wait_arg(deadline)) and self._sections:
                        self._timeouts += 1
                        noun = self.section_noun + ("" if self._sections == 1 else "s")
                        raise self.timeout_error(
                            f"{self.name} did not {self.close_verb} within {limit:.1f} s "
                            f"({self._sections} {noun} still running)",
                            operation=f"{self.close_verb} {self.name}",
                            timeout=limit,
                            sections_running=self._sections,
                        )
                self._holder_depth[me] = 1
                self._exclusive_acquired += 1
            finally:
                self._exclusive_waiting -= 1
                if not self._exclusive_waiting and not self._holder_depth:
                    self._hand_off_to_waiting_sections()
                    self._opened.notify_all()

    def acquire_exclusive_nowait(self) -> None:
        """Hold the gate if no section runs now; raise :class:`WouldBlock` otherwise."""
        with self._lock:
            if self._admit_holder_now(threading.get_ident()):
                return
            if self._sections:
                raise WouldBlock(f"{self.name}: {self._sections} {self.section_noun}(s) running")
            self._holder_depth[threading.get_ident()] = 1
            self._exclusive_acquired += 1

    def release_exclusive(self) -> None:
        """Release one hold of the calling thread; the gate opens when no hold is left."""
        me = threading.get_ident()
        with self._lock:
            depth = self._holder_depth.get(me)
            if not depth:
                raise RuntimeError(f"{self.name}: release_exclusive() by a thread that holds none")
            if depth > 1:
                self._holder_depth[me] = depth - 1
                return
            del self._holder_depth[me]
            if not self._holder_depth and not self._exclusive_waiting:
                self._hand_off_to_waiting_sections()
                self._opened.notify_all()

    def exclusive(self, timeout: float | None = None) -> _ExclusiveContext:
        """Context-manager form of :meth:`acquire_exclusive` / :meth:`release_exclusive`."""
        return _ExclusiveContext(self, timeout)

    def _hand_off_to_waiting_sections(self) -> None:
        """Admit every waiting section now, so a hold taken right after cannot overtake them."""
        if self._sections_waiting:
            self._sections += self._sections_waiting
            self._sections_entered += self._sections_waiting
            self._handoffs += 1

    def _admit_holder_now(self, me: int) -> bool:
        """Admit ``me`` at once if the gate is already held (re-entrant or shared)."""
        depth = self._holder_depth.get(me)
        if depth:
            self._holder_depth[me] = depth + 1
            return True
        if self._holder_depth:
            self._holder_depth[me] = 1
            return True
        return False

    # -- waiting without closing ---------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no section is running, without keeping new ones out.

        This is a *flush*: it proves that the sections running at the call have finished, not
        that none starts afterwards. Use :meth:`exclusive` for that. Sections are anonymous, so
        under back-to-back overlapping sections the gate may never be idle and this waits until
        ``timeout``; a component that needs "the sends in flight at the call" exactly keeps
        tickets of its own (the payload transport does).
        """
        with self._lock:
            if not self._sections:
                return
            limit = limit_of(timeout, self.default_timeout)
            deadline = deadline_after(limit)
            self._idle_waiting += 1
            try:
                while self._sections:
                    if not self._sections_done.wait(wait_arg(deadline)) and self._sections:
                        self._timeouts += 1
                        raise self.timeout_error(
                            f"{self.name}: {self._sections} {self.section_noun}(s) still running "
                            f"after {limit:.1f} s of waiting for them to finish",
                            operation=f"wait for {self.name} to go idle",
                            timeout=limit,
                            sections_running=self._sections,
                        )
            finally:
                self._idle_waiting -= 1

    # -- introspection -------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Whether some thread holds the exclusive side now."""
        return bool(self._holder_depth)

    @property
    def held_by_current_thread(self) -> bool:
        return threading.get_ident() in self._holder_depth

    def statistics(self) -> GateStatistics:
        with self._lock:
            return GateStatistics(
                name=self.name,
                sections_running=self._sections,
                sections_waiting=self._sections_waiting,
                holders=len(self._holder_depth),
                exclusive_waiting=self._exclusive_waiting,
                sections_entered=self._sections_entered,
                exclusive_acquired=self._exclusive_acquired,
                timeouts=self._timeouts,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        if s.holders:
            state = f"held by {s.holders} thread(s)"
        elif s.exclusive_waiting:
            state = "closing"
        else:
            state = "open"
        noun = self.section_noun + ("" if s.sections_running == 1 else "s")
        return (
            f"<Gate {self.name!r} {state}: {s.sections_running} {noun}, "
            f"{s.sections_waiting + s.exclusive_waiting} waiting>"
        )


class _SectionContext:
    __slots__ = ("_gate", "_timeout")

    def __init__(self, gate: Gate, timeout: float | None) -> None:
        self._gate = gate
        self._timeout = timeout

    def __enter__(self) -> None:
        self._gate.enter_section(self._timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._gate.exit_section()


class _ExclusiveContext:
    __slots__ = ("_gate", "_timeout")

    def __init__(self, gate: Gate, timeout: float | None) -> None:
        self._gate = gate
        self._timeout = timeout

    def __enter__(self) -> None:
        self._gate.acquire_exclusive(self._timeout)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._gate.release_exclusive()
