"""The compact model's small fused ops on cuda, in Triton (kernels:
workers/kernels/triton_ops_kernels.py): the residual add with RMSNorm, rotary embedding with the
K/V write into the pool, SiLU-and-mul.
The same three calls, with the same contracts, as workers/kernels' C++ ones on the CPU, so
`CompactLlama` runs one layer body on either device (workers/llama.py picks the module).

Unfused, a layer of a decode step launches ~13 small kernels (two norms, two residual adds, five
for the rotary, two index copies, SiLU, a product), each a few microseconds even inside a CUDA
graph: ~1.4 ms a step for a 32-layer model on an H200. Fused, four.

Triton is imported lazily: where it is missing, where there is no CUDA, or with
`RAYPD_FUSED_OPS=0` (the CPU's switch too), `available()` is False and the model keeps torch's
own ops. Every launch is asynchronous and sync-free (graph-capturable). The host functions take
any device's tensors, so a test can run them on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from kvcache.manager import cdiv
from workers.kernels.triton_decode import import_kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 16384          # one program holds a whole row
MAX_HEAD_DIM = 256


def _enabled() -> bool:
    return os.environ.get("RAYPD_FUSED_OPS", "1") != "0"


@functools.cache
def _kernels() -> ModuleType | None:
    """workers/kernels/triton_ops_kernels.py, or None where Triton cannot be imported."""
    return import_kernels("triton_ops_kernels", "torch's ops run")


def applies(dtype: torch.dtype, device: torch.device, hidden: int, head_dim: int) -> bool:
    """Whether the compact model of weights `dtype` on `device` runs these ops."""
    return device.type == "cuda" and dtype in DTYPES and hidden <= MAX_HIDDEN \
        and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0 and _enabled() \
        and torch.cuda.is_available() and _kernels() is not None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight: [T, D], contiguous."""
    assert h.dim() == 2 and h.is_contiguous() and h.dtype in DTYPES
    assert weight.is_contiguous() and weight.shape == (h.shape[1],)
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == h.shape and delta.dtype == h.dtype
    t, d = h.shape
    x = torch.empty_like(h)
    if t:
        block = _pow2(d)
        _kernels().add_rms_norm[(t,)](x, h, h if delta is None else delta, weight, d,
                                      float(eps), HAS_DELTA=delta is not None, BLOCK=block,
                                      num_warps=_warps(block))
    return x


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int, num_kv_heads: int) -> None:
    """Rotate qkv's q and k heads in place ([T, H + 2 Hkv, D]) by cos/sin ([T, 1, D], qkv's
    dtype) and write each token's k and v into the pool ([num_blocks, bs, Hkv, D], contiguous)
    at its slot (slots [T], each in [0, num_blocks * bs): the host's slot mapping)."""
    t, heads, d = qkv.shape
    assert heads == num_heads + 2 * num_kv_heads and qkv.is_contiguous() and d % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[-2:] == (num_kv_heads, d)
    assert cos.dtype == sin.dtype == qkv.dtype
    if not t:
        return
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    assert slots.numel() == t
    slots = slots.contiguous()
    _kernels().rope_and_cache[(t,)](
        qkv, cos, sin, k_cache, v_cache, slots, k_cache.numel() // (num_kv_heads * d),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=d,
        BLOCK_H=_pow2(num_heads + num_kv_heads), BLOCK_HALF=_pow2(d // 2),
        BLOCK_KV=_pow2(num_kv_heads), BLOCK_D=_pow2(d), IS_BF16=qkv.dtype == torch.bfloat16,
        num_warps=4)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate, up) -> silu(gate) * up."""
    gate_up = gate_up.contiguous()
    assert gate_up.dim() == 2 and gate_up.dtype in DTYPES and gate_up.shape[1] % 2 == 0
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _kernels().silu_mul[(t, cdiv(inter, SILU_BLOCK))](out, gate_up, inter, BLOCK=SILU_BLOCK,
                                                          num_warps=4)
    return out
