"""The main job, multi-process: a trainer and N rollout replicas over gloo on loopback.

Process 0 is the trainer; processes ``1..N`` are rollout replicas. Nothing is simulated on the
paths the guard protects:

* **Generation.** Each replica is a :class:`~rollout_sync.RolloutWorker` whose engine generates
  on its own thread throughout the run. The default engine (``torch_lm``) is the tiny torch LM
  under the stream scheduler
  (:class:`~rollout_sync.backends.torch_lm.TorchLMStreamBackend`), kept fed with prompts of
  mixed length; its parameters are the served tensors that P2R and R2R write in
  place. A forward is torn when the LM's seqlock saw a write, or when its span overlaps a
  weight write in the timeline.
* **Payloads.** Every finished generation (token ids, logprobs, the weight version of each
  token, as tensors, plus small metadata) goes to the trainer through a
  :class:`~rollout_sync.PayloadSender` on the payload process groups
  (:func:`~rollout_sync.new_payload_groups`). The sender is the worker's ``data_packer``, so
  the guard holds it for every sync. The trainer takes them from a
  :class:`~rollout_sync.PayloadReceiver`.
* **Weights.** The trainer runs a training loop over the same TinyLM architecture: each step
  it takes the payloads that arrive (its stand-in for training on them), moves its weights (a
  perturbation, so every version differs), and a :class:`~rollout_sync.WeightBroadcastCallback`
  announces the step through a :class:`~rollout_sync.worker.WorkerCommandChannel` (P2R for the
  first replica, R2R for all) on the replicas' command queues on the rendezvous store
  and pushes the weights through a :class:`~rollout_sync.TransferWeightPusher`: the P2R
  barrier (the replica reaches it paused, with its sends held), then the trainer's
  ``hold_receives``, then the bucketed, validated :class:`~rollout_sync.WeightTransfer` send.
  ``step_end`` returns ``weight_sync_time_ms``, merged into the step's training metrics.

Every process records a timeline; the parent merges them and checks that no forward read torn
weights or overlapped a weight write, that no payload transfer overlapped a weight collective
or sync (on the replicas and on the trainer), that no payload was lost, and that every replica
ends (and, with ``check_every_step``, is after every version it received) bit-identical to the
trainer.

**Sharded** (``trainer_ranks`` or ``tp`` above 1; :mod:`rollout_sync.demos.sharded`): ranks
``0 .. trainer_ranks - 1`` are the trainer, each holding only its FSDP-style shard of the TinyLM
(every tensor cut along dim 0) and sending only its own regions; then each replica is ``tp``
consecutive ranks serving the model tensor-parallel, each rank under a worker of its own. The
replica's first rank (its leader) schedules, generates and ships payloads to the trainer's first
rank; the others mirror its steps. The trainer's first rank takes the payloads and announces
each sync on every replica rank's queue; every trainer rank pushes at once (a
:class:`~rollout_sync.transfer.ShardedTransfer` to the first replica's ranks, after a barrier
with them), then the first replica's ``k``-th rank sends its slice to every other replica's
``k``-th rank. The checks are the same, per rank: every replica rank's slice, and every trainer
rank's shards, against the trainer's whole model replayed from its seed.

The engine is chosen by name from the engines registered in :mod:`rollout_sync.backends`
(:func:`~rollout_sync.backends.register_engine`). :mod:`rollout_sync.demos.engines`, imported
here, registers three: ``torch_lm``
(the default), ``torn_read``, a fake model whose every tensor carries its version (it also runs
the async modes), and ``vllm`` (:mod:`rollout_sync.demos.vllm_replicas`, imported only when a
``vllm`` replica or trainer is built, so importing the demo imports neither it nor vLLM).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from ..backends import (
    LAUNCHERS,
    EngineHandle,
    registered_engine,
    registered_engines,
)
from ..backends.torch_lm.tensor_parallel import TensorParallel
from ..distributed import new_group
from ..errors import PayloadTimeout
from ..launch import (
    JobContext,
    JobLayout,
    StoreCommandQueue,
    results_on_trainer,
    torchrun_context,
)
from ..lora import require_adapter
from ..payload import (
    PayloadGroups,
    PayloadReceiver,
    PayloadSender,
    ReceivedPayload,
    new_payload_groups,
)
from ..sharded_groups import ShardedSyncGroups, build_sharded_sync_groups
from ..testing import (
    find_free_port,
    run_processes,
    weights_digest,
)
from ..trace import (
    Timeline,
)
from ..trainer import (
    CommandChannel,
    TrainerCallbacks,
    TransferWeightPusher,
    WeightBroadcastCallback,
)
from ..transfer import TransferConfig, TransferPlan, TransferStats
from ..worker import (
    CommandResult,
    RolloutWorker,
    SyncGroups,
    WorkerCommandChannel,
    build_sync_groups,
)
from .engines import streaming_lm, torch_lm_trainer_shards  # registers the demo's engines
from .job import (
    DEMO_ADAPTER,
    DistributedDemoConfig,
    build_engine,
    drift_each_step,
    register_demo_backend,
    trainer_adapter,
    trainer_model,
)
from .learning import LearningTrainer, NextTokenTrainer, check_learning_config, learning_engines
from .report import (
    add_process_spans,
    decode_step_ms_p50,
    park_steps,
    report_of,
    version_skew_ms_max,
)
from .sharded import (
    check_sharded_config,
    demo_layout,
    replica_layout,
    trainer_layout,
)

__all__ = [
    "LAUNCHED_AT_ENV",
    "LAUNCHERS",
    "DistributedDemoConfig",
    "add_process_spans",
    "check_delta_config",
    "check_demo_config",
    "decode_step_ms_p50",
    "demo_layout",
    "demo_limit_s",
    "demo_process",
    "drift_each_step",
    "park_steps",
    "register_demo_backend",
    "run_demo_under_torchrun",
    "run_distributed_demo",
    "version_skew_ms_max",
]


# -- the processes -----------------------------------------------------------------------------


def demo_process(context: JobContext, config: DistributedDemoConfig) -> dict[str, Any]:
    """One process of the demo, whatever placed it: the trainer or a replica, by rank.

    The launchers (local processes, torchrun, Ray) differ only in the :class:`JobContext`
    they give: every process joins the rendezvous in it, builds the same groups, and takes or
    puts its commands on the job's store. The context's layout must be the config's
    (:func:`~rollout_sync.demos.sharded.demo_layout`): with ``trainer_ranks`` or ``tp`` above
    1, the sharded job's.

    Raises:
        ValueError: the context's layout is not the config's.
    """
    expected = demo_layout(config)
    if config.sharded and context.layout != expected:
        raise ValueError(
            f"the sharded demo (trainer_ranks={config.trainer_ranks}, {config.replicas} "
            f"replicas, tp={config.tp}) runs on {expected.describe()}: {expected}; this "
            f"process was placed in {context.layout}"
        )
    if not config.sharded and (
        context.layout.is_sharded or context.layout.world_size != expected.world_size
    ):
        raise ValueError(
            f"the demo of {config.replicas} replicas runs on {expected.world_size} processes "
            f"(a trainer and one per replica); this process was placed in {context.layout}"
        )
    if config.sharded:
        return _sharded_process(context, config)
    context.join(timeout_s=config.timeout_s)
    layout = context.layout
    groups = build_sync_groups(layout.trainer, layout.replicas, timeout_s=config.timeout_s)
    # The control group's timeout is the longest a reader waits for the next frame, so it
    # must outlast any hold (payload/sender.py); credit expiry keeps an idle pair talking.
    payloads = new_payload_groups(timeout=config.timeout_s * 4)
    timeline = Timeline()
    queues = context.command_queues()
    if context.is_trainer:
        return _trainer(config, groups, payloads, queues, timeline)
    commands = queues[context.rank]
    try:
        return _replica(context.rank, config, groups, payloads, commands, timeline)
    finally:
        commands.close()


def _local_process(rank: int, config: DistributedDemoConfig, rendezvous: str) -> dict[str, Any]:
    layout = demo_layout(config)
    return demo_process(JobContext(rank, layout, rendezvous, launcher="local"), config)


class _Rollouts:
    """What the trainer does with the payloads it takes: counts them and checks them.

    ``stale`` is how many versions behind the trainer the oldest token of a payload was.
    ``invalid`` counts payloads whose tensors disagree in length or hold impossible logprobs.
    """

    def __init__(self) -> None:
        self.payloads = self.tokens = self.nbytes = self.invalid = 0
        self.stale: list[int] = []

    def take_for(
        self, receiver: PayloadReceiver, seconds: float, trainer_version: int
    ) -> dict[str, Any]:
        """Take what arrives for ``seconds``; the step's training metrics."""
        before = (self.payloads, self.tokens)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.add(receiver.get(left), trainer_version)
            except PayloadTimeout:
                break
        return {"rollouts": self.payloads - before[0], "rollout_tokens": self.tokens - before[1]}

    def add(self, payload: ReceivedPayload, trainer_version: int) -> None:
        self.payloads += 1
        self.nbytes += payload.nbytes
        versions = payload.tensors["weight_versions"]
        if versions.numel():
            self.stale.append(trainer_version - int(versions.min()))
        tokens = payload.tensors.get("tokens")
        logprobs = payload.tensors.get("logprobs")
        if tokens is not None:
            self.tokens += tokens.numel()
            if tokens.numel() != versions.numel() or (
                logprobs is not None
                and not (
                    logprobs.numel() == tokens.numel()
                    and bool(torch.isfinite(logprobs).all())
                    and bool((logprobs <= 0).all())
                )
            ):
                self.invalid += 1


