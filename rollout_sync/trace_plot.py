"""A picture of a :class:`~rollout_sync.Timeline`: who did what, when, readable at a glance.

``rollout-sync demo --plot sync.png`` draws the run it just made, ``rollout-sync plot
trace.json -o sync.png`` a trace written earlier (by ``--trace`` or by
:meth:`~rollout_sync.Timeline.write_chrome_trace` in any job); :func:`plot_timeline` returns the
figure and :func:`save_timeline_plot` writes it as a PNG. What the picture shows, in order of
importance:

1. **One lane per process**: the trainer first, then the replicas, named by
   :meth:`~rollout_sync.Timeline.name_process` (an unnamed process is ``trainer (pid N)`` if it
   receives payloads and generates nothing, else ``pid N``). A lane has a row for each activity
   it had: *generation* (forwards / decode steps, with parks hatched where generation was
   paused), *wire* (weight collectives, over the light band of the sync's handler body),
   *write* (weight writes and installs), *payload* (payload sends or receives, with holds
   hatched behind them). Other span kinds (the scheduler's steps, each holding a decode step)
   are not drawn.
2. **Overlaps in red**: every overlap :meth:`~rollout_sync.Timeline.overlaps` finds (the
   pairs of :data:`~rollout_sync.trace.FORBIDDEN_OVERLAPS`: what the demo reports count as
   ``forward_write_overlaps`` and ``egress_overlaps``) is a red box, over the rows of its two
   spans for as long as they overlap, with a red marker above its lane; every torn forward
   (:func:`~rollout_sync.trace.torn_forwards`: the report's ``torn_reads``) is a red cross on
   its generation row. A guarded run has neither.
3. **The whole run on top, one sync zoomed below it.** A sync is a stretch of time in which
   some process was paused, in a sync's handler body, on the weight wire or holding payloads,
   the stretches of all processes merged where they touch (:func:`sync_windows`). The zoomed
   one is the sync of median length among those with an overlap; without overlaps, among all
   but the first (which starts the engines) when there are three or more, else among all. A
   timeline without a sync has no zoom. When no forward ran in the first half of the
   timeline (a vLLM engine starting inside the first sync), the top starts just before the
   first forward, and its title says how much it left out.
4. **The headline in the title**: syncs, torn reads, stall p50 (``sync_ms_p50``: pause to
   resume, per sync) and park p99 (``time_to_park_ms_p99``), taken from the run's report when
   there is one; from the trace otherwise (syncs: ``weight_sync`` spans; stall: ``pause``
   spans; park: their ``park_ms``), and the title says which.

Colours are the Okabe-Ito palette, safe for colour-blind readers, each kind also told apart by
its row and hatching in a grey print; vermillion (red) is for overlaps and torn reads only.

matplotlib is imported on first use and draws with its Agg backend on a figure of its own (no
display, no pyplot state); without it :class:`~rollout_sync.errors.MissingDependencyError`
(``MatplotlibUnavailableError``) names the extra that installs it. The artists carry
``gid`` s, so code (a test) can read the picture without its pixels: ``"<style>|<lane>"`` for
one style's spans in one lane (a collection, one rectangle per span; the styles are
:data:`STYLES`' keys), ``"overlap|<lane>"`` (one rectangle per overlap), ``"torn|<lane>"``
(one marker per torn forward) and ``"zoom"`` (the zoomed window, outlined on the whole run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import MissingDependencyError
from .metrics import percentile
from .trace import Overlap, Span, SpanKind, Timeline, torn_forwards

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "INSTALL_HINT",
    "STYLES",
    "Headline",
    "SpanStyle",
    "TimelinePlot",
    "plot_timeline",
    "require_matplotlib",
    "save_timeline_plot",
    "sync_windows",
]

INSTALL_HINT = "install the extra: pip install 'rollout-sync[plot]' (matplotlib)"

# Okabe-Ito: distinguishable with any common colour-vision deficiency.
_BLUE, _ORANGE, _GREEN, _PURPLE = "#0072B2", "#E69F00", "#009E73", "#CC79A7"
_SKY, _YELLOW, _VERMILLION, _GREY = "#56B4E9", "#F0E442", "#D55E00", "#BBBBBB"

ROWS = ("generation", "wire", "write", "payload")
"""The rows of a lane, top to bottom (a lane shows those it has spans for)."""


@dataclass(frozen=True)
class SpanStyle:
    """How the spans of some kinds are drawn: their row, colour, hatching and legend label."""

    key: str
    label: str
    kinds: tuple[str, ...]
    row: str
    color: str
    hatch: str = ""
    background: bool = False
    """Drawn full height behind the row's other spans (a park, a hold, a handler body)."""


