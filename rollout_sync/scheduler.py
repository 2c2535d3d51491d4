"""Stream generation: a scheduler that decodes on its own thread and parks at a step boundary.

This is the case where "idle by construction" is false. :class:`RolloutTaskScheduler` keeps
decoding on a thread of its own while the worker's main loop takes commands, so a weight sync
arriving on the main loop would land on tensors a decode step is reading. The scheduler makes
that safe with the one primitive of this package, a :class:`~rollout_sync.Gate`:

* **Each scheduling iteration is one gate section**: admit queued prompts, run one batched decode
  step over the active sequences (one forward), retire the finished ones. ``paused()`` takes the
  exclusive side, so it returns once the step in progress has finished (time to park is bounded
  by one decode step, not by the longest generation) and writer preference keeps the next step
  out until the ``with`` body exits.
* **Admission happens inside that section.** Deciding to admit and admitting are one act done
  while the gate is open, so no task can start between "the scheduler is quiet" and the sync (the
  check-then-act race). :class:`rollout_sync.testing.CheckThenActScheduler` rebuilds the classic
  bug (check a flag, then admit outside the gate) so tests can show the race is real.
* **In-flight sequences survive a pause.** Nothing is aborted and nothing has to finish first;
  after the sync the engine continues each sequence under the new weights (what happens to its
  cached state is the engine's documented policy). ``paused(wait_for_active_tasks=True)`` is the
  drain alternative: stop admitting, let the active tasks finish, then park.
* **Nothing is stranded.** Results go to an unbounded completion queue, so a pause completes even
  when nobody collects results, and every request ends as exactly one
  :class:`GenerationResult`: finished, failed (with its error) or cancelled by :meth:`stop`.
  Each result carries the weight versions it was generated under.

The scheduler drives any :class:`DecodeEngine`;
:class:`~rollout_sync.backends.torch_lm.TorchLMBackend` is the embedded one. It can run on its own
thread (:meth:`RolloutTaskScheduler.start`) or be stepped by hand
(:meth:`RolloutTaskScheduler.step`), which is how tests build exact interleavings.
"""

from __future__ import annotations

import collections
import enum
import itertools
import math
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ._deadline import deadline_after, limit_of, remaining, wait_arg
from .errors import PauseTimeout, SchedulerTimeout, WouldBlock
from .gate import Gate
from .lora import SupportsLoRA
from .trace import SpanKind, Timeline

__all__ = [
    "SCHEDULER_STEP_SPAN",
    "DecodeEngine",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "ParkReport",
    "RolloutTaskScheduler",
    "SamplingParams",
    "SchedulerStatistics",
    "SchedulerTimeout",
    "SequenceState",
    "StepReport",
]

SCHEDULER_STEP_SPAN = "scheduler_step"
"""Timeline span kind of one scheduling iteration inside its gate section (admission, the
decode step, retirement): what a step-boundary pause may have to wait for."""

LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
"""``(tokens so far, prompt included; next-token logits) -> logits``; may raise to fail a task."""


class FinishReason(str, enum.Enum):
    """Why a sequence ended."""

    LENGTH = "length"
    """It generated ``max_new_tokens`` tokens."""
    STOP = "stop"
    """It generated one of its ``stop_token_ids`` (kept as its last token)."""
    ERROR = "error"
    """Its decoding raised; the result carries the error and the tokens made before it."""
    CANCELLED = "cancelled"
    """The scheduler stopped before it finished; the result carries the tokens made so far."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    ``temperature == 0`` is greedy decoding. Sampling is deterministic for a given ``seed`` (or,
    without one, for the engine's seed and the request id), whatever the batch it runs in.
    """

    temperature: float = 0.0
    top_k: int | None = None
    seed: int | None = None
    logits_processor: LogitsProcessor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue. Token ids only: tokenization is the caller's business."""

    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    adapter: str | None = None
    """The LoRA adapter the request runs on (:mod:`rollout_sync.lora`), by name; ``None``: the
    base model. The engine must serve it (:class:`~rollout_sync.lora.SupportsLoRA`), or
    :meth:`RolloutTaskScheduler.put` refuses the request."""

    def __post_init__(self) -> None:
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(
                f"GenerationRequest.adapter must be an adapter's name or None, got {self.adapter!r}"
            )
        # operator.index accepts numpy and torch integers and refuses floats, so a prompt of
        # 3.7 is an error here rather than a silently truncated token.
        object.__setattr__(self, "prompt", tuple(operator.index(t) for t in self.prompt))
        object.__setattr__(
            self, "stop_token_ids", tuple(operator.index(t) for t in self.stop_token_ids)
        )