def _trainer(
    config: DistributedDemoConfig,
    groups: SyncGroups,
    payloads: PayloadGroups,
    queues: Mapping[int, StoreCommandQueue],
    timeline: Timeline,
) -> dict[str, Any]:
    transfer = groups.p2r_transfer(config=_transfer_config(config), timeline=timeline)
    assert transfer is not None  # the trainer is the P2R source
    receiver = PayloadReceiver(
        payloads,
        groups.replicas,
        window=config.payload_window,
        timeline=timeline,
        default_timeout=config.timeout_s,
    )
    rollouts = _Rollouts()
    learning: LearningTrainer | None = None
    next_tokens: NextTokenTrainer | None = None
    train_step: Callable[[int, int], dict[str, Any]]
    if config.learn is not None:
        learning = LearningTrainer(config, receiver, rollouts.add)
        weights: Mapping[str, torch.Tensor] = learning.weights
        train_step = learning.step
    elif config.delta:  # real AdamW steps: what a delta sync ships is what training changes
        next_tokens = NextTokenTrainer(config)
        weights = next_tokens.weights
        base_nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        train_step = _drift_step(config, next_tokens.step, receiver, rollouts)
    else:
        weights, advance = trainer_model(config)
        base_nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        if config.lora:  # the replicas serve their own base model: only the adapter moves
            weights, advance = trainer_adapter(config)
        train_step = _drift_step(config, advance, receiver, rollouts)
    # Unguarded, the trainer keeps receiving payloads through its weight sends.
    pusher = TransferWeightPusher(
        transfer,
        barrier=groups.p2r_barrier,
        receiver=receiver if config.guarded else None,
        delta=config.delta,
        full_every=config.full_every,
    )
    channel = WorkerCommandChannel.for_groups(
        groups, queues, pipelined_relay=config.pipelined_relay
    )
    report = _train(config, weights, train_step, pusher, channel, receiver, rollouts, timeline)
    if learning is not None:
        return {**report, "learning": learning.report()}
    if next_tokens is not None:
        report = {**report, "next_tokens": next_tokens.report()}
    return {**report, "base_nbytes": base_nbytes}


