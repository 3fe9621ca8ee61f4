"""The replay report: latency percentiles, goodput, KV figures per worker, the KV cache's
timeline and story (raypd/replay/kv_story.py), and a diagnosis that applies the KV lifecycle
decision table to what was measured; as JSON and a short text summary (the HTML page is
report_html.py).

Decision table (each rule names the figures that triggered it; thresholds below):
  cache near full and evicting/preempting as contexts grow  -> capacity bound
  prefixes repeat but the cache misses them, or hits don't cut TTFT -> reuse not effective
  P99 worse at high concurrency with fragmented blocks or preemptions -> allocation/scheduling
  cache mostly free but the engine idle or few requests in flight -> request organisation
  the pool is the boundary (capacity bound)  -> the capacity action that would have served the
      run best: keep (evictions cost no reuse), evict to tier 2 (reload measured cheaper than
      prefill), compress (a quantized KV dtype whose kv-quality gate passed; first choice when
      requests were preempted, since only more capacity helps running requests), or recompute
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from raypd.replay.kv_story import kv_story
from router.percentiles import percentiles

# ---- decision-table thresholds -------------------------------------------------------------
CAPACITY_PEAK_SHARE = 0.85        # peak blocks used / pool, on some worker
REUSE_MIN_REPEATED = 0.30         # share of prompt tokens an earlier request already had
REUSE_MISSED_FACTOR = 0.5         # hit rate below this x the repeated share: reuse missed
REUSE_TTFT_RATIO = 0.8            # TTFT p50 of hits / misses at or above this: hits don't help
REUSE_MIN_GROUP = 5               # requests needed in each of the hit and miss groups
HIT_SHARE, MISS_SHARE = 0.5, 0.1  # a request is a hit / miss by its cached share of the prompt
CONCURRENCY_P99_RATIO = 2.0       # TTFT p99 at high / low concurrency
FRAGMENTATION = 0.3               # 1 - block utilization (tokens stored / block capacity)
CONCURRENCY_MIN_GROUP = 10
IDLE_PEAK_SHARE = 0.5             # cache "free": peak blocks used / pool below this everywhere
IDLE_BUSY_SHARE = 0.5             # engine busy share of the replay below this: under-fed
IDLE_IN_FLIGHT_SHARE = 0.5        # or mean requests in flight below this x the cap

COUNTERS = ("prompt_tokens", "reused_tokens", "computed_tokens", "recomputed_tokens",
            "evictions", "preemptions", "requests_finished", "requests_rejected", "busy_s",
            "steps", "transfer_offered", "transfer_bytes_staged",
            "tier2_demotions", "tier2_hits", "tier2_recomputed", "reloaded_tokens", "reload_s",
            "recompute_avoided_s")
TIER2_COUNTERS = COUNTERS[-6:]
COST_GAUGES = ("reload_s_per_token", "prefill_s_per_token")   # measured by each engine
EVIDENCE_LEVELS = ("cpu-measured", "gpu-measured", "simulated")


def _delta(after: dict, before: dict | None, key: str) -> Any:
    a = after.get(key)
    if a is None:
        return None
    b = (before or {}).get(key) or 0
    return a - b


def evidence_from_devices(devices: Sequence[str]) -> str:
    """`gpu-measured` only when every worker reported a cuda pool; a run with no device
    reported, or any CPU pool, is `cpu-measured` (GPUs reserved is not GPUs used)."""
    return "gpu-measured" if devices and all(d == "cuda" for d in devices) else "cpu-measured"


def per_actor_rows(after: Sequence[dict] | None, before: Sequence[dict] | None,
                   wall_s: float) -> list[dict]:
    """One row per worker: counters as deltas over the replay; gauges and peaks as last seen
    (`peak_blocks_used` is since the worker started)."""
    prev = {s.get("worker_id"): s for s in before or ()}
    rows = []
    for s in after or ():
        b = prev.get(s.get("worker_id"))
        row = {"worker_id": s.get("worker_id"), "role": s.get("role")}
        for k in COUNTERS:
            d = _delta(s, b, k)
            if d is not None:
                row[k] = d
        if row.get("prompt_tokens"):
            row["hit_rate"] = row.get("reused_tokens", 0) / row["prompt_tokens"]
        elif "hit_rate" in s:
            row["hit_rate"] = s["hit_rate"]
        for k in ("num_blocks", "peak_blocks_used", "block_utilization", "blocks_used",
                  "blocks_cached", "block_size", "kv_dtype", "tier2_blocks", "tier2_slots",
                  "device", "device_name", *COST_GAUGES):
            if k in s:
                row[k] = s[k]
        if row.get("num_blocks") and row.get("peak_blocks_used") is not None:
            row["peak_block_share"] = row["peak_blocks_used"] / row["num_blocks"]
        if row.get("busy_s") is not None and wall_s > 0:
            row["busy_share"] = row["busy_s"] / wall_s
        rows.append(row)
    return rows


def _sum(rows: Sequence[dict], key: str) -> Any:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) if vals else None


def _mean(rows: Sequence[dict], key: str) -> Any:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _weighted_repeated(records) -> float | None:
    w = [(r.repeated_prefix, r.prompt_tokens or 1) for r in records]
    total = sum(n for _, n in w)
    return sum(s * n for s, n in w) / total if total else None


def _r(x: Any, nd: int = 4) -> Any:
    return round(x, nd) if isinstance(x, float) else x


def _gate_summary(kv_gates: dict | None) -> dict:
    """{kv_dtype: {passed, failures, teacher_forced_agreement, mean_kl, ppl_delta_pct,
    greedy_agreement (information), capacity_ratio, evidence}} of the recorded kv-quality gates
    (`raypd bench kv-quality`, judged against the bf16 noise floor) of the run's model."""
    out = {}
    for fmt, g in (kv_gates or {}).items():
        out[fmt] = {k: _r(g.get(k)) for k in ("passed", "failures", "teacher_forced_agreement",
                                              "mean_kl", "ppl_delta_pct", "greedy_agreement",
                                              "capacity_ratio", "evidence")}
    return out


