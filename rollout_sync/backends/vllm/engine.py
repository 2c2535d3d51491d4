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

**Staged updates** (``RolloutSyncUpdateInfo(staged=True)``: stage, then swap). The wire does
not need the engine parked; only the load does. A staged ``update_weights`` starts the receive
on a thread of the worker's own and returns at once, so the engine keeps stepping while the
bytes arrive: the whole transfer (manifest vote, buckets with checksums, commit vote) lands in
staging buffers (one copy of the weights, host memory on gloo, the device on NCCL; each bucket
in a buffer of its own), and each tensor's read-back witness is taken there too. Nothing of the
served model is touched. :meth:`~RolloutSyncWeightTransferEngine.finish_weight_update` is the
install, the one call to park generation for: it waits for the receive, then runs vLLM's
layerwise reload over the staged tensors, finalizes and reads back. A receive that failed (or
was discarded, :meth:`~RolloutSyncWeightTransferEngine.discard_staged`) is never installed: the
served weights and version stay as they were, and ``torn`` stays ``None``. Under tensor
parallelism with an NCCL group a staged receive would run beside forwards that do their own
NCCL collectives: refused (:class:`~rollout_sync.errors.TwoCommunicatorsRefused`).

**Delta syncs** (``RolloutSyncInitInfo(delta_host_copy=True)``; docs/delta.md). vLLM for CPU
repacks and replaces its linear weights after loading, so a delta cannot be applied to what it
serves. With the option on, the engine keeps a :class:`HostCopy`: the served weights on the
host, in the dtype the trainer sends, refreshed from the tensors every whole update hands the
loader (no read of vLLM's weights), holding the version last committed, and a
:class:`~rollout_sync.transfer.delta_sync.DigestCache` of it. A delta on that version is
received packed, checked and proven against the host copy before anything is loaded, then
applied to it; the whole tensors of every changed name (and the unchanged parts of their fused
modules, from the host copy) go through vLLM's layerwise reload and the read-back as a whole
update's do: the delta saves wire bytes, not the load. Without the option, with no complete
host copy yet, while torn, or on another base, the engine votes for the whole version, which
the trainer then sends at once in the same transfer. A delta refused or unproven loads
nothing (not torn, host copy untouched); a load that fails part-way is torn as a whole
update's is, and the host copy is dropped (the next sync goes whole). A staged delta stages
the packed delta alone and rebuilds at the install.

The trainer side is :class:`~rollout_sync.backends.vllm.trainer.RolloutSyncTrainerEngine`.
Both are registered by :func:`~rollout_sync.backends.vllm.plugin.register_engines`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...distributed import standalone_group
from ...errors import (
    TwoCommunicatorsRefused,
    WeightMismatchError,
    WeightsNotLandedError,
    WeightTransferError,
    WeightTransferTimeout,
)
from ...trace import SpanKind, Timeline
from ...transfer import TransferConfig, TransferStats, WeightManifest, WeightTransfer
from ...transfer.delta_sync import DeltaTarget, ReceivedDelta, SyncKind
from .host_copy import DeltaLoad, FusedParts, HostCopy
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
    "DEFAULT_RECEIVE_AHEAD",
    "HostCopy",
    "RolloutSyncInitInfo",
    "RolloutSyncUpdateInfo",
    "RolloutSyncWeightTransferEngine",
    "StagedReceive",
    "join_transfer_group",
]

