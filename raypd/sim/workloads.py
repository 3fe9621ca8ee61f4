"""Workloads for the routing benchmark, in block terms (raypd.sim.routing_sim.SimRequest): the shared
Mooncake trace, and synthesized ones with other reuse shapes so that a policy is never tuned on
one trace alone:

  mooncake            the shared synthetic trace (read from ../shared/traces, never copied)
  multi_turn          chat sessions whose every turn resends the growing history, over a pool
                      of shared system prompts
  tool_agent          agent loops: a long shared tool prompt per tool suite, then the task and
                      a scratchpad of observations that grows each step
  short_independent   many short prompts sharing only the chat template's first block
  multi_lora          requests spread (Zipf) over many LoRA adapters (each its own cache
                      namespace, loaded into a few adapter slots per worker), with per-adapter
                      shared prompts

Synthesized arrivals are Poisson, then rescaled so that the prefill work at the cache ceiling
(under the cost model the simulation runs, adapter loads not counted) would keep TARGET_WORKERS
workers busy TARGET_UTILIZATION of the time; the same arrivals for every policy.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from raypd.replay.mooncake import default_trace_path, load_trace
from raypd.sim.cost_model import PrefillCost
from raypd.sim.routing_sim import SimRequest, as_sim_requests, ceiling_hit_rate

TARGET_WORKERS = 8
TARGET_UTILIZATION = 0.6


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[SimRequest]
    block_tokens: int
    capacity_tokens: int            # KV tokens one worker's prefix cache holds
    description: str

    def summary(self) -> dict:
        n = len(self.requests)
        span = self.requests[-1].timestamp_s - self.requests[0].timestamp_s if n else 0.0
        return {"description": self.description, "num_requests": n,
                "block_tokens": self.block_tokens, "capacity_tokens_per_worker":
                self.capacity_tokens, "span_s": span,
                "mean_input_tokens": sum(r.num_tokens for r in self.requests) / max(n, 1),
                "ceiling_hit_rate": ceiling_hit_rate(self.requests, self.block_tokens),
                "adapters": len({r.lora for r in self.requests if r.lora})}


def _ids(counter: list[int], n: int) -> tuple[int, ...]:
    start = counter[0]
    counter[0] += n
    return tuple(range(start, start + n))


DEFAULT_COST = PrefillCost()


def ceiling_work_s(reqs: list[SimRequest], block_tokens: int,
                   cost: PrefillCost = DEFAULT_COST) -> float:
    """Prefill seconds of the whole workload with an infinite cache (each request computes
    only what no earlier request had), under the default cost model."""
    seen: set[tuple] = set()
    total = 0.0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and (r.lora, r.hash_ids[:k + 1]) in seen:
            k += 1
        seen.update((r.lora, r.hash_ids[:i + 1]) for i in range(k, len(r.hash_ids)))
        total += cost.prefill_s(r.num_tokens, min(k * block_tokens, r.num_tokens - 1))
    return total


def _rescale(reqs: list[SimRequest], block_tokens: int,
             cost: PrefillCost = DEFAULT_COST) -> list[SimRequest]:
    """Sort by arrival and stretch time so that the prefill work at the cache ceiling (under
    `cost`) keeps TARGET_WORKERS busy TARGET_UTILIZATION of the time."""
    reqs.sort(key=lambda r: r.timestamp_s)
    span = ceiling_work_s(reqs, block_tokens, cost) / (TARGET_UTILIZATION * TARGET_WORKERS)
    t0, t1 = reqs[0].timestamp_s, reqs[-1].timestamp_s
    k = span / (t1 - t0) if t1 > t0 else 1.0
    return [r._replace(timestamp_s=(r.timestamp_s - t0) * k) for r in reqs]


def mooncake(limit: int | None = None, path=None) -> Workload:
    reqs = as_sim_requests(load_trace(path or default_trace_path(), limit=limit), 512)
    return Workload("mooncake", reqs, 512, 8192 * 512,
                    "shared Mooncake synthetic trace, arrivals as recorded")


def multi_turn(sessions: int = 600, seed: int = 1, bt: int = 64,
               cost: PrefillCost = DEFAULT_COST) -> Workload:
    rng = random.Random(seed)
    counter = [0]
    systems = [_ids(counter, rng.randint(8, 24)) for _ in range(8)]     # 0.5k-1.5k tokens
    reqs, t = [], 0.0
    for _ in range(sessions):
        t += rng.expovariate(1.0)
        history = systems[rng.randrange(len(systems))]
        turn_t = t
        for _ in range(rng.randint(2, 10)):
            history = history + _ids(counter, rng.randint(1, 4))         # user message
            reqs.append(SimRequest(turn_t, len(history) * bt - rng.randrange(bt), 200,
                                   history))
            history = history + _ids(counter, rng.randint(2, 8))         # assistant reply
            turn_t += rng.expovariate(1 / 8.0)                            # user think time
    return Workload("multi_turn", _rescale(reqs, bt, cost), bt, 1 << 18,
                    "chat sessions (2-10 turns) resending their growing history over 8 shared "
                    "system prompts")


def tool_agent(agents: int = 400, seed: int = 2, bt: int = 64,
               cost: PrefillCost = DEFAULT_COST) -> Workload:
    rng = random.Random(seed)
    counter = [0]
    suites = [_ids(counter, rng.randint(64, 128)) for _ in range(12)]    # 4k-8k-token tools
    reqs, t = [], 0.0
    for _ in range(agents):
        t += rng.expovariate(1.0)
        ctx = suites[min(int(rng.paretovariate(1.2)) - 1, len(suites) - 1)] + \
            _ids(counter, rng.randint(2, 6))                             # the task
        step_t = t
        for _ in range(rng.randint(3, 12)):
            reqs.append(SimRequest(step_t, len(ctx) * bt - rng.randrange(bt), 64, ctx))
            ctx = ctx + _ids(counter, rng.randint(1, 3)) + _ids(counter, rng.randint(2, 10))
            step_t += rng.uniform(0.2, 2.0)                               # the tool runs
    return Workload("tool_agent", _rescale(reqs, bt, cost), bt, 1 << 19,
                    "agent loops (3-12 steps) over 12 long shared tool prompts (Pareto "
                    "popularity), growing scratchpads")


def short_independent(n: int = 6000, seed: int = 3, bt: int = 64,
                      cost: PrefillCost = DEFAULT_COST) -> Workload:
    rng = random.Random(seed)
    counter = [0]
    header = _ids(counter, 1)                                            # chat template
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        ids = header + _ids(counter, rng.randint(1, 12))
        reqs.append(SimRequest(t, len(ids) * bt - rng.randrange(bt), 128, ids))
    return Workload("short_independent", _rescale(reqs, bt, cost), bt, 1 << 18,
                    "short unrelated prompts (64-832 tokens) sharing one template block")


def multi_lora(n: int = 4000, adapters: int = 16, seed: int = 4, bt: int = 64,
               cost: PrefillCost = DEFAULT_COST) -> Workload:
    rng = random.Random(seed)
    counter = [0]
    names = [f"adapter-{i}" for i in range(adapters)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(adapters)]
    prompts = {a: [_ids(counter, rng.randint(16, 48)) for _ in range(2)] for a in names}
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        a = rng.choices(names, weights)[0]
        ids = rng.choice(prompts[a]) + _ids(counter, rng.randint(1, 8))
        reqs.append(SimRequest(t, len(ids) * bt - rng.randrange(bt), 128, ids, lora=a))
    return Workload("multi_lora", _rescale(reqs, bt, cost), bt, 1 << 18,
                    f"{adapters} LoRA adapters (Zipf 1.1), 2 shared 1k-3k-token prompts each; "
                    "adapter slots per worker: the simulator's max_loras")


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mooncake": mooncake, "multi_turn": multi_turn, "tool_agent": tool_agent,
    "short_independent": short_independent, "multi_lora": multi_lora,
}


QUICK_SIZES = {"mooncake": 1000, "multi_turn": 150, "tool_agent": 100,
               "short_independent": 1500, "multi_lora": 1000}


def make_workloads(quick: bool = False, trace_path=None,
                   only: tuple[str, ...] | None = None, seed: int | None = None,
                   cost: PrefillCost = DEFAULT_COST) -> list[Workload]:
    """Every workload (or those named in `only`); `quick`: about a quarter of the requests;
    `seed`: the synthesized ones drawn with it instead of each one's own (the shared trace
    is what it is); `cost`: the cost model their arrivals are placed for."""
    names = only or tuple(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; valid: {', '.join(WORKLOADS)}")
    out = []
    for name in names:
        if name == "mooncake":
            out.append(mooncake(QUICK_SIZES[name] if quick else None, trace_path))
            continue
        args = (QUICK_SIZES[name],) if quick else ()
        out.append(WORKLOADS[name](*args, cost=cost,
                                   **({} if seed is None else {"seed": seed})))
    return out
