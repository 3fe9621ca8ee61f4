"""Routing simulator without a model: replays a workload through the real prefix index and
policies against prefill workers that each hold a real `BlockPool` and schedule like the
engine: every step batches the waiting requests first come, first served, up to the token
budget (the last one chunked).

What the policies see is exactly what the live router sees: each simulated worker produces the
same `LoadReport` a live worker does (queue in tokens and in seconds by its own fitted speed,
batched into steps as it batches them, the prefill fit made by `protocol.step_rates.StepRates`
from the steps it ran less their adapter loads, resident adapters and their measured load
time, KV events), as of its last published step, delivered to the
router every `report_interval_s` (the live reporter's interval) after `report_rpc_s`. The router
turns reports into WorkerStates with the live code (router/worker_view.py) and counts its own
decisions between reports the same way. The hidden cost model (raypd/sim/cost_model.py) only
charges time; nothing of it, and nothing of the workers' true state, reaches a policy.

A worker publishes (as the live loop does) after every step and when a request wakes it from
idle; a request that arrives while it is busy shows up at the end of the running step. The
pool caches what is computed, when it is computed, as the engine does: a request takes its
prefix hit when a step first schedules it (the engine matches at admission), from blocks that
earlier steps computed; the blocks a step computes are cached at its end, and their KV events
go out with that step's publish. So a request routed behind a prefix that is still queued or
being computed on the same worker hits it only if it is admitted after the step that
computed it, as in the live engine; `locality`'s credit for its own in-flight decisions is
worth exactly that here too. A waiting request's hit is unknown to its worker (its report
counts the whole prompt as queued, as a live worker's does).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from kvcache.block_pool import BlockPool
from kvcache.events import BlockRemoved, BlockStored, KVEvent
from kvcache.hashing import BlockHash, CacheNamespace, hash_block
from protocol.errors import RoutingRejected
from protocol.messages import LoadReport
from protocol.step_rates import StepRates
from raypd.replay.mooncake import TRACE_MODEL_ID, WorkloadRequest, scaled_tokens
from raypd.sim.cost_model import CostModel, HostSlowdown, PrefillCost
from router.percentiles import percentile
from router.policies import BasePolicy, Locality, RoutingRequest, WorkerState, make_policy
from router.prefix_index import ApproxPrefixIndex, PrefixIndex
from router.worker_view import REPORT_INTERVAL_S, apply_load_report, note_prefill


class SimRequest(NamedTuple):
    """One request in block terms: `hash_ids[i]` names the content of block i (equal leading
    ids under the same namespace = a shared prefix)."""

    timestamp_s: float
    num_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    lora: str = ""
    tenant: str = ""


def as_sim_requests(requests: Sequence[WorkloadRequest | SimRequest], block_tokens: int
                    ) -> list[SimRequest]:
    """Mooncake trace rows (512-token blocks scaled to `block_tokens`) or SimRequests as is."""
    out = []
    for r in requests:
        if isinstance(r, SimRequest):
            out.append(r)
        else:
            out.append(SimRequest(r.timestamp_s, scaled_tokens(r.input_length, block_tokens),
                                  r.output_length, tuple(r.hash_ids)))
    return out


@dataclass
class SimConfig:
    num_workers: int = 8
    capacity_blocks: int = 8192     # per prefill worker
    block_tokens: int = 512         # tokens a trace block stands for (input lengths scale too)
    prefill_tok_s: float = 8_000.0  # hidden cost model: rate at zero context
    overhead_s: float = 0.02        # hidden cost model: fixed cost of one prefill step
    attn_ctx_tokens: float = 32_768.0  # hidden: attention doubles a token's cost here; 0: off
    chunk_tokens: int = 8192        # chunked prefill: new tokens per step at most
    max_loras: int = 4              # adapter slots per worker (LRU)
    lora_load_s: float = 0.2        # hidden: seconds to load an adapter into a slot
    report_interval_s: float = REPORT_INTERVAL_S   # the live reporter's interval
    report_rpc_s: float = 0.002     # a report's age when it reaches the router (round trip)
    index_mode: str = "precise"     # "precise" (KV events) or "approx" (routing history + TTL)
    approx_ttl_s: float = 120.0
    tenant: str = ""
    ttft_slo_s: float | None = None  # goodput counts requests served within it (None: all)
    slo_scale: float | None = None   # or per request: within max(slo_floor_s, slo_scale x its
    slo_floor_s: float = 0.25        # prefill alone on an idle worker, no hit) (DistServe-like)
    shed_by_slo: bool = False        # each request carries its SLO to the policy (one that
    #                                  can shed, locality, rejects what it cannot meet: 429)

    def cost_model(self) -> CostModel:
        return CostModel(prefill=PrefillCost(self.prefill_tok_s, self.attn_ctx_tokens,
                                             self.overhead_s, self.chunk_tokens),
                         lora_load_s=self.lora_load_s)


def namespace_root(tenant: str = "", lora: str = "") -> BlockHash:
    return CacheNamespace(TRACE_MODEL_ID, tenant=tenant, lora_id=lora).root_hash()


def trace_hashes(requests: Sequence[WorkloadRequest | SimRequest],
                 tenant: str = "") -> list[list[BlockHash]]:
    """Chained 64-bit hashes of every request under its namespace (tenant, adapter)."""
    roots: dict[tuple[str, str], BlockHash] = {}
    out = []
    for r in requests:
        key = (getattr(r, "tenant", "") or tenant, getattr(r, "lora", ""))
        if key not in roots:
            roots[key] = namespace_root(*key)
        parent, hs = roots[key], []
        for x in r.hash_ids:
            parent = hash_block(parent, (x,))
            hs.append(parent)
        out.append(hs)
    return out


def ceiling_hit_rate(requests: Sequence[WorkloadRequest | SimRequest], block_tokens: int = 512,
                     hashes: Sequence[Sequence[BlockHash]] | None = None) -> float:
    """Hit rate of one worker with an infinite cache: every block seen before is a hit."""
    reqs = as_sim_requests(requests, block_tokens)
    hashes = trace_hashes(reqs) if hashes is None else hashes
    seen: set[BlockHash] = set()
    hit = total = 0
    for r, hs in zip(reqs, hashes, strict=True):
        k = 0
        for h in hs:
            if h not in seen:
                break
            k += 1
        seen.update(hs)
        hit += min(k * block_tokens, r.num_tokens)
        total += r.num_tokens
    return hit / total if total else 0.0


def cached_chain(pool: BlockPool, hashes: Sequence[BlockHash], hash_ids: Sequence[int],
                 root: BlockHash, n: int) -> list:
    """The leading blocks of a request (its first `n` at most) the pool holds cached, in order:
    what an engine's prefix match at admission finds (each confirmed by parent and content)."""
    hits, parent = [], root
    for i in range(n):
        block = pool.get_cached_block(hashes[i], parent, (hash_ids[i],))
        if block is None:
            break
        hits.append(block)
        parent = hashes[i]
    return hits