def _drift_step(
    config: DistributedDemoConfig,
    advance: Callable[[int], None],
    receiver: PayloadReceiver | None,
    rollouts: _Rollouts,
) -> Callable[[int, int], dict[str, Any]]:
    """The default trainer's step: take the payloads that arrive for ``step_interval_s`` (its
    stand-in for training on them; a rank without a receiver just spends the time), then move
    the weights (``advance``: noise, or with ``delta`` an AdamW step)."""

    def train_step(step: int, version: int) -> dict[str, Any]:
        if receiver is not None:
            metrics = rollouts.take_for(receiver, config.step_interval_s, version)
        else:
            time.sleep(config.step_interval_s)  # this rank's stand-in for training
            metrics = {}
        advance(step)
        return metrics

    return train_step


def _train(
    config: DistributedDemoConfig,
    weights: Mapping[str, torch.Tensor],
    train_step: Callable[[int, int], dict[str, Any]],
    pusher: TransferWeightPusher,
    channel: CommandChannel | None,
    receiver: PayloadReceiver | None,
    rollouts: _Rollouts,
    timeline: Timeline,
) -> dict[str, Any]:
    """The training loop of a trainer rank, and its report: each step ``train_step(step,
    version)`` (``version``: the last one pushed, what the replicas serve at best) takes what it
    trains on (counted in ``rollouts``) and moves ``weights`` in place, and the
    rank pushes them through its callback (announced on ``channel``, if this rank announces);
    at the end the payloads still arriving on ``receiver`` are counted."""
    broadcast = WeightBroadcastCallback(
        lambda: weights,
        pusher=pusher,
        channel=channel,
        timeout=config.timeout_s,
        # The learning job pushes its initial weights first (version 1): that starts the
        # replicas' engines (the first sync does), and every replica then serves exactly the
        # trainer's weights.
        sync_on_run_begin=config.learn is not None,
        report_every_step=True,
        adapter=DEMO_ADAPTER if config.lora else None,
    )
    callbacks = TrainerCallbacks([broadcast])
    digests: dict[int, str] = {}
    step_metrics: list[dict[str, Any]] = []
    transfers: list[dict[str, Any]] = []
    if config.learn is not None and config.check_every_step:
        digests[broadcast.version + 1] = weights_digest(weights)
    callbacks.run_begin(1)
    # The push of the initial weights (sync_on_run_begin), apart: the steps' rates leave it out.
    first_push = None if pusher.last_stats is None else asdict(pusher.last_stats)
    for step in range(1, config.steps + 1):
        train_metrics = train_step(step, broadcast.version)
        if config.check_every_step:  # by the version this step's push will be
            digests[broadcast.version + 1] = weights_digest(weights)
        metrics = callbacks.step_end(step, None, True, train_metrics)
        assert metrics is not None  # report_every_step
        step_metrics.append(metrics)
        assert pusher.last_stats is not None
        transfers.append(asdict(pusher.last_stats))
    callbacks.train_end(config.steps)  # STOP (from the rank that announces): senders close
    received = lost = 0
    if receiver is not None:
        for payload in receiver.iter_payloads(config.timeout_s):
            rollouts.add(payload, config.steps)
        receiver.close(config.timeout_s)
        stats = receiver.statistics()
        received, lost = stats.received, stats.lost
    return {
        "role": "trainer",
        "pid": os.getpid(),
        "digests": digests,
        "final_digest": weights_digest(weights),
        "nbytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "transfers": transfers,
        "first_push": first_push,
        "step_metrics": step_metrics,
        "payloads_received": received,
        "payloads_lost": lost,
        "payloads_invalid": rollouts.invalid,
        "payload_bytes": rollouts.nbytes,
        "rollout_tokens": rollouts.tokens,
        "staleness": rollouts.stale,
        "spans": timeline.to_records(),
    }


