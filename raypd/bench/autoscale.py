"""`raypd bench autoscale`: a live run with the autoscaler on, against the best static P:D of
the same peak size, on one trace with a quiet phase, a burst and a quiet phase again.

The trace: Poisson arrivals (seeded) at `quiet_rps` for `quiet_s`, `burst_rps` for `burst_s`,
`quiet_rps` for `tail_s`; random prompts of `prompt_tokens` (a range); outputs of `max_tokens`,
a `long_share` of them `long_tokens` (long-form answers: they run for seconds, so some are
decoding when a pool shrinks); ignore_eos, so every request decodes exactly that long. Each request
is sent at its arrival time (open loop) and must end within `deadline_s`. The defaults are
sized for the tiny model on a 2-core machine: its decode step is ~2 ms, so the SLOs are in
its units (TPOT 12 ms, TTFT 0.25 s) and the burst (18 requests/s, 256 tokens each, 1024 for a
tenth: these run for seconds, so the quiet phases at 1.5 requests/s have decodes running when
a pool shrinks) needs more than one decode worker at that TPOT by the workers' own fits while every
worker still shares the same 2 cores (a heavier burst overloads the machine whatever the
split: then the static runs miss too); other models take other values.

Autoscaled run: the cluster starts at `initial` (P, D), as a deployment starts at its
configured size; cluster/autoscale_loop.py sizes it from what the router sees from then on. Its peak size (live + starting, sampled every 0.25 s) is
the static runs' size: every split of that many workers with at least one of each role (at
most `max_statics`, the autoscaled peak's split first), each on a fresh cluster; the best is the
one with the highest SLO attainment (fewer worker-seconds on a tie).

Figures, each run: requests ok, lost (not ended by their deadline), failed with an explicit
error; greedy mismatches of completed requests against stock transformers generate();
leaked blocks (router ledger and every live worker's pool, once nothing is in flight); SLO
attainment = share of all requests with TTFT <= slo_ttft_s and TPOT <= slo_tpot_s as the
client saw them (failed and lost ones miss); worker-seconds = seconds each worker actor lived
from the first arrival to the last end (start-up and draining included).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import ray

from cluster.pd import LeakCount, PDCluster, PDConfig
from protocol.errors import RaypdError
from raypd.bench.chaos import references
from router.autoscale_decision import AutoscaleConfig
from router.orchestrator import FlowConfig
from router.percentiles import percentiles
from workers.request import SamplingParams


@dataclass(frozen=True)
class Phase:
    rps: float
    seconds: float


def trace(phases: list[Phase], prompt_tokens: tuple[int, int], vocab: int, seed: int,
          max_tokens: int = 256, long_share: float = 0.0, long_tokens: int = 0
          ) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt token ids, max_tokens) of every request: Poisson arrivals per
    phase; a `long_share` of the requests generate `long_tokens` (long-form answers), the
    others `max_tokens`."""
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for ph in phases:
        t = t0
        while ph.rps > 0:
            t += rng.expovariate(ph.rps)
            if t >= t0 + ph.seconds:
                break
            n = rng.randint(*prompt_tokens)
            out_tokens = long_tokens if rng.random() < long_share else max_tokens
            out.append((t, [rng.randrange(3, vocab) for _ in range(n)], out_tokens))
        t0 += ph.seconds
    return out


class _Replay:
    """Open loop: each request starts at its arrival offset; outcomes and client-side times."""

    def __init__(self, cluster: PDCluster, requests: list, deadline_s: float) -> None:
        self.cluster, self.requests = cluster, requests
        self.deadline_s = deadline_s
        self.out: list[dict | None] = [None] * len(requests)
        self._done = threading.Semaphore(0)

    def run(self) -> tuple[float, float]:
        """Send every request at its time, wait for all (each ends by its deadline, or is
        lost); returns (monotonic start, monotonic end)."""
        start = time.monotonic()
        threads = []
        for i, (at, _, _) in enumerate(self.requests):
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)      # the trace's own clock (open loop)
            t = threading.Thread(target=self._one, args=(i,), daemon=True)
            t.start()
            threads.append(t)
        until = time.monotonic() + self.deadline_s + 5
        for t in threads:
            t.join(max(0.0, until - time.monotonic()))
        ends = [o["end"] for o in self.out if o is not None]
        return start, max(ends, default=time.monotonic())

    def _one(self, i: int) -> None:
        t0, first = time.monotonic(), []

        def on_delta(_d) -> None:
            if not first:
                first.append(time.monotonic())
        try:
            _, prompt, max_tokens = self.requests[i]
            r = self.cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True),
                                         request_id=f"as-{i}", on_delta=on_delta,
                                         timeout_s=self.deadline_s)
            o = {"tokens": r.token_ids, "migrations": r.lifecycle.migrations,
                 "fallbacks": r.lifecycle.migration_fallbacks}
        except RaypdError as e:
            o = {"error": f"{type(e).__name__}: {e}"[:300]}
        except Exception as e:   # noqa: BLE001 - not a documented error: counted as such
            o = {"error": f"{type(e).__name__}: {e}"[:300], "undocumented": True}
        end = time.monotonic()
        n = len(o.get("tokens", ()))
        o.update(start=t0, end=end, ttft=first[0] - t0 if first else None,
                 tpot=(end - first[0]) / (n - 1) if first and n > 1 else None)
        self.out[i] = o


