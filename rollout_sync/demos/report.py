"""The main job's report: what the trainer's and the replicas' values, and their merged
timeline, say about a run (torn reads, overlaps, payloads, timings, rates, bit-identical
checks, with ``--learn`` the learning keys, with ``--delta`` the delta keys). :func:`report_of`
is what every launcher's run ends with (:mod:`rollout_sync.demos.distributed`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..launch import JobLayout
from ..metrics import percentile
from ..trace import (
    SpanKind,
    Timeline,
    split_overlaps,
    step_intervals_ms,
    token_rates_in_windows,
    torn_forwards,
)
from ..transfer.delta_sync import WholeReason
from .job import DistributedDemoConfig
from .learning import learning_report
from .sharded import demo_layout, expected_digests

__all__ = [
    "add_process_spans",
    "decode_step_ms_p50",
    "delta_report",
    "park_steps",
    "report_of",
    "version_skew_ms_max",
]


def park_steps(park_ms: float, decode_step_ms: float) -> float:
    """A time to park in decode steps (``nan`` without a decode step to measure it by)."""
    return park_ms / decode_step_ms if decode_step_ms > 0 else math.nan


def report_of(
    config: DistributedDemoConfig,
    values: Mapping[int, dict[str, Any]],
    timeline: Timeline,
    wall_s: float,
    launcher: str,
) -> dict[str, Any]:
    layout = demo_layout(config)
    if config.sharded:
        return {"launcher": launcher, **_sharded_report(config, layout, values, timeline, wall_s)}
    for rank, value in values.items():
        add_process_spans(
            timeline, value["spans"], "trainer" if rank == layout.trainer else f"replica {rank}"
        )
    trainer = values[layout.trainer]
    replicas = [values[r] for r in layout.replicas]
    report = _report(config, trainer, replicas, timeline, wall_s, _plain_checks(trainer, replicas))
    if config.learn is not None:
        pids = [rep["pid"] for rep in replicas]
        report = {**report, **learning_report(trainer, pids, timeline)}
    if config.delta:
        report = {**report, **delta_report(trainer, replicas)}
    return {"launcher": launcher, **report}


def delta_report(
    trainer: Mapping[str, Any], replicas: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The report's delta keys, over every version every replica received (its
    :class:`~rollout_sync.transfer.TransferStats`, P2R or R2R: one per replica and version).

    ``delta_syncs`` / ``full_syncs``: the versions that came by delta / whole;
    ``delta_bytes_over_full_p50``: over the delta ones, the bytes moved over the whole
    version's, at the median (``None`` without a delta); ``full_sync_reasons``: why the whole
    ones went whole, counted by :class:`~rollout_sync.transfer.delta_sync.WholeReason` name
    (``first``, ``keyframe``, ``not_smaller``, ...). A replica that took a version whole over
    R2R because its source took it whole from the trainer (the R2R passes on what the P2R
    brought) counts the trainer's reason for that version. With ``--delta`` and no ``--learn``,
    ``changed_fraction_p50``: the share of served elements a training step changed, at the
    median (the learning keys have it with ``--learn``)."""
    pushes = [
        *([trainer["first_push"]] if trainer.get("first_push") else []),
        *trainer["transfers"],
    ]
    sent = {t["version"]: t.get("whole_reason") for t in pushes}
    received = [
        t for rep in replicas for t in rep["transfers"] if t["role"] in ("receive", "relay")
    ]
    deltas = [t for t in received if t.get("sync_kind") == "delta"]
    reasons = Counter(
        _reason_name(t.get("whole_reason") or sent.get(t["version"]))
        for t in received
        if t.get("sync_kind") != "delta"
    )
    ratios = [t["nbytes"] / t["full_nbytes"] for t in deltas if t.get("full_nbytes")]
    out: dict[str, Any] = {
        "delta_syncs": len(deltas),
        "full_syncs": len(received) - len(deltas),
        "delta_bytes_over_full_p50": percentile(ratios, 50) if ratios else None,
        "full_sync_reasons": dict(reasons.most_common()),
    }
    changed = trainer.get("next_tokens", {}).get("changed_fractions")
    if changed is not None:
        out["changed_fraction_p50"] = percentile(changed, 50)
    return out


