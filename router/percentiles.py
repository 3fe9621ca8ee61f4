"""The project's one percentile helper (linear interpolation between closest ranks, numpy's
default), and the p50/p90/p99 summary every report, benchmark and simulator prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float, empty: float = math.nan) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks (numpy's
    default); `empty` when there are no values. The project's one percentile helper."""
    if not len(xs):
        return empty
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def percentiles(values: Sequence[float]) -> dict:
    """p50/p90/p99 (linear interpolation), mean and count; None figures when empty."""
    v = [x for x in values if x is not None]
    if not v:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    return {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "mean": statistics.fmean(v), "n": len(v)}

