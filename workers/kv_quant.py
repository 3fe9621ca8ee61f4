"""Quantized KV pool (int8, fp8 = float8_e4m3fn): a packed byte pool with a scale per block, per
layer, per K/V and per KV head stored in each block's tail, quantize-on-write, dequantize-on-read.

The pool tensor every transport moves, `kv_cache`, is uint8 `[num_layers, 2, num_blocks,
block_bytes]` with `block_bytes = block_size * kv_heads * head_dim + 4 * kv_heads`: the elements of
the block (one byte each), then its float32 scales. Block ids stay at dim 2, so
`kv_cache[:, :, block_ids]` is a block's stored form, scales included, bit for bit: every
transport carries quantized pages (and their scales) without knowing they are quantized.
`QuantizedPool.data` and `.scales` are views of the same storage in the shapes the attention uses.

Scale rule (symmetric): element = round(x / scale) with scale = amax / qmax over the block's
tokens of that head (int8: qmax 127, round to nearest; fp8: qmax 448, cast to e4m3fn). A write
that starts a block (offset 0: blocks fill in position order, so this is the block's first write
in its current life) resets its scale; a later write whose values exceed the block's scale grows
it and requantizes the block's earlier tokens with the new scale (one extra rounding for those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.uint8, 448.0)}  # storage, qmax
SCALE_FLOOR = 1e-12   # the scale of an all-zero block (keeps division finite)


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANT_FORMATS


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] float, scale broadcastable to x[..., :1] -> storage dtype (int8 / fp8 bits)."""
    y = x.float() / scale
    if fmt == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8)
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored elements [..., D] times their scales [...,] -> `dtype`."""
    f = q.view(torch.float8_e4m3fn).float() if q.dtype == torch.uint8 else q.float()
    return (f * scale.unsqueeze(-1)).to(dtype)


@dataclass
class QuantizedPool:
    """Views over one packed pool: data [L, 2, NB, bs, H, D] (int8, or uint8 holding fp8 bits),
    scales [L, 2, NB, H] float32."""

    fmt: str
    kv_cache: torch.Tensor      # uint8 [L, 2, NB, block_bytes]: what transports move
    data: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def allocate(cls, fmt: str, num_layers: int, num_blocks: int, block_size: int,
                 kv_heads: int, head_dim: int, device: torch.device) -> QuantizedPool:
        assert fmt in QUANT_FORMATS, fmt
        elems = block_size * kv_heads * head_dim
        assert elems % 4 == 0, "the scales must start 4-byte aligned"
        block_bytes = elems + 4 * kv_heads
        raw = torch.zeros(num_layers, 2, num_blocks, block_bytes, dtype=torch.uint8,
                          device=device)
        st = raw.stride()
        data = raw.as_strided((num_layers, 2, num_blocks, block_size, kv_heads, head_dim),
                              (st[0], st[1], st[2], kv_heads * head_dim, head_dim, 1))
        data = data.view(QUANT_FORMATS[fmt][0])
        scales = raw[..., elems:].view(torch.float32)      # [L, 2, NB, H]
        return cls(fmt, raw, data, scales)


def write_quantized(data: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor,
                    x: torch.Tensor, fmt: str) -> None:
    """Write x [T, H, D] at flat slots into one layer's data [NB, bs, H, D] / scales [NB, H]."""
    if x.shape[0] == 0:
        return
    bs, n_heads = data.shape[1], data.shape[2]
    qmax = QUANT_FORMATS[fmt][1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    uniq, inv = torch.unique(blocks, return_inverse=True)
    amax = torch.zeros(len(uniq), n_heads, device=x.device).scatter_reduce_(
        0, inv.unsqueeze(1).expand(-1, n_heads), x.detach().abs().amax(-1).float(), "amax")
    fresh = torch.zeros(len(uniq), dtype=torch.bool, device=x.device)
    fresh[inv[offsets == 0]] = True
    old = torch.where(fresh.unsqueeze(1), 0.0, scales[uniq])
    new = torch.maximum(old, amax / qmax).clamp_(min=SCALE_FLOOR)
    grow = ((new > old) & (old > 0)).any(1)
    if bool(grow.any()):          # earlier tokens of these blocks: requantize with the new scale
        rows = grow.nonzero().squeeze(1)
        ids = uniq[rows]
        blk = dequantize(data[ids], old[rows].unsqueeze(1), torch.float32)
        data[ids] = quantize(blk, new[rows].view(-1, 1, n_heads, 1), fmt)
    scales[uniq] = new
    data[blocks, offsets] = quantize(x, new[inv].unsqueeze(-1), fmt)


def gather_dequantized(data: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor,
                       length: int, dtype: torch.dtype) -> torch.Tensor:
    """[(B,) length, H, D] in `dtype` of the blocks in `block_table` (one layer, K or V)."""
    q = data[block_table].flatten(-4, -3)[..., :length, :, :]        # [(B,) S, H, D]
    bs = data.shape[1]
    s = scales[block_table].repeat_interleave(bs, dim=-2)[..., :length, :]   # [(B,) S, H]
    return dequantize(q, s, dtype)
