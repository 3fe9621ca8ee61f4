"""The compact model's fused native CPU ops, bf16 and float32: residual add with RMSNorm, rotary
embedding with the K/V write, SiLU-and-mul (csrc/fused_ops.cpp), and every layer of a pure
decode step in one call (csrc/decode_layers.cpp)."""

from __future__ import annotations

import os

import torch

from workers.kernels import bindings, isa
from workers.kernels.attention import DTYPE_CODES

FUSED_DTYPES = (torch.bfloat16, torch.float32)


def fused_ops_apply(dtype: torch.dtype, device: torch.device, hidden: int) -> bool:
    """Whether the compact model's fused ops run for weights of `dtype` on `device`
    (`RAYPD_FUSED_OPS=0` turns them off: torch's own ops, transformers' bit for bit in
    float32)."""
    return device.type == "cpu" and dtype in FUSED_DTYPES and hidden <= 8192 \
        and os.environ.get("RAYPD_FUSED_OPS", "1") != "0" and bindings.library() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight: [T, D] bf16 or float32,
    contiguous."""
    assert h.is_contiguous() and h.dtype in FUSED_DTYPES and weight.is_contiguous()
    assert weight.dtype == h.dtype
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == h.shape and delta.dtype == h.dtype
    x = torch.empty_like(h)
    lib = bindings.library()
    f = lib.add_rms_norm if h.dtype == torch.bfloat16 else lib.add_rms_norm_f32
    f(x.data_ptr(), h.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
      h.shape[0], h.shape[1], float(eps), torch.get_num_threads())
    return x


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int, num_kv_heads: int) -> None:
    """Rotate qkv's q and k heads in place ([T, H + 2 Hkv, D] bf16 or float32) by cos/sin
    ([T, 1, D]) and write each token's k and v into the pool (of the same dtype) at its slot."""
    t, heads, d = qkv.shape
    assert heads == num_heads + 2 * num_kv_heads and qkv.is_contiguous()
    assert qkv.dtype in FUSED_DTYPES
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype == cos.dtype == sin.dtype
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    slots = slots.to(torch.int64).contiguous()
    assert slots.numel() == t
    lib = bindings.library()
    f = lib.rope_and_cache if qkv.dtype == torch.bfloat16 else lib.rope_and_cache_f32
    if f(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
         slots.data_ptr(), t, num_heads, num_kv_heads, d, k_cache.numel() // (num_kv_heads * d),
         torch.get_num_threads()):
        raise ValueError("rope_and_cache: a slot outside the pool")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate, up) -> silu(gate) * up, bf16 or float32."""
    gate_up = gate_up.contiguous()
    assert gate_up.dtype in FUSED_DTYPES
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    lib = bindings.library()
    f = lib.silu_mul if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32
    f(out.data_ptr(), gate_up.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


# ---- the compact model's decode layers in one call (decode_layers.cpp) ---------------------------
LAYER_WORDS = 11   # per layer: qkv, qkv bias, o, o bias, gate_up, down, ln1, ln2, k, v, window
GROUP_WORDS = 5    # per decode group: start, count, block tables, context lens, width


def decode_layers(layer_words: torch.Tensor, groups: list[tuple[int, torch.Tensor,
                                                                 torch.Tensor]],
                  h: torch.Tensor, dims: tuple[int, ...], eps: float, scale: float,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  amx: bool = False) -> torch.Tensor:
    """Every layer of a pure decode step, as llama._Layer.forward_fused computes them one call
    at a time: float32 activations and pool with bf16-held linears (linear_w16), or bf16
    activations and pool with VNNI-packed linears (linear_amx where `amx`, else
    linear_small_m). `layer_words` [L, LAYER_WORDS] int64 (the layers' operands,
    CompactLlama.decode_words); `groups` (start row, block tables [count, width], context lens
    [count]); h [T, hidden] the residual stream (updated in place); dims (T, hidden, H, Hkv, D,
    I, block_size, num_blocks); cos, sin [T, D] of h's dtype; slots [T].
    Returns the last layer's output, still to be added to h."""
    t, hidden = h.shape
    assert dims[0] == t and dims[1] == hidden and h.dtype in FUSED_DTYPES and h.is_contiguous()
    assert cos.dtype == sin.dtype == h.dtype and (not amx or h.dtype == torch.bfloat16)
    assert layer_words.dtype == torch.int64 and layer_words.is_contiguous() \
        and layer_words.shape[1] == LAYER_WORDS
    assert cos.shape == sin.shape == (t, dims[4]) and cos.is_contiguous() and sin.is_contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (t,) and slots.is_contiguous()
    words, held, rows = [], [], 0    # held: the converted tables the words point into
    for start, tables, lens in groups:       # the groups' rows partition [0, T), in order
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        count = tables.shape[0]
        assert start == rows and lens.shape == (count,) and count > 0
        rows += count
        held += [tables, lens]
        words += [start, count, tables.data_ptr(), lens.data_ptr(), tables.shape[1]]
    assert rows == t
    group_words = torch.tensor(words, dtype=torch.int64)
    dims_t = torch.tensor(dims, dtype=torch.int64)
    delta = torch.empty_like(h)
    args = (layer_words.data_ptr(), layer_words.shape[0], group_words.data_ptr(), len(groups),
            h.data_ptr(), delta.data_ptr(), dims_t.data_ptr(), float(eps), float(scale),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), torch.get_num_threads(),
            isa.decode_attention(dims[4], DTYPE_CODES[h.dtype]))
    lib = bindings.library()
    if lib.decode_layers_f32(*args) if h.dtype == torch.float32 \
            else lib.decode_layers_bf16(*args, int(amx)):
        raise ValueError("decode_layers: a slot or a block outside the pool")
    return delta
