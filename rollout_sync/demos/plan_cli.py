"""``rollout-sync plan``: the command over :mod:`rollout_sync.plan`. It reads the flags, refuses
a bad one in one line (exit code 2) before computing anything, and prints the plan: every
design ranked by refit and by stall, where the time goes, the recommendation and the
assumptions; ``--json`` as one JSON object, ``--plot`` as a picture."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..errors import MatplotlibUnavailableError
from ..plan import (
    DTYPE_BYTES,
    Design,
    FleetSpec,
    ModelSpec,
    Plan,
    build_plan,
    dtype_bytes,
    format_bytes,
    model_from_file,
    parse_bytes,
    parse_rate,
)
from ..scale import FLEET_1T

__all__ = ["add_plan_parser", "format_plan", "run_plan", "save_plan_plot"]

PROG = "rollout-sync plan"


def add_plan_parser(commands: Any) -> None:
    """The ``plan`` subcommand on ``commands`` (an ``add_subparsers()`` result)."""
    plan = commands.add_parser(
        "plan",
        help="choose a weight-sync design: every design's refit, stall and memory, ranked",
        description="Every weight-sync design the refit cost model knows (each topology in "
        "place, staged in device memory and staged in host memory; delta designs with "
        "--changed-fraction) for one model on one fleet: ranked by refit and "
        "by stall, the device memory each needs per replica GPU and whether it fits in "
        "--free-memory, where the time goes, and a recommendation with its reason. Pure "
        "arithmetic (rollout_sync.plan over rollout_sync.scale) on the 1T fleet's H100-class "
        "costs, which the output lists with their sources (docs/scale.md). Give the model as "
        "--params, --tensors and --dtype, or as --model FILE.",
    )
    model = plan.add_argument_group("the model (--params and --tensors, or --model)")
    model.add_argument("--params", metavar="N", help="parameters, e.g. 1e12 or 70e9")
    model.add_argument("--tensors", metavar="N", help="named tensors in the model, e.g. 70000")
    model.add_argument(
        "--dtype",
        metavar="NAME",
        help=f"the served dtype: {', '.join(DTYPE_BYTES)} (default bfloat16; with --model, "
        "the config.json's torch_dtype)",
    )
    model.add_argument(
        "--model",
        metavar="FILE",
        help="a safetensors index (model.safetensors.index.json: its metadata.total_size "
        "bytes, its weight_map's tensors) or a Hugging Face config.json (an estimate from the "
        "layer structure)",
    )
    fleet = plan.add_argument_group("the fleet")
    fleet.add_argument(
        "--trainer-ranks", metavar="N", help="trainer GPUs, each holding a shard (default 1)"
    )
    fleet.add_argument("--replicas", metavar="N", help="rollout replicas (required)")
    fleet.add_argument("--gpus-per-replica", metavar="N", help="GPUs of each replica (default 1)")
    fleet.add_argument(
        "--nic",
        metavar="RATE",
        help="every GPU's NIC, one way: 50GB/s, 400Gb/s, 800MB/s (decimal units; B bytes, "
        "b bits; required)",
    )
    fleet.add_argument(
        "--free-memory",
        metavar="SIZE",
        help="device memory free on each replica GPU beside its weights: 20GB, 512MB, 20GiB "
        "(default: not checked)",
    )
    fleet.add_argument(
        "--bucket-mb",
        metavar="MIB",
        help=f"the transfer's bucket in MiB (default {FLEET_1T.bucket_bytes >> 20})",
    )
    plan.add_argument(
        "--changed-fraction",
        metavar="F",
        help="the measured fraction of served elements one training step changes, in (0, 1]: "
        "adds delta designs (implemented but over the pipelined sharded relay: docs/delta.md)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument(
        "--plot",
        metavar="FILE",
        help="draw where the time goes per design as a PNG (needs the extra: pip install "
        "'rollout-sync[plot]')",
    )


def _refuse(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as argparse refuses a flag."""
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(2)


