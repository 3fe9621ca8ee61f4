"""Paged attention: reads and writes the KV pool through block tables and slot mappings.

It plugs into stock transformers models through their attention interface: the model runs
on one flat sequence of every scheduled token (batch dim 1, no padding), and the metadata
below, passed as a keyword argument of `model(...)`, tells each layer where each token's K/V
goes (slot_mapping) and which blocks each sequence reads (block tables). Decodes come first
in the flat batch and run as batched SDPAs (one per group of similar context length);
prefill chunks follow, one SDPA each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

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
    """Decode tokens [start, start + count) of the flat batch, read in one batched SDPA."""

    start: int
    count: int
    block_tables: torch.Tensor       # [count, max_blocks] (padded with block 0)
    mask: torch.Tensor | None        # [count, 1, 1, max_blocks * block_size]; None: no padding


@dataclass
class AttentionMetadata:
    kv_cache: torch.Tensor           # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor       # [num_tokens] flat slot (block_id * block_size + offset)
    num_decodes: int                 # the first num_decodes tokens are single-token decodes
    decode_groups: list[DecodeGroup]  # those decodes, in groups of similar context length
    prefills: list[PrefillSegment]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int | None) -> torch.Tensor:
    """[..., heads, tokens, head_dim] view-ready K or V of the blocks in `block_table`."""
    kv = cache[block_table]                               # [(B,) nb, bs, H, D]
    kv = kv.flatten(-4, -3) if kv.dim() == 5 else kv.flatten(0, 1)  # [(B,) nb*bs, H, D]
    if length is not None:
        kv = kv[..., :length, :, :]
    return kv.transpose(-3, -2)                           # [(B,) H, tokens, D]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    attn_meta: AttentionMetadata | None = None, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> output [1, T, H, D]."""
    assert attn_meta is not None, "the paged attention needs attn_meta (see ModelRunner)"
    m = attn_meta
    k_cache, v_cache = m.kv_cache[module.layer_idx]       # [num_blocks, bs, Hkv, D] each
    n_kv, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    q, k, v = query[0], key[0].transpose(0, 1), value[0].transpose(0, 1)  # k,v: [T, Hkv, D]
    # write this step's K/V into the pool
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, m.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, m.slot_mapping, v.to(v_cache.dtype))

    out = query.new_empty(q.shape[1], q.shape[0], head_dim)  # [T, H, D]
    for g in m.decode_groups:
        rows = slice(g.start, g.start + g.count)
        qd = q[:, rows].transpose(0, 1).unsqueeze(2)           # [B, H, 1, D]
        kd = _gather(k_cache, g.block_tables, None).to(q.dtype)  # [B, Hkv, S, D]
        vd = _gather(v_cache, g.block_tables, None).to(q.dtype)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scaling,
                                           enable_gqa=True)
        out[rows] = o.squeeze(2)
    for seg in m.prefills:
        qs = q[:, seg.q_start:seg.q_start + seg.q_len].unsqueeze(0)   # [1, H, q, D]
        if seg.block_table is None:   # the chunk is the whole context: no gather needed
            ks = key[:, :, seg.q_start:seg.q_start + seg.q_len]
            vs = value[:, :, seg.q_start:seg.q_start + seg.q_len]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                               enable_gqa=True)
        else:
            ks = _gather(k_cache, seg.block_table, seg.context_len).unsqueeze(0).to(q.dtype)
            vs = _gather(v_cache, seg.block_table, seg.context_len).unsqueeze(0).to(q.dtype)
            offset = seg.context_len - seg.q_len
            mask = torch.ones(seg.q_len, seg.context_len, dtype=torch.bool).tril(offset)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling,
                                               enable_gqa=True)
        out[seg.q_start:seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The paged attention builds its own masks from the metadata."""
    return None


def register_paged_attention() -> str:
    AttentionInterface.register(ATTN_IMPL, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
    return ATTN_IMPL
