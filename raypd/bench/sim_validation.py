"""`raypd simulate --validate`: a short replay on a real 1P+1D cluster here and the same replay
in the cluster simulator with the cpu-here cost model; `sim_vs_real_error` is the largest
relative error of TTFT p50, TTFT p99 and TPOT p50 (simulator against real).

The cost model comes from `raypd bench engine --calibration` figures: a JSON given with
`--engine-json`, or (without one) measured by this command first, on this machine, in a Ray task
placed like the workers and with their thread count, right before the replay, so that both
sides see the machine in the same state. The calibration measures the engine alone (prefill of
one request at several lengths and of a few batched prompts in one step, decode steps at
several batch sizes and contexts); the replay adds what the simulator has to predict: queueing
behind other prefills, prompts batched into one step, the transfer, decode batches forming and
changing.

The replay (`replay_requests`): `num_requests` prompts of random token ids (lengths cycling
over `prompt_lens`), `max_tokens` each (ignore_eos), Poisson arrivals; the real side measures
TTFT at the client (first streamed token) and TPOT from the first to the last streamed token,
after one warm-up request of each prompt length through both workers. The real side runs the
replay twice (`rounds`; new prompts, same arrivals and lengths) and pools both: this machine's
speed drifts by 10-25% over minutes (the same decode step measured 100-150 ms within ten
minutes here), and a prompt that just makes or just misses a prefill step moves its TTFT by
a whole step; `real_round_spread` says how far the rounds differ (the noise floor under
sim_vs_real_error). Before the replay a probe measures how much the real prefill and decode
workers slow each other (`probe_shared_host`: the simulator's shared-host slowdowns) and
the workers' speed alone, to which the calibration's level is re-anchored (`anchor`: the
machine drifts in the minutes the calibration takes; the shapes stay the calibration's), and
what a request spends around its prefill before its first token (admission, staging, the
transfer over the object store, the token's way back), which the simulator's link carries.
Both sides are `cpu-measured`; `per_request` gives each request's figures on both sides (and
its real stage seconds), to see where they part: the real side's round k request i is key
k * requests + i (the simulator's i)."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from dataclasses import asdict

from raypd.sim.cluster_sim import ClusterConfig, ClusterSim
from raypd.sim.cost_model import CostModel, SharedHost, cpu_cost_model
from raypd.sim.routing_sim import SimRequest
from router.percentiles import percentile


def replay_requests(num_requests: int, prompt_lens: tuple[int, ...], gap_s: float,
                    seed: int = 0, vocab: int = 49152) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt) pairs: Poisson arrivals at a mean gap of `gap_s`, the first at 0,
    prompt lengths cycling over `prompt_lens`, random token ids (no shared prefixes)."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for j in range(num_requests):
        out.append((at, [rng.randrange(100, vocab) for _ in range(prompt_lens[j % len(
            prompt_lens)])]))
        at += rng.expovariate(1.0 / gap_s)
    return out


def _timed_request(cluster, prompt: list[int], max_tokens: int, request_id: str | None = None,
                   first: threading.Event | None = None, first_at: int = 1
                   ) -> tuple[float, list[float], int]:
    """(start, arrival time of each delta that carries tokens, tokens) of one request through
    the cluster; `first` is set once `first_at` such deltas arrived."""
    from workers.request import SamplingParams
    start, token_times = time.perf_counter(), []

    def on_delta(delta) -> None:
        if delta.token_ids:
            token_times.append(time.perf_counter())
            if first is not None and len(token_times) >= first_at:
                first.set()
    res = cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              request_id=request_id, on_delta=on_delta)
    return start, token_times, len(res.token_ids)


def probe_shared_host(cluster, rng: random.Random, context: int, prefill_tokens: int,
                      decode_tokens: int) -> dict:
    """How much the real prefill and decode workers slow each other on this host (they share
    its cores, its memory and the serving processes' CPU), with probe requests of its own (none
    of the replay's), after the warm-up and before the replay, from the router's request
    traces: one `context`-token sequence decodes `decode_tokens` tokens while, after its tenth
    token, a `prefill_tokens` prompt prefills; decode_x = its mean gap between streamed tokens
    inside that prefill's compute over its mean gap outside it (before the prefill, and after
    the prompt's KV landed); prefill_x = that prefill's compute over the mean of the same
    prefill alone right before and right after (the machine's speed drifts over minutes)."""
    traces = cluster.orchestrator.traces

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    def compute_span(rid: str):
        span = next((x for x in traces.get(rid).spans if x.stage == "prefill_compute"), None)
        if span is None:
            raise RuntimeError(f"probe request {rid} has no prefill_compute stage (was it "
                               f"prefilled by the prefill worker?)")
        return span

    def mean_gap(ts: list[float]) -> float | None:
        return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) >= 4 else None
    alone_runs = [_timed_request(cluster, prompt(prefill_tokens), 2, "probe-prefill-before")]
    tenth, box = threading.Event(), {}

    def decode() -> None:
        try:
            box["d"] = _timed_request(cluster, prompt(context), decode_tokens,
                                      "probe-decode", first=tenth, first_at=10)
        finally:
            tenth.set()
    th = threading.Thread(target=decode)
    th.start()
    try:
        tenth.wait()
        _timed_request(cluster, prompt(prefill_tokens), 2, "probe-prefill-beside")
    finally:
        th.join()
    assert "d" in box, "the probe's decode request failed"
    alone_runs.append(_timed_request(cluster, prompt(prefill_tokens), 2, "probe-prefill-after"))
    span = compute_span("probe-prefill-beside")
    landed = traces.get("probe-prefill-beside").token_times[1]   # D's first step after it
    ts = traces.get("probe-decode").token_times[1:]              # D's steps
    inside = mean_gap([t for t in ts if span.start <= t <= span.end])
    before = [t for t in ts if t < span.start]
    after = [t for t in ts if t > landed]
    gaps = [g for g in (mean_gap(before), mean_gap(after)) if g is not None]
    outside = sum(gaps) / len(gaps) if gaps else None
    computes = [compute_span(f"probe-prefill-{k}").seconds for k in ("before", "after")]
    alone = sum(computes) / 2
    # what a request spends around its prefill on the idle cluster (route, admit, staging,
    # transfer, the first token's way to the client): its TTFT at the client less its compute
    handoff = sum(token_times[0] - start - c for (start, token_times, _), c
                  in zip(alone_runs, computes, strict=True)) / 2
    return {"context": context, "prefill_tokens": prefill_tokens,
            "decode_tokens": decode_tokens, "decode_gap_s_outside": outside,
            "decode_gap_s_inside_prefill": inside, "prefill_compute_s_alone": alone,
            "handoff_s_alone": handoff,
            "prefill_compute_s_beside_decode": span.seconds,
            "decode_x": max(1.0, inside / outside) if inside and outside else 1.0,
            "prefill_x": max(1.0, span.seconds / alone) if alone > 0 else 1.0}


def run_real(replay, max_tokens: int, engine: dict, cost: CostModel, rounds: int = 2
             ) -> dict:
    """The replay on a real 1P+1D cluster (Ray already started: `validate`), after a warm-up
    and the shared-host probe (both not measured as the replay; `cost` sizes the probe),
    `rounds` times one after the other (new prompts each round): the figures pool every
    round's requests, `rounds` gives each round's and `round_spread` how far they differ."""
    from cluster.pd import PDCluster, PDConfig
    from workers.request import SamplingParams

    cluster = PDCluster(PDConfig(engine=engine, num_prefill=1, num_decode=1))
    per: dict[int, tuple[float, float | None]] = {}
    errors: list[str] = []
    stages: dict[int, dict[str, float]] = {}
    rounds_out: list[dict] = []
    try:   # warm-up, not measured: one request of each prompt length through both workers
        rng = random.Random(1)
        lens = sorted({len(p) for _, p in replay})
        for n in lens:
            cluster.run_request([rng.randrange(100, 30000) for _ in range(n)],
                                SamplingParams(max_tokens=4, ignore_eos=True))
        context, prefill_tokens = lens[len(lens) // 2], lens[-1]
        # enough tokens to decode through the prefill: 10 before, 1.5x its time, 10 after
        decode_tokens = 20 + math.ceil(1.5 * cost.prefill.prefill_s(prefill_tokens)
                                       / max(cost.decode.step_s(1, context), 1e-3))
        probe = probe_shared_host(cluster, rng, context, prefill_tokens, decode_tokens)
        for k in range(rounds):   # the same arrivals and lengths, new prompts (no prefix hits)
            rng_k = random.Random(100 + k)
            this = replay if k == 0 else [
                (at, [rng_k.randrange(100, 30000) for _ in p]) for at, p in replay]
            per_k: dict[int, tuple[float, float | None]] = {}
            _replay_once(cluster, this, max_tokens, f"validate-r{k}", per_k, errors)
            rounds_out.append(_summary(per_k))
            for idx, v in per_k.items():
                per[k * len(replay) + idx] = v
                trace = cluster.orchestrator.traces.get(f"validate-r{k}-{idx}")
                stages[k * len(replay) + idx] = trace.stage_seconds() if trace else {}
    finally:
        cluster.shutdown()
    out = _summary(per, errors)
    for idx, st in stages.items():
        out["per_request"][idx]["stage_s"] = st
    out["shared_host_probe"] = probe
    out["rounds"] = [{k: r[k] for k in METRICS} for r in rounds_out]
    out["round_spread"] = _spread(rounds_out, out)
    return out


METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")


def _spread(rounds: list[dict], pooled: dict) -> float | None:
    """The largest (max - min over rounds) / pooled figure of the three metrics: how far the
    real cluster disagrees with itself on the same replay (the noise floor of
    sim_vs_real_error)."""
    if len(rounds) < 2:
        return None
    out = [(max(r[k] for r in rounds) - min(r[k] for r in rounds)) / pooled[k]
           for k in METRICS if pooled[k] and not any(math.isnan(r[k]) for r in rounds)]
    return max(out) if out else None


def _replay_once(cluster, replay, max_tokens: int, prefix: str,
                 per: dict[int, tuple[float, float | None]], errors: list[str]) -> None:
    """One pass of the replay: each request on its own thread at its arrival time; TTFT at
    the first streamed token, TPOT from the first to the last."""
    t0 = time.perf_counter()

    def one(idx, at, prompt):
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        try:
            start, token_times, n = _timed_request(cluster, prompt, max_tokens,
                                                   f"{prefix}-{idx}")
        except Exception as e:   # noqa: BLE001 - counted, reported
            errors.append(str(e))
            return
        per[idx] = (token_times[0] - start,
                    (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None)
    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(replay)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _summary(per: dict[int, tuple[float, float | None]], errors: list[str] | None = None
             ) -> dict:
    ttft = [t for t, _ in per.values()]
    tpot = [t for _, t in per.values() if t is not None]
    out = {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50), "served": len(per),
           "per_request": {i: {"ttft_s": a, "tpot_s": b} for i, (a, b) in sorted(per.items())}}
    if errors is not None:
        out["errors"] = errors
    return out


def run_sim(replay, max_tokens: int, cost: CostModel, block_tokens: int) -> dict:
    reqs = [SimRequest(at, len(p), max_tokens,
                       tuple(10_000 * j + i for i in range(-(-len(p) // block_tokens))))
            for j, (at, p) in enumerate(replay)]
    sim = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="locality",
                                         block_tokens=block_tokens, slo_ttft_s=1e9,
                                         slo_tpot_s=1e9, shed_on_slo=False,
                                         shared_host=True))
    sim.run(reqs)
    return _summary({j: (t, sim.tpot_s.get(j) if max_tokens > 1 else None)
                     for j, t in sim.ttft_s.items() if j in sim.tpot_s})


def _calibration(engine: dict, threads: int, repeats: int) -> dict:
    from raypd.bench.engine import run_calibration
    return run_calibration(model=engine.get("model", "smollm2"), threads=threads,
                           dtype=engine.get("dtype", "auto"), repeats=repeats, device="cpu")


def calibrate(engine: dict, threads: int | None = None, repeats: int = 3) -> dict:
    """`raypd bench engine --calibration` figures for the workers' engine, measured here now,
    in a Ray task placed like the workers (num_cpus=0, `threads` torch threads): Ray's worker
    environment (OMP_NUM_THREADS=1 among others) made the same prefill ~15% slower than in a
    plain process on this machine, so a calibration outside it predicts the workers wrong.
    `threads` None: the workers' own (PDConfig.threads_per_actor)."""
    import ray

    from cluster.pd import PDConfig
    threads = threads or PDConfig().threads_per_actor
    return ray.get(ray.remote(num_cpus=0)(_calibration).remote(engine, threads, repeats))


def validate(cost: CostModel | None = None, num_requests: int = 12,
             prompt_lens=(128, 384, 768), max_tokens: int = 16, load: float = 0.6,
             gap_s: float | None = None, engine: dict | None = None, rounds: int = 2) -> dict:
    """`cost` None: calibrate here first (see the module doc). The mean arrival gap is
    `gap_s` or else the cost model's mean prefill time over `prompt_lens` divided by `load`
    (the prefill worker's utilization: queueing without an ever-growing queue, whose TTFT
    would only say how long the replay ran)."""
    import ray
    engine = engine or {"block_size": 16}
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return _validate(cost, num_requests, prompt_lens, max_tokens, load, gap_s, engine,
                         rounds)
    finally:
        if started:
            ray.shutdown()


def _anchor(cost: CostModel, probe: dict) -> dict:
    """The calibration's level re-anchored to the real workers' speed seconds before the
    replay (the machine drifts 10-25% in the minutes the calibration takes): prefill seconds
    scaled so that the probe's prefill alone takes what it took, decode seconds so that a step
    of the probe's sequence (at its mean context) takes its mean gap outside the prefill. The
    shapes (vs length, batch, context) stay the calibration's. The link's latency: what the
    probe's prefills alone spent around their compute before their first token, less the
    link's transfer of their KV (the simulator's only cost between a prefill's end and its
    first token)."""
    kp = probe["prefill_compute_s_alone"] / cost.prefill.prefill_s(probe["prefill_tokens"])
    gap, ctx = probe["decode_gap_s_outside"], probe["context"] + probe["decode_tokens"] // 2
    kd = gap / cost.decode.step_s(1, ctx) if gap else 1.0
    transfer_s = probe["prefill_tokens"] * cost.kv_bytes_per_token / (cost.link.gbps * 1e9)
    latency = max(0.0, probe["handoff_s_alone"] - transfer_s)
    return {"prefill_k": kp, "decode_k": kd, "link_latency_s": latency,
            "from": "probe_shared_host's alone figures"}


def _validate(cost: CostModel | None, num_requests: int, prompt_lens, max_tokens: int,
              load: float, gap_s: float | None, engine: dict, rounds: int) -> dict:
    calibration = None
    if cost is None:
        calibration = calibrate(engine)
        cost = cpu_cost_model(calibration)
    derived = gap_s is None
    if derived:
        mean_prefill = sum(cost.prefill.prefill_s(n) for n in prompt_lens) / len(prompt_lens)
        gap_s = mean_prefill / load
    replay = replay_requests(num_requests, tuple(prompt_lens), gap_s)
    real = run_real(replay, max_tokens, engine, cost, rounds)
    probe = real["shared_host_probe"]
    anchor = _anchor(cost, probe)
    cost = dataclasses.replace(cost.scaled(anchor["prefill_k"], anchor["decode_k"]),
                               shared_host=SharedHost(probe["prefill_x"], probe["decode_x"]),
                               link=dataclasses.replace(cost.link,
                                                        latency_s=anchor["link_latency_s"]))
    sim = run_sim(replay, max_tokens, cost, engine.get("block_size", 16))
    errors = {k: abs(sim[k] - real[k]) / real[k] if real[k] else None for k in METRICS}
    known = [e for e in errors.values() if e is not None]
    return {"label": "cpu-measured (real) vs simulated cpu-here", "cost_model": cost.label,
            "calibration": calibration or "given (--engine-json)",
            "cost_model_fit": {"prefill": asdict(cost.prefill), "decode": asdict(cost.decode),
                               "link": asdict(cost.link),
                               "shared_host": asdict(cost.shared_host)},
            "replay": {"requests": num_requests, "prompt_lens": list(prompt_lens),
                       "load": load if derived else None,
                       "max_tokens": max_tokens, "gap_s": gap_s, "engine": engine},
            "anchor": anchor, "real": real, "sim": sim, "relative_errors": errors,
            "sim_vs_real_error": max(known) if known else None,
            "real_round_spread": real["round_spread"],
            "within_25pct": bool(known) and max(known) <= 0.25}
