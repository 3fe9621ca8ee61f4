"""The bf16 prefill attention (workers/kernels/csrc/attention_bf16.cpp: causal from the bottom right over a
cached prefix and the chunk itself, grouped-query heads, sliding windows on AVX512-BF16) on each
path this CPU has (AMX-BF16; AVX512-BF16, forced by RAYPD_KERNEL_ISA=avx512bf16 where AMX is
there too) against a float32 reference."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import attention_reference, fused_qkv_slices

from kvcache.manager import cdiv
from workers import kernels

BF16 = torch.bfloat16
HAS_AMX = kernels.linear_amx_rows(torch.empty(1, 32, dtype=BF16)) > 0
HAS_AVX512_BF16 = kernels.linear_small_m_rows(torch.empty(1, 32, dtype=BF16)) > 0
pytestmark = pytest.mark.skipif(not (HAS_AMX or HAS_AVX512_BF16),
                                reason="needs the native kernels and AVX512-BF16")
PATHS = [pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")),
         pytest.param("avx512bf16", marks=pytest.mark.skipif(
             not HAS_AVX512_BF16, reason="needs AVX512-BF16"))]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "avx512bf16":
        monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx512bf16")   # (no AMX even where it is)
    return request.param


def _close(got: torch.Tensor | None, want: torch.Tensor, q: torch.Tensor) -> None:
    """bf16 inputs, float32 sums, P rounded to bf16: within 2^-7 of the output's scale plus
    1e-2 (bf16 output rounding and P's)."""
    assert got is not None and got.dtype == BF16 and got.shape == q.shape
    assert ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-2).all()


