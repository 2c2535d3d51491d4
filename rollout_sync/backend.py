"""RolloutBase, the class rollout backends subclass, and a backend that serves on its own thread.

Weight sync writes the tensors a backend serves. That is only safe while no forward reads them.
:meth:`RolloutBase.paused` is where a backend makes sure of it: inside it no forward runs and none
starts. The default does nothing, which is right for an engine whose generate call blocks the
caller's loop: when the loop is running a sync it is, by construction, not generating.
Backends that generate on their own (stream generation, a backend serving on its own thread)
override it and really park.
"""

from __future__ import annotations

import abc
import enum
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .errors import RolloutSyncError, ShutdownTimeout, TornWeightsError
from .gate import Gate
from .trace import SpanKind, Timeline
from .weights import check_weights_match, specs_of

__all__ = [
    "BackendStatistics",
    "KVCachePolicy",
    "RolloutBase",
    "ThreadedRolloutBackend",
    "TornWeightsPark",
]


class KVCachePolicy(enum.Enum):
    """What happens to the cached keys/values of sequences in flight when the weights change.

    A backend that parks at a step boundary keeps its sequences in flight across a sync; their
    caches were computed with the old weights. Every such backend takes this policy explicitly.
    """

    RECOMPUTE = "recompute"
    """Rebuild the cache under the new weights (the default): the continuation is exactly what
    the new weights produce from the prompt plus the tokens so far."""
    KEEP_STALE = "keep_stale"
    """Keep the cache computed under the old weights: cheaper, and the continuation mixes
    versions."""

    @property
    def clear_cache(self) -> bool:
        """Whether the cache must be dropped at the sync (vLLM's ``clear_cache``)."""
        return self is KVCachePolicy.RECOMPUTE


def _once_per_instance(build: Callable[[Any], None]) -> Callable[[Any], None]:
    """``build`` (a subclass's ``initialize``), run once per instance: the outermost call
    builds and marks the engine built; a call once built returns at once; a nested call (the
    subclass's ``super().initialize()``) just runs its part."""

    @functools.wraps(build)
    def initialize(self: RolloutBase) -> None:
        with self._init_lock:
            if self._initialized:
                return
            if self._init_depth:
                build(self)
                return
            self._init_depth = 1
            try:
                build(self)
            finally:
                self._init_depth = 0
            self._initialized = True

    initialize._runs_once = True  # type: ignore[attr-defined]
    return initialize


