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
after one warm-up request of each prompt length through both workers. Both sides are
`cpu-measured`; `per_request` gives each request's figures on both sides (and its real stage
seconds), to see where they part."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict

from router.cluster_sim import ClusterConfig, ClusterSim
from router.cost_model import CostModel, cpu_cost_model
from router.report import percentile
from router.sim import SimRequest


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


def run_real(replay, max_tokens: int, engine: dict) -> dict:
    """The replay on a real 1P+1D cluster (Ray already started: `validate`)."""
    from cluster.pd import PDCluster, PDConfig
    from workers.request import SamplingParams

    cluster = PDCluster(PDConfig(engine=engine, num_prefill=1, num_decode=1))
    per: dict[int, tuple[float, float | None]] = {}
    errors: list[str] = []
    stages: dict[int, dict[str, float]] = {}
    try:   # warm-up, not measured: one request of each prompt length through both workers
        rng = random.Random(1)
        for n in sorted({len(p) for _, p in replay}):
            cluster.run_request([rng.randrange(100, 30000) for _ in range(n)],
                                SamplingParams(max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()

        def one(idx, at, prompt):
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            start = time.perf_counter()
            token_times: list[float] = []     # arrival of each delta that carries tokens

            def on_delta(delta: dict) -> None:
                if delta["token_ids"]:
                    token_times.append(time.perf_counter())
            try:
                res = cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True),
                                          request_id=f"validate-{idx}", on_delta=on_delta)
            except Exception as e:   # noqa: BLE001 - counted, reported
                errors.append(str(e))
                return
            n = len(res["token_ids"])   # TTFT: first token; TPOT: first -> last token
            per[idx] = (token_times[0] - start,
                        (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None)
        threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(replay)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for idx in per:      # where each request's time went (router/request_traces.py)
            trace = cluster.orchestrator.traces.get(f"validate-{idx}")
            stages[idx] = trace.stage_seconds() if trace is not None else {}
    finally:
        cluster.shutdown()
    out = _summary(per, errors)
    for idx, st in stages.items():
        out["per_request"][idx]["stage_s"] = st
    return out


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
                                         slo_tpot_s=1e9, shed_on_slo=False))
    sim.run(reqs)
    return _summary({j: (t, sim.tpot_s.get(j) if max_tokens > 1 else None)
                     for j, t in sim.ttft_s.items() if j in sim.tpot_s})


def _calibration(engine: dict, threads: int, repeats: int) -> dict:
    from cluster.bench_engine import run_calibration
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
             gap_s: float | None = None, engine: dict | None = None) -> dict:
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
        return _validate(cost, num_requests, prompt_lens, max_tokens, load, gap_s, engine)
    finally:
        if started:
            ray.shutdown()


def _validate(cost: CostModel | None, num_requests: int, prompt_lens, max_tokens: int,
              load: float, gap_s: float | None, engine: dict) -> dict:
    calibration = None
    if cost is None:
        calibration = calibrate(engine)
        cost = cpu_cost_model(calibration)
    derived = gap_s is None
    if derived:
        mean_prefill = sum(cost.prefill.prefill_s(n) for n in prompt_lens) / len(prompt_lens)
        gap_s = mean_prefill / load
    replay = replay_requests(num_requests, tuple(prompt_lens), gap_s)
    sim = run_sim(replay, max_tokens, cost, engine.get("block_size", 16))
    real = run_real(replay, max_tokens, engine)
    errors = {k: abs(sim[k] - real[k]) / real[k] if real[k] else None
              for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")}
    known = [e for e in errors.values() if e is not None]
    return {"label": "cpu-measured (real) vs simulated cpu-here", "cost_model": cost.label,
            "calibration": calibration or "given (--engine-json)",
            "cost_model_fit": {"prefill": asdict(cost.prefill), "decode": asdict(cost.decode),
                               "link": asdict(cost.link)},
            "replay": {"requests": num_requests, "prompt_lens": list(prompt_lens),
                       "load": load if derived else None,
                       "max_tokens": max_tokens, "gap_s": gap_s, "engine": engine},
            "real": real, "sim": sim, "relative_errors": errors,
            "sim_vs_real_error": max(known) if known else None,
            "within_25pct": bool(known) and max(known) <= 0.25}
