"""Global prefix index: precise mode equals the union of the workers' pools, approximate mode
expires, tenants never share hits."""

import random

import pytest

from kvcache.block_pool import BlockPool
from kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    RemovalReason,
    event_to_dict,
)
from kvcache.hashing import CacheNamespace, block_hashes, hash_block
from router.prefix_index import ApproxPrefixIndex, PrefixIndex

NS = CacheNamespace("test-model")
ROOT = NS.root_hash()


def chain(tag: int, n: int, parent: int = ROOT) -> list[int]:
    out = []
    for i in range(n):
        parent = hash_block(parent, (tag, i))
        out.append(parent)
    return out


def leading(held: set[int], hashes: list[int]) -> int:
    k = 0
    for h in hashes:
        if h not in held:
            break
        k += 1
    return k


def test_match_counts_leading_blocks_per_worker():
    a = chain(1, 6)
    idx = PrefixIndex()
    idx.apply("w0", [BlockStored(tuple(a[:4]), ROOT, 4 * 16)])
    idx.apply("w1", [BlockStored(tuple(a), ROOT, 6 * 16)])
    idx.apply("w2", [BlockStored(tuple(a[1:]), a[0], 5 * 16)])  # lacks block 0: no usable prefix
    assert idx.match(a) == {"w0": 4, "w1": 6}
    assert idx.match(a[:2]) == {"w0": 2, "w1": 2}
    assert idx.match(chain(2, 3)) == {}
    assert idx.match([]) == {}


def test_removed_and_cleared_events():
    a = chain(1, 5)
    idx = PrefixIndex()
    idx.apply("w0", [BlockStored(tuple(a), ROOT, 80)])
    idx.apply("w1", [BlockStored(tuple(a), ROOT, 80)])
    idx.apply("w0", [BlockRemoved((a[2],), RemovalReason.EVICTED)])
    assert idx.match(a) == {"w0": 2, "w1": 5}
    idx.apply("w1", [AllBlocksCleared()])
    assert idx.match(a) == {"w0": 2}
    assert idx.num_blocks("w1") == 0 and idx.num_blocks("w0") == 4


def test_events_as_plain_dicts():
    a = chain(1, 3)
    idx = PrefixIndex()
    idx.apply("w0", [event_to_dict(BlockStored(tuple(a), ROOT, 48)),
                     event_to_dict(BlockRemoved((a[2],), RemovalReason.EVICTED))])
    assert idx.match(a) == {"w0": 2}


