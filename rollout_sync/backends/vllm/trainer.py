"""The trainer side of vLLM's native weight transfer, ``backend="rollout_sync"``.

:class:`RolloutSyncTrainerEngine` is what ``WeightTransferTrainerFactory.trainer_init`` builds
for a :class:`RolloutSyncTrainerInitInfo`: it opens the transfer group as its rank 0 while the
inference workers join it (``init_weight_transfer_engine`` through the client), then pushes
each update as vLLM's protocol wants it (``start_weight_update``, ``update_weights`` running
while this process sends, ``finish_weight_update`` with the version) through any
``VLLMWeightSyncClient``: vLLM's HTTP or Ray client, this package's
:class:`~rollout_sync.backends.vllm.client.AsyncLLMWeightSyncClient`, or any of them wrapped in
:class:`~rollout_sync.backends.vllm.client.GuardedWeightSyncClient` (which pauses generation
around each update: vLLM does not).

The bytes go as one :class:`~rollout_sync.transfer.WeightTransfer` per update: a manifest the
workers check and vote on before anything is loaded, buckets with checksums, a commit vote.
Every wait is bounded by ``timeout_s``.

Each push is timed by the package's :class:`~rollout_sync.WeightSyncTimer` (CUDA events read
one step later on NCCL, never a host stall; wall time on gloo), through a
:class:`~rollout_sync.WeightBroadcastCallback`: :attr:`RolloutSyncTrainerEngine.callback`.
Register that callback with the trainer's callbacks and every successful step pushes and
``step_end`` returns ``weight_sync_time_ms``; or call :meth:`~RolloutSyncTrainerEngine.send_weights`
yourself and read :meth:`~RolloutSyncTrainerEngine.metrics`.

**Delta syncs** (``RolloutSyncTrainerInitInfo(delta=True, full_every=N)``, docs/delta.md): the
sender keeps a :class:`~rollout_sync.transfer.delta_sync.DeltaEncoder` (one copy of the last
version every worker committed, in the dtype it sends) and sends each version as its changes
against it; the workers keep a host copy to rebuild whole tensors from
(``delta_host_copy``, on with ``delta``). The first sync, a keyframe, a delta no smaller than the
whole version, or a worker that cannot take it (no host copy, another base, torn) makes the sync
whole, automatically, in the same transfer; :attr:`RolloutSyncTrainerEngine.last_stats` says
``sync_kind`` and ``whole_reason``, and the metrics count ``weight_sync_delta_count``.

Multi-rank trainers: build the engine on every rank. Rank 0 sends; the other ranks only iterate
the source (an FSDP ``full_tensor()`` is a collective they must join).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from typing_extensions import Self
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    layerwise_groups,
    materialize_full_tensor,
)

from ..._deadline import deadline_after, remaining
from ...errors import WeightTransferTimeout
from ...metrics import WeightSyncTimer
from ...trainer import WeightBroadcastCallback
from ...transfer import TransferStats, WeightTransfer
from ...transfer.delta_sync import DeltaEncoder, EncodedDelta, WholeReason
from .engine import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_RECEIVE_AHEAD,
    RolloutSyncInitInfo,
    RolloutSyncUpdateInfo,
    join_transfer_group,
)
from .plugin import ENGINE_NAME, register_engines

__all__ = [
    "MappingSource",
    "RolloutSyncTrainerEngine",
    "RolloutSyncTrainerInitInfo",
    "in_layer_order",
]

register_engines()


class MappingSource(WeightSource):
    """A vLLM ``WeightSource`` over named tensors (checkpoint names), read afresh each pass.

    ``weights``: the mapping, or a function returning the current one (a trainer whose
    parameters are replaced, not updated in place). ``metadata()`` and iteration follow the
    mapping's order.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
    ) -> None:
        self._weights = weights

    def current(self) -> Mapping[str, torch.Tensor]:
        return self._weights() if callable(self._weights) else self._weights

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.current().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.current().items()


