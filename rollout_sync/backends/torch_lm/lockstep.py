"""Stream generation on a tensor-parallel replica: one scheduler, every rank in lockstep.

Every rank of a tensor-parallel replica must run the same forward at the same time (each
forward all-reduces over the replica's group), but only one of them should schedule: requests
arrive at one place, and two schedulers on two threads would batch differently. So the
replica's first rank, the **leader**, runs the :class:`~rollout_sync.RolloutTaskScheduler`;
before each decode step it *announces* the step (which sequences, their cache lengths, the new
tokens and positions) over the replica's group, and the other ranks, the **followers**, each
run the same forward on their own slice and their own KV caches, from a thread of their own.

**Pausing the replica.** A sync writes every rank's slice, so no rank may run a forward while
any rank writes, and the ranks must resume on the same version:

1. The leader's ``paused()`` parks its scheduler at a step boundary (no step in flight on any
   rank: a follower's step ends with the leader's), then announces ``PARK``.
2. A follower's ``paused()`` waits for that announcement (bounded: :class:`PauseTimeout`),
   then closes its own gate. Followers never park on their own: a follower that stopped
   between the leader's steps would leave the leader's all-reduce waiting.
3. When a rank's outermost pause ends, the ranks **agree**: each contributes whether its
   weights are servable and their version (an all-gather). If any rank is torn, or the
   versions differ (one rank's sync failed where another's landed), every rank marks its
   weights torn: the replica refuses to generate until a complete sync, rather than run a
   forward that mixes two versions. The leader's scheduler resumes only after the agreement.

Every rank of a replica takes every sync (they do: a sharded P2R includes every rank, and R2R
goes rank to rank). The follower's wait for the next announcement is the one unbounded wait
(generation may idle for hours); the replica's group is made with a long timeout for it, and
each all-reduce, announcement and agreement is bounded by :attr:`TensorParallel.timeout_s`.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..._deadline import wait_collective
from ...errors import PauseTimeout
from ...gate import Gate
from .tensor_parallel import TensorParallel

__all__ = ["Lockstep", "StepKind", "StepPlan"]


class StepKind(enum.IntEnum):
    """What the leader announces."""

    STEP = 1
    """Run this forward (a :class:`StepPlan` follows)."""
    PARK = 2
    """The leader is parked; followers may close their gates; an agreement follows."""
    STOP = 3
    """Generation is over; followers leave their loop."""


@dataclass(frozen=True)
class StepPlan:
    """One decode step as every rank runs it: sequence ``ids`` (request ids), each one's cache
    length before the step, and the new ``tokens`` / ``positions`` / ``new_mask`` (``[B, W]``)."""

    ids: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: torch.Tensor
    positions: torch.Tensor
    new_mask: torch.Tensor
    version: int = 0
    """The weight version the leader runs the step on: a follower on another refuses it."""

    def encode(self) -> torch.Tensor:
        return torch.cat(
            [
                torch.tensor(self.ids, dtype=torch.int64),
                torch.tensor(self.lengths, dtype=torch.int64),
                self.tokens.reshape(-1).to(torch.int64),
                self.positions.reshape(-1).to(torch.int64),
                self.new_mask.reshape(-1).to(torch.int64),
            ]
        )

    @classmethod
    def decode(cls, data: torch.Tensor, batch: int, width: int, version: int = 0) -> StepPlan:
        ids, lengths, tokens, positions, mask = data.split(
            [batch, batch, batch * width, batch * width, batch * width]
        )
        return cls(
            tuple(ids.tolist()),
            tuple(lengths.tolist()),
            tokens.view(batch, width),
            positions.view(batch, width),
            mask.view(batch, width).bool(),
            version,
        )


ReplicaState = tuple[bool, int]
"""A rank's ``(servable, weight version)``, as the agreement gathers it."""


