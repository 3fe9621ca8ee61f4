"""Paged attention: writes each token's K/V into the pool through the slot mapping and reads each
sequence's context through its block table.

One flat batch of every scheduled token (no padding): decodes first, read in batched groups of
similar context length (on the CPU a native kernel reading the pool in place, on cuda a Triton
kernel reading it in place where Triton imports (workers/kernels/triton_decode.py), elsewhere a
gather and two matmuls; softmax in float32 everywhere), then prefill
chunks, one attention call each (a chunk with no cached prefix attends to its own K/V without
touching the pool): bf16 on a CPU with AMX or AVX512-BF16, workers/kernels/csrc/attention_bf16.cpp,
float32 on a CPU with AVX2 + FMA, workers/kernels/csrc/attention_f32.cpp (flash-style blocks, no
mask tensor);
elsewhere SDPA. Sliding-window layers mask keys older than the window. A quantized pool (int8 / fp8,
workers/kv_quant.py) is written through `write_quantized` and read dequantized by the PyTorch
path (the native kernel reads float pools only), and every prefill chunk reads its K/V back from
the pool, so a token's attention sees the same stored K/V whichever chunk or worker wrote it. The compact model calls
`paged_attention` directly; stock transformers models reach it through their attention interface
(`register_paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers import kernels as native
from workers.kernels import triton_decode
from workers.kv_quant import gather_dequantized, write_quantized

ATTN_IMPL = "raypd_paged"


@dataclass
class PrefillSegment:
    """One sequence's chunk: query tokens [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    context_len: int                 # tokens in KV after this chunk (cached prefix + chunk)
    block_table: torch.Tensor | None  # None when the chunk is the whole context (no prefix)


@dataclass
class DecodeGroup:
    """Decode tokens [start, start + count) of the flat batch, read in one batched gather."""

    start: int
    count: int
    block_tables: torch.Tensor       # [count, max_blocks] (padded with block 0)
    context_lens: torch.Tensor       # [count] tokens in KV, this step's token included
    max_context_len: int
    needs_mask: bool = True          # some row is shorter than max_context_len (known on the
                                     # host, so the device is never asked)


@dataclass
class AttentionMetadata:
    kv_cache: torch.Tensor           # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor       # [num_tokens] flat slot (block_id * block_size + offset)
    num_decodes: int                 # the first num_decodes tokens are single-token decodes
    decode_groups: list[DecodeGroup]  # those decodes, in groups of similar context length
    prefills: list[PrefillSegment]
    kv_scales: torch.Tensor | None = None   # quantized pool: [num_layers, 2, num_blocks, kv_heads]
    kv_quant: str = ""               # "", "int8" or "fp8": how kv_cache stores its elements


