"""The worker side of vLLM's native weight transfer, ``backend="rollout_sync"``: validated.

vLLM (0.16+) updates weights for RL through its own API: ``init_weight_transfer_engine``, then
per update ``start_weight_update``, one or more ``update_weights`` and ``finish_weight_update``,
each a ``collective_rpc`` that runs in the worker between engine steps. The engine that moves
the bytes is chosen by name. :class:`RolloutSyncWeightTransferEngine` is this package's: it
receives a :class:`~rollout_sync.transfer.WeightTransfer` (manifest first, voted on by every
rank; buckets with checksums; a commit vote) over a group of its own (gloo on CPU, NCCL on GPU,
one code path), and it does what vLLM's built-in engines do not:

* **a rejected manifest leaves the model servable.** vLLM's ``start_weight_update`` moves every
  layer to the meta device at once (the layerwise reload); this engine starts the reload only
  once the manifest has been checked here (names, shapes, dtypes against the checkpoint the
  engine loaded) and every rank voted yes. A bad manifest is refused with nothing touched.
* **no receive buffer is reused** while a layer that references it is incomplete: the reload
  keeps references to loaded tensors until a layer is whole, so every bucket arrives in a
  buffer of its own (:meth:`~rollout_sync.transfer.WeightTransfer.stream`).
* **part of a fused module is refused** (``q_proj`` without ``k_proj`` and ``v_proj``: vLLM
  would rebuild ``qkv_proj`` around uninitialized memory).
* **the load is read back.** :meth:`finish_weight_update` finalizes the reload, then reads every
  loaded tensor back through the module's own quant method (the kernel's weight, bit-exact;
  see :mod:`~rollout_sync.backends.vllm.worker`) and raises
  :class:`~rollout_sync.errors.WeightsNotLandedError` if anything did not land.
* **torn is explicit.** From the first loaded bucket until a finish that verified, the engine's
  ``torn`` says why the model must not serve; a failure leaves it set. Generation must stay
  parked meanwhile: that is the frontend's job
  (:class:`~rollout_sync.backends.vllm.client.GuardedWeightSyncClient`), since vLLM itself
  never pauses for an update.

Memory: the engine keeps, per loaded tensor, a witness for the read-back (a few sampled
columns, or a checksum), not the tensor.

**Tensor parallelism.** vLLM builds one engine per worker; each joins the transfer group as its
own rank (``rank_offset`` + its worker rank) and receives every tensor *whole* (a broadcast).
vLLM's own weight loaders, run by the layerwise reload, keep the worker's shard (``load_weights``
has no way to be handed a shard). The manifest check, the witnesses and the read-back are this
worker's: each probe reads back the rows (and, for a row-parallel layer, the input columns)
that this worker holds, located as vLLM's loaders cut them
(:func:`~rollout_sync.backends.vllm.worker.build_probe_plan`).

The trainer side is :class:`~rollout_sync.backends.vllm.trainer.RolloutSyncTrainerEngine`.
Both are registered by :func:`~rollout_sync.backends.vllm.plugin.register_engines`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...distributed import standalone_group
from ...errors import WeightMismatchError, WeightsNotLandedError
from ...trace import SpanKind, Timeline
from ...transfer import TransferConfig, TransferStats, WeightManifest, WeightTransfer
from .worker import (
    ProbePlan,
    Witness,
    build_probe_plan,
    checkpoint_specs,
    partial_load_groups,
    tensor_parallel_position,
    verify_witnesses,
    witness_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RolloutSyncInitInfo",
    "RolloutSyncUpdateInfo",
    "RolloutSyncWeightTransferEngine",
    "join_transfer_group",
]

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass
class RolloutSyncInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the transfer group (the trainer engine sends it).

    The worker joins as rank ``rank_offset`` + its own rank across data-parallel replicas; the
    trainer is rank 0 and the source. ``group_backend``: ``"gloo"`` (CPU buffers) or ``"nccl"``
    (buffers on the worker's device). ``timeout_s`` bounds the rendezvous and every collective.
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    group_backend: str = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    checksums: bool = True
    timeout_s: float = 60.0
    verify_columns: int = 16
    """Input columns read back per module after each update."""

    def __post_init__(self) -> None:
        if self.group_backend not in ("gloo", "nccl"):
            raise ValueError(f"group_backend must be 'gloo' or 'nccl', got {self.group_backend!r}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset must be in 1 .. world_size - 1 (rank 0 is the trainer), got "
                f"{self.rank_offset} for a world of {self.world_size}"
            )
        if not self.timeout_s > 0 or self.bucket_bytes < 1 or self.verify_columns < 1:
            raise ValueError(
                "timeout_s, bucket_bytes and verify_columns must be positive, got "
                f"{self.timeout_s}, {self.bucket_bytes}, {self.verify_columns}"
            )


@dataclass
class RolloutSyncUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` chunk: one whole transfer (its manifest says what it holds).

    ``allow_subset``: accept a manifest that names only part of the served weights (whole
    fused modules only); ``False`` requires every served weight.
    """

    allow_subset: bool = True
    group: str = ""
    """The transfer group the trainer sends on (``host:port`` of its rendezvous). An engine
    serves one trainer at a time: a later ``init_weight_transfer_engine`` replaces its group,
    and an update for the old one is refused at once rather than waiting out the timeout."""
    final: bool = False
    """The last chunk of its update: the engine finalizes and reads back at its end, so a load
    that did not land fails ``update_weights`` (after which vLLM's worker closes the update)
    rather than ``finish_weight_update`` (after which vLLM's worker still counts the update as
    open, and refuses the next ``start_weight_update`` until ``finish_weight_update`` is called
    again). The trainer engine sends one chunk per update, marked final."""


