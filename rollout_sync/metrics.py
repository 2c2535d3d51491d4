"""Timing summaries for reports: percentiles of a list of durations.

Kept free of I/O and of any clock: callers measure, this module summarises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DurationSummary", "percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class DurationSummary:
    """p50/p99/max/mean of durations, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float


def summarize(durations_s: Sequence[float]) -> DurationSummary:
    """Summarise durations given in seconds."""
    ms = [d * 1e3 for d in durations_s]
    return DurationSummary(
        count=len(ms),
        p50_ms=percentile(ms, 50),
        p99_ms=percentile(ms, 99),
        max_ms=max(ms, default=math.nan),
        mean_ms=sum(ms) / len(ms) if ms else math.nan,
    )