@dataclass
class LayerKV:
    """One layer's K and V pool views (and scales when quantized)."""

    k: torch.Tensor                  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor
    k_scales: torch.Tensor | None = None   # [num_blocks, kv_heads]
    v_scales: torch.Tensor | None = None

    def gather(self, which: str, block_table: torch.Tensor, length: int,
               dtype: torch.dtype) -> torch.Tensor:
        cache, scales = (self.k, self.k_scales) if which == "k" else (self.v, self.v_scales)
        if scales is None:
            return _gather(cache, block_table, length).to(dtype)
        return gather_dequantized(cache, scales, block_table, length, dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[(B,) tokens, kv_heads, head_dim] of the blocks in `block_table`, cut at `length`."""
    kv = cache[block_table]                               # [(B,) nb, bs, H, D]
    kv = kv.flatten(-4, -3)                                # [(B,) nb*bs, H, D]
    return kv[..., :length, :, :]


def decode_kernel_name(device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int = 64) -> str:
    """Which decode attention runs over a float pool of `dtype` on `device`: triton-cuda (cuda
    where Triton imports; `RAYPD_TRITON_DECODE=0` turns it off), native-cpu[-amx|-avx512bf16|
    -avx2] (the CPU's native kernel, workers/kernels/attention.py), or torch (the gather path). What
    `_decode_attention` picks for that pool, so it is what the engine reports as
    `attention_kernel`."""
    if device.type == "cuda":
        name = triton_decode.kernel_name(device, dtype, head_dim) if dtype is not None else None
        return name or "torch"
    return native.decode_kernel_name(device, dtype, head_dim)


def _decode_attention(q: torch.Tensor, kv: LayerKV, g: DecodeGroup, scale: float,
                      window: int | None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each row attends to its first context_lens[b] tokens.
    Float pools: the Triton kernel on cuda, the native kernel on the CPU, where they apply;
    quantized pools and everything else: the torch path."""
    out = None
    if kv.k_scales is None:
        if triton_decode.applies(q, kv.k):
            return triton_decode.paged_decode(q, kv.k, kv.v, g.block_tables, g.context_lens,
                                              scale, window, g.max_context_len)
        out = native.paged_decode(q, kv.k, kv.v, g.block_tables, g.context_lens, scale, window)
    return out if out is not None else _decode_attention_torch(q, kv, g, scale, window)


def _decode_attention_torch(q: torch.Tensor, kv: LayerKV, g: DecodeGroup, scale: float,
                            window: int | None) -> torch.Tensor:
    """The same in PyTorch ops: gather (and dequantize) the group's blocks, two matmuls."""
    b, h, d = q.shape
    n_kv = kv.k.shape[-2]
    k = kv.gather("k", g.block_tables, g.max_context_len, q.dtype)   # [B, S, Hkv, D]
    v = kv.gather("v", g.block_tables, g.max_context_len, q.dtype)
    qg = q.view(b, n_kv, h // n_kv, d)                            # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B,Hkv,G,S]
    pos = torch.arange(g.max_context_len, device=q.device)
    lens = g.context_lens.view(b, 1, 1, 1)
    invalid = pos >= lens
    if window is not None:
        invalid = invalid | (pos < lens - window)
    if window is not None or g.needs_mask:
        scores.masked_fill_(invalid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))                  # [B, Hkv, G, D]
    return out.reshape(b, h, d)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                       seg: PrefillSegment, scale: float, window: int | None) -> torch.Tensor:
    """One chunk: q [q_len, H, D] -> [q_len, H, D], causal over its cached prefix + itself."""
    if seg.block_table is not None:   # else the chunk is the whole context: its own K/V
        if kv.k_scales is None:
            # bf16 on AVX512-BF16 / AMX: the prefix (and the chunk, written there already) read
            # in place from the pool, through the block table (gathered, a prefix cost up to a
            # few ms a step: the copy of every block of the table, every layer)
            o = native.prefill_attention_bf16(q, kv.k, kv.v, scale, window, seg.block_table,
                                              seg.context_len)
            if o is not None:
                return o
        k = kv.gather("k", seg.block_table, seg.context_len, q.dtype)   # [S, Hkv, D]
        v = kv.gather("v", seg.block_table, seg.context_len, q.dtype)
    # bf16 on a CPU with AMX (no window) or AVX512-BF16: flash-style blocks, no mask (None
    # elsewhere)
    o = native.prefill_attention_bf16(q, k, v, scale, window)
    if o is not None:
        return o
    # float32 on a CPU with AVX2 + FMA: flash-style blocks, sliding windows too (None elsewhere)
    o = native.prefill_attention_f32(q, k, v, scale, window)
    if o is not None:
        return o
    qs = q.transpose(0, 1).unsqueeze(0)                           # [1, H, q, D]
    ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    offset = seg.context_len - seg.q_len
    if window is not None and q.device.type == "cpu" and seg.q_len >= BLOCKED_MIN_QUERIES:
        return _blocked_causal_attention(q, ks[0].transpose(0, 1), vs[0].transpose(0, 1), offset,
                                         scale, window)
    if window is None:   # torch's flash kernel; causal from the bottom right past a prefix
        # (imported here: torch.nn.attention.bias imports torch._dynamo, ~2 s a process)
        from torch.nn.attention.bias import causal_lower_right
        causal = {"is_causal": True} if offset == 0 else \
            {"attn_mask": causal_lower_right(seg.q_len, seg.context_len)}
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True, **causal)
    else:
        rows = torch.arange(seg.q_len, device=q.device).view(-1, 1) + offset
        cols = torch.arange(seg.context_len, device=q.device).view(1, -1)
        mask = cols <= rows
        if window is not None:
            mask &= cols > rows - window
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


