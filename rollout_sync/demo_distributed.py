"""The main job, multi-process: a trainer and N rollout replicas over gloo on loopback.

Process 0 is the trainer; processes ``1..N`` are rollout replicas, each a
:class:`~rollout_sync.RolloutWorker` whose engine generates continuously on its own thread and
ships a payload per forward through a packer. The parent process is the controller: it queues,
for every training step, a :class:`~rollout_sync.P2R` for replica 1 and an
:class:`~rollout_sync.R2R` for every replica, then :class:`~rollout_sync.Stop`. The trainer
updates its weights and broadcasts them every step.

Every process records a timeline; the parent merges them and checks that no forward overlapped
a weight write and no payload send overlapped a weight collective or sync, and that every
replica ends (and, with ``check_every_step``, is after every version it received) bit-identical
to the trainer.

The engine is chosen by name from :data:`DEMO_BACKENDS` (see :func:`register_demo_backend`), so
other engines (the stream scheduler's tiny LM) plug in without touching the plumbing.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .backend import RolloutBase
from .distributed import find_free_port, init_process_group, run_processes
from .guard import SyncMode
from .metrics import percentile, summarize
from .testing import AsyncTornReadBackend, RecordingPacker, TornReadBackend, VersionStampedModel
from .trace import SpanKind, Timeline
from .transfer import TransferConfig, TransferStats
from .worker import P2R, R2R, RolloutWorker, Stop, build_sync_groups

__all__ = [
    "DEMO_BACKENDS",
    "DemoEngine",
    "DistributedDemoConfig",
    "register_demo_backend",
    "run_distributed_demo",
    "weights_digest",
]


@dataclass(frozen=True)
class DistributedDemoConfig:
    """Knobs of the multi-process demo. The defaults finish in ~10-20 s on two cores."""

    replicas: int = 3
    steps: int = 30
    backend: str = "torn_read"
    """A key of :data:`DEMO_BACKENDS`."""
    mode: SyncMode = SyncMode.SYNC
    guarded: bool = True
    num_tensors: int = 32
    numel: int = 65536
    """Elements (float32) per tensor: 32 x 65536 x 4 B = 8 MiB by default."""
    bucket_bytes: int = 4 << 20
    checksums: bool = False
    step_interval_s: float = 0.02
    """The trainer's stand-in for a training step between two broadcasts."""
    send_s: float = 200e-6
    """How long one fake payload send takes."""
    timeout_s: float = 30.0
    """Limit of every collective, pause, hold and fence."""
    check_every_step: bool = True
    """Compare every version every replica received with the trainer's (a digest each)."""
    seed: int = 0


# -- engines -----------------------------------------------------------------------------------


@dataclass
class DemoEngine:
    """What a demo backend factory returns: the engine, and how to read its counters."""

    rollout: RolloutBase
    counters: Callable[[], dict[str, int]]
    """``forwards`` and ``torn_reads`` at least; ``generation_pauses`` and ``installs`` if
    the engine knows them."""
    step_generation: Callable[[], Any] | None = None
    """For a blocking engine: one generation call (see RolloutWorker)."""


DemoBackendFactory = Callable[[DistributedDemoConfig, Timeline, RecordingPacker], DemoEngine]

DEMO_BACKENDS: dict[str, DemoBackendFactory] = {}
"""Engines the demo can run, by name."""


def register_demo_backend(name: str, factory: DemoBackendFactory) -> None:
    """Make ``factory`` available as ``--backend name``.

    Register at import time of a module that the demo imports, since replicas are spawned
    processes that look the factory up by name.
    """
    DEMO_BACKENDS[name] = factory


