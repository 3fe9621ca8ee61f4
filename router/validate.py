"""`raypd simulate --validate`: a short replay on a real 1P+1D cluster here and the same replay
in the cluster simulator with the cpu-here cost model; `sim_vs_real_error` is the largest
relative error of TTFT p50, TTFT p99 and TPOT p50 (simulator against real).

The replay: `num_requests` prompts of random token ids (lengths cycling over `prompt_lens`),
`max_tokens` each (ignore_eos), arrivals every `gap_s`; the real side measures TTFT at the
client (first streamed token) and TPOT from the stream's end. Timings here share the machine
with whatever else runs on it: both sides are `cpu-measured`, the error says how well the
simulator's cost model (from `raypd bench engine` JSON) predicts this machine now."""

from __future__ import annotations

import random
import threading
import time

import numpy as np

from router.cluster_sim import ClusterConfig, ClusterSim
from router.cost_model import CostModel
from router.sim import SimRequest


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def replay_requests(num_requests: int, prompt_lens: tuple[int, ...], gap_s: float,
                    seed: int = 0, vocab: int = 49152) -> list[tuple[float, list[int]]]:
    rng = random.Random(seed)
    return [(j * gap_s, [rng.randrange(100, vocab) for _ in range(prompt_lens[j % len(
        prompt_lens)])]) for j in range(num_requests)]


def run_real(replay, max_tokens: int, engine: dict) -> dict:
    import ray

    from cluster.pd import PDCluster, PDConfig
    from workers.request import SamplingParams

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    cluster = PDCluster(PDConfig(engine=engine, num_prefill=1, num_decode=1))
    ttft, tpot, errors = [], [], []
    try:   # warm-up: one request, not measured
        cluster.run_request(list(replay[0][1][:64]), SamplingParams(max_tokens=4,
                                                                    ignore_eos=True))
        t0 = time.perf_counter()

        def one(at, prompt):
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            start = time.perf_counter()
            first = []
            try:
                res = cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True),
                                          on_delta=lambda d: first or first.append(
                                              time.perf_counter()))
            except Exception as e:   # noqa: BLE001 - counted, reported
                errors.append(str(e))
                return
            end = time.perf_counter()
            ttft.append(first[0] - start)
            n = len(res["token_ids"])
            if n > 1:
                tpot.append((end - first[0]) / (n - 1))
        threads = [threading.Thread(target=one, args=r) for r in replay]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()
    return {"ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "served": len(ttft), "errors": errors}


def run_sim(replay, max_tokens: int, cost: CostModel, block_tokens: int) -> dict:
    reqs = [SimRequest(at, len(p), max_tokens,
                       tuple(10_000 * j + i for i in range(-(-len(p) // block_tokens))))
            for j, (at, p) in enumerate(replay)]
    res = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="locality",
                                         block_tokens=block_tokens, slo_ttft_s=1e9,
                                         slo_tpot_s=1e9, shed_on_slo=False)).run(reqs)
    return {k: res[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "served")}


def validate(cost: CostModel, num_requests: int = 8, prompt_lens=(128, 384, 768),
             max_tokens: int = 16, gap_s: float = 2.0, engine: dict | None = None) -> dict:
    engine = engine or {"block_size": 16}
    replay = replay_requests(num_requests, tuple(prompt_lens), gap_s)
    sim = run_sim(replay, max_tokens, cost, engine.get("block_size", 16))
    real = run_real(replay, max_tokens, engine)
    errors = {k: abs(sim[k] - real[k]) / real[k] if real[k] else None
              for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s")}
    known = [e for e in errors.values() if e is not None]
    return {"label": "cpu-measured (real) vs simulated cpu-here", "cost_model": cost.label,
            "replay": {"requests": num_requests, "prompt_lens": list(prompt_lens),
                       "max_tokens": max_tokens, "gap_s": gap_s, "engine": engine},
            "real": real, "sim": sim, "relative_errors": errors,
            "sim_vs_real_error": max(known) if known else None,
            "within_25pct": bool(known) and max(known) <= 0.25}