def _run(cfg: PDConfig, requests: list, reference: list, deadline_s: float,
         slo: tuple[float, float], label: str) -> dict:
    cluster = PDCluster(cfg)
    peak = {"prefill": 0, "decode": 0, "total": 0}
    sampling_stop = threading.Event()

    def sample_sizes() -> None:
        fleet = cluster.orchestrator.fleet
        while not sampling_stop.wait(0.25):
            auto = cluster.autoscaler
            starting = dict(auto.starting) if auto else {"prefill": 0, "decode": 0}
            sizes = {r: len(fleet.live(r)) + starting[r] for r in ("prefill", "decode")}
            for r, n in sizes.items():
                peak[r] = max(peak[r], n)
            peak["total"] = max(peak["total"], sum(sizes.values()))
    try:
        ws0 = cluster.worker_seconds()
        sampler = threading.Thread(target=sample_sizes, daemon=True)
        sampler.start()
        replay = _Replay(cluster, requests, deadline_s)
        t_start, t_end = replay.run()
        worker_seconds = cluster.worker_seconds() - ws0
        # the workers' seconds between the first arrival and the last end
        worker_seconds -= max(0.0, time.monotonic() - t_end) * len(cluster.workers)
        sampling_stop.set()
        auto = cluster.autoscaler
        if auto is not None:
            auto.stop(wait_s=10)
        for t in list(cluster._reapers):
            t.join(60)
        leaked = cluster.leak_count()
        return _figures(label, replay.out, reference, slo, worker_seconds, leaked, peak,
                        cluster, t_end - t_start, t_start)
    finally:
        sampling_stop.set()
        cluster.shutdown()


def _figures(label: str, out: list, reference: list, slo: tuple[float, float],
             worker_seconds: float, leaked: LeakCount, peak: dict, cluster: PDCluster,
             span_s: float, t0: float) -> dict:
    ok = [i for i, o in enumerate(out) if o is not None and "tokens" in o]
    lost = sum(o is None for o in out)
    failed = [o["error"] for o in out if o is not None and "error" in o]
    mismatches = sum(out[i]["tokens"] != reference[i] for i in ok)
    def attained(i: int) -> bool:
        o = out[i]
        return o is not None and "tokens" in o and o["ttft"] is not None and \
            o["ttft"] <= slo[0] and (o["tpot"] is None or o["tpot"] <= slo[1])
    met = sum(attained(i) for i in ok)
    by_second: dict[int, list[int]] = {}      # arrival second -> [requests, attained]
    for i, o in enumerate(out):
        if o is not None:
            cell = by_second.setdefault(int(o["start"] - t0), [0, 0])
            cell[0] += 1
            cell[1] += attained(i)
    auto = cluster.autoscaler.to_dict() if cluster.autoscaler else None
    history = list(cluster.autoscaler.controller.history) if cluster.autoscaler else []
    return {
        "label": label, "requests_total": len(out), "requests_ok": len(ok),
        "requests_lost": lost, "requests_failed": len(failed),
        "failures": failed[:10], "undocumented_errors": sum(
            1 for o in out if o is not None and o.get("undocumented")),
        # None (unknown) when a worker could not be counted: `no_leaked` then fails
        "leaked_blocks": leaked.leaked, "leak_unknown": leaked.unknown,
        "greedy_mismatches": mismatches,
        "slo_attainment": met / len(out) if out else 0.0,
        "attainment_by_arrival_second": {k: v for k, v in sorted(by_second.items())},
        "worker_seconds": worker_seconds, "span_s": span_s, "peak": dict(peak),
        "ttft_s": percentiles([out[i]["ttft"] for i in ok if out[i]["ttft"] is not None]),
        "tpot_s": percentiles([out[i]["tpot"] for i in ok if out[i]["tpot"] is not None]),
        "migrations": sum(out[i]["migrations"] for i in ok),
        "migrations_fallback": sum(out[i]["fallbacks"] for i in ok),
        "router_migrations": dict(cluster.orchestrator.migrations),
        "moved_by_cause": dict(cluster.orchestrator.moved_by_cause),
        "scale_applied": [{**a, "at": a["at"] - t0} for a in auto["applied"]] if auto else [],
        "scale_ups": sum(auto["scale_ups"].values()) if auto else 0,
        "scale_downs": sum(auto["scale_downs"].values()) if auto else 0,
        "decisions": [{"at_s": d.at - t0, "prefill": d.prefill, "decode": d.decode,
                       "reasons": {r.role: r.reason for r in d.roles if r.changed}}
                      for d in history if d.changed],
    }