def _random_pool_ops(pool: BlockPool, rng: random.Random, prefixes: list[list[int]]) -> None:
    """One request's life on a pool: hit the cached prefix, allocate, cache, free tail first."""
    base = rng.choice(prefixes)
    hashes = base[:rng.randint(1, len(base))]
    if rng.random() < 0.3:  # a fresh suffix
        hashes = hashes + chain(rng.randint(10_000, 10**9), rng.randint(1, 4), hashes[-1])
    hashes = hashes[:pool.num_blocks]
    hits, parent = [], ROOT
    for h in hashes:
        b = pool.get_cached_block(h, parent, (h & 0xFFFF,))
        if b is None:
            break
        hits.append(b)
        parent = h
    pool.touch(hits)
    new = pool.allocate(len(hashes) - len(hits))
    pool.cache_blocks(new, hashes[len(hits):], parent, [(h & 0xFFFF,) for h in hashes[len(hits):]])
    pool.free(list(reversed(hits + new)))
    r = rng.random()
    if r < 0.02:
        pool.reset_prefix_cache()
    elif r < 0.08:
        cached = [b for b in pool.blocks if b.block_hash is not None]
        if cached:
            pool.invalidate(rng.sample(cached, min(3, len(cached))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_equals_union_of_worker_pools(seed):
    rng = random.Random(seed)
    prefixes = [chain(t, rng.randint(2, 12)) for t in range(25)]
    pools = {f"w{i}": BlockPool(rng.choice([8, 16, 40])) for i in range(4)}
    idx = PrefixIndex()
    seqs = {w: 0 for w in pools}
    for _ in range(600):
        w = rng.choice(list(pools))
        _random_pool_ops(pools[w], rng, prefixes)
        if rng.random() < 0.5:  # publish in batches, sometimes several requests at once
            for wid, pool in pools.items():
                assert idx.apply_batch(KVEventBatch(wid, seqs[wid], pool.take_events()))
                seqs[wid] += 1
    for wid, pool in pools.items():
        idx.apply(wid, pool.take_events())
        pool.check_invariants()
    for wid, pool in pools.items():
        held = {b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert idx.blocks_of(wid) == held
    union = set().union(*(idx.blocks_of(w) for w in pools))
    assert idx.num_blocks() == len(union)
    for p in prefixes:
        want = {}
        for wid, pool in pools.items():
            k = leading({b.block_hash for b in pool.blocks if b.block_hash is not None}, p)
            if k:
                want[wid] = k
        assert idx.match(p) == want


def test_per_worker_cap_trims_least_recently_stored():
    a = chain(1, 5)
    idx = PrefixIndex(max_blocks_per_worker=3)
    idx.apply("w0", [BlockStored(tuple(a[:2]), ROOT, 32)])
    idx.apply("w0", [BlockStored((a[0],), ROOT, 16)])  # refresh block 0
    idx.apply("w0", [BlockStored(tuple(a[2:4]), a[1], 32)])
    assert idx.blocks_of("w0") == {a[0], a[2], a[3]}
    assert idx.num_blocks("w0") == 3 and idx.trimmed == 1


def test_remove_worker_and_slot_reuse():
    a = chain(1, 3)
    idx = PrefixIndex()
    idx.apply("w0", [BlockStored(tuple(a), ROOT, 48)])
    idx.apply("w1", [BlockStored(tuple(a[:1]), ROOT, 16)])
    idx.remove_worker("w0")
    assert idx.match(a) == {"w1": 1}
    assert "w0" not in idx.workers()
    idx.apply("w2", [BlockStored(tuple(a[:2]), ROOT, 32)])  # reuses w0's slot
    assert idx.match(a) == {"w1": 1, "w2": 2}
    assert len(idx) == 2


def test_sequence_gap_forgets_the_worker():
    a, b = chain(1, 2), chain(2, 2)
    idx = PrefixIndex()
    assert idx.apply_batch(KVEventBatch("w0", 0, [BlockStored(tuple(a), ROOT, 32)]))
    # batch 1 was lost: its removal of `a` may never arrive, so `a` must not be trusted
    assert not idx.apply_batch(KVEventBatch("w0", 2, [BlockStored(tuple(b), ROOT, 32)]))
    assert idx.match(a) == {} and idx.match(b) == {"w0": 2}
    assert idx.gaps == 1


def test_approx_index_ttl_expiry():
    now = [0.0]
    idx = ApproxPrefixIndex(ttl_s=10.0, clock=lambda: now[0])
    a = chain(1, 4)
    idx.record("w0", a)
    idx.record("w1", a[:2])
    now[0] = 5.0
    assert idx.match(a) == {"w0": 4, "w1": 2}
    idx.record("w1", a[:1])  # refreshes block 0 on w1 until t=15
    now[0] = 10.0
    assert idx.match(a) == {"w1": 1}
    assert idx.num_blocks("w0") == 0
    now[0] = 15.0
    assert idx.match(a) == {}
    assert len(idx) == 0


def test_approx_index_per_call_ttl_and_no_ttl():
    idx = ApproxPrefixIndex(ttl_s=None, clock=lambda: 0.0)
    a = chain(1, 2)
    idx.record("w0", a, now=0.0)
    assert idx.match(a, now=1e9) == {"w0": 2}  # no TTL: kept until trimmed
    idx.record("w1", a, now=0.0, ttl_s=3.0)
    assert idx.match(a, now=2.9) == {"w0": 2, "w1": 2}
    assert idx.match(a, now=3.0) == {"w0": 2}


def test_tenants_never_share_hits():
    tokens = list(range(64))
    ns_a, ns_b = NS.with_request(tenant="acme"), NS.with_request(tenant="globex")
    ha, hb = block_hashes(tokens, 16, ns_a), block_hashes(tokens, 16, ns_b)
    assert not set(ha) & set(hb)
    idx = PrefixIndex()
    idx.apply("w0", [BlockStored(tuple(ha), ns_a.root_hash(), 64)])
    approx = ApproxPrefixIndex(ttl_s=60.0, clock=lambda: 0.0)
    approx.record("w0", ha)
    assert idx.match(ha) == {"w0": 4} and approx.match(ha) == {"w0": 4}
    assert idx.match(hb) == {} and approx.match(hb) == {}
    lora = NS.with_request(tenant="acme", lora_id="adapter-1")
    assert idx.match(block_hashes(tokens, 16, lora)) == {}
