"""`raypd bench capacity`: the plain figure is what transformers' cache really holds, the paged
figures are what the real KV manager allocates, prefix sharing stores the shared blocks once."""

from __future__ import annotations

import torch

from kvcache.kv_sizing import size_kv
from raypd.bench.capacity import max_concurrency, peak_bytes, render_html, run_capacity


def test_plain_is_what_transformers_cache_holds(tiny_reference):
    n, ctx = 3, 20
    with torch.inference_mode():
        out = tiny_reference(torch.randint(3, 200, (n, ctx)), use_cache=True)
    cache = out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    bpt = size_kv(tiny_reference.config, "float32").bytes_per_token
    assert peak_bytes("plain", n, ctx, 0, bpt, 0, 16) == held


def test_paged_rounds_up_to_blocks_and_prefix_sharing_stores_shared_blocks_once():
    bpt, bs = 100.0, 16
    bpb = int(bpt * bs)
    args = dict(bytes_per_token_plain=bpt, bytes_per_block=bpb, block_size=bs)
    assert peak_bytes("paged", 4, 20, 10, **args) == 4 * 2 * bpb       # 20 tokens: 2 blocks
    # 40 shared tokens = 2 full shared blocks + 3 own blocks per request (64 tokens)
    assert peak_bytes("paged_prefix", 4, 64, 40, **args) == (2 + 4 * 2) * bpb
    assert peak_bytes("plain", 4, 64, 40, **args) == 4 * 64 * 100
    assert peak_bytes("plain_static", 4, 64, 40, **args, max_len=2048) == 4 * 2048 * 100
    budget = 10 * bpb
    assert max_concurrency("paged", budget, 64, 40, **args) == 2            # 4 blocks each
    assert max_concurrency("paged_prefix", budget, 64, 40, **args) == 4     # 2 + 2 each


def test_run_and_html_on_tiny(tmp_path):
    r = run_capacity("tiny", contexts=[256, 512], concurrencies=[1, 8], tpot_contexts=[],
                     budget_gb=0.001, budgets_gb=(0.0005, 0.001))
    for s in ("plain_static", "plain", "paged", "paged_prefix"):
        assert len(r["peak_bytes_vs_context"][s]) == 2
    assert r["max_concurrency_in_budget"]["paged_prefix"][0] > \
        r["max_concurrency_in_budget"]["paged"][0]
    assert [b["block_size"] for b in r["block_sizes"]] == [8, 16, 32, 64]
    page = render_html(r)
    assert page.count("<img") == 3


def test_tpot_is_timed_on_reserved_requests_decoding(tiny_loaded):
    from raypd.bench.capacity import measure_tpot
    assert measure_tpot("tiny", tiny_loaded, "float32", n=2, context=40, block_size=16,
                        steps=2) > 0
