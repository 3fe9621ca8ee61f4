"""The float32 prefill attention (workers/kernels/csrc/attention_f32.cpp: AVX2 + FMA, causal from the bottom
right over a cached prefix and the chunk itself, grouped-query heads, sliding windows) against a
float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import attention_reference, fused_qkv_slices

from workers import attention, kernels

HAS_AVX2 = kernels.prefill_attention_f32(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                                         torch.zeros(1, 1, 16), 1.0) is not None
pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="needs the native kernels and AVX2 + FMA")


def check(tq: int, prefix: int, group: int, h_kv: int, d: int, window: int | None = None,
          seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    s = prefix + tq
    q = torch.randn(tq, group * h_kv, d, generator=g)
    k = torch.randn(s, h_kv, d, generator=g)
    v = torch.randn(s, h_kv, d, generator=g)
    got = kernels.prefill_attention_f32(q, k, v, 1 / math.sqrt(d), window)
    want = attention_reference(q, k, v, 1 / math.sqrt(d), window)
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tq,prefix", [(1, 0), (1, 70), (15, 0), (16, 0), (17, 47), (63, 1),
                                       (64, 0), (65, 64), (130, 200), (300, 0)])
def test_prefill_attention_matches_float64(group, d, tq, prefix):
    """Query blocks (48 rows of heads x tokens) and key steps of 64 (tiles of 16) below, at and
    past their sizes, prefixes that do and do not align with them: float32 to 1e-5 of the
    output's scale."""
    check(tq, prefix, group, 2 if group < 8 else 1, d, seed=tq * 1000 + prefix * 10 + d + group)


@pytest.mark.parametrize("window", [1, 7, 16, 64, 100])
@pytest.mark.parametrize("tq,prefix", [(1, 130), (40, 0), (97, 33), (200, 150)])
def test_sliding_window_matches_float64(window, tq, prefix):
    """Keys older than the window are masked per row; steps wholly outside it are skipped."""
    check(tq, prefix, 3, 2, 64, window, seed=window * 7 + tq + prefix)


def test_a_long_context_and_other_head_sizes():
    """A few thousand keys; head_dim 16 and 32; a group larger than a block (64 query heads a
    KV head: split in divisors of the group)."""
    check(70, 2900, 3, 1, 64, seed=1)
    check(20, 20, 2, 2, 16, seed=2)
    check(33, 5, 4, 1, 32, seed=3)
    check(9, 40, 64, 1, 16, seed=4)


def test_large_scores_stay_finite_and_one_hot():
    """A row whose scores differ by hundreds: the max key takes all of the weight."""
    q = torch.zeros(4, 2, 64)
    q[:, :, 0] = 30.0
    k = torch.zeros(4, 1, 64)
    k[:, 0, 0] = torch.tensor([1.0, 5.0, 2.0, 3.0])       # key 1 wins wherever it is visible
    v = torch.arange(4.0).view(4, 1, 1).expand(4, 1, 64).contiguous()
    got = kernels.prefill_attention_f32(q, k, v, 1.0)
    assert got is not None and torch.isfinite(got).all()
    assert got[0, :, 0].tolist() == [0.0, 0.0]     # row 0 sees key 0 only
    assert (got[1:, :, 0] == 1.0).all()


def test_not_applied_where_it_does_not_fit(monkeypatch):
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    b = torch.bfloat16
    assert kernels.prefill_attention_f32(q.to(b), k.to(b), k.to(b), 1.0) is None     # bf16
    assert kernels.prefill_attention_f32(q[..., :40], k[..., :40], k[..., :40], 1.0) is None
    assert kernels.prefill_attention_f32(torch.randn(5, 2, 64), k, k, 1.0) is None  # Tq > S
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "portable")
    assert kernels.prefill_attention_f32(q, k, k, 1.0) is None


def test_strided_token_rows_are_read_in_place():
    """q, k, v as slices of one fused QKV row (what the model hands over): the same result as
    contiguous copies."""
    q, k, v = fused_qkv_slices(torch.float32)
    got = kernels.prefill_attention_f32(q, k, v, 0.125)
    want = kernels.prefill_attention_f32(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("window", [None, 24])
def test_a_float32_prefill_chunk_over_a_cached_prefix_runs_it(window, monkeypatch):
    """The engine's prefill attention takes this kernel for a float32 chunk over a prefix read
    back from the pool (full and sliding-window layers), with the reference's result."""
    calls = []
    real = kernels.prefill_attention_f32
    monkeypatch.setattr(kernels, "prefill_attention_f32",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(9)
    bs, h, h_kv, d, prefix, tq = 16, 6, 2, 64, 37, 50
    pool = torch.zeros(8, bs, h_kv, d)
    vpool = torch.zeros(8, bs, h_kv, d)
    table = torch.tensor([5, 2, 7, 0, 3, 1, 4, 6])           # non-contiguous blocks
    k_all, v_all = torch.randn(prefix + tq, h_kv, d, generator=g), \
        torch.randn(prefix + tq, h_kv, d, generator=g)
    for pos in range(prefix + tq):
        pool[table[pos // bs], pos % bs] = k_all[pos]
        vpool[table[pos // bs], pos % bs] = v_all[pos]
    kv = attention.LayerKV(pool, vpool)
    seg = attention.PrefillSegment(0, tq, prefix + tq, table)
    q = torch.randn(tq, h, d, generator=g)
    got = attention._prefill_attention(q, k_all[prefix:], v_all[prefix:], kv, seg, 0.125, window)
    want = attention_reference(q, k_all, v_all, 0.125, window)
    assert calls and (got.double() - want).abs().max() / want.abs().max() < 1e-5
