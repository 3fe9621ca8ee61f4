"""The compact model's fused ops on cuda (workers/kernels/triton_ops.py) against the torch ops they replace
(transformers' own formulas). They run on a GPU with Triton, or on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1` set before the test process starts, Triton installed):
skipped elsewhere. In bf16 the fused ops round where transformers' separate ops round, so they
agree bit for bit except where the last bit of an exp or rsqrt, or the order of a sum, moves a
rounding (checked: at most one bf16 step, on under 1% of the elements); float32 to 1e-5.
Triton's interpreter casts float32 to bf16 toward zero (a GPU rounds to nearest), and each op
rounds two or three times, so under it bf16 results are checked to four bf16 steps of the largest
value only (the tight check runs on cuda)."""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels import triton_ops
from workers.layers import RotaryEmbedding, silu_and_mul

BF16 = torch.bfloat16
DTYPES = [BF16, torch.float32]


def _device() -> str | None:
    if triton_ops._kernels() is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


DEV = _device()
needs_triton = pytest.mark.skipif(DEV is None,
                                  reason="needs Triton, and cuda or TRITON_INTERPRET=1")


# ---- CPU: selection -------------------------------------------------------------------------
def test_cuda_runs_the_fused_ops_only_where_triton_imports_and_unless_switched_off(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # as if a GPU were here
    monkeypatch.setattr(triton_ops, "_kernels", lambda: object())      # "importable"
    monkeypatch.delenv("RAYPD_FUSED_OPS", raising=False)
    assert triton_ops.applies(BF16, cuda, 4096, 128)
    assert not triton_ops.applies(BF16, torch.device("cpu"), 4096, 128)   # the CPU: C++ ops
    assert not triton_ops.applies(BF16, cuda, 4096, 512)                   # head_dim too large
    monkeypatch.setenv("RAYPD_FUSED_OPS", "0")
    assert not triton_ops.applies(BF16, cuda, 4096, 128)
    monkeypatch.delenv("RAYPD_FUSED_OPS")
    monkeypatch.setattr(triton_ops, "_kernels", lambda: None)          # Triton missing
    assert not triton_ops.applies(BF16, cuda, 4096, 128)


def test_the_engine_reports_which_fused_ops_run(monkeypatch):
    from workers.engine import EngineConfig, LLMEngine
    from workers.kernels import library
    cfg = EngineConfig(model="tiny", dtype="float32", device="cpu", num_blocks=16, block_size=16)
    want = "native-cpu" if library() is not None else "off"
    assert LLMEngine(cfg).get_stats()["fused_ops"] == want
    monkeypatch.setenv("RAYPD_FUSED_OPS", "0")
    assert LLMEngine(cfg).get_stats()["fused_ops"] == "off"


def rms_norm_hf(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(h.dtype)


def agree(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    g, w = got.float(), want.float()
    # a bf16 step of each value (of 1/64 of the largest, where a difference cancelled it)
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(w.abs().max() / 64))) - 7)
    steps = ((g - w).abs() / step).max().item()
    if DEV == "cuda":
        assert steps <= 1 and (g != w).float().mean().item() < 0.01
    else:               # the interpreter truncates (module docstring)
        top = torch.exp2(torch.floor(torch.log2(w.abs().max())) - 7)
        assert (g - w).abs().max() <= 4 * top


def same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """One rounding of the same float32 value: bit for bit (within `agree` under the
    interpreter, which truncates)."""
    if DEV == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        agree(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (7, 4096), (33, 1000)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_transformers_residual_add_then_rmsnorm(tokens, hidden, with_delta,
                                                                dtype):
    g = torch.Generator().manual_seed(tokens * hidden)
    h = torch.randn(tokens, hidden, generator=g).to(DEV, dtype)
    delta = torch.randn(tokens, hidden, generator=g).to(DEV, dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEV, dtype)
    want_h = h + delta if with_delta else h.clone()
    want_x = rms_norm_hf(want_h, w, 1e-5)
    x = triton_ops.add_rms_norm(h, delta, w, 1e-5)
    same_rounding(h, want_h)          # the residual stream: exactly torch's add
    agree(x, want_x)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (32, 8, 128), (4, 4, 64),
                                                      (12, 3, 128)])
@pytest.mark.parametrize("tokens", [1, 40])
def test_rope_and_cache_rotates_in_place_and_writes_only_the_slots(tokens, heads, kv_heads, d,
                                                                   dtype):
    from transformers import LlamaConfig
    num_blocks, bs = 16, 16
    g = torch.Generator().manual_seed(tokens * heads + d)
    rope = RotaryEmbedding(LlamaConfig(), d, 4096, dtype, torch.device(DEV))
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEV)
    cos, sin = rope.tables(positions)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, generator=g).to(DEV, dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens].to(DEV)   # not in order
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    want_qk = RotaryEmbedding.apply(qkv[:, :heads + kv_heads], (cos, sin))
    want_k, want_v = k_cache.clone().view(-1, kv_heads, d), v_cache.clone().view(-1, kv_heads, d)
    want_k[slots] = want_qk[:, heads:]
    want_v[slots] = qkv[:, heads + kv_heads:]
    v_before = qkv[:, heads + kv_heads:].clone()
    triton_ops.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    agree(qkv[:, :heads + kv_heads], want_qk)
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)          # v is not rotated
    assert torch.equal(v_cache.view(-1, kv_heads, d), want_v)        # and stored as it is
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, kv_heads, d)[untouched], want_k[untouched])
    agree(k_cache.view(-1, kv_heads, d)[slots], want_k[slots])
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots], qkv[:, heads:heads + kv_heads])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1536), (5, 14336), (3, 1000)])
def test_silu_mul_is_silu_of_gate_times_up(tokens, inter, dtype):
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(DEV, dtype)
    agree(triton_ops.silu_mul(gate_up), silu_and_mul(gate_up))


@needs_triton
def test_empty_steps_launch_nothing_and_return_empty():
    h = torch.empty(0, 64, device=DEV)
    assert triton_ops.add_rms_norm(h, None, torch.ones(64, device=DEV), 1e-5).shape == (0, 64)
    assert triton_ops.silu_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
