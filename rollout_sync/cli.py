"""The ``rollout-sync`` command: ``rollout-sync demo`` runs the main job and prints a report."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from .demo import InProcessDemoConfig, run_in_process_demo
from .trace import Timeline

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-sync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="generation, payload egress and weight syncs racing; prints a report",
        description="Runs generation, payload sends and weight syncs concurrently and reports "
        "torn reads, payload/sync overlaps and timings. Guarded by default.",
    )
    demo.add_argument("--syncs", type=int, default=200, help="weight syncs to run (default 200)")
    demo.add_argument("--backend", choices=("fake", "vllm"), default="fake",
                      help="fake: in-process fakes (default); vllm: a tiny Llama served by vLLM "
                      "(needs the extra: pip install 'rollout-sync[vllm]')")
    demo.add_argument("--unguarded", action="store_true",
                      help="run without the guard: expect torn reads and egress overlaps")
    demo.add_argument("--trace", metavar="PATH",
                      help="write the timeline as Chrome/Perfetto trace JSON")
    demo.add_argument("--json", action="store_true",
                      help="also print the report as one JSON object on the last line")
    return parser


def _format_report(report: dict[str, Any]) -> str:
    width = max(len(k) for k in report)
    lines = ["rollout-sync demo report", "-" * (width + 16)]
    for key, value in report.items():
        if isinstance(value, float):
            shown = "n/a" if math.isnan(value) else f"{value:.3f}"
        else:
            shown = str(value)
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


def _verdict(report: dict[str, Any]) -> str:
    hazards = report["torn_reads"] + report["egress_overlaps"]
    if report["guarded"]:
        return ("OK: no forward read torn weights and no payload send overlapped a sync."
                if hazards == 0 else f"FAIL: {hazards} hazards observed while guarded.")
    return (f"Unguarded: {report['torn_reads']} torn reads, {report['egress_overlaps']} payload "
            "sends inside a sync - the hazards the guard prevents.")


def _run_demo(args: argparse.Namespace) -> int:
    if args.syncs < 1:
        raise SystemExit("--syncs must be at least 1")
    timeline = Timeline()
    if args.backend == "vllm":
        vllm_report = _run_vllm_demo(args, timeline)
        if vllm_report is None:
            return 2
        report = vllm_report
    else:
        report = run_in_process_demo(
            InProcessDemoConfig(syncs=args.syncs, guarded=not args.unguarded), timeline
        )
    print(_format_report(report))
    if args.trace:
        path = timeline.write_chrome_trace(args.trace)
        print(f"trace: {path} ({len(timeline)} spans; open in https://ui.perfetto.dev)")
    print(_verdict(report))
    if args.json:
        print(json.dumps(report))
    failed = report["guarded"] and (report["torn_reads"] or report["egress_overlaps"])
    return 1 if failed else 0


def _run_vllm_demo(args: argparse.Namespace, timeline: Timeline) -> dict[str, Any] | None:
    """The demo on vLLM, or ``None`` (with the install hint on stderr) when vLLM is missing."""
    from .backends.vllm import VLLMUnavailableError

    try:
        from .backends.vllm_demo import VLLMDemoConfig, run_vllm_demo

        return run_vllm_demo(VLLMDemoConfig(syncs=args.syncs, guarded=not args.unguarded),
                             timeline)
    except VLLMUnavailableError as exc:
        print(f"rollout-sync demo --backend vllm: {exc}", file=sys.stderr)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        return _run_demo(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
