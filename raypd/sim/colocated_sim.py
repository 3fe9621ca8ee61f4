"""A colocated GPU: one engine that prefills and decodes, stepping as a chunked-prefill engine
does (vLLM v1, Sarathi-Serve, raypd's own engine): every step takes one token of each running
sequence first (at most `max_decode_batch`, oldest first; the others wait for a slot), then
fills what is left of the token budget with waiting prompts first come, first served, the last
one chunked. A step costs `CostModel.mixed_step_s` (decode-only steps are jumped over in runs
of equal steps between events).

KV: one BlockPool holds the prefix cache and the requests' KV. Admission reserves
ceil((prompt + max_tokens) / block) blocks as a count (`reserved`), never the true output
(the router does not know it); a request's prompt blocks come out of its reservation as hits
when its first step matches cached blocks, or as its steps compute them (then cached); the rest
stays reserved until its decode ends, when its blocks and what is left of its reservation are
released. Invariant: pool.num_free_blocks >= reserved, so `room()` = free - reserved is what a
new admission may take and a reserved block can always be made real.

What reaches the router is what a live worker publishes: the prefill fit from prefill-only
steps and the decode fit from decode-only steps (a mixed step feeds neither, as
protocol/step_rates.py's live fit does), the prompt queue as of the last step that ended by
the report's time, KV events of the steps that ended by then; the decode side reports its
current batch, context and room (as DecodeSim does).
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

from kvcache.block_pool import BlockPool, KVBlock
from kvcache.hashing import BlockHash
from kvcache.manager import cdiv
from protocol.messages import LoadReport
from protocol.step_rates import StepRates
from raypd.sim.cost_model import CostModel
from raypd.sim.routing_sim import cached_chain, stored_delta


def decode_steps(running: list, k: int) -> tuple[list, list]:
    """`k` decode steps of every running sequence (each has `left` tokens to go and `ctx`
    tokens held): (those still running, those done), in their order."""
    for s in running:
        s.left -= k
        s.ctx += k
    return [s for s in running if s.left > 0], [s for s in running if s.left <= 0]


class _Request:
    """One request on the GPU from its admission until its decode ends."""

    __slots__ = ("rid", "arrival", "num_tokens", "hashes", "root", "hash_ids", "left",
                 "reserved", "blocks", "pos", "fed", "uncached", "ctx", "first_s",
                 "prefilled_at")

    def __init__(self, rid: int, arrival: float, num_tokens: int, hashes, root: BlockHash,
                 hash_ids, output_tokens: int, reserved: int) -> None:
        self.rid, self.arrival, self.num_tokens = rid, arrival, num_tokens
        self.hashes, self.root, self.hash_ids = hashes, root, hash_ids
        self.left = output_tokens - 1      # decode steps after the first token
        self.reserved = reserved           # blocks still promised to it, not yet real
        self.blocks: list[KVBlock] = []    # its prompt blocks in the pool (held)
        self.pos: int | None = None        # prompt tokens cached or scheduled (None: waiting)
        self.fed = 0                       # of `uncached`, computed by published steps
        self.uncached = num_tokens         # until its first step: its hit is not known
        self.ctx = num_tokens
        self.first_s = math.nan
        self.prefilled_at: float | None = None


class _Step(NamedTuple):
    """`k` equal engine steps formed back to back (k > 1 only for decode-only runs)."""

    start: float
    end: float
    k: int
    chunks: list[tuple[int, int]]          # prefill (new tokens, tokens before)
    members: list[tuple[_Request, int]]
    batch: int                             # decode tokens a step
    ctx: int                               # their context at the first step
    events: list


class ColocatedGPU:
    """One GPU that prefills and decodes (module doc)."""

    def __init__(self, worker_id: str, cost: CostModel, capacity_blocks: int,
                 token_budget: int, max_decode_batch: int, block_tokens: int) -> None:
        if token_budget < 1 or max_decode_batch < 1:
            raise ValueError("token_budget and max_decode_batch must be >= 1")
        self.worker_id, self.cost = worker_id, cost
        self.pool = BlockPool(capacity_blocks)
        self.budget, self.max_batch, self.block_tokens = token_budget, max_decode_batch, \
            block_tokens
        self.reserved = 0
        self.waiting: deque[_Request] = deque()   # prompts not fully scheduled (FCFS)
        self.ready: deque[_Request] = deque()     # prefilled, waiting for a decode slot
        self.running: list[_Request] = []
        self.ctx = 0                              # context tokens of `running`
        self.free_at = 0.0                        # end of the last formed step
        self.rates = StepRates()
        self.steps: deque[_Step] = deque()        # formed, not yet published
        self.jobs: deque[_Request] = deque()      # prompts not yet published as prefilled
        self.prefilled: list[tuple[float, int]] = []   # (first token, rid) not handed on
        self.finished: list[tuple[int, float, float]] = []   # (rid, first token, finish)
        self.max_batch_seen = 0
        self.decode_steps = 0
        self._published_cached = 0
        self._last_step_end = 0.0
        self._last_wake = -1.0
        self._last_batch = 0
        self._last_step_s = 0.0

    # ---- admission ------------------------------------------------------------------------
    def room(self) -> int:
        """Blocks a new admission may reserve (free or evictable, less what is promised)."""
        return self.pool.num_free_blocks - self.reserved

    def serve(self, rid: int, hashes, root: BlockHash, hash_ids, num_tokens: int,
              output_tokens: int, arrival: float, reserve_blocks: int) -> None:
        """Admit one request: reserve `reserve_blocks` (the caller checked `room()`), queue
        its prompt; it decodes `output_tokens` tokens in all (its first from the prefill)."""
        assert 0 < reserve_blocks <= self.room(), (reserve_blocks, self.room())
        if not (self.waiting or self.ready or self.running) and self.free_at <= arrival:
            self._last_wake = arrival           # a request wakes it: it publishes
        self.reserved += reserve_blocks
        job = _Request(rid, arrival, num_tokens, hashes, root, hash_ids, output_tokens,
                       reserve_blocks)
        self.waiting.append(job)
        self.jobs.append(job)

    def _take(self, job: _Request, n: int) -> None:
        """n of the job's reserved blocks become real (hits or computed blocks)."""
        k = min(n, job.reserved)
        job.reserved -= k
        self.reserved -= k

    def _admit(self, job: _Request) -> None:
        """Its first step: its hit is the cached chain earlier steps computed."""
        pool = self.pool
        hits = cached_chain(pool, job.hashes, job.hash_ids, job.root, self._prompt_blocks(job))
        pool.touch(hits)
        self._take(job, len(hits))
        job.blocks = hits
        job.pos = min(len(hits) * self.block_tokens, job.num_tokens - 1)
        job.uncached = job.num_tokens - job.pos

    def _prompt_blocks(self, job: _Request) -> int:
        return min(len(job.hashes), cdiv(job.num_tokens, self.block_tokens))

    def _cache_computed(self, job: _Request) -> None:
        """Its blocks computed so far enter the pool (held by it) and the prefix cache."""
        n = self._prompt_blocks(job)
        done = n if job.pos >= job.num_tokens else min(n, job.pos // self.block_tokens)
        a = len(job.blocks)
        if done <= a:
            return
        new = self.pool.allocate(done - a)
        self._take(job, done - a)
        self.pool.cache_blocks(new, job.hashes[a:done], job.hashes[a - 1] if a else job.root,
                               [(x,) for x in job.hash_ids[a:done]])
        job.blocks += new

    def _release(self, job: _Request, at: float) -> None:
        self.finished.append((job.rid, job.first_s, at))
        self.pool.free(reversed(job.blocks))
        job.blocks = []
        self.reserved -= job.reserved
        job.reserved = 0

    # ---- stepping -------------------------------------------------------------------------
    def advance(self, t: float) -> list[tuple[float, int]]:
        """Form every step that starts by `t`; returns (first token, rid) of the prompts
        prefilled since the last call (their first token is their last prefill step's end)."""
        while True:
            start = self.free_at
            if not (self.running or self.ready):
                if not self.waiting:
                    break
                start = max(start, self.waiting[0].arrival)
            if start > t:
                break
            while self.ready and len(self.running) < self.max_batch:
                s = self.ready.popleft()
                self.running.append(s)
                self.ctx += s.ctx
            b, ctx = len(self.running), self.ctx
            self.max_batch_seen = max(self.max_batch_seen, b)
            budget, chunks, members = self.budget - b, [], []
            for job in self.waiting:
                if job.arrival > start or budget <= 0:
                    break
                if job.pos is None:
                    self._admit(job)
                c = min(budget, job.num_tokens - job.pos)
                chunks.append((c, job.pos))
                members.append((job, c))
                job.pos += c
                budget -= c
            if chunks:
                k, dt = 1, self.cost.mixed_step_s(chunks, b, ctx)
            else:
                assert b > 0, "a step with neither prefill nor decode"
                dt = self.cost.decode.step_s(b, ctx)
                k = min(s.left for s in self.running)
                if t < math.inf:
                    k = min(k, int((t - start) // dt) + 1)
                if self.waiting and self.waiting[0].arrival > start:   # it joins a step
                    k = min(k, max(1, math.ceil((self.waiting[0].arrival - start) / dt)))
            end = start + k * dt
            if b:
                self.decode_steps += k
                self.ctx += k * b
                self.running, done = decode_steps(self.running, k)
                for s in done:
                    self.ctx -= s.ctx
                    self._release(s, end)
            for job, _ in members:
                self._cache_computed(job)
            while self.waiting and self.waiting[0].pos is not None and \
                    self.waiting[0].pos >= self.waiting[0].num_tokens:
                job = self.waiting.popleft()
                job.first_s = job.prefilled_at = end
                self.prefilled.append((end, job.rid))
                if job.left <= 0:
                    self._release(job, end)
                else:
                    self.ready.append(job)
            self.steps.append(_Step(start, end, k, chunks, members, b, ctx,
                                    self.pool.take_events()))
            self.free_at = end
        out, self.prefilled = self.prefilled, []
        return out

    # ---- what the router sees -------------------------------------------------------------
    def _publish(self, at: float) -> list:
        """Feed the steps that ended by `at` to the fits; their KV events, in order."""
        events: list = []
        while self.steps and self.steps[0].end <= at:
            st = self.steps.popleft()
            step_s = (st.end - st.start) / st.k
            if st.chunks and not st.batch:
                self.rates.observe_prefill(step_s, st.chunks)
            elif not st.chunks:
                self.rates.observe_decode(step_s, st.batch, st.ctx)
            for job, c in st.members:
                job.fed += c
            events += st.events
            self._last_step_end, self._last_batch, self._last_step_s = st.end, st.batch, step_s
        for ev in events:
            self._published_cached += stored_delta(ev)
        while self.jobs and self.jobs[0].prefilled_at is not None and \
                self.jobs[0].prefilled_at <= at and self.jobs[0].fed >= self.jobs[0].uncached:
            self.jobs.popleft()
        return events

    def prefill_report(self, at: float) -> LoadReport:
        """As SimWorker.report: the prompt queue as of its last publish by `at`."""
        events = self._publish(at)
        published = max(self._last_step_end, self._last_wake if self._last_wake <= at
                        else -1.0)
        queued = running = num = active = 0
        backlog = []
        for job in self.jobs:
            if job.arrival > published:
                break
            left = job.uncached - job.fed
            num += 1
            active += len(job.hashes)
            if job.pos is not None and job.fed > 0:
                running += left
            else:
                queued += left
            backlog.append((job.num_tokens, job.num_tokens - left))
        fit = self.rates.prefill_fit()
        queued_s = fit.backlog_s(backlog, max(1, self.budget - self._last_batch)) \
            if fit else None
        return LoadReport(
            self.worker_id, queued_tokens=queued, running_tokens=running, num_requests=num,
            active_blocks=active, cached_blocks=self._published_cached,
            free_blocks=max(0, self.room()), total_blocks=self.pool.num_blocks,
            queued_s=queued_s, prefill_fit=fit, kv_bytes_per_token=self.cost.kv_bytes_per_token,
            events=tuple(events), reported_at=published, age_s=max(0.0, at - published))

    def decode_report(self) -> LoadReport:
        """Its decode batch, context and room now, with the last step's measured seconds."""
        ctx = self.ctx + sum(s.ctx for s in self.ready)
        return LoadReport(self.worker_id, running_tokens=ctx,
                          queued_tokens=sum(j.num_tokens - (j.pos or 0) for j in self.waiting),
                          num_requests=len(self.running) + len(self.ready) + len(self.waiting),
                          active_blocks=self.pool.num_used_blocks,
                          free_blocks=max(0, self.room()), total_blocks=self.pool.num_blocks,
                          decode_batch=self._last_batch, decode_step_s=self._last_step_s,
                          decode_fit=self.rates.decode_fit(),
                          kv_bytes_per_token=self.cost.kv_bytes_per_token)