def _replica(
    rank: int,
    config: DistributedDemoConfig,
    groups: SyncGroups,
    payloads: PayloadGroups,
    commands: StoreCommandQueue,
    timeline: Timeline,
) -> dict[str, Any]:
    sender = _payload_sender(config, payloads, groups.trainer, timeline)
    digests, on_transfer = _version_digests(config)
    engine: EngineHandle | None = None
    try:
        try:
            engine = build_engine(config, timeline, sender)
            transfer_config = _transfer_config(config)
            worker = RolloutWorker(
                engine.rollout,
                mode=config.mode,
                commands=commands,
                timeline=timeline,
                p2r=groups.p2r_transfer(config=transfer_config, timeline=timeline),
                p2r_barrier=groups.p2r_barrier,
                r2r=groups.r2r_transfer(config=transfer_config, timeline=timeline),
                data_packer=sender,
                weight_sync_timeout=config.timeout_s,
                guarded=config.guarded,
                on_transfer=on_transfer,
            )
            try:
                results = worker.run(idle_timeout_s=config.timeout_s * 4)
                # Async modes: let a safe point install the last version received first.
                worker.wait_for_install(config.timeout_s)
            finally:
                worker.close(config.timeout_s)
        finally:
            # Every payload registered is sent before the goodbye.
            sender.close(config.timeout_s)
        return _replica_report(
            rank, worker, engine, sender, results, digests, timeline, lora=config.lora
        )
    finally:
        if engine is not None:
            engine.close()


