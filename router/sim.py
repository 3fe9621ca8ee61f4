"""Routing simulator without a model: replays a Mooncake trace through the real prefix index and
policies against prefill workers that each hold an LRU cache of C blocks and serve a FIFO queue.

Service-time model (the same for every policy):
    service = overhead_s + prefill_seconds(prompt, cached, prefill_tok_s, attn_ctx_tokens)
i.e. a fixed cost per request plus the uncached tokens at `prefill_tok_s`, each token's cost
growing by 1 / attn_ctx_tokens per token of context it attends to (attention). One request at a
time per worker; TTFT = prefill finish - arrival (decode and KV transfer are not simulated).

Each worker's cache is a real `kvcache.block_pool.BlockPool`: hits touch cached blocks, misses
allocate (LRU eviction of unreferenced blocks), computed blocks are cached, the request's blocks
are freed tail first. The pool's KV events reach the router's `PrefixIndex` when they would be
published: evictions when the request starts, stores when its prefill finishes. Since a worker
serves its queue in order, its cache sees operations in routing order, so a request's real hit
is known at routing time while the router only sees what has been published by then.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvcache.block_pool import BlockPool
from kvcache.hashing import BlockHash
from router.policies import (
    BasePolicy,
    RoutingRejected,
    RoutingRequest,
    WorkerState,
    make_policy,
    prefill_seconds,
)
from router.prefix_index import ApproxPrefixIndex, PrefixIndex
from router.trace import TraceRequest, chained_hashes, namespace_root, scaled_tokens


@dataclass
class SimConfig:
    num_workers: int = 8
    capacity_blocks: int = 8192     # per prefill worker
    block_tokens: int = 512         # tokens a trace block stands for (input lengths scale too)
    prefill_tok_s: float = 8_000.0  # per worker, at zero context
    overhead_s: float = 0.02        # per prefill request
    attn_ctx_tokens: float = 32_768.0  # attention doubles a token's cost at this context; 0: off
    index_mode: str = "precise"     # "precise" (KV events) or "approx" (routing history + TTL)
    approx_ttl_s: float = 120.0
    tenant: str = ""


class _Worker:
    """One simulated prefill worker: its block pool, FIFO of in-flight requests, unpublished
    KV events, and counters."""

    def __init__(self, worker_id: str, capacity_blocks: int) -> None:
        self.worker_id = worker_id
        self.pool = BlockPool(capacity_blocks)
        self.inflight: deque[tuple[float, float, int, int]] = deque()  # start, finish, u, blocks
        self.sum_tokens = 0
        self.sum_blocks = 0
        self.free_at = 0.0
        self.pending: deque[tuple[float, list]] = deque()  # (publish time, events)
        self.computed_tokens = 0
        self.busy_s = 0.0

    def advance(self, now: float, index: PrefixIndex | None) -> None:
        """Retire finished requests and publish the events due by `now`."""
        q = self.inflight
        while q and q[0][1] <= now:
            _, _, u, b = q.popleft()
            self.sum_tokens -= u
            self.sum_blocks -= b
        p = self.pending
        while p and p[0][0] <= now:
            _, events = p.popleft()
            if index is not None:
                index.apply(self.worker_id, events)

    def state(self, now: float, cfg: SimConfig, index) -> WorkerState:
        running = 0
        if self.inflight:
            start, finish, u, _ = self.inflight[0]
            if start <= now and finish > start:
                running = int(u * (finish - now) / (finish - start))
        return WorkerState(
            worker_id=self.worker_id,
            queued_tokens=self.sum_tokens - (self.inflight[0][2] if self.inflight else 0),
            running_tokens=running,
            num_requests=len(self.inflight),
            active_blocks=self.sum_blocks,
            cached_blocks=index.num_blocks(self.worker_id),
            free_blocks=self.pool.num_free_blocks,
            total_blocks=self.pool.num_blocks,
            prefill_tok_s=cfg.prefill_tok_s,
            prefill_ctx_tokens=cfg.attn_ctx_tokens,
            overhead_s=cfg.overhead_s,
            backlog_s=max(0.0, self.free_at - now),
        )

    def serve(self, hashes: Sequence[BlockHash], root: BlockHash, hash_ids: Sequence[int],
              num_tokens: int, arrival: float, cfg: SimConfig) -> tuple[int, float]:
        """Queue one request: returns (cached blocks it hits, prefill finish time)."""
        pool = self.pool
        n = min(len(hashes), pool.num_blocks)  # a prompt longer than the cache caches its head
        hits = []
        parent = root
        for i in range(n):
            block = pool.get_cached_block(hashes[i], parent, (hash_ids[i],))
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        k = len(hits)
        pool.touch(hits)
        new = pool.allocate(n - k)
        evicted = pool.take_events()
        pool.cache_blocks(new, hashes[k:n], parent, [(x,) for x in hash_ids[k:n]])
        stored = pool.take_events()
        pool.free(reversed(hits + new))

        cached = min(k * cfg.block_tokens, num_tokens)
        u = max(num_tokens - cached, 1)
        service = cfg.overhead_s + prefill_seconds(num_tokens, num_tokens - u, cfg.prefill_tok_s,
                                                   cfg.attn_ctx_tokens)
        start = max(arrival, self.free_at)
        finish = start + service
        self.free_at = finish
        self.inflight.append((start, finish, u, len(hashes)))
        self.sum_tokens += u
        self.sum_blocks += len(hashes)
        self.computed_tokens += u
        self.busy_s += service
        if evicted:
            self.pending.append((start, evicted))
        if stored:
            self.pending.append((finish, stored))
        return k, finish


def trace_hashes(requests: Sequence[TraceRequest], tenant: str = "") -> list[list[BlockHash]]:
    """Chained 64-bit hashes of every request (compute once, replay under many policies)."""
    root = namespace_root(tenant)
    return [chained_hashes(r.hash_ids, root) for r in requests]


def ceiling_hit_rate(requests: Sequence[TraceRequest], block_tokens: int = 512,
                     hashes: Sequence[Sequence[BlockHash]] | None = None) -> float:
    """Hit rate of one worker with an infinite cache: every block seen before is a hit."""
    hashes = trace_hashes(requests) if hashes is None else hashes
    seen: set[BlockHash] = set()
    hit = total = 0
    for r, hs in zip(requests, hashes, strict=True):
        tokens = scaled_tokens(r.input_length, block_tokens)
        k = 0
        for h in hs:
            if h not in seen:
                break
            k += 1
        seen.update(hs)
        hit += min(k * block_tokens, tokens)
        total += tokens
    return hit / total if total else 0.0


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


class Simulator:
    """One replay: `cfg.num_workers` prefill workers, the router's index, one policy."""

    def __init__(self, policy: BasePolicy | str, cfg: SimConfig) -> None:
        if cfg.num_workers <= 0 or cfg.capacity_blocks <= 0 or cfg.block_tokens <= 0:
            raise ValueError("num_workers, capacity_blocks and block_tokens must be > 0")
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.cfg = cfg
        self.root = namespace_root(cfg.tenant)
        self.workers = [_Worker(f"prefill-{i}", cfg.capacity_blocks)
                        for i in range(cfg.num_workers)]
        self.precise = cfg.index_mode == "precise"
        if self.precise:
            self.index: PrefixIndex | ApproxPrefixIndex = PrefixIndex()
        elif cfg.index_mode == "approx":
            self.index = ApproxPrefixIndex(ttl_s=cfg.approx_ttl_s, clock=lambda: 0.0)
        else:
            raise ValueError(f"unknown index mode {cfg.index_mode!r}; valid: precise, approx")
        for w in self.workers:
            self.index.add_worker(w.worker_id)

    def flush(self) -> None:
        """Let every worker finish and publish all its events (end of replay)."""
        for w in self.workers:
            w.advance(float("inf"), self.index if self.precise else None)

    def run(self, requests: Sequence[TraceRequest],
            hashes: Sequence[Sequence[BlockHash]] | None = None,
            ceiling: float | None = None) -> dict:
        """Replay `requests` (sorted by arrival) and return the report dict."""
        cfg, index, precise, workers = self.cfg, self.index, self.precise, self.workers
        hashes = trace_hashes(requests, cfg.tenant) if hashes is None else hashes
        if ceiling is None:
            ceiling = ceiling_hit_rate(requests, cfg.block_tokens, hashes)
        by_id = {w.worker_id: w for w in workers}
        ttfts: list[float] = []
        hit_tokens = total_tokens = 0
        reasons: Counter[str] = Counter()
        rejected = 0
        bt = cfg.block_tokens
        for j, (r, hs) in enumerate(zip(requests, hashes, strict=True)):
            now = r.timestamp_s
            for w in workers:
                w.advance(now, index if precise else None)
            states = [w.state(now, cfg, index) for w in workers]
            matches = index.match(hs) if precise else index.match(hs, now=now)
            num_tokens = scaled_tokens(r.input_length, bt)
            req = RoutingRequest(str(j), hs, num_tokens, bt, cfg.tenant, r.output_length,
                                 arrival_s=now)
            try:
                decision = self.policy.choose_prefill(req, states, matches)
            except RoutingRejected as e:
                rejected += 1
                reasons[e.reason] += 1
                continue
            reasons[decision.reason] += 1
            w = by_id[decision.worker_id]
            k, finish = w.serve(hs, self.root, r.hash_ids, num_tokens, now, cfg)
            if not precise:
                index.record(w.worker_id, hs, now=now)
            hit_tokens += min(k * bt, num_tokens)
            total_tokens += num_tokens
            ttfts.append(finish - now)

        loads = [w.computed_tokens for w in workers]
        mean_load = sum(loads) / len(loads)
        hit_rate = hit_tokens / total_tokens if total_tokens else 0.0
        t0 = requests[0].timestamp_s if requests else 0.0
        makespan = max(w.free_at for w in workers) - t0
        return {
            "policy": self.policy.name,
            "num_requests": len(requests),
            "rejected": rejected,
            "hit_rate": hit_rate,
            "ceiling_hit_rate": ceiling,
            "hit_ratio_of_ceiling": hit_rate / ceiling if ceiling else 0.0,
            "max_over_mean_load": max(loads) / mean_load if mean_load else 1.0,
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p90_s": _pct(ttfts, 90),
            "ttft_p99_s": _pct(ttfts, 99),
            "ttft_mean_s": float(np.mean(ttfts)) if ttfts else 0.0,
            "utilization": (sum(w.busy_s for w in workers) / (len(workers) * makespan)
                            if makespan > 0 else 0.0),
            "prefill_tokens_per_worker": loads,
            "trace_span_s": (requests[-1].timestamp_s - t0) if requests else 0.0,
            "reasons": dict(reasons),
            "config": asdict(cfg),
        }


def simulate(requests: Sequence[TraceRequest], policy: BasePolicy | str, cfg: SimConfig,
             hashes: Sequence[Sequence[BlockHash]] | None = None,
             ceiling: float | None = None) -> dict:
    """Replay `requests` (sorted by arrival) under `policy`; the report dict (see Simulator)."""
    return Simulator(policy, cfg).run(requests, hashes, ceiling)
