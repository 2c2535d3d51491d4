"""The two vLLM backends: park generation at a step boundary, write weights that really land.

* :class:`VLLMAsyncBackend` - stream generation on ``AsyncLLM``. Its asyncio loop runs on a
  thread the backend owns, so requests keep decoding while the caller's loop takes commands.
  :meth:`~VLLMAsyncBackend.paused` parks the engine with ``pause_generation(mode="keep")``:
  sequences in flight stay in flight, the engine stops between two steps, requests that arrive
  meanwhile are queued by vLLM (not lost), and ``resume_generation()`` lets all of them go on.
* :class:`VLLMBlockingBackend` - the offline ``LLM`` engine driven by :meth:`generate`, which
  blocks its caller. ``paused()`` is the base no-op (idle by construction); the step-hook case
  (commands run between two engine steps inside a ``generate`` call) is covered by the write
  itself, see the class.

**What happens to sequences in flight when the weights change** (the KV policy) is explicit:
:attr:`KVCachePolicy.RECOMPUTE` (the default) drops their KV cache at the pause, so vLLM
recomputes it with the new weights and every token after the sync is exactly what the new
weights produce from the tokens so far; :attr:`KVCachePolicy.KEEP_STALE` keeps the KV computed
with the old weights (cheaper, and the continuation is a mix of both versions).

**Weight writes** go through a worker extension
(:class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension`) and ``collective_rpc``:
tensors do not survive ``collective_rpc`` arguments, so the backend ships one safetensors blob
(or a file path). Inside the engine vLLM's in-place ``reload_weights`` loads it (this also
re-packs linear weights on the CPU build). Names, shapes and dtypes are checked against the
engine's own specs before anything is sent, and after the write every tensor is read back
through the kernels the forward uses: a write that did not land raises
:class:`WeightsNotLandedError`, never a success.

The engine does not expose writable tensors, so :meth:`served_weights` returns receive buffers
of the served names, shapes and dtypes (a transfer receives into them in place), and
:meth:`load_weights` hands them to the engine.

vLLM is imported lazily: importing this module does not import vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from typing_extensions import Self

from ...backend import KVCachePolicy, RolloutBase
from ...errors import (
    EngineCallTimeout,
    GenerationTimeout,
    ManifestRejected,
    PauseTimeout,
    WeightMismatchError,
    WeightsNotLandedError,
)
from ...trace import Span, SpanKind, Timeline
from ...weights import WeightSpec, check_weights_match, specs_of
from .calls import LoopThread, park_engine
from .config import PauseMode, VLLMEngineConfig, greedy_params, require_vllm
from .generations import VersionHistory, VLLMGeneration, VLLMRequest
from .plugin import ENGINE_NAME as NATIVE_ENGINE
from .worker import partial_load_groups

if TYPE_CHECKING:
    from .park import ParkFlag

__all__ = ["VLLMAsyncBackend", "VLLMBackendStatistics", "VLLMBlockingBackend"]

T = TypeVar("T")


@dataclass(frozen=True)
class VLLMBackendStatistics:
    initialized: bool
    parked: bool
    pauses: int
    requests_in_flight: int
    requests_finished: int
    writes: int
    last_write_ms: float
    last_verify_ms: float
    weight_version: int
    weights_torn: bool


# -- the shared part: specs, receive buffers, the verified write -------------------------------


class _VLLMBackendBase(RolloutBase):
    """Weights, versions and tracing, shared by both backends; subclasses own the engine."""

    def __init__(
        self,
        config: VLLMEngineConfig,
        *,
        kv_cache_policy: KVCachePolicy = KVCachePolicy.RECOMPUTE,
        write_method: Literal["reload", "copy"] = "reload",
        write_path: Literal["auto", "native", "rpc"] = "auto",
        verify_columns: int = 16,
        payload_transport: Literal["bytes", "file"] = "bytes",
        payload_dir: str | os.PathLike[str] | None = None,
        init_timeout: float = 600.0,
        rpc_timeout: float = 300.0,
        timeline: Timeline | None = None,
    ) -> None:
        """Configure the backend; nothing starts until :meth:`initialize` (lazily, in a sync).

        Args:
            config: the engine to start.
            kv_cache_policy: what in-flight sequences keep across a sync (see the module).
            write_method: ``"reload"`` (vLLM's in-place ``reload_weights``; right everywhere)
                or ``"copy"`` (``param.data.copy_``: only where the platform serves its
                parameters as they are; on vLLM for CPU it does not land and raises).
            write_path: how :meth:`load_weights` reaches the engine. ``"native"``: vLLM's
                native weight transfer with the ``"rollout_sync"`` engine (the engine must run
                it: ``VLLMEngineConfig.weight_transfer_config``, the default); ``"rpc"``: one
                safetensors blob through ``collective_rpc`` (the only path for
                ``write_method="copy"``); ``"auto"``: native where the engine runs it.
            verify_columns: input columns read back per weight after each write.
            payload_transport: ship the safetensors blob as bytes through ``collective_rpc``,
                or as a file in ``payload_dir`` (large models, engine on the same host).
            init_timeout, rpc_timeout: seconds for engine start-up and for each engine call.
            timeline: records pauses here, and (collected with :meth:`collect_engine_spans`)
                the engine's forward and write spans.
        """
        super().__init__()
        require_vllm()
        if write_method not in ("reload", "copy"):
            raise ValueError(f"write_method must be 'reload' or 'copy', got {write_method!r}")
        if payload_transport not in ("bytes", "file"):
            raise ValueError(
                f"payload_transport must be 'bytes' or 'file', got {payload_transport!r}"
            )
        if write_path not in ("auto", "native", "rpc"):
            raise ValueError(f"write_path must be 'auto', 'native' or 'rpc', got {write_path!r}")
        if verify_columns < 1:
            raise ValueError(f"verify_columns must be at least 1, got {verify_columns}")
        self.config = config
        self.kv_cache_policy = kv_cache_policy
        self.write_method = write_method
        self.write_path = write_path
        self.verify_columns = verify_columns
        self.payload_transport = payload_transport
        self.payload_dir = payload_dir
        self.init_timeout = init_timeout
        self.rpc_timeout = rpc_timeout
        self.timeline = timeline
        self._versions = VersionHistory()
        self._specs: dict[str, WeightSpec] = {}
        self._spec_meta: dict[str, torch.Tensor] = {}
        self._groups: dict[str, str] = {}
        self._buffers: dict[str, torch.Tensor] | None = None
        self._writes = 0
        self._last_write: Mapping[str, Any] = {}
        self._native: Any = None
        self._ids = itertools.count()
        self._requests_lock = threading.Lock()
        self._in_flight: dict[str, VLLMRequest] = {}
        self._finished = 0

    def __enter__(self) -> Self:
        """Start the engine (if it is not started yet); :meth:`shutdown` it when the block ends."""
        self.ensure_initialized()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # -- engine access, provided by the subclass ---------------------------------------------

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method`` of the worker extension on every worker; return the first result."""
        raise NotImplementedError

    def _after_write(self) -> None:
        """Called after a verified write (the blocking backend applies its KV policy here)."""

    def _check_write_allowed(self) -> None:
        """Raise if a write now would race generation (the blocking backend's thread rule)."""

    # -- set-up ------------------------------------------------------------------------------

    def _describe_engine(self) -> None:
        """Fetch the served specs from the engine; turn tracing on if a timeline is set."""
        info = self._rpc("rollout_sync_describe", timeout=self.rpc_timeout)
        if int(info["tensor_parallel_size"]) != 1:
            raise NotImplementedError(
                "the rollout_sync vLLM backend writes and verifies whole tensors: it supports "
                f"tensor_parallel_size=1, got {info['tensor_parallel_size']}"
            )
        if info["unverifiable"]:
            lines = [f"{n}: {why}" for n, why in sorted(info["unverifiable"].items())]
            raise NotImplementedError(
                "the rollout_sync vLLM backend cannot read back these checkpoint tensors "
                "from the served model, so it could not tell a write that did not land:\n  "
                + "\n  ".join(lines[:20])
            )
        specs = [
            WeightSpec(name, tuple(shape), getattr(torch, dtype))
            for name, shape, dtype in info["specs"]
        ]
        self._specs = {s.name: s for s in specs}
        self._spec_meta = {
            s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs
        }
        self._groups = dict(info["groups"])
        if self.timeline is not None:
            self.set_engine_tracing(True)

    # -- weights -----------------------------------------------------------------------------

    def weight_specs(self) -> list[WeightSpec]:
        """What the engine serves, in checkpoint format (names, shapes, dtypes)."""
        self.ensure_initialized()
        return list(self._specs.values())

    def load_groups(self) -> dict[str, str]:
        """For each served name, the engine module it loads into (``q_proj`` -> ``qkv_proj``).

        A partial write (``require_all=False``) must send whole groups.
        """
        self.ensure_initialized()
        return dict(self._groups)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        """Receive buffers of the served names, shapes and dtypes (CPU, allocated once).

        The engine's own tensors are not writable from here (and on vLLM for CPU not even in
        checkpoint layout); receive into these, then :meth:`load_weights` them.
        """
        self.ensure_initialized()
        if self._buffers is None:
            self._buffers = {
                s.name: torch.empty(s.shape, dtype=s.dtype) for s in self._specs.values()
            }
        return self._buffers

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        """Write ``weights`` into the engine, then check that they landed.

        Call inside :meth:`paused` (the guard does). Order: validate every name, shape and
        dtype against the engine's specs (and, for a subset, that each module it loads into is
        complete: vLLM rebuilds a packed module such as ``qkv_proj`` from all its parts), ship
        one safetensors blob, write it in the engine, read every tensor back.

        Raises:
            WeightMismatchError: a bad input; nothing was sent.
            WeightsNotLandedError: the engine refused the write (nothing written), or a tensor
                did not land (weights now torn; generation stays parked until a good sync).
            EngineCallTimeout: the engine did not answer within ``rpc_timeout`` (torn).
        """
        self.ensure_initialized()
        self._check_write_allowed()
        context = f"weights for {type(self).__name__}"
        check_weights_match(
            specs_of(weights), self._spec_meta, require_all=require_all, context=context
        )
        if not require_all:
            self._check_whole_groups(weights.keys(), context)
        native = self.native_writes  # raises for a write_path it cannot take: nothing sent
        self._writes += 1
        if native:
            self._native_write(weights, require_all, context)
            self._after_write()
            return
        payload, cleanup = self._encode(weights)
        try:
            report = self._rpc(
                "rollout_sync_write",
                payload,
                self.write_method,
                self.verify_columns,
                self._writes,
                timeout=self.rpc_timeout,
            )
        except BaseException as exc:
            self.mark_weights_torn(f"the engine's weight write failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            cleanup()
        self._last_write = report
        if report["refused"]:
            raise WeightsNotLandedError(
                list(report["refused"]),
                torn=False,
                context=f"{context}: the engine refused the write",
            )
        if report["problems"]:
            self.mark_weights_torn(f"{len(report['problems'])} tensor(s) did not land")
            raise WeightsNotLandedError(
                list(report["problems"]),
                torn=True,
                context=f"{context}: the {self.write_method!r} write did not land in the "
                "weights the engine computes with",
            )
        self._after_write()

    @property
    def native_writes(self) -> bool:
        """Whether :meth:`load_weights` goes through vLLM's native weight transfer (see
        ``write_path``) rather than the older safetensors blob through ``collective_rpc``."""
        runs_engine = (self.config.weight_transfer_config or {}).get("backend") == NATIVE_ENGINE
        if self.write_path == "native" and not runs_engine:
            raise ValueError(
                'write_path="native" needs the engine to run the "rollout_sync" weight-transfer '
                "engine: VLLMEngineConfig(weight_transfer_config={'backend': 'rollout_sync'})"
            )
        if self.write_path == "native" and self.write_method != "reload":
            raise ValueError(
                'write_path="native" writes through vLLM\'s reload: write_method="reload"'
            )
        return self.write_path != "rpc" and runs_engine and self.write_method == "reload"

    def _weight_sync_client(self) -> Any:
        """vLLM's client protocol over this backend's engine (no pause: the caller's)."""
        raise NotImplementedError

    def _native_write(
        self, weights: Mapping[str, torch.Tensor], require_all: bool, context: str
    ) -> None:
        """One native update: this process sends, the engine's ``"rollout_sync"`` weight-transfer
        engine receives, loads and reads back (over a gloo group of the two, on this host)."""
        from .trainer import (
            MappingSource,
            RolloutSyncTrainerEngine,
            RolloutSyncTrainerInitInfo,
        )

        try:
            if self._native is None:
                info = RolloutSyncTrainerInitInfo.on_this_host(
                    group_backend="gloo",  # the receive buffers here are CPU tensors
                    timeout_s=self.rpc_timeout,
                    verify_columns=self.verify_columns,
                )
                self._native = RolloutSyncTrainerEngine.trainer_init(
                    info, client=self._weight_sync_client(), source=MappingSource({})
                )
            stats = self._native.push(
                weights,
                version=self._writes,
                label=None,
                timeout=self.rpc_timeout,
                require_all=require_all,
            )
        except BaseException as exc:
            # Leave the group: after a failure it may be out of step; the next write joins anew.
            self._close_native()
            if isinstance(exc, (ManifestRejected, WeightMismatchError)):
                # The manifest vote failed: no rank started loading.
                raise WeightsNotLandedError(
                    [f"{type(exc).__name__}: {exc}"],
                    torn=False,
                    context=f"{context}: the engine refused the update; nothing was loaded",
                ) from exc
            torn = self._native_torn() or f"{type(exc).__name__}: {exc}"
            self.mark_weights_torn(f"the engine's native weight update failed: {torn}")
            if isinstance(exc, (TimeoutError, KeyboardInterrupt)):
                raise
            raise WeightsNotLandedError(
                [torn],
                torn=True,
                context=f"{context}: the native update did not land in the weights the engine "
                "computes with",
            ) from exc
        # The read-back's time is the engine's; asked for only when statistics are.
        self._last_write = {"write_ms": (stats.total_s * 1e3) if stats is not None else math.nan}

    def _close_native(self) -> None:
        """Leave the native transfer group (after a failure, or before the engine shuts down)."""
        native, self._native = self._native, None
        if native is not None:
            try:
                native.shutdown()
            except Exception:  # a group broken by the failure that brought us here
                pass

    def _native_torn(self) -> str | None:
        """The engine's reason its weights are torn (``None``: untouched); an engine that cannot
        answer counts as torn."""
        try:
            state = self.native_transfer_state()
        except Exception as exc:  # no answer: assume the worst
            return f"the engine did not report its state ({type(exc).__name__}: {exc})"
        if state is None:
            return "the engine runs no rollout_sync weight-transfer engine"
        torn: str | None = state.get("torn")
        return torn

    def _check_whole_groups(self, names: Any, context: str) -> None:
        problems = partial_load_groups(names, self._groups)
        if problems:
            raise WeightMismatchError(problems, context=context)

    def _encode(
        self, weights: Mapping[str, torch.Tensor]
    ) -> tuple[bytes | str, Callable[[], None]]:
        import safetensors.torch

        flat: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights.items():
            t = tensor.detach().to("cpu").contiguous()
            storage = t.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory; copy the second view of a storage.
            flat[name] = t.clone() if storage in seen else t
            seen.add(storage)
        if self.payload_transport == "bytes":
            return safetensors.torch.save(flat), lambda: None
        fd, path = tempfile.mkstemp(
            suffix=".safetensors", prefix="rollout_sync_", dir=self.payload_dir
        )
        os.close(fd)
        safetensors.torch.save_file(flat, path)
        return path, lambda: Path(path).unlink(missing_ok=True)

    def commit_weight_version(self, version: int) -> None:
        """Record a complete sync; with native writes vLLM's own label (per-token
        ``weight_versions``, ``get_weight_version()``) becomes ``str(version)`` too."""
        if self._native is not None:
            self._set_engine_version(str(version))
        self._versions.commit(version, time.monotonic())
        super().commit_weight_version(version)

    def _set_engine_version(self, label: str) -> None:
        """Set vLLM's weight-version label (the subclass reaches the engine)."""

    def native_transfer_state(self) -> dict[str, Any] | None:
        """The engine's ``"rollout_sync"`` weight-transfer engine state (``torn``: why it must
        not serve, or ``None``; ``updates``; the last transfer), or ``None`` when the engine
        runs another weight-transfer backend or none."""
        state: dict[str, Any] | None = self._rpc(
            "rollout_sync_native_state", timeout=self.rpc_timeout
        )
        return state

    # -- tracing -----------------------------------------------------------------------------

    def collect_engine_spans(self) -> list[Span]:
        """Fetch the engine's forward and write spans (since the last call); add them to the
        timeline, if any, and return them.

        They are re-attributed to this process (the original pid is kept in ``args``): the
        engine core is part of this rollout replica, so its forwards are checked against the
        syncs this process brackets. Needs a ``timeline`` at construction (tracing on).
        """
        records = self._rpc("rollout_sync_spans", True, timeout=self.rpc_timeout)
        pid = os.getpid()
        spans = [
            Span(
                r["kind"],
                r["name"],
                r["start_ns"],
                r["end_ns"],
                pid,
                r["tid"],
                {**r["args"], "engine_pid": r["pid"]},
            )
            for r in records
        ]
        if self.timeline is not None:
            self.timeline.extend(spans)
        return spans

    def set_engine_tracing(self, enabled: bool) -> None:
        """Turn the engine's forward spans on or off (on by default when a timeline is set)."""
        self._rpc("rollout_sync_trace", enabled, timeout=self.rpc_timeout)

    def engine_forward_count(self) -> int:
        """Forwards the engine ran since tracing was turned on."""
        return int(self._rpc("rollout_sync_forward_count", timeout=self.rpc_timeout))

    # -- requests bookkeeping ----------------------------------------------------------------

    def _new_request(self, prompt_token_ids: Sequence[int], request_id: str | None) -> VLLMRequest:
        rid = request_id if request_id is not None else f"rollout-sync-{next(self._ids)}"
        request = VLLMRequest(rid, prompt_token_ids, self._versions)
        with self._requests_lock:
            if rid in self._in_flight:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._in_flight[rid] = request
        return request

    def _end_request(self, request: VLLMRequest, error: str | None) -> None:
        request._complete(error)
        with self._requests_lock:
            if self._in_flight.pop(request.request_id, None) is not None:
                self._finished += 1

    @property
    def requests_in_flight(self) -> int:
        with self._requests_lock:
            return len(self._in_flight)

    def _statistics(self, parked: bool, pauses: int) -> VLLMBackendStatistics:
        with self._requests_lock:
            in_flight, finished = len(self._in_flight), self._finished
        verify_ms = self._last_write.get("verify_ms")
        if verify_ms is None and self._native is not None:
            state = self.native_transfer_state() or {}
            verify_ms = float(state.get("last_verify_s", math.nan)) * 1e3
        return VLLMBackendStatistics(
            initialized=self.is_initialized,
            parked=parked,
            pauses=pauses,
            requests_in_flight=in_flight,
            requests_finished=finished,
            writes=self._writes,
            last_write_ms=float(self._last_write.get("write_ms", math.nan)),
            last_verify_ms=math.nan if verify_ms is None else float(verify_ms),
            weight_version=self.weight_version,
            weights_torn=self.weights_torn,
        )


# -- stream generation on AsyncLLM -------------------------------------------------------------


class VLLMAsyncBackend(_VLLMBackendBase):
    """Stream generation on vLLM's ``AsyncLLM``, with a pause that parks at a step boundary.

    The engine's asyncio loop runs on a thread this backend owns; :meth:`submit` returns at
    once with a :class:`VLLMRequest`. :meth:`paused` bridges to ``pause_generation`` /
    ``resume_generation`` on that loop:

    * re-entrant on one thread; a second thread waits for the first pause to end (bounded);
    * bounded by ``timeout`` (default ``pause_timeout``): :class:`~rollout_sync.PauseTimeout`
      if the engine does not park in time (the engine is told to resume, so it is not left
      paused when the late pause lands);
    * generation resumes in a ``finally`` (also when the body raises), unless the body left
      the weights torn: then it stays parked until a complete sync commits a version;
    * a no-op before the engine exists; an engine started inside the body (lazy
      initialization in a sync) starts parked, and resumes when the pause ends.

    ``pause_mode`` picks vLLM's mode: :attr:`PauseMode.KEEP` (default) parks within one step
    and keeps sequences in flight; ``WAIT`` drains them first; ``ABORT`` ends them. The KV
    cache of kept sequences follows ``kv_cache_policy``. vLLM queues requests submitted while
    parked and admits them after the resume, under the new weights.
    """

    def __init__(
        self,
        config: VLLMEngineConfig,
        *,
        pause_mode: PauseMode = PauseMode.KEEP,
        pause_timeout: float = 60.0,
        park_flag: bool = True,
        **kwargs: Any,
    ) -> None:
        """Configure the backend; nothing starts until :meth:`initialize` (lazily, in a sync).

        ``pause_mode`` and ``pause_timeout`` (seconds) configure :meth:`paused`. ``park_flag``
        (default on) runs the engine with :func:`~rollout_sync.backends.vllm.park.parking_scheduler`
        so that a keep-mode pause lands at the first step boundary after it is asked for,
        without waiting for vLLM's message to cross the engine's loop (ignored when
        ``engine_kwargs`` name a ``scheduler_cls`` of their own; set to ``False`` on a
        started engine, pauses go by vLLM's message alone). The keyword
        arguments shared with :class:`VLLMBlockingBackend` (KV policy, write method, read-back
        columns, payload transport, timeouts, timeline) are described on the base class.
        """
        super().__init__(config, **kwargs)
        self.pause_mode = pause_mode
        self.pause_timeout = pause_timeout
        self.park_flag = park_flag
        self._flag: ParkFlag | None = None
        self._loop: LoopThread | None = None
        self._engine: Any = None
        self._pause_lock = threading.RLock()
        self._park_lock = threading.Lock()
        self._pause_depth = 0
        self._parked = False
        self._pauses = 0

    def __repr__(self) -> str:
        state = "not started" if self._engine is None else "parked" if self._parked else "running"
        return (
            f"<{type(self).__name__} {state}: {self.requests_in_flight} requests in flight, "
            f"weights v{self.weight_version}{' (torn)' if self.weights_torn else ''}>"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def initialize(self) -> None:
        """Start the loop thread and the engine; fetch its specs; park it if inside a pause."""
        require_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self.config.to_engine_kwargs()
        if self.park_flag and "scheduler_cls" not in kwargs:
            from .park import ParkFlag

            self._flag = ParkFlag()
            flagged = self._flag.engine_kwargs()
            kwargs["scheduler_cls"] = flagged["scheduler_cls"]
            kwargs["additional_config"] = {
                **dict(kwargs.get("additional_config") or {}),
                **flagged["additional_config"],
            }
        loop = LoopThread(f"{type(self).__name__}-loop")

        async def create() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        try:
            self._engine = loop.run(create(), self.init_timeout, "starting the vLLM engine")
        except BaseException:
            loop.stop(10.0)
            self._close_flag()
            raise
        self._loop = loop
        try:
            self._describe_engine()
        except BaseException:
            self.shutdown()
            raise
        with self._park_lock:
            if self._pause_depth > 0:
                self._park_locked(self.pause_timeout)

    def shutdown(self, timeout: float = 60.0) -> None:
        """End requests in flight (as failed results), shut the engine down, stop the loop."""
        self._close_native()
        engine, loop = self._engine, self._loop
        self._engine = self._loop = None
        if engine is not None and loop is not None:

            async def close() -> None:
                engine.shutdown()

            try:
                loop.run(close(), timeout, "shutting the vLLM engine down")
            finally:
                loop.stop(timeout)
        self._close_flag()
        with self._requests_lock:
            left = list(self._in_flight.values())
        for request in left:
            self._end_request(request, "the backend was shut down")
        self._parked = False

    # -- generation --------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        request_id: str | None = None,
    ) -> VLLMRequest:
        """Submit one prompt (token ids); returns at once. Greedy, 64 tokens by default.

        Raises :class:`~rollout_sync.TornWeightsError` while the weights are torn, and
        :class:`RuntimeError` before the engine is started.
        """
        engine, loop = self._engine, self._loop
        if engine is None or loop is None:
            raise RuntimeError(f"{type(self).__name__} is not started: call ensure_initialized()")
        self.check_servable()
        from vllm.inputs import TokensPrompt

        params = sampling_params if sampling_params is not None else greedy_params(64)
        request = self._new_request(prompt_token_ids, request_id)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))

        async def drive() -> None:
            error: str | None = None
            try:
                async for output in engine.generate(prompt, params, request.request_id):
                    request._update(output)
            except asyncio.CancelledError:
                error = "cancelled"
                raise
            except Exception as exc:  # noqa: BLE001 - reported on the result, never dropped
                error = f"{type(exc).__name__}: {exc}"
            finally:
                self._end_request(request, error)

        loop.submit(drive())
        return request

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Any = None,
        *,
        timeout: float = 300.0,
    ) -> list[VLLMGeneration]:
        """Submit every prompt and wait for all results (in prompt order)."""
        requests = [self.submit(p, sampling_params) for p in prompts]
        deadline = time.monotonic() + timeout
        return [r.result(max(0.0, deadline - time.monotonic())) for r in requests]

    def abort(self, request: VLLMRequest, timeout: float = 30.0) -> None:
        """Abort one request; its result ends with ``finish_reason="abort"``."""
        engine, loop = self._engine, self._loop
        if engine is None or loop is None or request.done:
            return

        async def abort() -> None:
            await engine.abort(request.request_id)

        loop.run(abort(), timeout, f"aborting request {request.request_id}")

    # -- the pause ---------------------------------------------------------------------------

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """Park the engine at a step boundary for the ``with`` body; see the class docstring."""
        limit = self.pause_timeout if timeout is None else timeout
        if not self._pause_lock.acquire(timeout=limit):
            raise PauseTimeout(
                f"generation did not park within {limit:.1f} s: another thread holds the pause "
                f"of {type(self).__name__} ({self.requests_in_flight} requests in flight)",
                operation="pause generation",
                timeout=limit,
                sections_running=self.requests_in_flight,
            )
        outer = False
        try:
            started = time.monotonic_ns()
            with self._park_lock:
                self._pause_depth += 1
                outer = self._pause_depth == 1
                if outer:
                    self._park_locked(limit)
            park_ms = (time.monotonic_ns() - started) / 1e6
            if outer and self.timeline is not None and self._parked:
                with self.timeline.span(
                    SpanKind.PAUSE, "generation paused", park_ms=park_ms, mode=self.pause_mode.value
                ):
                    yield
            else:
                yield
        finally:
            with self._park_lock:
                try:
                    if outer:
                        self._unpark_locked(limit)
                finally:
                    self._pause_depth -= 1
            self._pause_lock.release()

    # The park state (_parked, _pause_depth) changes only under _park_lock, which is never held
    # while waiting for anything but the engine's own answer (bounded). The engine can start on
    # another thread while a pause is held: initialize() parks it under the same lock, so
    # either the pause is still open and will resume it, or it has closed and nothing parks.

    def _park_locked(self, limit: float) -> None:
        engine, loop = self._engine, self._loop
        if self._parked or engine is None or loop is None:
            return
        mode, clear_cache = self.pause_mode.value, self.kv_cache_policy.clear_cache
        # Keep mode: the flag parks the engine at its next step boundary; vLLM's pause (sent
        # at once) finishes the pause and confirms it behind every earlier output.
        flag = self._flag if self.park_flag and self.pause_mode is PauseMode.KEEP else None
        if flag is not None:
            flag.raise_()
        try:
            loop.run(
                park_engine(engine, mode, clear_cache, confirm=flag is None),
                limit,
                "pause generation",
            )
        except BaseException as exc:
            if flag is not None:
                flag.lower()
            if not isinstance(exc, EngineCallTimeout):
                raise
            # The pause may still land in the engine later; the resume queued behind it makes
            # sure the engine is not left paused by a caller that has given up.
            loop.submit(engine.resume_generation())
            raise PauseTimeout(
                f"generation did not park within {limit:.1f} s ({self.requests_in_flight} "
                f"requests in flight, pause mode {mode!r}); the engine is held up between steps "
                "or the mode drains long requests",
                operation="pause generation",
                timeout=limit,
                sections_running=self.requests_in_flight,
            ) from None
        self._parked = True
        self._pauses += 1

    def _unpark_locked(self, limit: float) -> None:
        engine, loop = self._engine, self._loop
        if not self._parked or engine is None or loop is None or self.weights_torn:
            return
        if self._flag is not None:
            self._flag.lower()  # first: a raised flag would park the engine again
        loop.run(engine.resume_generation(), limit, "resume generation")
        self._parked = False

    def _close_flag(self) -> None:
        flag, self._flag = self._flag, None
        if flag is not None:
            flag.close()

    def commit_weight_version(self, version: int) -> None:
        """Record a complete sync; an engine parked for torn weights resumes (outside a pause)."""
        super().commit_weight_version(version)
        with self._park_lock:
            if self._pause_depth == 0:
                self._unpark_locked(self.pause_timeout)

    def mark_weights_torn(self, reason: str) -> None:
        """Record torn weights and park the engine (if it is not parked already)."""
        super().mark_weights_torn(reason)
        with self._park_lock:
            self._park_locked(self.pause_timeout)

    @property
    def parked(self) -> bool:
        return self._parked

    def statistics(self) -> VLLMBackendStatistics:
        return self._statistics(self._parked, self._pauses)

    # -- engine calls ------------------------------------------------------------------------

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        engine, loop = self._engine, self._loop
        if engine is None or loop is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        limit = self.rpc_timeout if timeout is None else timeout

        async def call() -> Any:
            return await engine.collective_rpc(method, timeout=limit, args=args)

        return loop.run(call(), limit, f"engine call {method}")[0]

    def run_on_loop(self, coro: Coroutine[Any, Any, T], timeout: float, operation: str) -> T:
        """Run a coroutine on the engine's loop (e.g. raw ``AsyncLLM`` calls in benchmarks)."""
        if self._loop is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._loop.run(coro, timeout, operation)

    @property
    def engine(self) -> Any:
        """The ``AsyncLLM`` (``None`` before start); use it on :meth:`run_on_loop` only."""
        return self._engine

    def weight_sync_client(self, timeout_s: float | None = None) -> Any:
        """vLLM's weight-sync client protocol over this backend's engine, on its loop (an
        :class:`~rollout_sync.backends.vllm.client.AsyncLLMWeightSyncClient`; each call
        bounded by ``timeout_s``, default ``rpc_timeout``). Wrap it in
        :class:`~rollout_sync.backends.vllm.client.GuardedWeightSyncClient` with
        ``rollout=`` this backend, so every update is paused and versioned here."""
        from .client import AsyncLLMWeightSyncClient

        self.ensure_initialized()
        return AsyncLLMWeightSyncClient(
            self._engine,
            run=self.run_on_loop,
            timeout_s=self.rpc_timeout if timeout_s is None else timeout_s,
        )

    def _weight_sync_client(self) -> Any:
        return self.weight_sync_client()

    def _set_engine_version(self, label: str) -> None:
        engine = self._engine
        if engine is not None:
            self.run_on_loop(engine.update_weight_version(label), self.rpc_timeout, "set version")


