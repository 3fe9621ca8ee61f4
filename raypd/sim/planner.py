"""Capacity planning on the cluster simulator: for each cluster size, the P:D ratios (and
colocation) under each policy, each at its goodput (the highest request rate at which at least
`attainment` of requests meet TTFT and TPOT SLOs; shed requests fail, DistServe's definition),
and the goodput-optimal configuration. Two published directions are checked on the way:
DistServe (disaggregation beats colocation at equal GPUs under tight TTFT + TPOT SLOs) and
Mooncake (a global prefix-aware scheduler beats cache-blind routing under SLO).

A cluster of G GPUs replays the trace's first `requests_per_16` x G/16 ... see `plan_workload`:
the trace head replicated G/16 times under distinct tenants (each replica its own prefix space,
its own arrivals), so load and reuse scale with the cluster."""

from __future__ import annotations

import time
from collections.abc import Sequence

from raypd.sim.cluster_sim import ClusterConfig, ClusterSim, cluster_requests
from raypd.sim.cost_model import CostModel
from raypd.sim.routing_sim import SimRequest, trace_hashes

P_FRACTIONS = (0.25, 0.5, 0.75, 0.875)   # share of GPUs that prefill (disaggregated)
RATE_PROBES = (0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0, 5.6, 8.0)   # x base, ascending
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


def plan_workload(trace: Sequence, gpus: int, requests_per_16: int) -> list[SimRequest]:
    """The trace head replicated max(1, gpus / 16) times, each replica under its own tenant,
    arrivals interleaved (each replica keeps its own timeline)."""
    reps = max(1, round(gpus / BASE_GPUS))
    per = max(50, requests_per_16 // reps) if reps > 1 else requests_per_16
    base = cluster_requests(list(trace)[:per], ClusterConfig())
    out = [r._replace(tenant=f"replica-{k}") for k in range(reps) for r in base]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def configs_for(gpus: int, policies: Sequence[str]) -> list[tuple[str, int, int, bool, str]]:
    """(label, P, D, colocated, policy) of each configuration tried at this size."""
    out = []
    for pol in policies:
        for f in P_FRACTIONS:
            p = min(gpus - 1, max(1, round(gpus * f)))
            out.append((f"{p}P:{gpus - p}D {pol}", p, gpus - p, False, pol))
        if pol == policies[0]:     # colocation under the first (prefix-aware) policy
            out.append((f"colocated {gpus} {pol}", gpus, 0, True, pol))
    return out


def goodput_of(reqs: list[SimRequest], hashes, cost: CostModel, cfg: ClusterConfig,
               base_rate_scale: float, attainment: float) -> dict:
    """The highest probed rate whose SLO attainment >= `attainment` (0 if none), with that
    run's figures."""
    best = {"rate_scale": 0.0, "goodput_rps": 0.0, "goodput_rps_per_gpu": 0.0,
            "slo_attainment": 0.0}
    t0 = reqs[0].timestamp_s
    for probe in RATE_PROBES:
        scale = base_rate_scale * probe
        scaled = [r._replace(timestamp_s=(r.timestamp_s - t0) / scale) for r in reqs]
        res = ClusterSim(cost, cfg).run(scaled, hashes)
        if res["slo_attainment"] < attainment:
            break
        best = {"rate_scale": scale, "goodput_rps": res["goodput_rps"],
                "goodput_rps_per_gpu": res["goodput_rps_per_gpu"],
                "slo_attainment": res["slo_attainment"], "ttft_p99_s": res["ttft_p99_s"],
                "tpot_p99_s": res["tpot_p99_s"], "shed": res["shed_total"]}
    return best


def run_plan(trace: Sequence, cost: CostModel, gpu_sizes: Sequence[int], slo_ttft_s: float,
             slo_tpot_s: float, policies: Sequence[str] = ("locality", "round_robin"),
             requests_per_16: int = 800, attainment: float = 0.9,
             base_rps_per_gpu: float = 0.5) -> dict:
    """The sweep: `sizes[str(G)] = {configs: {label: goodput}, best, distserve, mooncake}`."""
    t_start = time.perf_counter()
    sizes = {}
    for g in gpu_sizes:
        reqs = plan_workload(trace, g, requests_per_16)
        hashes = trace_hashes(reqs)
        span = reqs[-1].timestamp_s - reqs[0].timestamp_s
        base_scale = base_rps_per_gpu * g / (len(reqs) / span) if span > 0 else 1.0
        results = {}
        for label, p, d, col, pol in configs_for(g, policies):
            cfg = ClusterConfig(num_prefill=p, num_decode=max(d, 1), colocated=col,
                                policy=pol, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
            results[label] = goodput_of(reqs, hashes, cost, cfg, base_scale, attainment)
            results[label].update(prefill=p, decode=d, colocated=col, policy=pol)
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
                          "goodput_ratio": g_dis / g_col if g_col else None,
                          "direction_holds": g_dis > g_col},
            "mooncake": {"prefix_aware": dis, "cache_blind": blind,
                         "goodput_ratio": g_dis / g_blind if g_blind else None,
                         "direction_holds": g_dis > g_blind},
        }
    return {"label": f"simulated ({cost.label})", "cost_model": cost.to_dict(),
            "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "attainment": attainment,
            "goodput_definition": f"highest probed rate with >= {attainment:.0%} of requests "
                                  "within both SLOs (shed = failed), requests/s",
            "rate_probes": list(RATE_PROBES), "base_rps_per_gpu": base_rps_per_gpu,
            "workload": "trace head replicated G/16 times under distinct tenants",
            "sizes": sizes, "elapsed_s": time.perf_counter() - t_start}


def _top(results: dict, pred) -> str | None:
    """The label of the highest-goodput configuration satisfying `pred` (None: none)."""
    cands = [k for k in results if pred(results[k])]
    return max(cands, key=lambda k: results[k]["goodput_rps"]) if cands else None


def plan_text(plan: dict) -> str:
    lines = [f"{plan['label']}  SLO: TTFT <= {plan['slo_ttft_s']} s, TPOT <= "
             f"{plan['slo_tpot_s']} s at {plan['attainment']:.0%}",
             f"efficiency factors / source: {plan['cost_model'].get('notes', {})}",
             f"{'GPUs':>5}  {'goodput-optimal config':<28} {'req/s':>8} {'/GPU':>7}   "
             f"{'DistServe dis/col':>17} {'Mooncake aware/blind':>21}"]
    for g, s in plan["sizes"].items():
        best = s["configs"][s["best"]]
        ds, mc = s["distserve"]["goodput_ratio"], s["mooncake"]["goodput_ratio"]
        lines.append(f"{g:>5}  {s['best']:<28} {best['goodput_rps']:>8.2f} "
                     f"{best['goodput_rps_per_gpu']:>7.3f}   "
                     f"{(f'{ds:.2f}x' if ds else 'n/a'):>17} {(f'{mc:.2f}x' if mc else 'n/a'):>21}")
    return "\n".join(lines)