def _torn_read_engine(config: DistributedDemoConfig, timeline: Timeline,
                      packer: RecordingPacker) -> DemoEngine:
    model = VersionStampedModel(config.num_tensors, config.numel, timeline=timeline)
    backend: TornReadBackend
    if config.mode is SyncMode.SYNC:
        backend = TornReadBackend(model, packer=packer, pause_timeout=config.timeout_s,
                                  timeline=timeline)
    else:
        backend = AsyncTornReadBackend(model, packer=packer, pause_timeout=config.timeout_s,
                                       timeline=timeline)
    def counters() -> dict[str, int]:
        return {
            "forwards": model.forwards,
            "torn_reads": model.torn_reads,
            "generation_pauses": backend.generation_gate.statistics().exclusive_acquired,
            "installs": len(backend.installs) if isinstance(backend, AsyncTornReadBackend)
            else 0,
        }

    return DemoEngine(backend, counters)


register_demo_backend("torn_read", _torn_read_engine)


# -- weights -----------------------------------------------------------------------------------


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and exact bytes: equal iff bit-identical."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in weights.items():
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}|".encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _trainer_weights(config: DistributedDemoConfig) -> tuple[dict[str, torch.Tensor],
                                                              dict[str, torch.Tensor]]:
    """The trainer's weights (named like the replicas' model) and a fixed fractional pattern.

    Version ``v`` is ``v + pattern`` with the pattern in [0, 0.5): the stamp a forward reads
    (``int(x)``) is ``v``, and the bytes differ from element to element, so the bit-identical
    check compares real data, not a constant.
    """
    gen = torch.Generator().manual_seed(config.seed)
    names = [f"layers.{i}.weight" for i in range(config.num_tensors)]
    pattern = {n: torch.rand(config.numel, generator=gen) * 0.5 for n in names}
    weights = {n: torch.zeros(config.numel) for n in names}
    return weights, pattern


# -- the processes -----------------------------------------------------------------------------


def _demo_process(rank: int, config: DistributedDemoConfig, port: int,
                  queues: list[Any]) -> dict[str, Any]:
    init_process_group(rank=rank, world_size=config.replicas + 1,
                       init_method=f"tcp://127.0.0.1:{port}", timeout_s=config.timeout_s)
    groups = build_sync_groups(0, range(1, config.replicas + 1), timeout_s=config.timeout_s)
    transfer_config = TransferConfig(bucket_bytes=config.bucket_bytes,
                                     checksums=config.checksums, timeout_s=config.timeout_s)
    timeline = Timeline()
    if rank == 0:
        return _trainer(config, groups.p2r_transfer(config=transfer_config, timeline=timeline),
                        timeline)
    return _replica(rank, config, groups.p2r_transfer(config=transfer_config, timeline=timeline),
                    groups.r2r_transfer(config=transfer_config, timeline=timeline),
                    queues[rank], timeline)


def _trainer(config: DistributedDemoConfig, transfer: Any, timeline: Timeline) -> dict[str, Any]:
    weights, pattern = _trainer_weights(config)
    digests: dict[int, str] = {}
    stats: list[TransferStats] = []
    for step in range(1, config.steps + 1):
        with torch.no_grad():
            for name, tensor in weights.items():
                torch.add(pattern[name], float(step), out=tensor)
        if config.check_every_step:
            digests[step] = weights_digest(weights)
        stats.append(transfer.send(weights, version=step))
        time.sleep(config.step_interval_s)  # stands in for the next training step's compute
    return {
        "role": "trainer",
        "digests": digests,
        "final_digest": weights_digest(weights),
        "final_version": config.steps,
        "transfers": [asdict(s) for s in stats],
        "spans": timeline.to_records(),
    }


