"""Routing benchmark: decision latency with 100,000 blocks indexed, and every policy side by
side at 4, 8 and 16 prefill workers on the shared Mooncake trace (router/sim.py)."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import numpy as np

from kvcache.events import BlockStored
from kvcache.hashing import CacheNamespace, hash_block
from router.policies import POLICIES, RoutingRequest, WorkerState, make_policy
from router.prefix_index import PrefixIndex
from router.sim import SimConfig, ceiling_hit_rate, simulate, trace_hashes
from router.trace import default_trace_path, load_trace

WORKER_COUNTS = (4, 8, 16)
QUICK_REQUESTS = 1000
BENCH_CONFIG = SimConfig()  # capacity 8192 blocks / worker, 8k tok/s, 20 ms, 32k-token attention


def decision_latency(num_blocks: int = 100_000, num_workers: int = 8, num_decisions: int = 5000,
                     chain_len: int = 50, block_size: int = 512, seed: int = 0) -> dict:
    """Microseconds per `locality` decision (index lookup + policy) with `num_blocks` distinct
    block hashes indexed: chains of `chain_len` blocks, each held by one to three workers;
    requests reuse a random prefix of a random chain and add new blocks."""
    rng = random.Random(seed)
    root = CacheNamespace("bench-model").root_hash()
    workers = [f"prefill-{i}" for i in range(num_workers)]
    index = PrefixIndex()
    chains: list[list[int]] = []
    for c in range(num_blocks // chain_len):
        parent, chain = root, []
        for i in range(chain_len):
            parent = hash_block(parent, (c, i))
            chain.append(parent)
        chains.append(chain)
        for w in rng.sample(workers, rng.randint(1, 3)):
            index.apply(w, [BlockStored(tuple(chain), root, chain_len * block_size)])
    requests = []
    for j in range(num_decisions):
        chain = rng.choice(chains)
        shared = chain[:rng.randint(0, chain_len)]
        parent = shared[-1] if shared else root
        extra = []
        for i in range(rng.randint(1, 40)):
            parent = hash_block(parent, (-1, j, i))
            extra.append(parent)
        hashes = shared + extra
        requests.append(RoutingRequest(str(j), hashes, len(hashes) * block_size - 100,
                                       block_size, arrival_s=j * 0.25))
    states = [WorkerState(w, queued_tokens=rng.randint(0, 200_000), running_tokens=4096,
                          num_requests=rng.randint(0, 20), cached_blocks=index.num_blocks(w),
                          prefill_tok_s=8000.0, prefill_ctx_tokens=32768.0, overhead_s=0.02)
              for w in workers]
    policy = make_policy("locality")
    times = []
    clock = time.perf_counter_ns
    for req in requests:
        t0 = clock()
        matches = index.match(req.block_hashes)
        policy.choose_prefill(req, states, matches)
        times.append(clock() - t0)
    us = np.asarray(times[len(times) // 10:]) / 1000.0  # first 10%: warm-up
    return {"decision_us_p50": float(np.percentile(us, 50)),
            "decision_us_p99": float(np.percentile(us, 99)),
            "blocks_indexed": len(index), "workers": num_workers,
            "mean_request_blocks": float(np.mean([r.num_blocks for r in requests]))}


def run_routing_bench(trace_path: str | os.PathLike | None = None, quick: bool = False,
                      config: SimConfig = BENCH_CONFIG,
                      worker_counts: tuple[int, ...] = WORKER_COUNTS) -> dict:
    """The whole benchmark as a dict: decision latency, then `policies[name][str(workers)]`."""
    t_start = time.perf_counter()
    path = Path(trace_path) if trace_path is not None else default_trace_path()
    requests = load_trace(path, limit=QUICK_REQUESTS if quick else None)
    hashes = trace_hashes(requests, config.tenant)
    ceiling = ceiling_hit_rate(requests, config.block_tokens, hashes)
    latency = decision_latency(num_decisions=2000 if quick else 5000)
    policies: dict[str, dict[str, dict]] = {}
    for name in POLICIES:
        policies[name] = {}
        for n in worker_counts:
            cfg = dataclasses.replace(config, num_workers=n)
            r = simulate(requests, make_policy(name), cfg, hashes, ceiling)
            policies[name][str(n)] = {k: r[k] for k in (
                "hit_ratio_of_ceiling", "max_over_mean_load", "ttft_p99_s", "ttft_p50_s",
                "hit_rate", "utilization", "rejected")}
    out = {
        "trace": str(path),
        "num_requests": len(requests),
        "ceiling_hit_rate": ceiling,
        "decision_us_p50": latency["decision_us_p50"],
        "decision_us_p99": latency["decision_us_p99"],
        "decision": latency,
        "sim_config": {k: v for k, v in dataclasses.asdict(config).items()
                       if k != "num_workers"},
        "policies": policies,
    }
    if "8" in policies.get("locality", {}):
        loc = policies["locality"]["8"]
        out["targets"] = {
            "locality_8_hit_ratio_of_ceiling_ge_0.9": loc["hit_ratio_of_ceiling"] >= 0.9,
            "locality_8_max_over_mean_load_le_1.25": loc["max_over_mean_load"] <= 1.25,
            "locality_8_ttft_p99_beats_cache_aware":
                loc["ttft_p99_s"] < policies["cache_aware"]["8"]["ttft_p99_s"],
            "locality_8_ttft_p99_beats_kv_cost":
                loc["ttft_p99_s"] < policies["kv_cost"]["8"]["ttft_p99_s"],
            "decision_us_p99_le_1000": latency["decision_us_p99"] <= 1000.0,
        }
    out["elapsed_s"] = time.perf_counter() - t_start
    return out
