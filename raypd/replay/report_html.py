"""The replay report as one self-contained HTML page (plots inlined as PNG), read top down:

1. the first screen answers "was it good?": throughput, goodput against the SLOs, TTFT and TPOT
   p50/p99, hit rate against the trace's repeat ceiling, peak KV share, failures, each tile
   labelled with its evidence level, and the diagnosis with the action it recommends;
2. the KV cache over time (the router's KV timeline: blocks referenced, cached and free per
   worker against the pool size, the hit rate over a sliding window, event markers);
3. growth -> reuse -> boundary in one figure, with the boundary per worker as a table;
4. latency, handoff stages, the other plots, KV usage per worker, failures;
5. parameters, the text summary, and every raw key of report.json, last.

Every tile carries data-field / data-value (the raw report value) so tests can check it.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache.manager import cdiv
from raypd.replay.report import summary_lines


def _png(fig, alt: str = "plot") -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return (f"<img alt='{html.escape(alt)}' src='data:image/png;base64,"
            + base64.b64encode(buf.getvalue()).decode() + "'>")


def _plots(report: dict, records: Sequence) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["<p>(plots need matplotlib: pip install matplotlib)</p>"]
    ok = [r for r in records if r.ok]
    out = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    slo = report["slo"]
    for ax, (name, vals, line) in zip(axes, [
            ("TTFT (s)", [r.ttft_s for r in ok], slo["ttft_s"]),
            ("TPOT (s)", [r.tpot_s for r in ok], slo["tpot_s"]),
            ("E2E (s)", [r.e2e_s for r in ok], None)], strict=True):
        v = sorted(x for x in vals if x is not None)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post")
        if line is not None:
            ax.axvline(line, color="red", linestyle="--", linewidth=1, label="SLO")
            ax.legend(loc="lower right")
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests")
        ax.set_title(f"CDF of {name.split()[0]}")
        ax.grid(alpha=0.3)
    out.append(_png(fig))
    plt.close(fig)
    itl = [x for r in ok for x in r.itl_s]
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.4))
    if itl:
        axes[0].hist(itl, bins=50)
    axes[0].set_xlabel("inter-token latency (s)")
    axes[0].set_ylabel("chunks")
    axes[0].set_title("ITL histogram")
    xs = [r.prompt_tokens for r in ok if r.ttft_s is not None]
    ys = [r.ttft_s for r in ok if r.ttft_s is not None]
    cs = [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0
          for r in ok if r.ttft_s is not None]
    sc = axes[1].scatter(xs, ys, c=cs, cmap="viridis", vmin=0, vmax=1, s=12)
    fig.colorbar(sc, ax=axes[1], label="cached share of prompt")
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_title("TTFT vs prompt length and cache hit")
    out.append(_png(fig))
    plt.close(fig)
    rs = sorted(records, key=lambda r: r.sent_s)
    fig, ax = plt.subplots(figsize=(13, max(3.0, min(12.0, 0.03 * len(rs) + 2))))
    for i, r in enumerate(rs):
        ax.hlines(i, r.scheduled_s, r.sent_s, color="lightgray", linewidth=1)
        first = r.first_token_s if r.first_token_s is not None else r.end_s
        ax.hlines(i, r.sent_s, first, color="tab:orange" if r.ok else "tab:red", linewidth=1.5)
        if r.ok:
            ax.hlines(i, first, r.end_s, color="tab:blue", linewidth=1.5)
    ax.set_xlabel("seconds from the start of the replay")
    ax.set_ylabel("request (by send time)")
    ax.set_title("timeline: queued at client (gray), waiting for the first token (orange), "
                 "decoding (blue), failed (red)")
    out.append(_png(fig))
    plt.close(fig)
    return out


def _pairs(d: dict, columns: int = 3) -> str:
    """A one-row record as name / value pairs, in side-by-side columns (fits any width)."""
    items = list(d.items())
    if not items:
        return "<p>(none)</p>"
    per = cdiv(len(items), columns)

    def cell(v: Any) -> str:
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, dict | list):
            v = ", ".join(f"{k}: {x}" for k, x in v.items()) if isinstance(v, dict) else \
                ", ".join(map(str, v))
        return html.escape("" if v is None else str(v))
    tables = []
    for i in range(0, len(items), per):
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{cell(v)}</td></tr>"
                       for k, v in items[i:i + per])
        tables.append(f"<table>{rows}</table>")
    return f"<div class='pairs'>{''.join(tables)}</div>"


def _table(rows: Sequence[dict], cols: Sequence[str] | None = None) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(cols or dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        if isinstance(v, float):
            v = f"{v:.4g}"
        return html.escape("" if v is None else str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>"


def _fmt_ms(p: dict | None, key: str) -> str:
    v = (p or {}).get(key)
    return "-" if v is None else f"{v * 1000:,.0f} ms"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.0%}"


def tiles(r: dict) -> list[dict]:
    """The first screen's figures: name, shown value, raw value, what it is measured against,
    evidence level."""
    ev = r["evidence_level"]
    st = r.get("kv_story") or {}
    reuse = st.get("reuse") or {}
    slo = r["slo"]
    failed = r["requests_failed"]
    return [
        {"field": "throughput_tok_s", "name": "throughput", "raw": r["throughput_tok_s"],
         "value": f"{r['throughput_tok_s']:,.1f} tok/s",
         "sub": f"{r['requests_per_s']:.2f} requests/s, {r['input_tok_s']:,.0f} prompt tok/s",
         "evidence": ev},
        {"field": "goodput", "name": "goodput", "raw": r["goodput"], "value": _pct(r["goodput"]),
         "sub": f"of requests met TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s",
         "evidence": ev},
        {"field": "ttft_s.p50", "name": "TTFT p50 / p99", "raw": r["ttft_s"].get("p50"),
         "value": f"{_fmt_ms(r['ttft_s'], 'p50')} / {_fmt_ms(r['ttft_s'], 'p99')}",
         "sub": f"SLO {slo['ttft_s'] * 1000:,.0f} ms", "evidence": ev},
        {"field": "tpot_s.p50", "name": "TPOT p50 / p99", "raw": r["tpot_s"].get("p50"),
         "value": f"{_fmt_ms(r['tpot_s'], 'p50')} / {_fmt_ms(r['tpot_s'], 'p99')}",
         "sub": f"SLO {slo['tpot_s'] * 1000:,.0f} ms", "evidence": ev},
        {"field": "hit_rate", "name": "prefix-cache hit rate", "raw": r["hit_rate"],
         "value": _pct(r["hit_rate"]),
         "sub": f"the trace itself repeats {_pct(reuse.get('final_ceiling'))} of its prompt "
                "tokens", "evidence": ev},
        {"field": "peak_kv_share", "name": "peak KV share", "raw": st.get("peak_kv_share"),
         "value": _pct(st.get("peak_kv_share")),
         "sub": (f"{st['closest_to_edge']}: headroom {st['headroom_requests']} requests of "
                 f"the mean length" if st.get("headroom_requests") is not None else
                 "of the fullest pool"), "evidence": ev},
        {"field": "requests_failed", "name": "failures", "raw": failed,
         "value": f"{failed} of {r['requests_sent']}",
         "sub": ", ".join(f"HTTP {k}: {v}" for k, v in r["failures_by_status"].items())
                or "none failed", "evidence": ev, "bad": failed > 0},
    ]


def headline(r: dict) -> str:
    """One sentence: how many met the SLOs, failures, the pool's peak and the reuse."""
    st = r.get("kv_story") or {}
    reuse = st.get("reuse") or {}
    parts = [f"{_pct(r['goodput'])} of {r['requests_sent']} requests met both SLOs",
             f"{r['requests_failed']} failed"]
    if st.get("peak_kv_share") is not None:
        parts.append(f"the fullest KV pool ({st['closest_to_edge']}) peaked at "
                     f"{_pct(st['peak_kv_share'])}")
    if reuse.get("final_served") is not None:
        parts.append(f"the cache served {_pct(reuse['final_served'])} of prompt tokens where "
                     f"the trace repeats {_pct(reuse['final_ceiling'])}")
    return "; ".join(parts) + "."