def _replica(rank: int, config: DistributedDemoConfig, p2r: Any, r2r: Any, commands: Any,
             timeline: Timeline) -> dict[str, Any]:
    packer = RecordingPacker(capacity=32, send_s=config.send_s, timeline=timeline,
                             default_timeout=config.timeout_s).start()
    engine = DEMO_BACKENDS[config.backend](config, timeline, packer)
    digests: dict[int, str] = {}

    def on_transfer(stats: TransferStats, tensors: Mapping[str, torch.Tensor]) -> None:
        # The worker calls this before anything else writes these tensors: they hold exactly
        # the version just received.
        if config.check_every_step and stats.role == "receive":
            digests[stats.version] = weights_digest(tensors)

    worker = RolloutWorker(
        engine.rollout, p2r=p2r, r2r=r2r, mode=config.mode, commands=commands,
        step_generation=engine.step_generation, data_packer=packer, timeline=timeline,
        weight_sync_timeout=config.timeout_s, guarded=config.guarded, on_transfer=on_transfer)
    try:
        results = worker.run(idle_timeout_s=config.timeout_s * 4)
        # Async modes: let a safe point install the last version received before stopping.
        worker.wait_for_install(config.timeout_s)
    finally:
        try:
            worker.close(config.timeout_s)
        finally:
            packer.stop(config.timeout_s)
    counters = engine.counters()
    return {
        "role": "replica",
        "rank": rank,
        "digests": digests,
        "final_digest": weights_digest(_received_weights(worker)),
        "final_version": worker.rollout.weight_version,
        "weights_torn": worker.rollout.weights_torn,
        "forwards": counters.get("forwards", 0),
        "torn_reads": counters.get("torn_reads", 0),
        "generation_pauses": counters.get("generation_pauses", 0),
        "installs": counters.get("installs", 0),
        "superseded": (worker.weight_buffer.statistics().superseded
                       if worker.weight_buffer is not None else 0),
        "payloads_sent": len(packer.sent),
        "failed": [r.error for r in results if not r.ok],
        "syncs": sum(r.ok and isinstance(r.command, (P2R, R2R)) for r in results),
        "transfers": [asdict(r.value) for r in results
                      if r.ok and isinstance(r.value, TransferStats)],
        "reports": [{"park_s": s.park_s, "total_s": s.total_s, "handler": s.handler}
                    for s in worker.sync_reports],
        "spans": timeline.to_records(),
    }


def _received_weights(worker: RolloutWorker) -> Mapping[str, torch.Tensor]:
    """What the replica received: the served tensors, or in async modes the buffer."""
    if worker.weight_buffer is not None:
        return worker.weight_buffer.tensors
    return worker.rollout.served_weights()


# -- the controller ----------------------------------------------------------------------------


@dataclass
class _Merged:
    replicas: list[dict[str, Any]] = field(default_factory=list)
    trainer: dict[str, Any] = field(default_factory=dict)


def run_distributed_demo(config: DistributedDemoConfig,
                         timeline: Timeline | None = None) -> dict[str, Any]:
    """Run the demo (spawning ``replicas + 1`` processes) and return its report.

    Raises:
        GroupProcessError: a process failed or overstayed (its traceback is in the message).
        KeyError: ``config.backend`` is not a registered demo backend.
    """
    if config.replicas < 1 or config.steps < 1:
        raise ValueError("the demo needs at least one replica and one step")
    if config.backend not in DEMO_BACKENDS:
        raise KeyError(f"unknown demo backend {config.backend!r}; "
                       f"known: {sorted(DEMO_BACKENDS)}")
    timeline = timeline if timeline is not None else Timeline()
    ctx = multiprocessing.get_context("spawn")
    queues = [ctx.Queue() for _ in range(config.replicas + 1)]
    for step in range(1, config.steps + 1):
        queues[1].put(P2R(step=step))
        if config.replicas > 1:
            for rank in range(1, config.replicas + 1):
                queues[rank].put(R2R(step=step))
    for rank in range(1, config.replicas + 1):
        queues[rank].put(Stop())

    started = time.perf_counter()
    # The limit covers spawning (a few seconds each on a busy machine) and every step.
    limit = 60.0 + config.steps * (config.step_interval_s + 2.0)
    values = run_processes(_demo_process, config.replicas + 1,
                           (config, find_free_port(), queues), timeout_s=limit,
                           what="rollout-sync demo", intra_op_threads=1)
    wall_s = time.perf_counter() - started
    for q in queues:
        q.close()
        q.join_thread()
    merged = _Merged(trainer=values[0],
                     replicas=[values[r] for r in range(1, config.replicas + 1)])
    for value in values.values():
        timeline.extend(Timeline.from_records(value["spans"]).spans())
    return _report(config, merged, timeline, wall_s)