class RolloutBase(abc.ABC):
    """The base class of rollout backends.

    What a subclass provides:

    * :meth:`served_weights`: the tensors its forwards read, by name.
    * :meth:`initialize` (optional): build the engine. Called once, lazily, by
      :meth:`ensure_initialized`; a worker calls that inside the weight-sync bracket.
    * :meth:`paused` (optional): park generation. Leave the default only if generation never
      runs while the caller's loop handles a command.
    * :meth:`load_weights` (optional): the default copies in place into :meth:`served_weights`;
      an engine that needs a reload path overrides it.
    * :meth:`flat_weight_storage` (optional): the flat buffer the served weights live in, for
      zero-copy transfers.

    What the base keeps: the served weight version, and whether the served weights are torn
    (a synchronous write failed part-way), in which case generation must be refused until a
    complete sync lands (:meth:`check_servable`).
    """

    def __init__(self) -> None:
        self._weight_version = 0
        self._torn_reason: str | None = None
        self._servable = threading.Event()
        self._servable.set()
        self._initialized = False
        self._init_lock = threading.RLock()

    # -- the pause -----------------------------------------------------------------------------

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[object]:
        """Park generation for the ``with`` body: no forward runs inside it and none starts.

        Contract for overrides: re-entrant; bounded by ``timeout`` seconds (``None``: the
        backend's default), raising :class:`PauseTimeout` instead of hanging; always resumes on
        exit, exceptions included; a no-op before the engine exists.

        What the ``with`` yields is the backend's to say (a stream scheduler yields a
        :class:`~rollout_sync.scheduler.ParkReport`; the default yields ``None``).

        The default does nothing: correct for an engine whose generate call blocks the loop that
        runs weight-sync commands, since that loop cannot be in a sync and a generate at once.
        """
        yield None

    # -- lifecycle -----------------------------------------------------------------------------

    _init_depth = 0
    """How deep this thread is in ``initialize`` calls (a subclass's ``super().initialize()``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make every ``initialize`` a subclass defines run once per instance, whoever calls
        it: a backend built by hand (``b.initialize()``) and then handed to a worker (which
        calls :meth:`ensure_initialized`) builds one engine, never two."""
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("initialize")
        if build is not None and not getattr(build, "_runs_once", False):
            cls.initialize = _once_per_instance(build)  # type: ignore[method-assign,assignment]

    def initialize(self) -> None:
        """Build the engine. Runs at most once per instance: a later call (by hand, or by
        :meth:`ensure_initialized`) returns at once, whatever a subclass overrides; a call that
        raised leaves the engine not built, so the next call tries again."""

    def ensure_initialized(self) -> None:
        """Run :meth:`initialize` once; later calls return at once."""
        with self._init_lock:
            if not self._initialized:
                self.initialize()
                self._initialized = True

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    def shutdown(self) -> None:
        """Release the engine. Safe to call more than once."""

    # -- weights -------------------------------------------------------------------------------

    @abc.abstractmethod
    def served_weights(self) -> Mapping[str, torch.Tensor]:
        """The tensors generation reads, by name (in a stable order).

        Transfers receive into these in place. A backend whose engine does not expose writable
        tensors returns tensors of the right names, shapes and dtypes to receive into and
        overrides :meth:`load_weights` to hand them to the engine.
        """

    def flat_weight_storage(self) -> torch.Tensor | None:
        """The flat buffer the served weights live in, if they do (opt-in); default ``None``.

        A backend that keeps its served weights as views of one ``uint8`` buffer, laid out as
        :class:`~rollout_sync.flat.FlatWeights` lays them out (served order, each tensor at a
        multiple of 64 bytes), returns that buffer here. Transfers then receive into it and
        send from it directly, without staging copies, and overwrite its padding bytes: return
        it only if every byte of it is the backend's to overwrite.
        """
        return None

    def forward_collectives(self) -> frozenset[str]:
        """The backends (``"nccl"``, ``"gloo"``) of the collectives this engine's forwards run
        on their own (tensor parallelism); default none. A receive that runs beside the
        forwards (staged, async) is refused over NCCL when this names NCCL
        (:func:`~rollout_sync.staging.check_two_communicators`)."""
        return frozenset()

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        """Write ``weights`` into the served tensors, all checked before any is touched.

        Call inside :meth:`paused` (the guard does). Raises
        :class:`~rollout_sync.WeightMismatchError` and writes nothing on a bad input.
        """
        served = self.served_weights()
        check_weights_match(specs_of(weights), served, require_all=require_all)
        with torch.no_grad():
            for name, tensor in weights.items():
                target = served[name]
                if tensor.data_ptr() != target.data_ptr():
                    target.copy_(tensor)

    @property
    def weight_version(self) -> int:
        """The version of the weights served now (0 before the first sync)."""
        return self._weight_version

    def commit_weight_version(self, version: int) -> None:
        """Record that a complete sync of ``version`` landed; clears a torn state."""
        self._weight_version = version
        self._torn_reason = None
        self._servable.set()

    def mark_weights_torn(self, reason: str) -> None:
        """Record that a write failed part-way; generation is refused until the next commit."""
        self._torn_reason = reason
        self._servable.clear()

    @property
    def weights_torn(self) -> bool:
        return self._torn_reason is not None

    def check_servable(self) -> None:
        """Raise :class:`TornWeightsError` if the served weights are torn."""
        reason = self._torn_reason
        if reason is not None:
            raise TornWeightsError(
                f"{type(self).__name__} refuses to generate: its weights are torn ({reason}). "
                "Run a complete weight sync to recover."
            )


@dataclass(frozen=True)
class BackendStatistics:
    running: bool
    steps_served: int
    parked: bool
    weight_version: int
    weights_torn: bool


