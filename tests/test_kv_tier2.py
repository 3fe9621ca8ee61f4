"""The second KV tier: evicted cached blocks are demoted to a host store (LRU, up to a slot
budget), a later prefix hit reloads them bit-exact when the measured costs favour it, greedy
output is the same as when the blocks stayed in the pool, nothing leaks, KV events say the tier
and the router's index credits a tier-2 hit less than a tier-1 hit."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_engine, random_prompt

from kvcache.events import (
    BlockRemoved,
    BlockStored,
    RemovalReason,
    event_from_dict,
    event_to_dict,
)
from kvcache.hashing import block_hashes
from kvcache.manager import KVCacheManager
from kvcache.tier2 import ReloadCostModel
from router.prefix_index import PrefixIndex
from workers.request import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


class DictMover:
    """Tier-2 bytes as a dict; the pool's 'bytes' are a list of per-block payloads."""

    def __init__(self, num_blocks: int) -> None:
        self.data: list[object] = [None] * num_blocks
        self.store: dict[int, object] = {}
        self.reloads = 0

    def demote(self, block_ids, slots) -> None:
        for b, s in zip(block_ids, slots, strict=True):
            self.store[s] = self.data[b]

    def reload(self, slots, block_ids) -> None:
        self.reloads += 1
        for s, b in zip(slots, block_ids, strict=True):
            self.data[b] = self.store[s]


def _manager(num_blocks: int, tier2_slots: int) -> tuple[KVCacheManager, DictMover]:
    mgr = KVCacheManager(num_blocks, BS, tier2_slots=tier2_slots)
    mover = DictMover(num_blocks)
    mgr.pool.mover = mover
    return mgr, mover


def _run(mgr: KVCacheManager, mover: DictMover, rid: str, toks: list[int]) -> int:
    """Admit `toks`, 'compute' its blocks (payload = the block's tokens), cache and free.
    Returns how many leading blocks came from the cache."""
    hashes = block_hashes(toks, BS, 0)
    hits = mgr.match_prefix(0, hashes, toks, len(toks) - 1)
    for i, b in enumerate(hits):   # a hit's payload is exactly its tokens (reloaded bit-exact)
        assert mover.data[b.block_id] == tuple(toks[i * BS:(i + 1) * BS])
    assert mgr.allocate_slots(rid, len(toks), hits) is not None
    for i, b in enumerate(mgr.blocks_of(rid)[len(hits):], start=len(hits)):
        mover.data[b.block_id] = tuple(toks[i * BS:(i + 1) * BS])
    mgr.cache_computed(rid, 0, hashes, toks, len(toks))
    mgr.free(rid)
    mgr.pool.check_invariants()
    return len(hits)


def test_evicted_blocks_demote_to_tier2_and_reload_on_a_later_hit():
    mgr, mover = _manager(num_blocks=4, tier2_slots=8)
    a, b = list(range(100, 116)), list(range(200, 216))   # 4 blocks each
    assert _run(mgr, mover, "a", a) == 0
    assert _run(mgr, mover, "b", b) == 0                  # evicts all of a's blocks into tier 2
    st = mgr.pool.tier2_stats
    assert st.tier2_demotions == 4 and mgr.pool.num_tier2_blocks == 4
    assert _run(mgr, mover, "a2", a) == 3                 # last token is always computed
    assert st.tier2_hits == 3 and st.reloaded_tokens == 12 and mover.reloads == 1
    assert mgr.pool.counts()["referenced"] == 0


def test_tier2_is_lru_within_its_slot_budget():
    mgr, mover = _manager(num_blocks=2, tier2_slots=3)
    chains = [list(range(k * 100, k * 100 + 8)) for k in range(1, 5)]   # 2 blocks each
    for i, toks in enumerate(chains):
        _run(mgr, mover, f"r{i}", toks)
    # 6 blocks were evicted (each chain tail first) into 3 slots: the 3 most recently evicted
    # remain, the rest were dropped
    assert mgr.pool.num_tier2_blocks == 3
    assert mgr.pool.tier2_stats.tier2_demotions == 6
    assert mgr.pool.tier2_stats.tier2_dropped == 3
    held = set(mgr.pool.tier2.hashes())
    h = [block_hashes(t, BS, 0) for t in chains]
    assert held == {h[1][0], h[2][1], h[2][0]}
    assert len(mover.store) <= 3


