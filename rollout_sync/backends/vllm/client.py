"""vLLM's weight-sync clients, guarded: every native update inside the package's bracket.

vLLM's trainer-side engines drive an update through a ``VLLMWeightSyncClient`` (four methods:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). vLLM never pauses for it, and its checkpoint-format engines move
every layer to the meta device at ``start_weight_update``: one forward before
``finish_weight_update`` kills the engine. :class:`GuardedWeightSyncClient` wraps any such
client and brackets every update, in this order::

    start_weight_update:   pause generation (keep mode; clear_cache from the KV policy)
                           -> hold payload egress -> inner start
    update_weights:        inner update (any number of chunks)
    finish_weight_update:  inner finish (sets the version) -> device fence
                           -> release egress -> resume generation

With ``staged=True`` (stage, then swap; the trainer engine's
``RolloutSyncTrainerInitInfo(staged=True)`` sends each update as one staged chunk) the wire runs
while the engine generates, and only the install is parked::

    start_weight_update:   hold payload egress -> inner start
    update_weights:        inner update (the workers' receive starts on threads of their own)
                           ... the trainer sends; the engine keeps stepping ...
    finish_weight_update:  pause generation -> inner finish (the install: vLLM's load of the
                           staged tensors, read-back; sets the version) -> device fence
                           -> resume generation -> release egress

A staged update that fails before its install never touched the served weights: generation
was never parked for it and goes on, on the version it served.

A failure anywhere leaves generation **parked** and the replica **torn** (``torn`` says why)
until a complete update lands; egress is released. The exception: the engine says it loaded
nothing (the ``"rollout_sync"`` engine refused the manifest), so it still serves the version it
served, and generation resumes on it. Every wait is bounded (``timeout``) and its error names
what it waited for. Each update yields a :class:`~rollout_sync.SyncReport`.

What it pauses:

* ``rollout=``: a :class:`~rollout_sync.RolloutBase`, e.g. a
  :class:`~rollout_sync.backends.vllm.VLLMAsyncBackend` whose engine the client updates; its
  own ``paused()`` parks (its KV policy applies), ``mark_weights_torn`` and
  ``commit_weight_version`` keep its bookkeeping (results' versions, refusing requests while
  torn) right; a backend serving LoRA adapters is asked, before the commit, whether vLLM's
  drop of every adapter at the end of the update lost one (``check_adapters_kept``: that
  adapter is marked torn, not the weights). Without ``rollout=`` nothing asks;
* ``pauser=``: anything with ``pause_generation(mode=, clear_cache=)`` and
  ``resume_generation()``;
* otherwise the inner client itself when it has those methods
  (:class:`AsyncLLMWeightSyncClient` does), or, for vLLM's own clients,
  :class:`HTTPGenerationPauser` (the ``/pause`` and ``/resume`` routes of a server with
  ``VLLM_SERVER_DEV_MODE=1``) and :class:`RayGenerationPauser` (the actors' methods).

Where it reads the engine's state (:class:`EngineStateSource`: ``native_transfer_state()``, the
worker extension's ``rollout_sync_native_state`` RPC) to tell a refused update from a torn one:
``engine_state=``, else ``rollout=`` or the inner client where they have it
(:class:`AsyncLLMWeightSyncClient` and :class:`LLMWeightSyncClient` do), else for vLLM's HTTP
client :class:`HTTPEngineState` (the server's ``/collective_rpc``). Every one of them needs the
engine started with the worker extension
(:class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension`); without an answer a
failed update is taken as torn, and ``torn`` says why.

:class:`AsyncLLMWeightSyncClient` is the client for an ``AsyncLLM`` in this process, on the
event loop it runs on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..._deadline import limit_of
from ...backend import KVCachePolicy, RolloutBase
from ...egress import EgressHoldReport, payload_egress_held
from ...errors import EngineCallTimeout, EngineOutOfStepError, PauseTimeout
from ...guard import DEFAULT_SYNC_TIMEOUT_S, SyncReport, device_fence
from ...sync.mode import SyncMode
from ...trace import SpanKind, Timeline
from .calls import park_engine, run_coroutine
from .plugin import ENGINE_NAME
from .worker import WORKER_EXTENSION, RolloutSyncWorkerExtension

__all__ = [
    "AsyncLLMWeightSyncClient",
    "EngineStateSource",
    "GenerationPauser",
    "GuardedWeightSyncClient",
    "HTTPEngineState",
    "HTTPGenerationPauser",
    "LLMWeightSyncClient",
    "RayGenerationPauser",
]

T = TypeVar("T")

_THREAD_SLACK_S = 5.0
"""Beyond a pause's own limit, how long its holder thread may take to report."""

