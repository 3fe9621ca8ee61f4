"""Block pool and prefix cache: refcounts, LRU eviction, namespaces, events, invariants (no model)."""

from __future__ import annotations

import random

import pytest

from kvcache.block_pool import NoFreeBlocksError
from kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    RemovalReason,
    event_from_dict,
    event_to_dict,
)
from kvcache.hashing import CacheNamespace, block_hashes, hash_block
from kvcache.manager import KVCacheManager

NS = CacheNamespace("m", "rev1", "tok1", "float32")


def _run(mgr: KVCacheManager, rid: str, tokens: list[int], ns=NS) -> int:
    """Admit, 'compute' and cache a whole prompt; returns the prefix-hit length in tokens."""
    root = ns.root_hash()
    hashes = block_hashes(tokens, mgr.block_size, root)
    hits = mgr.match_prefix(root, hashes, tokens, len(tokens) - 1)
    assert mgr.allocate_slots(rid, len(tokens), hits) is not None
    mgr.cache_computed(rid, root, hashes, tokens, len(tokens))
    return len(hits) * mgr.block_size


def test_hashes_are_deterministic_and_chained():
    toks = list(range(40))
    a = block_hashes(toks, 16, NS)
    assert a == block_hashes(toks, 16, NS) and len(a) == 2   # the partial block has no hash
    assert a[1] == hash_block(a[0], toks[16:32])
    assert block_hashes([99] + toks[1:], 16, NS)[1] != a[1], "a chain depends on its whole prefix"
    assert all(0 <= h < 2**64 for h in a)


@pytest.mark.parametrize("field, value", [("tenant", "t2"), ("lora_id", "adapter"),
                                          ("revision", "rev2"), ("tokenizer_fingerprint", "x"),
                                          ("kv_dtype", "bfloat16"), ("model_id", "m2")])
def test_namespace_isolation_no_cross_hit(field, value):
    other = CacheNamespace(**{**NS.__dict__, field: value})
    mgr = KVCacheManager(16, 4)
    toks = list(range(17))
    assert _run(mgr, "a", toks) == 0
    mgr.free("a")
    assert _run(mgr, "b", toks, ns=other) == 0, f"hit across a different {field}"
    mgr.free("b")
    assert _run(mgr, "c", toks) == 16, "same namespace must hit"
    mgr.free("c")
    mgr.pool.check_invariants()


def test_refcounts_and_sharing():
    mgr = KVCacheManager(8, 4)
    toks = list(range(9))
    _run(mgr, "a", toks)
    assert _run(mgr, "b", toks) == 8
    shared = mgr.blocks_of("a")[:2]
    assert [b.ref_cnt for b in shared] == [2, 2]
    mgr.free("a")
    assert [b.ref_cnt for b in shared] == [1, 1]
    mgr.free("b")
    assert [b.ref_cnt for b in shared] == [0, 0]
    assert mgr.pool.counts() == {"free": 6, "cached": 2, "referenced": 0, "total": 8}
    mgr.pool.check_invariants()
    with pytest.raises(AssertionError):
        mgr.pool.free([shared[0]])


def test_lru_eviction_order_tail_blocks_first():
    mgr = KVCacheManager(6, 2)
    _run(mgr, "old", [1, 2, 3, 4, 5])     # 3 blocks, 2 full -> cached
    mgr.free("old")
    _run(mgr, "new", [7, 8, 9, 10, 11])
    mgr.free("new")
    pool = mgr.pool
    pool.take_events()
    # free list is empty of uncached blocks after one more allocation of 2
    got = pool.allocate(4)
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    old_hashes = block_hashes([1, 2, 3, 4], 2, NS)
    new_hashes = block_hashes([7, 8, 9, 10], 2, NS)
    evicted = [h for e in removed for h in e.block_hashes]
    # 2 uncached free blocks go first, then LRU: the older request, its tail block first
    assert evicted == [old_hashes[1], old_hashes[0]]
    assert all(pool.contains(h) for h in new_hashes)
    assert all(e.reason is RemovalReason.EVICTED for e in removed)
    assert pool.evictions == 2
    pool.free(got)
    pool.check_invariants()


def test_touch_protects_from_eviction_and_no_free_blocks_error():
    mgr = KVCacheManager(4, 2)
    _run(mgr, "a", [1, 2, 3, 4])
    mgr.free("a")
    hits = mgr.match_prefix(NS.root_hash(), block_hashes([1, 2, 3, 4], 2, NS), [1, 2, 3, 4], 3)
    assert len(hits) == 1
    assert not mgr.can_allocate("b", 2 + 8, hits)    # 1 hit + 4 new > 4 - 1 reserved
    assert mgr.allocate_slots("b", 2 + 8, hits) is None
    mgr.pool.check_invariants()
    with pytest.raises(NoFreeBlocksError):
        mgr.pool.allocate(5)


def _replay(events, state: set[int]) -> set[int]:
    for e in events:
        e = event_from_dict(event_to_dict(e))       # events survive plain-data round trips
        if isinstance(e, BlockStored):
            state |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            state -= set(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            state = set()
    return state


def test_event_stream_matches_pool_state_random_scenario():
    rng = random.Random(0)
    mgr = KVCacheManager(24, 4)
    live: list[str] = []
    seen: set[int] = set()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        op = rng.random()
        if op < 0.5:
            toks = rng.choice(prefixes)[: rng.randrange(1, 13)] + \
                [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            root = NS.with_request(tenant=rng.choice(["", "t1"])).root_hash()
            hashes = block_hashes(toks, 4, root)
            hits = mgr.match_prefix(root, hashes, toks, len(toks) - 1)
            rid = f"r{step}"
            if mgr.allocate_slots(rid, len(toks), hits) is not None:
                mgr.cache_computed(rid, root, hashes, toks, len(toks))
                live.append(rid)
        elif op < 0.9 and live:
            mgr.free(live.pop(rng.randrange(len(live))))
        elif op < 0.95 and live:
            mgr.pool.invalidate(mgr.blocks_of(rng.choice(live))[:1])
        else:
            mgr.pool.reset_prefix_cache()
        seen = _replay(mgr.pool.take_events(), seen)
        assert seen == set(mgr.pool._cached), f"events diverged from the pool at step {step}"
        mgr.pool.check_invariants()
    for rid in live:
        mgr.free(rid)
    mgr.pool.check_invariants()
    assert mgr.pool.counts()["referenced"] == 0


def test_duplicate_prefix_built_twice_is_cached_once():
    mgr = KVCacheManager(8, 2)
    toks = [1, 2, 3, 4, 5]
    root = NS.root_hash()
    hashes = block_hashes(toks, 2, root)
    for rid in ("a", "b"):   # both admitted before either cached: no hit for b
        mgr.allocate_slots(rid, len(toks))
    assert mgr.cache_computed("a", root, hashes, toks, 5) == 2
    assert mgr.cache_computed("b", root, hashes, toks, 5) == 0
    mgr.free("a")
    mgr.free("b")
    assert mgr.pool.counts()["cached"] == 2
    mgr.pool.check_invariants()