def _reason_name(reason: str | None) -> str:
    """A :class:`WholeReason`'s value by its name (``"first"``); another text as it is."""
    if reason is None:
        return "not_given"
    try:
        return WholeReason(reason).name.lower()
    except ValueError:
        return reason


def _sharded_report(
    config: DistributedDemoConfig,
    layout: JobLayout,
    values: Mapping[int, dict[str, Any]],
    timeline: Timeline,
    wall_s: float,
) -> dict[str, Any]:
    for rank, value in values.items():
        if rank in layout.trainers:
            name = f"trainer rank {layout.trainers.index(rank)}"
        else:
            name = f"replica {value['replica']} rank {value['position']}"
        add_process_spans(timeline, value["spans"], name)
    trainers = [values[r] for r in layout.trainers]
    replicas = [values[r] for r in layout.replicas]
    checks = _sharded_checks(config, trainers, replicas)
    return _report(config, trainers[0], replicas, timeline, wall_s, checks)


@dataclass(frozen=True)
class _Checks:
    """What the report says about the weights: the plain job's or the sharded job's."""

    versions_checked: int
    step_mismatches: int
    final_identical: bool
    final_versions: list[int]
    syncs: int
    """Per replica (a replica of several ranks counts once)."""
    model_nbytes: int
    p2r_rates: list[float]
    r2r_rates: list[float]
    trainer_shard_mismatches: int | None = None
    """Sharded: trainer rank versions (and final shards) that differ from the replay."""


def _rate(transfers: Sequence[Mapping[str, Any]]) -> float:
    """MB/s of transfers that ran at once: all their bytes over the slowest one's time."""
    nbytes: float = sum(t["nbytes"] for t in transfers)
    seconds: float = max(t["total_s"] for t in transfers)
    return nbytes / 1e6 / seconds


def _plain_checks(trainer: dict[str, Any], replicas: list[dict[str, Any]]) -> _Checks:
    """Every version a replica received compared with the trainer's weights of that version.
    In sync mode every replica receives every version; async modes may skip superseded ones."""
    step_mismatches = versions_checked = 0
    for rep in replicas:
        for version, digest in rep["digests"].items():
            versions_checked += 1
            if trainer["digests"].get(version) != digest:
                step_mismatches += 1
    r2r = [t for t in replicas[0]["transfers"] if t["role"] in ("send", "relay")]
    return _Checks(
        versions_checked=versions_checked,
        step_mismatches=step_mismatches,
        final_identical=all(
            rep["final_digest"] == trainer["final_digest"] and rep.get("engine_slot_matches", True)
            for rep in replicas
        ),
        final_versions=[rep["final_version"] for rep in replicas],
        syncs=sum(rep["syncs"] for rep in replicas),
        model_nbytes=trainer.get("base_nbytes", trainer["nbytes"]),
        p2r_rates=[_rate([t]) for t in trainer["transfers"]],
        r2r_rates=[_rate([t]) for t in r2r] if len(replicas) > 1 else [],
    )


def _sharded_checks(
    config: DistributedDemoConfig, trainers: list[dict[str, Any]], replicas: list[dict[str, Any]]
) -> _Checks:
    """Every replica rank's slice, at every version it received and at the end, compared with
    that slice of the trainer's whole model, replayed from its seed; and every trainer rank's
    shards at every version and at the end with the replay's (so the replay is what the
    trainer held). A sync's rate: the bytes of all its senders over the slowest one's time."""
    expected = expected_digests(config)
    step_mismatches = versions_checked = 0
    for rep in replicas:
        for version, digest in rep["digests"].items():
            versions_checked += 1
            want = expected.replica.get(version)
            if want is None or want[rep["position"]] != digest:
                step_mismatches += 1
    shard_mismatches = 0
    for index, trainer in enumerate(trainers):
        for version, digest in trainer["digests"].items():
            shard_mismatches += expected.trainer[version][index] != digest
        shard_mismatches += expected.trainer[config.steps][index] != trainer["final_digest"]
    final = expected.replica[config.steps]
    leaders = [rep for rep in replicas if rep["position"] == 0]

    def rates(transfers: list[dict[str, Any]]) -> list[float]:
        by_version: dict[int, list[dict[str, Any]]] = {}
        for t in transfers:
            by_version.setdefault(t["version"], []).append(t)
        return [_rate(ts) for _, ts in sorted(by_version.items())]

    first = [rep for rep in replicas if rep["replica"] == 0]
    r2r = [t for rep in first for t in rep["transfers"] if t["role"] in ("send", "relay")]
    return _Checks(
        versions_checked=versions_checked,
        step_mismatches=step_mismatches,
        final_identical=all(rep["final_digest"] == final[rep["position"]] for rep in replicas),
        final_versions=[rep["final_version"] for rep in leaders],
        syncs=sum(rep["syncs"] for rep in leaders),
        model_nbytes=expected.model_nbytes,
        p2r_rates=rates([t for trainer in trainers for t in trainer["transfers"]]),
        r2r_rates=rates(r2r) if config.replicas > 1 else [],
        trainer_shard_mismatches=shard_mismatches,
    )