def _whole(flag: str, text: str | None, default: int | None = None) -> int:
    if text is None:
        if default is None:
            _refuse(f"{flag} is required")
        return default
    try:
        value = int(text)
    except ValueError:
        _refuse(f"{flag} {text!r} is not a whole number")
    if value < 1:
        _refuse(f"{flag} must be at least 1, not {value}")
    return value


def _positive(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        _refuse(f"{flag} {text!r} is not a number")
    if not (value > 0 and math.isfinite(value)):
        _refuse(f"{flag} must be a number > 0, not {text}")
    return value


def _model(args: argparse.Namespace) -> ModelSpec:
    if args.dtype is not None:
        try:
            dtype_bytes(args.dtype)
        except ValueError as exc:
            _refuse(f"--dtype: {exc}")
    if args.model is not None:
        if args.params is not None or args.tensors is not None:
            _refuse("give the model one way: --params and --tensors, or --model FILE (not both)")
        try:
            return model_from_file(args.model, dtype=args.dtype)
        except OSError as exc:
            _refuse(f"--model: cannot read {args.model}: {exc.strerror or exc}")
        except ValueError as exc:
            _refuse(f"--model: {exc}")
    if args.params is None or args.tensors is None:
        _refuse(
            "give the model: --params N and --tensors N (and --dtype), or --model FILE "
            "(a safetensors index or a config.json)"
        )
    params = _positive("--params", args.params)
    tensors = _whole("--tensors", args.tensors)
    try:
        return ModelSpec.of(params, tensors, args.dtype or "bfloat16")
    except ValueError as exc:  # the dtype is known: the parameter count is below 1
        _refuse(f"--params: {exc}")


def _fleet(args: argparse.Namespace) -> FleetSpec:
    trainer_ranks = _whole("--trainer-ranks", args.trainer_ranks, 1)
    replicas = _whole("--replicas", args.replicas)
    gpus = _whole("--gpus-per-replica", args.gpus_per_replica, 1)
    if args.nic is None:
        _refuse("--nic is required: every GPU's NIC, e.g. 50GB/s or 400Gb/s")
    try:
        nic = parse_rate(args.nic)
    except ValueError as exc:
        _refuse(f"--nic {exc}")
    free = None
    if args.free_memory is not None:
        try:
            free = parse_bytes(args.free_memory)
        except ValueError as exc:
            _refuse(f"--free-memory {exc}")
    bucket = FLEET_1T.bucket_bytes
    if args.bucket_mb is not None:
        bucket = max(1, round(_positive("--bucket-mb", args.bucket_mb) * (1 << 20)))
    return FleetSpec(trainer_ranks, replicas, gpus, nic, free, bucket)


def _changed_fraction(args: argparse.Namespace) -> float | None:
    if args.changed_fraction is None:
        return None
    try:
        value = float(args.changed_fraction)
    except ValueError:
        _refuse(f"--changed-fraction {args.changed_fraction!r} is not a number")
    if not 0 < value <= 1:
        _refuse(f"--changed-fraction must be in (0, 1], not {args.changed_fraction}")
    return value


def _plot_refused(path: str) -> str | None:
    """Why ``--plot path`` cannot be drawn (matplotlib missing, no such folder), or ``None``."""
    from ..trace_plot import INSTALL_HINT, require_matplotlib

    try:
        require_matplotlib()
    except MatplotlibUnavailableError as exc:
        cause = exc.__cause__ or exc
        return f"--plot: drawing the plan needs matplotlib, which is not importable ({cause}); " + (
            INSTALL_HINT
        )
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        return f"--plot: no folder {folder} to write into"
    return None


def run_plan(args: argparse.Namespace) -> int:
    """The command: every input checked first (exit 2 on a bad one), then the plan printed."""
    if args.plot is not None:
        refused = _plot_refused(args.plot)
        if refused is not None:
            _refuse(refused)
    model = _model(args)
    fleet = _fleet(args)
    plan = build_plan(model, fleet, changed_fraction=_changed_fraction(args))
    if args.json:
        print(json.dumps(plan.to_json()))
    else:
        print(format_plan(plan))
    if args.plot is not None:
        try:
            save_plan_plot(plan, args.plot)
        except OSError as exc:
            _refuse(f"--plot: cannot write the picture {args.plot}: {exc}")
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


# -- the words ----------------------------------------------------------------------------------


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def _seconds(s: float) -> str:
    return f"{s:.3g} s"


def _status(design: Design) -> str:
    if design.implemented:
        return "implemented"
    return "modelled (delta)" if design.delta else "modelled"


def _fits(design: Design) -> str:
    return {True: "yes", False: "no", None: "?"}[design.fits]


def _where(design: Design) -> str:
    total = design.refit_s
    phases = sorted(design.estimate.phases, key=lambda p: -p.seconds)
    return ", ".join(
        f"{p.name} {_seconds(p.seconds)} ({p.seconds / total:.0%})"
        for p in phases
        if p.seconds >= 0.0005 * total
    )


def format_plan(plan: Plan) -> str:
    """The plan in words: the inputs, the designs by refit and by stall, where the time goes,
    the recommendation, the assumptions."""
    m, f = plan.model, plan.fleet
    estimated = " (an estimate)" if m.estimated else ""
    source = "given" if m.source == "given" else f"from {m.source}"
    free = (
        "not given: fits unchecked (?)"
        if f.free_memory_bytes is None
        else format_bytes(f.free_memory_bytes)
    )
    lines = [
        f"model: {_count(m.params)} parameters, {m.dtype}: {format_bytes(m.model_bytes)} in "
        f"{m.tensors:,} tensors{estimated} ({source})",
        f"fleet: {f.trainer_ranks} trainer rank{'s' if f.trainer_ranks != 1 else ''} -> "
        f"{f.replicas} replica{'s' if f.replicas != 1 else ''} x {f.gpus_per_replica} "
        f"GPU{'s' if f.gpus_per_replica != 1 else ''}; "
        f"NIC {format_bytes(f.nic_bytes_per_s)}/s per GPU; "
        f"buckets {f.bucket_bytes / 2**20:.4g} MiB; free memory per GPU {free}",
        f"speed of light: {_seconds(plan.speed_of_light_s)} (each replica takes in "
        f"{format_bytes(m.model_bytes)} through its {f.gpus_per_replica} NIC"
        f"{'s' if f.gpus_per_replica != 1 else ''})",
    ]
    if plan.changed_fraction is not None:
        lines.append(
            f"changed fraction: {plan.changed_fraction:g} (adds a delta design per topology)"
        )
    width = max(len(d.name) for d in plan.designs)
    stall_rank = {d.name: i for i, d in enumerate(plan.by_stall, 1)}
    lines += [
        "",
        "by refit (memory: device memory per replica GPU beyond its weights; host: host memory)",
        f"  {'#':>2}  {'design':<{width}}  {'refit':>9}  {'stall':>9}  {'memory':>9}  "
        f"{'host':>9}  fits  {'stall #':>7}  status",
    ]
    for rank, d in enumerate(plan.designs, 1):
        host = format_bytes(d.host_memory_bytes_per_gpu) if d.host_memory_bytes_per_gpu else "-"
        lines.append(
            f"  {rank:>2}  {d.name:<{width}}  {_seconds(d.refit_s):>9}  {_seconds(d.stall_s):>9}"
            f"  {format_bytes(d.memory_bytes_per_gpu):>9}  {host:>9}  {_fits(d):<4}  "
            f"{stall_rank[d.name]:>7}  {_status(d)}"
        )
    lines += ["", "by stall", f"  {'#':>2}  {'design':<{width}}  {'stall':>9}  {'refit':>9}"]
    for rank, d in enumerate(plan.by_stall, 1):
        lines.append(
            f"  {rank:>2}  {d.name:<{width}}  {_seconds(d.stall_s):>9}  {_seconds(d.refit_s):>9}"
        )
    lines += ["", "where the time goes (phases of the refit, largest first)"]
    lines += [f"  {d.name}: {_where(d)}" for d in plan.designs]
    lines.append("")
    if plan.recommended is None:
        lines.append("recommended: none")
        lines.append(f"  why: {plan.reason}")
    else:
        lines.append(f"recommended: {plan.recommended.name}")
        lines.append(f"  why: {plan.reason}")
    lines += ["", "assumptions (H100-class; FLEET_1T.sources in rollout_sync/scale.py):"]
    lines += [f"  {name}: {text}" for name, text in plan.assumptions]
    return "\n".join(lines)


# -- the picture --------------------------------------------------------------------------------

# Okabe-Ito, as the timeline's picture: distinguishable with any common colour-vision deficiency.
_PHASE_COLORS = {
    "park": "#E69F00",
    "control": "#999999",
    "wire: P2R link": "#0072B2",
    "wire: R2R link": "#56B4E9",
    "pipeline": "#009E73",
    "install": "#CC79A7",
}


def save_plan_plot(plan: Plan, path: str | Path, *, dpi: int = 100) -> Path:
    """Where the time goes per design: a stacked horizontal bar per design (fastest refit on
    top), a segment per phase; modelled designs hatched, the recommended one's name in bold.
    Needs matplotlib (checked by the caller); ``OSError`` if ``path`` cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    designs = plan.designs
    figure = Figure(figsize=(11, 1.6 + 0.38 * len(designs)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    names = [p.name for d in designs for p in d.estimate.phases]
    order = [n for n in _PHASE_COLORS if n in names] + sorted(set(names) - set(_PHASE_COLORS))
    extra = iter(("#D55E00", "#F0E442", "#000000"))
    colors = {n: _PHASE_COLORS.get(n) or next(extra, "#555555") for n in order}
    for row, d in enumerate(designs):
        left = 0.0
        seconds = {p.name: p.seconds for p in d.estimate.phases}
        for name in order:
            width = seconds.get(name, 0.0)
            if width <= 0:
                continue
            axes.barh(
                row,
                width,
                left=left,
                color=colors[name],
                hatch="" if d.implemented else "//",
                edgecolor="white",
                linewidth=0.5,
            )
            left += width
        axes.text(
            left,
            row,
            f"  {_seconds(d.refit_s)} (stall {_seconds(d.stall_s)})",
            va="center",
            fontsize=8,
        )
    axes.set_yticks(range(len(designs)))
    labels = axes.set_yticklabels(
        [d.name + ("" if d.implemented else " (modelled)") for d in designs], fontsize=8
    )
    for label, d in zip(labels, designs, strict=True):
        if plan.recommended is not None and d.name == plan.recommended.name:
            label.set_fontweight("bold")
    axes.invert_yaxis()
    axes.set_xlabel("refit, s")
    axes.set_xlim(0, max(d.refit_s for d in designs) * 1.3)
    m, f = plan.model, plan.fleet
    axes.set_title(
        f"Where the time goes: {_count(m.params)} parameters ({format_bytes(m.model_bytes)}), "
        f"{f.trainer_ranks} trainer ranks -> {f.replicas} x {f.gpus_per_replica} GPUs, "
        f"NIC {format_bytes(f.nic_bytes_per_s)}/s",
        fontsize=10,
    )
    axes.legend(
        handles=[Patch(color=colors[n], label=n) for n in order]
        + [Patch(facecolor="white", edgecolor="black", hatch="//", label="modelled only")],
        loc="upper right",
        fontsize=8,
    )
    out = Path(path)
    figure.savefig(out, dpi=dpi, format="png")
    return out
