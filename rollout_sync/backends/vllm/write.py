"""The vLLM backends' write path: which way a write goes, decided once, and the write itself.

* :class:`VLLMWritePlan` - the backend's write options and the weight-transfer engine the
  engine runs, checked together when the plan is built (vLLM validates its own transfer info in
  ``__post_init__`` the same way): a combination that cannot work is a :class:`ValueError`
  naming both options and what to change, when the backend is constructed, never at the first
  write after the engine started. ``write_path="auto"`` is resolved there: the plan is frozen,
  so the path it names (:attr:`VLLMWritePlan.path`) never changes afterwards.
* :class:`ServedModel` - what the engine serves (checkpoint names, shapes, dtypes, and the load
  groups a partial write must send whole), read from the engine once it runs; every write is
  checked against it before anything is sent.
* :class:`WeightWriter` - one job: a write into a started engine along the plan's path. Check
  the input (nothing sent on a bad one), ship it (one safetensors blob through
  ``collective_rpc``, or vLLM's native weight transfer), have the engine read it back, and
  report torn weights when a write failed part-way. It keeps what the last write took, so
  the backend's ``statistics()`` reads local state only.

The engine is reached through an :class:`~.access.EngineAccess` the backend passes in.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ...errors import ManifestRejected, WeightMismatchError, WeightsNotLandedError
from ...weights import WeightSpec, check_weights_match, specs_of
from .config import VLLMEngineConfig
from .plugin import ENGINE_NAME as NATIVE_ENGINE
from .worker import partial_load_groups

if TYPE_CHECKING:
    from .access import EngineAccess
    from .trainer import RolloutSyncTrainerEngine

__all__ = ["ServedModel", "VLLMWritePlan", "WeightWriter"]

WriteMethod = Literal["reload", "copy"]
WritePath = Literal["auto", "native", "rpc"]
PayloadTransport = Literal["bytes", "file"]

_NATIVE_STATE_RPC = "rollout_sync_native_state"


@dataclass(frozen=True)
class VLLMWritePlan:
    """How ``load_weights`` reaches the engine: the write options, checked together.

    Build it with :meth:`for_engine` (the backends do, from their keyword arguments). Every
    field is checked in ``__post_init__``; a value out of range, or two options that cannot
    work together, raise :class:`ValueError` naming both and what to change. A plan that
    exists is one that can write.
    """

    weight_transfer_backend: str | None
    """The weight-transfer engine the engine runs (``VLLMEngineConfig.weight_transfer_config``'s
    ``"backend"``; ``None``: none)."""
    write_method: WriteMethod = "reload"
    """``"reload"`` (vLLM's in-place ``reload_weights``; right everywhere) or ``"copy"``
    (``param.data.copy_``: only where the platform serves its parameters as they are)."""
    write_path: WritePath = "auto"
    """``"native"``: vLLM's native weight transfer with the ``"rollout_sync"`` engine;
    ``"rpc"``: one safetensors payload through ``collective_rpc``; ``"auto"``: native where the
    engine runs that engine and ``write_method="reload"``, else rpc (see :attr:`path`)."""
    payload_transport: PayloadTransport = "bytes"
    """The rpc path's payload: bytes through ``collective_rpc``, or a file (engine on this
    host) whose path goes through it instead."""
    payload_dir: str | os.PathLike[str] | None = None
    """Where ``payload_transport="file"`` writes its files (``None``: the system's temporary
    directory)."""
    verify_columns: int = 16
    """Input columns read back per weight after each write."""

    @classmethod
    def for_engine(
        cls,
        config: VLLMEngineConfig,
        *,
        write_method: WriteMethod = "reload",
        write_path: WritePath = "auto",
        payload_transport: PayloadTransport = "bytes",
        payload_dir: str | os.PathLike[str] | None = None,
        verify_columns: int = 16,
    ) -> VLLMWritePlan:
        """The plan for an engine started with ``config``."""
        return cls(
            config.weight_transfer_backend,
            write_method=write_method,
            write_path=write_path,
            payload_transport=payload_transport,
            payload_dir=payload_dir,
            verify_columns=verify_columns,
        )

    def __post_init__(self) -> None:
        _one_of("write_method", self.write_method, ("reload", "copy"))
        _one_of("write_path", self.write_path, ("auto", "native", "rpc"))
        _one_of("payload_transport", self.payload_transport, ("bytes", "file"))
        columns = self.verify_columns
        if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
            raise ValueError(
                "verify_columns must be an int >= 1 (input columns read back per weight after "
                f"each write), got {columns!r}"
            )
        runs = self.weight_transfer_backend
        if self.write_path == "native" and runs != NATIVE_ENGINE:
            runs_text = "None" if runs is None else f"with backend {runs!r}"
            raise ValueError(
                f"write_path='native' conflicts with VLLMEngineConfig.weight_transfer_config "
                f"{runs_text}: the native path needs the engine to run the {NATIVE_ENGINE!r} "
                f"weight-transfer engine. Set weight_transfer_config={{'backend': "
                f"{NATIVE_ENGINE!r}}} (the default), or write_path='rpc' (or 'auto') to write "
                "through collective_rpc"
            )
        if self.write_path == "native" and self.write_method != "reload":
            raise ValueError(
                f"write_path='native' conflicts with write_method={self.write_method!r}: the "
                "native path writes through vLLM's reload_weights. Use write_method='reload', "
                "or write_path='rpc' (or 'auto') for a copy write"
            )
        if self.payload_transport == "file" and self.native:
            why = (
                ""
                if self.write_path == "native"
                else f", which resolves to the native path here (VLLMEngineConfig."
                f"weight_transfer_config with backend {NATIVE_ENGINE!r}, write_method='reload')"
            )
            raise ValueError(
                f"payload_transport='file' conflicts with write_path={self.write_path!r}{why}: "
                "the native path sends over a transfer group and ships no payload file. Set "
                "write_path='rpc' to ship the payload as a file through collective_rpc, or drop "
                "payload_transport (and payload_dir)"
            )
        if self.payload_dir is not None and self.payload_transport != "file":
            raise ValueError(
                f"payload_dir={os.fspath(self.payload_dir)!r} conflicts with "
                f"payload_transport={self.payload_transport!r}: the directory holds payload "
                "files only. Set payload_transport='file' (with write_path='rpc'), or drop "
                "payload_dir"
            )
        if self.payload_dir is not None and not Path(self.payload_dir).is_dir():
            raise ValueError(
                f"payload_dir={os.fspath(self.payload_dir)!r} is not an existing directory "
                "(payload_transport='file' writes each payload there): create it, or drop "
                "payload_dir for the system's temporary directory"
            )

    @property
    def path(self) -> Literal["native", "rpc"]:
        """The path every write takes: ``write_path`` with ``"auto"`` resolved."""
        if self.write_path == "auto":
            runs_native = self.weight_transfer_backend == NATIVE_ENGINE
            return "native" if runs_native and self.write_method == "reload" else "rpc"
        return "native" if self.write_path == "native" else "rpc"

    @property
    def native(self) -> bool:
        """Whether writes go through vLLM's native weight transfer (:attr:`path`)."""
        return self.path == "native"


