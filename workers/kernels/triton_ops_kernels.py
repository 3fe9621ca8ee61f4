"""The Triton kernels of the compact model's small fused ops on cuda (imported only where Triton is
installed; workers/kernels/triton_ops.py is the host side, the one module that imports this one).

Each computes what transformers' ops compute, rounding where they round: an op on bf16 tensors
is computed in float32 and rounded to bf16 at each point where transformers' separate bf16 ops
round (so in bf16 they give the stock model's bits, up to the last bit of exp and rsqrt); in
float32 the roundings are no-ops.

- add_rms_norm, one program per row: h += delta (rounded), then
  x = weight * (h * rsqrt(mean(h^2) + eps)) (the normalised value rounded first);
- rope_and_cache, one program per token: q and k heads rotated in place (x * cos and
  rotate_half(x) * sin each rounded (bf16: by `_round`; a float16 pool's products may be
  contracted into an FMA), then their sum), k and v written into the pool at the
  token's slot (a slot outside [0, num_slots) writes nothing: the host never passes one);
- silu_mul, one program per (token, column tile): silu(gate) rounded, times up.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, IS_BF16: tl.constexpr):
    """float32 x rounded to bf16 (to nearest, ties to even) and back, by integer ops on its
    bits where IS_BF16 (else x). Not `x.to(bf16).to(float32)`: the compiler contracted such a
    product into the add that follows it (an FMA, one rounding fewer: measured on an H200,
    one bf16 step off torch on ~a quarter of the rotated elements)."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def add_rms_norm(x_ptr, h_ptr, d_ptr, w_ptr, n_cols, eps,
                 HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        h = (h + d).to(dt).to(tl.float32)
        tl.store(h_ptr + row * n_cols + cols, h.to(dt), mask=mask)
    var = tl.sum(h * h, axis=0) / n_cols
    normed = (h * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * n_cols + cols, (w * normed).to(dt), mask=mask)


@triton.jit
def rope_and_cache(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slots_ptr, num_slots,
                   NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
                   BLOCK_D: tl.constexpr, IS_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dt = qkv_ptr.dtype.element_ty
    base = qkv_ptr + t * (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM
    heads = tl.arange(0, BLOCK_H)[:, None]                 # q heads, then k heads
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    mask = (heads < NUM_HEADS + NUM_KV) & cmask
    x1 = tl.load(base + heads * HEAD_DIM + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + heads * HEAD_DIM + half + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * HEAD_DIM + cols, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * HEAD_DIM + half + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * HEAD_DIM + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * HEAD_DIM + half + cols, mask=cmask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded
    o1 = (_round(x1 * c1, IS_BF16) - _round(x2 * s1, IS_BF16)).to(dt)
    o2 = (_round(x2 * c2, IS_BF16) + _round(x1 * s2, IS_BF16)).to(dt)
    tl.store(base + heads * HEAD_DIM + cols, o1, mask=mask)
    tl.store(base + heads * HEAD_DIM + half + cols, o2, mask=mask)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    row = slot * NUM_KV * HEAD_DIM
    kmask = mask & (heads >= NUM_HEADS) & ok
    kdst = k_ptr + row + (heads - NUM_HEADS) * HEAD_DIM
    tl.store(kdst + cols, o1.to(k_ptr.dtype.element_ty), mask=kmask)
    tl.store(kdst + half + cols, o2.to(k_ptr.dtype.element_ty), mask=kmask)
    vh = tl.arange(0, BLOCK_KV)[:, None]
    vd = tl.arange(0, BLOCK_D)[None, :]
    vmask = (vh < NUM_KV) & (vd < HEAD_DIM) & ok
    v = tl.load(base + (NUM_HEADS + NUM_KV + vh) * HEAD_DIM + vd, mask=vmask, other=0.0)
    tl.store(v_ptr + row + vh * HEAD_DIM + vd, v.to(v_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def silu_mul(out_ptr, in_ptr, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = in_ptr.dtype.element_ty
    g = tl.load(in_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * u).to(dt), mask=mask)