STYLES: tuple[SpanStyle, ...] = (
    SpanStyle(
        "park", "park (generation paused)", (SpanKind.PAUSE,), "generation", _ORANGE, "////", True
    ),
    SpanStyle("forward", "forward / decode step", (SpanKind.FORWARD,), "generation", _BLUE),
    SpanStyle("sync", "sync (handler body)", (SpanKind.SYNC,), "wire", _GREY, background=True),
    SpanStyle(
        "collective", "weight collective (the wire)", (SpanKind.WEIGHT_COLLECTIVE,), "wire", _GREEN
    ),
    SpanStyle(
        "write",
        "weight write / install",
        (SpanKind.WEIGHT_WRITE, SpanKind.WEIGHT_BUFFER_WRITE),
        "write",
        _PURPLE,
        "xxx",
    ),
    SpanStyle(
        "hold", "payload hold", (SpanKind.PAYLOAD_HOLD,), "payload", _YELLOW, "\\\\\\\\", True
    ),
    SpanStyle(
        "payload",
        "payload send / receive",
        (SpanKind.PAYLOAD_SEND, SpanKind.PAYLOAD_RECV),
        "payload",
        _SKY,
    ),
)
"""Every style drawn, backgrounds before what they are behind; each kind in one style."""

_STYLE_OF_KIND = {kind: style for style in STYLES for kind in style.kinds}
_SYNC_KINDS = (SpanKind.PAUSE, SpanKind.SYNC, SpanKind.WEIGHT_COLLECTIVE, SpanKind.PAYLOAD_HOLD)


def require_matplotlib() -> ModuleType:
    """Import and return matplotlib, or raise
    :class:`~rollout_sync.errors.MissingDependencyError` (``MatplotlibUnavailableError``)
    naming the extra."""
    try:
        import matplotlib
        import matplotlib.backends.backend_agg  # noqa: F401  (the canvas every figure here uses)
    except ImportError as exc:
        raise MissingDependencyError(
            f"drawing a timeline needs matplotlib, which is not importable ({exc}); {INSTALL_HINT}",
            package="matplotlib",
            extra="plot",
        ) from exc
    module: ModuleType = matplotlib
    return module


# -- what is drawn (plain data, no matplotlib) -------------------------------------------------