def capacity_action(m: dict, kv_gates: dict | None = None) -> dict:
    """Which capacity action would have served a run whose pool was the boundary, from its
    measured figures: the prompt tokens that eviction or preemption made the engines compute
    again, what recomputing them cost (measured prefill s/token) against reloading them from
    tier 2 (measured reload s/token, when tier 2 ran), and the kv-quality gates for compress."""
    tier2_on = bool(m.get("tier2_slots"))
    pre = m.get("preemptions") or 0
    recomputed = m.get("recomputed_tokens") or 0
    rep, prompt, reused = (m.get("repeated_prefix_share"), m.get("prompt_tokens"),
                           m.get("reused_tokens"))
    # prompt tokens that repeat an earlier prompt's prefix yet no cache served (evicted, or
    # routed where the prefix was not): an upper bound of the reuse eviction cost
    missed = max(0, round(rep * prompt - reused)) if None not in (rep, prompt, reused) else 0
    reloaded = m.get("reloaded_tokens") or 0
    lost = missed + reloaded      # reloaded tokens were served (counted reused), but by tier 2
    lost_source = "repeated-prefix tokens no cache served" + \
        (" + tokens reloaded from tier 2" if tier2_on else "")
    prefill, reload = m.get("prefill_s_per_token"), m.get("reload_s_per_token")
    passed = {f: g for f, g in (kv_gates or {}).items() if g.get("passed")}
    best_fmt = max(passed, key=lambda f: passed[f].get("capacity_ratio") or 0) if passed else None
    needed = lost + recomputed
    reload_cheaper = reload is not None and prefill is not None and reload < prefill
    if needed == 0:
        action, why = "keep", "the evicted blocks were never needed again and nothing was " \
                              "preempted: evicting cost no reuse"
    elif best_fmt is not None and (pre > 0 or not reload_cheaper):
        action, why = "compress", f"{best_fmt} passed its kv-quality gate and holds " \
                                  f"{passed[best_fmt].get('capacity_ratio') or 0:.2f}x the " \
                                  "tokens" + (" (requests were preempted: only more " \
                                              "capacity helps running requests)" if pre else "")
    elif reload_cheaper and lost > 0:
        action, why = "evict to tier 2", "reloading measured cheaper per token than prefill"
    else:
        action = "recompute"
        if not tier2_on:
            why = "no measured cheaper action: tier 2 was off (reload cost not measured; " \
                  "set engine.kv_tier2_gb) and no quantized KV dtype passed its gate"
        else:
            why = "reloading was not measured cheaper than prefill, and no quantized KV " \
                  "dtype passed its gate"
    est = {"recompute_s": _r(needed * prefill) if prefill is not None else None,
           "evict_to_tier2_s": _r(lost * reload + recomputed * prefill)
           if reload is not None and prefill is not None else None}
    return {"finding": f"capacity action: {action} would have served this run best ({why})",
            "because": {"action": action, "reuse_lost_tokens": lost,
                        "reuse_lost_source": lost_source, "recomputed_tokens": recomputed,
                        # unrounded here: _clean keeps 6 significant digits
                        "prefill_s_per_token": prefill,
                        "reload_s_per_token": reload, "estimated_s": est,
                        "tier2_enabled": tier2_on,
                        **{k: _r(m.get(k)) for k in TIER2_COUNTERS},
                        "evictions": m.get("evictions") or 0, "preemptions": pre,
                        "kv_gate": _gate_summary(kv_gates)}}


