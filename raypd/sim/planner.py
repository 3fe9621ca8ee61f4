"""Capacity planning on the cluster simulator: for each cluster size, the P:D ratios under each
policy and colocation at each token budget, each at its goodput (the highest request rate at
which at least `attainment` of requests meet TTFT and TPOT SLOs; shed requests fail,
DistServe's definition), and the goodput-optimal configuration. Two published directions are
checked on the way, each allowed to come out either way:
DistServe (disaggregation beats colocation at equal GPUs under tight TTFT + TPOT SLOs): the
best disaggregated configuration against the best colocated token budget, both under the
prefix-aware policy; the verdict says which wins and by how much, `colocated` included.
Mooncake (a global prefix-aware scheduler beats cache-blind routing under SLO).

A cluster of G GPUs replays the trace head (`requests_per_16` requests) replicated
max(1, G / 16) times, each replica under its own tenant (its own prefix space) and on its own
arrival timeline (`plan_workload`), so load and reuse scale with the cluster and bursts do not."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from raypd.sim.cluster_sim import ClusterConfig, ClusterSim, cluster_requests
from raypd.sim.cost_model import CostModel
from raypd.sim.routing_sim import SimRequest, trace_hashes

P_FRACTIONS = (0.25, 0.5, 0.75, 0.875)   # share of GPUs that prefill (disaggregated)
COLOCATED_BUDGETS = (512, 1024, 2048, 4096, 8192)   # tokens a colocated step holds
RATE_PROBES = (0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0, 5.6, 8.0)   # x base, ascending
MAX_PROBE = 128.0       # past the last probe: x sqrt(2) while it passes, up to this x base
REFINE_STEPS = 2        # bisections (geometric) between the last passing and first failing probe
BASE_GPUS = 16


def parse_gpus(text: str) -> list[int]:
    """"16..256" -> 16, 32, 64, 128, 256 (doublings); "8,24" -> those; "64" -> [64]."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            if lo < 2 or hi < lo:
                raise ValueError
            out, g = [], lo
            while g <= hi:
                out.append(g)
                g *= 2
            return out
        out = [int(x) for x in text.split(",")]
        if any(g < 2 for g in out):
            raise ValueError
        return out
    except ValueError:
        raise ValueError(f"--gpus must be LOW..HIGH or a list of sizes >= 2, got {text!r}") \
            from None


def parse_budgets(text: str) -> tuple[int, ...]:
    """"512,2048" -> (512, 2048): colocated token budgets, each >= 1."""
    try:
        out = tuple(int(x) for x in text.split(","))
        if not out or any(b < 1 for b in out):
            raise ValueError
        return out
    except ValueError:
        raise ValueError(f"--colocated-budgets must be a list of token budgets >= 1, "
                         f"got {text!r}") from None


def own_arrivals(base: Sequence[SimRequest], replica: int) -> list[SimRequest]:
    """The replica's own timeline: the base's timeline as a cycle (its span plus a mean gap)
    entered at a time drawn with the replica's seed, i.e. every arrival shifted by that time
    modulo the cycle (replica 0 keeps the trace's timeline). Each replica keeps the trace's
    gaps and bursts (one gap, at the wrap, excepted); their bursts fall at different times."""
    n = len(base)
    if n < 2 or replica == 0:
        return list(base)
    t0 = base[0].timestamp_s
    cycle = (base[-1].timestamp_s - t0) * n / (n - 1)
    if cycle <= 0:
        return list(base)
    shift = random.Random(replica).uniform(0.0, cycle)
    out = [r._replace(timestamp_s=t0 + (r.timestamp_s - t0 + shift) % cycle) for r in base]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def plan_workload(trace: Sequence, gpus: int, requests_per_16: int) -> list[SimRequest]:
    """The trace head (`requests_per_16` requests) replicated max(1, round(gpus / 16)) times,
    each replica under its own tenant and on its own arrival timeline (`own_arrivals`),
    interleaved by arrival."""
    reps = max(1, round(gpus / BASE_GPUS))
    base = cluster_requests(list(trace)[:requests_per_16], ClusterConfig())
    out = [r._replace(tenant=f"replica-{k}") for k in range(reps)
           for r in own_arrivals(base, k)]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def configs_for(gpus: int, policies: Sequence[str],
                budgets: Sequence[int] = COLOCATED_BUDGETS
                ) -> list[tuple[str, int, int, bool, str, int]]:
    """(label, P, D, colocated, policy, colocated token budget) of each configuration tried."""
    out = []
    for pol in policies:
        for f in P_FRACTIONS:
            p = min(gpus - 1, max(1, round(gpus * f)))
            out.append((f"{p}P:{gpus - p}D {pol}", p, gpus - p, False, pol, 0))
        if pol == policies[0]:     # colocation under the first (prefix-aware) policy
            for b in budgets:
                out.append((f"colocated {gpus} b{b} {pol}", gpus, 0, True, pol, b))
    return out


