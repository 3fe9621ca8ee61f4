"""The engine's P/D and migration API: the narrow set of calls a worker's KV handoff makes
(workers/kv_handoff.py), and nothing else reaches into the engine for.

Prefill side: `admitted_request` (the router's admitted request, trusted but namespace-checked),
`read_pages`, `sampler_state`, `release` (a finished `hold_kv` request's blocks).
Decode side: `match_prefix` + `reserve` (blocks for the whole prompt before anyone computes it),
then `fill` (the pages landed: decode from here) or `fallback` (prefill it here), or `release`.
Live migration: `freeze` / `unfreeze` on the worker it leaves, `resumed_request` + `reserve` +
`fill` on the one it goes to.

Invariant: a reserved request is the engine's (in `engine.requests`, WAITING) but not the
scheduler's until `fill` or `fallback`; a frozen one holds its blocks and is in neither queue.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvcache.manager import cdiv
from protocol.errors import RequestError
from protocol.messages import AdmittedRequest, MigratedRequest
from workers.request import Request, RequestStatus

if TYPE_CHECKING:
    from workers.engine import LLMEngine, StepOutput


class EngineHandoff:
    """`engine.handoff`: one engine's P/D and migration calls."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    # ---- requests that arrive computed elsewhere ---------------------------------------------
    def admitted_request(self, admitted: AdmittedRequest,
                         max_tokens: int | None = None) -> Request:
        """Build the engine request for an AdmittedRequest, trusting its tokens and hashes
        (validated and hashed once, at admission) but not its namespace: a worker of another
        model revision, tokenizer, dtype, tenant or adapter refuses it (RequestError).
        `max_tokens` overrides the sampling's (P samples only the first token)."""
        inputs = self.engine.inputs
        ns = inputs.namespace.with_request(tenant=admitted.tenant,
                                           lora_id=inputs.lora_hash(admitted.lora_id))
        if ns.root_hash() != admitted.namespace_root or admitted.block_size != inputs.block_size:
            raise RequestError(f"request {admitted.request_id} was admitted under another "
                               "cache namespace or block size than this worker's")
        inputs.check_fits(admitted.num_tokens + 1)
        inputs.check_new_id(admitted.worker_request_id)
        sp = admitted.sampling
        if max_tokens is not None:
            sp = replace(sp, max_tokens=max_tokens, min_tokens=min(sp.min_tokens, max_tokens))
        req = Request(admitted.worker_request_id, list(admitted.prompt_token_ids), sp,
                      admitted.namespace_root, inputs.block_size, lora_name=admitted.lora_id,
                      eos_token_ids=inputs.eos_for(sp))
        req.block_hashes = list(admitted.block_hashes)
        return req

    def resumed_request(self, m: MigratedRequest) -> Request:
        """Decode side of a live migration: the engine request that goes on with a decode
        another worker froze (its prompt, its output so far but the last token, which `fill`
        appends; its lifecycle and clocks carried over). Same namespace checks as
        `admitted_request`."""
        req = self.admitted_request(m.admitted)
        out, f = list(m.frozen.output_token_ids), m.frozen
        if cdiv(len(req.prompt_token_ids) + len(out) + 1, self.engine.cfg.block_size) \
                > self.engine.kv.pool.num_blocks:
            raise RequestError(f"request {m.admitted.request_id} holds more tokens than this "
                               "worker's whole pool")
        req.output_token_ids = out[:-1]
        req.lifecycle = replace(f.lifecycle)
        now, gap = time.perf_counter(), max(0.0, time.time() - f.frozen_at)
        req.arrival_time = now - f.since_arrival_s - gap
        req.first_token_time = req.first_scheduled_time = now - f.since_first_token_s - gap
        req.update_block_hashes()
        return req

    # ---- live migration, the side it leaves --------------------------------------------------
    def freeze(self, request_id: str) -> Request | None:
        """Decode side, between two steps: stop decoding a running request so that it can move
        to another worker (live migration). Its blocks stay held (KV of every token but the
        last sampled one) until `release` or `abort`; `unfreeze` puts it back. None (nothing
        changed) unless it is a running decode: not queued, prefilling, frozen or finished."""
        e = self.engine
        req = e.requests.get(request_id)
        if req is None or not e.scheduler.pause(req):
            return None
        e.frozen.add(request_id)
        return req

    def unfreeze(self, request_id: str) -> bool:
        """A frozen request decodes here again (its move did not happen)."""
        e = self.engine
        req = e.requests.get(request_id)
        if request_id not in e.frozen or req is None:
            return False
        e.frozen.discard(request_id)
        e.scheduler.add_running(req)
        return True

    # ---- decode side: reserve, then fill or fall back ----------------------------------------
    def match_prefix(self, req: Request) -> list:
        """The cached blocks of the request's longest cached prefix (at least its last prompt
        token is left to compute)."""
        return self.engine.kv.match_prefix(req.namespace_root, req.block_hashes,
                                           req.all_token_ids, req.num_tokens - 1)

    def reserve(self, req: Request, hits: list | None = None,
                migrated: bool = False) -> int | None:
        """Decode side: take the request's prefix hit (`hits`: `match_prefix(req)` when the
        caller has it already) and reserve blocks for its whole prompt before anyone computes
        it (decode-first admission). Returns the hit in blocks, or None (nothing reserved) when
        the pool (or the adapter slots) cannot take it now. The request is the engine's but not
        the scheduler's until `fill` or `fallback`."""
        e = self.engine
        if req.lora_name and not e.scheduler.lora_fits(req.lora_name):
            return None
        if hits is None:
            hits = self.match_prefix(req)
        new = e.kv.allocate_slots(req.request_id, req.num_tokens, hits)
        if new is None:
            return None
        e.requests[req.request_id] = req
        req.lifecycle.blocks_allocated += len(new)
        if not migrated:     # a moved decode's prompt was counted where it was admitted
            req.lifecycle.cached_tokens = len(hits) * e.cfg.block_size
            e.stats.prompt_tokens += len(req.prompt_token_ids)
            e.stats.reused_tokens += req.lifecycle.cached_tokens
        return len(hits)

    def fill(self, req: Request, dest_block_ids: Sequence[int], pages: torch.Tensor | None,
             first_token: int, sampler_state: bytes | None = None) -> StepOutput:
        """Decode side: write the transferred pages into the reserved request's blocks (the
        caller has checked it still owns them), add the first token (sampled by the prefill
        worker, whose generator state goes on here) and let it decode."""
        e = self.engine
        assert req.status is RequestStatus.WAITING and req.request_id in e.requests
        if pages is not None:
            e.runner.write_pages(list(dest_block_ids), pages)
        if sampler_state is not None:
            g = torch.Generator()
            g.set_state(torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8))
            req.generator = g
        now = time.perf_counter()
        req.num_computed_tokens = req.num_tokens
        req.append_token(first_token, now)
        e.scheduler.cache_computed(req)
        e.scheduler.add_running(req)
        return e.after_token(req, now)

    def fallback(self, req: Request) -> None:
        """Decode side: give up on the transfer and prefill the reserved request here."""
        e = self.engine
        assert req.status is RequestStatus.WAITING and req not in e.scheduler.waiting
        e.kv.free(req.request_id)
        req.num_computed_tokens = 0
        e.scheduler.add(req)

    def release(self, request_id: str) -> None:
        """Free the blocks a handoff holds outside the scheduler: a prefill request finished
        with `hold_kv`, or a reservation given up (its cached blocks stay cached)."""
        e = self.engine
        req = e.requests.get(request_id)
        if req is not None and req.status is RequestStatus.WAITING:
            e.finish_request(req, "abort", time.perf_counter())
        e.frozen.discard(request_id)
        e.kv.free(request_id)

    # ---- pages and state to stage ------------------------------------------------------------
    def read_pages(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A private copy of these blocks' pages (for staging)."""
        return self.engine.runner.read_pages(list(block_ids))

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks, in order (empty when it holds none)."""
        return self.engine.kv.block_table(request_id)

    @staticmethod
    def sampler_state(req: Request) -> bytes | None:
        """The request's seeded generator state (None: greedy or unseeded)."""
        g = req.generator
        return None if g is None else bytes(g.get_state().numpy().tobytes())
