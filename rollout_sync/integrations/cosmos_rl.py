"""The guard on cosmos-rl 0.4.7's own rollout worker, scheduler, weight-sync thread and producer.

A cosmos-rl user gets this package's bracket on the worker they already run, without forking
cosmos::

    from rollout_sync.integrations import cosmos_rl

    guard = cosmos_rl.install()     # in the rollout process, before the worker is built
    ...                             # cosmos runs as usual
    cosmos_rl.uninstall()

or ``with cosmos_rl.installed(): ...``. What :func:`install` changes, all of it undone by
:func:`uninstall`:

* **The command handlers.** cosmos dispatches commands through a registry
  (``RolloutWorkerBase.rollout_command_handler_registry``), so overriding a method changes
  nothing. Every handler registered there for ``PolicyToRolloutUnicastCommand`` (P2R) and
  ``RolloutToRolloutBroadcastCommand`` (R2R), in every worker class's registry (the
  disaggregated worker's; the colocated worker keeps a copy of its own) under every backend
  key, also those registered after :func:`install`, is
  replaced by the same handler inside the bracket: pause generation, hold payload egress,
  *handler* (lazy engine init, the barrier, the transfer), fence cosmos's ``inference_stream``,
  release, resume. In an async R2R mode (``rollout.async_r2r_sync`` ``generation`` /
  ``inference``: the transfer writes a buffer clone) nothing is paused; egress is held.
* **The pause target** (:class:`CosmosGenerationPause`) is cosmos's ``RolloutTaskScheduler``
  (stream generation, ``rollout.mode = "async"``): admission stops, and a backend with its own
  ``paused(timeout)`` parks its generations at a step boundary; a backend without one is
  drained (active generations run to their end), as 0.4.7 does; before the scheduler has
  started, nothing. Without a scheduler (``rollout.mode = "sync"``: generation blocks the
  main loop, idle by construction) only a backend's own ``paused()`` is used. While the
  bracket holds the scheduler paused, 0.4.7's ``_paused_async_live_weights`` keeps its
  failure latch and write fence but skips its drain (which would wait for the parked
  generations) and, after a park, the backend's ``synchronize_generation`` (the backend's
  ``paused()`` is its device fence).
* **The weight-sync thread** (``WeightSyncThread._execute_p2r`` / ``_execute_r2r``) writes a
  buffer clone: each transfer runs with payload egress held (no pause) and its stream fenced.
* **The payload producer.** ``PayloadContext.create("nccl", ...)`` builds a
  :class:`~rollout_sync.integrations.cosmos_rl_payload.HoldableNCCLPayloadProducer`
  (``hold_sends`` / ``flush_pending_sends``); every one alive in the process is held, with the
  worker's ``data_packer`` / ``val_data_packer`` (their own hooks, if any). Producers created
  before :func:`install` are cosmos's own and cannot be held.

Every sync produces a :class:`~rollout_sync.SyncReport`: left on the worker
(``last_weight_sync_report``), passed to the worker's ``on_weight_sync_report`` if it has one
and to :func:`install`'s ``on_report``, and kept in :attr:`CosmosRLGuard.reports`.

It patches cosmos's internals, so it works with exactly the version it was written against:
:func:`install` refuses any other with :class:`~rollout_sync.errors.CosmosRLVersionError`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .._deadline import deadline_after, limit_of, wait_device_event
from ..errors import CosmosRLVersionError, FenceTimeout, PauseTimeout
from ..guard import SyncReport, _deliver_report, weight_sync_bracket
from ..sync.mode import SyncMode

__all__ = [
    "SUPPORTED_VERSION",
    "CosmosGenerationPause",
    "CosmosRLGuard",
    "check_cosmos_rl_version",
    "cosmos_generation_pause",
    "install",
    "installed",
    "uninstall",
]

logger = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.4.7"
"""The one cosmos-rl version :func:`install` accepts."""

_REPORTS_KEPT = 1024


def check_cosmos_rl_version() -> str:
    """The installed cosmos-rl version, if it is :data:`SUPPORTED_VERSION`.

    Raises:
        CosmosRLVersionError: cosmos-rl is not installed, or is another version.
    """
    try:
        found = importlib.metadata.version("cosmos-rl")
    except importlib.metadata.PackageNotFoundError:
        raise CosmosRLVersionError(
            f"cosmos-rl is not installed; rollout_sync.integrations.cosmos_rl needs "
            f"cosmos-rl=={SUPPORTED_VERSION}",
            package="cosmos-rl",
        ) from None
    if found != SUPPORTED_VERSION:
        raise CosmosRLVersionError(
            f"rollout_sync.integrations.cosmos_rl supports cosmos-rl {SUPPORTED_VERSION} only "
            f"(it wraps cosmos's command registry, scheduler, weight-sync thread and payload "
            f"producer, whose internals change between releases); found {found}. Install "
            f"cosmos-rl=={SUPPORTED_VERSION}.",
            package="cosmos-rl",
        )
    return found


# -- the pause target ---------------------------------------------------------------------------


def _own_paused(backend: object) -> Callable[..., Any] | None:
    pause = getattr(backend, "paused", None)
    return pause if callable(pause) else None


class CosmosGenerationPause:
    """What the bracket pauses on a cosmos rollout worker: its scheduler, or its backend.

    ``strategy`` says how, decided when :meth:`paused` is entered:

    * ``"park"``: the scheduler's admission stops and the backend's own ``paused(timeout)``
      parks the active generations at a step boundary (they resume where they were);
    * ``"drain"``: the scheduler's admission stops and the active generations run to their end
      (``RolloutTaskScheduler.paused(wait_for_active_tasks=True)``, 0.4.7's behaviour): the
      backend has no ``paused()``;
    * ``"backend"``: no scheduler (``rollout.mode = "sync"``); the backend's own ``paused()``;
    * ``"none"``: nothing to pause: no scheduler and no backend pause, or a scheduler not
      started yet (the first sync starts it; cosmos's own drain covers what it runs then).

    ``scheduler`` and ``backend`` are the worker's ``scheduler`` and ``rollout``.
    """

    def __init__(self, scheduler: Any, backend: Any) -> None:
        self.scheduler = scheduler
        self.backend = backend
        self.strategy = "none"

    def _choose(self) -> str:
        has_own = _own_paused(self.backend) is not None
        if self.scheduler is None:  # rollout.mode = "sync": generation blocks the main loop
            return "backend" if has_own else "none"
        if not self.scheduler.is_running():
            # Nothing generates before the scheduler starts. It starts inside the first sync's
            # handler (lazy init), and cosmos's own drain then covers what it runs at once: a
            # backend parked now would keep those generations from ever finishing.
            return "none"
        return "park" if has_own else "drain"

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[CosmosGenerationPause]:
        """Park generation for the ``with`` body.

        Raises:
            PauseTimeout: the drain (or the backend's park) took longer than ``timeout``.
        """
        self.strategy = self._choose()
        with ExitStack() as stack:
            if self.strategy in ("park", "drain"):
                drain = self.strategy == "drain"
                try:
                    stack.enter_context(
                        self.scheduler.paused(wait_for_active_tasks=drain, timeout=timeout)
                    )
                except TimeoutError as exc:
                    raise PauseTimeout(
                        f"cosmos's scheduler did not drain within {timeout} s: {exc}",
                        operation="drain cosmos generations",
                        timeout=timeout if timeout is not None else float("inf"),
                        sections_running=self.scheduler.active_tasks(),
                    ) from exc
            if self.strategy in ("park", "backend"):
                own = _own_paused(self.backend)
                assert own is not None
                stack.enter_context(own(timeout))
            yield self


def cosmos_generation_pause(worker: Any) -> CosmosGenerationPause | None:
    """The pause target of a cosmos rollout worker, or ``None`` when nothing can generate."""
    pause = CosmosGenerationPause(
        getattr(worker, "scheduler", None), getattr(worker, "rollout", None)
    )
    return None if pause._choose() == "none" else pause


# -- the installed state -----------------------------------------------------------------------


@dataclass
class CosmosRLGuard:
    """What :func:`install` did; returned by it and by :func:`installed`.

    Attributes:
        timeout: seconds for each part of the bracket (pause, each egress hold, the fence);
            ``None``: cosmos's ``COSMOS_ROLLOUT_CMD_WAIT_TIMEOUT`` (600 s by default).
        on_report: called with each sync's :class:`~rollout_sync.SyncReport`.
        reports: the :class:`~rollout_sync.SyncReport` of the latest syncs (up to 1024), oldest
            first, from every guarded handler and weight-sync-thread transfer.
        syncs: how many syncs were guarded since :func:`install`.
        strategies: how many syncs paused generation each way (``park``, ``drain``,
            ``backend``, ``none``, and ``async`` for syncs that write a buffer clone).
    """

    timeout: float | None = None
    on_report: Callable[[SyncReport], None] | None = None
    reports: deque[SyncReport] = field(default_factory=lambda: deque(maxlen=_REPORTS_KEPT))
    syncs: int = 0
    strategies: dict[str, int] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def metrics(self, prefix: str = "rollout_sync/") -> dict[str, float]:
        """The latest sync's :meth:`SyncReport.to_metrics`, plus ``cosmos_syncs`` (``syncs``)."""
        with self._lock:
            latest = self.reports[-1] if self.reports else None
            count = self.syncs
        found = latest.to_metrics(prefix) if latest is not None else {}
        found[f"{prefix}cosmos_syncs"] = float(count)
        return found

    def _sync_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        from cosmos_rl.utils import constant

        return float(constant.COSMOS_ROLLOUT_CMD_WAIT_TIMEOUT)

    def _deliver(self, worker: Any, report: SyncReport | None, strategy: str) -> None:
        """Record ``report``; hand it to the worker and ``on_report`` (their errors are logged,
        never raised over the handler's own outcome)."""
        if report is None:
            return
        with self._lock:
            self.reports.append(report)
            self.syncs += 1
            self.strategies[strategy] = self.strategies.get(strategy, 0) + 1
        sinks: list[Callable[[], None]] = [lambda: _deliver_report(worker, report)]
        if self.on_report is not None:
            on_report = self.on_report
            sinks.append(lambda: on_report(report))
        for sink in sinks:
            try:
                sink()
            except Exception:
                logger.exception("delivering a weight-sync report failed")


_installed: CosmosRLGuard | None = None
_install_lock = threading.Lock()
_bracketed = threading.local()


def _bracketed_here() -> dict[int, CosmosGenerationPause | None]:
    """Per thread: worker id -> the pause its guarded handler entered (``None``: no pause)."""
    try:
        found: dict[int, CosmosGenerationPause | None] = _bracketed.workers
    except AttributeError:
        found = _bracketed.workers = {}
    return found


def _stream_fence(stream: Any) -> Callable[[float | None], None] | None:
    """A fence on one of cosmos's CUDA streams: poll an event recorded on it (bounded)."""
    if stream is None:
        return None

    def fence(timeout: float | None) -> None:
        limit = limit_of(timeout, 60.0)
        finished = torch.cuda.Event()
        finished.record(stream)
        wait_device_event(
            finished,
            deadline_after(limit),
            lambda: FenceTimeout(f"cosmos's stream still had weight-sync work after {limit:.1f} s"),
        )

    return fence


def _sync_mode(worker: Any) -> SyncMode:
    from cosmos_rl.rollout.worker.weight_sync import AsyncR2RSyncMode, get_async_r2r_sync_mode

    mode = get_async_r2r_sync_mode(worker)
    if mode is AsyncR2RSyncMode.GENERATION:
        return SyncMode.ASYNC_PER_GENERATION
    if mode is AsyncR2RSyncMode.INFERENCE:
        return SyncMode.ASYNC_PER_FORWARD
    return SyncMode.SYNC


def _egress_components(worker: Any) -> tuple[object, ...]:
    from .cosmos_rl_payload import live_producers

    named = (getattr(worker, n, None) for n in ("data_packer", "val_data_packer", "rollout"))
    return (*named, *live_producers())


# -- the wrappers ------------------------------------------------------------------------------


def _bracketed_call(
    guard: CosmosRLGuard,
    worker: Any,
    name: str,
    call: Callable[[], Any],
    *,
    pause: CosmosGenerationPause | None,
    mode: SyncMode,
    stream: Any,
) -> Any:
    """``call()`` inside the bracket (``pause`` if given, egress held, ``stream`` fenced);
    the report goes to the guard and the worker."""
    bracket = weight_sync_bracket(
        pause,
        _egress_components(worker),
        name=name,
        mode=mode,
        pause=pause is not None,
        hold=True,
        timeout=guard._sync_timeout(),
        fence=_stream_fence(stream),
        timeline=getattr(worker, "timeline", None),
    )
    try:
        with bracket:
            return call()
    finally:
        if not mode.pauses_generation:
            strategy = "async"
        else:
            strategy = pause.strategy if pause is not None else "none"
        guard._deliver(worker, bracket.report, strategy)


def _guarded_handler(guard: CosmosRLGuard, handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` (a registered P2R or R2R handler) inside the whole bracket."""

    @functools.wraps(handler)
    def guarded(worker: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        inside = _bracketed_here()
        if id(worker) in inside:  # nested (a handler calling another): the outer one holds all
            return handler(worker, command, *args, **kwargs)
        mode = _sync_mode(worker)
        pause = cosmos_generation_pause(worker) if mode.pauses_generation else None
        inside[id(worker)] = pause
        try:
            return _bracketed_call(
                guard,
                worker,
                f"cosmos_rl.{getattr(handler, '__name__', 'handler')}",
                lambda: handler(worker, command, *args, **kwargs),
                pause=pause,
                mode=mode,
                stream=getattr(worker, "inference_stream", None),
            )
        finally:
            del inside[id(worker)]

    guarded.__rollout_sync_wrapped__ = handler  # type: ignore[attr-defined]
    return guarded


def _guarded_transfer(
    guard: CosmosRLGuard, method: Callable[..., Any], kind: str
) -> Callable[..., Any]:
    """A weight-sync-thread transfer (buffer clone) with payload egress held, no pause.

    A P2R whose bracket fails (a hold that timed out, say) is marked failed the way cosmos
    marks its own failures (``_p2r_failed``), so no R2R broadcasts the stale buffer after it.
    """

    @functools.wraps(method)
    def guarded(thread: Any, command: Any) -> Any:
        worker = thread._worker
        try:
            return _bracketed_call(
                guard,
                worker,
                f"cosmos_rl.weight_sync_thread.{kind}",
                lambda: method(thread, command),
                pause=None,
                mode=_sync_mode(worker),
                stream=getattr(thread, "_stream", None),
            )
        except BaseException:
            if kind == "p2r":
                thread._p2r_failed = True
            raise

    return guarded


def _live_weights_pause(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.4.7's ``_paused_async_live_weights``, without its drain after the bracket's own.

    Inside a guarded handler whose bracket paused this worker's scheduler (``park`` or
    ``drain``), cosmos's drain (``scheduler.paused(wait_for_active_tasks=True)``) would wait
    for generations parked at a step boundary, or for none at all: it is skipped. After a
    ``park`` the backend's own ``paused()`` is its device fence, so ``synchronize_generation``
    is skipped too (a backend may need the loop it parked to answer it); after a ``drain`` it
    runs, as in 0.4.7. The rest is 0.4.7's: refuse after a failed write, the write fence on
    ``inference_stream``, and on failure the latch that keeps admission paused. Anywhere else
    (the scheduler started inside the handler, no guarded handler) 0.4.7's runs unchanged.
    """

    @contextmanager
    def paused_async_live_weights(worker: Any) -> Iterator[None]:
        scheduler = getattr(worker, "scheduler", None)
        pause = _bracketed_here().get(id(worker))
        if (
            scheduler is None
            or pause is None
            or pause.strategy not in ("park", "drain")
            or pause.scheduler is not scheduler
        ):
            with original(worker):
                yield
            return
        from cosmos_rl.utils import constant

        if getattr(worker, "_async_weight_write_failed", False):
            raise RuntimeError("Async live-weight state is unusable after a failure")
        timeout = constant.COSMOS_ROLLOUT_CMD_WAIT_TIMEOUT
        try:
            if pause.strategy == "drain":
                worker.rollout.synchronize_generation(timeout=timeout)
            yield
            fence = _stream_fence(getattr(worker, "inference_stream", None))
            if fence is not None:
                fence(timeout)
        except BaseException:
            worker._async_weight_write_failed = True
            scheduler.pause()
            raise

    return paused_async_live_weights


# -- install / uninstall -----------------------------------------------------------------------


def _is_wrapped(handler: Any) -> bool:
    return hasattr(handler, "__rollout_sync_wrapped__")


def _rollout_registries(root: type) -> list[Any]:
    """Every distinct command registry of ``root``'s base chain and its subclasses."""
    found: dict[int, Any] = {}
    classes = [*root.__mro__]
    pending = [root]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    for cls in classes:
        registry = cls.__dict__.get("rollout_command_handler_registry")
        if registry is not None:
            found.setdefault(id(registry), registry)
    return list(found.values())


def _patch_cosmos(guard: CosmosRLGuard) -> None:
    """Make every change :func:`install` describes, recording how to undo each in ``guard``."""
    import cosmos_rl.rollout.worker.colocated.rollout_control  # noqa: F401  its registry
    from cosmos_rl.dispatcher.command import (
        PolicyToRolloutUnicastCommand,
        RolloutCommandRegistry,
        RolloutToRolloutBroadcastCommand,
    )
    from cosmos_rl.rollout.worker import weight_sync
    from cosmos_rl.rollout.worker.rollout_control import DisaggregatedRolloutControlWorker
    from cosmos_rl.utils.payload_transport.nccl import producer as producer_module

    from .cosmos_rl_payload import HoldableNCCLPayloadProducer

    undo = guard._undo
    weight_commands = (PolicyToRolloutUnicastCommand, RolloutToRolloutBroadcastCommand)

    def patch(owner: Any, name: str, replacement: Any) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, replacement)
        undo.append(lambda: setattr(owner, name, original))

    def wrap_entry(table: dict[Any, Any], key: Any) -> None:
        original = table[key]
        wrapped = _guarded_handler(guard, original)
        table[key] = wrapped

        def restore() -> None:
            if table.get(key) is wrapped:  # not replaced since by someone else
                table[key] = original

        undo.append(restore)

    # 1. Registered P2R / R2R handlers, in every worker class's registry (the colocated worker
    # has a copy of its own), now and as they are registered later.
    for registry in _rollout_registries(DisaggregatedRolloutControlWorker):
        for table in registry.registry.values():
            for command in weight_commands:
                if command in table and not _is_wrapped(table[command]):
                    wrap_entry(table, command)
    register = RolloutCommandRegistry.__dict__["register"]

    def register_guarded(
        registry: Any, key: Any, func: Callable[..., Any], backend: str = "vllm"
    ) -> None:
        register(registry, key, func, backend)
        if key in weight_commands and not _is_wrapped(func):
            wrap_entry(registry.registry[backend], key)

    patch(RolloutCommandRegistry, "register", register_guarded)
    # 2. The weight-sync thread's transfers, 3. the live-weights drain, 4. the producer.
    thread_cls = weight_sync.WeightSyncThread
    patch(thread_cls, "_execute_p2r", _guarded_transfer(guard, thread_cls._execute_p2r, "p2r"))
    patch(thread_cls, "_execute_r2r", _guarded_transfer(guard, thread_cls._execute_r2r, "r2r"))
    worker_cls = DisaggregatedRolloutControlWorker
    patch(
        worker_cls,
        "_paused_async_live_weights",
        _live_weights_pause(worker_cls._paused_async_live_weights),
    )
    patch(producer_module, "NCCLPayloadProducer", HoldableNCCLPayloadProducer)


def _undo_all(guard: CosmosRLGuard) -> None:
    while guard._undo:
        guard._undo.pop()()


def install(
    *, timeout: float | None = None, on_report: Callable[[SyncReport], None] | None = None
) -> CosmosRLGuard:
    """Put the guard on cosmos-rl (see the module docstring).

    Call it in each rollout process before the worker runs (and before any
    ``PayloadContext.create``). A second call while installed returns the same guard.

    Args:
        timeout: seconds for each part of the bracket; ``None``: cosmos's
            ``COSMOS_ROLLOUT_CMD_WAIT_TIMEOUT``.
        on_report: called with each sync's :class:`~rollout_sync.SyncReport`.

    Raises:
        CosmosRLVersionError: cosmos-rl is missing or not :data:`SUPPORTED_VERSION`; nothing
            is changed.
        ValueError: already installed with another ``timeout`` or ``on_report``.
    """
    global _installed
    check_cosmos_rl_version()
    with _install_lock:
        if _installed is not None:
            if (timeout, on_report) != (_installed.timeout, _installed.on_report):
                raise ValueError(
                    "the cosmos-rl guard is already installed with other settings "
                    f"(timeout={_installed.timeout!r}); uninstall() first"
                )
            return _installed
        guard = CosmosRLGuard(timeout=timeout, on_report=on_report)
        try:
            _patch_cosmos(guard)
        except BaseException:
            _undo_all(guard)  # all or nothing
            raise
        _installed = guard
        return guard


def uninstall() -> None:
    """Undo :func:`install` (a no-op when not installed). Syncs already running finish guarded."""
    global _installed
    with _install_lock:
        if _installed is None:
            return
        _undo_all(_installed)
        _installed = None


@contextmanager
def installed(
    *, timeout: float | None = None, on_report: Callable[[SyncReport], None] | None = None
) -> Iterator[CosmosRLGuard]:
    """:func:`install` for the ``with`` body, :func:`uninstall` after it (also on error).

    When the guard was already installed, the body gets that guard and it stays installed.
    """
    with _install_lock:
        was_installed = _installed is not None
    guard = install(timeout=timeout, on_report=on_report)
    try:
        yield guard
    finally:
        if not was_installed:
            uninstall()