def test_reload_is_skipped_when_measured_costlier_than_prefill():
    mgr, mover = _manager(num_blocks=4, tier2_slots=8)
    a, b = list(range(100, 116)), list(range(200, 216))
    _run(mgr, mover, "a", a)
    _run(mgr, mover, "b", b)
    mgr.costs.observe_reload(100, 1.0)     # 10 ms/token to reload
    mgr.costs.observe_prefill(100, 0.1)    # 1 ms/token to prefill
    assert _run(mgr, mover, "a2", a) == 0
    assert mgr.pool.tier2_stats.tier2_recomputed >= 1 and mover.reloads == 0
    # recomputing put a's blocks back into tier 1: tier 2 no longer holds them (exclusive)
    assert not any(x in mgr.pool.tier2 for x in block_hashes(a, BS, 0))


def test_prefill_cost_is_the_marginal_cost_of_a_token():
    """A step's fixed cost is paid with or without a reload: steps of 8 and 72 tokens costing
    0.1 s + 1 ms per token give 1 ms per token, not the 3-13 ms of their means."""
    costs = ReloadCostModel()
    assert costs.prefill_s_per_token is None and costs.prefer_reload()
    for n in (8, 72, 8, 72, 40):
        costs.observe_prefill(n, 0.1 + 1e-3 * n)
    assert costs.prefill_s_per_token == pytest.approx(1e-3)
    costs.observe_reload(64, 64 * 2e-3)
    assert not costs.prefer_reload()


def test_reload_never_evicts_the_tier1_hits_of_the_same_prefix():
    mgr, mover = _manager(num_blocks=5, tier2_slots=8)
    a = list(range(100, 116))
    _run(mgr, mover, "a", a)
    # evict a's last two blocks only (tail first): a 3-block request, one block still free
    _run(mgr, mover, "b", list(range(200, 212)))
    ha = block_hashes(a, BS, 0)
    assert mgr.pool.contains(ha[0]) and mgr.pool.contains(ha[1])
    assert ha[2] in mgr.pool.tier2 and ha[3] in mgr.pool.tier2
    assert _run(mgr, mover, "a2", a + [7]) == 4           # 2 from tier 1, 2 reloaded
    assert mgr.pool.tier2_stats.tier2_hits == 2


def test_kv_events_name_the_tier_and_the_index_credits_tier2_less():
    mgr, mover = _manager(num_blocks=4, tier2_slots=8)
    a, b = list(range(100, 116)), list(range(200, 216))
    _run(mgr, mover, "a", a)
    _run(mgr, mover, "b", b)
    events = mgr.pool.take_events()
    assert any(isinstance(e, BlockStored) and e.tier == 2 for e in events)
    assert all(event_from_dict(event_to_dict(e)) == e for e in events)
    index = PrefixIndex()
    index.apply("w1", events)
    ha, hb = block_hashes(a, BS, 0), block_hashes(b, BS, 0)
    index.apply("w0", [BlockStored(tuple(ha), 0, 16)])   # w0 holds a in tier 1
    assert index.match_tiers(ha) == {"w0": (4, 0), "w1": (0, 4)}
    m = index.match(ha)
    assert m["w1"] < m["w0"] == 4
    assert index.match(hb) == {"w1": 4}
    # a reload (and the recomputed last block) move a back to tier 1 on w1; b went to tier 2
    _run(mgr, mover, "a2", a)
    index.apply("w1", mgr.pool.take_events())
    assert index.match_tiers(ha)["w1"] == (4, 0) and index.match_tiers(hb)["w1"] == (0, 4)
    # a removal from tier 2 leaves a tier-1 holding alone, and drops a tier-2 one
    index.apply("w1", [BlockRemoved((ha[0], hb[0]), RemovalReason.EVICTED, tier=2)])
    assert index.match_tiers(ha)["w1"] == (4, 0)
    assert "w1" not in index.match(hb)


