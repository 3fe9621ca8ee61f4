"""The pool that holds KV blocks: refcounts, the prefix-cache hash map, LRU eviction, KV events.

Every block is in exactly one of three states:
  free        ref_cnt == 0, no hash       -> in `_free` (allocated first)
  cached      ref_cnt == 0, has a hash    -> in `_evictable`, LRU order (front = evicted first)
  referenced  ref_cnt >= 1 (hash or not)  -> held by at least one request or transfer lease
so free + cached + referenced == num_blocks always (`check_invariants`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, RemovalReason
from kvcache.hashing import BlockHash


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
                 enable_events: bool = True) -> None:
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_events = enable_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

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

    # ---- reference counting ----------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a transfer pin)."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_hash is not None, "only cached blocks can be re-referenced"
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """`n` blocks with ref_cnt 1: free ones first, then LRU eviction of cached ones."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.popleft()]
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                evicted.append(self._drop_hash(block))
                self.evictions += 1
            assert block.ref_cnt == 0 and block.block_hash is None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._emit(BlockRemoved(tuple(evicted), RemovalReason.EVICTED))
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a request's blocks tail first, so its leading (most shareable) blocks
        become the most recently used and are evicted last.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
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
        return {"free": free, "cached": cached, "referenced": self.num_blocks - free - cached,
                "total": self.num_blocks}

    def check_invariants(self) -> None:
        """free + cached + referenced == total; refcounts >= 0; the hash map agrees."""
        free_ids, evict_ids = set(self._free), set(self._evictable)
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