class _Job:
    """One request on a simulated worker, from its arrival until its last step was reported."""

    __slots__ = ("arrival", "start", "finish", "num_tokens", "uncached", "blocks", "pos",
                 "fed", "lora", "tag", "hashes", "root", "hash_ids", "in_pool")

    def __init__(self, arrival: float, num_tokens: int, hashes: Sequence[BlockHash],
                 root: BlockHash, hash_ids: Sequence[int], lora: str, tag: object) -> None:
        self.arrival, self.num_tokens, self.blocks = arrival, num_tokens, len(hashes)
        self.hashes, self.root, self.hash_ids = hashes, root, hash_ids
        self.uncached = num_tokens    # until admitted: its hit is not known yet
        self.start: float | None = None    # its first step's start (None: still waiting)
        self.finish: float | None = None   # its last step's end (None: not formed yet)
        self.pos = 0              # prompt tokens cached or computed by the steps formed so far
        self.fed = 0              # of `uncached`, computed by the steps already reported
        self.in_pool = 0          # its leading blocks in the pool (hit + computed)
        self.lora, self.tag = lora, tag


class SimWorker:
    """One simulated prefill worker: its block pool, waiting queue, adapter slots, and what it
    has published (the KV events, resident adapters and speeds a LoadReport carries).

    It schedules like the engine: each step takes the waiting requests first come, first
    served, up to the token budget (`chunk_tokens`: max_num_batched_tokens), the last one
    chunked; a request that arrives while a step runs waits for the next one. Steps are formed
    lazily (`advance`), since a step's batch is known only when it starts."""

    def __init__(self, worker_id: str, capacity_blocks: int, cost: CostModel,
                 max_loras: int, log_steps: bool = False, block_tokens: int = 512) -> None:
        self.worker_id = worker_id
        self.pool = BlockPool(capacity_blocks)
        self.block_tokens = block_tokens
        self.hits: list[tuple[object, int]] = []   # (tag, blocks its admission hit): statistics
        self.cost = cost
        self.max_loras = max_loras
        self.jobs: deque[_Job] = deque()      # arrived, not yet reported as done
        self.waiting: deque[_Job] = deque()   # not yet fully scheduled (FCFS)
        # formed, not reported: (start of its prefill compute, end, chunks, members)
        self.steps: deque[tuple[float, float, list, list]] = deque()
        self.step_log: list[tuple[float, float]] | None = [] if log_steps else None
        # a shared host's neighbour: (step start, its cost alone) -> its duration
        self.slowed: Callable[[float, float], float] | None = None
        self.free_at = 0.0
        # a shared host's: (time) -> its HostSlowdown then (staging and the pages the last
        # step's prompts send meanwhile); the last staging's tokens and their send window
        self.host_at: Callable[[float], HostSlowdown] | None = None
        self._sent, self._send_until = 0, -math.inf
        self.rates = StepRates()
        self.loras: OrderedDict[str, None] = OrderedDict()   # true LRU of resident adapters
        # to publish: (step end, the KV events the pool made in that step), in step order;
        # adapter changes in time order
        self._events: deque[tuple[float, list]] = deque()
        self._lora_changes: deque[tuple[float, tuple[str, ...], float]] = deque()
        self._done: deque[tuple[float, object]] = deque()    # (finish, tag) not yet handed on
        self._published_cached = 0
        self._published_loras: tuple[str, ...] = ()
        self._lora_loads: list[float] = []
        self._last_step_end = 0.0
        self._last_idle_start = -1.0
        self.computed_tokens = 0
        self.busy_s = 0.0
        self.lora_loads = 0

    # ---- the worker's side -------------------------------------------------------------------
    def serve(self, hashes: Sequence[BlockHash], root: BlockHash, hash_ids: Sequence[int],
              num_tokens: int, arrival: float, block_tokens: int, lora: str = "",
              tag: object = None) -> None:
        """Queue one request; its prefix hit is taken when a step first schedules it (`hits`
        has it then), its finish comes out of `advance` with `tag`."""
        self.block_tokens = block_tokens      # tokens a trace block stands for
        if not self.waiting and self.free_at <= arrival:
            self._last_idle_start = arrival              # a request wakes it: it publishes
        job = _Job(arrival, num_tokens, hashes, root, hash_ids, lora, tag)
        self.jobs.append(job)
        self.waiting.append(job)

    def _admit(self, job: _Job) -> None:
        """A step schedules `job` for the first time: its hit is the cached chain of blocks
        earlier steps computed (the engine's match at admission)."""
        pool = self.pool
        hits = cached_chain(pool, job.hashes, job.hash_ids, job.root,
                            min(job.blocks, pool.num_blocks))
        pool.touch(hits)
        pool.free(reversed(hits))
        k = len(hits)
        cached = min(k * self.block_tokens, job.num_tokens - 1)   # the last token is computed
        job.pos, job.in_pool, job.uncached = cached, k, job.num_tokens - cached
        self.hits.append((job.tag, k))
        self.computed_tokens += job.uncached

    def _cache_computed(self, job: _Job) -> None:
        """After a step: the job's blocks that are now computed enter the pool (all of them,
        a partial last one included, once its prompt is done; a prompt longer than the pool
        caches its head)."""
        n = min(job.blocks, self.pool.num_blocks)
        done = n if job.pos >= job.num_tokens else min(n, job.pos // self.block_tokens)
        a = job.in_pool
        if done <= a:
            return
        pool = self.pool
        new = pool.allocate(done - a)
        pool.cache_blocks(new, job.hashes[a:done], job.hashes[a - 1] if a else job.root,
                          [(x,) for x in job.hash_ids[a:done]])
        pool.free(reversed(new))
        job.in_pool = done

    def advance(self, t: float) -> list[tuple[float, object]]:
        """Form every step that starts by `t`; returns (finish, tag) of the requests whose
        prefill ended by `t`, in finish order."""
        budget0, waiting = self.cost.prefill.chunk_tokens, self.waiting
        while waiting:
            start = max(self.free_at, waiting[0].arrival)
            if start > t:
                break
            budget, chunks, members, load_s = budget0, [], [], 0.0
            for job in waiting:
                if job.arrival > start or budget <= 0:
                    break
                if job.start is None:
                    job.start = start
                    self._admit(job)
                    if job.lora:
                        load_s += self._use_lora(job.lora, start + load_s)
                c = min(budget, job.num_tokens - job.pos)
                chunks.append((c, job.pos))
                members.append((job, c))
                job.pos += c
                budget -= c
            pc = self.cost.prefill
            step_s = pc.step_s(chunks)
            if self._sent and self.host_at is not None and start < self._send_until:
                # the pages it sends meanwhile
                step_s += self.host_at(start).send_s_per_token * self._sent
            self._sent = 0
            if self.slowed is not None:
                step_s = self.slowed(start + load_s, step_s)
            end = start + load_s + step_s
            for job, _ in members:          # what the step computed is cached at its end
                self._cache_computed(job)
            self._events.append((end, self.pool.take_events()))
            # its prefill seconds, for the fit: the adapter loads are reported on their own
            self.steps.append((start + load_s, end, chunks, members))
            staged, sent = end, 0     # the loop stages what the step finished, in order
            sx = self.host_at(end).stage_x if self.host_at is not None else 1.0
            while waiting and waiting[0].pos >= waiting[0].num_tokens:
                job = waiting.popleft()
                staged += sx * pc.stage_s_per_token * job.num_tokens
                sent += job.num_tokens
                job.finish = staged
                self._done.append((staged, job.tag))
            if sent:
                self._sent = sent
                self._send_until = staged + self.cost.link.seconds(
                    sent * self.cost.kv_bytes_per_token)
            if self.step_log is not None:
                self.step_log.append((start, staged))
            self.busy_s += staged - start
            self.free_at = staged
        out = []
        while self._done and self._done[0][0] <= t:
            out.append(self._done.popleft())
        return out

    def finished_by(self, t: float) -> list[tuple[float, object]]:
        """(finish, tag) of the requests whose prefill ended by t, not yet handed on by
        `advance` (steps formed in the same call)."""
        return [x for x in self._done if x[0] <= t]

    def _use_lora(self, lora: str, at: float) -> float:
        """The adapter's slot (LRU); seconds to load it when it is not resident."""
        if lora in self.loras:
            self.loras.move_to_end(lora)
            return 0.0
        if len(self.loras) >= self.max_loras:
            self.loras.popitem(last=False)
        self.loras[lora] = None
        self.lora_loads += 1
        load_s = self.cost.lora_load_s
        self._lora_changes.append((at + load_s, tuple(self.loras), load_s))
        return load_s

    def report(self, at: float) -> LoadReport:
        """The LoadReport a live worker would answer at `at` (steps formed up to `at` by
        `advance`): its state as of its last publish (a step end, or a request waking it from
        idle) at or before `at`."""
        steps = self.steps
        while steps and steps[0][1] <= at:   # feed the steps that have ended to the fits
            begin, end, chunks, members = steps.popleft()
            self.rates.observe_prefill(end - begin, chunks)
            for job, c in members:
                job.fed += c
            self._last_step_end = end
        while self.jobs and self.jobs[0].finish is not None and self.jobs[0].finish <= at \
                and self.jobs[0].fed >= self.jobs[0].uncached:
            self.jobs.popleft()
        published = max(self._last_step_end, self._last_idle_start if
                        self._last_idle_start <= at else -1.0)
        events: list = []
        pe = self._events
        while pe and pe[0][0] <= published:
            for ev in pe.popleft()[1]:
                events.append(ev)
                self._published_cached += stored_delta(ev)
        pl = self._lora_changes
        while pl and pl[0][0] <= published:
            _, self._published_loras, load_s = pl.popleft()
            self._lora_loads.append(load_s)
        fit = self.rates.prefill_fit()
        queued = running = active = num = 0
        backlog = []
        for job in self.jobs:
            if job.arrival > published:
                break
            num += 1
            if job.start is not None and job.start <= published:   # admitted: hit known
                left = job.uncached - job.fed
                active += job.blocks
                running += left
            else:                   # waiting: the whole prompt, as a live worker reports it
                left = job.num_tokens
                queued += left
            backlog.append((job.num_tokens, job.num_tokens - left))
        queued_s = fit.backlog_s(backlog, self.cost.prefill.chunk_tokens) if fit else None
        loads = self._lora_loads
        return LoadReport(
            self.worker_id, queued_tokens=queued, running_tokens=running, num_requests=num,
            active_blocks=active, cached_blocks=self._published_cached,
            free_blocks=max(0, self.pool.num_blocks - active), total_blocks=self.pool.num_blocks,
            queued_s=queued_s, prefill_fit=fit,
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
            loras_resident=self._published_loras,
            lora_load_s=sum(loads) / len(loads) if loads else 0.0,
            lora_slots=self.max_loras, events=tuple(events), reported_at=published,
            age_s=max(0.0, at - published))   # as a live worker's: its snapshot's age


def stored_delta(ev: KVEvent) -> int:
    """How a KV event changes the count of cached blocks a worker has published."""
    if isinstance(ev, BlockStored):
        return len(ev.block_hashes)
    if isinstance(ev, BlockRemoved):
        return -len(ev.block_hashes)
    return 0


@dataclass
class ReportLog:
    """Every report the simulated router received, with the tick it arrived at (for tests)."""

    delivered: list[tuple[float, LoadReport]] = field(default_factory=list)
    keep: bool = False


class Simulator:
    """One replay: `cfg.num_workers` prefill workers, the router's index and view, one policy."""

    def __init__(self, policy: BasePolicy | str, cfg: SimConfig, keep_reports: bool = False
                 ) -> None:
        if cfg.num_workers <= 0 or cfg.capacity_blocks <= 0 or cfg.block_tokens <= 0:
            raise ValueError("num_workers, capacity_blocks and block_tokens must be > 0")
        if cfg.report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.cfg = cfg
        self.cost = cfg.cost_model()
        self.workers = [SimWorker(f"prefill-{i}", cfg.capacity_blocks, self.cost, cfg.max_loras,
                                  block_tokens=cfg.block_tokens)
                        for i in range(cfg.num_workers)]
        self.states = {w.worker_id: WorkerState(w.worker_id) for w in self.workers}
        self.log = ReportLog(keep=keep_reports)
        self._tick = -1
        self.precise = cfg.index_mode == "precise"
        if self.precise:
            self.index: PrefixIndex | ApproxPrefixIndex = PrefixIndex()
        elif cfg.index_mode == "approx":
            self.index = ApproxPrefixIndex(ttl_s=cfg.approx_ttl_s, clock=lambda: 0.0)
        else:
            raise ValueError(f"unknown index mode {cfg.index_mode!r}; valid: precise, approx")
        for w in self.workers:
            self.index.add_worker(w.worker_id)

    def ttft_slo(self, num_tokens: int) -> float:
        """The TTFT a request must meet to count in goodput (inf: no SLO)."""
        cfg = self.cfg
        if cfg.slo_scale is not None:
            return max(cfg.slo_floor_s, cfg.slo_scale * self.cost.prefill.prefill_s(num_tokens))
        return cfg.ttft_slo_s if cfg.ttft_slo_s is not None else float("inf")

    def deliver_reports(self, now: float) -> None:
        """The router's reporter: at the last tick <= now, every worker's report (as of
        tick - rpc) replaces its WorkerState and its KV events reach the index."""
        tick = int(now / self.cfg.report_interval_s)
        if tick <= self._tick:
            return
        self._tick = tick
        t = tick * self.cfg.report_interval_s
        for w in self.workers:
            rep = w.report(t - self.cfg.report_rpc_s)
            if self.precise:
                self.index.apply(w.worker_id, rep.events)
            apply_load_report(self.states[w.worker_id], rep, t - self.cfg.report_rpc_s)
            if self.log.keep:
                self.log.delivered.append((t, rep))

    def flush(self) -> None:
        """Let every worker finish and publish all its events (end of replay)."""
        for w in self.workers:
            w.advance(float("inf"))
            rep = w.report(float("inf"))
            if self.precise:
                self.index.apply(w.worker_id, rep.events)

    def run(self, requests: Sequence[WorkloadRequest | SimRequest],
            hashes: Sequence[Sequence[BlockHash]] | None = None,
            ceiling: float | None = None) -> dict:
        """Replay `requests` (sorted by arrival) and return the report dict."""
        cfg, index, precise, workers = self.cfg, self.index, self.precise, self.workers
        bt = cfg.block_tokens
        reqs = as_sim_requests(requests, bt)
        hashes = trace_hashes(reqs, cfg.tenant) if hashes is None else hashes
        if ceiling is None:
            ceiling = ceiling_hit_rate(reqs, bt, hashes)
        by_id = {w.worker_id: w for w in workers}
        roots: dict[tuple[str, str], BlockHash] = {}
        finish: dict[int, float] = {}
        good = 0
        hit_tokens = total_tokens = 0
        reasons: Counter[str] = Counter()
        rejected = 0
        def finished(done: list[tuple[float, object]]) -> None:
            for t, j in done:
                finish[j] = t

        for j, (r, hs) in enumerate(zip(reqs, hashes, strict=True)):
            now = r.timestamp_s
            for w in workers:                # the steps that have started by now
                finished(w.advance(now))
            self.deliver_reports(now)
            states = [self.states[w.worker_id] for w in workers]
            matches = index.match(hs) if precise else index.match(hs, now=now)
            req = RoutingRequest(str(j), hs, r.num_tokens, bt, r.tenant or cfg.tenant,
                                 r.output_tokens, arrival_s=now, lora=r.lora,
                                 ttft_slo_s=self.ttft_slo(r.num_tokens) if cfg.shed_by_slo
                                 else None)
            try:
                decision = self.policy.choose_prefill(req, states, matches)
            except RoutingRejected as e:
                rejected += 1
                reasons[e.reason] += 1
                continue
            reasons[decision.reason] += 1
            note_prefill(self.states[decision.worker_id], req, decision,
                         Locality.pooled_fit(states), now)
            w = by_id[decision.worker_id]
            key = (r.tenant or cfg.tenant, r.lora)
            root = roots.get(key) or roots.setdefault(key, namespace_root(*key))
            w.serve(hs, root, r.hash_ids, r.num_tokens, now, bt, r.lora, tag=j)
            finished(w.advance(now))
            if not precise:
                index.record(w.worker_id, hs, now=now)
            total_tokens += r.num_tokens
        for w in workers:
            finished(w.advance(float("inf")))
            hit_tokens += sum(min(k * bt, reqs[j].num_tokens) for j, k in w.hits)
        ttfts = []
        for j, t in sorted(finish.items()):
            r = reqs[j]
            ttfts.append(t - r.timestamp_s)
            good += t - r.timestamp_s <= self.ttft_slo(r.num_tokens)

        loads = [w.computed_tokens for w in workers]
        mean_load = sum(loads) / len(loads)
        hit_rate = hit_tokens / total_tokens if total_tokens else 0.0
        t0 = reqs[0].timestamp_s if reqs else 0.0
        span = (reqs[-1].timestamp_s - t0) if reqs else 0.0
        makespan = max(w.free_at for w in workers) - t0
        return {
            "policy": self.policy.name,
            "num_requests": len(reqs),
            "rejected": rejected,
            "hit_rate": hit_rate,
            "ceiling_hit_rate": ceiling,
            "hit_ratio_of_ceiling": hit_rate / ceiling if ceiling else 0.0,
            "max_over_mean_load": max(loads) / mean_load if mean_load else 1.0,
            "ttft_p50_s": percentile(ttfts, 50, 0.0),
            "ttft_p90_s": percentile(ttfts, 90, 0.0),
            "ttft_p99_s": percentile(ttfts, 99, 0.0),
            "ttft_mean_s": float(np.mean(ttfts)) if ttfts else 0.0,
            "slo_attainment": good / len(reqs) if reqs else 0.0,
            "goodput": good / span if span > 0 else float(good),
            "utilization": (sum(w.busy_s for w in workers) / (len(workers) * makespan)
                            if makespan > 0 else 0.0),
            "prefill_tokens_per_worker": loads,
            "lora_loads": sum(w.lora_loads for w in workers),
            "trace_span_s": span,
            "reasons": dict(reasons),
            "config": asdict(cfg),
        }


def simulate(requests: Sequence[WorkloadRequest | SimRequest], policy: BasePolicy | str,
             cfg: SimConfig, hashes: Sequence[Sequence[BlockHash]] | None = None,
             ceiling: float | None = None) -> dict:
    """Replay `requests` (sorted by arrival) under `policy`; the report dict (see Simulator)."""
    return Simulator(policy, cfg).run(requests, hashes, ceiling)
