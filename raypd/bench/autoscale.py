"""`raypd bench autoscale`: live runs with the autoscaler on against every static P:D fleet from
the smallest that serves the quiet phase up to the autoscaled peak, on one trace with a quiet
phase, a burst and a quiet phase again.

The trace: Poisson arrivals (seeded) at `quiet_rps` for `quiet_s`, `burst_rps` for `burst_s`,
`quiet_rps` for `tail_s`; random prompts of `prompt_tokens` (a range); outputs of `max_tokens`,
a `long_share` of them `long_tokens` (long-form answers: they run for seconds, so some are
decoding when a pool shrinks); ignore_eos, so every request decodes exactly that long. Each request
is sent at its arrival time (open loop) and must end within `deadline_s`. The SLOs and the
phases' rates are multiples of this machine's own step times and throughput, measured first
as the workers run (raypd/bench/autoscale_targets.py), so every CPU kind is asked the same;
the long outputs (a tenth at 1024 tokens) run for seconds, so the quiet tail has decodes
running when a pool shrinks. Defaults (6 s quiet, 12 s burst, 14 s quiet) keep a run near a
minute on 2 cores; with 2 repeats and up to 10 static splits that is ~20 minutes.

Autoscaled run: the cluster starts at `initial` (P, D), as a deployment starts at its
configured size; cluster/autoscale_loop.py sizes it from what the router sees from then on. Its
peak size (live + starting, sampled every 0.25 s; the largest over its repeats) bounds the
static runs: every split (one of each role at least) of every size from the smallest fleet
that serves the quiet phase by the measured throughput (`quiet_fleet`) up to that peak, each on
a fresh cluster, in rounds (every split once, then again) so drift spreads over all alike. A
static of the peak size spends peak x span worker-seconds, so beating it alone is true by
construction; the rival is the smallest static whose median attainment is within 5 points of
the autoscaled median (raypd/sim/static_rivals.py), and the best static bounds attainment.
Each side runs `repeats` times (default 2): medians and spreads.

Figures, each run: requests ok, lost (not ended by their deadline), failed with an explicit
error; greedy mismatches of completed requests against stock transformers generate();
leaked blocks (router ledger and every live worker's pool, once nothing is in flight); SLO
attainment = share of all requests with TTFT <= slo_ttft_s and TPOT <= slo_tpot_s as the
client saw them (failed and lost ones miss); worker-seconds = seconds each worker actor lived
from the first arrival to the last end (start-up and draining included).
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass

import ray

from cluster.pd import LeakCount, PDCluster, PDConfig
from protocol.errors import RaypdError
from raypd.bench.autoscale_targets import Multiples, StepTimes, derive, measure
from raypd.bench.chaos import references
from raypd.sim.static_rivals import fleet_splits, judge, rival_lines
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


def idle_path(cfg: PDConfig, prompt_tokens: int, vocab: int, seed: int, n: int = 6,
              max_tokens: int = 32) -> tuple[float, float]:
    """(TTFT, TPOT) of a request of `prompt_tokens` on an unloaded cluster of `cfg`, one at a
    time, as the client sees them: medians of `n` after one warm-up request."""
    import statistics
    rng = random.Random(seed + 1)
    cluster = PDCluster(cfg)
    ttft, tpot = [], []
    try:
        for k in range(n + 1):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
            first: list[float] = []
            t0 = time.monotonic()
            r = cluster.run_request(
                prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                request_id=f"idle-{k}", timeout_s=60.0,
                on_delta=lambda _d, first=first: first or first.append(time.monotonic()))
            end = time.monotonic()
            if k and first and len(r.token_ids) > 1:
                ttft.append(first[0] - t0)
                tpot.append((end - first[0]) / (len(r.token_ids) - 1))
    finally:
        cluster.shutdown()
    if not ttft:
        raise RuntimeError("the idle probe got no timed request: no SLO to derive")
    return statistics.median(ttft), statistics.median(tpot)


def quiet_fleet(steps: StepTimes, quiet_rps: float, mean_prompt: float,
                mean_output: float) -> int:
    """The smallest fleet that serves the quiet phase by the measured throughput: enough
    prefill workers for its prompt tokens and decode workers for its output tokens (one of
    each at least)."""
    return max(1, math.ceil(quiet_rps * mean_prompt / steps.prefill_tok_s)) + \
        max(1, math.ceil(quiet_rps * mean_output / steps.decode_tok_s))


def run_autoscale_bench(model: str = "tiny", quiet_rps: float | None = None,
                        burst_rps: float | None = None, quiet_s: float = 6.0,
                        burst_s: float = 12.0, tail_s: float = 14.0,
                        prompt_tokens: tuple[int, int] = (32, 160), max_tokens: int = 256,
                        long_share: float = 0.1, long_tokens: int = 1024,
                        slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                        multiples: Multiples | None = None, repeats: int = 2,
                        max_prefill: int = 2, max_decode: int = 3, deadline_s: float = 120.0,
                        seed: int = 0, initial: tuple[int, int] = (1, 2),
                        autoscale: AutoscaleConfig | None = None,
                        engine: dict | None = None) -> dict:
    """`engine`: EngineConfig fields (the config chain's; `model` and the pool are this
    bench's). The flow is as recorded: object_store, every prefill on the prefill pool.
    SLOs and rates left None come from this machine's calibration (autoscale_targets.py);
    given, they are used as given and the JSON says so."""
    from workers.model_loader import load_model
    multiples = multiples or Multiples()
    multiples.validate()
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if min(quiet_s, burst_s, tail_s) < 0 or any(
            x is not None and not x > 0 for x in (burst_rps, slo_ttft_s, slo_tpot_s)) or (
            quiet_rps is not None and quiet_rps < 0):
        raise ValueError("rates must be >= 0 (burst > 0), SLOs > 0 and phase lengths >= 0")
    if not 1 <= prompt_tokens[0] <= prompt_tokens[1]:
        raise ValueError(f"prompt tokens must be a range LOW..HIGH >= 1, got {prompt_tokens}")
    if not 0 <= long_share <= 1 or max_tokens < 1 or (long_share and long_tokens < 1):
        raise ValueError("max tokens must be >= 1 and the long share in [0, 1]")
    vocab = min(load_model(model)[2].vocab_size, 30000)
    mean_prompt = sum(prompt_tokens) / 2
    mean_output = (1 - long_share) * max_tokens + long_share * long_tokens
    engine = {**(engine or {}), "model": model, "num_blocks": 1024}
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        t_cal = time.monotonic()
        flow = FlowConfig(request_timeout_s=deadline_s, report_interval_s=0.1,
                          transport="object_store", local_prefill_when_backlogged=False)
        idle = idle_path(PDConfig(engine=engine, num_prefill=1, num_decode=1, flow=flow),
                         prompt_tokens[1], vocab, seed)
        steps, raw = measure(engine, prompt_tokens[1], PDConfig().threads_per_actor, idle)
        derived = derive(steps, multiples, mean_prompt, mean_output)
        slo = (slo_ttft_s or derived.slo_ttft_s, slo_tpot_s or derived.slo_tpot_s)
        rates = (derived.quiet_rps if quiet_rps is None else quiet_rps,
                 burst_rps or derived.burst_rps)
        calibration = {"measured": asdict(steps), "multiples": asdict(multiples),
                       "derived": asdict(derived), "seconds": time.monotonic() - t_cal,
                       "cpu_model": raw.get("device_name"), "probe": raw,
                       "overridden": [k for k, v in (
                           ("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s),
                           ("quiet_rps", quiet_rps), ("burst_rps", burst_rps)) if v is not None]}
        phases = [Phase(rates[0], quiet_s), Phase(rates[1], burst_s), Phase(rates[0], tail_s)]
        requests = trace(phases, prompt_tokens, vocab, seed, max_tokens, long_share,
                         long_tokens)
        reference: list = [None] * len(requests)
        for n in {m for _, _, m in requests}:      # stock generate(), each length's requests
            idx = [i for i, r in enumerate(requests) if r[2] == n]
            for i, toks in zip(idx, references(model, [requests[i][1] for i in idx], n,
                                               ignore_eos=True), strict=True):
                reference[i] = toks
        auto_cfg = autoscale or AutoscaleConfig(
            enabled=True, min_prefill=1, max_prefill=max_prefill, min_decode=1,
            max_decode=max_decode, ttft_s=slo[0], tpot_s=slo[1], interval_s=1.0,
            cooldown_s=6.0, up_cooldown_s=2.0, window_s=10.0, min_samples=5)
        t_runs = time.monotonic()
        autos = [_run(PDConfig(engine=engine, num_prefill=initial[0], num_decode=initial[1],
                               flow=flow, autoscale=auto_cfg),
                      requests, reference, deadline_s, slo, f"autoscaled #{r + 1}")
                 for r in range(repeats)]
        peak = max(2, *(a["peak"]["total"] for a in autos))
        smallest = min(quiet_fleet(steps, rates[0], mean_prompt, mean_output), peak)
        splits = fleet_splits(range(smallest, peak + 1))
        statics: dict[tuple[int, int], list[dict]] = {s: [] for s in splits}
        for r in range(repeats):             # rounds: drift spreads over every split alike
            for p, d in splits:
                statics[(p, d)].append(_run(
                    PDConfig(engine=engine, num_prefill=p, num_decode=d, flow=flow),
                    requests, reference, deadline_s, slo, f"static {p}P:{d}D #{r + 1}"))
        runs_s = time.monotonic() - t_runs
    finally:
        if started_ray:
            ray.shutdown()
    judged = judge(autos, statics)
    a = autos
    result = {
        "model": model, "label": "cpu-measured (this machine, one Ray node)",
        "cpu_model": cpu_model(), "initial": list(initial), "repeats": repeats,
        "trace": {"phases": [{"rps": p.rps, "seconds": p.seconds} for p in phases],
                  "requests": len(requests), "prompt_tokens": list(prompt_tokens),
                  "max_tokens": max_tokens, "long_share": long_share,
                  "long_tokens": long_tokens, "seed": seed},
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "calibration": calibration,
        "autoscale_config": {k: v for k, v in vars(auto_cfg).items()},
        "smallest_quiet_fleet": smallest,
        "requests_total": len(requests),
        "requests_ok": [x["requests_ok"] for x in a],
        "requests_lost": sum(x["requests_lost"] for x in a),
        "leaked_blocks": _sum_or_none(x["leaked_blocks"] for x in a),
        "greedy_mismatches": sum(x["greedy_mismatches"] for x in a),
        "scale_ups": [x["scale_ups"] for x in a], "scale_downs": [x["scale_downs"] for x in a],
        "migrations": [x["migrations"] for x in a],
        "migrations_by_cause": [x["moved_by_cause"] for x in a],
        **{k: v for k, v in judged.items() if k not in ("targets", "static_rows")},
        "worker_seconds": judged["worker_seconds_autoscaled"],
        "slo_attainment": judged["slo_attainment_autoscaled"],
        "static_rows": judged["static_rows"],
        "autoscaled": autos, "statics": [x for runs in statics.values() for x in runs],
        "runs_seconds": runs_s,
    }
    result["targets"] = {**verdict(autos, [x for v in statics.values() for x in v]),
                         **judged["targets"]}
    result["passed"] = all(result["targets"].values())
    return result


def _sum_or_none(xs) -> int | None:
    """A sum that fails closed: any unknown count makes it unknown."""
    xs = list(xs)
    return None if any(x is None for x in xs) else sum(xs)


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (workers/device.py)."""
    from workers.device import cpu_model_name
    return cpu_model_name()


def verdict(autos: list[dict], statics: list[dict]) -> dict[str, bool]:
    """The targets each run's own figures decide (every run, autoscaled and static, must be
    clean; every autoscaled run must have scaled down with a drain that moved a request);
    the comparison's two come from static_rivals.judge."""
    runs = [*autos, *statics]
    return {
        "no_lost": all(x["requests_lost"] == 0 for x in runs),
        "no_leaked": all(x["leaked_blocks"] == 0 for x in runs),   # None (unknown) fails
        "no_mismatches": all(x["greedy_mismatches"] == 0 for x in runs),
        "scale_down_migrated": bool(autos) and all(
            x["scale_downs"] >= 1 and (x.get("moved_by_cause") or {}).get("drain", 0) >= 1
            for x in autos),
    }


def _count(n: int | None) -> str:
    return "unk" if n is None else str(n)


def summary_text(r: dict) -> str:
    cal = r["calibration"]
    m, st = cal["multiples"], cal["measured"]
    lines = [f"bench autoscale ({r['label']}, {r['cpu_model']}), model {r['model']}, "
             f"{r['requests_total']} requests, {r['repeats']} runs a side",
             f"calibrated here: idle TTFT {1e3 * st['prefill_step_s']:.1f} ms "
             f"({st['prompt_tokens']} tokens; engine prefill step "
             f"{1e3 * st['engine_prefill_step_s']:.2f} ms), idle TPOT "
             f"{1e3 * st['decode_step_s']:.2f} ms (engine step "
             f"{1e3 * st['engine_decode_step_s']:.2f} ms); "
             f"SLO TTFT <= {r['slo']['ttft_s']:.3f} s ({m['slo_ttft_x']:g} x idle TTFT), "
             f"TPOT <= {1e3 * r['slo']['tpot_s']:.1f} ms ({m['slo_tpot_x']:g} x idle TPOT); "
             f"rates quiet {r['trace']['phases'][0]['rps']:.2f} / burst "
             f"{r['trace']['phases'][1]['rps']:.2f} req/s ({m['quiet_x']:g} / {m['burst_x']:g} "
             f"x capacity {cal['derived']['capacity_rps']:.1f} req/s)"
             + (f"; given: {', '.join(cal['overridden'])}" if cal["overridden"] else ""),
             f"{'run':<20} {'ok':>4} {'lost':>4} {'fail':>4} {'leak':>4} {'mism':>4} "
             f"{'attain':>7} {'worker-s':>9} {'peak P/D':>8} {'up/down':>7} {'moved':>5}"]
    for x in [*r["autoscaled"], *r["statics"]]:
        lines.append(f"{x['label']:<20} {x['requests_ok']:>4} {x['requests_lost']:>4} "
                     f"{x['requests_failed']:>4} {_count(x['leaked_blocks']):>4} "
                     f"{x['greedy_mismatches']:>4} {100 * x['slo_attainment']:>6.1f}% "
                     f"{x['worker_seconds']:>9.0f} "
                     f"{x['peak']['prefill']:>4}/{x['peak']['decode']:<3} "
                     f"{x['scale_ups']:>3}/{x['scale_downs']:<3} {x['migrations']:>5}")
    lines.extend(rival_lines(r))
    return "\n".join(lines)
