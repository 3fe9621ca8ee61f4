"""The autoscaler in the cluster simulator: the live controller (router/autoscale_decision.py) sizes the
prefill and decode pools of a ClusterSim replay every `interval_s` of simulated time, and the
run is compared with every static P:D of every size from 1P:1D up to its peak, on the same
requests, each side repeated on other arrival timelines (raypd/sim/static_rivals.py judges).

What the controller sees is what the live router has: `observe()` over the WorkerStates the
simulated workers' load reports built (router/worker_view.py, as the policies see them) and a
RequestWindow fed with the requests' arrivals, ends and sheds as the router would see them.
The cost model and the workers' true queues never reach it.

Scale-up: a worker starts `startup_s` after the decision (a GPU worker's launch and weight
load; 30 s by default) and joins the pool then; a draining worker of the role is taken back
first (it is still loaded). Scale-down: the newest starting worker is cancelled if there is
one; else the live worker with the least work drains: no new requests; its queued prefills
finish and go on to their decode workers; its running decodes migrate to another decode
worker chosen by the policy's decode choice on reports (blocks reserved there as for an
admission), paying their KV (context tokens x bytes per token) over the target's link, FIFO
with its other transfers; a sequence no worker has room for keeps decoding where it is and is
tried again next interval. A drained worker leaves when it holds nothing (decode: no block
reserved, running, waiting or landing).

Accounting: worker-seconds = the sum over workers of the time from the decision that started
them (start-up included) until they left or the run ended (its last request's end), draining
included; a static run's = its size x the same span of its own. SLO attainment and goodput as
ClusterSim reports them (shed = failed)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from protocol.errors import RoutingRejected
from raypd.sim.cluster_sim import ClusterConfig, ClusterSim, DecodeSim, RunHooks, cluster_requests
from raypd.sim.cost_model import CostModel
from raypd.sim.planner import BASE_GPUS, own_arrivals, plan_workload
from raypd.sim.routing_sim import SimRequest, trace_hashes
from raypd.sim.static_rivals import fleet_splits, judge, rival_lines
from router.autoscale_decision import AutoscaleConfig, Controller, Decision, RequestWindow, observe
from router.policies import RoutingRequest
from router.worker_view import note_decode

STARTUP_S = 30.0     # a GPU worker's launch + weight load (8B model from local disk), stated


@dataclass
class _Life:
    """One worker's stay: from the decision that launched it to when it left."""

    role: str
    worker_id: str
    started: float
    ready: float                  # joins the pool then
    ended: float | None = None
    draining: bool = False


