"""Global prefix index: which worker holds which chained block hashes, so one lookup tells, per
worker, how many leading blocks of a request it already holds.

Two modes share the lookup:
  PrefixIndex        precise: fed by the workers' KV events (stored / removed / cleared);
  ApproxPrefixIndex  approximate: predicted from the router's own decisions, each entry living
                     `ttl_s`, for workers that publish no events.

Hashes are chained from the request's cache namespace root (kvcache.hashing), so a hash names a
whole prefix, and blocks of one tenant or adapter can never match a request of another.
Workers are kept as bits of an int mask: `_holders[h]` has bit `slot(w)` set iff the index
believes w holds h; a lookup walks the request's hashes from the front and intersects masks,
O(prefix length) whatever the number of workers or blocks indexed.

A worker may hold a block in its second tier (host memory / disk, KV events with tier 2): such a
hit costs a reload, so `match` credits it `tier2_credit` of a block (floored per worker; default
one half), and `match_tiers` gives the two counts apart.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    event_from_dict,
)
from kvcache.hashing import BlockHash

DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20
DEFAULT_TIER2_CREDIT = 0.5   # a tier-2 hit is worth half a tier-1 hit to the router


class _MaskIndex:
    """Slots for workers, hash -> worker bit mask, one LRU-ordered dict of hashes per slot.

    Invariant: bit s of `_holders[h]` is set iff h is a key of `_blocks[s]`; `_tier2[h]` is a
    subset of `_holders[h]` (those holding h in tier 2); no empty mask is stored; every `_blocks[s]` holds at most `max_blocks_per_worker` hashes.
    """

    def __init__(self, max_blocks_per_worker: int) -> None:
        assert max_blocks_per_worker > 0
        self.max_blocks_per_worker = max_blocks_per_worker
        self._slot_of: dict[str, int] = {}
        self._worker_of: list[str | None] = []
        self._blocks: list[OrderedDict[BlockHash, float | None]] = []
        self._holders: dict[BlockHash, int] = {}
        self._tier2: dict[BlockHash, int] = {}   # mask of workers holding h in tier 2 (subset)
        self.tier2_credit = DEFAULT_TIER2_CREDIT
        self._all_mask = 0
        self.trimmed = 0  # hashes dropped by the per-worker cap (not by the worker itself)

    # ---- workers -----------------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> int:
        """Register a worker (idempotent); returns its slot."""
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        try:
            slot = self._worker_of.index(None)
            self._worker_of[slot] = worker_id
        except ValueError:
            slot = len(self._worker_of)
            self._worker_of.append(worker_id)
            self._blocks.append(OrderedDict())
        self._slot_of[worker_id] = slot
        self._all_mask |= 1 << slot
        return slot

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held (it died, drained or was removed)."""
        slot = self._slot_of.pop(worker_id, None)
        if slot is None:
            return
        self._clear_slot(slot)
        self._worker_of[slot] = None
        self._all_mask &= ~(1 << slot)

    def workers(self) -> list[str]:
        return list(self._slot_of)

    # ---- queries -----------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker, how many leading blocks of `block_hashes` it holds (absent means 0),
        a tier-2 block credited `tier2_credit` of one (floored; equal to the count when no
        worker holds any of them in tier 2)."""
        held = self._match_held(block_hashes)
        if not self._tier2 or not held:
            return held
        return {w: n1 + int(n2 * self.tier2_credit)
                for w, (n1, n2) in self._split(block_hashes, held).items()}

    def match_tiers(self, block_hashes: Sequence[BlockHash]) -> dict[str, tuple[int, int]]:
        """Per worker, (tier-1 blocks, tier-2 blocks) among the leading blocks it holds."""
        return self._split(block_hashes, self._match_held(block_hashes))

    def _split(self, block_hashes: Sequence[BlockHash], held: dict[str, int]
               ) -> dict[str, tuple[int, int]]:
        out = {}
        for w, n in held.items():
            bit = 1 << self._slot_of[w]
            n2 = sum(1 for h in block_hashes[:n] if self._tier2.get(h, 0) & bit)
            out[w] = (n - n2, n2)
        return out

    def _match_held(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        holders = self._holders
        out: dict[str, int] = {}
        if not block_hashes:
            return out
        alive = holders.get(block_hashes[0], 0) & self._all_mask
        if not alive:
            return out
        for i in range(1, len(block_hashes)):
            m = holders.get(block_hashes[i], 0) & alive
            if m != alive:
                self._record(out, alive & ~m, i)
                alive = m
                if not alive:
                    return out
        self._record(out, alive, len(block_hashes))
        return out

    def _record(self, out: dict[str, int], mask: int, n: int) -> None:
        names = self._worker_of
        while mask:
            low = mask & -mask
            out[names[low.bit_length() - 1]] = n  # type: ignore[index]
            mask ^= low

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Hashes held by one worker, or distinct hashes indexed over all workers."""
        if worker_id is None:
            return len(self._holders)
        slot = self._slot_of.get(worker_id)
        return 0 if slot is None else len(self._blocks[slot])

    def blocks_of(self, worker_id: str) -> set[BlockHash]:
        slot = self._slot_of.get(worker_id)
        return set() if slot is None else set(self._blocks[slot])

    def __len__(self) -> int:
        return len(self._holders)

    # ---- mutation helpers --------------------------------------------------------------------
    def _add(self, slot: int, hashes: Iterable[BlockHash], value: float | None,
             tier: int = 1) -> None:
        bit = 1 << slot
        od = self._blocks[slot]
        holders = self._holders
        for h in hashes:
            if h in od:
                od.move_to_end(h)
            else:
                holders[h] = holders.get(h, 0) | bit
            od[h] = value
            self._set_tier(h, bit, tier)
        over = len(od) - self.max_blocks_per_worker
        if over > 0:
            self.trimmed += over
            for _ in range(over):
                h, _ = od.popitem(last=False)
                self._unset(h, bit)

    def _remove(self, slot: int, hashes: Iterable[BlockHash], tier: int | None = None) -> None:
        """Forget these hashes of the worker; with `tier`, only those it holds in that tier
        (tiers are exclusive: a stale removal from the other tier changes nothing)."""
        bit = 1 << slot
        od = self._blocks[slot]
        for h in hashes:
            if tier is not None and bool(self._tier2.get(h, 0) & bit) != (tier == 2):
                continue
            if od.pop(h, _MISSING) is not _MISSING:
                self._unset(h, bit)

    def _set_tier(self, h: BlockHash, bit: int, tier: int) -> None:
        m = self._tier2.get(h, 0)
        m = m | bit if tier == 2 else m & ~bit
        if m:
            self._tier2[h] = m
        else:
            self._tier2.pop(h, None)

    def _unset(self, h: BlockHash, bit: int) -> None:
        self._set_tier(h, bit, 1)
        m = self._holders[h] & ~bit
        if m:
            self._holders[h] = m
        else:
            del self._holders[h]

    def _clear_slot(self, slot: int) -> None:
        bit = 1 << slot
        od = self._blocks[slot]
        for h in od:
            self._unset(h, bit)
        od.clear()