@dataclass(frozen=True)
class Headline:
    """The figures in the picture's title."""

    syncs: int | None
    torn_reads: int | None
    stall_ms_p50: float
    """The report's ``sync_ms_p50``; from a trace alone, the ``pause`` spans' p50."""
    park_ms_p99: float
    """The report's ``time_to_park_ms_p99``; from a trace alone, the pauses' ``park_ms`` p99."""
    guarded: bool | None
    source: str
    """``"report"`` or ``"trace"``: where the figures come from."""

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Headline:
        """The figures of a demo report (a missing or ``None`` figure is NaN / ``None``)."""

        def number(key: str) -> float:
            value = report.get(key)
            return float(value) if isinstance(value, (int, float)) else math.nan

        def count(key: str) -> int | None:
            value = report.get(key)
            return int(value) if isinstance(value, (int, float)) else None

        guarded = report.get("guarded")
        return cls(
            syncs=count("syncs"),
            torn_reads=count("torn_reads"),
            stall_ms_p50=number("sync_ms_p50"),
            park_ms_p99=number("time_to_park_ms_p99"),
            guarded=guarded if isinstance(guarded, bool) else None,
            source="report",
        )

    @classmethod
    def from_timeline(cls, timeline: Timeline, overlaps: Sequence[Overlap]) -> Headline:
        """The figures as far as a trace alone tells them (``overlaps``: the timeline's)."""
        pauses = timeline.spans(SpanKind.PAUSE)
        parks = [float(s.args["park_ms"]) for s in pauses if "park_ms" in s.args]
        return cls(
            syncs=len(timeline.spans(SpanKind.SYNC)),
            torn_reads=len(torn_forwards(timeline.spans(SpanKind.FORWARD), overlaps)),
            stall_ms_p50=percentile([s.duration_s * 1e3 for s in pauses], 50),
            park_ms_p99=percentile(parks, 99),
            guarded=None,
            source="trace",
        )

    def title(self) -> str:
        def ms(value: float) -> str:
            return "n/a" if math.isnan(value) else f"{value:.1f} ms"

        def n(value: int | None) -> str:
            return "?" if value is None else str(value)

        return (
            f"{n(self.syncs)} syncs · {n(self.torn_reads)} torn reads · "
            f"stall p50 {ms(self.stall_ms_p50)} · park p99 {ms(self.park_ms_p99)}"
        )


@dataclass(frozen=True)
class _Lane:
    pid: int
    name: str
    rows: tuple[str, ...]
    top: float
    """The y of its first row's top edge (y grows downwards)."""

    def y(self, row: str) -> float:
        return self.top + self.rows.index(row)

    @property
    def bottom(self) -> float:
        return self.top + len(self.rows)


_LANE_GAP = 0.7


def _natural(name: str) -> tuple[Any, ...]:
    """``"replica 10"`` after ``"replica 9"``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _lanes(timeline: Timeline, spans: Sequence[Span]) -> list[_Lane]:
    names = timeline.process_names()
    kinds: dict[int, set[str]] = {}
    for s in spans:
        kinds.setdefault(s.pid, set()).add(s.kind)
    order = []
    for pid, seen in kinds.items():
        name = names.get(pid)
        if name is None:
            trainer = SpanKind.PAYLOAD_RECV in seen and SpanKind.FORWARD not in seen
            name = f"trainer (pid {pid})" if trainer else f"pid {pid}"
        rows = tuple(r for r in ROWS if any(_STYLE_OF_KIND[k].row == r for k in seen))
        order.append((not name.startswith("trainer"), _natural(name), pid, name, rows))
    lanes, top = [], 0.0
    for _, _, pid, name, rows in sorted(order):
        lanes.append(_Lane(pid, name, rows, top))
        top += len(rows) + _LANE_GAP
    return lanes


def sync_windows(spans: Iterable[Span]) -> list[tuple[int, int]]:
    """The syncs of a timeline, as ``(start_ns, end_ns)`` in time order: the stretches in which
    some process was paused, in a sync's handler body, on the weight wire or holding payloads,
    merged across processes where they overlap or touch."""
    intervals = sorted((s.start_ns, s.end_ns) for s in spans if s.kind in _SYNC_KINDS)
    merged: list[tuple[int, int]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _zoom_window(
    windows: Sequence[tuple[int, int]], overlaps: Sequence[Overlap]
) -> tuple[int, int] | None:
    """The sync to zoom into (see the module docstring), padded by a fifth of its length."""
    marks = [(o.start_ns, o.end_ns) for o in overlaps]
    marked = [w for w in windows if any(lo < w[1] and w[0] < hi for lo, hi in marks)]
    candidates = marked or list(windows[1:] if len(windows) >= 3 else windows)
    if not candidates:
        return None
    candidates.sort(key=lambda w: (w[1] - w[0], w[0]))
    chosen = candidates[len(candidates) // 2]
    pad = (chosen[1] - chosen[0]) // 5 + 1_000_000
    return chosen[0] - pad, chosen[1] + pad


# -- drawing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelinePlot:
    """A drawn timeline: the figure, and what it marks."""

    figure: Figure
    lanes: tuple[str, ...]
    """The lanes' names, top to bottom."""
    overlaps: int
    """Overlaps marked in red (the timeline's :meth:`~rollout_sync.Timeline.overlaps`)."""
    torn_reads: int
    """Torn forwards marked (:func:`~rollout_sync.trace.torn_forwards`)."""
    zoom_ns: tuple[int, int] | None
    """The zoomed window, in the timeline's ``monotonic_ns``; ``None``: no sync, no zoom."""
    headline: Headline

    def save(self, path: str | Path, *, dpi: int = 100) -> Path:
        """Write the picture as a PNG to ``path`` (whatever its suffix) and return the path."""
        out = Path(path)
        self.figure.savefig(out, dpi=dpi, format="png")
        return out