DEFAULT_BUCKET_BYTES = 8 << 20
"""Buckets of 8 MiB: small enough that vLLM loads the first layers while later ones are on the
wire, large enough that a bucket's collectives and checksum cost little beside its bytes
(benchmarks/vllm_native.py: on the 96.5 MB model an in-place update took about 310 ms with
32 MiB buckets, 258 ms with 8 MiB and 260-280 ms with 4 MiB)."""
DEFAULT_RECEIVE_AHEAD = 1
"""One bucket on the wire while vLLM loads the one before: on a 2-core host more buckets ahead
made the in-place update no faster (the wire and vLLM's load compete for the same cores;
benchmarks/vllm_native.py, docs/vllm.md). Raise it where the wire does not need the cores
the load uses (NCCL), at one more receive buffer held per bucket."""


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
    delta_host_copy: bool = False
    """Keep a :class:`HostCopy` of the served weights (one copy of them in host memory, in
    the dtype the trainer sends), so that a delta sync can be taken (see the module); without
    it every delta is answered with a vote for the whole version."""
    receive_ahead: int = DEFAULT_RECEIVE_AHEAD
    """In place: buckets on the wire while vLLM loads the one that arrived (each holds a
    receive buffer), so the wire runs on beside the load."""

    def __post_init__(self) -> None:
        if self.group_backend not in ("gloo", "nccl"):
            raise ValueError(f"group_backend must be 'gloo' or 'nccl', got {self.group_backend!r}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset must be in 1 .. world_size - 1 (rank 0 is the trainer), got "
                f"{self.rank_offset} for a world of {self.world_size}"
            )
        if (
            not self.timeout_s > 0
            or self.bucket_bytes < 1
            or self.verify_columns < 1
            or self.receive_ahead < 1
        ):
            raise ValueError(
                "timeout_s, bucket_bytes, verify_columns and receive_ahead must be positive, "
                f"got {self.timeout_s}, {self.bucket_bytes}, {self.verify_columns}, "
                f"{self.receive_ahead}"
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
    staged: bool = False
    """Stage, then swap: receive on a thread of the worker's own into staging buffers while
    the engine keeps stepping, and load them in ``finish_weight_update`` (see the module). The
    update's only chunk; ``final`` does not apply (the install is the finish)."""


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


@dataclass
class StagedReceive:
    """One staged receive: the transfer's thread and what it landed.

    The thread is the only writer of every field until :attr:`done` is set; after that they
    are read-only. ``names``/``tensors``/``witnesses`` are in arrival order; each tensor is a
    view of a bucket buffer of its own.
    """

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    witnesses: list[Witness] = field(default_factory=list)
    stats: TransferStats | None = None
    delta: ReceivedDelta | None = None
    """A delta received instead (proven against the host copy, nothing written): the install
    rebuilds the whole tensors from the host copy."""
    error: BaseException | None = None
    """Why the receive failed (``None`` while it runs or once it landed whole)."""
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        """The staging memory the received tensors (or the packed delta) take."""
        staged = sum(t.numel() * t.element_size() for t in self.tensors)
        return staged + (0 if self.delta is None else self.delta.nbytes)

    def status(self) -> str:
        """``"receiving"``, ``"staged"`` (whole and verified) or ``"failed"``."""
        if not self.done.is_set():
            return "receiving"
        return "failed" if self.error is not None else "staged"


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
        self._timeout_s = 60.0
        self._receive_ahead = DEFAULT_RECEIVE_AHEAD
        self._staged: StagedReceive | None = None
        """The staged receive of the open update (``None``: none, or it was installed or
        discarded)."""
        self._abandoned: StagedReceive | None = None
        """A discarded receive whose thread may still be in a collective on the group."""
        self.staged_installs = 0
        self.staged_discarded = 0
        self.last_stage_bytes = 0
        self.last_install_s = 0.0
        self.host: HostCopy | None = None
        """The host copy delta syncs are rebuilt from (``delta_host_copy``), else ``None``."""
        self._fused = FusedParts({}, {})
        """Which checkpoint names load into one fused module."""
        self._delta_load: DeltaLoad | None = None
        """While a delta loads: what it changes and what was handed so far (``None``: a whole
        update loads)."""
        self._host_pending: ReceivedDelta | None = None
        """A staged delta being installed: written into the host copy once it landed."""

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
        self._timeout_s = init_info.timeout_s
        self._receive_ahead = init_info.receive_ahead
        self._group_id = f"{init_info.master_address}:{init_info.master_port}"
        # A copy kept across trainers stays valid: a delta is taken only on the bits it holds.
        if not init_info.delta_host_copy:
            self.host = None
        elif self.host is None:
            self.host = HostCopy()

    def start_weight_update(self) -> None:
        """Open an update. Touches nothing: the reload starts after the first manifest vote."""
        if self.transfer is None:
            raise RuntimeError(
                "the rollout_sync weight transfer is not initialized: call "
                "init_weight_transfer_engine first"
            )
        self._settle_abandoned()
        self.discard_staged()
        self._settle_abandoned()
        if self._reload_started:
            self._reset_reload()
        self._reload_started = False
        self._witnesses = []
        self.last_load_s = 0.0
        self._delta_load, self._host_pending = None, None

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
        if update_info.staged or self._staged is not None:
            self._start_staged(transfer, update_info)
            return
        try:
            self.last_stats = transfer.stream(
                self._expected,
                self._load,
                accept=self._accept,
                begin=self._begin,
                allow_subset=update_info.allow_subset,
                delta=self._delta_target(apply=True) if update_info.final else None,
                ahead=self._receive_ahead,
            )
        except BaseException as exc:
            if self._reload_started:
                self.torn = f"an update failed mid-load: {type(exc).__name__}: {exc}"
                self._drop_host_copy()
                self._record_write(error=True)
            elif not isinstance(exc, WeightTransferError) or exc.tensors_written:
                # Before the reload, a delta may have been written into the host copy: only
                # the transfer's own word that nothing was keeps the copy.
                self._drop_host_copy()
            raise
        if update_info.final:
            self._complete()

    def finish_weight_update(self) -> None:
        """Finalize the reload, then read every loaded tensor back through its kernel (unless
        the final chunk did already; a no-op when nothing was loaded).

        With a staged receive open, this is its install: wait for the receive (at most the
        group's ``timeout_s``), load the staged tensors through vLLM's layerwise reload,
        finalize, read back. Park generation around it (vLLM does not).

        Raises:
            WeightsNotLandedError: a tensor did not land; the engine stays ``torn``. vLLM's
                worker then still counts the update as open: call ``finish_weight_update``
                again (a no-op here) before the next start.
            WeightTransferError: the staged receive failed, or did not end within
                ``timeout_s``: nothing was loaded, the model serves what it served (not torn).
        """
        staged, self._staged = self._staged, None
        if staged is not None:
            self._install(staged)
        self._complete()

    def discard_staged(self) -> bool:
        """Throw away the staged receive of the open update, installed nowhere; whether there
        was one. Does not wait: a receive still running ends on its own (a failed trainer's
        abort, or the group's timeout) and its buffers are dropped then; the next update waits
        for it first. The served weights are untouched."""
        staged, self._staged = self._staged, None
        if staged is None:
            return False
        self._abandoned = staged
        self.staged_discarded += 1
        return True

    def _settle_abandoned(self) -> None:
        """Wait for a discarded receive's thread to leave the group's collectives (bounded by
        ``timeout_s``), so that the next transfer does not meet it there."""
        abandoned, self._abandoned = self._abandoned, None
        if abandoned is None or abandoned.done.wait(self._timeout_s + 5.0):
            return
        raise WeightTransferTimeout(
            f"a discarded staged receive was still in the transfer group's collectives after "
            f"{self._timeout_s + 5.0:.1f} s; restart the transfer group "
            "(init_weight_transfer_engine)",
            operation="start_weight_update: waiting for a discarded staged receive",
        )

    def _start_staged(self, transfer: WeightTransfer, update_info: RolloutSyncUpdateInfo) -> None:
        """Start the receive on a thread of its own into fresh staging buffers; return at once."""
        if not update_info.staged:
            raise RuntimeError(
                "an in-place update_weights chunk after a staged one: a staged update is one "
                "chunk (staged=True), installed by finish_weight_update"
            )
        if self._staged is not None:
            raise RuntimeError(
                "a second staged update_weights chunk in one update: a staged update is one "
                "chunk, installed by finish_weight_update"
            )
        if self._reload_started:
            raise RuntimeError(
                "a staged update_weights chunk after an in-place one in the same update: "
                "finish that update first"
            )
        _, tp_size = tensor_parallel_position()
        if transfer.backend == "nccl" and tp_size > 1:
            raise TwoCommunicatorsRefused(
                "a staged rollout_sync update over NCCL would receive beside forwards that run "
                f"their own NCCL collectives (tensor_parallel_size={tp_size}): two NCCL "
                "communicators in flight on one device at once. Send it in place "
                "(RolloutSyncTrainerInitInfo(staged=False): the engine is parked for the whole "
                "update) or over gloo (group_backend='gloo': staging through host memory)"
            )
        self._settle_abandoned()
        staged = StagedReceive()
        plan = self._plan
        assert plan is not None
        columns, seed = self._verify_columns, self.updates

        def keep(names: list[str], tensors: list[torch.Tensor]) -> None:
            for name, tensor in zip(names, tensors, strict=True):
                staged.witnesses.append(witness_of(name, tensor, plan, columns=columns, seed=seed))
            staged.names.extend(names)
            staged.tensors.extend(tensors)

        delta = self._delta_target(apply=False)

        def receive() -> None:
            try:
                staged.stats = transfer.stream(
                    self._expected,
                    keep,
                    accept=self._accept,
                    allow_subset=update_info.allow_subset,
                    delta=delta,
                    ahead=self._receive_ahead,
                )
                if staged.stats.sync_kind == SyncKind.DELTA.value:
                    assert delta is not None and delta.pending is not None
                    staged.delta = delta.pending
            except BaseException as exc:  # handed to the install, which raises it
                staged.error = exc
                staged.names, staged.tensors, staged.witnesses = [], [], []
            finally:
                staged.done.set()

        staged.thread = threading.Thread(
            target=receive, name="rollout_sync-staged-receive", daemon=True
        )
        self._staged = staged
        staged.thread.start()

    def _install(self, staged: StagedReceive) -> None:
        """Load a staged receive into the model (the caller parks generation); see
        :meth:`finish_weight_update`."""
        limit = self._timeout_s + 5.0
        if not staged.done.wait(limit):
            self._abandoned = staged
            self.staged_discarded += 1
            raise WeightTransferTimeout(
                f"the staged receive did not end within {limit:.1f} s; nothing was loaded, the "
                "model serves the version it served",
                operation="install a staged rollout_sync update",
            )
        if staged.error is not None:
            self.staged_discarded += 1
            error = staged.error
            raise WeightTransferError(
                "the staged receive failed, so nothing was installed and the model serves the "
                f"version it served: {type(error).__name__}: {error}",
                operation="install a staged rollout_sync update",
                version=getattr(error, "version", None),
            ) from error
        if staged.delta is not None:
            self._check_staged_base(staged.delta)
        start = time.perf_counter()
        self.last_stats = staged.stats
        self.last_stage_bytes = staged.nbytes
        try:
            if staged.delta is not None:
                self._install_delta(staged.delta)
            else:
                self._begin(None)
                if self.host is not None:
                    self.host.refresh(staged.names, staged.tensors)
                self._witnesses = staged.witnesses
                load_start = time.perf_counter()
                self._load_into_model(staged.names, staged.tensors)
                self.last_load_s = time.perf_counter() - load_start
        except BaseException as exc:
            self.torn = f"installing a staged update failed mid-load: {type(exc).__name__}: {exc}"
            self._drop_host_copy()
            self._record_write(error=True)
            raise
        finally:
            staged.names, staged.tensors = [], []  # the reload holds what it still needs
            staged.delta = None
        self._complete()
        self.staged_installs += 1
        self.last_install_s = time.perf_counter() - start

    def _check_staged_base(self, delta: ReceivedDelta) -> None:
        """A staged delta installs only on the host copy it was proven against (nothing
        else updates between its receive and its install; refused loudly if something did)."""
        host = self.host
        if host is None or host.version != delta.header.base_version or self.torn is not None:
            self.staged_discarded += 1
            raise WeightTransferError(
                f"the staged delta of version {delta.version} applies to version "
                f"{delta.header.base_version}, but the host copy now holds "
                f"{None if host is None else host.version} (torn: {self.torn}); nothing was "
                "installed, the model serves the version it served",
                operation="install a staged rollout_sync update",
                version=delta.version,
            )

    def _install_delta(self, delta: ReceivedDelta) -> None:
        """Rebuild the whole tensors a staged delta changes from the host copy (the host copy
        itself is written once the install landed) and load them as a whole update's."""
        host = self.host
        assert host is not None
        self._begin(None, changed=set(delta.changes))
        self._host_pending = delta
        limit = DEFAULT_BUCKET_BYTES if self.transfer is None else self.transfer.config.bucket_bytes
        load_start = time.perf_counter()
        for names, tensors in host.rebuilt(delta, limit):
            self._load(names, tensors)
        self.last_load_s = time.perf_counter() - load_start

    def _delta_target(self, *, apply: bool) -> DeltaTarget | None:
        """The host copy as a delta sync's target, or ``None`` (every delta then gets a vote
        for the whole version): no host copy, none complete, torn, or mid-update."""
        if self.host is None or self.torn is not None or self._reload_started:
            return None
        return self.host.target(self._expected, apply=apply)

    def _drop_host_copy(self) -> None:
        """The host copy may no longer hold what is served (a failed update): drop it, so
        every delta gets a vote for the whole version until a whole update of every served
        weight has refreshed it."""
        if self.host is not None:
            self.host = HostCopy()  # new objects: a staged receive may still hold the old
        self._host_pending = None

    def _commit_host_copy(self, version: int | None) -> None:
        """An update landed (verified): the host copy holds ``version`` where it holds every
        served name."""
        pending, self._host_pending = self._host_pending, None
        if self.host is not None:
            self.host.commit(pending, version, self._expected)

    def _complete(self) -> None:
        if not self._reload_started:
            return  # nothing (more) was loaded: the model serves what it served
        start = time.perf_counter()
        try:
            try:
                self._finish_reload()
            finally:
                self._reload_started = False
            self.last_finalize_s = time.perf_counter() - start
            start = time.perf_counter()
            problems = self._read_back()
        except BaseException as exc:  # whatever it is, nothing was verified
            self.torn = f"finishing the update failed: {type(exc).__name__}: {exc}"
            self._drop_host_copy()
            self._record_write(error=True)
            raise
        self.last_verify_s = time.perf_counter() - start
        self._witnesses = []
        self._record_write(error=bool(problems))
        self._delta_load = None
        if problems:
            shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
            self.torn = f"{len(problems)} tensor(s) did not land: {shown}"
            self._drop_host_copy()
            raise WeightsNotLandedError(
                problems,
                torn=True,
                context="rollout_sync native weight update: the read-back after finish",
            )
        self.torn = None
        self.updates += 1
        self._commit_host_copy(None if self.last_stats is None else self.last_stats.version)

    def shutdown(self) -> None:
        """Leave the transfer group (the engine keeps serving); a staged receive still open
        is discarded (its collectives fail with the group)."""
        self.discard_staged()
        self._abandoned = None
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
            "staged": None if self._staged is None else self._staged.status(),
            "staged_installs": self.staged_installs,
            "staged_discarded": self.staged_discarded,
            "last_stage_mb": self.last_stage_bytes / 1e6,
            "last_install_s": self.last_install_s,
            "last_sync_kind": None if stats is None else stats.sync_kind,
            "last_whole_reason": None if stats is None else stats.whole_reason,
            "last_full_mb": (stats.full_nbytes or 0) / 1e6 if stats is not None else 0.0,
            "host_copy_version": None if self.host is None else self.host.version,
            "host_copy_mb": None if self.host is None else self.host.nbytes / 1e6,
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
        self._fused = FusedParts.of(self._plan.groups)

    def _accept(self, manifest: WeightManifest) -> None:
        """This rank's objections beyond names, shapes and dtypes: tensors it could not read
        back, and parts of fused modules sent without the rest."""
        plan = self._plan
        assert plan is not None
        names = {e.name for e in manifest.entries}
        if manifest.delta is not None:
            # The unchanged parts of a fused module come from the host copy.
            names = self._fused.closure(names)
        problems = [
            f"{name}: cannot be read back from the served model ({plan.unverifiable[name]})"
            for name in sorted(names)
            if name in plan.unverifiable
        ]
        problems += partial_load_groups(names, plan.groups)
        if problems:
            raise WeightMismatchError(problems, context="rollout_sync native weight update")

    def _begin(self, manifest: WeightManifest | None, *, changed: set[str] | None = None) -> None:
        """After the vote (or at a staged install): start vLLM's layerwise reload (every layer
        leaves its device). ``changed`` (or the manifest's delta): a delta loads those names,
        with the unchanged parts of their fused modules from the host copy."""
        if self._reload_started:
            return  # a second chunk of the same update
        if manifest is not None and manifest.delta is not None:
            changed = {e.name for e in manifest.delta.entries}
        self._delta_load = None
        if changed is not None:
            assert self.host is not None  # a delta is taken only on the host copy
            self._delta_load = DeltaLoad(self.host, changed, self._fused)
        if self.host is not None:
            # Until the commit: a whole update refreshes it as it loads, an in-place delta was
            # written into it already (a staged one is written at the commit).
            self.host.version = None
        self.torn = "an update is in progress (layers are on the meta device until finish)"
        self._reload_started = True
        self._write_start_ns = time.monotonic_ns()
        self._start_reload()

    def _load(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        plan = self._plan
        assert plan is not None
        start = time.perf_counter()
        seed = self.updates
        if self._delta_load is not None:
            names, tensors = self._delta_load.with_unchanged_parts(names, tensors)
        elif self.host is not None:
            self.host.refresh(names, tensors)
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

    def _read_back(self) -> list[str]:
        """Every loaded tensor read back through its kernel: what did not land."""
        return verify_witnesses(self.model, self._witnesses)

    def _finish_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
