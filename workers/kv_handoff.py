"""Both ends of the KV handoff on an engine: P stages exactly the plan; D lands only what it still owns.

Decode side (DecodeHandoff): a reservation is RESERVED until a pull begins (PULLING); the pull
goes into a private buffer, never into the reserved blocks; `verify_pages` checks each page's
checksum once per handoff, outside the engine lock (it reads only the private buffer); the pages
are written (by `land`, under the caller's engine lock, no checksum computed there) only if the
same reservation still owns those blocks, its epoch and plan digest match the transfer, the
lease has not ended and verification found every page whole. An abort or expiry while PULLING cancels the reservation at once (its blocks are freed
and may be reused); the pull then lands nowhere. So a block is never written after it was freed.

Prefill side (stage_plan): read the plan's blocks, checksum each page (once: the transport adds
no checksum of its own unless configured to), stage the copy under a lease; P's blocks stay in its prefix cache but are not pinned (the staged copy is private).

Every hold is in the worker's HandoffLedger with its release reason. Not thread-safe by itself:
callers hold the engine lock around every DecodeHandoff method (the pull and `verify_pages`
run outside it).
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from protocol.errors import (
    REJECT_CORRUPT,
    REJECT_DUPLICATE,
    REJECT_LATE,
    REJECT_STALE,
    REJECT_UNKNOWN,
    RequestError,
    TransferRejected,
)
from protocol.ledger import (
    EXPIRED,
    FALLBACK_LOCAL,
    FILLED,
    PREFILL_FAILED,
    RESERVED,
    STAGED,
    HandoffLedger,
)
from protocol.messages import AdmittedRequest, MigratedRequest, PrefillResult, TransferPlan
from workers.engine import LLMEngine, StepOutput
from workers.request import Request

WSUM_TAG = 1 << 62        # wsum64 values carry this bit; crc32 values are below 2**32
_WSUM_CHUNK = 32          # blocks per device pass (bounds the int64 temporary)


def page_checksums(pages: torch.Tensor, algo: str | None = None) -> tuple[int, ...]:
    """One checksum per block of ``pages`` ([num_layers, 2, n, ...]), over the block's bytes in
    layer-major order. ``algo`` None: crc32 on the host for CPU pages; for GPU pages "wsum64",
    a position-weighted sum of the block's 32-bit words mod 2**62 computed on the device (no
    host round trip of the pages; any one changed word changes it), tagged with WSUM_TAG so the
    verifier (``checksum_algo``) recomputes the same function on whatever device it holds."""
    algo = algo or ("wsum64" if pages.device.type == "cuda" else "crc32")
    if algo == "wsum64":
        return _wsum64(pages)
    assert algo == "crc32", algo
    host = pages.detach().to("cpu")
    return tuple(zlib.crc32(host[:, :, i].contiguous().reshape(-1).view(torch.uint8).numpy())
                 for i in range(host.shape[2]))


def checksum_algo(sums) -> str:
    """The algorithm that made ``sums`` (page_checksums values)."""
    return "wsum64" if sums and int(sums[0]) & WSUM_TAG else "crc32"


def _wsum64(pages: torch.Tensor) -> tuple[int, ...]:
    n = pages.shape[2]
    block_bytes = pages[:, :, :1].numel() * pages.element_size()
    word = torch.int32 if block_bytes % 4 == 0 else torch.uint8
    words = block_bytes // word.itemsize
    # odd weights from the word's position (two's complement int64 arithmetic wraps the same
    # way on every device, and so does the order-free sum)
    weights = (torch.arange(1, words + 1, dtype=torch.int64, device=pages.device)
               * -7046029254386353131) | 1
    out = []
    for start in range(0, n, _WSUM_CHUNK):
        chunk = pages[:, :, start:start + _WSUM_CHUNK]
        c = chunk.shape[2]
        rows = chunk.movedim(2, 0).contiguous().view(torch.uint8).view(c, -1).view(word)
        out.append((rows.to(torch.int64) * weights).sum(dim=1))
    sums = torch.cat(out) & (WSUM_TAG - 1) | WSUM_TAG
    return tuple(int(v) for v in sums.tolist())


@dataclass(frozen=True)
class PulledPages:
    """Pages pulled into D's private buffer, with the verdict of their one checksum pass.

    Made only by ``verify_pages``; ``land`` trusts ``intact`` and computes no checksum."""

    pages: torch.Tensor
    intact: bool              # every page's checksum equals what P computed when staging


def verify_pages(result: PrefillResult, pages: torch.Tensor | None) -> PulledPages | None:
    """Check every pulled page against P's checksums: one ``page_checksums`` pass per handoff.

    Pure (reads only ``pages``, a buffer the caller owns, and the frozen ``result``), so D runs
    it outside its engine lock, between the pull and ``land``. None when no pages came (a
    handoff with nothing to transfer)."""
    if pages is None:
        return None
    sums = page_checksums(pages, checksum_algo(result.page_checksums))
    return PulledPages(pages, sums == tuple(result.page_checksums))


class PullState(str, Enum):
    RESERVED = "reserved"    # blocks reserved, no pull running
    PULLING = "pulling"      # a pull into a private buffer runs (outside the engine lock)
    CANCELLED = "cancelled"  # given up while pulling: the blocks are freed, the pull is void


@dataclass
class Reservation:
    request: Request
    plan: TransferPlan
    deadline: float          # wall clock: the request's own deadline
    state: PullState = PullState.RESERVED
    migrated_from: str = ""  # a live migration's source decode worker ("" : a prefill's pages)


class DecodeHandoff:
    def __init__(self, engine: LLMEngine, worker_id: str, ledger: HandoffLedger,
                 clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.ledger = ledger
        self._clock = clock
        self.reservations: dict[str, Reservation] = {}   # worker-side request id ->
        self.rejected: Counter[str] = Counter()          # REJECT_* -> transfers refused

    # ---- reserve ------------------------------------------------------------------------------
    def reserve(self, req: Request, admitted: AdmittedRequest,
                hits: list | None = None) -> TransferPlan | None:
        """Reserve blocks for the whole prompt (taking D's own prefix hit, `hits` when the
        caller matched it already); return the plan of the blocks P must send, or None (nothing
        reserved) when there is no room now."""
        d_hit = self.engine.handoff.reserve(req, hits)
        if d_hit is None:
            return None
        blocks = self.engine.handoff.block_table(req.request_id)
        n = admitted.num_prompt_blocks
        hashes = list(admitted.block_hashes[d_hit:n])
        hashes += [0] * (n - d_hit - len(hashes))    # the trailing partial block
        plan = TransferPlan(admitted.request_id, admitted.epoch, self.worker_id, d_hit,
                            tuple(blocks[d_hit:n]), tuple(hashes))
        self.reservations[req.request_id] = Reservation(req, plan, admitted.deadline)
        self.ledger.hold(self.worker_id, RESERVED, req.request_id, len(blocks),
                         max(0.0, admitted.deadline - self._clock()))
        return plan

    def reserve_migration(self, req: Request, m: MigratedRequest) -> TransferPlan | None:
        """Live migration, D2's side: reserve blocks for every token the source computed
        (prompt + output but the last, `req` from engine.handoff.resumed_request), taking D2's own
        prefix hit over them; the plan names the source's blocks D2 lacks, the trailing partial
        block included. None (nothing reserved) when there is no room now."""
        hits = self.engine.handoff.match_prefix(req)
        d_hit = self.engine.handoff.reserve(req, hits, migrated=True)
        if d_hit is None:
            return None
        blocks = self.engine.handoff.block_table(req.request_id)
        n = -(-req.num_tokens // req.block_size)
        assert len(blocks) == n > d_hit, (len(blocks), n, d_hit)
        hashes = list(req.block_hashes[d_hit:n])
        hashes += [0] * (n - d_hit - len(hashes))    # the trailing partial block
        admitted = m.admitted
        plan = TransferPlan(admitted.request_id, admitted.epoch, self.worker_id, d_hit,
                            tuple(blocks[d_hit:n]), tuple(hashes))
        self.reservations[req.request_id] = Reservation(req, plan, admitted.deadline,
                                                        migrated_from=m.source_worker)
        self.ledger.hold(self.worker_id, RESERVED, req.request_id, len(blocks),
                         max(0.0, admitted.deadline - self._clock()))
        return plan

    # ---- pull ---------------------------------------------------------------------------------
    def begin_pull(self, result: PrefillResult) -> Reservation:
        """Check the transfer against the reservation; mark it PULLING (one pull at a time)."""
        rid = result.worker_request_id
        res = self.reservations.get(rid)
        if res is None:
            raise self._reject(REJECT_UNKNOWN, f"no reservation for {rid} on {self.worker_id} "
                                               "(aborted, expired or never admitted here)")
        if result.epoch != res.plan.epoch or result.plan_digest != res.plan.digest:
            raise self._reject(REJECT_STALE, f"transfer for {rid} carries epoch {result.epoch} "
                                             f"plan {result.plan_digest}; the reservation is "
                                             f"epoch {res.plan.epoch} plan {res.plan.digest}")
        if res.state is not PullState.RESERVED:
            raise self._reject(REJECT_DUPLICATE, f"a pull for {rid} is already {res.state.value}")
        if result.handle is not None and (result.handle.num_blocks != res.plan.num_blocks
                                          or len(result.page_checksums) != res.plan.num_blocks):
            raise self._reject(REJECT_STALE, f"transfer for {rid} has {result.handle.num_blocks} "
                                             f"blocks; the plan {res.plan.num_blocks}")
        self._check_lease(result)
        res.state = PullState.PULLING
        return res

    def pull_failed(self, res: Reservation) -> None:
        """The pull raised: the reservation waits for another transfer (or a fallback)."""
        if res.state is PullState.PULLING:
            res.state = PullState.RESERVED

    def land(self, res: Reservation, result: PrefillResult,
             pulled: PulledPages | None) -> StepOutput:
        """Write the pulled pages (verified by ``verify_pages``, outside the lock) into the
        reserved blocks and start decoding, if this reservation still owns them and the pages
        are whole; else TransferRejected and nothing is written. No checksum runs here."""
        rid = result.worker_request_id
        corrupt = pulled is not None and not pulled.intact
        # corrupt pages are counted as such even when the reservation is gone meanwhile (they
        # land nowhere either way)
        if res.state is PullState.CANCELLED or self.reservations.get(rid) is not res:
            if corrupt:
                raise self._reject(REJECT_CORRUPT, f"page checksums of {rid} do not match "
                                                   "what the prefill worker staged (and its "
                                                   "reservation is gone)")
            raise self._reject(REJECT_LATE, f"{rid} was aborted or expired during its pull; "
                                            "its blocks are no longer reserved for it")
        try:
            if corrupt:
                raise self._reject(REJECT_CORRUPT, f"page checksums of {rid} do not match "
                                                   "what the prefill worker staged")
            self._check_lease(result)
        except TransferRejected:
            res.state = PullState.RESERVED
            raise
        del self.reservations[rid]
        self.ledger.release(self.worker_id, RESERVED, rid, FILLED)
        lc = res.request.lifecycle
        lc.decode_worker = self.worker_id
        pages = None if pulled is None else pulled.pages
        if res.migrated_from:      # a moved decode: its lifecycle so far came with it
            lc.migrations += 1
            lc.transferred_blocks += res.plan.num_blocks if pages is not None else 0
            return self.engine.handoff.fill(res.request, res.plan.dest_block_ids, pages,
                                    result.first_token, result.sampler_state)
        lc.skipped_blocks = res.plan.first_block
        lc.prefill_worker = result.prefill_worker
        lc.cached_tokens = max(lc.cached_tokens, result.cached_tokens)
        lc.computed_tokens += result.computed_tokens
        if pages is not None:
            lc.transferred_blocks = res.plan.num_blocks
        return self.engine.handoff.fill(res.request, res.plan.dest_block_ids, pages, result.first_token,
                                result.sampler_state)

    # ---- give up ------------------------------------------------------------------------------
    def fallback(self, rid: str) -> bool:
        """No transfer will come (no prefill worker left, or the router chose this worker to
        prefill it): prefill here."""
        res = self.reservations.get(rid)
        if res is None or res.state is not PullState.RESERVED:
            return False
        del self.reservations[rid]
        self.ledger.release(self.worker_id, RESERVED, rid, FALLBACK_LOCAL)
        res.request.lifecycle.decode_worker = self.worker_id
        self.engine.handoff.fallback(res.request)
        return True

    def cancel(self, rid: str, reason: str) -> bool:
        """Abort or expiry: free the reservation's blocks now; a pull in flight lands nowhere."""
        res = self.reservations.pop(rid, None)
        if res is None:
            return False
        res.state = PullState.CANCELLED
        self.engine.handoff.release(rid)
        self.ledger.release(self.worker_id, RESERVED, rid, reason)
        return True

    def expire(self) -> list[str]:
        """Cancel reservations past their request's deadline (the router gave up or died)."""
        now = self._clock()
        due = [rid for rid, r in self.reservations.items() if r.deadline <= now]
        for rid in due:
            self.cancel(rid, EXPIRED)
        return due

    # ---- helpers ------------------------------------------------------------------------------
    def _check_lease(self, result: PrefillResult) -> None:
        if result.handle is not None and self._clock() > result.staged_at + result.lease_s:
            raise self._reject(REJECT_LATE, f"the lease on {result.worker_request_id}'s pages "
                                            f"ended {self._clock() - result.staged_at:.1f} s "
                                            f"after staging (lease {result.lease_s:.1f} s)")

    def _reject(self, reason: str, message: str) -> TransferRejected:
        self.rejected[reason] += 1
        return TransferRejected(reason, message)