def _one_of(option: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        names = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{option} must be {names}, got {value!r}")


@dataclass(frozen=True)
class ServedModel:
    """What a started engine serves, in checkpoint format; every write is checked against it."""

    specs: Mapping[str, WeightSpec]
    """Names, shapes and dtypes, in the engine's order."""
    groups: Mapping[str, str]
    """For each name, the engine module it loads into (``q_proj`` -> ``qkv_proj``)."""
    workers: int = 1
    """The engine's workers (its tensor-parallel ranks): each joins a native transfer."""

    @classmethod
    def describe(cls, engine: EngineAccess, timeout: float) -> ServedModel:
        """Ask the engine's worker extension, in every worker.

        Raises:
            NotImplementedError: pipeline parallelism, or checkpoint tensors the read-back
                cannot reach in some worker (a write to them could not be checked).
            RuntimeError: a worker could not describe what it serves.
        """
        infos: list[dict[str, Any]] = engine.rpc_all("rollout_sync_describe", timeout=timeout)
        errors = [f"worker {i}: {info['error']}" for i, info in enumerate(infos) if "error" in info]
        if errors:
            raise RuntimeError(
                "the engine's workers could not describe the weights they serve: "
                + "; ".join(errors)
            )
        info = infos[0]
        pipeline = max(int(i.get("pipeline_parallel_size", 1)) for i in infos)
        if pipeline != 1:
            raise NotImplementedError(
                "the rollout_sync vLLM backend supports tensor parallelism but not pipeline "
                f"parallelism (pipeline_parallel_size={pipeline}): each worker would serve "
                "only some layers"
            )
        unverifiable: dict[str, str] = {}
        for i, worker in enumerate(infos):
            for name, why in worker["unverifiable"].items():
                prefix = f"worker {i}: " if len(infos) > 1 else ""
                unverifiable.setdefault(name, prefix + why)
        if unverifiable:
            lines = [f"{n}: {why}" for n, why in sorted(unverifiable.items())]
            raise NotImplementedError(
                "the rollout_sync vLLM backend cannot read back these checkpoint tensors "
                "from the served model, so it could not tell a write that did not land:\n  "
                + "\n  ".join(lines[:20])
            )
        specs = [
            WeightSpec(name, tuple(shape), getattr(torch, dtype))
            for name, shape, dtype in info["specs"]
        ]
        return cls({s.name: s for s in specs}, dict(info["groups"]), len(infos))

    @functools.cached_property
    def _meta(self) -> dict[str, torch.Tensor]:
        """The specs as meta tensors (what :func:`check_weights_match` compares with)."""
        return {
            s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in self.specs.values()
        }

    def check(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool, context: str
    ) -> None:
        """Raise :class:`WeightMismatchError` unless ``weights`` fit: every name, shape and
        dtype, every served name unless ``require_all`` is false, and then whole load groups
        (vLLM rebuilds a fused module such as ``qkv_proj`` from all of its parts)."""
        check_weights_match(specs_of(weights), self._meta, require_all=require_all, context=context)
        if not require_all:
            problems = partial_load_groups(weights.keys(), self.groups)
            if problems:
                raise WeightMismatchError(problems, context=context)


class WeightWriter:
    """Writes into a started engine along one :class:`VLLMWritePlan`; one write at a time.

    The caller holds the pause (the guard does). ``on_torn`` is called with the reason when a
    write failed after the engine may have changed a served tensor (the backend marks its
    weights torn and parks); a write refused before anything was written is not torn.

    What the last write took is kept here (:attr:`last_write_ms`, :attr:`last_verify_ms`),
    recorded when the write returns: reading it never calls the engine.
    """

    def __init__(self, plan: VLLMWritePlan, on_torn: Callable[[str], None]) -> None:
        self.plan = plan
        self._on_torn = on_torn
        self.writes = 0
        """Writes shipped to the engine (an input refused here is not one)."""
        self.last_write_ms = math.nan
        """The engine's time for the last write (rpc: the load; native: the transfer)."""
        self.last_verify_ms = math.nan
        """The engine's time for the last write's read-back."""
        self._native: RolloutSyncTrainerEngine | None = None

    @property
    def native_open(self) -> bool:
        """Whether a native transfer group with the engine is open (from the first native
        write until :meth:`close` or a failure)."""
        return self._native is not None

    def write(
        self,
        engine: EngineAccess,
        served: ServedModel,
        weights: Mapping[str, torch.Tensor],
        *,
        require_all: bool,
        timeout: float,
        context: str,
    ) -> None:
        """Check ``weights`` against ``served``, write them, and have the engine read them back.

        Raises:
            WeightMismatchError: a bad input; nothing was sent.
            WeightsNotLandedError: the engine refused the write (nothing written), or a tensor
                did not land (``on_torn`` was called).
            EngineCallTimeout: the engine did not answer within ``timeout`` (torn).
        """
        served.check(weights, require_all=require_all, context=context)
        self.writes += 1
        if self.plan.native:
            self._write_native(engine, weights, require_all, timeout, context, served.workers)
        else:
            self._write_rpc(engine, weights, timeout, context, served.workers)

    def close(self) -> None:
        """Leave the native transfer group (after a failure, or before the engine shuts down)."""
        native, self._native = self._native, None
        if native is not None:
            try:
                native.shutdown()
            except Exception:  # a group broken by the failure that brought us here
                pass

    # -- the rpc path ----------------------------------------------------------------------------

    def _write_rpc(
        self,
        engine: EngineAccess,
        weights: Mapping[str, torch.Tensor],
        timeout: float,
        context: str,
        workers: int,
    ) -> None:
        plan = self.plan
        payload, cleanup = self._encode(weights)
        try:
            reports: list[dict[str, Any]] = engine.rpc_all(
                "rollout_sync_write",
                payload,
                plan.write_method,
                plan.verify_columns,
                self.writes,
                timeout=timeout,
            )
        except BaseException as exc:
            self._on_torn(
                f"the engine's weight write failed: {type(exc).__name__}: {exc}"
                + _out_of_step_hint(workers)
            )
            raise
        finally:
            cleanup()
        report = _merged_write_reports(reports)
        if report.get("error"):
            self._on_torn(f"the engine's weight write failed: {report['error']}")
            raise WeightsNotLandedError(
                [str(report["error"])],
                torn=True,
                context=f"{context}: the engine's loader failed part-way",
            )
        self.last_write_ms = float(report.get("write_ms", math.nan))
        self.last_verify_ms = float(report.get("verify_ms", math.nan))
        if report["refused"]:
            raise WeightsNotLandedError(
                list(report["refused"]),
                torn=False,
                context=f"{context}: the engine refused the write",
            )
        if report["problems"]:
            self._on_torn(f"{len(report['problems'])} tensor(s) did not land")
            raise WeightsNotLandedError(
                list(report["problems"]),
                torn=True,
                context=f"{context}: the {plan.write_method!r} write did not land in the "
                "weights the engine computes with",
            )

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
        if self.plan.payload_transport == "bytes":
            return safetensors.torch.save(flat), lambda: None
        fd, path = tempfile.mkstemp(
            suffix=".safetensors", prefix="rollout_sync_", dir=self.plan.payload_dir
        )
        os.close(fd)
        safetensors.torch.save_file(flat, path)
        return path, lambda: Path(path).unlink(missing_ok=True)

    # -- the native path -------------------------------------------------------------------------

    def _write_native(
        self,
        engine: EngineAccess,
        weights: Mapping[str, torch.Tensor],
        require_all: bool,
        timeout: float,
        context: str,
        workers: int,
    ) -> None:
        """One native update: this process sends, the engine's ``"rollout_sync"`` weight-transfer
        engine in each of its ``workers`` receives (every tensor whole), loads (vLLM's loader
        keeps the worker's shard) and reads back its shard (over a gloo group of this process
        and the workers, on this host)."""
        from .trainer import (
            MappingSource,
            RolloutSyncTrainerEngine,
            RolloutSyncTrainerInitInfo,
        )

        try:
            if self._native is None:
                info = RolloutSyncTrainerInitInfo.on_this_host(
                    world_size=1 + workers,  # this process (the sender) and every worker
                    group_backend="gloo",  # the receive buffers here are CPU tensors
                    timeout_s=timeout,
                    verify_columns=self.plan.verify_columns,
                )
                self._native = RolloutSyncTrainerEngine.trainer_init(
                    info,
                    client=engine.weight_sync_client(timeout),
                    source=MappingSource({}),
                )
            stats = self._native.push(
                weights,
                version=self.writes,
                label=None,
                timeout=timeout,
                require_all=require_all,
            )
            # The read-back ran in the engine; its time is asked for now, with the write, so
            # that statistics never have to. An engine that cannot answer right after an
            # update is taken as torn, as after any failure below.
            state = native_transfer_state(engine, timeout)
        except BaseException as exc:
            # Leave the group: after a failure it may be out of step; the next write joins anew.
            self.close()
            if isinstance(exc, (ManifestRejected, WeightMismatchError)):
                # The manifest vote failed: no rank started loading.
                raise WeightsNotLandedError(
                    [f"{type(exc).__name__}: {exc}"],
                    torn=False,
                    context=f"{context}: the engine refused the update; nothing was loaded",
                ) from exc
            torn = _native_torn(engine, timeout, workers) or f"{type(exc).__name__}: {exc}"
            self._on_torn(f"the engine's native weight update failed: {torn}")
            if isinstance(exc, (TimeoutError, KeyboardInterrupt)):
                raise
            raise WeightsNotLandedError(
                [torn],
                torn=True,
                context=f"{context}: the native update did not land in the weights the engine "
                "computes with",
            ) from exc
        self.last_write_ms = stats.total_s * 1e3 if stats is not None else math.nan
        verify_s = None if state is None else state.get("last_verify_s")
        self.last_verify_ms = math.nan if verify_s is None else float(verify_s) * 1e3


def native_transfer_state(engine: EngineAccess, timeout: float) -> dict[str, Any] | None:
    """The engine's ``"rollout_sync"`` weight-transfer engine state, merged over its workers
    (``torn``: why it must not serve, or ``None``; ``updates``; ``workers``; the last
    transfer), or ``None`` when the engine runs another weight-transfer backend or none.

    Raises:
        EngineOutOfStepError: a worker's answer was stale (vLLM issue #49972): restart the
            engine.
    """
    from .client import _merged_native_state, state_token

    token = state_token()
    states: list[dict[str, Any] | None] = engine.rpc_all(_NATIVE_STATE_RPC, token, timeout=timeout)
    return _merged_native_state(states, token)


def _out_of_step_hint(workers: int) -> str:
    """What to add to a failed all-worker call's error on an engine of ``workers`` workers."""
    if workers <= 1:
        return ""
    from .client import OUT_OF_STEP

    return f" (the engine has {workers} workers: {OUT_OF_STEP})"


def _merged_write_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``rollout_sync_write`` report for every worker's: refused or failing if any is
    (each line naming its worker when there are several), the slowest worker's times."""
    if len(reports) == 1:
        return reports[0]

    def lines(key: str) -> list[str]:
        return [f"worker {i}: {line}" for i, r in enumerate(reports) for line in r.get(key, [])]

    errors = [f"worker {i}: {r['error']}" for i, r in enumerate(reports) if r.get("error")]
    return {
        "written": any(r.get("written") for r in reports),
        "refused": lines("refused"),
        "problems": lines("problems"),
        "error": "; ".join(errors) or None,
        "write_ms": _slowest(r.get("write_ms") for r in reports),
        "verify_ms": _slowest(r.get("verify_ms") for r in reports),
    }


def _slowest(times: Iterable[object]) -> float:
    known = [float(t) for t in times if isinstance(t, (int, float)) and not math.isnan(t)]
    return max(known) if known else math.nan


def _native_torn(engine: EngineAccess, timeout: float, workers: int = 1) -> str | None:
    """The engine's reason its weights are torn (``None``: untouched); an engine that cannot
    answer counts as torn."""
    try:
        state = native_transfer_state(engine, timeout)
    except Exception as exc:  # no answer: assume the worst
        hint = "" if "restart the engine" in str(exc) else _out_of_step_hint(workers)
        return f"the engine did not report its state ({type(exc).__name__}: {exc}){hint}"
    if state is None:
        return "the engine runs no rollout_sync weight-transfer engine"
    torn: str | None = state.get("torn")
    return torn