@dataclass(frozen=True)
class GenerationResult:
    """A finished (or failed, or cancelled) request, stamped with the weights it saw.

    Staleness is reported in full: the version at admission, the version at completion, the
    version each token was produced under, and whether a weight sync landed while the sequence
    was in flight (``straddled_sync``), even when the version number did not change. A request
    on a LoRA adapter also carries the adapter version each token was produced under.
    """

    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the distribution it was drawn from."""
    token_weight_versions: tuple[int, ...]
    """The served weight version when each token was produced."""
    finish_reason: FinishReason
    admitted_weight_version: int
    completed_weight_version: int
    straddled_sync: bool
    """A weight write landed between admission and completion (for a request on an adapter:
    a write of the base weights or of that adapter)."""
    recomputes: int
    """Times the engine rebuilt this sequence's cached state under new weights."""
    stale_cache_tokens: int
    """Tokens produced while reading cached state computed under older weights."""
    latency_s: float
    """From admission to completion."""
    error: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    adapter: str | None = None
    """The LoRA adapter the request ran on (``None``: the base model)."""
    token_adapter_versions: tuple[int, ...] = ()
    """The adapter's served version when each token was produced; empty on the base model."""

    @property
    def ok(self) -> bool:
        """Whether the request finished normally (length or stop token)."""
        return self.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)

    @property
    def oldest_weight_version(self) -> int:
        """The oldest version any of its tokens came from (the admission version if none)."""
        return min(self.token_weight_versions, default=self.admitted_weight_version)


@dataclass(eq=False)
class SequenceState:
    """One sequence in flight: what the scheduler tracks and the engine advances.

    The engine appends tokens with :meth:`append_token` (which decides when the sequence is
    done) or records a per-sequence failure with :meth:`fail`; ``engine_state`` is the engine's
    own (a KV cache, say) and nobody else reads it.
    """

    request_id: int
    request: GenerationRequest
    admitted_weight_version: int
    admitted_epoch: int
    admitted_ns: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    recomputes: int = 0
    stale_cache_tokens: int = 0
    engine_state: object | None = None
    token_adapter_versions: list[int] = field(default_factory=list)
    """Per token, the version of the request's adapter it was produced under (the engine
    passes it to :meth:`append_token`); empty for a request on the base model."""
    adapter_write_landed: bool = False
    """The engine saw a write to the request's adapter land while it was in flight (it then
    reports ``straddled_sync``, as a base weight write does)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def context(self) -> list[int]:
        """The prompt followed by the tokens generated so far."""
        return [*self.request.prompt, *self.tokens]

    def append_token(
        self, token: int, logprob: float, weight_version: int, adapter_version: int | None = None
    ) -> None:
        """Record one generated token; finishes the sequence on a stop token or the limit.

        ``adapter_version``: the version of the request's adapter the token was produced under
        (a request on an adapter; ``None`` on the base model)."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} is finished; it takes no more tokens")
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.token_weight_versions.append(weight_version)
        if adapter_version is not None:
            self.token_adapter_versions.append(adapter_version)
        if token in self.request.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.tokens) >= self.request.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def fail(self, error: BaseException) -> None:
        """End the sequence as failed with ``error`` (the tokens made so far are kept)."""
        self.error = error
        self.finish_reason = FinishReason.ERROR

    def cancel(self) -> None:
        self.finish_reason = FinishReason.CANCELLED

    def to_result(self, completed_weight_version: int, completed_epoch: int) -> GenerationResult:
        reason = self.finish_reason
        if reason is None:
            raise RuntimeError(f"request {self.request_id} is still running")
        error = self.error
        message: str | None = None
        if error is not None:
            message = f"{type(error).__name__}: {error}"
        elif reason is FinishReason.CANCELLED:
            message = "the scheduler stopped before the request finished"
        return GenerationResult(
            request_id=self.request_id,
            prompt=self.request.prompt,
            tokens=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            token_weight_versions=tuple(self.token_weight_versions),
            finish_reason=reason,
            admitted_weight_version=self.admitted_weight_version,
            completed_weight_version=completed_weight_version,
            straddled_sync=completed_epoch != self.admitted_epoch or self.adapter_write_landed,
            recomputes=self.recomputes,
            stale_cache_tokens=self.stale_cache_tokens,
            latency_s=(time.monotonic_ns() - self.admitted_ns) / 1e9,
            error=message,
            exception=error,
            adapter=self.request.adapter,
            token_adapter_versions=tuple(self.token_adapter_versions),
        )


