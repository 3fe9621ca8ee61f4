"""The native CPU attention kernels' Python side: decode attention reading the paged KV pool in
place (csrc/paged_decode.cpp) and the prefill attentions, bf16 (csrc/attention_bf16.cpp) and
float32 (csrc/attention_f32.cpp); each returns None where its kernel does not apply (a GPU
tensor, another dtype, a shape it does not take, no library), and its caller takes PyTorch's
path."""

from __future__ import annotations

import torch

from kvcache.manager import cdiv
from workers.kernels import bindings, isa

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_GROUP = 16   # query heads per KV head the decode kernel takes
MAX_KV_HEADS = 256


def paged_decode_heads_fit(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether paged_decode.cpp holds these heads (its per-KV-head arrays are sized for at
    most MAX_GROUP query heads, MAX_KV_HEADS KV heads and head_dim 512)."""
    return 0 < head_dim <= 512 and 0 < num_kv_heads <= MAX_KV_HEADS \
        and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 window: int | None) -> torch.Tensor | None:
    """[B, H, D] decode attention over the pool, or None where the kernel does not apply."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu" \
            or q.dtype != k_cache.dtype or q.dtype not in DTYPE_CODES:
        return None
    lib = bindings.library()
    if lib is None:
        return None
    # checked on every call, not asserted: the kernel reads raw memory where these point (it
    # checks the context lengths and block ids itself, beside its reads)
    B, H, D = q.shape if q.dim() == 3 else (0, 0, 0)
    tables = block_tables.to("cpu", torch.int64).contiguous()
    lens = context_lens.to("cpu", torch.int64).contiguous()
    if not (q.dim() == 3 and k_cache.dim() == 4 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape and k_cache.shape[3] == D
            and paged_decode_heads_fit(H, k_cache.shape[2], D)
            and tables.dim() == 2 and tables.shape[0] == B and lens.shape == (B,)):
        raise ValueError(f"paged_decode: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (contiguous, same dtype), block_tables "
                         f"{tuple(tables.shape)}, context_lens {tuple(lens.shape)}")
    num_blocks, bs, h_kv = k_cache.shape[:3]
    q = q.contiguous()
    out = torch.empty_like(q)
    code = DTYPE_CODES[q.dtype]
    if lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                        lens.data_ptr(), out.data_ptr(), B, H, D, bs, h_kv, tables.shape[1],
                        num_blocks, float(scale), int(window or 0), code,
                        torch.get_num_threads(), isa.decode_attention(D, code)):
        raise ValueError("paged_decode: a context length outside its block table, or a block "
                         "outside the pool")
    return out


def decode_kernel_name(device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int = 64) -> str:
    """Which decode attention runs: native-cpu-amx (bf16 pools on a CPU with AMX-BF16: scores
    on AMX, values on AVX512-BF16), native-cpu-avx512bf16 (bf16 pools on a CPU with
    AVX512-BF16), native-cpu-avx2 (AVX2 + FMA: float32 pools, bf16 pools elsewhere),
    native-cpu (the kernel's portable loops), or torch."""
    if device.type != "cpu" or bindings.library() is None:
        return "torch"
    code = DTYPE_CODES.get(dtype if dtype is not None else torch.float32)
    path = isa.decode_attention(head_dim, code) if code is not None else isa.PORTABLE
    return isa.DECODE_PATH_NAMES[path]


# ---- prefill attention, bf16 on CPUs with AMX-BF16 or AVX512-BF16 (attention_bf16.cpp) ---------
def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           window: int | None = None, block_table: torch.Tensor | None = None,
                           context_len: int | None = None) -> torch.Tensor | None:
    """Causal attention of q [Tq, H, D] (the last Tq positions) over k, v [S, Hkv, D] (every
    position, the chunk's own last), each query seeing only the `window` newest keys of a
    sliding-window layer -> [Tq, H, D]; None where the kernel does not apply (not bf16 on the
    CPU, D not a multiple of 32 up to 128, neither AMX-BF16 (no window) nor AVX512-BF16, the
    portable switch). AMX where the CPU has it, unless RAYPD_KERNEL_ISA=avx512bf16.
    With `block_table` ([blocks] int64) and `context_len` (S), k and v are a layer's paged pool
    [num_blocks, block_size, Hkv, D] and the keys are the sequence's first S slots of its
    blocks, read in place (the chunk's own K/V already written there)."""
    tq, h, d = q.shape
    if block_table is not None:
        if k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous()) or context_len is None:
            return None
        num_blocks, bs, h_kv = k.shape[:3]
        s = context_len
    else:
        num_blocks, bs = 0, 0
        s, h_kv = k.shape[:2]
    if q.device.type != "cpu" or not q.dtype == k.dtype == v.dtype == torch.bfloat16 \
            or d % 32 or d > 128 or h % h_kv or k.shape != v.shape or k.shape[-1] != d \
            or not 1 <= tq <= s or (window is not None and window < 1):
        return None
    lib = bindings.library()
    path = isa.prefill_bf16(window)
    if lib is None or path is None:
        return None
    table_ptr = None
    if block_table is not None:
        # checked on every call, not asserted: the kernel reads where the table points
        table = block_table.to("cpu", torch.int64).contiguous()
        need = cdiv(s, bs)
        if table.dim() != 1 or table.numel() < need:
            raise ValueError(f"prefill_attention_bf16: a block table of {table.numel()} blocks "
                             f"for {s} tokens in blocks of {bs}")
        lo, hi = torch.aminmax(table[:need])
        if int(lo) < 0 or int(hi) >= num_blocks:
            raise ValueError("prefill_attention_bf16: a block outside the pool")
        table_ptr, kr = table.data_ptr(), h_kv * d     # rows of the pool
        vr = kr
    else:
        # each token's heads x D contiguous (slices of a fused QKV projection are): in place
        k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (k, v))
        kr, vr = k.stride(0), v.stride(0)
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    out = torch.empty(tq, h, d, dtype=q.dtype)
    lib.prefill_attention_bf16(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), tq, s,
                               h, h_kv, d, q.stride(0), kr, vr, scale, int(window or 0),
                               torch.get_num_threads(), int(path == isa.AMX), table_ptr, bs)
    return out


# ---- prefill attention, float32 on CPUs with AVX2 + FMA (attention_f32.cpp) -----------------------
def prefill_attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int | None = None) -> torch.Tensor | None:
    """Causal attention of q [Tq, H, D] (the last Tq positions) over k, v [S, Hkv, D] (every
    position, the chunk's own last), each query seeing only the `window` newest keys of a
    sliding-window layer -> [Tq, H, D]; None where the kernel does not apply (not float32 on the
    CPU, no AVX2 + FMA, D not a multiple of 16 up to 256, RAYPD_KERNEL_ISA=portable)."""
    tq, h, d = q.shape
    s, h_kv = k.shape[:2]
    if q.device.type != "cpu" or not q.dtype == k.dtype == v.dtype == torch.float32 \
            or h % h_kv or k.shape != v.shape or k.shape[2] != d or not 1 <= tq <= s \
            or not isa.prefill_f32(d):
        return None
    # each token's heads x D contiguous (slices of a fused QKV projection are): read in place
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (q, k, v))
    out = torch.empty(tq, h, d, dtype=q.dtype)
    bindings.library().prefill_attention_f32(out.data_ptr(), q.data_ptr(), k.data_ptr(),
                                             v.data_ptr(), tq, s, h, h_kv, d, q.stride(0),
                                             k.stride(0), v.stride(0), scale, int(window or 0),
                                             torch.get_num_threads())
    return out
