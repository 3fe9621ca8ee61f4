"""The pool that holds KV blocks: refcounts, the prefix-cache hash map, LRU eviction, KV events.

Every block is in exactly one of three states:
  free        ref_cnt == 0, no hash       -> in `_free` (allocated first)
  cached      ref_cnt == 0, has a hash    -> in `_evictable`, LRU order (front = evicted first)
  referenced  ref_cnt >= 1 (hash or not)  -> held by at least one request or transfer lease
so free + cached + referenced == num_blocks always (`check_invariants`).

With a second tier (`tier2` plus a `mover` that copies bytes), an LRU-evicted cached block is
demoted instead of dropped: its bytes are copied to a host-store slot (kvcache/tier2.py) before
the block is handed out again, and its hash lives on in tier 2 until tier 2's own LRU drops it.
`reload` brings tier-2 blocks back into fresh pool blocks. A hash is in one tier at a time.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, RemovalReason
from kvcache.hashing import BlockHash
from kvcache.tier2 import KVBlockMover, Tier2Entry, Tier2Index, Tier2Stats


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free or evictable; callers check `num_free_blocks` first."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = field(default=(), repr=False)


class BlockPool:
    """Owns `num_blocks` blocks; decides nothing about requests (see KVCacheManager)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 enable_events: bool = True, tier2: Tier2Index | None = None) -> None:
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_events = enable_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.shared_refs = 0     # sum over blocks of (ref_cnt - 1) where ref_cnt > 1
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.evictions = 0
        self.tier2 = tier2 if enable_prefix_caching else None
        self.mover: KVBlockMover | None = None   # set by the worker that holds the bytes
        self.tier2_stats = Tier2Stats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request references (reusable, evicted first when room is needed)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this hash, confirmed by parent and tokens (no hash collisions)."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    @property
    def tier2_enabled(self) -> bool:
        return self.tier2 is not None and self.mover is not None

    @property
    def num_tier2_blocks(self) -> int:
        return len(self.tier2) if self.tier2 is not None else 0

    def get_tier2_entry(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                        token_ids: Sequence[int]) -> Tier2Entry | None:
        """Tier 2's entry for this hash, confirmed by parent and tokens (None: not there)."""
        if not self.tier2_enabled:
            return None
        return self.tier2.get(block_hash, parent_hash, token_ids)

    # ---- reference counting ----------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a transfer pin)."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_hash is not None, "only cached blocks can be re-referenced"
                del self._evictable[block.block_id]
            else:
                self.shared_refs += 1
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """`n` blocks with ref_cnt 1: free ones first, then LRU eviction of cached ones."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        evicted: list[BlockHash] = []
        demoted: list[tuple[int, int, BlockHash]] = []   # (block_id, slot, hash)
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.popleft()]
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                self.evictions += 1
                if self.tier2_enabled:
                    self._demote(block, demoted, evicted)
                else:
                    evicted.append(self._drop_hash(block))
            assert block.ref_cnt == 0 and block.block_hash is None
            block.ref_cnt = 1
            out.append(block)
        if demoted:   # before anyone writes the blocks: their bytes are still the evicted KV
            live = [(b, s) for b, s, h in demoted if self.tier2.slot_of(h) == s]
            if live:
                self.mover.demote([b for b, _ in live], [s for _, s in live])
        if evicted:
            self._emit(BlockRemoved(tuple(evicted), RemovalReason.EVICTED))
        return out

    def _demote(self, block: KVBlock, demoted: list[tuple[int, int, BlockHash]],
                evicted: list[BlockHash]) -> None:
        """Move an evicted block's hash to tier 2 (its bytes are copied by the caller)."""
        parent, toks = block.parent_hash, block.token_ids
        h = self._drop_hash(block)
        slot, dropped = self.tier2.put(h, parent, toks)
        if slot is None:
            evicted.append(h)
            return
        if dropped is not None:
            self.tier2_stats.tier2_dropped += 1
            self._emit(BlockRemoved((dropped,), RemovalReason.EVICTED, tier=2))
        self.tier2_stats.tier2_demotions += 1
        self._emit(BlockStored((h,), parent, len(toks), tier=2))
        demoted.append((block.block_id, slot, h))

    def reload(self, hashes: Sequence[BlockHash]) -> tuple[list[KVBlock], float]:
        """Bring these tier-2 blocks (one chain, in order) back into fresh pool blocks, cached
        in tier 1 and referenced once each (the caller frees them). Returns (blocks, seconds the
        copy took). The caller checked `num_free_blocks >= len(hashes)`."""
        assert self.tier2_enabled and hashes
        if len(hashes) > self.num_free_blocks:
            raise NoFreeBlocksError(f"reload needs {len(hashes)} blocks, "
                                    f"{self.num_free_blocks} free")
        entries = [self.tier2.take(h) for h in hashes]   # slots held: no demotion reuses them
        try:
            blocks = self.allocate(len(hashes))
            t0 = time.perf_counter()
            self.mover.reload([e.slot for e in entries], [b.block_id for b in blocks])
            seconds = time.perf_counter() - t0
        finally:
            for e in entries:
                self.tier2.release(e.slot)
        num_tokens = 0
        for block, h, e in zip(blocks, hashes, entries, strict=True):
            assert h not in self._cached
            block.block_hash, block.parent_hash, block.token_ids = h, e.parent_hash, e.token_ids
            self._cached[h] = block
            num_tokens += len(e.token_ids)
        self._emit(BlockStored(tuple(hashes), entries[0].parent_hash, num_tokens))
        st = self.tier2_stats
        st.tier2_hits += len(hashes)
        st.reloaded_tokens += num_tokens
        st.reload_s += seconds
        return blocks, seconds

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a request's blocks tail first, so its leading (most shareable) blocks
        become the most recently used and are evicted last.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt:
                self.shared_refs -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._evictable[block.block_id] = None
                else:
                    self._free.append(block.block_id)

    # ---- prefix cache ------------------------------------------------------------------------
    def cache_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash],
                     parent_hash: BlockHash | None, token_chunks: Sequence[Sequence[int]]) -> int:
        """Register full, computed blocks (in chain order) in the prefix cache.

        A hash that another block already holds is left uncached here (two requests built the
        same prefix at once); the duplicate returns to the free list when released.
        Returns how many blocks were newly cached.
        """
        assert len(blocks) == len(hashes) == len(token_chunks)
        if not self.enable_prefix_caching or not blocks:
            return 0
        stored: list[BlockHash] = []
        first_parent = parent_hash
        num_tokens = 0
        for block, h, toks in zip(blocks, hashes, token_chunks, strict=True):
            assert block.ref_cnt > 0, "only referenced blocks are cached"
            if block.block_hash is None and h not in self._cached:
                block.block_hash, block.parent_hash, block.token_ids = h, parent_hash, tuple(toks)
                self._cached[h] = block
                if self.tier2 is not None:   # recomputed: tier 1 holds it now (BlockStored)
                    self.tier2.discard(h)
                if not stored:
                    first_parent = parent_hash
                stored.append(h)
                num_tokens += len(toks)
            elif stored:  # keep each event a contiguous chain
                self._emit(BlockStored(tuple(stored), first_parent, num_tokens))
                stored, num_tokens = [], 0
            parent_hash = h
        if stored:
            self._emit(BlockStored(tuple(stored), first_parent, num_tokens))
        return len(stored)

    def invalidate(self, blocks: Iterable[KVBlock],
                   reason: RemovalReason = RemovalReason.INVALIDATED) -> None:
        """Remove blocks from the prefix cache (their contents must not be reused)."""
        dropped = []
        for block in blocks:
            if block.block_hash is None:
                continue
            dropped.append(self._drop_hash(block))
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
                self._free.append(block.block_id)
        if dropped:
            self._emit(BlockRemoved(tuple(dropped), reason))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, just no longer shareable)."""
        for block in list(self._cached.values()):
            self._drop_hash(block)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._free.append(block_id)
        if self.tier2 is not None:
            self.tier2.clear()
        self._emit(AllBlocksCleared())

    def _drop_hash(self, block: KVBlock) -> BlockHash:
        h = block.block_hash
        assert h is not None and self._cached.get(h) is block
        del self._cached[h]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        return h

    # ---- events and invariants -------------------------------------------------------------------
    def _emit(self, event: KVEvent) -> None:
        if self.enable_events:
            self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def counts(self) -> dict[str, int]:
        free = len(self._free)
        cached = len(self._evictable)
        out = {"free": free, "cached": cached, "referenced": self.num_blocks - free - cached,
               "total": self.num_blocks}
        if self.tier2 is not None:
            out["tier2"] = len(self.tier2)
        return out

    def check_invariants(self) -> None:
        """free + cached + referenced == total; refcounts >= 0; the hash map agrees."""
        free_ids, evict_ids = set(self._free), set(self._evictable)
        assert self.shared_refs == sum(max(0, b.ref_cnt - 1) for b in self.blocks), \
            "shared_refs out of step with the refcounts"
        assert len(free_ids) == len(self._free), "a block is twice in the free list"
        assert not (free_ids & evict_ids), "a block is both free and cached"
        referenced = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.ref_cnt > 0:
                referenced += 1
                assert block.block_id not in free_ids and block.block_id not in evict_ids
            elif block.block_hash is None:
                assert block.block_id in free_ids, f"block {block.block_id} lost (unhashed)"
            else:
                assert block.block_id in evict_ids, f"block {block.block_id} lost (cached)"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block
        assert len(free_ids) + len(evict_ids) + referenced == self.num_blocks
        assert all(b.block_hash == h for h, b in self._cached.items())
        if self.tier2 is not None:
            self.tier2.check_invariants()
            assert not any(h in self._cached for h in self.tier2.hashes()), \
                "a hash is in both tiers"