def plot_timeline(
    timeline: Timeline,
    *,
    report: Mapping[str, Any] | None = None,
    title: str = "rollout-sync",
) -> TimelinePlot:
    """Draw ``timeline`` (see the module docstring); ``report``: the run's report, whose
    figures head the picture.

    Raises:
        MissingDependencyError: matplotlib is not installed (the ``plot`` extra).
        ValueError: the timeline has no span to draw.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spans = [s for s in timeline.spans() if s.kind in _STYLE_OF_KIND]
    if not spans:
        raise ValueError(
            f"nothing to draw: the timeline has no span of the kinds drawn "
            f"({sorted(_STYLE_OF_KIND)}); was it recorded (timeline=...)?"
        )
    overlaps = timeline.overlaps()
    torn = torn_forwards(timeline.spans(SpanKind.FORWARD), overlaps)
    lanes = _lanes(timeline, spans)
    origin = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    zoom = _zoom_window(sync_windows(spans), overlaps)
    headline = (
        Headline.from_report(report)
        if report is not None
        else Headline.from_timeline(timeline, overlaps)
    )

    height = lanes[-1].bottom
    axis_in = 0.2 * height + 0.5
    rows_in = 2 * axis_in + (2.0 if report is not None and report.get("reward_curve") else 0)
    figure = Figure(figsize=(13, rows_in + 2.4), layout="constrained")
    FigureCanvasAgg(figure)
    curve = list(report.get("reward_curve") or ()) if report is not None else []
    axes = figure.subplots(1 + (zoom is not None) + bool(curve), 1, squeeze=False)[:, 0]
    whole = axes[0]
    _draw(whole, lanes, spans, overlaps, torn, origin, 1e9, None)
    whole.set_xlabel("seconds since the first span")
    generating = min((s.start_ns for s in spans if s.kind == SpanKind.FORWARD), default=origin)
    if generating - origin > (end - origin) / 2:
        # Starting engines (a vLLM's, inside the first sync) would squeeze the run into a
        # sliver: the top starts just before generation does.
        left = generating - (end - generating) // 20
        whole.set_xlim((left - origin) / 1e9, (end - origin) / 1e9)
        whole.set_title(
            f"the whole run from its first forward (the {(generating - origin) / 1e9:.1f} s "
            "before it, no generation yet, left out)",
            loc="left",
            fontsize=10,
        )
    else:
        whole.set_xlim(0, (end - origin) / 1e9)
        whole.set_title("the whole run", loc="left", fontsize=10)
    if zoom is not None:
        lo, hi = zoom
        whole.axvspan(
            (lo - origin) / 1e9,
            (hi - origin) / 1e9,
            facecolor="none",
            edgecolor="black",
            linestyle="--",
            linewidth=0.8,
            gid="zoom",
        )
        detail = axes[1]
        shown = [s for s in spans if s.start_ns < hi and s.end_ns > lo]
        _draw(
            detail,
            lanes,
            shown,
            [o for o in overlaps if o.start_ns < hi and o.end_ns > lo],
            [s for s in torn if s.start_ns < hi and s.end_ns > lo],
            lo,
            1e6,
            "zoom",
        )
        detail.set_xlim(0, (hi - lo) / 1e6)
        detail.set_xlabel(f"milliseconds from {(lo - origin) / 1e9:.3f} s")
        detail.set_title(
            f"one sync, zoomed ({(hi - lo) / 1e6:.0f} ms, dashed above)", loc="left", fontsize=10
        )

    if curve:
        _draw_reward_curve(axes[-1], curve)

    guard = {True: "guarded", False: "UNGUARDED", None: ""}[headline.guarded]
    context = [guard] if guard else []
    if report is not None:
        for key, unit in (("backend", ""), ("trainer", " trainer"), ("replicas", " replicas")):
            if report.get(key) is not None:
                context.append(f"{report[key]}{unit}")
        if report.get("steps") is not None:
            context.append(f"{report['steps']} steps")
    context.append(f"{len(overlaps)} overlaps marked in red" if overlaps else "no overlap")
    context.append(f"figures from the {headline.source}")
    figure.suptitle(
        f"{title}: {headline.title()}\n{' · '.join(context)}", fontsize=12, fontweight="bold"
    )
    drawn_kinds = {s.kind for s in spans}
    handles: list[Any] = [
        Patch(
            facecolor=style.color,
            edgecolor="black" if style.hatch else style.color,
            hatch=style.hatch,
            linewidth=0.5,
            label=style.label,
        )
        for style in STYLES
        if drawn_kinds & set(style.kinds)
    ]
    handles += [
        Patch(
            facecolor=to_rgba(_VERMILLION, 0.3),
            edgecolor=_VERMILLION,
            linewidth=1.5,
            label="overlap (a forbidden pair, ▼ above)",
        ),
        Line2D([], [], color=_VERMILLION, marker="x", linestyle="none", label="torn read"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    return TimelinePlot(
        figure=figure,
        lanes=tuple(lane.name for lane in lanes),
        overlaps=len(overlaps),
        torn_reads=len(torn),
        zoom_ns=zoom,
        headline=headline,
    )


def _draw(
    ax: Axes,
    lanes: Sequence[_Lane],
    spans: Sequence[Span],
    overlaps: Sequence[Overlap],
    torn: Sequence[Span],
    origin_ns: int,
    unit_ns: float,
    axis: str | None,
) -> None:
    """One axes of the picture: every lane's spans, overlaps and torn forwards, with x in
    ``unit_ns`` from ``origin_ns``. ``axis`` (``"zoom"``) suffixes the gids of a second axes."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba

    suffix = f"|{axis}" if axis else ""
    by_lane: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in spans:
        by_lane.setdefault((s.pid, _STYLE_OF_KIND[s.kind].key), []).append(
            ((s.start_ns - origin_ns) / unit_ns, (s.end_ns - s.start_ns) / unit_ns)
        )
    for lane in lanes:
        for style in STYLES:
            bars = by_lane.get((lane.pid, style.key))
            if not bars:
                continue
            y = lane.y(style.row)
            inset = 0.04 if style.background else 0.18
            ax.broken_barh(
                bars,
                (y + inset, 1 - 2 * inset),
                facecolors=style.color,
                # An edge in the fill's colour keeps a span shorter than a pixel visible.
                edgecolors="black" if style.hatch else style.color,
                linewidths=0.3,
                hatch=style.hatch or None,
                zorder=1 if style.background else 2,
                gid=f"{style.key}|{lane.name}{suffix}",
            )
        mine = [o for o in overlaps if o.first.pid == lane.pid]
        if mine:
            boxes = []
            for o in mine:
                lo, hi = ((t - origin_ns) / unit_ns for t in (o.start_ns, o.end_ns))
                top, bottom = _rows_of(lane, o)
                boxes.append([(lo, top), (lo, bottom), (hi, bottom), (hi, top)])
            ax.add_collection(
                PolyCollection(
                    boxes,
                    facecolors=[to_rgba(_VERMILLION, 0.3)],
                    edgecolors=[_VERMILLION],
                    linewidths=1.5,
                    zorder=3,
                    gid=f"overlap|{lane.name}{suffix}",
                )
            )
            ax.plot(
                [((o.start_ns + o.end_ns) / 2 - origin_ns) / unit_ns for o in mine],
                [lane.top - 0.3] * len(mine),
                linestyle="none",
                marker="v",
                markersize=6,
                color=_VERMILLION,
                zorder=4,
                gid=f"overlap-marker|{lane.name}{suffix}",
            )
        crosses = [s for s in torn if s.pid == lane.pid]
        if crosses and "generation" in lane.rows:
            ax.plot(
                [((s.start_ns + s.end_ns) / 2 - origin_ns) / unit_ns for s in crosses],
                [lane.y("generation") + 0.5] * len(crosses),
                linestyle="none",
                marker="x",
                markersize=5,
                markeredgewidth=1.2,
                color=_VERMILLION,
                zorder=4,
                gid=f"torn|{lane.name}{suffix}",
            )
    ax.set_ylim(lanes[-1].bottom + 0.2, -0.6)
    ax.set_yticks(
        [lane.y(row) + 0.5 for lane in lanes for row in lane.rows],
        [row for lane in lanes for row in lane.rows],
        fontsize=7,
    )
    ax.tick_params(axis="y", length=0)
    for lane in lanes:
        # The lane's name, left of its rows' labels.
        ax.annotate(
            lane.name,
            xy=(0, (lane.top + lane.bottom) / 2),
            xycoords=("axes fraction", "data"),
            xytext=(-58, 0),
            textcoords="offset points",
            ha="right",
            va="center",
            fontsize=9,
            fontweight="bold",
        )
        if lane is not lanes[-1]:
            ax.axhline(lane.bottom + _LANE_GAP / 2, color="#888888", linewidth=0.5)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)


