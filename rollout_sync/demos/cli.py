"""The ``rollout-sync`` command: ``rollout-sync demo`` runs the main job and prints a report;
``rollout-sync plot`` draws a trace written earlier; ``rollout-sync plan`` chooses a weight-sync
design for a model and a fleet (:mod:`rollout_sync.demos.plan_cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..backends import InProcessRequest, RegisteredEngine, registered_engine, registered_engines
from ..backends.torch_lm import TinyLMConfig
from ..errors import MatplotlibUnavailableError
from ..learn import LearnConfig, TokenSetTask
from ..sync.mode import SyncMode
from ..trace import REPORT_METADATA_KEY, Timeline, read_chrome_trace
from ..transfer.delta_sync import WholeReason
from .distributed import (
    LAUNCHED_AT_ENV,
    LAUNCHERS,
    DistributedDemoConfig,
    check_demo_config,
    demo_layout,
    demo_limit_s,
    run_demo_under_torchrun,
    run_distributed_demo,
)
from .job import DELTA_LR, VLLM_LEARN_LR
from .learning import learning_engines
from .plan_cli import add_plan_parser, run_plan

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-sync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="generation, payload egress and weight syncs racing; prints a report",
        description="Runs a trainer process and --replicas rollout replica processes over "
        "gloo on loopback. Every replica streams generations from a tiny torch LM and ships "
        "each result (token ids, logprobs, weight versions) to the trainer over the payload "
        "transport; every training step the trainer pushes new weights: a P2R to the first "
        "replica, an R2R to the others, written in place into the served parameters. Reports "
        "torn reads, payload/sync overlaps, payloads lost, timings (rollout-side phases and "
        "the trainer's weight_sync_time_ms), transfer MB/s and whether every replica ends "
        "bit-identical to the trainer. Guarded by default; --in-process runs the threads-only "
        "demo. With --trainer-ranks N and --tp T the job is sharded: N trainer ranks holding "
        "FSDP shards push each region straight to the replica rank that serves it, every "
        "replica is T tensor-parallel ranks, and every rank is checked.",
    )
    demo.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="rollout replica processes next to the trainer process (default 3; 2 with "
        "--backend vllm)",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps, each a P2R plus an R2R (default 30; {LEARN_STEPS} with --learn)",
    )
    demo.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        metavar="N",
        help="trainer processes (default 1); above 1 each holds only its FSDP-style shard of the "
        "model (every tensor cut along dim 0) and sends only its own regions to the first "
        "replica's ranks (a sharded P2R). Sharded runs: --backend torch_lm, --mode sync",
    )
    demo.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="processes per replica (default 1): each replica serves the tiny LM tensor-parallel "
        "over T ranks (T must divide the model's 4 heads); the first rank schedules and ships "
        "payloads, the others mirror its steps; every rank takes every sync. The job runs "
        "--trainer-ranks + --replicas x T processes",
    )
    demo.add_argument(
        "--backend",
        default=None,
        help="rollout engine, by name: torch_lm (the tiny torch LM under the "
        "stream scheduler; the default) or torn_read (a fake model stamped with "
        "its version; the default with --in-process, and with an async --mode, "
        "which the stream LM does not run); vllm serves a tiny Llama on vLLM in every "
        "replica process, fed through vLLM's native weight-transfer API (with --in-process: "
        "one engine in this process; needs the extra: pip install 'rollout-sync[vllm]')",
    )
    demo.add_argument(
        "--mode",
        choices=[m.value for m in SyncMode],
        default="sync",
        help="weight sync mode (default sync: pause generation, write in place; staged: "
        "receive into a staging copy while generation goes on, pause only to install)",
    )
    demo.add_argument(
        "--staged",
        action="store_true",
        help="stage, then swap (the same as --mode staged): generation parks only for the "
        "install; on the stream LM and vLLM replicas a version lands on every replica or on "
        "none",
    )
    demo.add_argument(
        "--lora",
        action="store_true",
        help="the trainer trains a LoRA adapter on the replicas' base model: every step ships "
        "only the adapter (into its slot, under the guard); half the generations use it on "
        "torch_lm, all of them on vllm; the report adds adapter_mb (torch_lm and vllm)",
    )
    demo.add_argument(
        "--learn",
        action="store_true",
        help="the trainer learns: it keeps an fp32 master of the replicas' model and takes an "
        "AdamW step (GRPO advantages, truncated importance weights) each step on the rollouts "
        "the replicas generated for a toy task with a verifiable reward and sent over the "
        "payload transport; the replicas serve bfloat16. The report adds reward_first, "
        "reward_last, reward_curve, staleness, importance weights, the changed fraction per "
        f"sync, tokens_per_s and replica_idle_fraction. The default {LEARN_STEPS} steps take "
        "about 20 s on two cores on torch_lm (the tiny torch LM; local, torchrun or ray), "
        "about 70 s with --backend vllm (a tiny Llama on vLLM for CPU, serving bf16 with "
        "vLLM's processed_logprobs, the log-probabilities after temperature; local). The "
        "plain job (one trainer rank, --tp 1), sync or --staged (docs/learning.md)",
    )
    demo.add_argument(
        "--delta",
        action="store_true",
        help="delta syncs: the trainer sends each version as its changes against the last one "
        "the replicas committed (TransferWeightPusher(delta=True)), P2R and R2R, in place or "
        "--staged (applied at the install); the first sync, a keyframe (--full-every) or a "
        "delta no smaller than the whole version goes whole. Without --learn the trainer then "
        "takes real AdamW steps (betas 0.9/0.999, eps 1e-8, no weight decay) on an fp32 master "
        f"of the replicas' model, a next-token loss on random tokens, at --lr (default "
        f"{DELTA_LR:g}), instead of adding noise, and the replicas serve bf16. The report adds "
        "delta_syncs and full_syncs (versions the replicas received by delta / whole), "
        "delta_bytes_over_full_p50, full_sync_reasons and, without --learn, "
        "changed_fraction_p50. The plain job on torch_lm or vllm: not with --trainer-ranks/--tp "
        "above 1 (the sharded job's trainer has no AdamW master), --lora, --trainer fast-llm or "
        "--in-process",
    )
    demo.add_argument(
        "--full-every",
        type=int,
        default=None,
        metavar="N",
        help="with --delta: every N-th sync goes whole, a keyframe (default: none; only the "
        "fallbacks go whole)",
    )
    demo.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="K",
        help="with --learn: drop sequences more than K versions behind the trainer, judged by "
        f"their oldest token (default {LearnConfig.max_staleness})",
    )
    demo.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"AdamW's learning rate, with --learn (default {LearnConfig.lr:g} on torch_lm, "
        f"{VLLM_LEARN_LR:g} on vllm: what the engine's learner says) or with --delta alone "
        f"(default {DELTA_LR:g}, a realistic one); 0 freezes the policy",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the job's models, prompts and sampling (default 0)",
    )
    demo.add_argument(
        "--model-mb",
        type=float,
        default=8.0,
        help="--backend torn_read: size of the synced model in MiB (default 8); "
        "torch_lm syncs the tiny LM's own parameters",
    )
    demo.add_argument(
        "--bucket-mb", type=float, default=4.0, help="transfer bucket size in MiB (default 4)"
    )
    demo.add_argument("--checksums", action="store_true", help="checksum every bucket")
    demo.add_argument(
        "--pipelined-relay",
        action="store_true",
        help="the first replica passes each bucket on to the others as it arrives "
        "(P2R and R2R overlap) instead of an R2R after the P2R",
    )
    demo.add_argument(
        "--in-process",
        action="store_true",
        help="run the single-process demo instead (threads, no torch.distributed)",
    )
    demo.add_argument(
        "--syncs", type=int, default=200, help="weight syncs of the --in-process demo (default 200)"
    )
    demo.add_argument(
        "--stream",
        action="store_true",
        help="with --in-process --backend torch_lm: stream generation on the "
        "scheduler thread (without it, blocking generate and syncs alternate)",
    )
    demo.add_argument(
        "--unguarded",
        action="store_true",
        help="run without the guard: expect torn reads and egress overlaps",
    )
    demo.add_argument(
        "--trainer",
        choices=("default", "fast-llm"),
        default="default",
        help="who trains: default (this package's trainer loop and transfer) or fast-llm (a "
        "trainer process speaking Fast-LLM's weight-streaming protocol byte for byte over a "
        "real redis-server started for the run; replicas receive through "
        "rollout_sync.integrations.fast_llm and ship rollouts back over Redis)",
    )
    demo.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="who places the trainer and replica processes: local (spawned here; the "
        "default), ray (Ray actors, one placement-group bundle each; a local Ray cluster for "
        "the run unless --ray-address), torchrun (the same job under torchrun: env:// "
        "rendezvous, role by rank; without torchrun around it, this starts torchrun "
        "--standalone --nproc-per-node REPLICAS+1, or TRAINER_RANKS+REPLICAS*TP)",
    )
    demo.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="with --launcher ray: join this existing Ray cluster (e.g. auto, or "
        "ray://head:10001) instead of starting a local one",
    )
    demo.add_argument(
        "--trace",
        metavar="PATH",
        help="write the timeline as Chrome/Perfetto trace JSON (with the report, for "
        "rollout-sync plot)",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the timeline as a PNG: a lane per process, the whole run and one sync "
        "zoomed, overlaps in red, the report's headline in the title (needs the extra: pip "
        "install 'rollout-sync[plot]')",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="also print the report as one JSON object on the last line",
    )
    plot = commands.add_parser(
        "plot",
        help="draw a trace written earlier (--trace, Timeline.write_chrome_trace) as a PNG",
        description="Draws a Chrome/Perfetto trace written by rollout-sync demo --trace (or by "
        "Timeline.write_chrome_trace in any job): a lane per process (trainer, replicas) with "
        "its decode steps, parks, weight collectives, writes, payload transfers and holds; the "
        "whole run on top and one sync zoomed below; every forbidden overlap (what the report "
        "counts) marked in red; the report's headline figures in the title (from the trace "
        "itself when it holds no report). Needs matplotlib: pip install 'rollout-sync[plot]'.",
    )
    plot.add_argument("trace", metavar="TRACE", help="the trace JSON file")
    plot.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="the picture (PNG; default: TRACE with the suffix .png)",
    )
    plot.add_argument("--dpi", type=int, default=PLOT_DPI, help=f"resolution (default {PLOT_DPI})")
    add_plan_parser(commands)
    return parser


PLOT_DPI = 100


def _draw(timeline: Timeline, path: str, report: dict[str, Any] | None, dpi: int) -> str:
    """Save the picture; the line that says where it is and what it marks."""
    from ..trace_plot import save_timeline_plot

    drawn = save_timeline_plot(timeline, path, report=report, dpi=dpi)  # OSError: the caller's
    marked = f"{drawn.overlaps} overlaps" if drawn.overlaps else "no overlap"
    lanes = f"{len(drawn.lanes)} process{'es' if len(drawn.lanes) != 1 else ''}"
    return f"plot: {path} ({lanes}; {marked} marked in red)"


def _plot_unavailable(command: str) -> str | None:
    """The error line when matplotlib is missing, before anything runs; ``None`` if it is
    there."""
    from ..trace_plot import require_matplotlib

    try:
        require_matplotlib()
    except MatplotlibUnavailableError as exc:
        return f"rollout-sync {command}: {exc}"
    return None


def _run_plot(args: argparse.Namespace) -> int:
    if args.dpi < 1:
        raise SystemExit(f"rollout-sync plot: --dpi must be at least 1, not {args.dpi}")
    unavailable = _plot_unavailable("plot")
    if unavailable is not None:
        print(unavailable, file=sys.stderr)
        return 2
    try:
        timeline, metadata = read_chrome_trace(args.trace)
    except OSError as exc:
        raise SystemExit(f"rollout-sync plot: cannot read {args.trace}: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"rollout-sync plot: {exc}") from None
    report = metadata.get(REPORT_METADATA_KEY)
    output = args.output or str(Path(args.trace).with_suffix(".png"))
    try:
        print(_draw(timeline, output, report if isinstance(report, dict) else None, args.dpi))
    except OSError as exc:
        raise SystemExit(f"rollout-sync plot: cannot write the picture {output}: {exc}") from None
    return 0


def _distributed_config(args: argparse.Namespace, mode: SyncMode) -> DistributedDemoConfig:
    """The multi-process demo's config from the command line, checked
    (:func:`~rollout_sync.demos.distributed.check_demo_config`); a bad one exits."""
    numel = max(1, int(args.model_mb * (1 << 20) / 4 / DistributedDemoConfig().num_tensors))
    start_s = _engine(args.backend).start_s
    model = TinyLMConfig()
    if args.learn or args.delta:
        # torch_lm's replicas serve bfloat16 from the trainer's fp32 master (docs/learning.md).
        model = TinyLMConfig(dtype=torch.bfloat16, seed=args.seed)
    config = DistributedDemoConfig(
        replicas=args.replicas,
        steps=args.steps,
        trainer_ranks=args.trainer_ranks,
        tp=args.tp,
        backend=args.backend,
        mode=mode,
        guarded=not args.unguarded,
        numel=numel,
        bucket_bytes=max(64, int(args.bucket_mb * (1 << 20))),
        checksums=args.checksums,
        pipelined_relay=args.pipelined_relay,
        lora=args.lora,
        # Every pause, hold and collective is bounded by this; the first sync starts the
        # engines, so an engine that is slow to start gets its allowance.
        timeout_s=DistributedDemoConfig.timeout_s + start_s,
        seed=args.seed,
        model=model,
        delta=args.delta,
        full_every=args.full_every,
        delta_lr=DELTA_LR if args.lr is None or args.learn else args.lr,
    )
    if args.learn:
        config = dataclasses.replace(config, learn=_learn_config(args, config))
    try:
        check_demo_config(config)
    except ValueError as exc:
        if config.sharded:
            raise SystemExit(f"{exc} (--trainer-ranks, --tp)") from None
        flags = "--learn, --backend, --mode" if args.learn else "--backend, --mode, --lora"
        raise SystemExit(f"{exc} (--replicas, --steps, {flags})") from None
    return config


def _learn_config(args: argparse.Namespace, config: DistributedDemoConfig) -> LearnConfig:
    """``--learn``'s settings on the config's engine: its learner's learning rate and a task
    over its vocabulary, unless the command line says otherwise (an engine without a learner
    gets the defaults, and the config's check refuses it)."""
    learner = _engine(config.backend).learner
    model = None if learner is None else learner(config)
    return LearnConfig(
        lr=args.lr if args.lr is not None else model.lr if model is not None else LearnConfig.lr,
        max_staleness=(
            LearnConfig.max_staleness if args.max_staleness is None else args.max_staleness
        ),
        task=TokenSetTask() if model is None else TokenSetTask(vocab_size=model.vocab_size),
    )


def _engine(name: str) -> RegisteredEngine:
    """The engine registered as ``--backend name``; an unknown name exits, listing the known."""
    try:
        return registered_engine(name)
    except KeyError:
        raise SystemExit(
            f"unknown --backend {name!r}; known: {list(registered_engines())}"
        ) from None


def _default_engine(mode: SyncMode, in_process: bool) -> str:
    """The engine without ``--backend``: the stream LM, unless it cannot run the options."""
    stream_lm = mode in (SyncMode.SYNC, SyncMode.STAGED) and not in_process
    return "torch_lm" if stream_lm else "torn_read"


def _refuse_launcher(launcher: str, engine: RegisteredEngine) -> None:
    """Exit when ``launcher`` cannot place ``engine``'s replicas, saying which can."""
    if engine.runs_under(launcher):
        return
    why = "whose replicas start engine processes of their own: " if engine.starts_processes else ""
    can = " or ".join(engine.launchers or ())
    raise SystemExit(
        f"--launcher {launcher} places the multi-process demo's processes; it does not run "
        f"with --backend {engine.name} ({why}{can} only)"
    )


LEARN_STEPS = 40
"""``--learn``'s default steps: enough for the toy task to be learnt well on two cores."""


def _refuse_learning_combinations(args: argparse.Namespace) -> None:
    """Exit, before anything starts, on ``--learn`` options that do not go together (the
    config's own check, :func:`~rollout_sync.demos.learning.check_learning_config`, says the
    rest)."""
    if args.lr is not None and not args.lr >= 0:
        raise SystemExit(f"--lr must be at least 0, not {args.lr}")
    if not args.learn:
        if args.max_staleness is not None:
            raise SystemExit("--max-staleness needs --learn")
        if args.lr is not None and not args.delta:
            raise SystemExit("--lr needs --learn or --delta")
        return
    if args.in_process or args.trainer != "default" or args.lora:
        drop = "--in-process" if args.in_process else "--lora" if args.lora else "--trainer"
        raise SystemExit(
            f"--learn runs the multi-process demo with this package's trainer on the whole "
            f"model: drop {drop}"
        )
    if args.backend is not None and _engine(args.backend).learner is None:
        raise SystemExit(
            f"--learn trains the model of an engine registered with a learner; --backend "
            f"{args.backend} has none: use --backend {' or '.join(learning_engines())} "
            "(docs/learning.md)"
        )
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SystemExit(f"--max-staleness must be at least 0, not {args.max_staleness}")


def _delta_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--delta`` (or ``--full-every``) does not run with the other options, in one line;
    ``None`` when it does. Called once the engine is known."""
    if args.full_every is not None and not args.delta:
        return "--full-every is the keyframe interval of --delta: add --delta"
    if not args.delta:
        return None
    if args.full_every is not None and args.full_every < 1:
        return f"--full-every must be at least 1, not {args.full_every}"
    if args.in_process:
        return "--delta runs the multi-process demo: drop --in-process"
    if args.trainer != "default":
        return (
            f"--delta sends deltas from this package's trainer; the Fast-LLM wire sends whole "
            f"tensors: drop --trainer {args.trainer}"
        )
    if args.trainer_ranks > 1 or args.tp > 1:
        return (
            "--delta runs the plain job: the sharded job's trainer ranks move their shards by "
            "seeded noise, with no AdamW master to take small steps (drop --trainer-ranks and "
            "--tp; sharded transfers move deltas: docs/delta.md)"
        )
    if args.lora:
        return "--delta sends the whole model's changes; a --lora adapter goes whole: drop --lora"
    if _engine(args.backend).learner is None:
        return (
            f"--delta trains the master of an engine registered with a learner; --backend "
            f"{args.backend} has none: use --backend {' or '.join(learning_engines())}"
        )
    return None


def _refuse_sharded_combinations(args: argparse.Namespace, mode: SyncMode) -> None:
    """Exit, before anything starts, on options the sharded job does not run with."""
    if args.trainer_ranks < 1 or args.tp < 1:
        raise SystemExit(
            f"--trainer-ranks and --tp must be at least 1, got --trainer-ranks "
            f"{args.trainer_ranks} --tp {args.tp}"
        )
    if args.trainer_ranks == 1 and args.tp == 1:
        return
    sharded = f"--trainer-ranks {args.trainer_ranks} --tp {args.tp}"
    if args.in_process:
        raise SystemExit(f"{sharded} runs the multi-process demo: drop --in-process")
    if args.trainer != "default":
        raise SystemExit(f"{sharded} runs this package's trainer: drop --trainer {args.trainer}")
    if mode is not SyncMode.SYNC:
        raise SystemExit(f"{sharded} runs the sync mode only: drop --mode {mode.value}")
    if args.backend not in (None, "torch_lm"):
        raise SystemExit(
            f"{sharded} runs the torch_lm engine only: drop --backend {args.backend} (or pass "
            "--backend torch_lm)"
        )
    heads = DistributedDemoConfig().model.n_heads
    if heads % args.tp:
        raise SystemExit(
            f"--tp {args.tp} does not divide the model's {heads} attention heads: pass a --tp "
            f"that divides {heads}"
        )


def _format_report(report: dict[str, Any]) -> str:
    width = max(len(k) for k in report)
    lines = ["rollout-sync demo report", "-" * (width + 16)]
    if "trainer_ranks" in report and "tp" in report:
        lines.append(f"{'layout':<{width}}  {_layout_line(report)}")
    for key, value in report.items():
        if key == "full_sync_reasons" and isinstance(value, dict):
            lines += _reason_lines(key, value, width)
            continue
        if isinstance(value, float):
            shown = "n/a" if math.isnan(value) else f"{value:.3f}"
        elif value is None:
            shown = "n/a"
        else:
            shown = str(value)
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


def _reason_lines(key: str, reasons: dict[str, int], width: int) -> list[str]:
    """``full_sync_reasons``, one reason a line with what it means:
    ``first 3 (first sync: no committed base to encode against)``."""
    if not reasons:
        return [f"{key:<{width}}  none"]
    lines = []
    for n, (name, count) in enumerate(reasons.items()):
        meaning = WholeReason[name.upper()].value if name.upper() in WholeReason.__members__ else ""
        shown = f"{name} {count}" + (f" ({meaning})" if meaning else "")
        lines.append(f"{key if n == 0 else '':<{width}}  {shown}")
    return lines


def _layout_line(report: dict[str, Any]) -> str:
    """``"2 trainer ranks (FSDP shards) -> 3 replicas x 2 tensor-parallel ranks"``."""
    ranks, tp, replicas = report["trainer_ranks"], report["tp"], report["replicas"]
    trainer = "1 trainer rank" if ranks == 1 else f"{ranks} trainer ranks (FSDP shards)"
    served = f"{replicas} replica{'s' if replicas != 1 else ''}"
    if tp > 1:
        served += f" x {tp} tensor-parallel ranks"
    processes = report.get("processes")
    return f"{trainer} -> {served}" + (f" ({processes} processes)" if processes else "")


def _hazards(report: dict[str, Any]) -> int:
    return int(
        report["torn_reads"] + report["egress_overlaps"] + report.get("forward_write_overlaps", 0)
    )


def _broken(report: dict[str, Any]) -> str | None:
    """What went wrong whether guarded or not (the guard prevents hazards, not these)."""
    if report.get("failed_commands"):
        return f"{report['failed_commands']} weight-sync command(s) failed"
    if report.get("bit_identical") is False:
        return "a replica's weights differ from the trainer's"
    if report.get("payloads_lost"):
        return f"{report['payloads_lost']} payload(s) lost between the replicas and the trainer"
    if report.get("payloads_invalid"):
        return f"{report['payloads_invalid']} payload(s) arrived with inconsistent contents"
    return None


def _verdict(report: dict[str, Any]) -> str:
    broken = _broken(report)
    if broken is not None:
        return f"FAIL: {broken}."
    hazards = _hazards(report)
    if report["guarded"]:
        return (
            "OK: no forward read torn weights and no payload transfer overlapped a weight sync."
            if hazards == 0
            else f"FAIL: {hazards} hazards observed while guarded."
        )
    return (
        f"Unguarded: {report['torn_reads']} torn reads, "
        f"{report.get('forward_write_overlaps', 0)} forward/weight-write overlaps, "
        f"{report['egress_overlaps']} payload-transfer/weight-sync overlaps - the hazards the "
        "guard prevents."
    )


def _run_in_process(args: argparse.Namespace, timeline: Timeline) -> dict[str, Any]:
    """``--in-process``: the engine's one-process demo (an engine without one exits)."""
    if args.syncs < 1:
        raise SystemExit("--syncs must be at least 1")
    run = _engine(args.backend).in_process
    if run is None:
        have = [n for n in registered_engines() if registered_engine(n).in_process is not None]
        raise SystemExit(
            f"--backend {args.backend} has no one-process demo: drop --in-process (--in-process "
            f"runs {have})"
        )
    return run(InProcessRequest(args.syncs, not args.unguarded, timeline, stream=args.stream))


def _run_fast_llm_demo(
    args: argparse.Namespace, mode: SyncMode, timeline: Timeline
) -> dict[str, Any] | None:
    """The demo with a Fast-LLM trainer, or ``None`` (the install hint on stderr) without
    redis-server or the redis client."""
    from ..testing.redis_server import RedisUnavailableError
    from .fast_llm import FastLLMDemoConfig, run_fast_llm_demo

    if args.replicas < 1 or args.steps < 1:
        raise SystemExit("the demo needs at least one replica and one step (--replicas, --steps)")
    try:
        return run_fast_llm_demo(
            FastLLMDemoConfig(
                replicas=args.replicas, steps=args.steps, guarded=not args.unguarded, mode=mode
            ),
            timeline,
        )
    except RedisUnavailableError as exc:
        print(f"rollout-sync demo --trainer fast-llm: {exc}", file=sys.stderr)
        return None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _start_torchrun(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run this very command under ``torchrun --standalone``, one process per rank; every rank
    re-enters :func:`main` and finds torchrun's environment. Bounded like a local run."""
    layout = demo_layout(
        DistributedDemoConfig(replicas=args.replicas, trainer_ranks=args.trainer_ranks, tp=args.tp)
    )
    nproc = layout.world_size
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "rollout_sync.demos.cli",
        *argv,
    ]
    limit = (
        demo_limit_s(
            DistributedDemoConfig(
                replicas=args.replicas,
                steps=args.steps,
                trainer_ranks=args.trainer_ranks,
                tp=args.tp,
                backend=args.backend,  # its registered start_s counts
            )
        )
        + 60.0
    )
    env = {**os.environ, LAUNCHED_AT_ENV: repr(time.time())}
    child = subprocess.Popen(command, start_new_session=True, env=env)
    try:
        return child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"rollout-sync demo: torchrun overstayed {limit:.0f} s; killed", file=sys.stderr)
        return 1
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)


