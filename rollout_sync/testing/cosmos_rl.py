"""cosmos-rl 0.4.7's own rollout classes, driven on CPU (needs cosmos-rl installed).

What runs is cosmos's code: the rollout worker's registered P2R / R2R handlers looked up in its
command registry, its lazy engine initialization, ``_paused_async_live_weights``, its
``RolloutTaskScheduler`` (thread mode, its own event loop), its ``WeightSyncThread`` and its
``NCCLPayloadProducer`` (request handling over a real redis-server, per-pair send queues,
sender pool). Only what cannot run on a CPU is replaced, and each replacement is named here:

* **FAKE-CUDA** (:func:`cpu_cuda`): ``torch.cuda.Stream``, ``torch.cuda.Event``,
  ``torch.cuda.stream``, ``torch.cuda.set_device``, ``torch.cuda.current_stream``. Without a
  device all work is synchronous, so an event is complete once recorded.
* **FAKE-NCCL-WEIGHTS**: the weight transfer's NCCL part. The worker's ``_execute_p2r_recv``
  (P2R receive driven by the controller's shard instructions), the instruction fetch
  ``prepare_shard_infos_for_weight_sync_insts``, and ``do_nccl_broadcast_grouped`` (R2R
  broadcast) become :class:`InPlaceWeightWriter`, which writes the new version into the
  served tensor in place (half, then the rest) and records the collective's interval.
* **FAKE-NCCL-PAYLOAD**: ``pynccl.nccl_send`` and the 2-rank communicator build
  (``comm_cache._default_build_fn``): the send copies the payload buffer and records its
  interval; no peer is needed.
* **FAKE-PACKAGE** ``qwen_vl_utils`` (``rollout_sync/testing/cpu_stubs``; ``.venv-cosmos``
  has it on its path, and :func:`stub_packages_without_cpu_build`, run when this module is
  imported, adds it where it is missing): ``import cosmos_rl`` imports it at top level (VLM
  data packers), and it imports torchvision, which has no CPU build for this torch. Never
  called here.
* **NOT STARTED**: cosmos's controller (an HTTP service) and ``torch.distributed``: workers
  are built with ``__new__`` and given the attributes their handlers read
  (:func:`make_worker`); the colocated worker's API client hands over the "policy model".

The backend, :class:`StepEngine`, is a cosmos ``RolloutBase``: each generation is ``steps``
decode steps, each reading the whole served tensor. A step that finds it holding two versions
read half-written weights: its generation is **torn**. :class:`ParkingStepEngine` adds a
``paused(timeout)`` that parks generations at a step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

CPU_STUBS = Path(__file__).with_name("cpu_stubs")
"""Stand-ins for packages without a CPU build (FAKE-PACKAGE), put on ``sys.path`` when missing."""


def stub_packages_without_cpu_build() -> None:
    """FAKE-PACKAGE: make :data:`CPU_STUBS` importable unless the real packages are."""
    import importlib.util
    import sys

    if importlib.util.find_spec("qwen_vl_utils") is None:
        sys.path.append(str(CPU_STUBS))


stub_packages_without_cpu_build()

from cosmos_rl.rollout import State  # noqa: E402
from cosmos_rl.rollout.rollout_base import RolloutBase  # noqa: E402
from cosmos_rl.rollout.schema import RolloutResult  # noqa: E402
from cosmos_rl.rollout.worker import rollout_control  # noqa: E402
from cosmos_rl.rollout.worker.asynchronous.rollout_task_scheduler import (  # noqa: E402
    RolloutTask,
    RolloutTaskScheduler,
)
from cosmos_rl.rollout.worker.rollout_control import DisaggregatedRolloutControlWorker  # noqa: E402

from ..errors import GenerationTimeout, PauseTimeout  # noqa: E402

__all__ = [
    "CPU_STUBS",
    "VARIANTS",
    "CpuCudaEvent",
    "CpuCudaStream",
    "GenerationRecord",
    "InPlaceWeightWriter",
    "Interval",
    "ParkingStepEngine",
    "PolicyConsumer",
    "StepEngine",
    "attach_weight_sync_thread",
    "cpu_cuda",
    "fake_nccl_broadcast",
    "fake_nccl_payload_sends",
    "make_producer",
    "make_worker",
    "overlapping",
    "p2r_command",
    "r2r_command",
    "registered_handler",
    "run_payload_overlap",
    "run_torn_generations",
    "submit_generations",
    "trajectory",
    "variant",
]


# -- FAKE-CUDA ----------------------------------------------------------------------------------


class CpuCudaEvent:
    """FAKE-CUDA: ``torch.cuda.Event`` without a device (work is synchronous: always done)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class CpuCudaStream:
    """FAKE-CUDA: ``torch.cuda.Stream`` without a device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> CpuCudaEvent:
        return event or CpuCudaEvent()


@contextlib.contextmanager
def cpu_cuda() -> Iterator[None]:
    """FAKE-CUDA for the ``with`` body (``torch.cuda.is_available()`` stays False)."""
    cuda: Any = torch.cuda
    fakes: dict[str, Any] = {
        "Stream": CpuCudaStream,
        "Event": CpuCudaEvent,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "set_device": lambda device: None,
        "current_stream": lambda device=None: CpuCudaStream(),
    }
    saved = {name: getattr(cuda, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(cuda, name, fake)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cuda, name, value)


# -- intervals ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """A span of ``time.monotonic()`` during which something used the device."""

    start: float
    end: float

    def overlaps(self, other: Interval) -> bool:
        return self.start < other.end and other.start < self.end


def overlapping(sends: list[Interval], collectives: list[Interval]) -> int:
    """How many of ``sends`` overlap any of ``collectives``."""
    return sum(1 for s in sends if any(s.overlaps(c) for c in collectives))


# -- the backend ----------------------------------------------------------------------------------


@dataclass
class GenerationRecord:
    """One generation as the engine saw it."""

    versions: list[int]
    """The version each decode step read (the first element of the served tensor)."""
    torn_steps: int
    """Steps that read the served tensor holding two versions (half-written)."""

    @property
    def torn(self) -> bool:
        return self.torn_steps > 0


class StepEngine(RolloutBase):  # type: ignore[misc]
    """A cosmos rollout backend on CPU: generations of ``steps`` steps over one served tensor.

    The served tensor (``weight``, ``width`` float32 elements) holds the version number in
    every element once a write is complete. A step also multiplies a ``step_work`` square
    matrix (the rest of a decode step's compute). ``step_done`` is set after every step, and
    :attr:`steps_run` counts them. ``step_hook``, if set, runs inside every step (on the
    engine's event loop: a hook that waits holds a step in progress, as the paused() contract
    suite does to show a pause timing out).
    """

    def __init__(self, *, steps: int = 16, width: int = 1 << 16, step_work: int = 160) -> None:
        self.steps = steps
        self.width = width
        self._work = torch.randn(step_work, step_work)
        super().__init__(config=None)

    def post_init_hook(self, **kwargs: Any) -> None:
        self.weight = torch.zeros(0)
        self.records: list[GenerationRecord] = []
        self.records_lock = threading.Lock()
        self.step_done = threading.Event()
        self.step_hook: Callable[[], None] | None = None
        self._steps_run = 0
        self.init_calls: list[dict[str, Any]] = []
        self.on_init: Callable[[], None] | None = None

    def init_engine(self, quantization: Any, seed: int, load_format: str, **kwargs: Any) -> None:
        self.weight = torch.zeros(self.width)
        if self.on_init is not None:
            self.on_init()
        thread = threading.current_thread().name
        self.init_calls.append({"load_format": load_format, "thread": thread})
        self._engine_initialized = True

    def get_underlying_model(self) -> torch.nn.Module:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        return module

    def set_underlying_model(self, model: Any) -> None:
        """Colocated P2R: take the policy's weights (a callable writing them, here)."""
        model()

    def synchronize_generation(self, timeout: float) -> None:
        return None  # CPU: every read has completed when its step returns

    def _begin_step(self) -> None:
        return None

    def _end_step(self) -> None:
        with self.records_lock:
            self._steps_run += 1
        self.step_done.set()

    @property
    def steps_run(self) -> int:
        """Decode steps finished so far (every generation's)."""
        with self.records_lock:
            return self._steps_run

    def _read(self) -> tuple[int, bool]:
        hook = self.step_hook
        if hook is not None:
            hook()
        torch.mm(self._work, self._work)  # the rest of a decode step's compute
        w = self.weight
        first = w[0].item()
        mixed = not bool(torch.all(w == first))
        return int(first), mixed

    async def rollout_generation(
        self,
        payloads: Any,
        stream: Any,
        data_packer: Any,
        data_fetcher: Any,
        is_validation: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> list[Any]:
        versions: list[int] = []
        torn = 0
        for _ in range(self.steps):
            self._begin_step()
            try:
                version, mixed = self._read()
            finally:
                self._end_step()
            versions.append(version)
            torn += mixed
            await asyncio.sleep(0)
        with self.records_lock:
            self.records.append(GenerationRecord(versions, torn))
        return [RolloutResult(completions=[str(versions[-1])])]


class ParkingStepEngine(StepEngine):
    """:class:`StepEngine` with its own ``paused(timeout)``: generations park between steps.

    A step that starts while parked blocks (the engine's event loop with it) until the park
    ends; :meth:`paused` returns once no step is running. :attr:`parking` says whether a pause
    is asked for or held, :attr:`steps_waiting` how many steps wait for it to end.
    """

    def post_init_hook(self, **kwargs: Any) -> None:
        super().post_init_hook(**kwargs)
        self._cond = threading.Condition()
        self._parks = 0
        self._in_step = 0
        self._waiting = 0
        self.parks = 0

    @property
    def parking(self) -> bool:
        """Whether a pause is asked for or held (no step may start)."""
        with self._cond:
            return self._parks > 0

    @property
    def steps_waiting(self) -> int:
        """Steps that wait, at their start, for the pause to end."""
        with self._cond:
            return self._waiting

    def _begin_step(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: self._parks == 0, timeout=60.0):
                    raise RuntimeError("StepEngine stayed parked for 60 s")
            finally:
                self._waiting -= 1
            self._in_step += 1

    def _end_step(self) -> None:
        with self._cond:
            self._in_step -= 1
            self._cond.notify_all()
        super()._end_step()

    @contextlib.contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        with self._cond:
            self._parks += 1
            self.parks += 1
            if not self._cond.wait_for(lambda: self._in_step == 0, timeout=timeout):
                self._parks -= 1
                self._cond.notify_all()
                raise PauseTimeout(
                    f"StepEngine did not park within {timeout} s (a decode step kept running)",
                    operation="park StepEngine",
                    timeout=timeout if timeout is not None else float("inf"),
                    sections_running=self._in_step,
                )
        try:
            yield
        finally:
            with self._cond:
                self._parks -= 1
                self._cond.notify_all()


# -- FAKE-NCCL-WEIGHTS ----------------------------------------------------------------------------


@dataclass
class InPlaceWeightWriter:
    """FAKE-NCCL-WEIGHTS: a weight transfer writing version ``v`` into the served tensor in place.

    It writes the first half, then waits (up to ``window_s``) for a decode step to run, then the
    rest: a forward that runs during a transfer reads half-written weights, deterministically
    whenever generation was not parked. ``on_collective`` (if set) runs inside the collective,
    after the first half (a payload request arriving mid-transfer, say).
    """

    engine: StepEngine
    window_s: float = 0.05
    collectives: list[Interval] = field(default_factory=list)
    requested_at: float = 0.0
    """Set by the driver when it dispatches a sync: ``waits`` gets the time to the write."""
    waits: list[float] = field(default_factory=list)
    on_collective: Callable[[], None] | None = None
    version: int = 0

    def write(self, version: int | None = None) -> None:
        self.version = self.version + 1 if version is None else version
        start = time.monotonic()
        if self.requested_at:
            self.waits.append(start - self.requested_at)
            self.requested_at = 0.0
        w = self.engine.weight
        half = w.numel() // 2
        w[:half].fill_(float(self.version))
        self.engine.step_done.clear()
        if self.on_collective is not None:
            self.on_collective()
        self.engine.step_done.wait(self.window_s)
        w[half:].fill_(float(self.version))
        self.collectives.append(Interval(start, time.monotonic()))

    # the shapes cosmos calls
    def p2r_recv(self, command: Any, stream: Any) -> None:
        self.write(command.weight_step)

    def broadcast_grouped(self, worker: Any, src_replica_name: str, stream: Any) -> tuple[int, int]:
        self.write()
        return 1, self.engine.weight.numel() * 4


@contextlib.contextmanager
def fake_nccl_broadcast(writer: InPlaceWeightWriter) -> Iterator[None]:
    """FAKE-NCCL-WEIGHTS for the R2R handler's ``do_nccl_broadcast_grouped``."""
    saved = rollout_control.do_nccl_broadcast_grouped
    rollout_control.do_nccl_broadcast_grouped = writer.broadcast_grouped
    try:
        yield
    finally:
        rollout_control.do_nccl_broadcast_grouped = saved


# -- the worker ---------------------------------------------------------------------------------


def make_worker(
    engine: StepEngine,
    writer: InPlaceWeightWriter,
    *,
    worker_cls: Any = DisaggregatedRolloutControlWorker,
    mode: str = "async",
    async_r2r_sync: str = "disabled",
    max_concurrent: int = 4,
    replica_name: str = "rollout-0",
) -> Any:
    """A cosmos rollout worker of ``worker_cls``, without its controller (NOT STARTED).

    Its handlers run as cosmos wrote them; what they read is set here: config, replica name,
    backend, CPU "CUDA" stream, state, and in ``mode="async"`` a real ``RolloutTaskScheduler``
    over ``engine`` (started by the first sync's lazy initialization).
    """
    worker = worker_cls.__new__(worker_cls)
    worker.config = SimpleNamespace(
        rollout=SimpleNamespace(
            mode=mode, async_r2r_sync=async_r2r_sync, broadcast_all_params=True, seed=0
        ),
        validation=SimpleNamespace(enable=False, val_before_train=False, freq=1 << 30),
        policy=SimpleNamespace(is_diffusers=False),
    )
    worker.replica_name = replica_name
    worker.rollout = engine
    worker.quantization_type = None
    worker.inference_stream = torch.cuda.Stream()
    worker.state = State()
    worker.current_weight_version = 0
    worker.non_trainable_params_received = True
    worker.validation_flag = threading.Event()
    worker.consume_command = lambda *a, **k: None
    worker.report_rollouts = lambda *a, **k: None
    worker.data_packer = None
    worker.val_data_packer = None
    worker._is_async_rollout = mode == "async"
    worker.scheduler = None
    if mode == "async":
        worker.scheduler = RolloutTaskScheduler(
            rollout_engine=engine,
            data_packer=None,
            max_concurrent_requests=max_concurrent,
            stream=worker.inference_stream,
            check_interval=0.001,
            weight_version_getter=lambda: worker.current_weight_version,
        )
    # FAKE-NCCL-WEIGHTS: the shard-instruction exchange and the P2R receive.
    worker.prepare_shard_infos_for_weight_sync_insts = lambda: None
    worker._execute_p2r_recv = writer.p2r_recv
    # The colocated worker's API client (NOT STARTED controller): the "policy model" is the
    # next version, written by the backend's set_underlying_model.
    worker.api_client = SimpleNamespace(get_policy_model=lambda: writer.write)
    worker.shutdown_signal = threading.Event()
    return worker


def submit_generations(worker: Any, count: int, start: int = 0) -> None:
    """Queue ``count`` generations on the worker's scheduler."""
    worker.scheduler.put_rollout_batch(
        [RolloutTask(idx=i, payload={"prompt": i}) for i in range(start, start + count)]
    )


# -- the three variants ------------------------------------------------------------------------

VARIANTS = ("unguarded", "0.4.7", "guarded")
"""``unguarded``: no pause, no flush; ``0.4.7``: cosmos as shipped; ``guarded``: installed."""


@contextlib.contextmanager
def variant(name: str) -> Iterator[Any]:
    """Run the ``with`` body as one of :data:`VARIANTS`; yields the guard when ``guarded``.

    ``unguarded`` removes what 0.4.7 does about a sync under generation: the drain in
    ``_paused_async_live_weights`` (a plain pass-through) and the ``flush_pending_sends`` call
    (the packers the worker is given then have none).
    """
    from ..integrations import cosmos_rl as integration

    if name == "guarded":
        with integration.installed() as guard:
            yield guard
    elif name == "0.4.7":
        yield None
    elif name == "unguarded":
        cls = DisaggregatedRolloutControlWorker
        saved = cls.__dict__["_paused_async_live_weights"]
        cls._paused_async_live_weights = lambda self: contextlib.nullcontext()
        try:
            yield None
        finally:
            cls._paused_async_live_weights = saved
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")


def registered_handler(worker_cls: Any, command_type: type) -> Callable[..., Any]:
    """The handler ``worker_cls``'s registry dispatches ``command_type`` to (backend ``vllm``),
    as the worker's ``consume_command`` looks it up."""
    handler: Callable[..., Any] | None = worker_cls.get_rollout_command_handler(command_type)
    if handler is None:
        raise LookupError(f"no handler registered for {command_type.__name__}")
    return handler


def p2r_command(worker: Any, step: int) -> Any:
    from cosmos_rl.dispatcher.command import PolicyToRolloutUnicastCommand

    return PolicyToRolloutUnicastCommand("policy-0", worker.replica_name, 1, 1, weight_step=step)


def r2r_command(worker: Any, step: int, *, source: str = "rollout-src") -> Any:
    from cosmos_rl.dispatcher.command import RolloutToRolloutBroadcastCommand

    return RolloutToRolloutBroadcastCommand(
        source,
        [source, worker.replica_name],
        weight_step=step,
        total_steps=1 << 30,
        trainable_only=False,
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_torn_generations(
    name: str,
    *,
    generations: int = 40,
    steps: int = 16,
    park: bool = True,
    worker_cls: type = DisaggregatedRolloutControlWorker,
    window_s: float = 0.05,
    timeout_s: float = 120.0,
    queue_first: bool = False,
) -> dict[str, Any]:
    """Generations on cosmos's real scheduler while syncs land through the real registry.

    The first P2R starts the engine (lazy initialization, inside the handler); then
    ``generations`` are queued and, whenever a decode step has run since the last sync, the
    next sync is dispatched (P2R and R2R alternating, except on the colocated worker whose R2R
    writes nothing), until all have finished. ``queue_first``: the generations are queued
    before the first P2R (they start as soon as its lazy initialization starts the engine).
    Returns the counts: ``generations``, ``torn``
    (generations with a step that read half-written weights), ``syncs``,
    ``wait_to_write_ms_p50`` / ``_max`` (from dispatching a sync to its first write: the park,
    or a drain that waits for whole generations), ``parks`` (the backend's own).
    """
    from cosmos_rl.dispatcher.command import (
        PolicyToRolloutUnicastCommand,
        RolloutToRolloutBroadcastCommand,
    )

    from ..integrations.cosmos_rl import SUPPORTED_VERSION

    colocated = worker_cls is not DisaggregatedRolloutControlWorker
    with cpu_cuda(), variant(name):
        engine: StepEngine = ParkingStepEngine(steps=steps) if park else StepEngine(steps=steps)
        writer = InPlaceWeightWriter(engine, window_s=window_s)
        worker = make_worker(engine, writer, worker_cls=worker_cls)
        p2r = registered_handler(worker_cls, PolicyToRolloutUnicastCommand)
        r2r = registered_handler(worker_cls, RolloutToRolloutBroadcastCommand)
        deadline = time.monotonic() + timeout_s
        with fake_nccl_broadcast(writer):
            if queue_first:
                submit_generations(worker, generations)
            p2r(worker, p2r_command(worker, 1))
            if not queue_first:
                submit_generations(worker, generations)
            step = 1
            try:
                while len(engine.records) < generations:
                    if time.monotonic() > deadline:
                        raise GenerationTimeout(
                            f"{name}: generations did not finish in {timeout_s} s"
                        )
                    engine.step_done.clear()
                    if not engine.step_done.wait(1.0) or len(engine.records) >= generations:
                        continue
                    step += 1
                    use_r2r = step % 2 == 1 and not colocated
                    command = r2r_command(worker, step) if use_r2r else p2r_command(worker, step)
                    writer.requested_at = time.monotonic()
                    (r2r if use_r2r else p2r)(worker, command)
            finally:
                worker.scheduler.stop(wait=True, shutdown_engine=False)
    records = engine.records
    return {
        "variant": name,
        "cosmos_rl": SUPPORTED_VERSION,
        "worker": worker_cls.__name__,
        "backend_park": park,
        "generations": len(records),
        "torn": sum(1 for r in records if r.torn),
        "syncs": step,
        "wait_to_write_ms_p50": round(_percentile(writer.waits, 0.5) * 1e3, 2),
        "wait_to_write_ms_max": round(max(writer.waits, default=0.0) * 1e3, 2),
        "parks": getattr(engine, "parks", 0),
        "engine_inits": len(engine.init_calls),
    }


# -- FAKE-NCCL-PAYLOAD, and the payload transport around it ----------------------------------------


@contextlib.contextmanager
def fake_nccl_payload_sends(
    sends: list[Interval], on_send: Callable[[], None] | None = None
) -> Iterator[None]:
    """FAKE-NCCL-PAYLOAD: ``pynccl.nccl_send`` copies the payload, records its interval in
    ``sends`` and calls ``on_send()`` (if given); the 2-rank communicator build and abort do
    nothing."""
    from cosmos_rl.utils import pynccl
    from cosmos_rl.utils.payload_transport.nccl import comm_cache

    def nccl_send(tensor: torch.Tensor, peer: int, comm_idx: int, **kwargs: Any) -> None:
        start = time.monotonic()
        tensor.clone()
        sends.append(Interval(start, time.monotonic()))
        if on_send is not None:
            on_send()

    saved = (pynccl.nccl_send, comm_cache._default_build_fn, comm_cache._default_abort_fn)
    pynccl.nccl_send = nccl_send
    comm_cache._default_build_fn = lambda uid_chars, local_rank, timeout_ms=None: 1
    comm_cache._default_abort_fn = lambda comm_idx: None
    try:
        yield
    finally:
        pynccl.nccl_send, comm_cache._default_build_fn, comm_cache._default_abort_fn = saved


def payload_config() -> Any:
    """The part of a cosmos config the payload producer reads (prefix, tunables)."""
    return SimpleNamespace(custom={}, logging=SimpleNamespace(experiment_name="rollout_sync"))


def make_producer(kind: str, redis_client: Any, *, replica_id: str = "rollout-0") -> Any:
    """A set-up cosmos NCCL payload producer.

    ``kind``: ``"context"`` - what ``PayloadContext.create("nccl", ...)`` builds (cosmos's own,
    or :class:`HoldableNCCLPayloadProducer` while the guard is installed); ``"holdable"`` -
    :class:`HoldableNCCLPayloadProducer` directly; ``"cosmos"`` - cosmos's own class.
    """
    from cosmos_rl.utils.payload_transport.context import PayloadContext

    kwargs = {
        "replica_id": replica_id,
        "rollout_idx": 0,
        "redis_client": redis_client,
        "config": payload_config(),
        "max_steps": 16,
    }
    if kind == "context":
        return PayloadContext.create("nccl", **kwargs)._producer
    if kind == "holdable":
        from ..integrations.cosmos_rl_payload import HoldableNCCLPayloadProducer

        producer = HoldableNCCLPayloadProducer()
    elif kind == "cosmos":
        from ..integrations.cosmos_rl_payload import HoldableNCCLPayloadProducer

        producer = HoldableNCCLPayloadProducer.__base__()  # cosmos's class, also while patched
    else:
        raise ValueError(f"unknown producer kind {kind!r}")
    producer.setup(**kwargs)
    return producer


def trajectory(seed: int) -> dict[str, Any]:
    """One episode in the producer's default schema (16 steps, obs 4, action 2)."""
    import numpy as np
    from cosmos_rl.utils.trajectory import build_trajectory_schema

    schema = build_trajectory_schema({"max_steps": 16, "obs_dim": 4, "action_dim": 2})
    found = {s.name: np.full(s.shape, seed % 7, dtype=s.dtype) for s in schema}
    found["episode_length"] = np.array([16])
    return found


class PolicyConsumer(threading.Thread):
    """A policy replica fetching payloads: cosmos's own receiver-side rendezvous
    (``NcclRendezvous.initiate``), one request at a time, each published just before.

    ``statuses`` has each request's outcome in order; ``answered`` is set after each reply.
    """

    def __init__(
        self,
        producer: Any,
        redis_client: Any,
        *,
        replica_id: str = "rollout-0",
        request_timeout_s: float = 5.0,
        limit: int | None = None,
        receiver_replica: str = "policy-0",
    ) -> None:
        super().__init__(name="policy-consumer", daemon=True)
        from cosmos_rl.utils.payload_transport.nccl.context import resolve_prefix
        from cosmos_rl.utils.payload_transport.nccl.protocol import (
            build_request_channel,
            build_rollout_prefix,
        )
        from cosmos_rl.utils.payload_transport.nccl.rendezvous import NcclRendezvous

        prefix = resolve_prefix(payload_config())
        self.producer = producer
        self.replica_id = replica_id
        self.channel = build_request_channel(build_rollout_prefix(prefix, replica_id))
        self.rendezvous = NcclRendezvous(
            redis_client, prefix, poll_interval=0.0005, uid_fn=lambda: [7] * 128
        )
        self.request_timeout_s = request_timeout_s
        self.limit = limit
        self.receiver_replica = receiver_replica
        self.statuses: list[str] = []
        self.requested: list[str] = []
        self.answered = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def request(self, transfer_id: str, attempt: int = 1) -> str:
        result = self.rendezvous.initiate(
            transfer_id=transfer_id,
            sender_replica=self.replica_id,
            sender_rank=0,
            receiver_replica=self.receiver_replica,
            receiver_rank=0,
            request_channel=self.channel,
            need_uid=not self.statuses,
            timeout=self.request_timeout_s,
            attempt=attempt,
        )
        return str(result.status.value)

    def run(self) -> None:
        try:
            seed = 0
            while not self.stop.is_set() and (self.limit is None or seed < self.limit):
                ref = self.producer.publish(trajectory(seed))
                seed += 1
                self.requested.append(ref["_transfer_id"])
                self.statuses.append(self.request(ref["_transfer_id"]))
                self.answered.set()
        except BaseException as exc:  # reported by the driver
            self.error = exc


def attach_weight_sync_thread(worker: Any, redis_client: Any) -> Any:
    """cosmos's real ``WeightSyncThread`` on ``worker``, with what it reads set up."""
    from cosmos_rl.rollout.worker.weight_sync import WeightSyncThread

    worker.device = torch.device("cpu")
    worker._buffer_lock = threading.Lock()
    worker._buffer_write_failed = False
    worker._buffer_writing = False
    worker._buffer_adopt_event = None
    worker._buffer_weight_version = 0
    worker._buffer_version = 0
    worker._r2r_redis = redis_client
    worker._r2r_barrier_prefix = "rollout_sync:r2r"
    thread = WeightSyncThread(worker)
    worker._weight_sync_thread = thread
    return thread


class _BarrierPeer:
    """The other rollout replica of an R2R round: joins cosmos's Redis barrier (the real
    ``r2r_barrier``) once this replica is waiting in it and the policy consumer has had up to
    ``replies`` more replies (or ``window_s`` passed): a sync that lets payloads out while
    it waits for its peers shows it then."""

    def __init__(
        self, worker: Any, consumer: PolicyConsumer, *, replies: int = 3, window_s: float = 0.2
    ) -> None:
        self.peer = SimpleNamespace(
            _r2r_redis=worker._r2r_redis,
            _r2r_barrier_prefix=worker._r2r_barrier_prefix,
            replica_name="rollout-peer",
        )
        self.consumer = consumer
        self.replies = replies
        self.window_s = window_s

    def join(self, step: int, timeout_s: float = 30.0) -> threading.Thread:
        from cosmos_rl.rollout.worker import weight_sync

        barrier_key = weight_sync._round_keys(self.peer._r2r_barrier_prefix, step)[0]
        redis_client = self.peer._r2r_redis

        def run() -> None:
            deadline = time.monotonic() + timeout_s
            while int(redis_client.get(barrier_key) or 0) < 1:  # this replica has arrived
                if time.monotonic() > deadline:
                    return
                time.sleep(0.0005)
            window_end = time.monotonic() + self.window_s
            seen = len(self.consumer.statuses)
            while len(self.consumer.statuses) < seen + self.replies:
                self.consumer.answered.clear()
                if not self.consumer.answered.wait(max(0.0, window_end - time.monotonic())):
                    break
            weight_sync.r2r_barrier(self.peer, step, expected_world_size=2)

        thread = threading.Thread(target=run, name=f"r2r-peer-{step}", daemon=True)
        thread.start()
        return thread


def run_payload_overlap(
    name: str,
    *,
    syncs: int = 12,
    between: int = 8,
    window_s: float = 0.05,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Payload sends against cosmos's real weight-sync thread, one variant of :data:`VARIANTS`.

    A policy consumer fetches payloads from the replica's real NCCL payload producer over a
    real redis-server throughout (``between`` replies before each sync), while the weight-sync
    thread runs ``syncs`` transfers (P2R and R2R alternating; each R2R waits in cosmos's Redis
    barrier for a peer replica). The
    producer is cosmos's own (``unguarded``), one that can flush given to the worker as its
    packer (``0.4.7``: cosmos calls ``flush_pending_sends`` before an R2R), or what
    ``PayloadContext.create`` builds under the guard (``guarded``). Returns ``sends``,
    ``overlapping_sync`` (sends whose interval meets a sync's window: from the barrier, or the
    P2R receive, to the end of the transfer), ``overlapping_collective`` (meeting the transfer
    itself), ``requests``, ``not_accepted`` (requests that did not get ACCEPTED: none is
    lost to a hold), ``deferred`` (requests a hold kept waiting; ``None`` for cosmos's own
    producer).
    """
    import redis
    from cosmos_rl.rollout.worker import weight_sync

    from ..integrations.cosmos_rl import SUPPORTED_VERSION
    from .redis_server import RedisServer

    sends: list[Interval] = []
    windows: list[Interval] = []
    window_start: list[float] = []
    with (
        cpu_cuda(),
        RedisServer() as server,
        fake_nccl_payload_sends(sends),
        variant(name),
    ):
        client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        kind = {"unguarded": "cosmos", "0.4.7": "holdable", "guarded": "context"}[name]
        producer = make_producer(kind, client)
        engine = StepEngine()
        engine.init_engine(None, 0, "dummy")  # the buffer clone the thread writes
        writer = InPlaceWeightWriter(engine, window_s=window_s)
        worker = make_worker(engine, writer, mode="sync", async_r2r_sync="generation")
        if name == "0.4.7":
            worker.data_packer = producer  # the hook 0.4.7 calls (flush), behind hasattr
        thread = attach_weight_sync_thread(worker, client)
        consumer = PolicyConsumer(producer, client)
        peer = _BarrierPeer(worker, consumer)

        real_barrier = weight_sync.r2r_barrier

        def barrier(*args: Any, **kwargs: Any) -> bool:
            window_start.append(time.monotonic())
            return bool(real_barrier(*args, **kwargs))

        def receive(command: Any, stream: Any) -> None:
            window_start.append(time.monotonic())
            writer.write(command.weight_step)
            windows.append(Interval(window_start.pop(), time.monotonic()))

        def broadcast(worker_: Any, source: str, stream: Any) -> tuple[int, int]:
            result = writer.broadcast_grouped(worker_, source, stream)
            windows.append(Interval(window_start.pop(), time.monotonic()))
            return result

        worker._execute_p2r_recv = receive
        saved = (weight_sync.r2r_barrier, weight_sync.do_nccl_broadcast_grouped)
        weight_sync.r2r_barrier, weight_sync.do_nccl_broadcast_grouped = barrier, broadcast
        thread.start()
        consumer.start()
        try:
            for step in range(1, syncs + 1):
                wanted = len(consumer.statuses) + between
                while len(consumer.statuses) < wanted:  # payloads flow between syncs
                    consumer.answered.clear()
                    if consumer.error is not None or not consumer.answered.wait(timeout_s):
                        break
                if step % 2:
                    thread.enqueue_p2r(p2r_command(worker, step))
                else:
                    joined = peer.join(step)
                    thread.enqueue_r2r(r2r_command(worker, step, source="rollout-peer"))
                if not thread.drain(timeout=timeout_s):
                    raise GenerationTimeout(f"{name}: weight-sync thread did not drain")
                if step % 2 == 0:
                    joined.join(timeout_s)
        finally:
            consumer.stop.set()
            consumer.join(timeout_s)
            weight_sync.r2r_barrier, weight_sync.do_nccl_broadcast_grouped = saved
            thread.stop()
            producer.close()
        if consumer.error is not None:
            raise consumer.error
        task_failed = thread._task_failed
    collectives = writer.collectives
    return {
        "variant": name,
        "cosmos_rl": SUPPORTED_VERSION,
        "producer": type(producer).__name__,
        "syncs": len(windows),
        "sends": len(sends),
        "overlapping_sync": overlapping(sends, windows),
        "overlapping_collective": overlapping(sends, collectives),
        "requests": len(consumer.statuses),
        # "complete": accepted, and the send finished before the reply was read.
        "not_accepted": sum(1 for st in consumer.statuses if st not in ("accepted", "complete")),
        "deferred": getattr(producer, "hold_stats", None) and producer.hold_stats.deferred,
        "thread_failed": task_failed,
    }