class AutoscaleRun(RunHooks):
    """The hooks that run the controller inside a ClusterSim replay (module doc)."""

    def __init__(self, sim: ClusterSim, reqs: Sequence[SimRequest], cfg: AutoscaleConfig,
                 startup_s: float = STARTUP_S, t0: float = 0.0) -> None:
        self.sim, self.reqs, self.cfg = sim, reqs, cfg
        self.controller = Controller(cfg)
        self.window = RequestWindow.for_config(cfg)
        self.interval_s = cfg.interval_s
        self.startup_s = startup_s
        self.lives: dict[str, _Life] = {}
        for w in sim.prefill:
            self.lives[w.worker_id] = _Life("prefill", w.worker_id, t0, t0)
        for d in sim.decode:
            self.lives[d.worker_id] = _Life("decode", d.worker_id, t0, t0)
        self._n = {"prefill": len(sim.prefill), "decode": len(sim.decode)}
        self._events: list[tuple[float, int, tuple]] = []   # window records, flushed in order
        self._seen_finished: dict[str, int] = {}
        self._seen_hits: dict[str, int] = {}
        self.hit_blocks: dict[int, int] = {}
        self.decisions: list[Decision] = []
        self.migrations = 0
        self.migrated_bytes = 0
        self.size_log: list[tuple[float, int, int]] = []   # (t, prefill, decode) live + starting

    # ---- what the router sees of requests ---------------------------------------------------
    def arrive(self, j: int, now: float) -> None:
        r = self.reqs[j]
        self.window.arrive(now, r.num_tokens, self.sim.cfg.max_tokens)

    def shed(self, j: int, now: float, reason: str) -> None:
        r = self.reqs[j]
        self._events.append((now, j, (r.num_tokens, 0, 0, None, None, False)))

    def _collect(self) -> None:
        """Requests that ended since the last tick (their TTFT, TPOT and prefix hit, as the
        router's lifecycle records have them)."""
        sim, bt = self.sim, self.sim.cfg.block_tokens
        for w in (*sim.prefill, *sim.retired_prefill):
            i = self._seen_hits.get(w.worker_id, 0)
            for tag, k in w.hits[i:]:
                self.hit_blocks[tag] = k
            self._seen_hits[w.worker_id] = len(w.hits)
        for d in (*sim.decode, *sim.retired_decode):
            i = self._seen_finished.get(d.worker_id, 0)
            for rid, first, fin in d.finished[i:]:
                r, n = self.reqs[rid], sim.out_len[rid]
                cached = min(self.hit_blocks.get(rid, 0) * bt, r.num_tokens - 1)
                tpot = (fin - first) / (n - 1) if n > 1 else 0.0
                self._events.append((fin, rid, (r.num_tokens, cached, n, sim.ttft.get(rid),
                                                tpot, True)))
            self._seen_finished[d.worker_id] = len(d.finished)

    # ---- the interval -------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        self._collect()
        for at, _, rec in sorted(self._events, key=lambda e: (e[0], e[1])):
            self.window.record(at, *rec)
        self._events.clear()
        self._join_ready(now)
        self._drain_step(now)
        if self.controller.due(now):
            starting = {r: sum(1 for x in self.lives.values() if x.role == r and x.ended is None
                               and x.ready > now) for r in ("prefill", "decode")}
            obs = observe(list(self.sim.p_states.values()), list(self.sim.d_states.values()),
                          self.window, now, starting["prefill"], starting["decode"])
            d = self.controller.decide(obs, now)
            self.decisions.append(d)
            for role, cur, want in (("prefill", obs.prefill_workers + starting["prefill"],
                                     d.prefill),
                                    ("decode", obs.decode_workers + starting["decode"],
                                     d.decode)):
                if want > cur:
                    self._grow(role, want - cur, now)
                elif want < cur:
                    self._shrink(role, now)
            self._join_ready(now)
        self.size_log.append((now, *(sum(1 for x in self.lives.values() if x.role == r and
                                         x.ended is None and not x.draining)
                                     for r in ("prefill", "decode"))))

    def _grow(self, role: str, n: int, now: float) -> None:
        states = self.sim.p_states if role == "prefill" else self.sim.d_states
        for wid, st in states.items():     # take draining workers back first
            if n and st.draining:
                st.draining = self.lives[wid].draining = False
                n -= 1
        for _ in range(n):
            wid = f"{role}-{self._n[role]}"
            self._n[role] += 1
            self.lives[wid] = _Life(role, wid, now, now + self.startup_s)

    def _shrink(self, role: str, now: float) -> None:
        starting = [x for x in self.lives.values()
                    if x.role == role and x.ended is None and x.ready > now]
        if starting:                       # cancel the newest launch
            max(starting, key=lambda x: x.started).ended = now
            return
        states = self.sim.p_states if role == "prefill" else self.sim.d_states
        live = [s for s in states.values() if not s.draining]
        if len(live) <= 1:
            return
        st = min(live, key=lambda s: (s.num_requests, s.load_tokens, s.active_blocks,
                                      s.worker_id))
        st.draining = self.lives[st.worker_id].draining = True

    def _join_ready(self, now: float) -> None:
        for x in self.lives.values():
            if x.ended is None and x.ready <= now and x.worker_id not in self.sim.p_by_id \
                    and x.worker_id not in self.sim.d_by_id:
                (self.sim.add_prefill if x.role == "prefill" else self.sim.add_decode)(
                    x.worker_id)

    def _drain_step(self, now: float) -> None:
        """Draining workers: migrate what decodes on them, retire the ones left empty."""
        sim = self.sim
        for w in [w for w in sim.prefill if sim.p_states[w.worker_id].draining]:
            if sim.prefill_idle(w):
                sim.retire_prefill(w)
                self.lives[w.worker_id].ended = now
        for d in [d for d in sim.decode if sim.d_states[d.worker_id].draining]:
            for seq in [*d.running, *d.queued]:
                self._migrate(d, seq, now)
            if d.idle:
                sim.retire_decode(d)
                self.lives[d.worker_id].ended = now

    def _migrate(self, src: DecodeSim, seq, now: float) -> None:
        sim, bt, cost = self.sim, self.sim.cfg.block_tokens, self.sim.cost
        n = len(seq.blocks)
        req = RoutingRequest(f"{seq.rid}-migrate", (0,) * math.ceil(seq.ctx / bt), seq.ctx,
                             bt, output_tokens=max(0, n * bt - seq.ctx), arrival_s=now)
        try:
            dd = sim.policy.choose_decode(req, list(sim.d_states.values()), {})
        except RoutingRejected:
            return                         # no room anywhere now: it decodes on; next interval
        dst = sim.d_by_id[dd.worker_id]
        if n > dst.pool.num_free_blocks:   # the report was stale: the target refuses
            return
        src.evict(seq)
        src.pool.free(seq.blocks)
        seq.blocks = dst.pool.allocate(n)
        note_decode(sim.d_states[dst.worker_id], req, dd)
        nbytes = seq.ctx * cost.kv_bytes_per_token
        start = max(now, dst.link_free_at)
        dst.link_free_at = start + cost.link.seconds(nbytes) - cost.link.latency_s
        dst.join(dst.link_free_at + cost.link.latency_s, seq)
        self.migrations += 1
        self.migrated_bytes += nbytes

    def worker_seconds(self, t0: float, t_end: float) -> dict:
        out = {"prefill": 0.0, "decode": 0.0}
        for x in self.lives.values():
            end = t_end if x.ended is None else min(x.ended, t_end)
            out[x.role] += max(0.0, end - max(x.started, t0))
        return out