def _payload_sender(
    config: DistributedDemoConfig, payloads: PayloadGroups, trainer: int, timeline: Timeline
) -> PayloadSender:
    """A replica's sender of its finished generations to the trainer (rank ``trainer``)."""
    return PayloadSender(
        payloads,
        receiver_rank=trainer,
        capacity=config.payload_capacity,
        timeline=timeline,
        default_timeout=config.timeout_s,
    )


def _version_digests(
    config: DistributedDemoConfig,
) -> tuple[dict[int, str], Callable[[TransferStats, Mapping[str, torch.Tensor]], None]]:
    """A digest of every version this rank receives (with ``check_every_step``), and the
    worker's ``on_transfer`` that takes them: the worker calls it before anything else writes
    those tensors, so they hold exactly the version just received."""
    digests: dict[int, str] = {}

    def on_transfer(stats: TransferStats, tensors: Mapping[str, torch.Tensor]) -> None:
        if config.check_every_step and stats.role in ("receive", "relay"):
            digests[stats.version] = weights_digest(tensors)

    return digests, on_transfer


def _replica_report(
    rank: int,
    worker: RolloutWorker,
    engine: EngineHandle,
    sender: PayloadSender | None,
    results: Sequence[CommandResult],
    digests: Mapping[int, str],
    timeline: Timeline,
    *,
    lora: bool = False,
) -> dict[str, Any]:
    """One replica's part of the report; ``lora``: its weights are the demo's adapter."""
    sent = sender.statistics() if sender is not None else None
    slot_ok = True
    if lora:
        served = require_adapter(worker.rollout, DEMO_ADAPTER)
        tensors = served.served_adapter(DEMO_ADAPTER)
        final_digest = weights_digest(tensors)
        final_version = served.adapter_version(DEMO_ADAPTER)
        if hasattr(served, "read_adapter_slot"):
            # vLLM serves from its own slot, not from these host tensors: read it back.
            from ..backends.vllm.lora import adapter_slot_matches

            slot_ok = adapter_slot_matches(served, DEMO_ADAPTER, tensors)  # type: ignore[arg-type]
    else:
        final_digest = weights_digest(_received_weights(worker))
        final_version = worker.rollout.weight_version
    return {
        "role": "replica",
        "rank": rank,
        "pid": os.getpid(),
        "digests": digests,
        "final_digest": final_digest,
        "final_version": final_version,
        "engine_slot_matches": slot_ok,
        "weights_torn": worker.rollout.weights_torn,
        "counters": engine.counters(),
        "superseded": (
            worker.weight_buffer.statistics().superseded if worker.weight_buffer is not None else 0
        ),
        "payloads_registered": sent.registered if sent is not None else 0,
        "payloads_sent": sent.sent if sent is not None else 0,
        "failed": [r.error for r in results if not r.ok],
        "syncs": worker.statistics().syncs,  # results holds only the last `history`
        "transfers": [
            asdict(r.value) for r in results if r.ok and isinstance(r.value, TransferStats)
        ],
        "reports": [
            {"handler": s.handler, "paused": s.paused, **s.to_metrics(prefix="")}
            for s in worker.sync_reports
        ],
        # By the version committed (the model's or, with --lora, the adapter's).
        "commits": {
            r.value.version: r.committed_at
            for r in results
            if r.committed_at is not None and isinstance(r.value, TransferStats)
        },
        "spans": timeline.to_records(),
    }


def _transfer_config(config: DistributedDemoConfig) -> TransferConfig:
    return TransferConfig(
        bucket_bytes=config.bucket_bytes, checksums=config.checksums, timeout_s=config.timeout_s
    )


def _received_weights(worker: RolloutWorker) -> Mapping[str, torch.Tensor]:
    """What the replica received: the served tensors, or in async modes the buffer."""
    if worker.weight_buffer is not None:
        return worker.weight_buffer.tensors
    return worker.rollout.served_weights()


# -- the sharded job's processes ---------------------------------------------------------------


TP_GROUP_TIMEOUT_S = 3600.0
"""The tensor-parallel groups' own timeout: a follower waits on its replica's group for the
leader's next step for as long as generation idles. Every other wait on it is bounded by the
config's ``timeout_s`` (``TensorParallel.timeout_s``)."""