def stage_plan(engine: LLMEngine, producer, ledger: HandoffLedger, worker_id: str,
               req: Request, plan: TransferPlan, first_token: int,
               corrupt: bool = False, clock: Callable[[], float] = time.time) -> PrefillResult:
    """P, under its engine lock, after prefilling `req` (kept with hold_kv): stage the plan's
    blocks under a lease and let P's own blocks go (they stay in its prefix cache).
    `corrupt` flips bytes of the staged copy after the checksums were taken (chaos)."""
    rid = req.request_id
    try:
        blocks = engine.handoff.block_table(rid)
        src = blocks[plan.first_block:plan.first_block + plan.num_blocks]
        if len(src) != plan.num_blocks:
            raise RequestError(f"plan for {rid} asks for blocks {plan.first_block}.."
                               f"{plan.first_block + plan.num_blocks} of {len(blocks)}")
        pages = engine.handoff.read_pages(src)
        sums = page_checksums(pages)
        if corrupt:
            flat = pages.view(-1).view(torch.uint8)
            flat[: min(64, flat.numel())] ^= 0xFF
        lease_s = producer.leases.lease_s
        ledger.hold(worker_id, STAGED, rid, plan.num_blocks, lease_s)
        try:
            handle = producer.offer(
                rid, pages, plan.block_hashes,
                on_release=lambda _tid, reason: ledger.release(worker_id, STAGED, rid, reason))
        except BaseException:
            ledger.release(worker_id, STAGED, rid, PREFILL_FAILED)
            raise
        staged_at = clock()
    finally:
        engine.handoff.release(rid)
    lc = req.lifecycle
    return PrefillResult(plan.request_id, plan.epoch, plan.digest, first_token, handle, sums,
                         staged_at, handle.lease_s, worker_id,
                         sampler_state=engine.handoff.sampler_state(req),
                         cached_tokens=lc.cached_tokens, computed_tokens=lc.computed_tokens,
                         ttft_s=lc.ttft_s)
