"""Continuous batching: which requests run this step and how many tokens each computes.

Each step: running requests first (decodes, then unfinished prefill chunks), then waiting
requests admitted in arrival order, all under a per-step token budget (chunked prefill).
A waiting request's first admission takes its prefix hit from the cache. When blocks run
out for a running request, the youngest running request is preempted (its blocks freed,
recomputed later); cached-but-unreferenced blocks are evicted before that by the pool.
A request left alone that still cannot grow waits (`stalled`) while blocks are held outside
the running set (decode-side reservations awaiting their KV, prefill-side transfer leases):
those come back on their own. Only when nothing else holds blocks is the pool its limit,
and the engine ends it (`out_of_blocks`).

The scheduler owns the requests' progress: `schedule()` returns the step as a `SchedulerOutput`
(workers/scheduler_output.py), and `update_from_output()` applies what the step computed and
sampled (computed tokens, appended tokens, blocks cached). Torch-free.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvcache.manager import KVCacheManager
from protocol.lifecycle import EngineStats
from workers.request import Request, RequestStatus
from workers.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from workers.step_budget import StepBudget

# A prefill whose rest after this step's chunk is at most budget / TAIL_DIVISOR tokens computes
# that rest in this step too: a step of a few prefill tokens costs most of a whole step (the
# weights read, the decodes' attention, small-row matmuls), so 1,024 tokens beside 15 decodes
# under a 512 budget take 497 + 527 tokens, not 497 + 497 + 30. Not under a step-time target
# (engine.max_step_ms), whose cap stays a cap.
TAIL_DIVISOR = 8


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048   # token budget of one step (prefill chunk size; a
                                         # prefill's last piece may overrun it by budget / 8)
    max_num_seqs: int = 64               # running requests at most
    max_loras: int = 4                   # distinct LoRA adapters among running requests


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, stats: EngineStats,
                 busy_loras: Callable[[], set[str]] | None = None,
                 step_budget: StepBudget | None = None) -> None:
        self.cfg = cfg
        # under a step-time target, the prefill tokens a step with decodes may take
        self.step_budget = step_budget
        # adapters that will run in coming steps: the running requests' and, on a decode
        # worker, those of reservations awaiting their KV (the engine knows those)
        self.busy_loras = busy_loras or (lambda: {r.lora_name for r in self.running})
        self.kv = kv
        self.stats = stats
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stalled = False   # last step scheduled nothing: waiting for blocks held elsewhere

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        out_of_blocks: list[Request] = []   # running alone yet cannot grow: engine ends them
        # 1) running requests, decodes before prefill chunks (the runner wants decodes first)
        self.running.sort(key=lambda r: r.is_prefill)
        preempted = False
        stalled = False
        i = 0
        decodes = decode_ctx = 0       # decodes come first: the prefill cap is known after them
        prefill_left: int | None = None

        def prefill_cap() -> int:
            nonlocal prefill_left
            if prefill_left is None:
                prefill_left = budget if self.step_budget is None else \
                    self.step_budget.prefill_tokens(decodes, decode_ctx)
            return prefill_left

        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            is_prefill = left > 1              # req.is_prefill, read once a step
            n = min(left, budget)
            if is_prefill and (n := self._with_tail(left, min(n, prefill_cap()))) <= 0:
                break
            while not self._allocate(req, req.num_computed_tokens + n):
                if len(self.running) == 1:   # alone and still cannot grow
                    if self._blocks_held_elsewhere():
                        stalled = True       # reservations / leases free them: wait
                    else:                    # the pool is its limit
                        out_of_blocks.append(req)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING or req in out_of_blocks or stalled:
                break
            if is_prefill:
                prefill_left -= n
            else:
                decodes += 1
                decode_ctx += req.num_computed_tokens + left
            chunks.append(ScheduledChunk(req, n, self.kv.block_table(req.request_id)))
            budget -= n
            i += 1
        # 2) admit waiting requests while budget, sequence slots and blocks allow; not in a step
        #    that preempted (the freed blocks go to the running requests, no thrashing)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and not preempted and not stalled:
            req = self.waiting[0]
            if req.lora_name and not self.lora_fits(req.lora_name):
                break   # FCFS: it waits until a running adapter's requests finish
            hits = self.kv.match_prefix(req.namespace_root, req.block_hashes, req.token_ids,
                                        req.num_tokens - 1)
            num_cached = len(hits) * self.kv.block_size
            n = self._with_tail(req.num_tokens - num_cached,
                                min(req.num_tokens - num_cached, budget, prefill_cap()))
            if n <= 0:
                break
            new = self.kv.allocate_slots(req.request_id, num_cached + n, hits)
            if new is None:
                break
            self.waiting.popleft()
            self._account_admission(req, num_cached, len(new))
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:   # trace hook: prefill queue wait ends
                req.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, self.kv.block_table(req.request_id)))
            budget -= n
            prefill_left -= n
        assert not (stalled and chunks), "only a request running alone stalls"
        self.stalled = stalled
        used = self.kv.pool.num_used_blocks
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        return SchedulerOutput(chunks, out_of_blocks)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           now: float) -> list[Request]:
        """Apply a step: every chunk's tokens are computed, each sampled chunk's request
        gets its token, and the blocks now full are cached. Returns the requests that got a
        token, in `result`'s order (the engine checks their stop rules)."""
        self.stats.observe_utilization(*self.stored_tokens())
        for ch in out.chunks:
            ch.request.num_computed_tokens += ch.num_new_tokens
            ch.request.lifecycle.computed_tokens += ch.num_new_tokens
            self.stats.computed_tokens += ch.num_new_tokens
        reqs = [out.chunks[i].request for i in result.sampled_chunks]
        for req, tok in zip(reqs, result.token_ids, strict=True):
            req.append_token(tok, now)
        for ch in out.chunks:
            self.cache_computed(ch.request)
        return reqs

    def cache_computed(self, req: Request) -> None:
        """Cache the request's full computed blocks (prefix caching)."""
        self.kv.cache_computed(req.request_id, req.namespace_root, req.block_hashes,
                               req.token_ids, req.num_computed_tokens)

    def add_running(self, req: Request) -> None:
        """A request whose KV is already computed (landed from another worker, or unfrozen)
        decodes from the next step on."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def pause(self, req: Request) -> bool:
        """Take a running decode out of the batch, keeping its blocks (a live migration's
        freeze); False (nothing changed) unless it is a running decode with a token."""
        if req.status is not RequestStatus.RUNNING or req.is_prefill \
                or not req.output_token_ids or req not in self.running:
            return False
        assert req.num_computed_tokens == req.num_tokens - 1, req
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        return True

    def _with_tail(self, left: int, n: int) -> int:
        """`n` prefill tokens of the `left` to compute, or all `left` when the rest would be a
        tail of at most budget / TAIL_DIVISOR (a chunk of 0 stays 0: nothing was affordable)."""
        tail = self.cfg.max_num_batched_tokens // TAIL_DIVISOR
        if 0 < n < left and left - n <= tail and (self.step_budget is None
                                                  or not self.step_budget.on):
            return left
        return n

    def lora_fits(self, name: str) -> bool:
        """Can a request of adapter `name` run beside the running ones (max_loras slots)?"""
        busy = self.busy_loras() - {""}
        return name in busy or len(busy) < self.cfg.max_loras

    def _blocks_held_elsewhere(self) -> bool:
        """Do requests outside the running set reference blocks (reserved or leased)?"""
        running = {r.request_id for r in self.running}
        return any(blocks for rid, blocks in self.kv.req_blocks.items() if rid not in running)

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        if len(self.kv.block_table(req.request_id)) * self.kv.block_size >= num_tokens:
            return True   # its blocks hold them already (most decode steps): nothing to take
        new = self.kv.allocate_slots(req.request_id, num_tokens)
        if new is None:
            return False
        if new:
            req.lifecycle.blocks_allocated += len(new)
            if not req.is_prefill:
                req.lifecycle.block_appends += len(new)
        return True

    def _account_admission(self, req: Request, num_cached: int, num_new_blocks: int) -> None:
        lc = req.lifecycle
        lc.blocks_allocated += num_new_blocks
        if lc.preemptions == 0:   # first admission: this is the request's prefix query
            lc.cached_tokens = num_cached
            self.stats.prompt_tokens += len(req.prompt_token_ids)
            self.stats.reused_tokens += num_cached
        else:                      # recompute after preemption
            recompute = req.num_tokens - num_cached
            lc.recomputed_tokens += recompute
            self.stats.recomputed_tokens += recompute

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and put it back at the front of the queue (recompute)."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.lifecycle.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, free_blocks: bool = True) -> None:
        """Release a finished (or aborted) request's blocks; its full blocks stay cached."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_blocks:
            self.kv.free(req.request_id)

    def stored_tokens(self) -> tuple[int, int]:
        """(tokens held in the blocks running requests reference, those blocks), a block shared
        by k requests counted once: O(running requests), never a walk over their blocks.

        Shared blocks are full (only full blocks are cached, so only they are shared), so
        each extra reference (the pool's `shared_refs`) is one full block counted twice.
        Where other holders reference blocks too (a decode worker's reservations awaiting their
        pages), their extra references are subtracted as well: a slight undercount while
        transfers are in flight, never an overcount."""
        bs, kv = self.kv.block_size, self.kv
        tokens = blocks = 0
        for req in self.running:
            n = len(kv.block_table(req.request_id))
            tokens += min(req.num_tokens, n * bs)
            blocks += n
        shared = min(kv.pool.shared_refs, blocks)
        return max(0, tokens - shared * bs), blocks - shared