_STATE_RPC = RolloutSyncWorkerExtension.rollout_sync_native_state.__name__
"""The worker extension's RPC that reports the ``"rollout_sync"`` engine's state."""

_CLOSE_RPC = RolloutSyncWorkerExtension.rollout_sync_close_update.__name__
"""The worker extension's RPC that closes update sessions a failed update left open."""


@runtime_checkable
class GenerationPauser(Protocol):
    """What :class:`GuardedWeightSyncClient` pauses when it has no ``rollout``."""

    def pause_generation(self, *, mode: str, clear_cache: bool) -> None: ...

    def resume_generation(self) -> None: ...


@runtime_checkable
class EngineStateSource(Protocol):
    """What tells :class:`GuardedWeightSyncClient` whether a failed update loaded anything.

    ``native_transfer_state()`` returns the ``"rollout_sync"`` weight-transfer engine's state
    (the dict of the worker extension's ``rollout_sync_native_state``: ``torn``, ``updates``,
    ...; over several workers one dict, torn if any worker is, ``updates`` the fewest), or
    ``None`` when the engine runs another weight-transfer backend. It raises when it cannot
    ask.
    """

    def native_transfer_state(self) -> dict[str, Any] | None: ...


OUT_OF_STEP = (
    "vLLM's multiprocess executor stops reading the other workers' answers when one worker "
    "fails an all-worker call (vLLM issue #49972, fixed upstream by PR #57846); every later "
    "all-worker call then reads a stale answer, so this engine can no longer be updated or "
    "checked: restart the engine"
)
"""What an engine with several workers is left in after a failed all-worker call."""


def state_token() -> str:
    """A fresh token for one state call (:func:`_merged_native_state` checks it came back)."""
    return uuid.uuid4().hex


def _merged_native_state(
    states: Sequence[dict[str, Any] | None], token: str | None = None
) -> dict[str, Any] | None:
    """One state for an engine's workers (``collective_rpc`` answers one per worker): the
    first worker's, torn if any worker is (its reason), ``updates`` the fewest any landed,
    ``workers`` how many answered; ``None`` if every worker runs no ``"rollout_sync"`` engine
    (or none answered).

    With ``token`` (sent with the call), an answer that does not carry it is stale: raises
    :class:`~rollout_sync.errors.EngineOutOfStepError` (a ``RuntimeError``; its message ends in
    :data:`OUT_OF_STEP`: restart the engine).
    """
    if token is not None:
        stale = [
            i
            for i, state in enumerate(states)
            if not (state is None or (isinstance(state, dict) and state.get("token") == token))
        ]
        mixed = any(state is None for state in states) and any(
            state is not None for state in states
        )
        if stale or mixed:
            which = stale or [i for i, state in enumerate(states) if state is None]
            raise EngineOutOfStepError(
                f"worker(s) {which} of {len(states)} answered the state call with an answer "
                f"to an earlier call: {OUT_OF_STEP}"
            )
    if not states or any(state is None for state in states):
        return None
    known = [state for state in states if state is not None]
    torn = next(
        (
            state["torn"] if len(known) == 1 else f"worker {i}: {state['torn']}"
            for i, state in enumerate(known)
            if state["torn"] is not None
        ),
        None,
    )
    merged = {
        **known[0],
        "torn": torn,
        "updates": min(int(state["updates"]) for state in known),
        "workers": len(known),
    }
    merged.pop("token", None)
    return merged


def _reports_native_state(vllm_config: Any) -> bool:
    """Whether an engine started with ``vllm_config`` has a ``"rollout_sync"`` state to report
    (``False``: it runs another weight-transfer backend, or none).

    Raises:
        TypeError: it runs the ``"rollout_sync"`` engine without the worker extension that
            reports its state.
    """
    transfer = vllm_config.weight_transfer_config
    if transfer is None or transfer.backend != ENGINE_NAME:
        return False
    extension = vllm_config.parallel_config.worker_extension_cls
    if extension:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        extension_cls = resolve_obj_by_qualname(extension)
        if isinstance(extension_cls, type) and issubclass(
            extension_cls, RolloutSyncWorkerExtension
        ):
            return True
    raise TypeError(
        f"the engine runs the {ENGINE_NAME!r} weight-transfer engine but its worker extension "
        f"({extension or 'none'}) cannot report that engine's state, so a guard cannot tell an "
        f"update the engine refused from a torn one: start the engine with "
        f"worker_extension_cls={WORKER_EXTENSION!r} (or a subclass of it)"
    )


# -- clients and pausers -------------------------------------------------------------------------