class DecodeEngine(Protocol):
    """What :class:`RolloutTaskScheduler` drives: a batched, step-wise decoder.

    ``decode_step`` runs **one** forward over the given unfinished sequences and appends exactly
    one token to each (:meth:`SequenceState.append_token`), or records a failure on a sequence
    it cannot advance (:meth:`SequenceState.fail`) and advances the rest. An exception raised out
    of it fails every sequence of that batch. The scheduler calls it inside a gate section only.

    ``weights_epoch`` changes whenever the served weights may have changed (any write or
    committed sync); comparing it at admission and completion tells whether a sequence
    straddled a sync. ``weights_torn`` true means: serve nothing until a complete sync lands.
    """

    @property
    def weight_version(self) -> int: ...

    @property
    def weights_epoch(self) -> int: ...

    @property
    def weights_torn(self) -> bool: ...

    def validate_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` naming the problem if ``request`` cannot be served."""
        ...

    def decode_step(self, sequences: Sequence[SequenceState]) -> None: ...


@dataclass(frozen=True)
class ParkReport:
    """Yielded by :meth:`RolloutTaskScheduler.paused`: how the park went."""

    drained: bool
    """Whether active tasks were waited out (drain mode) before parking."""
    park_s: float
    """From entering ``paused()`` until generation was parked."""
    in_flight: int
    """Sequences held in flight across the pause (0 after a drain)."""


@dataclass(frozen=True)
class StepReport:
    """What one scheduling iteration did (returned by :meth:`RolloutTaskScheduler.step`)."""

    admitted: int
    decoded: int
    """Sequences in the batched forward (0: no forward ran)."""
    finished: int
    duration_s: float


@dataclass(frozen=True)
class SchedulerStatistics:
    """A snapshot of a :class:`RolloutTaskScheduler`."""

    running: bool
    queued: int
    active: int
    max_concurrent: int
    admitted: int
    completed: int
    """Results produced (any finish reason)."""
    failed: int
    results_waiting: int
    """Results produced and not yet collected."""
    steps: int
    """Batched decode steps (forwards) run."""
    tokens: int
    pauses: int
    drains: int
    parked: bool
    admission_open: bool
    last_park_s: float
    max_park_s: float


class RolloutTaskScheduler:
    """Runs generation tasks on its own thread; parks at a decode-step boundary on request.

    See the module docstring for the design. Thread safety: :meth:`put`, :meth:`get`,
    :meth:`get_all`, :meth:`paused`, :meth:`wait_idle` and :meth:`statistics` may be called from
    any thread except the scheduler's own.

    Args:
        engine: the decoder to drive.
        max_concurrent: sequences decoded together at most; further prompts wait in the queue.
        gate: the gate whose sections the decode steps are; share the engine's gate so that
            anything else that runs its forwards parks too. A fresh one by default.
        pause_timeout: default limit, in seconds, of :meth:`paused` and :meth:`step`.
        timeline: records a ``pause`` span per pause (the engine records the forwards).
        guard_steps: run steps inside the gate. ``False`` removes the guard (``paused()`` then
            parks nothing): only for measuring the guard's cost and showing the hazard.
        admission_hook: called with a request id after the scheduler decided to admit it and
            before the task starts (a test's event-controlled window). Runs on the stepping
            thread, with no scheduler lock held.
    """

    def __init__(
        self,
        engine: DecodeEngine,
        *,
        max_concurrent: int = 8,
        gate: Gate | None = None,
        pause_timeout: float = 60.0,
        timeline: Timeline | None = None,
        name: str = "generation",
        guard_steps: bool = True,
        admission_hook: Callable[[int], None] | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent!r}")
        if not pause_timeout > 0:
            raise ValueError(f"pause_timeout must be > 0 seconds, got {pause_timeout!r}")
        self.engine = engine
        self.max_concurrent = max_concurrent
        self.pause_timeout = pause_timeout
        self.timeline = timeline
        self.name = name
        self.gate = (
            gate
            if gate is not None
            else Gate.for_generation("decode step", timeout=pause_timeout, name=name)
        )
        self.guard_steps = guard_steps
        self.admission_hook = admission_hook

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[int, GenerationRequest]] = collections.deque()
        self._active: list[SequenceState] = []
        self._admitting = 0
        self._results: collections.deque[GenerationResult] = collections.deque()
        self._ids = itertools.count()
        self._drainers = 0
        self._stepping = threading.Lock()
        self._stepping_thread: int | None = None

        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._error: BaseException | None = None

        self._admitted = 0
        self._completed = 0
        self._failed = 0
        self._steps = 0
        self._tokens = 0
        self._pauses = 0
        self._drains = 0
        self._last_park_s = 0.0
        self._max_park_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start decoding on the scheduler's own thread.

        Started inside a :meth:`paused` body (lazy initialization in a sync), it begins parked.
        """
        with self._lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError(
                    f"the {self.name!r} scheduler was already started; a scheduler runs once "
                    "(make a new one)"
                )
            self._thread = threading.Thread(
                target=self._run, name=f"{self.name}-scheduler", daemon=True
            )
        self._thread.start()

    def stop(self, timeout: float = 30.0, *, finish_active: bool = False) -> None:
        """Stop the scheduler thread; unfinished requests become ``cancelled`` results.

        With ``finish_active`` it first waits (within ``timeout``) until every queued and active
        request has finished. Cancelled results keep the tokens made so far and, like every
        result, stay collectable with :meth:`get_all`. Call it outside :meth:`paused`: a parked
        thread can only stop once the pause ends.

        Raises:
            SchedulerTimeout: the work or the thread did not finish within ``timeout``.
            RuntimeError: the scheduler thread had died of an error (chained).
        """
        deadline = deadline_after(timeout)
        if finish_active and self.running:
            self.wait_idle(timeout)
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(wait_arg(deadline))
            if thread.is_alive():
                raise SchedulerTimeout(
                    f"{self.name} scheduler thread did not stop within {timeout:.1f} s: it is "
                    "parked by a pause that is still held (is stop() called inside paused()?) "
                    "or a decode step is stuck"
                )
        with self._changed:
            self._stopped = True
            self._end_unfinished_locked(None)
        self.raise_if_failed()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def raise_if_failed(self) -> None:
        """Re-raise, wrapped, the error that killed the scheduler thread, if one did."""
        if self._error is not None:
            raise RuntimeError(f"{self.name} scheduler thread failed") from self._error

    # -- the queues ----------------------------------------------------------------------------

    def put(
        self,
        request: GenerationRequest | Sequence[int],
        *,
        max_new_tokens: int = 16,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        adapter: str | None = None,
    ) -> int:
        """Queue a request (or a prompt, built into one with the keyword arguments, ``adapter``
        included: the LoRA adapter it runs on, ``None`` for the base model).

        Never blocks (the queue is unbounded); a put during a pause is admitted after it.
        Returns the request id its result will carry.

        Raises:
            ValueError: the engine cannot serve the request (checked now, not later), its
                adapter included: an engine that serves no LoRA adapters
                (:class:`~rollout_sync.lora.SupportsLoRA`) refuses every request on one.
            RuntimeError: the scheduler was stopped or its thread died.
        """
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(
                tuple(request),
                max_new_tokens=max_new_tokens,
                sampling=sampling if sampling is not None else SamplingParams(),
                stop_token_ids=tuple(stop_token_ids),
                adapter=adapter,
            )
        if request.adapter is not None and not isinstance(self.engine, SupportsLoRA):
            raise ValueError(
                f"request on LoRA adapter {request.adapter!r}, but {type(self.engine).__name__} "
                "serves no adapters (it does not implement rollout_sync.lora.SupportsLoRA)"
            )
        self.engine.validate_request(request)
        with self._changed:
            if self._stopped or self._stopping:
                raise RuntimeError(
                    f"the {self.name!r} scheduler is stopped; it admits no new request"
                )
            self.raise_if_failed()
            request_id = next(self._ids)
            self._queue.append((request_id, request))
            self._changed.notify_all()
        return request_id

    def get(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the next result and take it.

        Raises:
            SchedulerTimeout: no result within ``timeout`` seconds (``None``: the pause
                timeout; ``math.inf``: for ever).
        """
        limit = limit_of(timeout, self.pause_timeout)
        deadline = deadline_after(limit)
        with self._changed:
            while not self._results:
                if not self._changed.wait(wait_arg(deadline)) and not self._results:
                    raise SchedulerTimeout(
                        f"no generation result within {limit:.1f} s "
                        f"({len(self._active)} active, {len(self._queue)} queued)"
                    )
            return self._results.popleft()

    def get_nowait(self) -> GenerationResult:
        """Take the next result if there is one; raise :class:`WouldBlock` otherwise."""
        with self._lock:
            if not self._results:
                raise WouldBlock(f"{self.name}: no result waiting")
            return self._results.popleft()

    def get_all(self) -> list[GenerationResult]:
        """Take every result waiting now, in completion order (possibly none). Never blocks."""
        with self._lock:
            results = list(self._results)
            self._results.clear()
            return results

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is queued or active (results may still wait to be collected).

        Raises:
            SchedulerTimeout: work remained after ``timeout`` seconds.
            RuntimeError: work is outstanding but nothing will run it (the thread is not
                running: call :meth:`start`, or drive it with :meth:`step`).
        """
        limit = limit_of(timeout, self.pause_timeout)
        deadline = deadline_after(limit)
        with self._changed:
            while self._queue or self._active or self._admitting:
                if not self.running:
                    self.raise_if_failed()
                    raise RuntimeError(
                        f"the {self.name!r} scheduler has work but its thread is not running; "
                        "call start() or drive it with step()"
                    )
                if not self._changed.wait(wait_arg(deadline)) and (
                    self._queue or self._active or self._admitting
                ):
                    raise SchedulerTimeout(
                        f"{self.name} did not go idle within {limit:.1f} s "
                        f"({len(self._active)} active, {len(self._queue)} queued"
                        f"{', parked' if self.gate.held else ''})"
                    )

    # -- the pause -----------------------------------------------------------------------------

    @contextmanager
    def paused(
        self, timeout: float | None = None, *, wait_for_active_tasks: bool = False
    ) -> Iterator[ParkReport]:
        """Park generation for the ``with`` body: no decode step runs inside it and none starts.

        Default: park at a **decode-step boundary**. The step in progress finishes, the next
        waits; sequences in flight stay in flight and continue after the body under whatever
        weights it wrote. Time to park is bounded by one decode step.

        ``wait_for_active_tasks=True``: **drain**. Admission stops at once, the active tasks run
        to completion, then generation parks; the body starts with nothing in flight. Time to
        park is bounded by the longest active generation.

        Re-entrant (and shared with other threads' pauses); a queued request is admitted only
        after the last pause ends. Before :meth:`start` there is nothing to park and it returns
        at once. Always resumes on exit, exceptions included.

        Raises:
            PauseTimeout: not parked (or not drained) within ``timeout`` seconds (``None``: the
                scheduler's ``pause_timeout``); nothing stays held or closed.
            RuntimeError: called from the scheduler's own stepping thread (it would wait for
                itself), or a drain requested while this thread already holds a pause (the
                active tasks could never finish).
        """
        if threading.get_ident() == self._stepping_thread:
            raise RuntimeError(
                f"paused() called on {self.name}'s own stepping thread (from a hook or a "
                "callback): it would wait for the step it is in. Pause from another thread."
            )
        limit = limit_of(timeout, self.pause_timeout)
        start = time.monotonic()
        deadline = start + limit
        drain = wait_for_active_tasks
        if drain:
            self._drain(limit, deadline)
        try:
            self.gate.acquire_exclusive(remaining(deadline))
            park_s = time.monotonic() - start
            try:
                with self._changed:
                    in_flight = len(self._active) + self._admitting
                    self._pauses += 1
                    self._drains += drain
                    self._last_park_s = park_s
                    self._max_park_s = max(self._max_park_s, park_s)
                report = ParkReport(drained=drain, park_s=park_s, in_flight=in_flight)
                if self.timeline is None:
                    yield report
                else:
                    with self.timeline.span(
                        SpanKind.PAUSE,
                        f"{self.name} paused",
                        park_ms=park_s * 1e3,
                        drained=drain,
                        in_flight=in_flight,
                    ):
                        yield report
            finally:
                self.gate.release_exclusive()
        finally:
            if drain:
                with self._changed:
                    self._drainers -= 1
                    self._changed.notify_all()

    def _drain(self, limit: float, deadline: float) -> None:
        """Close admission and wait until no task is active (admission stays closed on return).

        The caller reopens admission (decrements ``_drainers``) when its pause ends.
        """
        with self._changed:
            if self.gate.held_by_current_thread and (self._active or self._admitting):
                raise RuntimeError(
                    f"drain requested on {self.name} by a thread that already holds a "
                    f"step-boundary pause: the {len(self._active)} active task(s) cannot finish "
                    "while parked. Ask for the drain on the outer pause."
                )
            self._drainers += 1
            try:
                while self._active or self._admitting:
                    if not self._changed.wait(wait_arg(deadline)) and (
                        self._active or self._admitting
                    ):
                        active = len(self._active) + self._admitting
                        raise PauseTimeout(
                            f"{self.name} did not drain within {limit:.1f} s ({active} active "
                            f"task(s) still generating, {len(self._queue)} queued). Drain waits "
                            "out whole generations; park at a step boundary "
                            "(wait_for_active_tasks=False) or raise the timeout.",
                            operation=f"drain {self.name}",
                            timeout=limit,
                            sections_running=self.gate.statistics().sections_running,
                        )
            except BaseException:
                self._drainers -= 1
                self._changed.notify_all()
                raise

    # -- stepping ------------------------------------------------------------------------------

    def step(self, timeout: float | None = None) -> StepReport:
        """Run one scheduling iteration on the calling thread (manual driving).

        Admits queued requests up to ``max_concurrent``, runs one batched decode step over the
        active sequences and retires the finished ones, all as one gate section. Waits up to
        ``timeout`` seconds (``None``: the pause timeout) while a pause is held.

        Raises:
            PauseTimeout: a pause stayed held past ``timeout``.
            RuntimeError: the scheduler thread is running (it owns the stepping), or another
                thread is stepping right now.
        """
        if self.running:
            raise RuntimeError(f"{self!r} is running on its own thread; step() is for manual use")
        return self._iterate(self.pause_timeout if timeout is None else timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    while not self._stopping and not self._runnable_locked():
                        self._changed.wait()
                    if self._stopping:
                        # Published here too, so that a stop() that gave up waiting for a
                        # parked thread strands nothing once the pause ends.
                        self._end_unfinished_locked(None)
                        return
                if self.engine.weights_torn:
                    # Torn weights serve nothing; a complete sync clears them. Poll, since the
                    # engine's recovery is not ours to be notified of.
                    with self._changed:
                        self._changed.wait(0.05)
                    continue
                # A sync holds the gate for as long as its transfer takes, and the transfer is
                # bounded by its own timeouts, so this wait is too.
                self._iterate(math.inf, blocking=True)
        except BaseException as exc:
            self._error = exc
            with self._changed:
                self._end_unfinished_locked(exc)

    def _end_unfinished_locked(self, error: BaseException | None) -> None:
        """Turn every queued and active request into a result: cancelled, or failed with
        ``error``."""
        unfinished = list(self._active) + [self._new_state(rid, req) for rid, req in self._queue]
        self._active.clear()
        self._queue.clear()
        for state in unfinished:
            if state.finished:
                continue
            if error is None:
                state.cancel()
            else:
                state.fail(error)
        self._publish_locked(unfinished)

    def _runnable_locked(self) -> bool:
        if self._active:
            return True
        return bool(self._queue) and not self._drainers

    def _iterate(self, timeout: float, *, blocking: bool = False) -> StepReport:
        if not self._stepping.acquire(blocking=blocking):
            raise RuntimeError(f"{self!r}: another thread is stepping it right now")
        started = time.perf_counter()
        admitted = 0
        guarded = self.guard_steps
        try:
            self._stepping_thread = threading.get_ident()
            admitted = self._admit_before_section()
            if guarded:
                self.gate.enter_section(timeout)
            section_ns = time.monotonic_ns()
            try:
                admitted += self._admit_in_section()
                with self._lock:
                    batch = [s for s in self._active if not s.finished]
                if batch:
                    try:
                        self.engine.decode_step(batch)
                    except Exception as exc:
                        for state in batch:
                            if not state.finished:
                                state.fail(exc)
                finished = self._retire(decoded=len(batch))
            finally:
                if guarded:
                    self.gate.exit_section()
            if batch and self.timeline is not None:
                self.timeline.add_span(
                    SCHEDULER_STEP_SPAN,
                    f"{self.name} step",
                    section_ns,
                    admitted=admitted,
                    batch=len(batch),
                    finished=finished,
                )
        finally:
            self._stepping_thread = None
            self._stepping.release()
        return StepReport(
            admitted=admitted,
            decoded=len(batch),
            finished=finished,
            duration_s=time.perf_counter() - started,
        )

    def _admit_before_section(self) -> int:
        """Admission outside the step's gate section: none. Deciding there is the
        check-then-act race; :class:`rollout_sync.testing.CheckThenActScheduler` does it on
        purpose, to prove the race."""
        return 0

    def _admit_in_section(self) -> int:
        """Admission inside the step's gate section, so never inside a pause."""
        return self._admit()

    def _admit(self) -> int:
        """Admit queued requests now (room permitting, not while draining or stopping)."""
        with self._lock:
            room = self.max_concurrent - len(self._active) - self._admitting
            taken: list[tuple[int, GenerationRequest]] = []
            if not self._drainers and not self._stopping:
                while room > 0 and self._queue:
                    taken.append(self._queue.popleft())
                    room -= 1
            self._admitting += len(taken)
        if not taken:
            return 0
        self._activate(taken)
        return len(taken)

    def _activate(self, taken: list[tuple[int, GenerationRequest]]) -> None:
        """Start the admitted requests: the hook's window, then the version stamp."""
        try:
            hook = self.admission_hook
            if hook is not None:
                for request_id, _ in taken:
                    hook(request_id)
        except BaseException:
            with self._changed:
                self._queue.extendleft(reversed(taken))
                self._admitting -= len(taken)
                self._changed.notify_all()
            raise
        with self._changed:
            self._active.extend(self._new_state(rid, req) for rid, req in taken)
            self._admitting -= len(taken)
            self._admitted += len(taken)
            self._changed.notify_all()

    def _new_state(self, request_id: int, request: GenerationRequest) -> SequenceState:
        return SequenceState(
            request_id=request_id,
            request=request,
            admitted_weight_version=self.engine.weight_version,
            admitted_epoch=self.engine.weights_epoch,
            admitted_ns=time.monotonic_ns(),
        )

    def _retire(self, decoded: int) -> int:
        with self._changed:
            done = [s for s in self._active if s.finished]
            if done:
                self._active = [s for s in self._active if not s.finished]
            if decoded:
                self._steps += 1
                self._tokens += decoded - sum(1 for s in done if s.error is not None)
            self._publish_locked(done)
            return len(done)

    def _publish_locked(self, done: list[SequenceState]) -> None:
        if not done:
            return
        version = self.engine.weight_version
        epoch = self.engine.weights_epoch
        for state in done:
            result = state.to_result(version, epoch)
            self._results.append(result)
            self._completed += 1
            self._failed += result.finish_reason is FinishReason.ERROR
        self._changed.notify_all()

    # -- introspection -------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        with self._lock:
            return SchedulerStatistics(
                running=self.running,
                queued=len(self._queue),
                active=len(self._active) + self._admitting,
                max_concurrent=self.max_concurrent,
                admitted=self._admitted,
                completed=self._completed,
                failed=self._failed,
                results_waiting=len(self._results),
                steps=self._steps,
                tokens=self._tokens,
                pauses=self._pauses,
                drains=self._drains,
                parked=self.gate.held,
                admission_open=not self._drainers and not self._stopping,
                last_park_s=self._last_park_s,
                max_park_s=self._max_park_s,
            )

    def __repr__(self) -> str:
        s = self.statistics()
        if s.running:
            state = "running"
        elif self._stopped:
            state = "stopped"
        else:
            state = "not started"
        parked = ", parked" if s.parked else ""
        draining = ", draining" if not s.admission_open and not self._stopping else ""
        return (
            f"<RolloutTaskScheduler {self.name!r} {state}: {s.active} active, {s.queued} queued, "
            f"{s.results_waiting} results waiting{parked}{draining}>"
        )
