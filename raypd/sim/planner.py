"""Capacity planning on the cluster simulator: for each cluster size, the P:D ratios under each
policy and colocation at each token budget, each at its goodput (the highest request rate at
which at least `attainment` of requests meet TTFT and TPOT SLOs; shed requests fail,
DistServe's definition), and the goodput-optimal configuration. Two published directions are
checked on the way, each allowed to come out either way:
DistServe (disaggregation beats colocation at equal GPUs under tight TTFT + TPOT SLOs): the
best disaggregated configuration against the best colocated token budget, both under the
prefix-aware policy; the verdict says which wins and by how much, `colocated` included.
Mooncake (a global prefix-aware scheduler beats cache-blind routing under SLO).

Tensor parallelism (with `tp_cost`): a worker of TP t holds t GPUs; each role's TP is searched
with the P:D split (`search_tp`), and per size the plan says, per role, whether a larger TP
beat more replicas on the same GPUs (`tp_verdict`). The cost of a TP worker is the roofline's
(raypd/sim/cost_model.py gpu_cost_model: compute and reads split, all-reduces added).

A cluster of G GPUs replays the trace head (`requests_per_16` requests) replicated
max(1, G / 16) times, each replica under its own tenant (its own prefix space) and on its own
arrival timeline (`plan_workload`), so load and reuse scale with the cluster and bursts do not."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

from raypd.sim.cluster_sim import ClusterConfig, ClusterSim, cluster_requests
from raypd.sim.cost_model import CostModel
from raypd.sim.routing_sim import SimRequest, trace_hashes

P_FRACTIONS = (0.25, 0.5, 0.75, 0.875)   # share of GPUs that prefill (disaggregated)
COLOCATED_BUDGETS = (512, 1024, 2048, 4096, 8192)   # tokens a colocated step holds
RATE_PROBES = (0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0, 5.6, 8.0)   # x base, ascending
MAX_PROBE = 128.0       # past the last probe: x sqrt(2) while it passes, up to this x base
REFINE_STEPS = 2        # bisections (geometric) between the last passing and first failing probe
BASE_GPUS = 16
TIE_PCT = 1.0           # a TP size that wins by less ties (the goodputs are bisected rates)


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


def split(gpus: int, p_fraction: float, prefill_tp: int, decode_tp: int
          ) -> tuple[int, int] | None:
    """(prefill workers, decode workers) when about `p_fraction` of `gpus` prefill in workers
    of TP `prefill_tp` and the rest decode in workers of `decode_tp` (at least one of each;
    GPUs a worker's TP cannot use stay idle); None when one of each does not fit."""
    p = max(1, round(gpus * p_fraction / prefill_tp))
    while p > 1 and p * prefill_tp + decode_tp > gpus:
        p -= 1
    d = (gpus - p * prefill_tp) // decode_tp
    return (p, d) if d >= 1 else None


def disagg_label(p: int, p_tp: int, d: int, d_tp: int, policy: str) -> str:
    """"4P:12D locality" at TP 1; "4Px2:3Dx4 locality": 4 prefill workers of TP 2 and 3
    decode workers of TP 4 (20 GPUs)."""
    if p_tp == d_tp == 1:
        return f"{p}P:{d}D {policy}"
    return f"{p}Px{p_tp}:{d}Dx{d_tp} {policy}"


def colocated_label(n: int, tp: int, budget: int, policy: str) -> str:
    return f"colocated {n}{'' if tp == 1 else f'x{tp}'} b{budget} {policy}"


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


class SizeSweep:
    """The configurations of one cluster size, each simulated once (memoized by its shape):
    a disaggregated one is (P workers, P's TP, D workers, D's TP, policy), a colocated one
    (workers, TP, token budget, policy); results by label, as the plan reports them."""

    def __init__(self, gpus: int, reqs, hashes, base_scale: float, cost_of, cluster: dict,
                 attainment: float) -> None:
        self.gpus, self.reqs, self.hashes, self.base_scale = gpus, reqs, hashes, base_scale
        self.cost_of, self.cluster, self.attainment = cost_of, cluster, attainment
        self.results: dict[str, dict] = {}
        self.by_shape: dict[tuple, str] = {}

    def disagg(self, p: int, p_tp: int, d: int, d_tp: int, policy: str) -> str:
        shape = (p, p_tp, d, d_tp, policy)
        if shape not in self.by_shape:
            label = disagg_label(*shape)
            cost = self.cost_of(p_tp, d_tp)
            cfg = ClusterConfig(num_prefill=p, num_decode=d, policy=policy, **self.cluster)
            self._run(label, cost, cfg, p * p_tp + d * d_tp)
            self.results[label].update(prefill=p, decode=d, colocated=False, policy=policy,
                                       token_budget=None, prefill_tp=p_tp, decode_tp=d_tp)
            self.by_shape[shape] = label
        return self.by_shape[shape]

    def colocated(self, tp: int, budget: int, policy: str) -> str:
        n = self.gpus // tp
        shape = ("colocated", n, tp, budget, policy)
        if shape not in self.by_shape:
            label = colocated_label(n, tp, budget, policy)
            cfg = ClusterConfig(num_prefill=n, num_decode=1, colocated=True, policy=policy,
                                colocated_budget=budget, **self.cluster)
            self._run(label, self.cost_of(tp, tp), cfg, n * tp)
            self.results[label].update(prefill=n, decode=0, colocated=True, policy=policy,
                                       token_budget=budget, prefill_tp=tp, decode_tp=tp)
            self.by_shape[shape] = label
        return self.by_shape[shape]

    def _run(self, label: str, cost: CostModel, cfg: ClusterConfig, gpus_used: int) -> None:
        r = goodput_of(self.reqs, self.hashes, cost, cfg, self.base_scale, self.attainment)
        # per GPU of those the workers hold (a worker of TP t holds t)
        r.update(goodput_rps_per_gpu=r["goodput_rps"] / gpus_used, gpus_used=gpus_used,
                 kv_capacity_tokens=cost.kv_capacity_tokens)
        self.results[label] = r

    def best(self, pred) -> str | None:
        return _top(self.results, pred)

    def role_variants(self, label: str, role: str, tps: Sequence[int]) -> list[str]:
        """The configurations of `label` (disaggregated) with `role`'s GPUs regrouped into
        workers of each TP size of `tps` (the other role unchanged), simulated."""
        r = self.results[label]
        n, own_tp = (r["prefill"], r["prefill_tp"]) if role == "prefill" else \
            (r["decode"], r["decode_tp"])
        role_gpus = n * own_tp
        out = []
        for t in tps:
            if role_gpus // t < 1:
                continue
            shape = (role_gpus // t, t, r["decode"], r["decode_tp"]) if role == "prefill" \
                else (r["prefill"], r["prefill_tp"], role_gpus // t, t)
            out.append(self.disagg(*shape, r["policy"]))
        return out

    def ratio_sweep(self, p_tp: int, d_tp: int, policy: str) -> None:
        for f in P_FRACTIONS:
            pd = split(self.gpus, f, p_tp, d_tp)
            if pd:
                self.disagg(pd[0], p_tp, pd[1], d_tp, policy)


def search_tp(sweep: SizeSweep, tps: Sequence[int], policy: str, rounds: int = 3) -> str | None:
    """DistServe-style, per role on the simulator: every P:D share at each TP size for both
    roles, then from the best so far each role's GPUs regrouped into workers of every TP size
    (the other role fixed) and the shares swept again at the best pair of TP sizes, until the
    best holds (at most `rounds` rounds). The best disaggregated configuration's label."""
    def top() -> str | None:
        return sweep.best(lambda r: not r["colocated"] and r["policy"] == policy)
    for t in tps:
        sweep.ratio_sweep(t, t, policy)
    for _ in range(rounds):
        before = top()
        if before is None:
            return None
        for role in ("prefill", "decode"):
            sweep.role_variants(top(), role, tps)
        b = sweep.results[top()]
        sweep.ratio_sweep(b["prefill_tp"], b["decode_tp"], policy)
        if top() == before:
            break
    return top()


def tp_verdict(sweep: SizeSweep, label: str | None, role: str, tps: Sequence[int]) -> dict | None:
    """At `label`'s other role, `role`'s GPUs in workers of each TP size: which won, against
    the best of the smaller TP sizes (more replicas) or, when the smallest won, the best of
    the larger ones; with a line ("decode: TP 2 x 3 replicas beats TP 1 x 6 replicas by 12%
    goodput"). `larger_tp_wins`: a TP above the smallest won (by TIE_PCT at least)."""
    if label is None:
        return None
    options = [sweep.results[v] for v in sweep.role_variants(label, role, tps)]
    key, n_key = f"{role}_tp", role

    def tag(r: dict) -> str:
        return f"TP {r[key]} x {r[n_key]} replica{'s' if r[n_key] != 1 else ''}"
    out: dict = {"at": label, "gpus": sweep.results[label][n_key] * sweep.results[label][key],
                 "options": {str(r[key]): {"replicas": r[n_key], "goodput_rps": r["goodput_rps"]}
                             for r in options}}
    if len(options) < 2:
        out.update(larger_tp_wins=None, line=f"{role}: only {tag(options[0])} fits "
                   f"{out['gpus']} GPUs" if options else f"{role}: no TP size fits")
        return out
    win = max(options, key=lambda r: r["goodput_rps"])
    smallest = min(options, key=lambda r: r[key])
    rivals = [r for r in options if r[key] < win[key]] or [r for r in options if r is not win]
    rival = max(rivals, key=lambda r: r["goodput_rps"])
    g_win, g_rival = win["goodput_rps"], rival["goodput_rps"]
    if g_win <= 0:
        line = f"{role}: no TP size meets the SLO ({', '.join(tag(r) for r in options)})"
        gain = None
    elif g_rival <= 0:
        line, gain = f"{role}: {tag(win)} beats {tag(rival)} (which meets no SLO)", None
    else:
        gain = 100.0 * (g_win / g_rival - 1.0)
        line = f"{role}: {tag(win)} beats {tag(rival)} by {gain:.0f}% goodput" \
            if gain >= TIE_PCT else f"{role}: {tag(win)} ties {tag(rival)} (within {TIE_PCT}%)"
    out.update(best_tp=win[key], best_replicas=win[n_key], versus_tp=rival[key],
               versus_replicas=rival[n_key], gain_pct=gain,
               larger_tp_wins=(g_win > 0 and win[key] > smallest[key]
                               and (gain is None or gain >= TIE_PCT)), line=line)
    return out


def run_plan(trace: Sequence, cost: CostModel, gpu_sizes: Sequence[int], slo_ttft_s: float,
             slo_tpot_s: float, policies: Sequence[str] = ("locality", "round_robin"),
             requests_per_16: int = 800, attainment: float = 0.9,
             base_rps_per_gpu: float = 0.5, budgets: Sequence[int] = COLOCATED_BUDGETS,
             max_tokens: int = ClusterConfig.max_tokens,
             max_decode_batch: int = ClusterConfig.max_decode_batch,
             tp_cost: Callable[[int, int], CostModel] | None = None,
             tp_choices: Sequence[int] = (1,)) -> dict:
    """The sweep: `sizes[str(G)] = {configs: {label: goodput}, best, distserve, mooncake,
    tp}`. `tp_cost(prefill_tp, decode_tp)`: the cost model of workers of those TP sizes
    (None: `cost`, TP 1 only); `tp_choices`: the TP sizes a worker can have (the model's heads
    and memory allow: raypd/sim/cost_model.py feasible_tps). Under the first (prefix-aware)
    policy the P:D shares and each role's TP are searched (`search_tp`); colocation sweeps
    the budgets at the smallest TP, then the best budget at each other TP; the other policies
    sweep the shares at the best disaggregated TP pair."""
    t_start = time.perf_counter()
    tps = tuple(sorted(tp_choices))
    if tp_cost is None and tps != (1,):
        raise ValueError("tp_choices other than (1,) need tp_cost")
    costs: dict[tuple[int, int], CostModel] = {}

    def cost_of(p_tp: int, d_tp: int) -> CostModel:
        if tp_cost is None:
            return cost
        if (p_tp, d_tp) not in costs:
            costs[p_tp, d_tp] = tp_cost(p_tp, d_tp)
        return costs[p_tp, d_tp]
    cluster = dict(slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s, max_tokens=max_tokens,
                   max_decode_batch=max_decode_batch)
    sizes = {}
    aware = policies[0]
    for g in gpu_sizes:
        reqs = plan_workload(trace, g, requests_per_16)
        hashes = trace_hashes(reqs)
        span = reqs[-1].timestamp_s - reqs[0].timestamp_s
        base_scale = base_rps_per_gpu * g / (len(reqs) / span) if span > 0 else 1.0
        fit = tuple(t for t in tps if t + tps[0] <= g)   # one P and one D worker at least
        if not fit:
            raise ValueError(f"{g} GPUs hold no prefill and decode worker of TP "
                             f"{', '.join(map(str, tps))}")
        sweep = SizeSweep(g, reqs, hashes, base_scale, cost_of, cluster, attainment)
        dis = search_tp(sweep, fit, aware)
        col_tps = tuple(t for t in tps if t <= g)
        for b in budgets:
            sweep.colocated(col_tps[0], b, aware)
        top_budget = sweep.results[sweep.best(lambda r: r["colocated"])]["token_budget"]
        for t in col_tps[1:]:
            sweep.colocated(t, top_budget, aware)
        pair = (sweep.results[dis]["prefill_tp"], sweep.results[dis]["decode_tp"]) if dis \
            else (fit[0], fit[0])
        for pol in policies[1:]:
            sweep.ratio_sweep(*pair, pol)
        verdicts = {role: tp_verdict(sweep, dis, role, fit) for role in ("prefill", "decode")}
        results = sweep.results
        dis = sweep.best(lambda r: not r["colocated"] and r["policy"] == aware)
        best = max(results, key=lambda k: results[k]["goodput_rps"])
        col = _top(results, lambda r: r["colocated"] and r["policy"] == aware)
        blind = _top(results, lambda r: not r["colocated"] and r["policy"] == "round_robin")
        g_dis = results[dis]["goodput_rps"] if dis else 0.0
        g_col = results[col]["goodput_rps"] if col else 0.0
        g_blind = results[blind]["goodput_rps"] if blind else 0.0
        sizes[str(g)] = {
            "requests": len(reqs), "configs": results, "best": best,
            "best_goodput_rps": results[best]["goodput_rps"],
            "best_prefill_tp": results[best]["prefill_tp"],
            "best_decode_tp": results[best]["decode_tp"],
            "distserve": {"disaggregated": dis, "colocated": col,
                          "disaggregated_goodput_rps": g_dis, "colocated_goodput_rps": g_col,
                          "colocated_budget": results[col]["token_budget"] if col else None,
                          "goodput_ratio": g_dis / g_col if g_col else None,
                          "winner": _verdict(g_dis, g_col),
                          "direction_holds": g_dis > g_col},
            "mooncake": {"prefix_aware": dis, "cache_blind": blind,
                         "goodput_ratio": g_dis / g_blind if g_blind else None,
                         "direction_holds": g_dis > g_blind},
            "tp": {"choices": list(fit), "colocated_choices": list(col_tps), **verdicts},
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
            "tp_choices": list(tps),
            "tp_search": "per role (search_tp): the P:D shares at each TP size for both roles, "
                         "then each role's GPUs regrouped at every TP size and the shares "
                         "swept again at the best pair, until the best holds",
            "sizes": sizes, "elapsed_s": time.perf_counter() - t_start}


def _top(results: dict, pred) -> str | None:
    """The label of the highest-goodput configuration satisfying `pred` (None: none)."""
    cands = [k for k in results if pred(results[k])]
    return max(cands, key=lambda k: results[k]["goodput_rps"]) if cands else None


def plan_text(plan: dict) -> str:
    """The plan as a table: per size the goodput-optimal configuration (with each role's TP),
    the best disaggregated configuration against the best colocated budget (who wins, by how
    much), Mooncake's ratio; then per size whether a larger TP beat more replicas, per role."""
    lines = [f"{plan['label']}  SLO: TTFT <= {plan['slo_ttft_s']} s, TPOT <= "
             f"{plan['slo_tpot_s']} s at {plan['attainment']:.0%}; max_tokens "
             f"{plan['max_tokens']}, colocated budgets {plan['colocated_budgets']}, TP sizes "
             f"{plan.get('tp_choices', [1])}",
             f"efficiency factors / source: {plan['cost_model'].get('notes', {})}",
             f"{'GPUs':>5}  {'goodput-optimal config':<30} {'P-TP':>4} {'D-TP':>4} "
             f"{'req/s':>7}   {'best disaggregated':<24} {'req/s':>7}   {'best colocated':<16} "
             f"{'req/s':>7}   {'dis/col':>7}  {'winner':<13} {'aware/blind':>11}"]
    for g, s in plan["sizes"].items():
        ds, mc = s["distserve"], s["mooncake"]["goodput_ratio"]
        dis = (ds["disaggregated"] or "n/a").removesuffix(" locality")
        col = f"budget {ds['colocated_budget']}" if ds["colocated"] else "n/a"
        ratio = f"{ds['goodput_ratio']:.2f}x" if ds["goodput_ratio"] else "n/a"
        lines.append(f"{g:>5}  {s['best']:<30} {s.get('best_prefill_tp', 1):>4} "
                     f"{s.get('best_decode_tp', 1):>4} {s['best_goodput_rps']:>7.2f}   "
                     f"{dis:<24} {ds['disaggregated_goodput_rps']:>7.2f}   {col:<16} "
                     f"{ds['colocated_goodput_rps']:>7.2f}   {ratio:>7}  {ds['winner']:<13} "
                     f"{(f'{mc:.2f}x' if mc else 'n/a'):>11}")
    for g, s in plan["sizes"].items():
        for role in ("prefill", "decode"):
            v = s.get("tp", {}).get(role)
            if v:
                at = v["at"].removesuffix(" locality")
                lines.append(f"{g:>5}  {v['line']} (its {v['gpus']} GPUs, at {at})")
    return "\n".join(lines)
