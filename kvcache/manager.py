"""Decides which blocks a request gets: prefix matching, slot allocation, caching, freeing.

The manager maps request ids to block tables; the pool (block_pool.py) holds the blocks.
A request's block i holds its tokens [i * block_size, (i + 1) * block_size).
With a second tier (`tier2_slots`), a prefix match goes on past the pool into tier 2 and reloads
those blocks when the engine's measured costs say a reload is cheaper than prefilling them
(`costs`, fed by the engine); otherwise the match stops there and they are recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import BlockPool, KVBlock
from kvcache.hashing import BlockHash
from kvcache.tier2 import ReloadCostModel, Tier2Index


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in exact integer arithmetic (no float rounding): the one place the
    `-(-a // b)` idiom lives; import this rather than spelling it out."""
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_events: bool = True, tier2_slots: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, enable_events,
                              Tier2Index(tier2_slots) if tier2_slots > 0 else None)
        self.costs = ReloadCostModel()
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._tables: dict[str, list[int]] = {}   # req -> block ids, kept beside req_blocks
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already in the prefix cache

    def match_prefix(self, root: BlockHash, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int], max_tokens: int) -> list[KVBlock]:
        """Leading blocks of this token sequence that the cache holds, covering <= max_tokens.

        The caller passes max_tokens = num_tokens - 1 so at least one token is computed
        (its logits start decoding). Blocks found in tier 2 are reloaded into the pool here
        (when `costs` prefers it and the pool has room) and returned like any cached block:
        cached, unreferenced, so `allocate_slots` takes them as prefix hits.
        """
        if not self.pool.enable_prefix_caching:
            return []
        bs = self.block_size
        pool = self.pool
        reload = pool.tier2_enabled and self.costs.prefer_reload()
        hits: list[KVBlock | None] = []   # None: in tier 2, to reload
        parent = root
        for i in range(min(len(block_hashes), max_tokens // bs)):
            toks = token_ids[i * bs:(i + 1) * bs]
            block = pool.get_cached_block(block_hashes[i], parent, toks)
            if block is None:
                if pool.get_tier2_entry(block_hashes[i], parent, toks) is None:
                    break
                if not reload:
                    pool.tier2_stats.tier2_recomputed += 1
                    break
            hits.append(block)
            parent = block_hashes[i]
        if all(b is not None for b in hits):
            return hits  # type: ignore[return-value]
        return self._reload(hits, block_hashes)

    def _reload(self, hits: list[KVBlock | None], block_hashes: Sequence[BlockHash]
                ) -> list[KVBlock]:
        """Reload the tier-2 hits (None) of `hits`; the chain ends at the first that does not
        fit. The tier-1 hits are referenced meanwhile, so the reload's allocation cannot
        evict them."""
        pool = self.pool
        tier1 = [b for b in hits if b is not None]
        pool.touch(tier1)
        room = pool.num_free_blocks
        todo = [i for i, b in enumerate(hits) if b is None]
        cut: list[KVBlock] = []    # tier-1 hits past a reload that did not fit
        if len(todo) > room:
            cut = [b for b in hits[todo[room]:] if b is not None]
            hits = hits[:todo[room]]
            todo = todo[:room]
        reloaded: list[KVBlock] = []
        if todo:
            reloaded, seconds = pool.reload([block_hashes[i] for i in todo])
            tokens = sum(len(b.token_ids) for b in reloaded)
            if self.costs.prefill_s_per_token is not None:
                pool.tier2_stats.recompute_avoided_s += tokens * self.costs.prefill_s_per_token
            self.costs.observe_reload(tokens, seconds)
        it = iter(reloaded)
        out = [b if b is not None else next(it) for b in hits]
        pool.free(reversed(cut))     # back to cached, tail first; allocate_slots re-takes them
        pool.free(reversed(out))
        return out

    def can_allocate(self, req_id: str, num_tokens: int,
                     computed_blocks: Sequence[KVBlock] = ()) -> bool:
        held = self.req_blocks.get(req_id, [])
        need = cdiv(num_tokens, self.block_size) - len(held) - len(computed_blocks)
        # computed blocks with ref_cnt 0 sit in the evictable list; touching them removes them
        reserved = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - reserved

    def allocate_slots(self, req_id: str, num_tokens: int,
                       computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Give the request enough blocks for `num_tokens` tokens in total.

        `computed_blocks` (prefix hits, first allocation only) are referenced, not allocated.
        Returns the newly allocated blocks, or None (and changes nothing) if they don't fit.
        """
        if not self.can_allocate(req_id, num_tokens, computed_blocks):
            return None
        blocks = self.req_blocks.setdefault(req_id, [])
        table = self._tables.setdefault(req_id, [])
        if computed_blocks:
            assert not blocks, "prefix hits are only taken at a request's first allocation"
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            table.extend(b.block_id for b in computed_blocks)
            self.num_cached_blocks[req_id] = len(computed_blocks)
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        new = self.pool.allocate(need) if need > 0 else []
        blocks.extend(new)
        table.extend(b.block_id for b in new)
        return new

    def cache_computed(self, req_id: str, root: BlockHash, block_hashes: Sequence[BlockHash],
                       token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Register the request's blocks that are now full and computed. Returns how many."""
        blocks = self.req_blocks[req_id]
        start = self.num_cached_blocks.get(req_id, 0)
        end = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        if end <= start:
            return 0
        bs = self.block_size
        parent = root if start == 0 else block_hashes[start - 1]
        chunks = [token_ids[i * bs:(i + 1) * bs] for i in range(start, end)]
        n = self.pool.cache_blocks(blocks[start:end], block_hashes[start:end], parent, chunks)
        self.num_cached_blocks[req_id] = end
        return n

    def free(self, req_id: str) -> None:
        """Release every block of the request, tail first (its prefix is evicted last)."""
        blocks = self.req_blocks.pop(req_id, [])
        self._tables.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        self.pool.free(reversed(blocks))

    def block_table(self, req_id: str) -> list[int]:
        """The request's block ids in order, kept as blocks are allocated (no rebuild per step).
        Read-only: the list grows in place at the request's next allocation."""
        table = self._tables.get(req_id)
        if table is None:
            return []
        assert len(table) == len(self.req_blocks[req_id]), req_id
        return table

    def blocks_of(self, req_id: str) -> list[KVBlock]:
        return self.req_blocks.get(req_id, [])