def static_splits(total: int, first: tuple[int, int] | None, max_statics: int
                  ) -> list[tuple[int, int]]:
    """Splits (P, D) of `total` workers, P and D >= 1: `first` (when it is one), then the
    others from the most decode-heavy, at most `max_statics`."""
    splits = [(p, total - p) for p in range(1, total)]
    if first in splits:
        splits.remove(first)
        splits.insert(0, first)
    return splits[:max(1, max_statics)]


def run_autoscale_bench(model: str = "tiny", quiet_rps: float = 1.5, burst_rps: float = 18.0,
                        quiet_s: float = 10.0, burst_s: float = 20.0, tail_s: float = 20.0,
                        prompt_tokens: tuple[int, int] = (32, 160), max_tokens: int = 256,
                        long_share: float = 0.1, long_tokens: int = 1024,
                        slo_ttft_s: float = 0.25, slo_tpot_s: float = 0.012,
                        max_prefill: int = 2, max_decode: int = 3, deadline_s: float = 120.0,
                        max_statics: int = 2, seed: int = 0, initial: tuple[int, int] = (1, 2),
                        autoscale: AutoscaleConfig | None = None,
                        engine: dict | None = None) -> dict:
    """`engine`: EngineConfig fields (the config chain's; `model` and the pool are this
    bench's). The flow is as recorded: object_store, every prefill on the prefill pool."""
    from workers.model_loader import load_model
    if not (quiet_rps >= 0 and burst_rps > 0 and min(quiet_s, burst_s, tail_s) >= 0):
        raise ValueError("rates must be >= 0 (burst > 0) and phase lengths >= 0")
    if not 1 <= prompt_tokens[0] <= prompt_tokens[1]:
        raise ValueError(f"prompt tokens must be a range LOW..HIGH >= 1, got {prompt_tokens}")
    vocab = min(load_model(model)[2].vocab_size, 30000)
    phases = [Phase(quiet_rps, quiet_s), Phase(burst_rps, burst_s), Phase(quiet_rps, tail_s)]
    if not 0 <= long_share <= 1 or max_tokens < 1 or (long_share and long_tokens < 1):
        raise ValueError("max tokens must be >= 1 and the long share in [0, 1]")
    requests = trace(phases, prompt_tokens, vocab, seed, max_tokens, long_share, long_tokens)
    reference: list = [None] * len(requests)
    for n in {m for _, _, m in requests}:      # stock generate(), each length's requests
        idx = [i for i, r in enumerate(requests) if r[2] == n]
        for i, toks in zip(idx, references(model, [requests[i][1] for i in idx], n,
                                           ignore_eos=True), strict=True):
            reference[i] = toks
    auto_cfg = autoscale or AutoscaleConfig(
        enabled=True, min_prefill=1, max_prefill=max_prefill, min_decode=1,
        max_decode=max_decode, ttft_s=slo_ttft_s, tpot_s=slo_tpot_s, interval_s=1.0,
        cooldown_s=6.0, up_cooldown_s=2.0, window_s=10.0, min_samples=5)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    engine = {**(engine or {}), "model": model, "num_blocks": 1024}
    flow = FlowConfig(request_timeout_s=deadline_s, report_interval_s=0.1,
                      transport="object_store", local_prefill_when_backlogged=False)
    slo = (slo_ttft_s, slo_tpot_s)
    try:
        auto = _run(PDConfig(engine=engine, num_prefill=initial[0], num_decode=initial[1],
                             flow=flow, autoscale=auto_cfg),
                    requests, reference, deadline_s, slo, "autoscaled")
        total = max(2, auto["peak"]["total"])
        first = (auto["peak"]["prefill"], total - auto["peak"]["prefill"])
        statics = [_run(PDConfig(engine=engine, num_prefill=p, num_decode=d, flow=flow),
                        requests, reference, deadline_s, slo, f"static {p}P:{d}D")
                   for p, d in static_splits(total, first, max_statics)]
    finally:
        if started_ray:
            ray.shutdown()
    best = max(statics, key=lambda r: (r["slo_attainment"], -r["worker_seconds"]))
    result = {
        "model": model, "label": "cpu-measured (this machine, one Ray node)",
        "initial": list(initial),
        "trace": {"phases": [{"rps": p.rps, "seconds": p.seconds} for p in phases],
                  "requests": len(requests), "prompt_tokens": list(prompt_tokens),
                  "max_tokens": max_tokens, "long_share": long_share,
                  "long_tokens": long_tokens, "seed": seed},
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "autoscale_config": {k: v for k, v in vars(auto_cfg).items()},
        "requests_total": auto["requests_total"], "requests_ok": auto["requests_ok"],
        "requests_lost": auto["requests_lost"], "leaked_blocks": auto["leaked_blocks"],
        "greedy_mismatches": auto["greedy_mismatches"], "scale_ups": auto["scale_ups"],
        "scale_downs": auto["scale_downs"], "migrations": auto["migrations"],
        "migrations_fallback": auto["migrations_fallback"],
        "migrations_by_cause": auto["moved_by_cause"],
        "worker_seconds": auto["worker_seconds"],
        "worker_seconds_static": best["worker_seconds"],
        "slo_attainment": auto["slo_attainment"],
        "slo_attainment_static": best["slo_attainment"],
        "static_best": best["label"], "autoscaled": auto, "statics": statics,
    }
    result["targets"] = verdict(result, [best])
    result["passed"] = all(result["targets"].values())
    return result