def goodput_of(reqs: list[SimRequest], hashes, cost: CostModel, cfg: ClusterConfig,
               base_rate_scale: float, attainment: float) -> dict:
    """The highest rate whose SLO attainment >= `attainment` (0 if none), with that run's
    figures: the ascending probes (continued x sqrt(2) up to MAX_PROBE while they pass, so a
    configuration never tops out at the probe list) up to the first that fails, then
    REFINE_STEPS geometric bisections between the last that passed and it. `capped` says
    the rate passed even at MAX_PROBE (the goodput is at least that)."""
    best = {"rate_scale": 0.0, "goodput_rps": 0.0, "goodput_rps_per_gpu": 0.0,
            "slo_attainment": 0.0}
    t0 = reqs[0].timestamp_s

    def passes(scale: float) -> bool:
        scaled = [r._replace(timestamp_s=(r.timestamp_s - t0) / scale) for r in reqs]
        res = ClusterSim(cost, cfg).run(scaled, hashes)
        if res["slo_attainment"] < attainment:
            return False
        best.update(rate_scale=scale, goodput_rps=res["goodput_rps"],
                    goodput_rps_per_gpu=res["goodput_rps_per_gpu"],
                    slo_attainment=res["slo_attainment"], ttft_p99_s=res["ttft_p99_s"],
                    tpot_p99_s=res["tpot_p99_s"], shed=res["shed_total"])
        return True

    lo, hi = 0.0, math.inf
    probes = list(RATE_PROBES)
    while probes[-1] * math.sqrt(2) <= MAX_PROBE * 1.0001:
        probes.append(probes[-1] * math.sqrt(2))
    for probe in probes:
        if not passes(base_rate_scale * probe):
            hi = base_rate_scale * probe
            break
        lo = base_rate_scale * probe
    best["capped"] = hi == math.inf and lo > 0
    if lo > 0 and hi < math.inf:
        for _ in range(REFINE_STEPS):
            mid = math.sqrt(lo * hi)
            if passes(mid):
                lo = mid
            else:
                hi = mid
    return best


def _verdict(g_dis: float, g_col: float, tie: float = 0.05) -> str:
    """Which wins at equal GPUs: 'disaggregated', 'colocated', or 'tie' (within `tie`)."""
    if g_dis <= 0 and g_col <= 0:
        return "neither meets the SLO"
    if abs(g_dis - g_col) <= tie * max(g_dis, g_col):
        return "tie"
    return "disaggregated" if g_dis > g_col else "colocated"


