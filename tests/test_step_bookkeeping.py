"""Per-step bookkeeping that must not grow with the blocks held (issue: GPU path): block tables
kept as blocks are allocated, the utilization figure from O(running) counters (equal to a walk
over every block where only running requests hold blocks), and one reused pinned buffer for a
step's upload."""

from __future__ import annotations

import torch
from conftest import make_engine, random_prompt

from workers.device import PinnedStaging
from workers.request import RequestStatus, SamplingParams


def walk(scheduler) -> tuple[int, int]:
    """The figure by a walk over every block of every running request (the old way)."""
    bs = scheduler.kv.block_size
    filled: dict[int, int] = {}
    for req in scheduler.running:
        for j, block_id in enumerate(scheduler.kv.block_table(req.request_id)):
            filled[block_id] = max(filled.get(block_id, 0),
                                   min(bs, max(0, req.num_tokens - j * bs)))
    return sum(filled.values()), len(filled)


def test_stored_tokens_equals_the_block_walk_with_shared_prefixes_at_every_step(tiny_loaded):
    engine = make_engine(tiny_loaded)
    shared = random_prompt(48, seed=3)                      # 3 full blocks, shared
    engine.generate([shared + random_prompt(5, seed=1)], SamplingParams(max_tokens=2))
    for i, n in enumerate((7, 16, 23, 40)):
        engine.add_request(shared + random_prompt(n, seed=10 + i),
                           SamplingParams(max_tokens=12, ignore_eos=True))
    seen_shared = 0
    while engine.has_unfinished():
        engine.step()
        sched = engine.scheduler
        seen_shared = max(seen_shared, engine.kv.pool.shared_refs)
        assert sched.stored_tokens() == walk(sched)
        engine.kv.pool.check_invariants()                   # shared_refs agrees
    assert seen_shared >= 3              # the shared prefix was referenced by several at once
    assert engine.kv.pool.shared_refs == 0


def test_block_table_is_kept_not_rebuilt(tiny_loaded):
    engine = make_engine(tiny_loaded)
    req = engine.add_request(random_prompt(20, seed=2),
                             SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    table = engine.kv.block_table(req.request_id)
    assert engine.kv.block_table(req.request_id) is table    # the same list, no copy
    while engine.has_unfinished():
        engine.step()
        if req.status != RequestStatus.FINISHED:
            assert table == [b.block_id for b in engine.kv.blocks_of(req.request_id)]
    assert engine.kv.block_table(req.request_id) == []


def test_pinned_staging_passes_host_tensors_through_off_a_gpu():
    s = PinnedStaging(torch.device("cpu"))
    t = torch.arange(10)
    assert s.stage(t) is t and s.allocations == 0
    s.copied()


def test_pinned_staging_reuses_one_buffer_on_a_gpu():
    import pytest
    if not torch.cuda.is_available():
        pytest.skip("needs cuda")
    s = PinnedStaging(torch.device("cuda"))
    for n in (100, 50, 1000, 10):
        v = s.stage(torch.arange(n))
        assert v.is_pinned() and torch.equal(v.cpu(), torch.arange(n))
        d = v.to("cuda", non_blocking=True)
        s.copied()
        assert torch.equal(d.cpu(), torch.arange(n))
    assert s.allocations == 1      # 1024 elements at first: every size above fit


def test_an_engine_that_loaded_its_model_frees_the_stock_weights_it_fused(tiny_loaded,
                                                                          tiny_reference):
    """The compact model holds fused q/k/v and gate/up copies: an engine that loaded the model
    itself frees the stock originals; one handed a shared model leaves it whole."""
    from conftest import hf_greedy

    from workers.engine import EngineConfig, LLMEngine
    own = LLMEngine(EngineConfig(model="tiny", num_blocks=64, block_size=16))
    assert own.runner.model_impl == "compact" and own.runner.stock_bytes_released > 0
    layer = own.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == 0 and own.model.raypd_stock_released
    prompt = random_prompt(21, seed=4)
    [req] = own.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert req.output_token_ids == hf_greedy(tiny_reference, prompt, 8)
    shared = make_engine(tiny_loaded)
    assert shared.runner.stock_bytes_released == 0
    assert tiny_loaded[0].model.layers[0].self_attn.q_proj.weight.numel() > 0
