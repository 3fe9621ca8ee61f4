"""The compact model's fused small ops (workers/kernels/csrc/fused_ops.cpp, bf16 and float32 on the CPU)
against the torch ops they replace, and the whole bf16 engine with them against the engine
without them (the float32 engine with them against transformers: tests/test_fast_engine.py)."""

from __future__ import annotations

import pytest
import torch

from workers import kernels
from workers.layers import RotaryEmbedding, rms_norm, silu_and_mul

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason="the native kernels could not be built (no C++ compiler)")
BF16 = torch.bfloat16


DTYPES = [BF16, torch.float32]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs: the fused op rounds once where torch rounds after each op (2^-8 relative
    each), so they agree to a few bf16 ulps. float32: the same values up to the order of the
    norm's sum, FMA contraction and the exp's last bit (a few float32 ulps)."""
    assert got.dtype == want.dtype
    tol = 2e-2 if got.dtype == BF16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_the_residual_add_then_rmsnorm(tokens, with_delta, dtype):
    g = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 576, generator=g).to(dtype)
    delta = torch.randn(tokens, 576, generator=g).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want_h = h + delta if with_delta else h.clone()
    want_x = rms_norm(want_h, w, 1e-5)
    x = kernels.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, want_h)          # the residual stream: exactly torch's add
    close(x, want_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 40])
def test_rope_and_cache_rotates_in_place_and_writes_the_slots(tokens, dtype):
    from transformers import LlamaConfig
    heads, kv_heads, d, num_slots = 9, 3, 64, 256
    rope = RotaryEmbedding(LlamaConfig(), d, 512, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    cos_sin = rope.tables(positions)
    want_qk = RotaryEmbedding.apply(qkv[:, :heads + kv_heads], cos_sin)
    want_v = qkv[:, heads + kv_heads:].clone()
    k_cache = torch.zeros(num_slots // 16, 16, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kernels.rope_and_cache(qkv, *cos_sin, k_cache, v_cache, slots, heads, kv_heads)
    close(qkv[:, :heads + kv_heads], want_qk)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    assert torch.equal(flat_k[slots], qkv[:, heads:heads + kv_heads])   # the rotated k
    assert torch.equal(flat_v[slots], want_v)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.rope_and_cache(qkv, *cos_sin, k_cache, v_cache, slots + num_slots, heads,
                               kv_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [5, 40])
def test_silu_mul_is_silu_of_the_gate_times_up(tokens, dtype):
    gate_up = torch.randn(tokens, 2 * 1536, generator=torch.Generator().manual_seed(3)).to(dtype)
    close(kernels.silu_mul(gate_up), silu_and_mul(gate_up))


def test_the_float32_compact_model_fuses_its_ops_and_the_switch_turns_them_off(monkeypatch):
    """A float32 model on the CPU runs the fused ops; RAYPD_FUSED_OPS=0 keeps torch's own."""
    cpu = torch.device("cpu")
    assert kernels.fused_ops_apply(torch.float32, cpu, 576)
    assert not kernels.fused_ops_apply(torch.float16, cpu, 576)
    monkeypatch.setenv("RAYPD_FUSED_OPS", "0")
    assert not kernels.fused_ops_apply(torch.float32, cpu, 576)
    assert not kernels.fused_ops_apply(BF16, cpu, 576)


def test_the_bf16_engine_with_fused_ops_stays_with_the_one_without(monkeypatch, tiny_loaded):
    """Greedy tokens of the bf16 compact model with the fused ops and without them (torch's
    ops): the same, or diverging only late (different rounding, one bf16 ulp)."""
    from conftest import make_engine, random_prompt

    from workers.model_loader import load_model
    from workers.request import SamplingParams
    loaded = load_model("tiny", "bfloat16")
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 40, 90)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = make_engine(loaded)
    assert engine.runner.compact.fused
    fused = [r.output_token_ids for r in engine.generate(prompts, greedy)]
    monkeypatch.setattr(kernels, "fused_ops_apply", lambda *a: False)
    plain_engine = make_engine(loaded)
    assert not plain_engine.runner.compact.fused
    plain = [r.output_token_ids for r in plain_engine.generate(prompts, greedy)]
    agree = [next((i for i, (a, b) in enumerate(zip(f, p, strict=True)) if a != b), len(f))
             for f, p in zip(fused, plain, strict=True)]
    assert sum(agree) >= 0.8 * sum(len(f) for f in fused), (agree, fused, plain)