class Lockstep:
    """One rank's side of a tensor-parallel replica's lockstep (module docstring).

    Args:
        tp: the replica's group; group rank 0 leads.
        gate: this rank's generation gate (a follower runs each mirrored step as a section of
            it; its ``paused()`` closes it).
        mirror: on a follower, runs one announced step (its forward and cache updates).
        state: this rank's ``(servable, version)`` for the agreement.
        reconcile: called with every rank's state after an agreement (in group rank order).
    """

    def __init__(
        self,
        tp: TensorParallel,
        *,
        gate: Gate,
        mirror: Callable[[StepPlan], None],
        state: Callable[[], ReplicaState],
        reconcile: Callable[[list[ReplicaState]], None],
        fail: Callable[[str], None],
    ) -> None:
        backend = str(dist.get_backend(tp.group))
        if "gloo" not in backend:
            raise ValueError(
                f"a tensor-parallel replica's lockstep sends its announcements as CPU tensors, so "
                f"its group needs gloo (a gloo group, or 'cpu:gloo,cuda:nccl'); got {backend!r}"
            )
        self.tp = tp
        self.gate = gate
        self.mirror = mirror
        self.state = state
        self.reconcile = reconcile
        self.fail = fail
        self.leader = tp.rank == 0
        self._src = tp.ranks[0]
        self._lock = threading.Lock()
        """Guards the hold count; on the leader it is held across announcing PARK and across
        agreeing, so two pauses' collectives never interleave on the group."""
        self._depth = 0
        self._announced = False
        self._parked = threading.Event()
        """Follower: the leader announced PARK and the agreement has not happened yet."""
        self._began = threading.Event()
        """Follower: its own outermost pause began (after the leader's PARK)."""
        self._released = threading.Event()
        """Follower: its outermost pause ended; the loop may agree."""
        self._agreed = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """Follower: what ended its loop, if not a STOP."""
        self.steps_mirrored = 0

    # -- the leader ----------------------------------------------------------------------------

    def announce_step(self, plan: StepPlan) -> None:
        """Leader, inside a decode step, before its forward."""
        batch, width = plan.tokens.shape
        data = plan.encode()
        self._announce([StepKind.STEP, batch, width, data.numel(), plan.version], data)

    def announce_stop(self) -> None:
        """Leader, once its scheduler stopped: the followers' loops end."""
        self._announce([StepKind.STOP, 0, 0, 0, 0], None)

    @contextmanager
    def leader_hold(self) -> Iterator[None]:
        """Leader, inside its parked scheduler: announce PARK (outermost hold), and agree when
        the outermost hold ends."""
        with self._lock:
            if self._depth == 0:
                self._announce([StepKind.PARK, 0, 0, 0, 0], None)
                self._announced = True
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._announced:
                    self._announced = False
                    self._agree()

    # -- a follower ----------------------------------------------------------------------------

    def start_follower(self) -> None:
        """Start the thread that mirrors the leader's steps."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._follow, name=f"tp{self.tp.rank} lockstep", daemon=True
            )
            self._thread.start()

    def join_follower(self, timeout: float) -> bool:
        """Wait for the loop to end (the leader's STOP); whether it did within ``timeout``."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @contextmanager
    def follower_hold(self, timeout: float) -> Iterator[None]:
        """Follower: wait for the leader's PARK, close the gate; agree after the outermost."""
        with self._lock:
            first = self._depth == 0
            self._depth += 1
        try:
            if first:
                if not self._parked.wait(timeout):
                    raise PauseTimeout(
                        f"tensor-parallel rank {self.tp.rank}: the replica's leader did not "
                        f"park within {timeout:.1f} s (a follower parks only with its leader: "
                        "every rank of a replica takes every sync)",
                        operation="wait for the replica's leader to park",
                        timeout=timeout,
                        sections_running=0,
                    )
                self._agreed.clear()
                self._began.set()
            with self.gate.exclusive(timeout):
                yield
        finally:
            with self._lock:
                self._depth -= 1
                last = self._depth == 0
            if last and self._began.is_set():
                self._began.clear()
                self._released.set()
                # The loop agrees now (bounded by the agreement's own limit).
                self._agreed.wait(self.tp.agree_timeout_s + self.tp.timeout_s)

    def _follow(self) -> None:
        try:
            while True:
                kind, plan = self._receive()
                if kind is StepKind.STOP:
                    return
                if kind is StepKind.PARK:
                    self._released.clear()
                    self._parked.set()
                    # The follower's own pause is on its way (its worker takes the same sync):
                    # its start is awaited for one collective's limit (a pause of the leader
                    # alone costs that, not a hang); once it began, its end is awaited whole
                    # (the sync inside it has limits of its own), and only then is this rank's
                    # state read.
                    if self._began.wait(self.tp.timeout_s):
                        self._released.wait()
                    try:
                        self._agree()
                    finally:
                        self._parked.clear()
                        self._agreed.set()
                    continue
                assert plan is not None
                self.gate.enter_section(self.tp.timeout_s)
                try:
                    self.mirror(plan)
                finally:
                    self.gate.exit_section()
                self.steps_mirrored += 1
        except BaseException as exc:  # reported by the backend's statistics and stop()
            self.error = exc
            self.fail(
                f"tensor-parallel rank {self.tp.rank} stopped following its leader: "
                f"{type(exc).__name__}: {exc}; restart the replica"
            )
            self._agreed.set()

    # -- the wire ------------------------------------------------------------------------------

    def _announce(self, header: list[int], data: torch.Tensor | None) -> None:
        works = [self._broadcast(torch.tensor(header, dtype=torch.int64))]
        if data is not None:
            works.append(self._broadcast(data))
        self._wait(works, f"announce {StepKind(header[0]).name}")

    def _receive(self) -> tuple[StepKind, StepPlan | None]:
        header = torch.zeros(5, dtype=torch.int64)
        # The one unbounded wait: generation may idle between steps for as long as it likes.
        self._wait([self._broadcast(header)], "wait for the leader's next step", bounded=False)
        kind, batch, width, size, version = (int(v) for v in header.tolist())
        if StepKind(kind) is not StepKind.STEP:
            return StepKind(kind), None
        data = torch.zeros(size, dtype=torch.int64)
        self._wait([self._broadcast(data)], "receive the leader's step")
        return StepKind.STEP, StepPlan.decode(data, batch, width, version)

    def _agree(self) -> None:
        """Agree with the other ranks on the weights; a failed agreement fails closed: this
        rank's weights are marked torn, then the error is raised."""
        servable, version = self.state()
        try:
            states = self.tp.agree(servable, version)
        except BaseException as exc:
            self.fail(
                f"the ranks of this tensor-parallel replica could not agree on their weights "
                f"after a sync ({type(exc).__name__}: {exc})"
            )
            raise
        self.reconcile(states)

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work | None:
        work: dist.Work | None = dist.broadcast(
            tensor, self._src, group=self.tp.group, async_op=True
        )
        return work

    def _wait(self, works: list[dist.Work | None], what: str, *, bounded: bool = True) -> None:
        wait_collective(
            works,
            operation=f"tensor-parallel lockstep: {what}",
            timeout_s=self.tp.timeout_s if bounded else float("inf"),
            ranks=self.tp.ranks,
        )