def _span(sim: ClusterSim, reqs: Sequence[SimRequest]) -> tuple[float, float]:
    """(first arrival, the last request's end: its last token, or its arrival if it had none)."""
    t0 = reqs[0].timestamp_s
    ends = [fin for d in (*sim.decode, *sim.retired_decode) for _, _, fin in d.finished]
    return t0, max([*ends, reqs[-1].timestamp_s])


def run_autoscaled(reqs: Sequence[SimRequest], cost: CostModel, cluster: ClusterConfig,
                   cfg: AutoscaleConfig, startup_s: float = STARTUP_S, hashes=None,
                   initial: tuple[int, int] | None = None) -> dict:
    """One autoscaled replay: the pools start at `initial` (P, D) sizes, else at the minimum
    sizes (prefill at least 1: the simulator has no colocated fallback), ready at the first
    arrival, and the controller sizes them from there."""
    p0, d0 = initial or (cfg.min_prefill, cfg.min_decode)
    p0, d0 = max(1, p0), max(1, d0)
    if cfg.min_prefill < 1:
        cfg = AutoscaleConfig(**{**asdict(cfg), "min_prefill": 1})
    sim = ClusterSim(cost, ClusterConfig(**{**asdict(cluster), "num_prefill": p0,
                                            "num_decode": d0}))
    run = AutoscaleRun(sim, reqs, cfg, startup_s, reqs[0].timestamp_s if reqs else 0.0)
    sim.hooks = run
    res = sim.run(reqs, hashes)
    t0, t_end = _span(sim, reqs)
    ws = run.worker_seconds(t0, t_end)
    sizes = [p + d for _, p, d in run.size_log]
    res.update(
        worker_seconds=ws["prefill"] + ws["decode"], worker_seconds_by_role=ws,
        span_s=t_end - t0, peak_workers=max(sizes, default=p0 + d0),
        mean_workers=(ws["prefill"] + ws["decode"]) / (t_end - t0) if t_end > t0 else 0.0,
        scale_ups=sum(run.controller.scale_ups.values()),
        scale_downs=sum(run.controller.scale_downs.values()),
        scale_ups_by_role=dict(run.controller.scale_ups),
        scale_downs_by_role=dict(run.controller.scale_downs),
        migrations=run.migrations, migrated_gb=run.migrated_bytes / 1e9,
        decisions=len(run.decisions), startup_s=startup_s, autoscale=asdict(cfg),
        size_timeline=run.size_log[::max(1, len(run.size_log) // 200)])
    res.pop("config", None)
    return res


def run_static(reqs: Sequence[SimRequest], cost: CostModel, cluster: ClusterConfig,
               hashes=None) -> dict:
    """One static replay with its worker-seconds: its size over its own span."""
    sim = ClusterSim(cost, cluster)
    res = sim.run(reqs, hashes)
    t0, t_end = _span(sim, reqs)
    res.update(worker_seconds=(cluster.num_prefill + cluster.num_decode) * (t_end - t0),
               span_s=t_end - t0)
    res.pop("config", None)
    return res


def repeat_workload(trace: Sequence, gpus: int, requests_per_16: int, repeat: int
                    ) -> list[SimRequest]:
    """The planner's workload at `gpus` (plan_workload) for repeat 0; repeat r > 0 enters
    each replica's timeline elsewhere (own_arrivals with seed k + r x replicas): the same
    requests on other arrival times, so the repeats of a deterministic simulator differ as
    live runs of one trace do."""
    if repeat == 0:
        return plan_workload(trace, gpus, requests_per_16)
    reps = max(1, round(gpus / BASE_GPUS))
    base = cluster_requests(list(trace)[:requests_per_16], ClusterConfig())
    out = [r._replace(tenant=f"replica-{k}") for k in range(reps)
           for r in own_arrivals(base, k + repeat * reps)]
    out.sort(key=lambda r: r.timestamp_s)
    return out


def compare(trace: Sequence, cost: CostModel, gpus: int, cfg: AutoscaleConfig,
            cluster: ClusterConfig, requests_per_16: int = 800, rate_scale: float = 1.0,
            startup_s: float = STARTUP_S, initial: tuple[int, int] | None = None,
            repeats: int = 2, min_size: int = 2) -> dict:
    """At `gpus` (the cap: max_total; each role up to gpus - 1): per repeat the trace as the
    planner scales it to that size (`repeat_workload`), arrivals x `rate_scale`, replayed
    autoscaled; then every static P:D of every size from `min_size` (default 1P:1D) up to the
    largest autoscaled peak, on the same workloads; judged by raypd/sim/static_rivals.py."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cfg = AutoscaleConfig(**{**asdict(cfg), "max_total": gpus,
                             "max_prefill": min(cfg.max_prefill, gpus - 1),
                             "max_decode": min(cfg.max_decode, gpus - 1)})
    workloads = []
    for r in range(repeats):
        reqs = repeat_workload(trace, gpus, requests_per_16, r)
        if rate_scale != 1.0 and reqs:
            t0 = reqs[0].timestamp_s
            reqs = [x._replace(timestamp_s=t0 + (x.timestamp_s - t0) / rate_scale)
                    for x in reqs]
        workloads.append((reqs, trace_hashes(reqs)))
    t_start = time.perf_counter()
    autos = []
    for reqs, hashes in workloads:
        autos.append(run_autoscaled(reqs, cost, cluster, cfg, startup_s, hashes, initial))
    elapsed_auto = time.perf_counter() - t_start
    peak = max(a["peak_workers"] for a in autos)
    sizes = range(max(2, min_size), max(2, min_size, peak) + 1)
    statics: dict[tuple[int, int], list[dict]] = {}
    for p, d in fleet_splits(sizes):
        c = ClusterConfig(**{**asdict(cluster), "num_prefill": p, "num_decode": d})
        statics[(p, d)] = [{**run_static(reqs, cost, c, hashes), "prefill": p, "decode": d}
                           for reqs, hashes in workloads]
    j = judge(autos, statics)
    keep = ("slo_attainment", "worker_seconds", "goodput_rps", "ttft_p99_s", "tpot_p99_s",
            "span_s")
    return {"gpus": gpus, "requests": len(workloads[0][0]), "repeats": repeats,
            "peak_workers": peak, "autoscaled_runs": autos,
            "static": {f"{p}P:{d}D": [{k: r.get(k) for k in keep} for r in runs]
                       for (p, d), runs in statics.items()},
            **{k: v for k, v in j.items() if k != "static_rows"},
            "elapsed_s": {"autoscaled": elapsed_auto,
                          "statics": time.perf_counter() - t_start - elapsed_auto}}


def compare_text(results: Sequence[dict], header: str) -> str:
    """The comparison as a table: per size the autoscaled run, the smallest static meeting
    the SLO and the best static (medians of the repeats, +- half their spread)."""
    lines = [header]
    for res in results:
        a = res["autoscaled_runs"]
        lines.append(f"{res['gpus']} GPUs (cap), {res['requests']} requests, autoscaled peak "
                     f"{res['peak_workers']} workers, scale-ups/downs "
                     + ", ".join(f"{x['scale_ups']}/{x['scale_downs']}" for x in a)
                     + ", migrations " + ", ".join(str(x["migrations"]) for x in a))
        lines.extend(rival_lines(res))
    return "\n".join(lines)