def join_transfer_group(
    info: RolloutSyncInitInfo, rank: int, device: torch.device
) -> tuple[Any, WeightTransfer]:
    """Join the transfer group ``info`` describes as ``rank`` (0: the trainer, the source);
    the group and a :class:`~rollout_sync.transfer.WeightTransfer` over it from rank 0, its
    buckets on ``device``. Blocks until every member joined, at most ``info.timeout_s``."""
    group = standalone_group(
        info.master_address,
        info.master_port,
        rank,
        info.world_size,
        backend=info.group_backend,
        timeout_s=info.timeout_s,
    )
    config = TransferConfig(
        bucket_bytes=info.bucket_bytes, checksums=info.checksums, timeout_s=info.timeout_s
    )
    return group, WeightTransfer(group, 0, config=config, device=device)


class RolloutSyncWeightTransferEngine(
    WeightTransferEngine[RolloutSyncInitInfo, RolloutSyncUpdateInfo]
):
    """vLLM's ``"rollout_sync"`` worker engine; see the module. Built by vLLM's factory."""

    init_info_cls = RolloutSyncInitInfo
    update_info_cls = RolloutSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.transfer: WeightTransfer | None = None
        self.group: Any = None
        self.torn: str | None = None
        """Why the model must not serve now (``None``: it serves a complete version)."""
        self.updates = 0
        self.last_stats: TransferStats | None = None
        self.last_verify_s = 0.0
        self.last_load_s = 0.0
        self.last_finalize_s = 0.0
        self.timeline: Timeline | None = None
        """Where each update's load is recorded as a ``weight_write`` span (from the start of
        the reload to the end of the read-back); set by the worker extension's tracing."""
        self._write_start_ns = 0
        self._group_id = ""
        self._verify_columns = 16
        self._plan: ProbePlan | None = None
        self._expected: dict[str, torch.Tensor] = {}
        self._reload_started = False
        self._witnesses: list[Witness] = []

    # -- the lifecycle vLLM drives ---------------------------------------------------------------

    def init_transfer_engine(self, init_info: RolloutSyncInitInfo) -> None:
        """Join the transfer group (blocks until every member has; bounded by ``timeout_s``).

        Called again (a new trainer), it leaves the previous group first."""
        self.shutdown()
        self._describe()
        parallel = self.parallel_config
        worker_rank = (
            getattr(parallel, "data_parallel_index", 0) * parallel.world_size + parallel.rank
        )
        device = self.device if init_info.group_backend == "nccl" else torch.device("cpu")
        self.group, self.transfer = join_transfer_group(
            init_info, init_info.rank_offset + worker_rank, device
        )
        self._verify_columns = init_info.verify_columns
        self._group_id = f"{init_info.master_address}:{init_info.master_port}"

    def start_weight_update(self) -> None:
        """Open an update. Touches nothing: the reload starts after the first manifest vote."""
        if self.transfer is None:
            raise RuntimeError(
                "the rollout_sync weight transfer is not initialized: call "
                "init_weight_transfer_engine first"
            )
        if self._reload_started:
            self._reset_reload()
        self._reload_started = False
        self._witnesses = []
        self.last_load_s = 0.0

    def _reset_reload(self) -> None:
        """An earlier update failed mid-load: finalize its reload (its layers stay torn until
        this update loads them), so no half-loaded layer's bookkeeping carries over."""
        try:
            self._finish_reload()
        except Exception:  # the model is torn already; the new update rewrites it
            pass

    def receive_weights(self, update_info: RolloutSyncUpdateInfo) -> None:
        """Receive one transfer and load it bucket by bucket (see the module).

        Raises what :meth:`~rollout_sync.transfer.WeightTransfer.stream` raises; after a
        failure past the manifest vote the engine is ``torn``.
        """
        transfer = self.transfer
        if transfer is None:
            raise RuntimeError(
                "the rollout_sync weight transfer is not initialized: call "
                "init_weight_transfer_engine first"
            )
        if update_info.group and update_info.group != self._group_id:
            raise RuntimeError(
                f"an update for the transfer group at {update_info.group}, but this engine "
                f"now serves the trainer of {self._group_id} (a later "
                "init_weight_transfer_engine replaced the group; one trainer at a time)"
            )
        try:
            self.last_stats = transfer.stream(
                self._expected,
                self._load,
                accept=self._accept,
                begin=self._begin,
                allow_subset=update_info.allow_subset,
            )
        except BaseException as exc:
            if self._reload_started:
                self.torn = f"an update failed mid-load: {type(exc).__name__}: {exc}"
                self._record_write(error=True)
            raise
        if update_info.final:
            self._complete()

    def finish_weight_update(self) -> None:
        """Finalize the reload, then read every loaded tensor back through its kernel (unless
        the final chunk did already; a no-op when nothing was loaded).

        Raises:
            WeightsNotLandedError: a tensor did not land; the engine stays ``torn``. vLLM's
                worker then still counts the update as open: call ``finish_weight_update``
                again (a no-op here) before the next start.
        """
        self._complete()

    def _complete(self) -> None:
        if not self._reload_started:
            return  # nothing (more) was loaded: the model serves what it served
        start = time.perf_counter()
        try:
            self._finish_reload()
        except BaseException as exc:
            self.torn = f"finishing the update failed: {type(exc).__name__}: {exc}"
            self._record_write(error=True)
            raise
        finally:
            self._reload_started = False
        self.last_finalize_s = time.perf_counter() - start
        start = time.perf_counter()
        problems = verify_witnesses(self.model, self._witnesses)
        self.last_verify_s = time.perf_counter() - start
        self._witnesses = []
        self._record_write(error=bool(problems))
        if problems:
            shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
            self.torn = f"{len(problems)} tensor(s) did not land: {shown}"
            raise WeightsNotLandedError(
                problems,
                torn=True,
                context="rollout_sync native weight update: the read-back after finish",
            )
        self.torn = None
        self.updates += 1

    def shutdown(self) -> None:
        """Leave the transfer group (the engine keeps serving)."""
        group, self.group, self.transfer = self.group, None, None
        if group is not None:
            group.shutdown()

    # -- what the frontend can ask ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Plain data for an RPC: torn or not, updates landed, the last transfer's numbers."""
        stats = self.last_stats
        return {
            "initialized": self.transfer is not None,
            "torn": self.torn,
            "updates": self.updates,
            "last_version": None if stats is None else stats.version,
            "last_mb": 0.0 if stats is None else stats.nbytes / 1e6,
            "last_transfer_s": 0.0 if stats is None else stats.total_s,
            "last_load_s": self.last_load_s,
            "last_finalize_s": self.last_finalize_s,
            "last_verify_s": self.last_verify_s,
        }

    # -- inside a transfer -----------------------------------------------------------------------

    def _describe(self) -> None:
        """What the engine serves (checkpoint specs) and how each tensor is read back.

        Read before any update, while every layer is still on its device.
        """
        if self._plan is not None:
            return
        dtype = self.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved by vLLM before the model loads
        specs = checkpoint_specs(str(self.model_config.model), dtype)
        tp_rank, tp_size = tensor_parallel_position()
        self._plan = build_probe_plan(self.model, specs, tp_rank=tp_rank, tp_size=tp_size)
        self._expected = {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (shape, dtype) in specs.items()
        }

    def _accept(self, manifest: WeightManifest) -> None:
        """This rank's objections beyond names, shapes and dtypes: tensors it could not read
        back, and parts of fused modules sent without the rest."""
        plan = self._plan
        assert plan is not None
        names = {e.name for e in manifest.entries}
        problems = [
            f"{name}: cannot be read back from the served model ({plan.unverifiable[name]})"
            for name in sorted(names)
            if name in plan.unverifiable
        ]
        problems += partial_load_groups(names, plan.groups)
        if problems:
            raise WeightMismatchError(problems, context="rollout_sync native weight update")

    def _begin(self, manifest: WeightManifest) -> None:
        """After the vote: start vLLM's layerwise reload (every layer leaves its device)."""
        if self._reload_started:
            return  # a second chunk of the same update
        self.torn = "an update is in progress (layers are on the meta device until finish)"
        self._reload_started = True
        self._write_start_ns = time.monotonic_ns()
        self._start_reload()

    def _load(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        plan = self._plan
        assert plan is not None
        start = time.perf_counter()
        seed = self.updates
        for name, tensor in zip(names, tensors, strict=True):
            self._witnesses.append(
                witness_of(name, tensor, plan, columns=self._verify_columns, seed=seed)
            )
        self._load_into_model(names, tensors)
        self.last_load_s += time.perf_counter() - start

    def _record_write(self, *, error: bool) -> None:
        if self.timeline is not None:
            self.timeline.add_span(
                SpanKind.WEIGHT_WRITE,
                f"native update #{self.updates + 1}",
                self._write_start_ns,
                method="native",
                error=error,
            )

    # -- vLLM's loading (the steps a test variant replaces to show what each one prevents) ---------

    def _start_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def _load_into_model(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Hand tensors to the model's loader; each owns its memory until the reload is done
        with it (a bucket's buffer is never reused)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        load: Any = self.model.load_weights
        with disable_mtp_completeness_check():
            load(list(zip(names, tensors, strict=True)))

    def _finish_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