class TornWeightsPark:
    """Keeps generation parked while the served weights are torn, whatever the backend.

    A receive that writes the served tensors in place and fails part-way marks them torn
    (:meth:`~rollout_sync.RolloutBase.mark_weights_torn`). A backend that checks
    ``weights_torn`` refuses to generate; one that never looks would serve them. So the
    receiving side (the :class:`~rollout_sync.RolloutWorker`, the Fast-LLM receiver) calls
    :meth:`hold_if_torn` inside the failed sync's bracket: it enters ``rollout.paused()`` once
    more (``paused()`` is re-entrant) and keeps it past the bracket, so no forward runs between
    the failure and the park. :meth:`release` lets generation go: after a complete version
    commits, or when serving ends. A pause is released by the thread that took it:
    :meth:`check_thread` says so clearly instead of breaking the pause.

    This parks a backend whose ``paused()`` parks its generation; the default ``paused()`` of
    a blocking engine does nothing, and such an engine must check ``weights_torn`` itself (the
    package's own blocking backends do, at every step).

    Who is parked is the caller's choice, for a reason: the rollout worker parks only a
    background engine, because its own loop already never steps a blocking engine while torn
    and a blocking ``generate`` called elsewhere should refuse at once (``TornWeightsError``),
    not wait for the park; the Fast-LLM receiver has no generation loop of its own to keep
    torn weights from being served, so it parks whatever engine it writes into.
    """

    def __init__(self, rollout: RolloutBase, owner: str) -> None:
        self._rollout = rollout
        self._owner = owner
        self._park: ExitStack | None = None
        self._thread: int | None = None
        """The thread that took ``_park``; set exactly while ``_park`` is."""

    @property
    def held(self) -> bool:
        return self._park is not None

    def hold_if_torn(self, timeout: float | None) -> None:
        """If the served weights are torn and generation is not parked yet, park it."""
        if self._park is None and self._rollout.weights_torn:
            park = ExitStack()
            park.enter_context(self._rollout.paused(timeout))
            self._park, self._thread = park, threading.get_ident()

    def release(self) -> None:
        """Let generation go (nothing if it is not parked here)."""
        park, self._park, self._thread = self._park, None, None
        if park is not None:
            park.close()

    def check_thread(self, what: str) -> None:
        """Raise if generation is parked here by another thread than this one.

        Raises:
            RolloutSyncError: ``what`` was called on another thread than the one whose failed
                receive parked generation on torn weights.
        """
        if self._park is not None and self._thread != threading.get_ident():
            raise RolloutSyncError(
                f"{self._owner}.{what} was called on another thread than the one whose failed "
                "receive parked generation on torn weights; a pause is released by the thread "
                f"that took it: call {what} on that thread"
            )


class ThreadedRolloutBackend(RolloutBase):
    """A backend that serves on a thread of its own, one :meth:`serve_step` at a time.

    The space between two steps is the safe point: :meth:`paused` closes a :class:`Gate` that
    every step runs inside, so it returns once the step in progress has finished and no new
    one starts until the ``with`` body exits. Time to park is bounded by one step.

    Before :meth:`start` there is nothing to park and :meth:`paused` returns at once; a
    :meth:`start` inside the body (lazy engine initialization in a sync) begins parked.
    While the weights are torn, the thread serves nothing and waits for a complete sync.
    """

    def __init__(
        self,
        *,
        pause_timeout: float = 60.0,
        timeline: Timeline | None = None,
        name: str = "generation",
    ) -> None:
        super().__init__()
        self.pause_timeout = pause_timeout
        self.timeline = timeline
        self.generation_gate = Gate.for_generation("serving step", timeout=pause_timeout, name=name)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._steps_served = 0

    @abc.abstractmethod
    def serve_step(self) -> None:
        """Serve one step (one forward, one simulator tick). Runs on the serving thread."""

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the serving thread (after :meth:`ensure_initialized`)."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} is already started")
        self.ensure_initialized()
        self._thread = threading.Thread(
            target=self._serve_forever, name=f"{type(self).__name__}-serving", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving and join the thread; re-raise an error that killed it.

        Call outside :meth:`paused`: a parked thread finishes only when the pause ends.

        Raises:
            ShutdownTimeout: the thread did not stop within ``timeout`` seconds.
            RuntimeError: the thread had failed (its error is chained).
        """
        thread = self._thread
        self._stopping.set()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise ShutdownTimeout(
                    f"{type(self).__name__}'s serving thread did not stop within {timeout:.1f} s "
                    "(is stop() called inside paused(), or is serve_step() stuck?)"
                )
        self.shutdown()
        self.raise_if_failed()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Re-raise, wrapped, the error that ended the serving thread, if one did."""
        if self._error is not None:
            raise RuntimeError(f"{type(self).__name__}'s serving thread failed") from self._error

    def _serve_forever(self) -> None:
        gate = self.generation_gate
        try:
            while not self._stopping.is_set():
                if not self._servable.is_set():
                    # Torn weights: serve nothing until a complete sync commits a version.
                    self._servable.wait(0.05)
                    continue
                # A sync holds the gate for as long as the transfer takes; the transfer itself
                # is bounded, so this wait is too.
                gate.enter_section(math.inf)
                try:
                    if self._servable.is_set() and not self._stopping.is_set():
                        self.serve_step()
                        self._steps_served += 1
                finally:
                    gate.exit_section()
        except BaseException as exc:
            self._error = exc

    # -- the pause -----------------------------------------------------------------------------

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """Park the serving thread between two steps; see the class docstring."""
        start = time.monotonic_ns()
        with self.generation_gate.exclusive(timeout):
            timeline = self.timeline
            if timeline is None:
                yield
            else:
                with timeline.span(
                    SpanKind.PAUSE, "generation paused", park_ms=(time.monotonic_ns() - start) / 1e6
                ):
                    yield

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            running=self.running,
            steps_served=self._steps_served,
            parked=self.generation_gate.held,
            weight_version=self.weight_version,
            weights_torn=self.weights_torn,
        )