# -- blocking generation on LLM ----------------------------------------------------------------


class VLLMBlockingBackend(_VLLMBackendBase):
    """The offline ``LLM`` engine, driven step by step inside a blocking :meth:`generate`.

    ``paused()`` is the base no-op: while the caller's loop runs a weight-sync command it is
    not inside ``generate``, so nothing is generating. Weight versions are dated per request.

    **The step-hook case.** ``generate(..., step_hook=f)`` calls ``f()`` between two engine
    steps, on the generating thread; a worker that handles commands there runs a weight sync
    *inside* a generate call. No forward runs then either (same thread, between steps), but
    sequences in flight hold KV computed with the old weights. So a write made from a step hook
    applies the KV policy itself: with :attr:`KVCachePolicy.RECOMPUTE` the running sequences are
    preempted and recomputed with the new weights at the next step, exactly like the async
    backend's pause. A write from *another* thread while ``generate`` runs would race the
    engine step; it is refused with an error that names the fix (use
    :class:`VLLMAsyncBackend` for stream generation).

    Start the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for a fast start and
    plain-object ``collective_rpc`` arguments.
    """

    def __init__(self, config: VLLMEngineConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._llm: Any = None
        self._generating: int | None = None
        self._generate_lock = threading.Lock()

    def __repr__(self) -> str:
        state = (
            "not started"
            if self._llm is None
            else "generating"
            if self._generating is not None
            else "idle"
        )
        return (
            f"<{type(self).__name__} {state}: weights v{self.weight_version}"
            f"{' (torn)' if self.weights_torn else ''}>"
        )

    def initialize(self) -> None:
        require_vllm()
        from vllm import LLM

        self._llm = LLM(**self.config.to_engine_kwargs())
        try:
            self._describe_engine()
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Shut the engine core down (``LLM`` has no ``shutdown()`` of its own)."""
        self._close_native()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` (``None`` before start)."""
        return self._llm

    def weight_sync_client(self, timeout_s: float | None = None) -> Any:
        """vLLM's weight-sync client protocol over this backend's ``LLM`` (an
        :class:`~rollout_sync.backends.vllm.client.LLMWeightSyncClient`; each call bounded by
        ``timeout_s``, default ``rpc_timeout``)."""
        from .client import LLMWeightSyncClient

        self.ensure_initialized()
        return LLMWeightSyncClient(
            self._llm, timeout_s=self.rpc_timeout if timeout_s is None else timeout_s
        )

    def _weight_sync_client(self) -> Any:
        return self.weight_sync_client()

    def _set_engine_version(self, label: str) -> None:
        if self._llm is not None:
            self._llm.llm_engine.set_weight_version(label)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Any = None,
        *,
        step_hook: Callable[[], None] | None = None,
        timeout: float = 300.0,
    ) -> list[VLLMGeneration]:
        """Generate for every prompt, blocking; results in prompt order.

        ``step_hook`` runs after each engine step (see the class docstring). Raises
        :class:`~rollout_sync.errors.GenerationTimeout` after ``timeout`` seconds and
        :class:`~rollout_sync.TornWeightsError` if the weights become torn (requests in flight
        are aborted in both cases).
        """
        self.ensure_initialized()
        self.check_servable()
        if not self._generate_lock.acquire(timeout=timeout):
            raise GenerationTimeout(
                f"generate() waited {timeout:.1f} s for another generate() call "
                f"on {type(self).__name__} to finish"
            )
        from vllm.inputs import TokensPrompt

        engine = self._llm.llm_engine
        params = sampling_params if sampling_params is not None else greedy_params(64)
        requests = [self._new_request(p, None) for p in prompts]
        by_id = {r.request_id: r for r in requests}
        deadline = time.monotonic() + timeout
        self._generating = threading.get_ident()
        try:
            for request in requests:
                engine.add_request(
                    request.request_id,
                    TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                    params,
                )
            while engine.has_unfinished_requests():
                self.check_servable()
                if time.monotonic() > deadline:
                    raise GenerationTimeout(
                        f"generate() did not finish within {timeout:.1f} s "
                        f"({sum(not r.done for r in requests)} of {len(requests)} requests left)"
                    )
                for output in engine.step():
                    stepped = by_id.get(output.request_id)
                    if stepped is None:
                        continue
                    stepped._update(output)
                    if output.finished:
                        self._end_request(stepped, None)
                if step_hook is not None:
                    step_hook()
        except BaseException as exc:
            left = [r.request_id for r in requests if not r.done]
            if left:
                engine.abort_request(left)
            for request in requests:
                self._end_request(request, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._generating = None
            self._generate_lock.release()
        for request in requests:
            self._end_request(request, "the engine reported no end for this request")
        return [r.result(0) for r in requests]

    def _check_write_allowed(self) -> None:
        owner = self._generating
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError(
                f"{type(self).__name__}: load_weights() on one thread while generate() runs on "
                "another would race the engine step; write from generate()'s step_hook (between "
                "steps, on the generating thread) or between generate() calls, or use "
                "VLLMAsyncBackend for stream generation"
            )

    def _after_write(self) -> None:
        if self._generating is not None and self.kv_cache_policy is KVCachePolicy.RECOMPUTE:
            # Inside a step hook: sequences in flight hold KV of the old weights. Preempting
            # them makes the next step recompute it with the new ones.
            self._llm.llm_engine.reset_prefix_cache(reset_running_requests=True)

    def statistics(self) -> VLLMBackendStatistics:
        return self._statistics(False, 0)

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._llm is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        limit = self.rpc_timeout if timeout is None else timeout
        # In-process the call runs on this thread, between engine steps.
        return self._llm.collective_rpc(method, timeout=limit, args=args)[0]
