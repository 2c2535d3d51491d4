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

**Weight writes** take the path the write options resolve to when the backend is built
(:class:`~.write.VLLMWritePlan`; an impossible combination is a ``ValueError`` then, not at
the first write): vLLM's native weight transfer with this package's ``"rollout_sync"`` engine,
or one safetensors payload (bytes or a file path) through ``collective_rpc`` to the worker
extension (:class:`~rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension`), where
vLLM's in-place ``reload_weights`` loads it (this also re-packs linear weights on the CPU
build). Names, shapes and dtypes are checked against the engine's own specs before anything
is sent, and after the write every tensor is read back through the kernels the forward uses: a
write that did not land raises :class:`WeightsNotLandedError`, never a success.

**The parts.** What the two backends share (specs, buffers, versions, tracing, requests) is
one base class; how a call reaches the engine is an object per engine type
(:class:`~.access.AsyncLLMAccess`, :class:`~.access.LLMAccess`) the backend holds while the
engine runs; the write is a :class:`~.write.WeightWriter` of its own. ``statistics()`` reads
local state only.

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
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import torch
from typing_extensions import Self

from ...backend import KVCachePolicy, RolloutBase
from ...errors import (
    EngineCallTimeout,
    GenerationTimeout,
    PauseTimeout,
    TornWeightsError,
    WeightsNotLandedError,
)
from ...lora import LoRAConfig
from ...trace import Span, SpanKind, Timeline
from ...weights import WeightSpec
from .access import AsyncLLMAccess, EngineAccess, LLMAccess
from .calls import LoopThread, park_engine
from .config import PauseMode, VLLMEngineConfig, greedy_params, require_vllm
from .generations import VersionHistory, VLLMGeneration, VLLMRequest
from .lora import AdapterTable, ServedAdapter, encode_adapter, merged_reports, vllm_lora_shapes
from .write import ServedModel, VLLMWritePlan, WeightWriter, native_transfer_state

if TYPE_CHECKING:
    from .park import ParkFlag

__all__ = ["VLLMAsyncBackend", "VLLMBackendStatistics", "VLLMBlockingBackend"]

T = TypeVar("T")
A = TypeVar("A", bound=EngineAccess)


@dataclass(frozen=True)
class VLLMBackendStatistics:
    """A backend's running totals, read from local state (never an engine call).

    ``last_write_ms`` / ``last_verify_ms``: what the engine reported for the last write and its
    read-back, recorded when that write returned (``nan`` before the first).
    """

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


# -- the shared part: specs, receive buffers, versions, tracing --------------------------------


