"""The packer protocol: keeping payload sends off the device while a weight sync uses it.

NCCL gives no guarantee for two communicators used at once on one device. Anything that ships
rollout payloads over the device's NCCL ("a packer") must have no send in flight while the
weight-sync collective runs, for the *whole* sync: a drain at the start is not enough, since a
sync spends most of its time waiting for its peers at a barrier, and a send launched then lands
in the middle of the collective. Two optional hooks, detected structurally:

* :class:`SupportsHoldSends` - ``hold_sends(timeout=None)``: a context manager. On entry it stops
  launching sends and waits for those in flight to complete; requests arriving while held are
  queued (not dropped, not reordered) and launched on exit.
* :class:`SupportsFlushPendingSends` - ``flush_pending_sends(timeout=None)``: waits for the sends
  already in flight. Weaker: nothing stops the next send.

:func:`payload_egress_held` applies the strongest hook each component has.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "EgressHoldReport",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "payload_egress_held",
]


@runtime_checkable
class SupportsHoldSends(Protocol):
    """A component that can stop launching payload sends for a while (preferred)."""

    def hold_sends(self, timeout: float | None = None) -> AbstractContextManager[object]:
        """Stop launching sends and wait for those in flight; queue new ones until exit."""
        ...


@runtime_checkable
class SupportsFlushPendingSends(Protocol):
    """A component that can wait for the payload sends it has in flight (fallback)."""

    def flush_pending_sends(self, timeout: float | None = None) -> None:
        """Return once every send already launched has completed."""
        ...


@dataclass
class EgressHoldReport:
    """What :func:`payload_egress_held` did: filled on entry, read by the guard."""

    held: int = 0
    """Components whose ``hold_sends`` is in force."""
    flushed: int = 0
    """Components that only could be flushed (their later sends are not prevented)."""
    drain_s: float = 0.0
    """Seconds spent entering the holds and flushes (waiting out sends in flight)."""


@contextmanager
def payload_egress_held(
    *components: object, timeout: float | None = None
) -> Iterator[EgressHoldReport]:
    """Hold every payload egress among ``components`` for the ``with`` body.

    Each component gets its strongest hook: ``hold_sends`` if it has one, else
    ``flush_pending_sends``, else nothing (it ships nothing over this device). ``None`` entries
    and repeats (the same packer reached two ways) are skipped. Holds are entered in the order
    given and released in reverse, also when the body raises or a later hold times out.

    Args:
        timeout: seconds each hook may take to drain; ``None`` leaves it to the component.
    """
    report = EgressHoldReport()
    seen: set[int] = set()
    start = time.perf_counter()
    with ExitStack() as stack:
        for component in components:
            if component is None or id(component) in seen:
                continue
            seen.add(id(component))
            if isinstance(component, SupportsHoldSends):
                stack.enter_context(component.hold_sends(timeout=timeout))
                report.held += 1
            elif isinstance(component, SupportsFlushPendingSends):
                component.flush_pending_sends(timeout=timeout)
                report.flushed += 1
        report.drain_s = time.perf_counter() - start
        yield report