class AsyncLLMWeightSyncClient:
    """vLLM's client protocol (and pause, resume, version) over an ``AsyncLLM`` in this process.

    Every call runs as a coroutine on the engine's event loop and waits at most
    ``timeout_s`` seconds (:class:`~rollout_sync.errors.EngineCallTimeout`). Call it from any
    thread but the loop's own.

    Args:
        engine: the ``AsyncLLM``.
        loop: the event loop it runs on (in another thread).
        run: instead of ``loop``, a function ``run(coroutine, timeout_s, what)`` that runs a
            coroutine there and returns its result
            (:meth:`~rollout_sync.backends.vllm.VLLMAsyncBackend.run_on_loop`).
    """

    def __init__(
        self,
        engine: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        run: Callable[[Coroutine[Any, Any, Any], float, str], Any] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if run is None:
            if loop is None:
                raise ValueError("pass loop= (the engine's event loop) or run=")
            run = functools.partial(run_coroutine, loop)
        elif loop is not None:
            raise ValueError("pass loop= or run=, not both")
        self.engine = engine
        self.timeout_s = timeout_s
        self._run = run

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        result: T = self._run(coro, self.timeout_s, what)
        return result

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        self._call(self.engine.init_weight_transfer_engine(request), "init_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._call(self.engine.start_weight_update(), "start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        self._call(self.engine.update_weights(request), "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.engine.finish_weight_update(weight_version), "finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self.engine.shutdown_weight_transfer_engine(), "shutdown_weight_transfer_engine")

    def close_weight_update(self) -> None:
        """Close the update session in every worker where a failed update left it open (the
        worker extension's ``rollout_sync_close_update``; see it). Never raises in a worker."""
        self._call(self.engine.collective_rpc(_CLOSE_RPC, timeout=self.timeout_s), _CLOSE_RPC)

    def get_weight_version(self) -> str | None:
        version: str | None = self._call(self.engine.get_weight_version(), "get_weight_version")
        return version

    def update_weight_version(self, weight_version: str) -> None:
        self._call(self.engine.update_weight_version(weight_version), "update_weight_version")

    def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        """Park the engine and confirm it (:func:`~rollout_sync.backends.vllm.park_engine`,
        without vLLM's fixed 20 ms sleep): every output produced before the pause has reached
        its request when this returns."""
        self._call(park_engine(self.engine, mode, clear_cache), f"pause_generation(mode={mode!r})")

    def resume_generation(self) -> None:
        self._call(self.engine.resume_generation(), "resume_generation")

    def native_transfer_state(self) -> dict[str, Any] | None:
        """The ``"rollout_sync"`` engine's state in the engine's workers, merged
        (:class:`EngineStateSource`); ``None`` when the engine runs another weight-transfer
        backend or none.

        Raises:
            TypeError: the engine was started without the worker extension that reports it
                (``worker_extension_cls``; the message names the setting).
        """
        if not _reports_native_state(self.engine.vllm_config):
            return None
        token = state_token()
        states: list[dict[str, Any] | None] = self._call(
            self.engine.collective_rpc(_STATE_RPC, timeout=self.timeout_s, kwargs={"token": token}),
            _STATE_RPC,
        )
        return _merged_native_state(states, token)


class LLMWeightSyncClient:
    """vLLM's client protocol over an offline ``vllm.LLM`` in this process (each call an engine
    call bounded by ``timeout_s``). Generation with ``LLM`` blocks its caller, so there is
    nothing to pause; call it between ``generate`` calls (or from a step hook)."""

    def __init__(self, llm: Any, timeout_s: float = 300.0) -> None:
        self.llm = llm
        self.timeout_s = timeout_s

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self.llm.collective_rpc(method, timeout=self.timeout_s, kwargs=kwargs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._rpc("shutdown_weight_transfer_engine")

    def close_weight_update(self) -> None:
        """As :meth:`AsyncLLMWeightSyncClient.close_weight_update`, over ``LLM``."""
        self.llm.collective_rpc(_CLOSE_RPC, timeout=self.timeout_s)

    def update_weight_version(self, weight_version: str) -> None:
        self._bounded(
            lambda: self.llm.llm_engine.set_weight_version(weight_version), "set_weight_version"
        )

    def get_weight_version(self) -> str | None:
        version: str | None = self._bounded(
            self.llm.llm_engine.get_weight_version, "get_weight_version"
        )
        return version

    def native_transfer_state(self) -> dict[str, Any] | None:
        """As :meth:`AsyncLLMWeightSyncClient.native_transfer_state`, over ``LLM``."""
        if not _reports_native_state(self.llm.llm_engine.vllm_config):
            return None
        token = state_token()
        states: list[dict[str, Any] | None] = self.llm.collective_rpc(
            _STATE_RPC, timeout=self.timeout_s, kwargs={"token": token}
        )
        return _merged_native_state(states, token)

    def _bounded(self, call: Callable[[], T], what: str) -> T:
        """``call()`` on a helper thread, waited for at most ``timeout_s`` (the engine's version
        calls take no timeout of their own)."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout_sync-llm")
        try:
            return pool.submit(call).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise EngineCallTimeout(
                f"{what} did not complete within {self.timeout_s:.1f} s"
            ) from None
        finally:
            pool.shutdown(wait=False)


class HTTPGenerationPauser:
    """Pause and resume a ``vllm serve`` through its ``/pause`` and ``/resume`` routes (they
    exist with ``VLLM_SERVER_DEV_MODE=1``, like the weight-transfer routes)."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_SYNC_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        self._post("pause", {"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume_generation(self) -> None:
        self._post("resume", {})

    def _post(self, route: str, params: dict[str, str]) -> None:
        import requests

        response = requests.post(f"{self.base_url}/{route}", params=params, timeout=self.timeout)
        response.raise_for_status()


class HTTPEngineState:
    """The ``"rollout_sync"`` engine's state in a ``vllm serve``, through its
    ``/collective_rpc`` route (:class:`EngineStateSource`).

    The route exists with ``VLLM_SERVER_DEV_MODE=1``, and the worker's answer needs the server
    started with ``--worker-extension-cls`` naming
    :class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension` (or a subclass).
    """

    def __init__(self, base_url: str, timeout: float = DEFAULT_SYNC_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def native_transfer_state(self) -> dict[str, Any] | None:
        """The state (see the class); ``None`` when the server runs another weight-transfer
        backend.

        Raises:
            RuntimeError: the server did not answer with it (the message names the flags).
        """
        import requests

        response = requests.post(
            f"{self.base_url}/collective_rpc",
            json={"method": _STATE_RPC, "timeout": self.timeout},
            timeout=self.timeout,
        )
        if not response.ok:
            raise RuntimeError(
                f"{self.base_url}/collective_rpc did not report the engine's state (HTTP "
                f"{response.status_code}): start the server with VLLM_SERVER_DEV_MODE=1 and "
                f"--worker-extension-cls {WORKER_EXTENSION}"
            )
        states: list[dict[str, Any] | None] = response.json()["results"]
        return _merged_native_state(states)


class RayGenerationPauser:
    """Pause and resume vLLM engines that run as Ray actors (each call waits for all)."""

    def __init__(self, handles: Any, timeout: float = DEFAULT_SYNC_TIMEOUT_S) -> None:
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        self.timeout = timeout

    def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        import ray

        calls = [
            h.pause_generation.remote(mode=mode, clear_cache=clear_cache) for h in self.handles
        ]
        ray.get(calls, timeout=self.timeout)

    def resume_generation(self) -> None:
        import ray

        ray.get([h.resume_generation.remote() for h in self.handles], timeout=self.timeout)


def default_pauser(inner: object, timeout: float) -> GenerationPauser | None:
    """The pauser that reaches the engines ``inner`` updates, or ``None`` if none is known."""
    if isinstance(inner, GenerationPauser):
        return inner
    kind = type(inner).__name__
    if kind == "HTTPVLLMWeightSyncClient":
        return HTTPGenerationPauser(inner.base_url, getattr(inner, "timeout", timeout))  # type: ignore[attr-defined]
    if kind == "RayVLLMWeightSyncClient":
        return RayGenerationPauser(inner.handles, timeout)  # type: ignore[attr-defined]
    return None


def default_engine_state(
    inner: object, rollout: object, timeout: float
) -> Callable[[], dict[str, Any] | None] | None:
    """Where :class:`GuardedWeightSyncClient` reads the engine's state when not told: ``rollout``
    or ``inner`` if it is an :class:`EngineStateSource`, else for vLLM's HTTP client the
    server's ``/collective_rpc``; ``None`` if nowhere (vLLM's Ray client: the actors' methods
    are the user's)."""
    for source in (rollout, inner):
        if isinstance(source, EngineStateSource):
            return source.native_transfer_state
    if type(inner).__name__ == "HTTPVLLMWeightSyncClient":
        http = HTTPEngineState(inner.base_url, getattr(inner, "timeout", timeout))  # type: ignore[attr-defined]
        return http.native_transfer_state
    return None


class _HeldBracket:
    """Context managers (a backend's pause, egress holds) entered and held on a thread of their
    own, so that any thread can end them.

    vLLM's update runs across calls from different threads (``update_weights`` beside the
    trainer's send), and a pause or a hold may be bound to the thread that entered it. Held at
    most ``max_hold_s``: then ``on_expire`` runs (it marks the weights torn, so the backend
    stays parked) and everything is released.
    """

    def __init__(
        self,
        contexts: Sequence[Callable[[], AbstractContextManager[Any]]],
        *,
        limit_s: float,
        max_hold_s: float,
        on_expire: Callable[[], None],
    ) -> None:
        self._contexts = contexts
        self._limit_s = limit_s
        self._max_hold_s = max_hold_s
        self._on_expire = on_expire
        self.values: list[Any] = []
        self.expired = False
        self._entered = threading.Event()
        self._release = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hold, name="rollout_sync-bracket", daemon=True)

    def _hold(self) -> None:
        try:
            with ExitStack() as stack:
                for context in self._contexts:
                    self.values.append(stack.enter_context(context()))
                self._entered.set()
                if not self._release.wait(self._max_hold_s):
                    self.expired = True
                    self._on_expire()
        except BaseException as exc:  # handed to the thread that waits on this one
            self._error = exc
        finally:
            self._entered.set()

    def start(self) -> None:
        """Enter everything; raise what entering raised (a pause or hold that timed out)."""
        self._thread.start()
        if not self._entered.wait(self._limit_s + _THREAD_SLACK_S):
            self._release.set()
            raise PauseTimeout(
                f"generation did not park and egress was not held within {self._limit_s:.1f} s",
                operation="pause generation and hold egress",
                timeout=self._limit_s,
                sections_running=0,
            )
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        """Release everything (in reverse order); raise what releasing raised."""
        self._release.set()
        self._thread.join(self._limit_s + _THREAD_SLACK_S)
        if self._thread.is_alive():
            raise EngineCallTimeout(
                f"releasing the update's pause and egress holds took over {self._limit_s:.1f} s"
            )
        if self._error is not None:
            raise self._error


# -- the guard -----------------------------------------------------------------------------------


class GuardedWeightSyncClient:
    """Any ``VLLMWeightSyncClient``, with every update inside the bracket; see the module.

    Pass it wherever vLLM takes a client (``WeightTransferTrainerFactory.trainer_init``, or
    drive the four methods yourself). Not for concurrent updates: one is open at a time.

    Args:
        inner: the client that reaches the engine(s).
        rollout: pause this backend (see the module); else ``pauser``, else a default.
        pauser: what to pause when there is no ``rollout``.
        egress: payload senders to hold (``hold_sends``) or flush (``flush_pending_sends``)
            while the update runs.
        kv_cache_policy: with a ``pauser``: ``RECOMPUTE`` pauses with ``clear_cache=True``
            (sequences in flight continue exactly on the new weights), ``KEEP_STALE`` keeps the
            KV and prefix caches (old-weight blocks keep serving, new requests included).
        timeout: seconds for the pause, each egress hold and the fence.
        fence: called after ``finish`` with ``timeout``, before egress is released.
        timeline: records each update's body as a ``weight_sync`` span.
        on_report: called with each update's :class:`~rollout_sync.SyncReport`.
        engine_state: asked at the first start and after a failure whether the engine is
            untouched (a dict whose ``"torn"`` is ``None`` and whose ``"updates"`` did not
            change: the ``"rollout_sync"`` engine refused the update before loading
            anything); then generation resumes on the version it served. Default:
            :func:`default_engine_state` (``rollout``'s or ``inner``'s
            ``native_transfer_state``, or the HTTP server's ``/collective_rpc``); without one,
            or without an answer, every failure is taken as torn (``torn`` then says why).
        max_update_s: the longest an update may stay open (start to finish). Past it the
            update is taken as abandoned: the weights are marked torn (generation stays
            parked) and egress is released.
        staged: stage, then swap (see the module): park generation for
            ``finish_weight_update`` (the install) alone, not for the whole update. Every
            ``update_weights`` must then be a staged ``"rollout_sync"`` chunk (a dict with
            ``staged=True``: ``RolloutSyncTrainerInitInfo(staged=True)``); any other is refused
            before it reaches the engine, since it would write in place while the engine runs.

    Raises (at construction): :class:`TypeError` when nothing can be paused. (A staged
    update over an NCCL group into an engine with tensor parallelism is refused by the engine,
    at its ``update_weights``, before anything is received:
    :class:`~rollout_sync.errors.TwoCommunicatorsRefused`.)
    """

    def __init__(
        self,
        inner: Any,
        *,
        rollout: RolloutBase | None = None,
        pauser: GenerationPauser | None = None,
        egress: Sequence[object] = (),
        kv_cache_policy: KVCachePolicy = KVCachePolicy.RECOMPUTE,
        timeout: float = DEFAULT_SYNC_TIMEOUT_S,
        fence: Callable[[float | None], None] | None = device_fence,
        timeline: Timeline | None = None,
        on_report: Callable[[SyncReport], None] | None = None,
        engine_state: Callable[[], dict[str, Any] | None] | None = None,
        max_update_s: float = 600.0,
        staged: bool = False,
    ) -> None:
        self.staged = staged
        self.inner = inner
        self.rollout = rollout
        self.timeout = limit_of(timeout, DEFAULT_SYNC_TIMEOUT_S)
        self.pauser = (
            pauser
            if pauser is not None
            else (None if rollout is not None else default_pauser(inner, self.timeout))
        )
        if rollout is None and self.pauser is None:
            raise TypeError(
                f"GuardedWeightSyncClient cannot pause generation through {type(inner).__name__}: "
                "pass rollout= (a RolloutBase) or pauser= (pause_generation/resume_generation)"
            )
        self.egress = tuple(egress)
        self.engine_state = (
            engine_state
            if engine_state is not None
            else default_engine_state(inner, rollout, self.timeout)
        )
        self.kv_cache_policy = kv_cache_policy
        self.fence = fence
        self.timeline = timeline
        self.on_report = on_report
        self.max_update_s = max_update_s
        self.reports: list[SyncReport] = []
        self.torn: str | None = None
        """Why the engine must not serve (``None``: the last update landed, or none ran)."""
        self.updates = 0
        self._lock = threading.Lock()
        self._open = False
        self._paused = False
        """Whether this client paused through ``pauser`` (not resumed yet)."""
        self._held: _HeldBracket | None = None
        self._egress = EgressHoldReport()
        self._engine_updates: int | None = None
        self._state_error: str | None = None
        """Why the engine's state could not be read (at the last time it was asked)."""
        self._engine_workers = 1
        """How many workers answered the last state read that succeeded."""
        self._times: dict[str, float] = {}
        self._body_start_ns = 0

    @property
    def parked(self) -> bool:
        """Whether this client holds generation parked (during an update, or after a failure)."""
        if self.rollout is not None:
            return bool(getattr(self.rollout, "parked", self._held is not None))
        return self._paused

    # -- the protocol ------------------------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """The inner call (no pause: nothing is written)."""
        self.inner.init_weight_transfer_engine(init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.inner.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        """Park generation, hold egress, then start the update in the engine."""
        with self._lock:
            if self._open:
                raise RuntimeError(
                    "start_weight_update while an update is open: finish or abort it first"
                )
            self._open = True
            self._egress = EgressHoldReport()
            start = time.perf_counter()
            self._times = {"start": start, "parked": start, "drained": start}
            try:
                if self._engine_updates is None:
                    self._engine_updates = self._engine_update_count()
                if self.rollout is None and not self._paused and not self.staged:
                    self._pause_engine()
                self._times["parked"] = time.perf_counter()
                self._hold(pause=not self.staged)
                self._times["drained"] = time.perf_counter()
                self._body_start_ns = time.monotonic_ns()
                self.inner.start_weight_update()
            except BaseException as exc:
                self._fail(exc, "start_weight_update")
                raise

    def update_weights(self, update_info: Any) -> None:
        """One chunk, through the inner client (the update must be open)."""
        self._require_open("update_weights")
        try:
            if self.staged:
                _require_staged_chunk(update_info)
            self.inner.update_weights(update_info)
        except BaseException as exc:
            with self._lock:
                self._close_open_sessions()
                self._fail(exc, "update_weights")
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish (and version) the update, fence, release egress, resume generation."""
        self._require_open("finish_weight_update")
        with self._lock:
            failed = False
            try:
                with ExitStack() as install:
                    if self.staged:
                        self._enter_install_pause(install)
                    try:
                        body_done, fenced = self._finish_inner(weight_version)
                    except BaseException as exc:
                        # Still parked (staged: inside the install's pause): a torn engine is
                        # marked torn before the pause ends, so it never resumes.
                        failed = True
                        self._fail(exc, "finish_weight_update")
                        raise
                self._release()
            except BaseException as exc:
                if not failed:
                    self._fail(exc, "finish_weight_update")
                raise
            self.torn = None
            self.updates += 1
            if self._engine_updates is not None:
                self._engine_updates += 1  # kept here: no engine call per update to learn it
            self._open = False
            self._report(body_done, fenced, None)

    def _finish_inner(self, weight_version: str | None) -> tuple[float, float]:
        """The inner finish (a staged update's install), the fence, the version commit; when
        the body and the fence ended."""
        try:
            self.inner.finish_weight_update(weight_version)
        except BaseException:
            self._close_failed_update()
            raise
        body_done = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add_span(SpanKind.SYNC, "vllm native update", self._body_start_ns)
        if self.fence is not None:
            self.fence(self.timeout)
        fenced = time.perf_counter()
        if self.rollout is not None:
            # vLLM dropped every adapter at the end of the update and the engine side installed
            # them again: one it could not is marked torn on the backend (not the weights).
            kept = getattr(self.rollout, "check_adapters_kept", None)
            if callable(kept):
                kept()
            # Also clears torn weights left by an earlier failure (and so the backend resumes
            # when its pause ends).
            self.rollout.commit_weight_version(
                _version_number(weight_version, self.rollout.weight_version + 1)
            )
        return body_done, fenced

    def abort_weight_update(self, reason: str) -> None:
        """Give up the open update (the trainer's side failed): close vLLM's session, mark the
        weights torn, keep generation parked, release egress. A no-op with no update open."""
        with self._lock:
            if not self._open:
                return
            self._close_failed_update()
            self._fail(RuntimeError(reason), "the trainer's side")

    # -- the bracket -------------------------------------------------------------------------------

    def _enter_install_pause(self, stack: ExitStack) -> None:
        """Staged: park generation for the install. A ``rollout``'s pause is entered on this
        thread and left with ``stack``; a pauser's is ended by :meth:`_release` (or kept by a
        failure: torn). Its time goes into the update's report (``park_s``, ``stall_s``)."""
        self._times["install_asked"] = time.perf_counter()
        if self.rollout is not None:
            stack.enter_context(self.rollout.paused(self.timeout))
        elif not self._paused:
            self._pause_engine()
        self._times["install_parked"] = time.perf_counter()

    def _require_open(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(f"{what} without an open update: call start_weight_update first")

    def _pause_engine(self) -> None:
        """Pause through the pauser (no ``rollout``); on failure, a best-effort resume, since
        a pause that timed out on this side may still land in the engine."""
        assert self.pauser is not None
        try:
            self.pauser.pause_generation(mode="keep", clear_cache=self.kv_cache_policy.clear_cache)
        except BaseException as exc:
            try:
                self.pauser.resume_generation()
            except Exception:  # the pause's own error is the one to raise
                pass
            if isinstance(exc, EngineCallTimeout):
                raise PauseTimeout(
                    f"generation did not park within {self.timeout:.1f} s: {exc}",
                    operation="pause generation",
                    timeout=self.timeout,
                    sections_running=0,
                ) from exc
            raise
        self._paused = True

    def _hold(self, *, pause: bool = True) -> None:
        """The backend's pause (with ``rollout``, unless not ``pause``) and the egress holds,
        on a helper thread."""
        contexts: list[Callable[[], AbstractContextManager[Any]]] = []
        rollout = self.rollout
        if rollout is not None and pause:
            contexts.append(lambda: rollout.paused(self.timeout))
        contexts.append(lambda: payload_egress_held(*self.egress, timeout=self.timeout))
        held = _HeldBracket(
            contexts, limit_s=self.timeout, max_hold_s=self.max_update_s, on_expire=self._expire
        )
        self._held = held
        held.start()
        self._egress = held.values[-1]

    def _expire(self) -> None:
        """The update stayed open past ``max_update_s`` (on the helper thread)."""
        reason = f"the native weight update was abandoned: open over {self.max_update_s:.0f} s"
        self.torn = reason
        if self.rollout is not None:
            self.rollout.mark_weights_torn(reason)

    def _release(self) -> None:
        """Release egress and end the backend's pause (which resumes unless its weights are
        torn); resume through the pauser otherwise."""
        held, self._held = self._held, None
        if held is not None:
            held.release()
        if self.rollout is None and self._paused:
            assert self.pauser is not None
            self.pauser.resume_generation()
            self._paused = False

    def _fail(self, exc: BaseException, where: str) -> None:
        """Release egress; resume only if the engine is known untouched, else mark torn and
        keep generation parked; report (lock held; any thread)."""
        self._open = False
        try:
            if self._engine_untouched():
                self._release()
            else:
                reason = f"the native weight update failed in {where}: {type(exc).__name__}: {exc}"
                if self._state_error is not None:
                    reason += (
                        f" (taken as torn: the engine's state could not be read, "
                        f"{self._state_error})"
                    )
                    if self._engine_workers > 1 and OUT_OF_STEP not in reason:
                        reason += (
                            f"; the engine has {self._engine_workers} workers, so the failed "
                            f"call may have left it out of step: {OUT_OF_STEP}"
                        )
                self.torn = reason
                if self.rollout is not None:
                    # Torn: the backend stays parked when its pause ends, refuses new requests,
                    # and resumes when a complete update commits a version.
                    self.rollout.mark_weights_torn(reason)
                held, self._held = self._held, None
                if held is not None:
                    held.release()  # egress (and the backend's pause; it stays parked: torn)
        except Exception:  # releasing failed too; the update's own error is the one raised
            pass
        finally:
            self._engine_updates = None  # asked afresh at the next start
            self._report(None, None, exc)

    def _close_failed_update(self) -> None:
        """vLLM's worker keeps an update whose finish raised open, and refuses the next start;
        a second finish closes it (the ``"rollout_sync"`` engine does nothing more in it).
        Where the inner client can close sessions without raising in a worker
        (``close_weight_update``: several workers), that instead."""
        if self._close_open_sessions():
            return
        try:
            self.inner.finish_weight_update(None)
        except Exception:  # the update is failed either way; the first error is the one raised
            pass

    def _close_open_sessions(self) -> bool:
        """Close the update session where a failed update left it open in some workers (with
        tensor parallelism, ``update_weights`` that failed in one worker leaves it open in the
        others); ``False`` when the inner client cannot (vLLM's own clients)."""
        close = getattr(self.inner, "close_weight_update", None)
        if not callable(close):
            return False
        try:
            close()
        except Exception:  # the update is failed either way; the first error is the one raised
            pass
        return True

    def _engine_update_count(self) -> int | None:
        """How many updates the engine has landed (``None``: it cannot say). Asked at the first
        start and after a failure; counted here after each update that lands (an update by
        another trainer meanwhile only makes a later failure count as torn: the safe side)."""
        state = self._read_engine_state()
        if state is not None:
            self._engine_workers = int(state.get("workers", 1))
        return None if state is None else int(state.get("updates", -1))

    def _read_engine_state(self) -> dict[str, Any] | None:
        """The engine's state, or ``None`` (no source, another weight-transfer backend, or no
        answer: then ``_state_error`` says why)."""
        self._state_error = None
        if self.engine_state is None:
            return None
        try:
            return self.engine_state()
        except Exception as exc:  # an engine that cannot answer is not known to be untouched
            self._state_error = f"{type(exc).__name__}: {exc}"
            return None

    def _engine_untouched(self) -> bool:
        """Whether the engine says nothing was loaded since this update started (not torn, no
        update landed), so it still serves the version it served."""
        if self.torn is not None or self._engine_updates is None:
            return False
        state = self._read_engine_state()
        return (
            state is not None
            and state.get("torn") is None
            and int(state.get("updates", -1)) == self._engine_updates
        )

    def _report(
        self, body_done: float | None, fenced: float | None, error: BaseException | None
    ) -> None:
        end = time.perf_counter()
        times = self._times
        body_end = body_done if body_done is not None else end
        parked_at = times.get("install_parked")
        if self.staged:
            # Parked for the install alone (never, if the update failed before it).
            park_s = parked_at - times["install_asked"] if parked_at is not None else 0.0
            stall_s = end - parked_at if parked_at is not None else 0.0
        else:
            park_s = times["parked"] - times["start"]
            stall_s = end - times["parked"]
        report = SyncReport(
            handler="vllm native update",
            mode=SyncMode.STAGED if self.staged else SyncMode.SYNC,
            paused=not self.staged or parked_at is not None,
            egress_held=self._egress.held,
            egress_flushed=self._egress.flushed,
            park_s=park_s,
            egress_drain_s=times["drained"] - times["parked"],
            handler_s=max(0.0, body_end - times["drained"]),
            fence_s=(fenced - body_end) if fenced is not None and body_done is not None else 0.0,
            total_s=end - times["start"],
            error=None if error is None else f"{type(error).__name__}: {error}",
            stall_s=stall_s,
        )
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)


def _require_staged_chunk(update_info: Any) -> None:
    """Refuse an ``update_weights`` chunk that is not a staged ``"rollout_sync"`` one, for a
    guard that does not park for the wire (``staged=True``)."""
    chunks = update_info if isinstance(update_info, list) else [update_info]
    if not chunks or not all(isinstance(c, dict) and c.get("staged") is True for c in chunks):
        raise ValueError(
            "GuardedWeightSyncClient(staged=True) refuses an update_weights chunk that is not "
            "staged (a dict with staged=True): it would write the served weights while the "
            "engine generates. Send staged updates (the rollout_sync trainer engine with "
            "RolloutSyncTrainerInitInfo(staged=True)), or build the guard with staged=False"
        )


def _version_number(weight_version: str | None, fallback: int) -> int:
    """The integer a backend commits for vLLM's string version (``"7"`` -> 7)."""
    if weight_version is None:
        return fallback
    try:
        return int(weight_version)
    except ValueError:
        return fallback