def diagnose(m: dict, records: Sequence, per_actor: Sequence[dict],
             kv_gates: dict | None = None) -> list[dict]:
    """The decision table applied to measured figures `m`; each line carries its numbers.
    `kv_gates`: the model's recorded kv-quality gates per quantized dtype (for compress)."""
    out = []
    peak = m.get("peak_block_share")
    ev, pre = m.get("evictions") or 0, m.get("preemptions") or 0
    if peak is not None and peak >= CAPACITY_PEAK_SHARE and (ev > 0 or pre > 0):
        out.append({"finding": "capacity bound: the KV pool fills as contexts grow and blocks "
                               "are evicted or requests preempted",
                    "because": {"peak_block_share": _r(peak), "evictions": ev,
                                "preemptions": pre,
                                "mean_prompt_tokens": _r(m.get("mean_prompt_tokens"), 1),
                                "max_prompt_tokens": m.get("max_prompt_tokens"),
                                "threshold_peak_block_share": CAPACITY_PEAK_SHARE}})
        out.append(capacity_action(m, kv_gates))
    rep, hit = m.get("repeated_prefix_share"), m.get("hit_rate")
    ok = [r for r in records if r.ok and r.prompt_tokens and r.ttft_s is not None]
    if rep is not None and hit is not None and rep >= REUSE_MIN_REPEATED:
        if hit < REUSE_MISSED_FACTOR * rep:
            out.append({"finding": "reuse not effective: prompts repeat earlier prefixes but "
                                   "the cache served few of them",
                        "because": {"repeated_prefix_share": _r(rep), "hit_rate": _r(hit),
                                    "threshold": f"hit_rate < {REUSE_MISSED_FACTOR} x "
                                                 "repeated_prefix_share"}})
        else:
            hits = [r.ttft_s for r in ok if r.cached_tokens / r.prompt_tokens >= HIT_SHARE]
            miss = [r.ttft_s for r in ok if r.cached_tokens / r.prompt_tokens < MISS_SHARE]
            if len(hits) >= REUSE_MIN_GROUP and len(miss) >= REUSE_MIN_GROUP:
                h, s = statistics.median(hits), statistics.median(miss)
                if s > 0 and h / s >= REUSE_TTFT_RATIO:
                    out.append({"finding": "reuse not effective: cache hits do not shorten TTFT",
                                "because": {"hit_rate": _r(hit), "ttft_p50_hits_s": _r(h),
                                            "ttft_p50_misses_s": _r(s),
                                            "ttft_hit_vs_miss_ratio": _r(h / s),
                                            "requests_hit": len(hits), "requests_miss": len(miss),
                                            "threshold_ratio": REUSE_TTFT_RATIO}})
    levels = sorted(r.in_flight_at_send for r in ok)
    if len(levels) >= 2 * CONCURRENCY_MIN_GROUP:
        cut = statistics.median(levels)
        low = [r for r in ok if r.in_flight_at_send <= cut]
        high = [r for r in ok if r.in_flight_at_send > cut]
        if len(low) >= CONCURRENCY_MIN_GROUP and len(high) >= CONCURRENCY_MIN_GROUP:
            p_low = percentiles([r.ttft_s for r in low])["p99"]
            p_high = percentiles([r.ttft_s for r in high])["p99"]
            util = m.get("block_utilization")
            frag = None if not util else 1 - util
            if p_low and p_high / p_low >= CONCURRENCY_P99_RATIO and (
                    (frag is not None and frag >= FRAGMENTATION) or pre > 0):
                out.append({"finding": "allocation or scheduling: P99 TTFT grows with "
                                       "concurrency while blocks fragment or requests are "
                                       "preempted",
                            "because": {"in_flight_low_max": cut,
                                        "ttft_p99_low_s": _r(p_low),
                                        "ttft_p99_high_s": _r(p_high),
                                        "ratio": _r(p_high / p_low),
                                        "fragmentation": _r(frag), "preemptions": pre,
                                        "threshold_ratio": CONCURRENCY_P99_RATIO,
                                        "threshold_fragmentation": FRAGMENTATION}})
    busy = [r["busy_share"] for r in per_actor if r.get("busy_share") is not None]
    max_busy = max(busy) if busy else None
    mif, cap = m.get("mean_in_flight"), m.get("concurrency")
    if peak is not None and peak < IDLE_PEAK_SHARE and (
            (max_busy is not None and max_busy < IDLE_BUSY_SHARE)
            or (max_busy is None and mif is not None and cap
                and mif < IDLE_IN_FLIGHT_SHARE * cap)):
        out.append({"finding": "request organisation: the KV cache is mostly free but the "
                               "workers are under-fed (few requests in flight or engines "
                               "idle); batch more, raise concurrency or the arrival rate",
                    "because": {"peak_block_share": _r(peak),
                                "max_worker_busy_share": _r(max_busy),
                                "mean_in_flight": _r(mif, 2), "concurrency_cap": cap,
                                "throughput_tok_s": _r(m.get("throughput_tok_s"), 1),
                                "threshold_peak_block_share": IDLE_PEAK_SHARE,
                                "threshold_busy_share": IDLE_BUSY_SHARE}})
    if not out:
        out.append({"finding": "no rule of the decision table triggered",
                    "because": {"peak_block_share": _r(peak), "hit_rate": _r(hit),
                                "repeated_prefix_share": _r(rep),
                                "block_utilization": _r(m.get("block_utilization")),
                                "max_worker_busy_share": _r(max_busy),
                                "evictions": ev, "preemptions": pre}})
    return out