def _draw_reward_curve(axis: Any, curve: Sequence[float]) -> None:
    """The learning job's reward per training step (``rollout-sync demo --learn``)."""
    steps = range(1, len(curve) + 1)
    axis.plot(steps, curve, color=_BLUE, marker=".", linewidth=1.2)
    axis.set_xlim(0.5, len(curve) + 0.5)
    axis.set_ylim(0, 1)
    axis.set_xlabel("training step")
    axis.set_ylabel("reward")
    axis.grid(True, linewidth=0.3)
    axis.set_title("the reward of the rollouts each step trained on", loc="left", fontsize=10)


def _rows_of(lane: _Lane, overlap: Overlap) -> tuple[float, float]:
    """The y range of an overlap's band: from the row of one of its spans to the other's."""
    ys = [lane.y(_STYLE_OF_KIND[s.kind].row) for s in (overlap.first, overlap.second)]
    return min(ys) + 0.05, max(ys) + 0.95


def save_timeline_plot(
    timeline: Timeline,
    path: str | Path,
    *,
    report: Mapping[str, Any] | None = None,
    dpi: int = 100,
) -> TimelinePlot:
    """:func:`plot_timeline`, written to ``path`` (a PNG at ``dpi``); returns what it drew.

    Raises what :func:`plot_timeline` raises, and ``OSError`` if ``path`` cannot be written.
    """
    drawn = plot_timeline(timeline, report=report)
    drawn.save(path, dpi=dpi)
    return drawn