def run_plan(trace: Sequence, cost: CostModel, gpu_sizes: Sequence[int], slo_ttft_s: float,
             slo_tpot_s: float, policies: Sequence[str] = ("locality", "round_robin"),
             requests_per_16: int = 800, attainment: float = 0.9,
             base_rps_per_gpu: float = 0.5, budgets: Sequence[int] = COLOCATED_BUDGETS,
             max_tokens: int = ClusterConfig.max_tokens,
             max_decode_batch: int = ClusterConfig.max_decode_batch) -> dict:
    """The sweep: `sizes[str(G)] = {configs: {label: goodput}, best, distserve, mooncake}`."""
    t_start = time.perf_counter()
    sizes = {}
    for g in gpu_sizes:
        reqs = plan_workload(trace, g, requests_per_16)
        hashes = trace_hashes(reqs)
        span = reqs[-1].timestamp_s - reqs[0].timestamp_s
        base_scale = base_rps_per_gpu * g / (len(reqs) / span) if span > 0 else 1.0
        results = {}
        for label, p, d, col, pol, budget in configs_for(g, policies, budgets):
            cfg = ClusterConfig(num_prefill=p, num_decode=max(d, 1), colocated=col,
                                policy=pol, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                                max_tokens=max_tokens, max_decode_batch=max_decode_batch,
                                colocated_budget=budget or ClusterConfig.colocated_budget)
            results[label] = goodput_of(reqs, hashes, cost, cfg, base_scale, attainment)
            results[label].update(prefill=p, decode=d, colocated=col, policy=pol,
                                  token_budget=budget if col else None)
        best = max(results, key=lambda k: results[k]["goodput_rps"])

        dis = _top(results, lambda r: not r["colocated"] and r["policy"] == "locality")
        col = _top(results, lambda r: r["colocated"] and r["policy"] == "locality")
        blind = _top(results, lambda r: not r["colocated"] and r["policy"] == "round_robin")
        g_dis = results[dis]["goodput_rps"] if dis else 0.0
        g_col = results[col]["goodput_rps"] if col else 0.0
        g_blind = results[blind]["goodput_rps"] if blind else 0.0
        sizes[str(g)] = {
            "requests": len(reqs), "configs": results, "best": best,
            "best_goodput_rps": results[best]["goodput_rps"],
            "distserve": {"disaggregated": dis, "colocated": col,
                          "disaggregated_goodput_rps": g_dis, "colocated_goodput_rps": g_col,
                          "colocated_budget": results[col]["token_budget"] if col else None,
                          "goodput_ratio": g_dis / g_col if g_col else None,
                          "winner": _verdict(g_dis, g_col),
                          "direction_holds": g_dis > g_col},
            "mooncake": {"prefix_aware": dis, "cache_blind": blind,
                         "goodput_ratio": g_dis / g_blind if g_blind else None,
                         "direction_holds": g_dis > g_blind},
        }
    return {"label": f"simulated ({cost.label})", "cost_model": cost.to_dict(),
            "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "attainment": attainment,
            "goodput_definition": f"highest rate with >= {attainment:.0%} of requests within "
                                  "both SLOs (shed = failed), requests/s, probed then bisected "
                                  f"{REFINE_STEPS} times",
            "rate_probes": list(RATE_PROBES), "base_rps_per_gpu": base_rps_per_gpu,
            "colocated_budgets": list(budgets), "max_tokens": max_tokens,
            "max_decode_batch": max_decode_batch,
            "workload": f"trace head ({requests_per_16} requests) replicated G/16 times under "
                        "distinct tenants, each on its own arrival timeline",
            "sizes": sizes, "elapsed_s": time.perf_counter() - t_start}


def _top(results: dict, pred) -> str | None:
    """The label of the highest-goodput configuration satisfying `pred` (None: none)."""
    cands = [k for k in results if pred(results[k])]
    return max(cands, key=lambda k: results[k]["goodput_rps"]) if cands else None


def plan_text(plan: dict) -> str:
    """The plan as a table: per size the goodput-optimal configuration, the best disaggregated
    configuration against the best colocated budget (who wins, by how much), Mooncake's ratio."""
    lines = [f"{plan['label']}  SLO: TTFT <= {plan['slo_ttft_s']} s, TPOT <= "
             f"{plan['slo_tpot_s']} s at {plan['attainment']:.0%}; max_tokens "
             f"{plan['max_tokens']}, colocated budgets {plan['colocated_budgets']}",
             f"efficiency factors / source: {plan['cost_model'].get('notes', {})}",
             f"{'GPUs':>5}  {'goodput-optimal config':<30} {'req/s':>7}   "
             f"{'best disaggregated':<24} {'req/s':>7}   {'best colocated':<16} {'req/s':>7}"
             f"   {'dis/col':>7}  {'winner':<13} {'aware/blind':>11}"]
    for g, s in plan["sizes"].items():
        ds, mc = s["distserve"], s["mooncake"]["goodput_ratio"]
        dis = (ds["disaggregated"] or "n/a").removesuffix(" locality")
        col = f"budget {ds['colocated_budget']}" if ds["colocated"] else "n/a"
        ratio = f"{ds['goodput_ratio']:.2f}x" if ds["goodput_ratio"] else "n/a"
        lines.append(f"{g:>5}  {s['best']:<30} {s['best_goodput_rps']:>7.2f}   {dis:<24} "
                     f"{ds['disaggregated_goodput_rps']:>7.2f}   {col:<16} "
                     f"{ds['colocated_goodput_rps']:>7.2f}   {ratio:>7}  {ds['winner']:<13} "
                     f"{(f'{mc:.2f}x' if mc else 'n/a'):>11}")
    return "\n".join(lines)