_MISSING = object()


class PrefixIndex(_MaskIndex):
    """Precise mode: the union of what the workers' KV events say their prefix caches hold.

    Memory is bounded by `max_blocks_per_worker` (LRU by last store); workers' own removal events
    normally keep each worker far below it. A gap in a worker's event sequence numbers (lost
    batch) drops that worker's entries: a missed hit costs a recompute, a false hit would route
    a request to a worker that no longer has the blocks.
    """

    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        super().__init__(max_blocks_per_worker)
        self._last_seq: dict[str, int] = {}
        self.gaps = 0

    def apply(self, worker_id: str, events: Iterable[KVEvent | dict]) -> None:
        """Apply one worker's events, in the order it published them."""
        slot = self.add_worker(worker_id)
        for ev in events:
            if isinstance(ev, dict):
                ev = event_from_dict(ev)
            if isinstance(ev, BlockStored):
                self._add(slot, ev.block_hashes, None, ev.tier)
            elif isinstance(ev, BlockRemoved):
                self._remove(slot, ev.block_hashes, ev.tier)
            elif isinstance(ev, AllBlocksCleared):
                self._clear_slot(slot)
            else:
                raise TypeError(f"not a KV event: {ev!r}")

    def apply_batch(self, batch: KVEventBatch) -> bool:
        """Apply a numbered batch; returns False (after resetting the worker) on a seq gap."""
        last = self._last_seq.get(batch.worker_id)
        ok = last is None or batch.seq == last + 1
        if not ok:
            self.gaps += 1
            slot = self._slot_of.get(batch.worker_id)
            if slot is not None:
                self._clear_slot(slot)
        self._last_seq[batch.worker_id] = batch.seq
        self.apply(batch.worker_id, batch.events)
        return ok

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._last_seq.pop(worker_id, None)


class ApproxPrefixIndex(_MaskIndex):
    """Approximate mode: after the router sends a request to worker w, w is assumed to hold the
    request's blocks for `ttl_s` seconds (or a per-call ttl), refreshed by each later request
    routed there with the same blocks.

    `ttl_s=None` keeps entries until the per-worker cap trims them (LRU), which is how SGLang's
    approximate radix tree behaves. Expiry uses a heap of (expiry, slot, hash); a popped entry
    whose expiry was since refreshed is skipped.
    """

    def __init__(self, ttl_s: float | None = 120.0,
                 max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_blocks_per_worker)
        self.ttl_s = ttl_s
        self.clock = clock
        self._expiries: list[tuple[float, int, BlockHash]] = []

    def record(self, worker_id: str, block_hashes: Sequence[BlockHash],
               now: float | None = None, ttl_s: float | None = None) -> None:
        """The router sent a request with these blocks to `worker_id`."""
        now = self.clock() if now is None else now
        self.expire(now)
        slot = self.add_worker(worker_id)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if ttl is None:
            self._add(slot, block_hashes, None)
            return
        expiry = now + ttl
        self._add(slot, block_hashes, expiry)
        heap = self._expiries
        for h in block_hashes:
            heapq.heappush(heap, (expiry, slot, h))

    def match(self, block_hashes: Sequence[BlockHash], now: float | None = None) -> dict[str, int]:
        self.expire(self.clock() if now is None else now)
        return super().match(block_hashes)

    def expire(self, now: float) -> None:
        """Drop every entry whose expiry is <= now."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, slot, h = heapq.heappop(heap)
            od = self._blocks[slot]
            if od.get(h, _MISSING) == expiry:  # not refreshed, trimmed or removed since
                del od[h]
                self._unset(h, 1 << slot)

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)  # its heap entries no longer match any od value