def verdict(r: dict, statics: list[dict]) -> dict[str, bool]:
    """The issue's targets, each on this run's figures (the static runs must be clean too)."""
    return {
        "no_lost": r["requests_lost"] == 0 and all(s["requests_lost"] == 0 for s in statics),
        "no_leaked": r["leaked_blocks"] == 0 and all(s["leaked_blocks"] == 0 for s in statics),
        "no_mismatches": r["greedy_mismatches"] == 0,
        "scale_down_migrated": r["scale_downs"] >= 1 and
        r.get("migrations_by_cause", {}).get("drain", 0) >= 1,
        "slo_within_5_points": r["slo_attainment"] >= r["slo_attainment_static"] - 0.05,
        "fewer_worker_seconds": r["worker_seconds"] < r["worker_seconds_static"],
    }


def _count(n: int | None) -> str:
    return "unk" if n is None else str(n)


def summary_text(r: dict) -> str:
    a = r["autoscaled"]
    lines = [f"bench autoscale ({r['label']}), model {r['model']}, {r['requests_total']} "
             f"requests, SLO TTFT <= {r['slo']['ttft_s']} s, TPOT <= {r['slo']['tpot_s']} s",
             f"{'run':<18} {'ok':>4} {'lost':>4} {'fail':>4} {'leak':>4} {'mism':>4} "
             f"{'attain':>7} {'worker-s':>9} {'peak P/D':>8} {'up/down':>7} {'moved':>5}"]
    for x in [a, *r["statics"]]:
        lines.append(f"{x['label']:<18} {x['requests_ok']:>4} {x['requests_lost']:>4} "
                     f"{x['requests_failed']:>4} {_count(x['leaked_blocks']):>4} "
                     f"{x['greedy_mismatches']:>4} {100 * x['slo_attainment']:>6.1f}% "
                     f"{x['worker_seconds']:>9.0f} "
                     f"{x['peak']['prefill']:>4}/{x['peak']['decode']:<3} "
                     f"{x['scale_ups']:>3}/{x['scale_downs']:<3} {x['migrations']:>5}")
    lines.append(f"autoscaled moves by cause: {a.get('moved_by_cause') or 'none'}; scale-ups "
                 "took " + ", ".join(f"{x['seconds']:.1f} s" for x in a["scale_applied"]
                                     if any(x["launched"].values())))
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}"
                                         for k, v in r["targets"].items()))
    return "\n".join(lines)