def first_screen(r: dict) -> str:
    cards = "".join(
        f"<div class='tile{' bad' if t.get('bad') else ''}' data-field='{t['field']}' "
        f"data-value='{html.escape(str(t['raw']))}'><div class='name'>{html.escape(t['name'])}"
        f"</div><div class='value'>{html.escape(t['value'])}</div>"
        f"<div class='sub'>{html.escape(t['sub'])}</div>"
        f"<div class='ev'>{html.escape(t['evidence'])}</div></div>" for t in tiles(r))
    diag = "".join(
        f"<li><b>{html.escape(d['finding'])}</b>"
        + (f" <span class='action'>action: {html.escape(d['because']['action'])}</span>"
           if "action" in d.get("because", {}) else "")
        + "<details><summary>figures</summary><code>"
        + html.escape(", ".join(f"{k}={v}" for k, v in d["because"].items()))
        + "</code></details></li>" for d in r["diagnosis"])
    return (f"<section id='verdict'><h2>Was it good?</h2><p class='headline'>"
            f"{html.escape(headline(r))}</p><div class='tiles'>{cards}</div>"
            f"<h3>Diagnosis</h3><ul class='diag'>{diag}</ul></section>")


def kv_sections(r: dict) -> list[str]:
    tl, st = r.get("kv_timeline"), r.get("kv_story") or {}
    if not tl or not tl.get("workers"):
        return ["<h2>KV cache over time</h2><p>(no KV timeline: the server did not give one; "
                "it needs GET /api/kv_timeline)</p>"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["<p>(plots need matplotlib: pip install matplotlib)</p>"]
    from raypd.replay.kv_story import story_figure, timeline_figure
    fig = timeline_figure(plt, tl, r.get("wall_s"))
    timeline_png = _png(fig, "KV timeline")
    plt.close(fig)
    fig = story_figure(plt, st, tl)
    story_png = _png(fig, "KV growth, reuse and boundary")
    plt.close(fig)
    ev = st.get("events") or {}
    events = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in ev.items() if v) or "none"
    curves = st.get("capacity_curves")
    note = (f"Dotted: <code>raypd bench capacity</code>'s paged curves for this model "
            f"({html.escape(str(curves.get('evidence')))}, context {curves.get('fixed_context')})."
            if curves else "Run <code>raypd bench capacity</code> for this model to draw its "
            "growth curves beside the run's points.")
    return [
        "<section id='kv-timeline'><h2>KV cache over time</h2>",
        f"<p class='muted'>Per worker, from its load reports (every "
        f"{tl.get('interval_s', 0):g} s at most): blocks referenced by requests, cached but "
        f"free, free, and the pool size (dashed); markers: {html.escape(events)}.</p>",
        timeline_png, "</section>",
        "<section id='kv-story'><h2>Growth, reuse, boundary</h2>",
        f"<p class='muted'>{note}</p>", story_png,
        _table(st.get("boundary") or []), "</section>",
    ]