def _sharded_process(context: JobContext, config: DistributedDemoConfig) -> dict[str, Any]:
    """One process of the sharded job (:mod:`~rollout_sync.demos.sharded`): a trainer rank or
    a rank of a replica."""
    context.join(timeout_s=config.timeout_s)
    layout = context.layout
    # Every rank makes every group, in the same order: P2R and the R2R per position, each
    # replica's tensor-parallel group, then the payload groups (the trainer's first rank and
    # the replicas' leaders, the only ranks that ship payloads).
    groups = build_sharded_sync_groups(
        layout.trainers, layout.replica_groups, timeout_s=config.timeout_s
    )
    tp_groups = [
        new_group(ranks, timeout_s=TP_GROUP_TIMEOUT_S) if config.tp > 1 else None
        for ranks in layout.replica_groups
    ]
    payloads = new_payload_groups([layout.trainer, *layout.leaders], timeout=config.timeout_s * 4)
    target = replica_layout(config)
    plan = TransferPlan.between(trainer_layout(target.specs, config.trainer_ranks), target)
    in_p2r = context.rank in layout.trainers + layout.replica_groups[0]
    barrier = groups.p2r_barrier if in_p2r else None
    timeline = Timeline()
    if context.is_trainer:
        queues = context.command_queues() if context.rank == layout.trainer else {}
        return _sharded_trainer(
            context.rank, config, layout, groups, plan, barrier, payloads, queues, timeline
        )
    where = groups.position(context.rank)
    assert where is not None  # a replica rank
    commands = context.command_queues()[context.rank]
    try:
        tp_group = tp_groups[where[0]]
        tp = None if tp_group is None else TensorParallel.of(tp_group, timeout_s=config.timeout_s)
        return _sharded_replica(
            context.rank, config, layout, groups, plan, barrier, payloads, tp, commands, timeline
        )
    finally:
        commands.close()


def _sharded_trainer(
    rank: int,
    config: DistributedDemoConfig,
    layout: JobLayout,
    groups: ShardedSyncGroups,
    plan: TransferPlan,
    barrier: Callable[[float], None] | None,
    payloads: PayloadGroups,
    queues: Mapping[int, StoreCommandQueue],
    timeline: Timeline,
) -> dict[str, Any]:
    """A trainer rank: its shards, moved every step, pushed (its own regions) every step. The
    first rank also takes the payloads and announces the syncs."""
    index = layout.trainers.index(rank)
    own_layout, shards, advance = torch_lm_trainer_shards(config, index)
    if own_layout.describe() != plan.source.describe():
        raise RuntimeError("the trainer's shards are not laid out as the transfer plan says")
    transfer = groups.p2r_transfer(plan, config=_transfer_config(config), timeline=timeline)
    assert transfer is not None  # every trainer rank is a P2R source
    lead = rank == layout.trainer
    receiver = (
        PayloadReceiver(
            payloads,
            layout.leaders,
            window=config.payload_window,
            timeline=timeline,
            default_timeout=config.timeout_s,
        )
        if lead
        else None
    )
    # Unguarded, the first rank keeps receiving payloads through its weight sends.
    pusher = TransferWeightPusher(
        transfer, barrier=barrier, receiver=receiver if config.guarded else None
    )
    channel = (
        groups.command_channel(queues, pipelined_relay=config.pipelined_relay) if lead else None
    )
    rollouts = _Rollouts()
    train_step = _drift_step(config, advance, receiver, rollouts)
    report = _train(config, shards, train_step, pusher, channel, receiver, rollouts, timeline)
    return {**report, "rank": rank}