def decode_step_ms_p50(timeline: Timeline) -> float:
    """The replicas' decode step, at the median: the interval between two consecutive model
    forwards of one process (vLLM's ``forward`` spans, the torch LM's ``... decode step``
    spans), intervals that hold a pause left out; NaN without two forwards."""
    steps = [
        s
        for s in timeline.spans(SpanKind.FORWARD)
        if s.name == "forward" or s.name.endswith("decode step")
    ]
    return percentile(step_intervals_ms(steps, gaps=timeline.spans(SpanKind.PAUSE)), 50)


def version_skew_ms_max(commits: Sequence[Mapping[int, float]]) -> float:
    """The longest time two replicas served different versions after a commit, in ms.

    ``commits`` is each replica's ``{version: CommandResult.committed_at}``. A replica serves
    version ``v`` (or newer) from the first time it committed ``v`` or a later version; per
    version, the skew is the spread of those times over the replicas that got there, and this
    is the largest. A replica that never reached ``v`` is left out of it: it had no later
    commit to measure to (a sync whose version some replicas never served is what
    ``benchmarks/chaos.py`` counts as ``mixed_versions``). 0 with one replica; NaN with no
    commit."""
    versions = {v for c in commits for v in c}
    spreads = []
    for version in versions:
        reached = [
            min((t for v, t in c.items() if v >= version), default=math.inf) for c in commits
        ]
        times = [t for t in reached if math.isfinite(t)]
        spreads.append(max(times) - min(times))
    return max(spreads) * 1e3 if spreads else math.nan


def add_process_spans(timeline: Timeline, records: Sequence[dict[str, Any]], name: str) -> None:
    """Merge one process's spans (:meth:`~rollout_sync.Timeline.to_records`) into ``timeline``
    and name their process (the picture's lane, Perfetto's process name)."""
    spans = Timeline.from_records(records).spans()
    timeline.extend(spans)
    for pid in {s.pid for s in spans}:
        timeline.name_process(pid, name)