STYLE = ("body{font-family:system-ui,sans-serif;margin:16px auto;max-width:1300px;"
         "padding:0 12px;color:#1d2330}"
         "table{border-collapse:collapse;margin:8px 0}"
         "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}"
         "th{background:#f0f0f0}img{max-width:100%;height:auto}"
         "pre{background:#f7f7f7;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}"
         "code{overflow-wrap:anywhere}"
         ".scroll{overflow-x:auto;max-width:100%}"
         ".pairs{display:flex;flex-wrap:wrap;gap:0 24px;align-items:flex-start;max-width:100%}"
         ".pairs td:first-child{text-align:left;color:#555}"
         ".pairs td{overflow-wrap:anywhere;max-width:360px}"
         "h1{font-size:22px;overflow-wrap:anywhere}"
         ".headline{font-size:15px}"
         ".tiles{display:grid;grid-template-columns:repeat(auto-fill,minmax(165px,1fr));"
         "gap:10px}"
         ".tile{border:1px solid #d9dde6;border-radius:6px;padding:8px 10px;background:#fff;"
         "min-width:0}"
         ".tile .name{color:#6b7385;font-size:12px}"
         ".tile .value{font-size:20px;font-weight:600;overflow-wrap:anywhere}"
         ".tile .sub{font-size:12px;color:#444;overflow-wrap:anywhere}"
         ".tile .ev{display:inline-block;margin-top:4px;font-size:11px;color:#2a5db0;"
         "border:1px solid #b9cdf0;border-radius:8px;padding:0 6px}"
         ".tile.bad .value{color:#c8383d}"
         ".diag li{margin:4px 0;overflow-wrap:anywhere}.action{color:#2f7d4f;font-weight:600}"
         ".muted{color:#6b7385}")


def render_html(report: dict, records: Sequence) -> str:
    r = report
    metrics = []
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        metrics.append({"metric": key, **{k: r[key][k] for k in ("p50", "p90", "p99", "mean",
                                                                  "n")}})
    flat = {k: v for k, v in r.items() if not isinstance(v, dict | list)}
    summary = html.escape("\n".join(summary_lines(r)))
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        "<title>raypd report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>raypd replay report <small>({html.escape(r['evidence_level'])})</small></h1>",
        first_screen(r),
        *kv_sections(r),
        "<h2>Latency</h2>", _table(metrics),
        "<h2>Handoff stages <small>(per request, from the router's traces)</small></h2>",
        _table(_stage_rows(r.get("stage_breakdown"))),
        "<h2>Plots</h2>", *_plots(r, records),
        "<h2>Per worker (KV usage)</h2>", _table(r["per_actor"]),
        "<h2>Failures (first 20)</h2>", _table(r["errors"]),
        "<h2>Parameters</h2>", _pairs(r["params"]),
        "<h2>Summary</h2>", f"<pre>{summary}</pre>",
        "<h2>All figures <small>(report.json's scalar keys)</small></h2>", _pairs(flat),
        "</body></html>",
    ]
    return "\n".join(parts)


def _stage_rows(breakdown: dict | None) -> list[dict]:
    """One row per stage: p50 / p90 / p99 / mean in ms and how many requests had it."""
    rows = []
    for stage, p in (breakdown or {}).items():
        ms = {k: None if p.get(k) is None else round(p[k] * 1e3, 3)
              for k in ("p50", "p90", "p99", "mean")}
        rows.append({"stage": stage, **{f"{k} ms": v for k, v in ms.items()}, "n": p.get("n")})
    return rows


def write_html(report: dict, records: Sequence, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_html(report, records), encoding="utf-8")