def _sharded_replica(
    rank: int,
    config: DistributedDemoConfig,
    layout: JobLayout,
    groups: ShardedSyncGroups,
    plan: TransferPlan,
    barrier: Callable[[float], None] | None,
    payloads: PayloadGroups,
    tp: TensorParallel | None,
    commands: StoreCommandQueue,
    timeline: Timeline,
) -> dict[str, Any]:
    """A rank of a replica: its slice of the stream LM under a worker of its own, which takes
    every sync of the replica. The leader (the replica's first rank) schedules, generates and
    ships payloads; a follower mirrors its steps."""
    where = groups.position(rank)
    assert where is not None
    replica, position = where
    sender = _payload_sender(config, payloads, layout.trainer, timeline) if position == 0 else None
    digests, on_transfer = _version_digests(config)  # of this rank's slice
    engine: EngineHandle | None = None
    try:
        try:
            engine = streaming_lm(config, timeline, sender, tp)
            transfer_config = _transfer_config(config)
            worker = RolloutWorker(
                engine.rollout,
                mode=config.mode,
                commands=commands,
                timeline=timeline,
                p2r=groups.p2r_transfer(
                    plan,
                    config=transfer_config,
                    timeline=timeline,
                    pipelined_relay=config.pipelined_relay,
                ),
                p2r_barrier=barrier,
                r2r=groups.r2r_transfer(config=transfer_config, timeline=timeline),
                data_packer=sender,
                weight_sync_timeout=config.timeout_s,
                guarded=config.guarded,
                on_transfer=on_transfer,
            )
            try:
                results = worker.run(idle_timeout_s=config.timeout_s * 4)
            finally:
                worker.close(config.timeout_s)
        finally:
            if sender is not None:  # every payload registered is sent before the goodbye
                sender.close(config.timeout_s)
        report = _replica_report(rank, worker, engine, sender, results, digests, timeline)
        return {**report, "replica": replica, "position": position}
    finally:
        if engine is not None:
            engine.close()


# -- the controller ----------------------------------------------------------------------------


LAUNCHED_AT_ENV = "ROLLOUT_SYNC_DEMO_LAUNCHED_AT"
"""Set by ``rollout-sync demo --launcher torchrun`` when it starts torchrun itself: the wall
clock time it did, so the report's ``wall_s`` includes torchrun's start as the other launchers'
include theirs."""


def check_demo_config(config: DistributedDemoConfig) -> None:
    """Refuse, before anything starts, a config the demo cannot run.

    Raises:
        KeyError: ``config.backend`` is not a registered engine (the message lists those that
            are).
        ValueError: no replica or step, an engine registered without a trainer model, or a
            sync mode the engine does not run; ``lora`` on an engine that serves no adapter,
            sharded or in an async mode; sharded
            (:func:`~rollout_sync.demos.sharded.check_sharded_config`): ``trainer_ranks`` or
            ``tp`` below 1, an engine other than torch_lm or a mode other than sync, a ``tp``
            that does not divide the model; ``learn``
            (:func:`~rollout_sync.demos.learning.check_learning_config`); ``delta``
            (:func:`check_delta_config`).
    """
    if config.replicas < 1 or config.steps < 1:
        raise ValueError("the demo needs at least one replica and one step")
    engine = registered_engine(config.backend)
    check_sharded_config(config)
    if engine.trainer_model is None:
        raise ValueError(
            f"engine {config.backend!r} was registered without a trainer_model: the demo's "
            "trainer needs one (register_engine(..., trainer_model=...))"
        )
    if config.mode not in engine.modes:
        raise ValueError(
            f"engine {config.backend!r} runs the sync modes "
            f"{sorted(m.value for m in engine.modes)}, not {config.mode.value!r}"
        )
    if config.lora:
        if engine.adapter is None:
            lora_engines = [
                n for n in registered_engines() if registered_engine(n).adapter is not None
            ]
            raise ValueError(
                f"engine {config.backend!r} serves no LoRA adapter (lora: {lora_engines})"
            )
        if config.sharded or config.mode.is_async:
            raise ValueError("the LoRA demo runs the plain job in sync or staged mode")
    if config.learn is not None:
        check_learning_config(config)
    check_delta_config(config)


def check_delta_config(config: DistributedDemoConfig) -> None:
    """Refuse delta options the job cannot run (``delta``, ``full_every``, ``delta_lr``).

    A delta sync needs a trainer whose versions a delta can encode: the plain job's (the
    sharded job's trainer ranks move their shards by seeded noise, with no AdamW master), the
    whole model (an adapter goes whole), and an engine registered with a learner (without
    ``learn`` the trainer takes AdamW steps on its master).

    Raises:
        ValueError: ``full_every`` without ``delta`` or below 1, a negative ``delta_lr``, or
            ``delta`` with ``trainer_ranks`` or ``tp`` above 1, ``lora``, or an engine without
            a learner.
    """
    if config.full_every is not None and (not config.delta or config.full_every < 1):
        raise ValueError(
            f"full_every is the keyframe interval of delta syncs: pass delta=True and "
            f"full_every >= 1, not {config.full_every!r}"
        )
    if not config.delta:
        return
    if not config.delta_lr >= 0:
        raise ValueError(f"delta_lr must be at least 0, not {config.delta_lr!r}")
    if config.sharded:
        raise ValueError(
            "delta syncs run on the plain job: the sharded job's trainer ranks have no AdamW "
            "master to take small steps"
        )
    if config.lora:
        raise ValueError("delta syncs move the whole model's changes; an adapter moves whole")
    if registered_engine(config.backend).learner is None:
        raise ValueError(
            f"delta syncs train the master of an engine registered with a learner; engine "
            f"{config.backend!r} has none (delta: {learning_engines()})"
        )