def _report(config: DistributedDemoConfig, merged: _Merged, timeline: Timeline,
            wall_s: float) -> dict[str, Any]:
    trainer, replicas = merged.trainer, merged.replicas
    overlaps = timeline.overlaps()
    egress = [o for o in overlaps if o.first.kind in (SpanKind.PAYLOAD_SEND,
                                                      SpanKind.PAYLOAD_RECV)]
    writes = [o for o in overlaps if o.first.kind == SpanKind.FORWARD]
    # The R2R source only reads its weights and is not paused; park times are the receivers'.
    receive_reports = [r for rep in replicas for r in rep["reports"]
                       if "send" not in r["handler"]]
    park = summarize([r["park_s"] for r in receive_reports])
    total = summarize([r["total_s"] for r in receive_reports])
    p2r_rates = [t["nbytes"] / 1e6 / t["total_s"] for t in trainer["transfers"]]
    r2r_rates = [t["nbytes"] / 1e6 / t["total_s"] for t in replicas[0]["transfers"]
                 if t["role"] == "send"] if config.replicas > 1 else []
    all_rates = p2r_rates + r2r_rates
    # Every version a replica received is compared with the trainer's weights of that version.
    # In sync mode every replica receives every version; async modes may skip superseded ones.
    step_mismatches = versions_checked = 0
    for rep in replicas:
        for version, digest in rep["digests"].items():
            versions_checked += 1
            if trainer["digests"].get(version) != digest:
                step_mismatches += 1
    final_identical = all(rep["final_digest"] == trainer["final_digest"] for rep in replicas)
    nbytes = config.num_tensors * config.numel * 4
    return {
        "mode": "multi_process",
        "sync_mode": config.mode.value,
        "backend": config.backend,
        "guarded": config.guarded,
        "replicas": config.replicas,
        "steps": config.steps,
        "syncs": sum(rep["syncs"] for rep in replicas),
        "failed_commands": sum(len(rep["failed"]) for rep in replicas),
        "forwards": sum(rep["forwards"] for rep in replicas),
        "torn_reads": sum(rep["torn_reads"] for rep in replicas),
        "egress_overlaps": len(egress),
        "write_forward_overlaps": len(writes),
        "payloads_sent": sum(rep["payloads_sent"] for rep in replicas),
        "generation_pauses": sum(rep["generation_pauses"] for rep in replicas),
        "installs": sum(rep["installs"] for rep in replicas),
        "superseded_versions": sum(rep["superseded"] for rep in replicas),
        "time_to_park_ms_p50": park.p50_ms,
        "time_to_park_ms_p99": park.p99_ms,
        "sync_ms_p50": total.p50_ms,
        "sync_ms_p99": total.p99_ms,
        "model_mb": nbytes / 1e6,
        "transfer_mb_per_s": percentile(all_rates, 50),
        "p2r_mb_per_s": percentile(p2r_rates, 50),
        "r2r_mb_per_s": percentile(r2r_rates, 50),
        "final_versions": [rep["final_version"] for rep in replicas],
        "versions_checked": versions_checked,
        "step_mismatches": step_mismatches,
        "bit_identical": final_identical and step_mismatches == 0,
        "wall_s": wall_s,
        "errors": [e.splitlines()[0] for rep in replicas for e in rep["failed"]][:5],
    }


def demo_config(**overrides: Any) -> DistributedDemoConfig:
    """The default config with ``overrides`` applied (a convenience for the CLI and tests)."""
    return replace(DistributedDemoConfig(), **overrides)