def _inputs(tq: int, prefix: int, heads: int, h_kv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = prefix + tq
    return (torch.randn(tq, heads, d, generator=g).to(BF16),
            torch.randn(s, h_kv, d, generator=g).to(BF16),
            torch.randn(s, h_kv, d, generator=g).to(BF16))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("tq,prefix", [(1, 0), (1, 70), (15, 0), (16, 0), (17, 47), (63, 1),
                                       (64, 0), (65, 64), (130, 200), (300, 0)])
def test_prefill_attention_matches_float32(path, group, d, tq, prefix):
    """Query blocks of 16 and key steps of 32 and 64 below, at and past their sizes, prefixes
    that do and do not align with them."""
    h_kv = 2 if group < 8 else 1
    q, k, v = _inputs(tq, prefix, group * h_kv, h_kv, d, tq * 1000 + prefix * 10 + d + group)
    got = kernels.prefill_attention_bf16(q, k, v, 1 / math.sqrt(d))
    _close(got, attention_reference(q, k, v, 1 / math.sqrt(d)), q)


@pytest.mark.parametrize("window", [1, 5, 16, 31, 32, 33, 100, 1000])
@pytest.mark.parametrize("tq,prefix", [(1, 70), (17, 47), (130, 200), (300, 0)])
def test_a_sliding_window_matches_float32_on_avx512_bf16(monkeypatch, window, tq, prefix):
    """Windows shorter and longer than a key step, starting inside one and across steps that
    no row of a query block sees (skipped)."""
    if not HAS_AVX512_BF16:
        pytest.skip("needs AVX512-BF16")
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx512bf16")
    q, k, v = _inputs(tq, prefix, 6, 2, 64, window * 7 + tq)
    got = kernels.prefill_attention_bf16(q, k, v, 0.125, window)
    _close(got, attention_reference(q, k, v, 0.125, window), q)


def test_large_scores_stay_finite_and_one_hot(path):
    """A row whose scores differ by hundreds: the max key takes all of the weight."""
    q = torch.zeros(4, 2, 64)
    q[:, :, 0] = 30.0
    k = torch.zeros(4, 1, 64)
    k[:, 0, 0] = torch.tensor([1.0, 5.0, 2.0, 3.0])       # key 1 wins wherever it is visible
    v = torch.arange(4.0).view(4, 1, 1).expand(4, 1, 64).contiguous()
    got = kernels.prefill_attention_bf16(q.to(BF16), k.to(BF16), v.to(BF16), 1.0)
    assert got is not None and torch.isfinite(got.float()).all()
    assert got[0, :, 0].float().tolist() == [0.0, 0.0]     # row 0 sees key 0 only
    assert (got[1:, :, 0].float() == 1.0).all()


def test_not_applied_where_it_does_not_fit(monkeypatch):
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    assert kernels.prefill_attention_bf16(q, k, k, 1.0) is None                  # float32
    qb, kb = q.to(BF16), k.to(BF16)
    assert kernels.prefill_attention_bf16(qb[..., :48], kb[..., :48], kb[..., :48], 1.0) is None
    assert kernels.prefill_attention_bf16(torch.randn(5, 2, 64).to(BF16), kb, kb, 1.0) is None
    assert kernels.prefill_attention_bf16(qb, kb, kb, 1.0, window=0) is None
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx2")
    assert kernels.prefill_attention_bf16(qb, kb, kb, 1.0) is None


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")
def test_amx_leaves_a_sliding_window_to_avx512_bf16():
    """The AMX path has no window; the AVX512-BF16 one takes it (same CPU)."""
    q, k, v = _inputs(40, 10, 6, 2, 64, 9)
    want = attention_reference(q, k, v, 0.125, 8)
    _close(kernels.prefill_attention_bf16(q, k, v, 0.125, 8), want, q)


def test_strided_token_rows_are_read_in_place(path):
    """q, k, v as slices of one fused QKV row (what the model hands over): same result as
    contiguous copies."""
    q, k, v = fused_qkv_slices(BF16)
    got = kernels.prefill_attention_bf16(q, k, v, 0.125)
    want = kernels.prefill_attention_bf16(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert got is not None and torch.equal(got, want)


def _paged(k: torch.Tensor, v: torch.Tensor, bs: int, seed: int, spare: int = 5):
    """k, v [S, Hkv, D] scattered over a pool of blocks of `bs` (in a shuffled order, with
    blocks no one uses between them): (k_pool, v_pool, block_table)."""
    g = torch.Generator().manual_seed(seed)
    s, h_kv, d = k.shape
    need = cdiv(s, bs)
    num_blocks = need + spare
    table = torch.randperm(num_blocks, generator=g)[:need]
    pools = []
    for x in (k, v):
        pool = torch.randn(num_blocks, bs, h_kv, d, generator=g).to(BF16)   # stale slots
        flat = pool.view(-1, h_kv, d)
        slots = table[torch.arange(s) // bs] * bs + torch.arange(s) % bs
        flat[slots] = x
        pools.append(pool)
    return pools[0], pools[1], table


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("tq,prefix", [(1, 15), (1, 16), (7, 9), (16, 17), (17, 47),
                                       (100, 412), (8, 504)])
@pytest.mark.parametrize("window", [None, 40])
def test_the_paged_pool_read_in_place_equals_the_gathered_rows(path, bs, tq, prefix, window):
    """A chunk over its cached prefix read through the block table from the pool (no gathered
    copy): bit for bit what the same rows laid out contiguously give, whatever the block edges
    (stale slots past the context are never read)."""
    if window is not None and path == "amx":
        pytest.skip("the AMX path has no window")
    q, k, v = _inputs(tq, prefix, 6, 2, 64, tq * 31 + prefix)
    k_pool, v_pool, table = _paged(k, v, bs, seed=prefix + bs)
    want = kernels.prefill_attention_bf16(q, k, v, 0.125, window)
    got = kernels.prefill_attention_bf16(q, k_pool, v_pool, 0.125, window, table, prefix + tq)
    assert got is not None and torch.equal(got, want)


def test_a_table_that_does_not_cover_the_context_is_refused(path):
    q, k, v = _inputs(4, 28, 2, 1, 64, 0)
    k_pool, v_pool, table = _paged(k, v, 16, seed=1)
    with pytest.raises(ValueError, match="block table"):
        kernels.prefill_attention_bf16(q, k_pool, v_pool, 1.0, None, table[:1], 32)
    bad = table.clone()
    bad[1] = k_pool.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.prefill_attention_bf16(q, k_pool, v_pool, 1.0, None, bad, 32)


def test_a_short_context_after_a_long_one_reads_none_of_its_keys(path):
    """The packed K and V live in a buffer kept from call to call and never zeroed: a short
    context after a long one whose keys and values were NaN must see none of them (its padding
    past S is written, not left over: a masked key's weight 0 times a stale NaN is NaN). A
    context too long to keep a buffer for (over 64 MB packed: 8 KV heads x 128 x 17,000 keys)
    gets one of its own, after which the kept one serves again."""
    scale = 1 / math.sqrt(128)
    q, k, v = _inputs(40, 900, 4, 2, 128, 1)
    kernels.prefill_attention_bf16(q, k.fill_(float("nan")), v.fill_(float("nan")), scale)
    for tq, prefix, h_kv, seed in [(3, 5, 2, 2), (2, 17_000, 8, 3), (17, 30, 2, 4), (1, 0, 2, 5)]:
        q, k, v = _inputs(tq, prefix, 2 * h_kv, h_kv, 128, seed)
        got = kernels.prefill_attention_bf16(q, k, v, scale)
        _close(got, attention_reference(q, k, v, scale), q)