def demo_limit_s(config: DistributedDemoConfig) -> float:
    """The limit of a whole run: spawning (a few seconds each on a busy machine), starting the
    engines (the engine's registered ``start_s``) and steps; a
    sharded job's processes beyond the plain job's (``replicas + 1``) add to both."""
    start_s = registered_engine(config.backend).start_s
    extra = max(0, demo_layout(config).world_size - (config.replicas + 1))
    step_s = config.step_interval_s + 2.0 + 0.5 * extra
    return 60.0 + 5.0 * extra + start_s + config.steps * step_s


def run_distributed_demo(
    config: DistributedDemoConfig,
    timeline: Timeline | None = None,
    *,
    launcher: str = "local",
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run the demo on ``replicas + 1`` processes (sharded: ``trainer_ranks + replicas * tp``,
    :func:`~rollout_sync.demos.sharded.demo_layout`) and return its report.

    Args:
        launcher: ``"local"`` spawns the processes here; ``"ray"`` runs them as Ray actors
            (:class:`~rollout_sync.launch.ray.RayJob`: a local cluster for the run, or
            the one at ``ray_address``). Under torchrun, every rank calls
            :func:`run_demo_under_torchrun` instead.

    Raises:
        GroupProcessError: a process failed or overstayed (its traceback is in the message).
        KeyError / ValueError: see :func:`check_demo_config`; ``ValueError`` for an unknown
            launcher too.
    """
    check_demo_config(config)
    if launcher not in ("local", "ray"):
        raise ValueError(
            f"run_distributed_demo launches 'local' or 'ray', not {launcher!r} (under torchrun "
            "every rank calls run_demo_under_torchrun)"
        )
    timeline = timeline if timeline is not None else Timeline()
    layout = demo_layout(config)
    started = time.perf_counter()
    if launcher == "local":
        values = run_processes(
            _local_process,
            layout.world_size,
            (config, f"tcp://127.0.0.1:{find_free_port()}"),
            timeout_s=demo_limit_s(config),
            what="rollout-sync demo",
            intra_op_threads=1,
            daemon=not registered_engine(config.backend).starts_processes,
        )
    else:
        from ..launch.ray import RayJob

        with RayJob(layout, address=ray_address, timeout_s=demo_limit_s(config)) as job:
            values = job.run(demo_process, config)
    return report_of(config, values, timeline, time.perf_counter() - started, launcher)


def run_demo_under_torchrun(
    config: DistributedDemoConfig, timeline: Timeline | None = None
) -> dict[str, Any] | None:
    """This rank's part of the demo under torchrun: the report on the trainer, ``None`` on
    the replicas (each rank's results are gathered on the trainer over the default group;
    sharded, on the trainer's first rank, and ``None`` on its others).

    Raises:
        ValueError: torchrun started another number of processes than the config's layout
            has (:func:`~rollout_sync.demos.sharded.demo_layout`).
    """
    check_demo_config(config)
    started = time.perf_counter()
    launched_at = os.environ.get(LAUNCHED_AT_ENV)
    if launched_at is not None:  # rollout-sync started torchrun: count torchrun's start too
        started -= time.time() - float(launched_at)
    context = torchrun_context(layout=demo_layout(config))  # ValueError: another world size
    value = demo_process(context, config)
    try:
        values = results_on_trainer(context, value)
    finally:
        dist.destroy_process_group()
    if values is None:
        return None
    timeline = timeline if timeline is not None else Timeline()
    return report_of(config, values, timeline, time.perf_counter() - started, "torchrun")