# CPU prefill of a sliding-window layer where the native kernels do not apply (bf16 without
# AVX512-BF16, or float32 without AVX2):
# from this many queries on, attention runs as query blocks of BLOCK_QUERIES rows, each two GEMMs
# over only the keys it can see (no [q, context] mask). Full-attention layers use the native
# kernels or torch's flash kernel (SDPA), the latter 3-5x faster than these blocks
# here (bf16, 2 threads: 2,048 tokens 9.8 ms a layer against 48; 1,024 new after 1,024 cached
# 11 ms against 37).
BLOCKED_MIN_QUERIES = 512
BLOCK_QUERIES = 256


def _blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                              scale: float, window: int | None) -> torch.Tensor:
    """q [Tq, H, D] at positions offset.., k/v [S, Hkv, D] at positions 0.. -> [Tq, H, D]."""
    tq, h, d = q.shape
    n_kv = k.shape[1]
    g = h // n_kv
    out = torch.empty_like(q)
    for kv in range(n_kv):
        kh, vh = k[:, kv].contiguous(), v[:, kv].contiguous()      # [S, D]
        qh = q[:, kv * g:(kv + 1) * g]                             # [Tq, G, D]
        for s in range(0, tq, BLOCK_QUERIES):
            e = min(tq, s + BLOCK_QUERIES)
            hi = offset + e                                        # keys [lo, hi) are visible
            lo = 0 if window is None else max(0, offset + s - window + 1)
            scores = (qh[s:e].reshape(-1, d) @ kh[lo:hi].t()).float().mul_(scale)
            scores = scores.view(e - s, g, hi - lo)
            rows = torch.arange(offset + s, offset + e, device=q.device).view(-1, 1, 1)
            cols = torch.arange(lo, hi, device=q.device).view(1, 1, -1)
            hidden = cols > rows
            if window is not None:
                hidden |= cols <= rows - window
            scores.masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(-1, hi - lo)
            out[s:e, kv * g:(kv + 1) * g] = (probs @ vh[lo:hi]).view(e - s, g, d)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    kv_written: bool = False) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of this step's tokens -> [T, H, D].

    Writes k/v into layer `layer_idx` of the pool first (unless `kv_written`: the caller wrote
    them, workers/kernels/fused.py rope_and_cache), then attends; `window` (tokens) limits each
    query to the most recent keys of a sliding-window layer."""
    k_cache, v_cache = meta.kv_cache[layer_idx]              # [num_blocks, bs, Hkv, D] each
    if kv_written:
        assert meta.kv_scales is None, "a quantized pool is written here, never by the caller"
        kv = LayerKV(k_cache, v_cache)
    elif meta.kv_scales is not None:
        k_scales, v_scales = meta.kv_scales[layer_idx]        # [num_blocks, Hkv] each
        write_quantized(k_cache, k_scales, meta.slot_mapping, k, meta.kv_quant)
        write_quantized(v_cache, v_scales, meta.slot_mapping, v, meta.kv_quant)
        kv = LayerKV(k_cache, v_cache, k_scales, v_scales)
    else:
        n_kv, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        k_cache.view(-1, n_kv, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, n_kv, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        kv = LayerKV(k_cache, v_cache)
    if not meta.prefills and len(meta.decode_groups) == 1 \
            and meta.decode_groups[0].count == q.shape[0]:   # a pure decode step, one group
        return _decode_attention(q, kv, meta.decode_groups[0], scale, window)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        rows = slice(g.start, g.start + g.count)
        out[rows] = _decode_attention(q[rows], kv, g, scale, window)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv, seg, scale, window)
    return out


def _hf_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0,
                        attn_meta: AttentionMetadata | None = None,
                        sliding_window: int | None = None, **kwargs
                        ) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    output [1, T, H, D]."""
    assert attn_meta is not None, "the paged attention needs attn_meta (see ModelRunner)"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), module.layer_idx, attn_meta, scale,
                          sliding_window)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The paged attention builds its own masks from the metadata."""
    return None


def register_paged_attention() -> str:
    """Plug the paged attention into transformers (the stock model's path; imported here so
    the compact model's processes never import transformers' attention and masking code)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTN_IMPL, _hf_paged_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
    return ATTN_IMPL