def _positive_seconds(option: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{option} must be a finite number of seconds > 0, got {value!r}")


class _VLLMBackendBase(RolloutBase, Generic[A]):
    """Weights, versions and tracing, shared by both backends.

    Each backend starts its engine and holds an engine access of its type (``A``:
    :class:`~.access.AsyncLLMAccess` or :class:`~.access.LLMAccess`) while it runs; the
    shared part reaches the engine only through it. Writes go through a
    :class:`~.write.WeightWriter` built from the options at construction.
    """

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

        Every option is checked here, before vLLM is imported or an engine starts: a value out
        of range, or two options that cannot work together (see :class:`~.write.VLLMWritePlan`),
        raise :class:`ValueError` naming both and what to change.

        Args:
            config: the engine to start.
            kv_cache_policy: what in-flight sequences keep across a sync (see the module).
            write_method: ``"reload"`` (vLLM's in-place ``reload_weights``; right everywhere)
                or ``"copy"`` (``param.data.copy_``: only where the platform serves its
                parameters as they are; on vLLM for CPU it does not land and raises).
            write_path: how :meth:`load_weights` reaches the engine. ``"native"``: vLLM's
                native weight transfer with the ``"rollout_sync"`` engine (the engine must run
                it: ``VLLMEngineConfig.weight_transfer_config``, the default, and
                ``write_method="reload"``); ``"rpc"``: one safetensors payload through
                ``collective_rpc`` (the only path for ``write_method="copy"``); ``"auto"``:
                native where both hold, else rpc.
            verify_columns: input columns read back per weight after each write (>= 1).
            payload_transport: the rpc path's payload: bytes through ``collective_rpc``, or a
                file in ``payload_dir`` (large models, engine on the same host). ``"file"``
                needs the rpc path.
            payload_dir: an existing directory for ``payload_transport="file"`` (``None``: the
                system's temporary directory); only with ``"file"``.
            init_timeout, rpc_timeout: seconds (finite, > 0) for engine start-up and for each
                engine call.
            timeline: records pauses here, and (collected with :meth:`collect_engine_spans`)
                the engine's forward and write spans.

        Raises:
            ValueError: an invalid option or combination of options.
            MissingDependencyError: vLLM is not importable (``VLLMUnavailableError``;
                says how to install it).
        """
        super().__init__()
        plan = VLLMWritePlan.for_engine(
            config,
            write_method=write_method,
            write_path=write_path,
            payload_transport=payload_transport,
            payload_dir=payload_dir,
            verify_columns=verify_columns,
        )
        if not isinstance(kv_cache_policy, KVCachePolicy):
            raise ValueError(
                "kv_cache_policy must be a KVCachePolicy (KVCachePolicy.RECOMPUTE or "
                f"KVCachePolicy.KEEP_STALE), got {kv_cache_policy!r}"
            )
        _positive_seconds("init_timeout", init_timeout)
        _positive_seconds("rpc_timeout", rpc_timeout)
        require_vllm()
        self.config = config
        self.kv_cache_policy = kv_cache_policy
        self.init_timeout = init_timeout
        self.rpc_timeout = rpc_timeout
        self.timeline = timeline
        self._access: A | None = None
        self._writer = WeightWriter(plan, self.mark_weights_torn)
        self._served: ServedModel | None = None
        self._versions = VersionHistory()
        self._buffers: dict[str, torch.Tensor] | None = None
        self._ids = itertools.count()
        self._requests_lock = threading.Lock()
        self._in_flight: dict[str, VLLMRequest] = {}
        self._finished = 0
        self._adapters = AdapterTable(config.lora.max_adapters) if config.lora else None
        self._lora_engine: dict[str, Any] | None = None
        """The engine's LoRA description (settings, lora dtype, shapes) once it runs."""
        self._lora_lock = threading.Lock()

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

    @property
    def write_plan(self) -> VLLMWritePlan:
        """The write options, checked together at construction, and the path they resolve to."""
        return self._writer.plan

    @property
    def native_writes(self) -> bool:
        """Whether :meth:`load_weights` goes through vLLM's native weight transfer (see
        ``write_path``) rather than the safetensors payload through ``collective_rpc``."""
        return self._writer.plan.native

    def forward_collectives(self) -> frozenset[str]:
        """The collectives the engine's forwards run on their own: with
        ``tensor_parallel_size > 1`` NCCL on CUDA (gloo on vLLM for CPU); none at 1. A receive
        that runs beside the forwards (``RolloutWorker(mode=SyncMode.STAGED)``) is refused
        over NCCL when this names NCCL (:func:`~rollout_sync.staging.check_two_communicators`).
        Read from the config: no engine call, valid before the engine starts."""
        if self.config.tensor_parallel_size <= 1:
            return frozenset()
        return frozenset({"nccl" if torch.cuda.is_available() else "gloo"})

    # -- set-up ------------------------------------------------------------------------------

    def _started(self) -> A:
        """The engine access, or :class:`RuntimeError` before start or after shutdown."""
        access = self._access
        if access is None:
            raise RuntimeError(f"{type(self).__name__} is not started: call ensure_initialized()")
        return access

    def _attach(self, access: A) -> None:
        """Take the started engine: fetch its served specs; turn tracing on if a timeline is
        set. The caller shuts the engine down if this raises."""
        self._access = access
        self._served = ServedModel.describe(access, self.rpc_timeout)
        if self.timeline is not None:
            self.set_engine_tracing(True)
        if self._adapters is not None:
            self._attach_adapters(access)

    def _detach(self) -> A | None:
        """Leave the native transfer group and drop the engine access (to shut it down)."""
        self._writer.close()
        access, self._access = self._access, None
        return access

    def _served_model(self) -> ServedModel:
        self.ensure_initialized()
        served = self._served
        if served is None:
            raise RuntimeError(f"{type(self).__name__} is not started: call ensure_initialized()")
        return served

    # -- weights -----------------------------------------------------------------------------

    def weight_specs(self) -> list[WeightSpec]:
        """What the engine serves, in checkpoint format (names, shapes, dtypes)."""
        return list(self._served_model().specs.values())

    def load_groups(self) -> dict[str, str]:
        """For each served name, the engine module it loads into (``q_proj`` -> ``qkv_proj``).

        A partial write (``require_all=False``) must send whole groups.
        """
        return dict(self._served_model().groups)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        """Receive buffers of the served names, shapes and dtypes (CPU, allocated once).

        The engine's own tensors are not writable from here (and on vLLM for CPU not even in
        checkpoint layout); receive into these, then :meth:`load_weights` them. After a write
        of other tensors (a staged sync's staging copy) lands, those are copied in here, so
        the buffers hold what the engine serves (what a staging area refreshes from).
        """
        served = self._served_model()
        if self._buffers is None:
            self._buffers = {
                s.name: torch.empty(s.shape, dtype=s.dtype) for s in served.specs.values()
            }
        return self._buffers

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        """Write ``weights`` into the engine, then check that they landed.

        Call inside :meth:`paused` (the guard does). Order: validate every name, shape and
        dtype against the engine's specs (and, for a subset, that each module it loads into is
        complete: vLLM rebuilds a packed module such as ``qkv_proj`` from all its parts), ship
        the weights along the write plan's path, write them in the engine, read every tensor
        back.

        Raises:
            WeightMismatchError: a bad input; nothing was sent.
            WeightsNotLandedError: the engine refused the write (nothing written), or a tensor
                did not land (weights now torn; generation stays parked until a good sync).
            EngineCallTimeout: the engine did not answer within ``rpc_timeout`` (torn).

        vLLM drops every adapter after a base write; the engine side installs them again in
        the same call. One it could not is marked torn (:meth:`check_adapters_kept`), not the
        weights: they landed, and their version can commit.
        """
        served = self._served_model()
        access = self._started()
        access.check_write_allowed(type(self).__name__)
        self._writer.write(
            access,
            served,
            weights,
            require_all=require_all,
            timeout=self.rpc_timeout,
            context=f"weights for {type(self).__name__}",
        )
        self._mirror(weights)
        access.after_write(self.kv_cache_policy)
        self.check_adapters_kept()

    def _mirror(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy landed ``weights`` that are not the receive buffers themselves into them."""
        buffers = self._buffers
        if buffers is None:
            return
        with torch.no_grad():
            for name, tensor in weights.items():
                buffer = buffers[name]
                if tensor.data_ptr() != buffer.data_ptr():
                    buffer.copy_(tensor)

    # -- LoRA adapters (rollout_sync.lora.SupportsLoRA) ---------------------------------------

    def _adapter_table(self) -> AdapterTable:
        table = self._adapters
        if table is None:
            raise ValueError(
                f"{type(self).__name__} serves no LoRA adapters: start it with "
                "VLLMEngineConfig(..., lora=VLLMLoRASettings(max_adapters=..., max_loras=..., "
                "max_lora_rank=...))"
            )
        return table

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every linear layer an adapter may target, by
        checkpoint module path (``"model.layers.0.self_attn.q_proj"``): the engine's own
        answer once it runs, :func:`~.lora.vllm_lora_shapes` of the model's config before."""
        self._adapter_table()
        engine = self._lora_engine
        if engine is not None:
            return {m: (int(i), int(o)) for m, (i, o) in engine["shapes"].items()}
        return vllm_lora_shapes(self.config.model)

    def adapter_names(self) -> list[str]:
        """The adapters served now (none on an engine without ``lora=``)."""
        return [] if self._adapters is None else self._adapters.names()

    def add_adapter(self, name: str, config: LoRAConfig) -> None:
        """Serve adapter ``name``: all zeros at version 0 (it changes no token until a version
        lands). No pause: no request can use it yet. Before the engine starts it is recorded
        and created in the engine when it starts; on a started engine it is created now (one
        engine call, between two steps).

        Raises:
            ValueError: the engine serves no adapters (``VLLMEngineConfig.lora``), the name is
                served already, ``max_adapters`` are served, or ``config`` does not fit: a rank
                above ``max_lora_rank``, a module that is not a LoRA layer of the model, a
                dtype other than the engine's (its LoRA dtype is the model's).
        """
        table = self._adapter_table()
        settings = self.config.lora
        assert settings is not None
        if not isinstance(config, LoRAConfig):
            raise ValueError(f"add_adapter takes a rollout_sync.lora.LoRAConfig, got {config!r}")
        if config.rank > settings.max_lora_rank:
            raise ValueError(
                f"adapter {name!r}: rank {config.rank} exceeds the engine's max_lora_rank "
                f"{settings.max_lora_rank} (VLLMLoRASettings.max_lora_rank)"
            )
        self._check_adapter_dtype(name, config)
        with self._lora_lock:
            adapter = table.add(name, config, self.lora_shapes())
            access = self._access
            if access is None:
                return
            try:
                self._install(access, adapter, adapter.tensors, context=f"adding adapter {name!r}")
            except BaseException:
                table.remove(name)
                raise

    def adapter_config(self, name: str) -> LoRAConfig:
        """The manifest adapter ``name`` was added with. Raises KeyError for an unknown name."""
        return self._adapter_table().get(name).config

    def served_adapter(self, name: str) -> Mapping[str, torch.Tensor]:
        """Host tensors of adapter ``name`` (names as :func:`~rollout_sync.lora.adapter_specs`
        gives them, CPU): the set the engine serves, copied in whenever a set lands. vLLM's
        slot is not writable from here; receive into a copy of these and :meth:`load_adapter`
        it (what a staged ``P2R(adapter=...)`` does)."""
        return self._adapter_table().get(name).tensors

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install ``tensors`` (the whole set) as adapter ``name`` and read its slot back.

        Call inside :meth:`paused` (the worker's staged install does): requests on the adapter
        then continue on the new set at the next step; vLLM steps every request in one batch,
        so base-model requests wait the same install out. Order: check every name, shape and
        dtype against the adapter's manifest; in the engine (one call, between two steps)
        build vLLM's adapter from copies, check it as vLLM checks one read from disk, replace
        the adapter of this id with it, read the slot back bit for bit. Requests submitted
        from here on carry a new ``lora_path``, so vLLM's prefix cache serves them no block of
        an earlier set.

        Raises:
            KeyError: no adapter ``name``.
            WeightMismatchError: the set does not fit the manifest (a wrong rank, a missing or
                unknown module, a wrong dtype); nothing was sent.
            WeightsNotLandedError: the engine refused the set (``torn=False``: nothing
                changed, nothing is marked torn; the adapter serves what it served), or the
                install failed part-way or its read-back differs (``torn=True``: the adapter
                alone is torn, see :meth:`check_adapter_servable`).
            EngineCallTimeout: the engine did not answer within ``rpc_timeout`` (the adapter
                is torn).

        A torn adapter: its requests in flight are aborted (their results carry the reason),
        new ones are refused (:class:`~rollout_sync.TornWeightsError`), and so is an R2R send
        of it, until a set of its own lands here; the model's weights and the other adapters
        serve on, and a weight sync does not bring it back.
        """
        table = self._adapter_table()
        adapter = table.get(name)
        adapter.config.check(tensors, self.lora_shapes(), context=f"adapter {name!r}")
        with self._lora_lock:
            access = self._access
            if access is not None:
                access.check_write_allowed(type(self).__name__)
                self._install(access, adapter, tensors, context=f"adapter {name!r}")
                access.after_write(self.kv_cache_policy)
            with torch.no_grad():
                for key, tensor in tensors.items():
                    mirror = adapter.tensors[key]
                    if tensor.data_ptr() != mirror.data_ptr():
                        mirror.copy_(tensor)

    def adapter_version(self, name: str) -> int:
        """The version of adapter ``name`` served now (0 before any landed)."""
        return self._adapter_table().get(name).version

    def commit_adapter_version(self, name: str, version: int) -> None:
        """Record that ``version`` of adapter ``name`` landed (results date their tokens by
        it). It touches neither the model's weights' state nor the adapter's tear (which only
        a set of it that lands clears: :meth:`load_adapter`)."""
        adapter = self._adapter_table().get(name)
        adapter.version = version
        adapter.history.commit(version, time.monotonic())

    def check_adapter_servable(self, name: str) -> None:
        """Raise :class:`~rollout_sync.TornWeightsError` while adapter ``name`` is torn: an
        install of it failed part-way, or the engine lost it when a base weight write dropped
        every adapter; until a set of its own lands (:meth:`load_adapter`). No engine call.

        Raises:
            KeyError: no adapter ``name``.
            TornWeightsError: it is torn (the reason says why).
        """
        torn = self._adapter_table().get(name).torn
        if torn is not None:
            raise TornWeightsError(
                f"{type(self).__name__} refuses adapter {name!r}: {torn}. A complete set of "
                "it must land first (load_adapter); a weight sync does not bring it back."
            )

    def read_adapter_slot(self, name: str) -> dict[str, torch.Tensor]:
        """What the engine computes adapter ``name`` with, read from its vLLM slot: for each
        target module ``<module>.lora_A`` ``[rank, in]`` and ``<module>.lora_B`` ``[out,
        rank]``, the latter scaled by ``alpha / rank`` as vLLM serves it (compare with
        :func:`~.lora.expected_slot` of the trainer's set). One engine call."""
        adapter = self._adapter_table().get(name)
        answer = self._started().rpc(
            "rollout_sync_lora_read", adapter.lora_id, timeout=self.rpc_timeout
        )
        if isinstance(answer, dict):
            raise RuntimeError(f"reading adapter {name!r}'s slot failed: {answer['error']}")
        import safetensors.torch

        slot = safetensors.torch.load(answer)
        r = adapter.config.rank
        out: dict[str, torch.Tensor] = {}
        shapes = self.lora_shapes()
        for module in adapter.config.target_modules:
            fan_in, fan_out = shapes[module]
            out[f"{module}.lora_A"] = slot[f"{module}.lora_A"][:r, :fan_in].clone()
            out[f"{module}.lora_B"] = slot[f"{module}.lora_B"][:fan_out, :r].clone()
        return out

    def lora_request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for a request on adapter ``name`` now (``load_inplace`` off:
        the engine holds the adapter; the path names its install, see
        :data:`~.lora.ADAPTER_PATH_SCHEME`)."""
        adapter = self._adapter_table().get(name)
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.lora_id, adapter.lora_path)

    def _check_adapter_dtype(self, name: str, config: LoRAConfig) -> None:
        engine = self._lora_engine
        served: torch.dtype | None = None
        if engine is not None:
            served = getattr(torch, engine["lora_dtype"])
        elif self.config.dtype not in ("auto", None):
            served = getattr(torch, str(self.config.dtype).removeprefix("torch."), None)
        if served is not None and config.dtype != served:
            raise ValueError(
                f"adapter {name!r}: LoRAConfig.dtype {config.dtype} differs from the engine's "
                f"LoRA dtype {served} (the model's dtype): use LoRAConfig(dtype={served})"
            )

    def _attach_adapters(self, access: A) -> None:
        """Describe the engine's LoRA layers and create every adapter recorded before it ran."""
        table = self._adapter_table()
        infos: list[dict[str, Any]] = access.rpc_all(
            "rollout_sync_lora_describe", timeout=self.rpc_timeout
        )
        errors = [f"worker {i}: {x['error']}" for i, x in enumerate(infos) if "error" in x]
        if errors:
            raise RuntimeError("the engine cannot serve adapters from memory: " + "; ".join(errors))
        self._lora_engine = infos[0]
        with self._lora_lock:
            for adapter in table:
                self._check_adapter_dtype(adapter.name, adapter.config)
                adapter.config.check(
                    adapter.tensors, self.lora_shapes(), context=f"adapter {adapter.name!r}"
                )
                self._install(
                    access, adapter, adapter.tensors, context=f"creating adapter {adapter.name!r}"
                )

    def _install(
        self,
        access: A,
        adapter: ServedAdapter,
        tensors: Mapping[str, torch.Tensor],
        *,
        context: str,
    ) -> None:
        """One engine call: install ``tensors`` as ``adapter`` and read the slot back."""
        data = encode_adapter(adapter.config, tensors)
        adapter.installs += 1  # requests from here on get a path of this install
        try:
            reports = access.rpc_all(
                "rollout_sync_lora_install",
                adapter.lora_id,
                adapter.name,
                data,
                timeout=self.rpc_timeout,
            )
        except BaseException as exc:
            self._adapter_torn(adapter, f"the engine call failed: {type(exc).__name__}: {exc}")
            raise
        report = merged_reports(reports)
        if report["refused"]:
            raise WeightsNotLandedError(
                list(report["refused"]), torn=False, context=f"{context}: the engine refused it"
            )
        if report.get("error") or report["problems"]:
            why = [str(report["error"])] if report.get("error") else list(report["problems"])
            self._adapter_torn(adapter, "; ".join(why[:3]))
            raise WeightsNotLandedError(
                why,
                torn=True,
                context=f"{context}: the install did not land in the slot the engine computes "
                f"with; adapter {adapter.name!r} is torn (the model's weights are not)",
            )
        adapter.in_engine = True
        adapter.torn = None  # its own complete set landed
        self._writer.last_write_ms = float(report.get("install_ms", math.nan))
        self._writer.last_verify_ms = float(report.get("verify_ms", math.nan))

    def _adapter_torn(self, adapter: ServedAdapter, why: str) -> None:
        """Mark ``adapter`` alone torn and abort its requests in flight: vLLM would load an
        adapter it no longer holds from the request's ``lora_path``, which is no directory (an
        error inside the engine's step). The model's weights are not marked."""
        reason = f"adapter {adapter.name!r} is not served as sent: {why}"
        with self._requests_lock:  # with _new_request's check: no request slips in between
            adapter.torn = reason
            doomed = [
                r for r in self._in_flight.values() if r.adapter == adapter.name and not r.done
            ]
        if not doomed:
            return
        try:
            self._abort_requests(doomed, f"aborted: {reason}")
        except Exception as exc:
            # They would step on the lost adapter: keep the engine parked instead (until a
            # complete weight sync; the adapter's own set does not clear this).
            if not self.weights_torn:
                self.mark_weights_torn(
                    f"{reason}; {len(doomed)} request(s) on it could not be aborted: "
                    f"{type(exc).__name__}: {exc}"
                )

    def _abort_requests(self, requests: Sequence[VLLMRequest], why: str) -> None:
        """End ``requests`` with ``why`` as their error, then abort them in the engine."""
        raise NotImplementedError

    def check_adapters_kept(self) -> list[str]:
        """After a base weight write (vLLM drops every adapter; the engine side installs them
        again in the same call): mark torn each adapter that could not be installed again, and
        return their names. The model's weights are not marked: they landed. If the engine
        cannot say, every adapter it held is marked. :meth:`load_weights` calls it; so does
        :class:`~.client.GuardedWeightSyncClient` after a native update, before it commits."""
        table = self._adapters
        access = self._access
        if table is None or access is None:
            return []
        held = [a for a in table if a.in_engine and a.torn is None]
        if not held:
            return []
        try:
            states: list[dict[str, Any]] = access.rpc_all(
                "rollout_sync_lora_state", timeout=self.rpc_timeout
            )
            lost = {n: why for state in states for n, why in state["lost"].items()}
        except Exception as exc:
            lost = {
                a.name: f"the engine did not say whether it kept it: {type(exc).__name__}: {exc}"
                for a in held
            }
        marked = []
        for adapter in held:
            why = lost.get(adapter.name)
            if why is not None:
                self._adapter_torn(adapter, f"lost in a base weight write: {why}")
                marked.append(adapter.name)
        return marked

    def weight_sync_client(self, timeout_s: float | None = None) -> Any:
        """vLLM's weight-sync client protocol over this backend's engine (starting it if
        needed): an :class:`~rollout_sync.backends.vllm.client.AsyncLLMWeightSyncClient` on
        :class:`VLLMAsyncBackend`'s loop, an
        :class:`~rollout_sync.backends.vllm.client.LLMWeightSyncClient` over
        :class:`VLLMBlockingBackend`'s ``LLM``; each call bounded by ``timeout_s`` (default
        ``rpc_timeout``). Wrap it in
        :class:`~rollout_sync.backends.vllm.client.GuardedWeightSyncClient` with ``rollout=``
        this backend, so every update is paused and versioned here."""
        self.ensure_initialized()
        limit = self.rpc_timeout if timeout_s is None else timeout_s
        return self._started().weight_sync_client(limit)

    def commit_weight_version(self, version: int) -> None:
        """Record a complete sync; with native writes vLLM's own label (per-token
        ``weight_versions``, ``get_weight_version()``) becomes ``str(version)`` too."""
        access = self._access
        if self._writer.native_open and access is not None:
            access.set_version(str(version), self.rpc_timeout)
        self._versions.commit(version, time.monotonic())
        super().commit_weight_version(version)

    def native_transfer_state(self) -> dict[str, Any] | None:
        """The engine's ``"rollout_sync"`` weight-transfer engine state (``torn``: why it must
        not serve, or ``None``; ``updates``; the last transfer), or ``None`` when the engine
        runs another weight-transfer backend or none. One engine call."""
        return native_transfer_state(self._started(), self.rpc_timeout)

    # -- tracing -----------------------------------------------------------------------------

    def collect_engine_spans(self) -> list[Span]:
        """Fetch the engine's forward and write spans (since the last call); add them to the
        timeline, if any, and return them.

        They are re-attributed to this process (the original pid is kept in ``args``): the
        engine core is part of this rollout replica, so its forwards are checked against the
        syncs this process brackets. Needs a ``timeline`` at construction (tracing on).
        """
        records = self._started().rpc("rollout_sync_spans", True, timeout=self.rpc_timeout)
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
        self._started().rpc("rollout_sync_trace", enabled, timeout=self.rpc_timeout)

    def engine_forward_count(self) -> int:
        """Forwards the engine ran since tracing was turned on."""
        count = self._started().rpc("rollout_sync_forward_count", timeout=self.rpc_timeout)
        return int(count)

    # -- requests bookkeeping ----------------------------------------------------------------

    def _new_request(
        self,
        prompt_token_ids: Sequence[int],
        request_id: str | None,
        adapter: str | None = None,
    ) -> tuple[VLLMRequest, Any]:
        """A request and its ``LoRARequest`` (``None`` on the base model). Raises
        :class:`~rollout_sync.TornWeightsError` on a torn adapter (never a request vLLM would
        try to load it from disk for)."""
        lora: Any = None
        history: VersionHistory | None = None
        served: ServedAdapter | None = None
        if adapter is not None:
            served = self._adapter_table().get(adapter)
            lora, history = self.lora_request(adapter), served.history
        rid = request_id if request_id is not None else f"rollout-sync-{next(self._ids)}"
        request = VLLMRequest(
            rid, prompt_token_ids, self._versions, adapter=adapter, adapter_versions=history
        )
        with self._requests_lock:
            if served is not None and served.torn is not None:
                self.check_adapter_servable(served.name)
            if rid in self._in_flight:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._in_flight[rid] = request
        return request, lora

    def _end_request(self, request: VLLMRequest, error: str | None) -> None:
        try:
            request._complete(error)
        finally:  # a request that could not complete still leaves the in-flight table
            with self._requests_lock:
                if self._in_flight.pop(request.request_id, None) is not None:
                    self._finished += 1

    @property
    def requests_in_flight(self) -> int:
        with self._requests_lock:
            return len(self._in_flight)

    def _statistics(self, parked: bool, pauses: int) -> VLLMBackendStatistics:
        """Local state only: no engine call (the writer recorded its numbers at write time)."""
        with self._requests_lock:
            in_flight, finished = len(self._in_flight), self._finished
        writer = self._writer
        return VLLMBackendStatistics(
            initialized=self.is_initialized,
            parked=parked,
            pauses=pauses,
            requests_in_flight=in_flight,
            requests_finished=finished,
            writes=writer.writes,
            last_write_ms=writer.last_write_ms,
            last_verify_ms=writer.last_verify_ms,
            weight_version=self.weight_version,
            weights_torn=self.weights_torn,
        )


# -- stream generation on AsyncLLM -------------------------------------------------------------


class VLLMAsyncBackend(_VLLMBackendBase[AsyncLLMAccess]):
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

        Raises:
            ValueError: ``pause_mode`` not a :class:`PauseMode`, ``pause_timeout`` not a
                finite number of seconds > 0, or an invalid shared option (the base class).
        """
        if not isinstance(pause_mode, PauseMode):
            raise ValueError(
                "pause_mode must be a PauseMode (PauseMode.KEEP, WAIT or ABORT), got "
                f"{pause_mode!r}"
            )
        _positive_seconds("pause_timeout", pause_timeout)
        super().__init__(config, **kwargs)
        self.pause_mode = pause_mode
        self.pause_timeout = pause_timeout
        self.park_flag = park_flag
        self._flag: ParkFlag | None = None
        self._pause_lock = threading.RLock()
        self._park_lock = threading.Lock()
        self._pause_depth = 0
        self._parked = False
        self._pauses = 0

    def __repr__(self) -> str:
        state = "not started" if self._access is None else "parked" if self._parked else "running"
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
            # Only the access holds the engine (shutdown() releases it): a frame of this call
            # that some traceback keeps alive must not keep the AsyncLLM alive as well.
            access = AsyncLLMAccess(
                loop.run(create(), self.init_timeout, "starting the vLLM engine"), loop
            )
        except BaseException:
            loop.stop(10.0)
            self._close_flag()
            raise
        try:
            self._attach(access)
        except BaseException:
            self.shutdown()
            raise
        with self._park_lock:
            if self._pause_depth > 0:
                self._park_locked(self.pause_timeout)

    def shutdown(self, timeout: float = 60.0) -> None:
        """End requests in flight (as failed results), shut the engine down, stop the loop."""
        access = self._detach()
        if access is not None:
            engine, loop = access.release(), access.loop

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
        adapter: str | None = None,
    ) -> VLLMRequest:
        """Submit one prompt (token ids); returns at once. Greedy, 64 tokens by default.
        ``adapter``: run it on that LoRA adapter (vLLM's ``LoRARequest``, never
        ``load_inplace``); its result dates each token by the adapter's version too.

        Raises :class:`~rollout_sync.TornWeightsError` while the weights or ``adapter`` are
        torn (:meth:`check_adapter_servable`), :class:`KeyError` for an adapter not served,
        and :class:`RuntimeError` before the engine is started.
        """
        access = self._started()
        engine, loop = access.engine, access.loop
        self.check_servable()
        from vllm.inputs import TokensPrompt

        params = sampling_params if sampling_params is not None else greedy_params(64)
        request, lora = self._new_request(prompt_token_ids, request_id, adapter)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))

        async def drive() -> None:
            error: str | None = None
            try:
                async for output in engine.generate(
                    prompt, params, request.request_id, lora_request=lora
                ):
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
        adapter: str | None = None,
    ) -> list[VLLMGeneration]:
        """Submit every prompt (on ``adapter``, if given) and wait for all results (in prompt
        order)."""
        requests = [self.submit(p, sampling_params, adapter=adapter) for p in prompts]
        deadline = time.monotonic() + timeout
        return [r.result(max(0.0, deadline - time.monotonic())) for r in requests]

    def abort(self, request: VLLMRequest, timeout: float = 30.0) -> None:
        """Abort one request; its result ends with ``finish_reason="abort"``."""
        access = self._access
        if access is None or request.done:
            return
        engine = access.engine

        async def abort() -> None:
            await engine.abort(request.request_id)

        access.run(abort(), timeout, f"aborting request {request.request_id}")

    def _abort_requests(self, requests: Sequence[VLLMRequest], why: str) -> None:
        access = self._started()
        engine, ids = access.engine, [r.request_id for r in requests]

        async def abort() -> None:
            await engine.abort(ids)

        for request in requests:  # first: the abort's own final output must not end them
            self._end_request(request, why)
        access.run(abort(), self.rpc_timeout, f"aborting {len(ids)} request(s)")

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
        access = self._access
        if self._parked or access is None:
            return
        engine, loop = access.engine, access.loop
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
        access = self._access
        if not self._parked or access is None or self.weights_torn:
            return
        if self._flag is not None:
            self._flag.lower()  # first: a raised flag would park the engine again
        access.run(access.engine.resume_generation(), limit, "resume generation")
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

    def run_on_loop(self, coro: Coroutine[Any, Any, T], timeout: float, operation: str) -> T:
        """Run a coroutine on the engine's loop (e.g. raw ``AsyncLLM`` calls in benchmarks)."""
        return self._started().run(coro, timeout, operation)

    @property
    def engine(self) -> Any:
        """The ``AsyncLLM`` (``None`` before start); use it on :meth:`run_on_loop` only."""
        access = self._access
        return None if access is None else access.engine


# -- blocking generation on LLM ----------------------------------------------------------------


class VLLMBlockingBackend(_VLLMBackendBase[LLMAccess]):
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
        self._generate_lock = threading.Lock()

    def __repr__(self) -> str:
        access = self._access
        state = (
            "not started"
            if access is None
            else "generating"
            if access.stepping is not None
            else "idle"
        )
        return (
            f"<{type(self).__name__} {state}: weights v{self.weight_version}"
            f"{' (torn)' if self.weights_torn else ''}>"
        )

    def initialize(self) -> None:
        require_vllm()
        from vllm import LLM

        access = LLMAccess(LLM(**self.config.to_engine_kwargs()))
        try:
            self._attach(access)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Shut the engine core down (``LLM`` has no ``shutdown()`` of its own)."""
        access = self._detach()
        if access is not None:
            access.llm.llm_engine.engine_core.shutdown()

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` (``None`` before start)."""
        access = self._access
        return None if access is None else access.llm

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Any = None,
        *,
        step_hook: Callable[[], None] | None = None,
        timeout: float = 300.0,
        adapter: str | None = None,
    ) -> list[VLLMGeneration]:
        """Generate for every prompt, blocking; results in prompt order. ``adapter``: every
        prompt on that LoRA adapter (see :meth:`VLLMAsyncBackend.submit`).

        ``step_hook`` runs after each engine step (see the class docstring). Raises
        :class:`~rollout_sync.errors.GenerationTimeout` after ``timeout`` seconds and
        :class:`~rollout_sync.TornWeightsError` if the weights become torn (requests in flight
        are aborted in both cases).
        """
        self.ensure_initialized()
        access = self._started()
        self.check_servable()
        if adapter is not None:
            self.check_adapter_servable(adapter)
        if not self._generate_lock.acquire(timeout=timeout):
            raise GenerationTimeout(
                f"generate() waited {timeout:.1f} s for another generate() call "
                f"on {type(self).__name__} to finish"
            )
        from vllm.inputs import TokensPrompt

        engine = access.llm.llm_engine
        params = sampling_params if sampling_params is not None else greedy_params(64)
        made: list[tuple[VLLMRequest, Any]] = []
        try:
            for prompt in prompts:
                made.append(self._new_request(prompt, None, adapter))
        except BaseException as exc:
            for request, _lora in made:
                self._end_request(request, f"{type(exc).__name__}: {exc}")
            self._generate_lock.release()
            raise
        requests = [request for request, _lora in made]
        by_id = {r.request_id: r for r in requests}
        deadline = time.monotonic() + timeout
        access.stepping = threading.get_ident()
        try:
            for request, lora in made:
                engine.add_request(
                    request.request_id,
                    TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                    params,
                    lora_request=lora,
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
            access.stepping = None
            self._generate_lock.release()
        for request in requests:
            self._end_request(request, "the engine reported no end for this request")
        return [r.result(0) for r in requests]

    def _abort_requests(self, requests: Sequence[VLLMRequest], why: str) -> None:
        # On the generating thread (a step hook) or idle: check_write_allowed refused others.
        for request in requests:
            self._end_request(request, why)
        self._started().llm.llm_engine.abort_request([r.request_id for r in requests])

    def statistics(self) -> VLLMBackendStatistics:
        return self._statistics(False, 0)