# ---- the engine: real KV bytes through the host store -----------------------------------------
def _evict_and_rehit(engine, shared: list[int], other: list[int]):
    [first] = engine.generate([shared + [5]], GREEDY)
    engine.generate([other], GREEDY)                  # fills the pool: `shared` is evicted
    [again] = engine.generate([shared + [9]], GREEDY)
    return first, again


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8"])
def test_tier2_reload_is_bit_exact_and_greedy_identical(tiny_loaded, tiny_reference, kv_dtype):
    shared, other = random_prompt(48, seed=21), random_prompt(80, seed=22)
    kw = dict(kv_dtype=kv_dtype, block_size=16)
    # reference: a pool big enough that `shared` stays in tier 1
    ref = make_engine(tiny_loaded, num_blocks=64, **kw)
    _, ref_again = _evict_and_rehit(ref, shared, other)
    assert ref_again.lifecycle.cached_tokens == 48
    small = make_engine(tiny_loaded, num_blocks=6, kv_tier2_gb=1e-3, **kw)
    first_pages = {}
    [first] = small.generate([shared + [5]], GREEDY)
    hashes = first.block_hashes[:3]
    for h in hashes:
        first_pages[h] = small.handoff.read_pages([small.kv.pool._cached[h].block_id]).clone()
    small.generate([other], GREEDY)
    assert all(h in small.kv.pool.tier2 for h in hashes), "shared's blocks were not demoted"
    [again] = small.generate([shared + [9]], GREEDY)
    stats = small.get_stats()
    assert stats["tier2_hits"] == 3 and stats["reloaded_tokens"] == 48
    assert again.lifecycle.cached_tokens == 48
    assert again.output_token_ids == ref_again.output_token_ids
    if kv_dtype == "float32":   # the tiny model is float32: also stock transformers
        assert again.output_token_ids == hf_greedy(tiny_reference, shared + [9], 8)
    for h in hashes:          # the reloaded blocks' bytes equal what was demoted, bit for bit
        page = small.handoff.read_pages([small.kv.pool._cached[h].block_id])
        assert torch.equal(page.view(torch.uint8), first_pages[h].view(torch.uint8))
    small.check_invariants()
    assert small.kv.pool.counts()["referenced"] == 0
    assert stats["tier2_blocks"] == small.kv.pool.num_tier2_blocks
    assert stats["reload_s"] > 0


@pytest.mark.realmodel
def test_smollm2_tier2_reload_matches_transformers():
    """SmolLM2 (float32): a system prompt demoted to tier 2 and reloaded gives the same greedy
    tokens as stock transformers generate() (which the tier-1 path equals: test_engine.py)."""
    from workers.engine import EngineConfig, LLMEngine
    from workers.model_loader import load_model
    reference = load_model("smollm2", "float32")[0]
    engine = LLMEngine(EngineConfig(model="smollm2", dtype="float32", num_blocks=5,
                                    block_size=16, kv_tier2_gb=0.05))
    system = ("You are a concise assistant. Answer in one short sentence, name facts plainly, "
              "and never invent sources or numbers that you are not sure about.")
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("What is the capital of France?", "Name a primary color.")]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.generate([msgs[0]], sp)
    engine.generate([random_prompt(72, seed=5, vocab=5000, low=100)], sp)  # evicts it all
    [r] = engine.generate([msgs[1]], sp)
    stats = engine.get_stats()
    assert r.lifecycle.cached_tokens >= 32
    assert stats["reloaded_tokens"] == r.lifecycle.cached_tokens == 16 * stats["tier2_hits"]
    assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 8)
    engine.check_invariants()
