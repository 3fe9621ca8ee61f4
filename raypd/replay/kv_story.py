"""The KV cache's story of one run, from the router's KV timeline (router/kv_timeline.py) and
the client's records: growth (KV bytes held against concurrency and context), reuse (the share
of prompt tokens served from cache against what the trace repeats) and the boundary (how close
the run came to each pool's edge, in blocks and in requests of the run's mean length).

    story = kv_story(timeline, records)       # JSON-ready, goes into report.json as `kv_story`

Every figure here is measured in the run (the timeline is sampled from the workers' own load
reports); `capacity_curves` (from `raypd bench capacity`, when it was run for the model) are
drawn beside the growth, never mixed into the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def rebase(timeline: dict | None, t0: float) -> dict | None:
    """The timeline with its times in seconds from unix time `t0` (the replay's start)."""
    if not timeline:
        return timeline
    shift = timeline["t0"] - t0
    out = {**timeline, "t0": t0, "workers": []}
    for w in timeline["workers"]:
        out["workers"].append({**w, "t": [round(t + shift, 3) for t in w["t"]],
                               "events": {k: [[round(t + shift, 3), n] for t, n in v]
                                          for k, v in w["events"].items()}})
    return out


def bytes_per_block(w: dict) -> int:
    return (w.get("block_size") or 0) * (w.get("kv_bytes_per_token") or 0)


def boundary(timeline: dict | None, mean_request_tokens: float | None) -> list[dict]:
    """Per worker: its pool, the most blocks requests referenced at once during the run, the
    headroom left at that moment in blocks and in requests of the run's mean length (prompt +
    output tokens, whole blocks), and the share of the pool reached."""
    rows = []
    for w in (timeline or {}).get("workers", []):
        total = w.get("total_blocks") or 0
        if not total or not w["t"]:
            continue
        peak = max(w["blocks_used_peak"])
        at = w["t"][w["blocks_used_peak"].index(peak)]
        head = total - peak
        per_req = math.ceil(mean_request_tokens / w["block_size"]) \
            if mean_request_tokens and w.get("block_size") else None
        rows.append({"worker_id": w["worker_id"], "role": w["role"], "pool_blocks": total,
                     "peak_blocks_used": peak, "peak_at_s": at, "peak_share": peak / total,
                     "headroom_blocks": head,
                     "headroom_requests": head // per_req if per_req else None,
                     "blocks_per_mean_request": per_req,
                     "peak_kv_bytes": peak * bytes_per_block(w) or None,
                     "min_free_blocks": min(w["blocks_free"])})
    return rows


def growth(timeline: dict | None) -> list[dict]:
    """Per decode worker (where contexts live while they grow; a prefill worker's snapshots
    fall between its steps, its blocks already handed on), the points (requests held, context
    tokens held, KV bytes referenced) of every sample with requests: how the KV held grows with
    concurrency and context."""
    out = []
    for w in (timeline or {}).get("workers", []):
        if w["role"] != "decode":
            continue
        bpb = bytes_per_block(w)
        pts = [(r, c, u * bpb) for r, c, u in zip(w["requests"], w["tokens_held"],
                                                   w["blocks_used"], strict=True) if r > 0]
        if pts:
            out.append({"worker_id": w["worker_id"], "role": w["role"],
                        "requests": [p[0] for p in pts], "tokens_held": [p[1] for p in pts],
                        "kv_bytes": [p[2] for p in pts],
                        "kv_bytes_per_token": w.get("kv_bytes_per_token")})
    return out


def reuse(records: Sequence) -> dict:
    """Over the finished requests in send order: the cumulative share of prompt tokens served
    from cache, and the cumulative share some earlier request had (the trace's repeat ceiling:
    no cache can serve more without computing ahead)."""
    ok = sorted((r for r in records if r.ok and r.prompt_tokens), key=lambda r: r.sent_s)
    t, served, ceiling = [], [], []
    p = c = rep = 0.0
    for r in ok:
        p += r.prompt_tokens
        c += r.cached_tokens
        rep += r.repeated_prefix * r.prompt_tokens
        t.append(round(r.sent_s, 3))
        served.append(round(c / p, 4))
        ceiling.append(round(rep / p, 4))
    return {"t": t, "served_from_cache": served, "repeat_ceiling": ceiling,
            "final_served": served[-1] if served else None,
            "final_ceiling": ceiling[-1] if ceiling else None,
            "share_of_ceiling": served[-1] / ceiling[-1] if ceiling and ceiling[-1] else None}


def event_totals(timeline: dict | None) -> dict[str, int]:
    """Every marker kind summed over all workers and the run."""
    tot: dict[str, int] = {}
    for w in (timeline or {}).get("workers", []):
        for k, v in w["events"].items():
            tot[k] = tot.get(k, 0) + sum(n for _, n in v)
    return tot


def kv_story(timeline: dict | None, records: Sequence,
             capacity_curves: dict | None = None) -> dict:
    ok = [r for r in records if r.ok]
    mean_len = (sum(r.prompt_tokens + r.output_tokens for r in ok) / len(ok)) if ok else None
    b = boundary(timeline, mean_len)
    edge = max(b, key=lambda r: r["peak_share"]) if b else None
    return {"mean_request_tokens": mean_len, "boundary": b,
            "closest_to_edge": edge["worker_id"] if edge else None,
            "peak_kv_share": edge["peak_share"] if edge else None,
            "headroom_requests": edge["headroom_requests"] if edge else None,
            "growth": growth(timeline), "reuse": reuse(records),
            "events": event_totals(timeline), "capacity_curves": capacity_curves}


# ---- plots (matplotlib figures; the caller renders them) -----------------------------------
EVENT_STYLE = {"evictions": ("v", "tab:red"), "preemptions": ("X", "black"),
               "tier2_demotions": ("s", "tab:purple"), "tier2_reloads": ("D", "tab:green"),
               "transfers": ("|", "tab:gray"), "transfers_rejected": ("x", "tab:red"),
               "restarts": ("*", "tab:orange")}


def timeline_figure(plt: Any, timeline: dict, span_s: float | None = None) -> Any:
    """Per worker: blocks referenced / cached-but-free / free stacked to the pool size (the
    boundary, dashed), the events as markers above; below, the windowed hit rate. The time
    axis covers the replay (0 .. `span_s`) and every sample."""
    ws = timeline["workers"]
    fig, axes = plt.subplots(2 * len(ws), 1, figsize=(13, 3.3 * len(ws) + 0.5),
                             gridspec_kw={"height_ratios": [3, 1] * len(ws)}, squeeze=False)
    for k, w in enumerate(ws):
        ax, hx = axes[2 * k][0], axes[2 * k + 1][0]
        t = w["t"]
        ax.stackplot(t, w["blocks_used"], w["blocks_cached"], w["blocks_free"],
                     labels=["referenced by requests", "cached, free (reusable)", "free"],
                     colors=["#3a6fd8", "#9cc3f0", "#eef1f6"], step="post")
        ax.step(t, w["blocks_used_peak"], where="post", color="#1d2330", linewidth=0.8,
                label="peak referenced")
        total = w.get("total_blocks") or 0
        if total:
            ax.axhline(total, color="tab:red", linestyle="--", linewidth=1,
                       label=f"pool: {total} blocks")
        for kind, pts in w["events"].items():
            if pts:
                m, c = EVENT_STYLE.get(kind, ("o", "gray"))
                ax.scatter([p[0] for p in pts], [total * 1.04] * len(pts), marker=m, color=c,
                           s=[min(120, 18 + 6 * p[1]) for p in pts], clip_on=False,
                           label=f"{kind.replace('_', ' ')} ({sum(p[1] for p in pts)})")
        ax.set_ylim(0, max(total, max(w["blocks_used_peak"], default=0)) * 1.1 or 1)
        ax.set_xlim(min(0.0, *t), max(span_s or 0.0, *t, 1e-3))
        ax.set_ylabel("blocks")
        ax.set_title(f"{w['worker_id']} ({w['role']}): KV blocks over time")
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
        hr = [(x, y) for x, y in zip(t, w["hit_rate"], strict=True) if y is not None]
        if hr:
            hx.plot([p[0] for p in hr], [p[1] for p in hr], color="tab:green")
        hx.set_ylim(-0.02, 1.02)
        hx.set_xlim(ax.get_xlim())
        hx.set_ylabel("hit rate")
        hx.set_xlabel(f"seconds from the start of the replay (hit rate over the last "
                      f"{timeline.get('window_s', 0):g} s)")
        hx.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def story_figure(plt: Any, story: dict, timeline: dict) -> Any:
    """Growth -> reuse -> boundary, side by side."""
    fig, (g, r, b) = plt.subplots(1, 3, figsize=(13, 3.8))
    for k, w in enumerate(story["growth"]):
        per = [c / n for c, n in zip(w["tokens_held"], w["requests"], strict=True)]
        sc = g.scatter(w["requests"], [x / 2**20 for x in w["kv_bytes"]], c=per, s=12,
                       cmap="viridis", marker="o^sDv"[k % 5], label=w["worker_id"])
    if story["growth"]:
        fig.colorbar(sc, ax=g, label="context tokens per request")
    curves = story.get("capacity_curves") or {}
    for scheme in ("paged", "paged_prefix"):
        ys = (curves.get("peak_bytes_vs_concurrency") or {}).get(scheme)
        if ys:
            g.plot(curves["concurrencies"], [y / 2**20 for y in ys], linestyle=":",
                   label=f"bench capacity: {scheme} (ctx {curves.get('fixed_context')})")
    g.set_xlabel("requests held by the worker")
    g.set_ylabel("KV referenced (MiB)")
    g.set_title("growth: KV held vs concurrency")
    if story["growth"] or curves:
        g.legend(fontsize=7)
    g.grid(alpha=0.3)
    ru = story["reuse"]
    r.plot(ru["t"], ru["served_from_cache"], label="served from cache")
    r.plot(ru["t"], ru["repeat_ceiling"], linestyle="--", label="the trace repeats (ceiling, without earlier traffic)")
    r.set_ylim(-0.02, 1.02)
    r.set_xlabel("seconds (request sent)")
    r.set_ylabel("share of prompt tokens, cumulative")
    r.set_title("reuse: cache hits vs what the trace repeats")
    r.legend(fontsize=7, loc="lower right")
    r.grid(alpha=0.3)
    for w in timeline["workers"]:
        total = w.get("total_blocks") or 0
        if total:
            b.step(w["t"], [u / total for u in w["blocks_used_peak"]], where="post",
                   label=w["worker_id"])
    b.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="pool edge")
    edge = next((x for x in story["boundary"] if x["worker_id"] == story["closest_to_edge"]),
                None)
    if edge:
        b.annotate(f"headroom {edge['headroom_blocks']} blocks"
                   + (f" = {edge['headroom_requests']} requests" if edge["headroom_requests"]
                      is not None else ""), (edge["peak_at_s"], edge["peak_share"]),
                   xytext=(0.05, 0.9), textcoords="axes fraction", fontsize=8,
                   arrowprops={"arrowstyle": "->", "color": "gray"})
    b.set_ylim(0, 1.1)
    b.set_xlabel("seconds from the start of the replay")
    b.set_ylabel("peak blocks referenced / pool")
    b.set_title("boundary: how close to the pool's edge")
    b.legend(fontsize=7, loc="lower right")
    b.grid(alpha=0.3)
    fig.tight_layout()
    return fig