def build_report(records: Sequence, *, params: dict, wall_s: float,
                 stats_before: Sequence[dict] | None = None,
                 stats_after: Sequence[dict] | None = None,
                 slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.25,
                 concurrency: int | None = None, stats_source: str | None = None,
                 evidence_level: str | None = None,
                 stage_breakdown: dict | None = None,
                 kv_timeline: dict | None = None,
                 capacity_curves: dict | None = None) -> dict:
    """The report dict (JSON-ready) of one replay's RequestRecords and the server's per-worker
    stats before and after it; `stage_breakdown` (router/request_traces.stage_breakdown of the
    replayed requests' handoff traces) goes in as is; `kv_timeline` (the router's, its times
    from the replay's start: kv_story.rebase) as `kv_timeline`, and what it tells with the
    records as `kv_story`; `capacity_curves`: `raypd bench capacity`'s for the model, if run."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    span = (max((r.end_s for r in records), default=0.0)
            - min((r.sent_s for r in records), default=0.0))
    per_actor = per_actor_rows(stats_after, stats_before, span or wall_s)
    lifecycles = [r.lifecycle for r in ok if r.lifecycle]
    if prompt_tokens:
        reused = sum(r.cached_tokens for r in ok)
        hit_rate, hit_source = reused / prompt_tokens, "requests"
    else:
        prefill = [a for a in per_actor if a.get("role") == "prefill"] or per_actor
        reused = _sum(prefill, "reused_tokens")
        queried = _sum(prefill, "prompt_tokens")
        hit_rate = reused / queried if reused is not None and queried else None
        hit_source = "workers"
    if lifecycles:
        transfer_bytes = sum(lc.get("transfer_bytes") or 0 for lc in lifecycles)
        transfer_s = sum(lc.get("transfer_s") or 0.0 for lc in lifecycles)
    else:
        transfer_bytes, transfer_s = _sum(per_actor, "transfer_bytes_staged"), None
    shares = [a["peak_block_share"] for a in per_actor if "peak_block_share" in a]
    utils = [a["block_utilization"] for a in per_actor if a.get("block_utilization")]
    meets = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
             and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)]
    failures: dict[str, int] = {}
    for r in failed:
        failures[str(r.status)] = failures.get(str(r.status), 0) + 1
    m = {
        "requests_sent": len(records),
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "failures_by_status": failures,
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "tpot_s": percentiles([r.tpot_s for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        "input_tok_s": prompt_tokens / span if span > 0 else 0.0,
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "goodput": len(meets) / len(records) if records else 0.0,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "hit_rate": hit_rate,
        "hit_rate_source": hit_source,
        "reused_tokens": reused,
        "repeated_prefix_share": _weighted_repeated(ok) if ok else None,
        "peak_blocks_used": max((a["peak_blocks_used"] for a in per_actor
                                 if a.get("peak_blocks_used") is not None), default=None),
        "peak_block_share": max(shares) if shares else None,
        "block_utilization": statistics.fmean(utils) if utils else None,
        "evictions": _sum(per_actor, "evictions"),
        "preemptions": _sum(per_actor, "preemptions"),
        "recomputed_tokens": _sum(per_actor, "recomputed_tokens"),
        "tier2_slots": _sum(per_actor, "tier2_slots"),
        **{k: _sum(per_actor, k) for k in TIER2_COUNTERS},
        **{k: _mean(per_actor, k) for k in COST_GAUGES},
        "transfer_bytes": transfer_bytes,
        "transfer_s": transfer_s,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else None,
        "max_prompt_tokens": max((r.prompt_tokens for r in ok), default=None),
        "mean_in_flight": sum(r.e2e_s for r in records) / span if span > 0 else 0.0,
        "concurrency": concurrency,
        "wall_s": wall_s,
    }
    devices = sorted({a["device"] for a in per_actor if a.get("device")})
    if evidence_level is None:   # from where the pools really were (the workers' stats)
        evidence_level = evidence_from_devices(devices)
    if evidence_level not in EVIDENCE_LEVELS:
        raise ValueError(f"evidence_level must be one of {EVIDENCE_LEVELS}")
    report = {"params": params, **m, "per_actor": per_actor,
              "stats_source": stats_source,
              "diagnosis": diagnose(m, records, per_actor, params.get("kv_gates")),
              "stage_breakdown": stage_breakdown,
              "kv_timeline": kv_timeline,
              "kv_story": kv_story(kv_timeline, records, capacity_curves),
              "evidence_level": evidence_level,
              "devices": devices,
              "device_names": sorted({a["device_name"] for a in per_actor
                                      if a.get("device_name")}),
              "errors": [{"id": r.id, "status": r.status, "error": r.error}
                         for r in failed[:20]]}
    return _clean(report)


def _clean(x: Any) -> Any:
    """JSON-ready: floats to 6 significant digits (a per-token cost of 5e-7 s stays non-zero),
    NaN/inf as None."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