def _report(
    config: DistributedDemoConfig,
    trainer: dict[str, Any],
    replicas: list[dict[str, Any]],
    timeline: Timeline,
    wall_s: float,
    checks: _Checks,
) -> dict[str, Any]:
    """The report: ``trainer`` is the (first) trainer rank's values, ``replicas`` every replica
    rank's."""
    forward_writes, egress = split_overlaps(timeline.overlaps())
    # A forward is torn if the engine's own detector saw it (the LM's seqlock, the stamps of
    # the fake model) or if it overlapped a weight write: counted once either way. Every rank
    # of a tensor-parallel replica runs (and is checked for) every forward.
    torn = torn_forwards(timeline.spans(SpanKind.FORWARD), forward_writes)
    # The R2R source only reads its weights and is not paused; phases are the receivers'.
    receives = [r for rep in replicas for r in rep["reports"] if "send" not in r["handler"]]

    def phase(key: str, q: float) -> float:
        return percentile([r[key] for r in receives], q)

    # Generation stalls once per replica and sync: for the whole receive in place, for the
    # install alone when staged (the reports that parked anything).
    parked = [r for rep in replicas for r in rep["reports"] if r.get("paused")]
    stalls = [r["stall_ms"] for r in parked]
    stall_shares = [r["stall_ms"] / r["sync_total_ms"] for r in parked if r["sync_total_ms"] > 0]
    rate_in, rate_out = token_rates_in_windows(
        timeline.spans(SpanKind.FORWARD), timeline.spans(SpanKind.SYNC)
    )

    sync_ms = [
        m["weight_sync_time_ms"] for m in trainer["step_metrics"] if "weight_sync_time_ms" in m
    ]
    decode_step_ms = decode_step_ms_p50(timeline)
    counters: dict[str, int] = {}
    for rep in replicas:
        for key, value in rep["counters"].items():
            counters[key] = counters.get(key, 0) + value
    core = ("forwards", "torn_forwards", "generation_pauses", "installs")
    shards = (
        {}
        if checks.trainer_shard_mismatches is None
        else {"trainer_shard_mismatches": checks.trainer_shard_mismatches}
    )
    return {
        "mode": "multi_process",
        "sync_mode": config.mode.value,
        "backend": config.backend,
        "guarded": config.guarded,
        "lora": config.lora,
        "replicas": config.replicas,
        "trainer_ranks": config.trainer_ranks,
        "tp": config.tp,
        "processes": demo_layout(config).world_size,
        "steps": config.steps,
        "syncs": checks.syncs,
        "failed_commands": sum(len(rep["failed"]) for rep in replicas),
        "forwards": counters.get("forwards", 0),
        "torn_reads": len(torn),
        "torn_forwards_detected": counters.get("torn_forwards", 0),
        "forward_write_overlaps": len(forward_writes),
        "egress_overlaps": len(egress),
        "trainer_egress_overlaps": sum(o.first.pid == trainer["pid"] for o in egress),
        "payloads_sent": sum(rep["payloads_sent"] for rep in replicas),
        "payloads_received": trainer["payloads_received"],
        "payloads_lost": trainer["payloads_lost"],
        "payloads_invalid": trainer["payloads_invalid"],
        "payload_mb": trainer["payload_bytes"] / 1e6,
        "rollout_tokens": trainer["rollout_tokens"],
        "rollout_staleness_p50": percentile(trainer["staleness"], 50),
        "rollout_staleness_max": max(trainer["staleness"], default=0),
        **{k: v for k, v in counters.items() if k not in core},
        "generation_pauses": counters.get("generation_pauses", 0),
        "installs": counters.get("installs", 0),
        "superseded_versions": sum(rep["superseded"] for rep in replicas),
        "time_to_park_ms_p50": phase("time_to_park_ms", 50),
        "time_to_park_ms_p99": phase("time_to_park_ms", 99),
        "decode_step_ms_p50": decode_step_ms,
        "park_steps_p99": park_steps(phase("time_to_park_ms", 99), decode_step_ms),
        "egress_drain_ms_p50": phase("egress_drain_ms", 50),
        "egress_drain_ms_p99": phase("egress_drain_ms", 99),
        "handler_ms_p50": phase("handler_ms", 50),
        "handler_ms_p99": phase("handler_ms", 99),
        "fence_ms_p50": phase("fence_ms", 50),
        "fence_ms_p99": phase("fence_ms", 99),
        "sync_ms_p50": phase("sync_total_ms", 50),
        "sync_ms_p99": phase("sync_total_ms", 99),
        "stall_ms_p50": percentile(stalls, 50),
        "stall_ms_p99": percentile(stalls, 99),
        "stall_over_sync_p50": percentile(stall_shares, 50),
        "version_skew_ms_max": version_skew_ms_max([rep["commits"] for rep in replicas]),
        "sync_window_tokens_ratio": rate_in / rate_out if rate_out > 0 else math.nan,
        "weight_sync_time_ms_p50": percentile(sync_ms, 50),
        "weight_sync_time_ms_p99": percentile(sync_ms, 99),
        "model_mb": checks.model_nbytes / 1e6,
        "bytes_per_sync": percentile([t["nbytes"] for t in trainer["transfers"]], 50),
        **({"adapter_mb": trainer["nbytes"] / 1e6} if config.lora else {}),
        "transfer_mb_per_s": percentile(checks.p2r_rates + checks.r2r_rates, 50),
        "p2r_mb_per_s": percentile(checks.p2r_rates, 50),
        "r2r_mb_per_s": percentile(checks.r2r_rates, 50),
        "final_versions": checks.final_versions,
        "versions_checked": checks.versions_checked,
        "step_mismatches": checks.step_mismatches,
        **shards,
        "bit_identical": (
            checks.final_identical
            and checks.step_mismatches == 0
            and not checks.trainer_shard_mismatches
        ),
        "wall_s": wall_s,
        "errors": [e.splitlines()[0] for rep in replicas for e in rep["failed"]][:5],
    }
