"""The main job with a Fast-LLM trainer: ``rollout-sync demo --trainer fast-llm``.

A real ``redis-server`` (started here on a free port, stopped at the end) carries the control
plane; every process is spawned locally:

* **The trainer** (process 0) speaks Fast-LLM's protocol byte for byte
  (:class:`~rollout_sync.testing.fast_llm_trainer.FastLLMTrainerStandIn`): it hosts the
  broadcast group's store, announces ``weights_ready`` on ``fast_llm_events`` before every
  broadcast (once at the start, then after every step), broadcasts each tensor as length /
  pickled header / tensor, ends with ``pickle.dumps(None)`` and sends ``training_finished``.
  Each step it reads the rollouts that arrived on ``fast_llm_streaming`` (consumer group
  ``fast_llm_group``; its stand-in for training on them), counts them as documents seen, and
  moves its weights (a TinyLM).
* **Replica 1** joins the trainer's group and receives each version through a
  :class:`~rollout_sync.integrations.fast_llm.FastLLMReceiver` inside the guard's bracket, then
  passes it on R2R with the package's transfer to the other replicas, which run a receiver
  without a group on the same events. Every replica streams generations from the tiny torch LM
  throughout and ships each as a ``fast_llm_streaming`` record (tokens, logprobs, the version
  of every token in ``documents_seen`` units) through a
  :class:`~rollout_sync.integrations.fast_llm.FastLLMRolloutSender`, which the guard holds.
  With ``mode=SyncMode.STAGED`` (``--staged``) every receiver stages each version while its
  engine generates and parks it only for the install.

The report has the default demo's keys where they apply, and ``staleness_p50`` /
``staleness_max`` (``documents_seen - model_version`` of each rollout's oldest token when the
trainer read it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..distributed import standalone_group
from ..errors import ShutdownTimeout
from ..integrations.fast_llm import FastLLMReceiver, FastLLMRolloutSender, ReceivedVersion
from ..integrations.fast_llm_wire import ROLLOUTS_GROUP, ROLLOUTS_STREAM, decode_rollout
from ..metrics import percentile
from ..sync.mode import SyncMode
from ..testing import find_free_port, run_processes, weights_digest
from ..testing.fast_llm_trainer import FastLLMTrainerStandIn
from ..testing.redis_server import RedisServer
from ..trace import SpanKind, Timeline, torn_forwards
from ..transfer import TransferConfig, WeightTransfer
from .distributed import DistributedDemoConfig, demo_limit_s
from .engines import torch_lm_trainer
from .report import add_process_spans, decode_step_ms_p50, park_steps
from .streaming_lm import StreamingLM

__all__ = ["FastLLMDemoConfig", "run_fast_llm_demo"]

_DONE_KEY = "rollout_sync_demo:replica_done:{rank}"


@dataclass(frozen=True)
class FastLLMDemoConfig:
    """Knobs of the Fast-LLM demo (the generation and model knobs are the default demo's)."""

    replicas: int = 3
    steps: int = 30
    guarded: bool = True
    mode: SyncMode = SyncMode.SYNC
    """``SYNC`` (paused for each whole receive) or ``STAGED`` (paused for each install)."""
    step_interval_s: float = 0.1
    """The trainer's training step: it reads the rollouts that arrive for this long."""
    timeout_s: float = 30.0
    demo: DistributedDemoConfig = field(default_factory=DistributedDemoConfig)
    redis_url: str = ""
    group_port: int = 0
    r2r_port: int = 0


class _RedisShipper:
    """What the streaming LM ships through: each finished generation as a Fast-LLM record."""

    def __init__(self, sender: FastLLMRolloutSender) -> None:
        self.sender = sender

    def register_payload(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, timeout: float
    ) -> None:
        self.sender.submit(
            tensors["tokens"],
            tensors["logprobs"],
            tensors["weight_versions"],
            {"reward": 0.0, "advantage": 0.0, "prompt_tokens": meta["prompt_tokens"]},
            timeout=timeout,
        )


def _process(rank: int, config: FastLLMDemoConfig) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(config.redis_url, socket_timeout=config.timeout_s)
    if rank == 0:
        return _trainer(config, client)
    return _replica(rank, config, client)


def _trainer(config: FastLLMDemoConfig, client: Any) -> dict[str, Any]:
    weights, advance = torch_lm_trainer(config.demo)
    client.xgroup_create(ROLLOUTS_STREAM, ROLLOUTS_GROUP, id="0", mkstream=True)
    trainer = FastLLMTrainerStandIn(
        client, host="127.0.0.1", port=config.group_port, timeout_s=config.timeout_s
    )
    trainer.connect()  # as Fast-LLM's callback does when it is built: waits for replica 1
    documents_seen = 0
    staleness: list[int] = []
    received = tokens = 0
    digests: dict[int, str] = {}
    push_ms: list[float] = []

    def take(block_ms: int) -> int:
        nonlocal received, tokens
        answer = client.xreadgroup(
            ROLLOUTS_GROUP, "trainer", {ROLLOUTS_STREAM: ">"}, count=256, block=block_ms
        )
        taken = 0
        for _, entries in answer or ():
            for _, fields in entries:
                rollout = decode_rollout(fields)
                staleness.append(rollout.staleness(documents_seen))
                tokens += rollout.tokens.numel()
                taken += 1
        received += taken
        return taken

    def push(step: int) -> None:
        digests[documents_seen] = weights_digest(weights)
        start = time.perf_counter()
        trainer.push(step, documents_seen, weights)
        push_ms.append((time.perf_counter() - start) * 1e3)

    push(0)  # run_begin: the initial weights, before any generation
    for step in range(1, config.steps + 1):
        deadline = time.monotonic() + config.step_interval_s
        taken = 0
        while (left := deadline - time.monotonic()) > 0:
            taken += take(max(1, int(left * 1000)))
        documents_seen += max(1, taken)  # a step trains on at least one document
        advance(step)
        push(step)
    trainer.training_finished()
    # Every replica sends what it has, then says so; then the stream is drained.
    deadline = time.monotonic() + config.timeout_s
    for rank in range(1, config.replicas + 1):
        while not client.exists(_DONE_KEY.format(rank=rank)):
            if time.monotonic() > deadline:
                raise ShutdownTimeout(f"replica {rank} did not finish within {config.timeout_s} s")
            take(50)
    while take(50):
        pass
    trainer.close()
    return {
        "role": "trainer",
        "digests": digests,
        "final_digest": weights_digest(weights),
        "final_version": documents_seen,
        "received": received,
        "tokens": tokens,
        "staleness": staleness,
        "push_ms": push_ms,
        "nbytes": sum(t.numel() * t.element_size() for t in weights.values()),
    }


def _replica(rank: int, config: FastLLMDemoConfig, client: Any) -> dict[str, Any]:
    timeline = Timeline()
    sender = FastLLMRolloutSender(client, timeline=timeline, default_timeout=config.timeout_s)
    engine = StreamingLM(config.demo, timeline, _RedisShipper(sender), seed=1009 * rank)  # type: ignore[arg-type]
    digests: dict[int, str] = {}

    def on_version(received: ReceivedVersion, served: Mapping[str, torch.Tensor]) -> None:
        digests[received.version] = weights_digest(served)

    receiver = FastLLMReceiver(
        engine,
        redis=client,
        group_address=("127.0.0.1", config.group_port) if rank == 1 else None,
        data_packer=sender,
        timeline=timeline,
        timeout_s=config.timeout_s,
        mode=config.mode,
        guarded=config.guarded,
        on_version=on_version,
    )
    # Every receiver notes where the event stream ends before the trainer can announce
    # anything: the others before the R2R group forms, replica 1 (whose join the trainer waits
    # for before its first announcement) after it.
    if rank != 1:
        receiver.connect()
    r2r: WeightTransfer | None = None
    if config.replicas > 1:
        group = standalone_group(
            "127.0.0.1", config.r2r_port, rank - 1, config.replicas, timeout_s=config.timeout_s
        )
        receiver.r2r = WeightTransfer(
            group, 0, config=TransferConfig(timeout_s=config.timeout_s), timeline=timeline
        )
        r2r = receiver.r2r
    if rank == 1:
        receiver.connect()
    error: str | None = None
    try:
        receiver.serve(idle_timeout_s=config.timeout_s * 4, poll_s=0.2)
    except Exception as exc:  # noqa: BLE001 - reported, and the verdict fails on it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        receiver.close()
        try:
            receiver.stop_engine(config.timeout_s)
        finally:
            try:
                sender.close(config.timeout_s)
            finally:
                client.set(_DONE_KEY.format(rank=rank), 1)
    stats = engine.statistics()
    return {
        "role": "replica",
        "rank": rank,
        "error": error,
        "digests": digests,
        "final_digest": weights_digest(engine.served_weights()),
        "final_version": engine.weight_version,
        "syncs": receiver.versions_received * (2 if r2r and r2r.is_source else 1),
        "forwards": stats.forwards,
        "torn_forwards": stats.torn_forwards,
        "sent": sender.sent,
        "failed_sends": sender.failed,
        "reports": [
            {"handler": s.handler, **s.to_metrics(prefix="")} for s in receiver.sync_reports
        ],
        "spans": timeline.to_records(),
        **engine.results,
    }


def run_fast_llm_demo(
    config: FastLLMDemoConfig, timeline: Timeline | None = None
) -> dict[str, Any]:
    """Start redis-server, run the trainer and the replicas, stop it; the report.

    Raises:
        RedisUnavailableError: no redis-server or redis client.
        GroupProcessError: a process failed or overstayed.
    """
    if config.replicas < 1 or config.steps < 1:
        raise ValueError("the demo needs at least one replica and one step")
    timeline = timeline if timeline is not None else Timeline()
    started = time.perf_counter()
    with RedisServer() as server:
        config = replace(
            config,
            redis_url=server.url,
            group_port=find_free_port(),
            r2r_port=find_free_port(),
            demo=replace(config.demo, timeout_s=config.timeout_s),
        )
        values = run_processes(
            _process,
            config.replicas + 1,
            (config,),
            timeout_s=demo_limit_s(
                replace(config.demo, steps=config.steps, step_interval_s=config.step_interval_s)
            ),
            what="rollout-sync demo --trainer fast-llm",
            intra_op_threads=1,
        )
    return _report(config, values, timeline, time.perf_counter() - started)


def _report(
    config: FastLLMDemoConfig,
    values: Mapping[int, dict[str, Any]],
    timeline: Timeline,
    wall_s: float,
) -> dict[str, Any]:
    trainer = values[0]
    replicas = [values[r] for r in range(1, config.replicas + 1)]
    for rank, rep in enumerate(replicas, start=1):
        add_process_spans(timeline, rep["spans"], f"replica {rank}")
    overlaps = timeline.overlaps()
    egress = [o for o in overlaps if o.first.kind == SpanKind.PAYLOAD_SEND]
    forward_writes = [o for o in overlaps if o.first.kind == SpanKind.FORWARD]
    torn = torn_forwards(timeline.spans(SpanKind.FORWARD), forward_writes)
    # The R2R source only reads its weights and is not paused; phases are the receivers'.
    reports = [r for rep in replicas for r in rep["reports"] if "send" not in r["handler"]]
    mismatches = checked = 0
    for rep in replicas:
        for version, digest in rep["digests"].items():
            checked += 1
            mismatches += trainer["digests"].get(version) != digest
    final_identical = all(rep["final_digest"] == trainer["final_digest"] for rep in replicas)
    sent = sum(rep["sent"] for rep in replicas)
    decode_step = decode_step_ms_p50(timeline)

    def phase(key: str, q: float) -> float:
        return percentile([r[key] for r in reports], q)

    # Generation stalls once per receiving replica and version: for the whole receive, or for
    # the install alone when staged.
    stalls = [r["stall_ms"] for r in reports]
    errors = [rep["error"] for rep in replicas if rep["error"]]
    return {
        "mode": "multi_process",
        "sync_mode": config.mode.value,
        "trainer": "fast-llm",
        "backend": "torch_lm",
        "guarded": config.guarded,
        "replicas": config.replicas,
        "steps": config.steps,
        "syncs": sum(rep["syncs"] for rep in replicas),
        "failed_commands": len(errors),
        "forwards": sum(rep["forwards"] for rep in replicas),
        "torn_reads": len(torn),
        "torn_forwards_detected": sum(rep["torn_forwards"] for rep in replicas),
        "forward_write_overlaps": len(forward_writes),
        "egress_overlaps": len(egress),
        "payloads_sent": sent,
        "payloads_received": trainer["received"],
        "payloads_lost": sent - trainer["received"] + sum(rep["failed_sends"] for rep in replicas),
        "rollout_tokens": trainer["tokens"],
        "staleness_p50": percentile(trainer["staleness"], 50),
        "staleness_max": max(trainer["staleness"], default=0),
        "results_straddled_sync": sum(rep["results_straddled_sync"] for rep in replicas),
        "time_to_park_ms_p50": phase("time_to_park_ms", 50),
        "time_to_park_ms_p99": phase("time_to_park_ms", 99),
        "decode_step_ms_p50": decode_step,
        "park_steps_p99": park_steps(phase("time_to_park_ms", 99), decode_step),
        "sync_ms_p50": phase("sync_total_ms", 50),
        "sync_ms_p99": phase("sync_total_ms", 99),
        "stall_ms_p50": percentile(stalls, 50),
        "stall_ms_p99": percentile(stalls, 99),
        "weight_sync_time_ms_p50": percentile(trainer["push_ms"], 50),
        "weight_sync_time_ms_p99": percentile(trainer["push_ms"], 99),
        "model_mb": trainer["nbytes"] / 1e6,
        "final_versions": [rep["final_version"] for rep in replicas],
        "documents_seen": trainer["final_version"],
        "versions_checked": checked,
        "step_mismatches": mismatches,
        "bit_identical": final_identical and mismatches == 0,
        "wall_s": wall_s,
        "errors": [e.splitlines()[0] for e in errors][:5],
    }