@dataclass
class RolloutSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``"rollout_sync"`` engine (the factory dispatches on
    ``backend``).

    ``world_size``: this trainer's sender plus every inference worker (tensor-parallel ranks
    times data-parallel replicas); the workers join as ranks 1 .. world_size - 1.
    ``group_backend``: ``"gloo"`` or ``"nccl"``; ``None`` picks NCCL where CUDA is available.
    ``require_all``: every update carries every served weight (``False``: the source may be a
    subset, whole fused modules only). ``staged``, ``delta``, ``full_every``,
    ``delta_host_copy``: see the fields. ``timer``: times each push (default: the clock that
    fits the group backend); not sent anywhere.
    """

    backend: ClassVar[str] = ENGINE_NAME

    master_address: str
    master_port: int
    world_size: int
    group_backend: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    checksums: bool = True
    timeout_s: float = 60.0
    verify_columns: int = 16
    require_all: bool = True
    staged: bool = False
    """Stage, then swap: each update's ``update_weights`` only starts the workers' receive (on
    a thread of their own, into staging buffers, while the engine keeps stepping) and
    ``finish_weight_update`` installs what they staged; with a
    :class:`~rollout_sync.backends.vllm.client.GuardedWeightSyncClient` built with
    ``staged=True`` generation is parked for the install alone."""
    delta: bool = False
    """Send each version as its changes against the last one every worker committed (see the
    module); whole when a worker cannot take it."""
    full_every: int | None = None
    """With ``delta``: every ``full_every``-th push goes whole (a keyframe)."""
    receive_ahead: int = DEFAULT_RECEIVE_AHEAD
    """In place: buckets on the wire while a worker's vLLM loads the one that arrived
    (:attr:`~rollout_sync.backends.vllm.engine.RolloutSyncInitInfo.receive_ahead`)."""
    delta_host_copy: bool | None = None
    """Whether the workers keep the host copy a delta is rebuilt from
    (:attr:`~rollout_sync.backends.vllm.engine.RolloutSyncInitInfo.delta_host_copy`: one copy
    of the weights in each worker's host memory); ``None``: as ``delta``. ``False`` with
    ``delta``: every sync goes whole (the workers ask for it)."""
    timer: WeightSyncTimer | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.full_every is not None and not self.delta:
            raise ValueError(
                "RolloutSyncTrainerInitInfo: full_every is the keyframe interval of delta "
                "syncs: pass delta=True"
            )
        if self.full_every is not None and self.full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {self.full_every!r}")

    @classmethod
    def on_this_host(cls, world_size: int = 2, **fields: Any) -> Self:
        """Init info for a trainer and its inference workers on this machine: the rendezvous on
        ``127.0.0.1`` at a port nothing listens on now, this process rank 0 (unless ``rank=``
        says otherwise); ``fields``: any other field."""
        from ...distributed import find_free_port

        fields.setdefault("rank", 0)
        return cls(
            master_address="127.0.0.1",
            master_port=find_free_port(),
            world_size=world_size,
            **fields,
        )

    def resolved_group_backend(self) -> str:
        if self.group_backend is not None:
            return self.group_backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def worker_init_info(self) -> RolloutSyncInitInfo:
        """What the workers get through ``init_weight_transfer_engine`` (validated here)."""
        return RolloutSyncInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world_size,
            rank_offset=1,
            group_backend=self.resolved_group_backend(),
            bucket_bytes=self.bucket_bytes,
            checksums=self.checksums,
            timeout_s=self.timeout_s,
            verify_columns=self.verify_columns,
            receive_ahead=self.receive_ahead,
            delta_host_copy=self.delta if self.delta_host_copy is None else self.delta_host_copy,
        )


class RolloutSyncTrainerEngine(TrainerWeightTransferEngine[RolloutSyncTrainerInitInfo]):
    """vLLM's ``"rollout_sync"`` trainer engine; see the module. Build it with
    ``WeightTransferTrainerFactory.trainer_init`` (or :meth:`trainer_init`)."""

    init_info_cls = RolloutSyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: RolloutSyncTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.transfer: WeightTransfer | None = None
        self.group: Any = None
        self.last_stats: TransferStats | None = None
        self.backend = init_info.resolved_group_backend()
        """The group's backend (what ``WeightBroadcastCallback`` picks its timer clock from)."""
        self.encoder: DeltaEncoder | None = None
        """The sender's delta encoder (``delta``), else ``None``: its base is the last version
        every worker committed (:attr:`~DeltaEncoder.extra_bytes` of trainer memory)."""
        if init_info.delta and self.is_sender:
            self.encoder = DeltaEncoder(full_every=init_info.full_every)
        timer: WeightSyncTimer | None = None
        if self.is_sender:
            timer = (
                init_info.timer
                if init_info.timer is not None
                else WeightSyncTimer.for_backend(self.backend)
            )
        self.callback = WeightBroadcastCallback(
            self._materialize,
            pusher=self,
            timer=timer,
            timeout=init_info.timeout_s,
            sync_on_run_begin=False,
            report_every_step=True,
        )
        """Pushes and times: register it with the trainer's callbacks (see the module)."""

    @classmethod
    def trainer_init(
        cls,
        init_info: RolloutSyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Open the transfer group with the workers (the sender); bounded by ``timeout_s``."""
        if source is None:
            raise ValueError("the rollout_sync trainer engine needs a WeightSource to send")
        engine = cls(client=client, source=source, init_info=init_info)
        if not engine.is_sender:
            return engine
        worker_info = init_info.worker_init_info()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if engine.backend == "nccl"
            else torch.device("cpu")
        )
        deadline = deadline_after(init_info.timeout_s)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout_sync-init")
        try:
            # The workers block in init_weight_transfer_engine until the group is complete,
            # so that call runs beside this process's own rendezvous.
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group, engine.transfer = join_transfer_group(worker_info, 0, device)
            _result(joined, deadline, "the workers' init_weight_transfer_engine")
        finally:
            pool.shutdown(wait=False)
        return engine

    # -- pushing ---------------------------------------------------------------------------------

    def send_weights(self, version: int | None = None) -> None:
        """Push the source as the next version (or ``version``), timed; every trainer rank
        calls it. The workers hold it, verified, when this returns on the sender."""
        if version is not None:
            self.callback.version = version - 1
        self.callback.sync(self.callback.version + 1)

    def metrics(self) -> dict[str, Any] | None:
        """``weight_sync_time_ms`` and the other keys of
        :meth:`~rollout_sync.WeightBroadcastCallback.step_end`, harvested without blocking."""
        return self.callback.report()

    @property
    def version(self) -> int:
        """The last version pushed."""
        return self.callback.version

    def push_weights(
        self, weights: Mapping[str, torch.Tensor], *, version: int, timeout: float
    ) -> None:
        """One update through vLLM's protocol (the :class:`~rollout_sync.trainer.WeightPusher`
        the callback calls): start, then ``update_weights`` beside this process's send, then
        finish with ``str(version)``. Raises within ``timeout`` seconds (plus the transfer's
        own bound) when a side fails; the workers then refuse to serve (torn) until a complete
        update lands."""
        self.push(weights, version=version, label=str(version), timeout=timeout)

    def push(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        label: str | None,
        timeout: float,
        require_all: bool | None = None,
        staged: bool | None = None,
    ) -> TransferStats | None:
        """:meth:`push_weights`, with vLLM's version ``label`` given apart from the transfer's
        ``version`` (``None``: finish without setting one), and ``require_all`` and ``staged``
        for this push (``None``: the init info's). The sender's transfer numbers, or ``None``
        on other ranks.

        Staged: ``update_weights`` returns once the workers' receive threads have started;
        this process then sends (the engine keeps generating), and ``finish_weight_update``
        installs. A failed send leaves every worker's served weights untouched: the update is
        given up (the workers' staged receives discarded, never installed)."""
        require_all = self.init_info.require_all if require_all is None else require_all
        staged = self.init_info.staged if staged is None else staged
        if not self.is_sender:
            return None
        transfer = self.transfer
        if transfer is None:
            raise RuntimeError("trainer_init() has not opened the transfer group")
        deadline = deadline_after(timeout + self.init_info.timeout_s)
        weights = in_layer_order(weights)
        encoded = None if self.encoder is None else self.encoder.encode(weights, version)
        update = asdict(
            RolloutSyncUpdateInfo(
                allow_subset=not require_all,
                group=f"{self.init_info.master_address}:{self.init_info.master_port}",
                final=not staged,
                staged=staged,
            )
        )
        self.client.start_weight_update()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout_sync-update")
        try:
            if staged:
                self._stage(
                    transfer, weights, version, require_all, update, deadline, pool, encoded
                )
            else:
                self._transfer(
                    transfer, weights, version, require_all, update, deadline, pool, encoded
                )
        except BaseException as exc:
            # A guarded client whose update is still open (this side failed, the engine's may
            # not have) gives it up: torn, parked, egress released.
            abort = getattr(self.client, "abort_weight_update", None)
            close = getattr(self.client, "close_weight_update", None)
            if callable(abort):
                abort(f"the trainer's push of version {version} failed: {type(exc).__name__}")
            elif callable(close):
                # This package's unguarded clients: close the update where it is still open
                # (tensor parallelism: the workers where update_weights did not fail).
                try:
                    close()
                except Exception:  # the push's own error is the one to raise
                    pass
            raise
        finally:
            pool.shutdown(wait=False)
        self.client.finish_weight_update(label)
        if self.encoder is not None:
            # Every worker committed this version: the base moves to it. A push that failed
            # leaves the base: a worker that landed it anyway asks for the whole next time.
            stats = self.last_stats
            sent = (
                encoded
                if isinstance(encoded, EncodedDelta)
                and stats is not None
                and stats.sync_kind == "delta"
                else None
            )
            self.encoder.committed(weights, version, sent)
        return self.last_stats

    def _transfer(
        self,
        transfer: WeightTransfer,
        weights: Mapping[str, torch.Tensor],
        version: int,
        require_all: bool,
        update: dict[str, Any],
        deadline: float,
        pool: concurrent.futures.ThreadPoolExecutor,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> None:
        """``update_weights`` on ``pool`` beside this process's send; both bounded."""
        received = pool.submit(self.client.update_weights, update)
        try:
            self.last_stats = transfer.send(
                weights, version=version, require_all=require_all, delta=delta
            )
        except BaseException as send_error:
            # The workers' side ends within the transfer's timeout too; the send's typed
            # error is raised, with the workers' own (their reason) as its cause.
            try:
                _result(received, deadline, "the workers' update_weights")
            except BaseException as worker_error:
                raise send_error from worker_error
            raise
        _result(received, deadline, "the workers' update_weights")

    def _stage(
        self,
        transfer: WeightTransfer,
        weights: Mapping[str, torch.Tensor],
        version: int,
        require_all: bool,
        update: dict[str, Any],
        deadline: float,
        pool: concurrent.futures.ThreadPoolExecutor,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> None:
        """Start the workers' staged receive (``update_weights`` returns at once), then send;
        both bounded. A worker that refused to start its receive (the call raised) gets no
        send: nothing would receive it."""
        _result(pool.submit(self.client.update_weights, update), deadline, "update_weights")
        self.last_stats = transfer.send(
            weights, version=version, require_all=require_all, delta=delta
        )

    def _materialize(self) -> dict[str, torch.Tensor]:
        """The source's tensors, each materialized (an FSDP gather), in metadata order; on
        ranks other than the sender the gathers are joined and the tensors dropped."""
        assert self.source is not None
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in self.source:
            full = materialize_full_tensor(tensor).detach()
            if self.is_sender:
                weights[name] = full
        return weights

    def shutdown(self) -> None:
        """Leave the transfer group."""
        group, self.group, self.transfer = self.group, None, None
        if group is not None:
            group.shutdown()


def in_layer_order(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``weights`` in the order vLLM's layerwise reload completes layers in (vLLM's
    ``layerwise_groups``: the block before the first indexed layer, each layer, the block after),
    so that the buckets fill layer by layer and each layer loads as soon as its last bucket
    arrived; the mapping itself when it is in that order already. ``layerwise_groups`` is a
    partition of the names: the reordered mapping holds every tensor once."""
    names = list(weights)
    order = [name for group in layerwise_groups(names) for name in group]
    if order == names:
        return weights
    return {name: weights[name] for name in order}


def _result(future: concurrent.futures.Future[Any], deadline: float, what: str) -> Any:
    try:
        return future.result(timeout=remaining(deadline))
    except concurrent.futures.TimeoutError:
        raise WeightTransferTimeout(
            f"{what} did not return in time (an engine that hangs, or a worker that never "
            "joined the transfer group)",
            operation=what,
        ) from None
