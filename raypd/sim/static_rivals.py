"""The autoscaled run judged against the static fleets a user would otherwise buy: every size
from the smallest tried up to the autoscaled peak, every P:D split of each, each side repeated;
medians and spreads, the smallest static whose SLO attainment comes within `SLO_MARGIN` of the
autoscaled run's, the best static, and the two targets (`raypd bench autoscale` and
`raypd simulate --autoscale` both read this; no Ray, no torch).

A static fleet of the autoscaled peak size spends peak x span worker-seconds, so beating it is
true by construction; the rival that can win is the smallest static that serves the trace as
well (within the margin). Invariant: every static row carries as many runs as the autoscaled
side (the same workloads, repeat for repeat), and a target with no rival to judge it against is
False, never vacuously True."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

SLO_MARGIN = 0.05     # 5 points of SLO attainment: the "within 5 points"


def fleet_splits(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """Every (P, D) with P, D >= 1 of each size in `sizes`, smallest size first, the most
    decode-heavy split of a size first."""
    return [(p, n - p) for n in sorted(set(sizes)) if n >= 2 for p in range(1, n)]


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and spread (max - min) of one figure over the repeats."""
    assert values, "a figure needs at least one run"
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "runs": list(values)}


def _row(label: str, runs: Sequence[dict]) -> dict:
    return {"label": label,
            "worker_seconds": spread([r["worker_seconds"] for r in runs]),
            "slo_attainment": spread([r["slo_attainment"] for r in runs])}


def judge(auto_runs: Sequence[dict], static_runs: dict[tuple[int, int], Sequence[dict]],
          margin: float = SLO_MARGIN) -> dict:
    """The comparison: `auto_runs` the autoscaled repeats, `static_runs` (P, D) -> that
    static's repeats (each run a dict with `worker_seconds` and `slo_attainment`). The best
    static has the highest median attainment (ties: fewer median worker-seconds); the smallest
    static meeting the SLO is the one of the fewest workers (ties: fewer median worker-seconds)
    whose median attainment is at least the autoscaled median minus `margin` (None when none
    is)."""
    assert static_runs, "no static fleet to compare with"
    assert all(len(v) == len(auto_runs) for v in static_runs.values()), \
        "each static runs as often as the autoscaled side"
    auto = _row("autoscaled", auto_runs)
    rows = []
    for (p, d), runs in sorted(static_runs.items(), key=lambda kv: (sum(kv[0]), kv[0])):
        rows.append({**_row(f"static {p}P:{d}D", runs), "prefill": p, "decode": d,
                     "size": p + d})
    def med(r: dict, k: str) -> float:
        return r[k]["median"]
    best = max(rows, key=lambda r: (round(med(r, "slo_attainment"), 9),
                                    -med(r, "worker_seconds")))
    bar = med(auto, "slo_attainment") - margin
    meeting = [r for r in rows if med(r, "slo_attainment") >= bar - 1e-12]
    smallest = min(meeting, key=lambda r: (r["size"], med(r, "worker_seconds")),
                   default=None)
    ws_small = med(smallest, "worker_seconds") if smallest else None
    return {
        "repeats": len(auto_runs), "slo_margin": margin,
        "static_sizes_tried": sorted({r["size"] for r in rows}),
        "statics_tried": len(rows),
        "worker_seconds_autoscaled": med(auto, "worker_seconds"),
        "slo_attainment_autoscaled": med(auto, "slo_attainment"),
        "smallest_static_meeting_slo": smallest["label"] if smallest else None,
        "worker_seconds_smallest_static_meeting_slo": ws_small,
        "slo_attainment_smallest_static_meeting_slo":
            med(smallest, "slo_attainment") if smallest else None,
        "best_static": best["label"],
        "worker_seconds_best_static": med(best, "worker_seconds"),
        "slo_attainment_best_static": med(best, "slo_attainment"),
        "autoscaled_row": auto, "smallest_static_row": smallest, "best_static_row": best,
        "static_rows": rows,
        "targets": {
            # no static within the margin: nothing to be cheaper than: not met (fails closed)
            "fewer_worker_seconds_than_smallest_static_meeting_slo":
                ws_small is not None and med(auto, "worker_seconds") < ws_small,
            "slo_within_5_points_of_best_static":
                med(auto, "slo_attainment") >= med(best, "slo_attainment") - margin - 1e-12,
        },
    }


def rival_lines(j: dict, unit: str = "worker-s") -> list[str]:
    """The three rows (autoscaled, smallest static meeting the SLO, best static): median and
    spread of worker-seconds and attainment, and the targets met or missed."""
    def line(name: str, row: dict | None) -> str:
        if row is None:
            return f"  {name:<34} {'none within ' + str(round(100 * j['slo_margin'])) + ' points':>24}"
        ws, at = row["worker_seconds"], row["slo_attainment"]
        return (f"  {name:<34} {ws['median']:>10.0f} +-{ws['spread'] / 2:<7.0f} "
                f"{100 * at['median']:>6.1f}% +-{50 * at['spread']:.1f}")
    lines = [f"  {'run (median of ' + str(j['repeats']) + ', +- half spread)':<34} "
             f"{unit:>10} {'':>9}{'attain':>7}",
             line("autoscaled", j["autoscaled_row"]),
             line("smallest static meeting SLO " + (j["smallest_static_meeting_slo"] or "")
                  .replace("static ", ""), j["smallest_static_row"]),
             line("best static " + j["best_static"].replace("static ", ""),
                  j["best_static_row"]),
             f"  statics tried: {j['statics_tried']} (sizes {_ranges(j['static_sizes_tried'])}"
             f", every P:D split), targets: " + ", ".join(
                 f"{k} {'met' if v else 'MISSED'}" for k, v in j["targets"].items())]
    return lines


def _ranges(sizes: Sequence[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if sizes and list(sizes) == list(
        range(sizes[0], sizes[-1] + 1)) else ",".join(map(str, sizes))
