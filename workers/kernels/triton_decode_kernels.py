"""The Triton kernels of CUDA paged decode attention (imported only where Triton is installed;
workers/kernels/triton_decode.py is the host side, the one module that imports this one).

Split pass, one program per (sequence b, KV head, split): the split's tokens
[split * partition, (split + 1) * partition) cut to the row's visible keys [lo, context_len),
read tile by tile straight from the pool through the row's block table (token t lives in block
block_tables[b, t // BLOCK_SIZE] at offset t % BLOCK_SIZE), for all GROUP query heads of the KV
head at once (padded to BLOCK_G >= 16 rows for tl.dot; padding rows are computed and never
stored). Online softmax in float32, in base 2 (`qk_scale` is the softmax scale times log2 e):
per head a running max m, sum l and unnormalized output acc. With one split the program writes
acc / l itself; with several it writes (m, l, acc) and the reduce pass, one program per
(b, query head), combines the splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

Invariants the host guarantees: every context length is >= 1, <= block_tables.shape[1] *
BLOCK_SIZE and <= num_splits * partition; `window` >= 1 (NO_WINDOW for none), so every row
sees >= 1 key and the split holding its first visible key is non-empty; the last stride of q,
k, v and out is 1 and a block table's row is contiguous; the scratch tensors m, l (float32
[B, H, num_splits]) and acc (float32 [B, H, num_splits, HEAD_DIM]) are contiguous. An empty split
(all its tokens outside [lo, context_len)) writes m = -inf, l = 0, acc = 0, which the reduce pass
weighs 0. Every tile the loop visits holds at least one visible token (it starts at the first
visible token of the split and steps while below the end), so the running max is finite after
the first tile and no exp2(-inf - -inf) is ever taken.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_split(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    num_heads, qk_scale, window, partition,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    ctx = tl.load(lens_ptr + b).to(tl.int32)
    lo = tl.maximum(ctx - window, 0)                             # first visible key
    start = tl.maximum(split * partition, lo)
    end = tl.minimum(split * partition + partition, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g                                      # query heads of this KV head
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + n
        valid = tok < end                                        # tok >= start >= lo already
        blk = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = (tok % BLOCK_SIZE).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_kt + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)         # [BLOCK_N, BLOCK_D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                           # [BLOCK_G, BLOCK_N] float32
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                    # finite: a valid token per tile
        alpha = tl.exp2(m_i - m_new)                             # 0 on the first tile
        p = tl.exp2(s - m_new[:, None])                          # 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vt + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)                        # [BLOCK_G, BLOCK_D] float32
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    store_mask = g_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + split   # [BLOCK_G]
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=store_mask)


@triton.jit
def paged_decode_reduce(
    out_ptr, m_ptr, l_ptr, acc_ptr,
    stride_ob, stride_oh,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    row = (b.to(tl.int64) * num_heads + h) * num_splits + s     # [BLOCK_S]
    m = tl.load(m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)                                         # finite: some split is non-empty
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)    # empty or padding splits: 0
    total = tl.sum(w * l_s, 0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)