def _run_demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.plot is not None:
        unavailable = _plot_unavailable("demo --plot")
        if unavailable is not None:  # said before the run, not after it
            print(unavailable, file=sys.stderr)
            return 2
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():
            print(f"rollout-sync demo --plot: no folder {folder} to write into", file=sys.stderr)
            return 2
    timeline = Timeline()
    mode = SyncMode(args.mode)
    if args.staged:
        if mode not in (SyncMode.SYNC, SyncMode.STAGED):
            raise SystemExit(f"--staged is --mode staged: drop --mode {mode.value}")
        mode = SyncMode.STAGED
    if mode is SyncMode.STAGED and args.in_process:
        raise SystemExit("--staged (--mode staged) runs the multi-process demo: drop --in-process")
    if args.lora and (args.in_process or args.trainer != "default"):
        raise SystemExit(
            "--lora runs the multi-process demo with this package's trainer: drop "
            + ("--in-process" if args.in_process else f"--trainer {args.trainer}")
        )
    _refuse_learning_combinations(args)
    if args.steps is None:
        args.steps = LEARN_STEPS if args.learn else 30
    if args.launcher != "local" and args.in_process:
        raise SystemExit(
            f"--launcher {args.launcher} places the multi-process demo's processes; it does not "
            "run with --in-process"
        )
    typed_backend = args.backend
    if args.backend is None:
        args.backend = _default_engine(mode, args.in_process)
    _refuse_launcher(args.launcher, _engine(args.backend))
    _refuse_sharded_combinations(args, mode)
    if args.replicas is None:
        args.replicas = _engine(args.backend).default_replicas
    refused = _delta_refusal(args)
    if refused is not None:
        print(f"rollout-sync demo: {refused}", file=sys.stderr)
        return 2
    if args.trainer == "fast-llm":
        if args.launcher != "local" or args.in_process or typed_backend not in (None, "torch_lm"):
            raise SystemExit(
                "--trainer fast-llm runs local processes over the tiny torch LM: no --launcher, "
                "--in-process or other --backend"
            )
        if mode not in (SyncMode.SYNC, SyncMode.STAGED):
            raise SystemExit("--trainer fast-llm runs the sync or staged mode only")
    if args.ray_address is not None and args.launcher != "ray":
        raise SystemExit("--ray-address needs --launcher ray")
    if args.stream and not (args.in_process and args.backend == "torch_lm"):
        raise SystemExit("--stream needs --backend torch_lm (with --in-process)")
    try:
        _engine(args.backend).check_available()
    except ImportError as exc:  # what the engine needs is not installed: the hint, no run
        print(f"rollout-sync demo --backend {args.backend}: {exc}", file=sys.stderr)
        return 2
    if args.launcher == "torchrun" and not _under_torchrun():
        _distributed_config(args, mode)  # refuse a bad config before starting torchrun
        return _start_torchrun(args, argv)
    if args.trainer == "fast-llm":
        fast_llm_report = _run_fast_llm_demo(args, mode, timeline)
        if fast_llm_report is None:
            return 2
        report = fast_llm_report
    elif args.in_process:
        report = _run_in_process(args, timeline)
    else:
        config = _distributed_config(args, mode)
        if args.launcher == "torchrun":
            under_torchrun = run_demo_under_torchrun(config, timeline)
            if under_torchrun is None:
                return 0  # a replica's rank: the trainer's rank reports
            report = under_torchrun
        else:
            report = run_distributed_demo(
                config, timeline, launcher=args.launcher, ray_address=args.ray_address
            )
    print(_format_report(report))
    if args.trace:
        path = timeline.write_chrome_trace(args.trace, metadata={REPORT_METADATA_KEY: report})
        print(f"trace: {path} ({len(timeline)} spans; open in https://ui.perfetto.dev)")
    plot_failed = False
    if args.plot:
        try:
            print(_draw(timeline, args.plot, report, PLOT_DPI))
        except OSError as exc:  # the run's verdict and report still come
            error = f"rollout-sync demo: cannot write the picture {args.plot}: {exc}"
            print(error, file=sys.stderr)
            plot_failed = True
    print(_verdict(report))
    if args.json:
        print(json.dumps(report))
    failed = bool(report["guarded"] and _hazards(report) > 0) or _broken(report) is not None
    return 1 if failed or plot_failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        return _run_demo(args, argv)
    if args.command == "plot":
        return _run_plot(args)
    if args.command == "plan":
        return run_plan(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