# ---- text summary --------------------------------------------------------------------------
def _ms(p: dict, key: str) -> str:
    v = p.get(key)
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _num(x: Any, fmt: str = "{:,}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_lines(report: dict) -> list[str]:
    r = report
    p = r.get("params", {})
    setup = [f"model {p.get('model', '?')}"]
    if p.get("prefill") is not None and p.get("decode") is not None:
        setup.append(f"{p['prefill']} prefill + {p['decode']} decode")
    setup += [f"{k} {p[k]}" for k in ("policy", "transport") if p.get(k)]
    lines = [
        f"raypd report ({r['evidence_level']}): " + ", ".join(setup),
        f"trace {p.get('trace', '?')} ({p.get('arrivals', '?')}"
        + (f", rate {p['rate']}/s" if p.get("rate") else "") + ")",
        f"requests: {r['requests_ok']} ok, {r['requests_failed']} failed of "
        f"{r['requests_sent']} sent in {r['wall_s']:.1f} s",
        f"TTFT p50 {_ms(r['ttft_s'], 'p50')}, p99 {_ms(r['ttft_s'], 'p99')}; "
        f"TPOT p50 {_ms(r['tpot_s'], 'p50')}, p99 {_ms(r['tpot_s'], 'p99')}; "
        f"E2E p50 {_ms(r['e2e_s'], 'p50')}",
        f"throughput {r['throughput_tok_s']:.1f} output tok/s "
        f"({r['input_tok_s']:.0f} prompt tok/s); goodput {r['goodput']:.0%} "
        f"(TTFT <= {r['slo']['ttft_s']} s, TPOT <= {r['slo']['tpot_s']} s)",
        f"prefix cache: hit rate {_num(r['hit_rate'], '{:.1%}')}, reused tokens "
        f"{_num(r['reused_tokens'])} (trace repeats {_num(r['repeated_prefix_share'], '{:.1%}')}"
        " of prompt tokens)",
        f"KV blocks: peak {_num(r['peak_blocks_used'])} "
        f"({_num(r['peak_block_share'], '{:.0%}')} of a pool), utilization "
        f"{_num(r['block_utilization'], '{:.0%}')}, evictions {_num(r['evictions'])}, "
        f"preemptions {_num(r['preemptions'])}",
        f"KV transfer: {_num(r['transfer_bytes'])} bytes"
        + (f" in {r['transfer_s']:.2f} s" if r.get("transfer_s") is not None else ""),
    ]
    st = r.get("kv_story") or {}
    if st.get("peak_kv_share") is not None:
        ev = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in (st.get("events") or {}).items()
                       if v)
        lines.append(f"KV timeline: fullest pool {st['closest_to_edge']} peaked at "
                     f"{st['peak_kv_share']:.0%}"
                     + (f" (headroom {st['headroom_requests']} requests of the mean length)"
                        if st.get("headroom_requests") is not None else "")
                     + (f"; events: {ev}" if ev else ""))
    if r.get("stage_breakdown"):
        lines.append("handoff stages p50/p99: " + ", ".join(
            f"{s} {_ms(p, 'p50').removesuffix(' ms')}/{_ms(p, 'p99')}"
            for s, p in r["stage_breakdown"].items() if s not in ("ttft", "e2e")))
    for d in r["diagnosis"]:
        because = ", ".join(f"{k}={v}" for k, v in d["because"].items()
                            if not k.startswith("threshold") and v is not None)
        lines.append(f"diagnosis: {d['finding']} [{because}]")
    if r["errors"]:
        e = r["errors"][0]
        lines.append(f"first failure: {e['id']} (status {e['status']}): {e['error'][:160]}")
    return lines


def print_summary(report: dict, files: Sequence[Any] = ()) -> None:
    for line in summary_lines(report):
        print(line)
    if files:
        print("wrote " + ", ".join(str(f) for f in files))
