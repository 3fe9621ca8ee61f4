"""CUDA paged decode attention in Triton: each sequence's K/V read in place from the pool through
its block table (no gather), all query heads of a KV head in one program, split over long
contexts with a reduction pass (workers/kernels/triton_decode_kernels.py holds the kernels).

Triton is imported lazily, on the first question asked here: where it is missing, where there is
no CUDA, or with `RAYPD_TRITON_DECODE=0`, `available()` is False and workers/attention.py keeps
its PyTorch gather path. Every launch is asynchronous and sync-free (the split count comes from
the host's `max_context_len`, never from the device), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

from kvcache.manager import cdiv

log = logging.getLogger(__name__)

NAME = "triton-cuda"            # what `attention_kernel` reports when this kernel runs
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GROUP = 64                  # query heads per KV head one program takes
MAX_SPLITS = 64                 # splits of one row's context (the reduce pass reads them at once)
MIN_SPLIT_TOKENS = 256          # a split reads at least this many tokens (when there are that many)
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30             # the window passed for none: no context is that long


def _enabled() -> bool:
    return os.environ.get("RAYPD_TRITON_DECODE", "1") != "0"


def import_kernels(module: str, what: str) -> ModuleType | None:
    """`workers.kernels.<module>` (Triton kernels), or None where Triton cannot be imported: logged
    once per caller (each caches its answer), `what` naming what then runs instead."""
    try:
        return importlib.import_module(f"workers.kernels.{module}")
    except Exception as e:  # noqa: BLE001 - ImportError, or a Triton that fails to initialise
        log.info("Triton kernels %s unavailable (%s: %s); %s", module, type(e).__name__, e,
                 what)
        return None


@functools.cache
def _kernels() -> ModuleType | None:
    """workers/kernels/triton_decode_kernels.py, or None where Triton cannot be imported."""
    return import_kernels("triton_decode_kernels", "the torch path runs")


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def unavailable_reason() -> str:
    """Why the kernel does not run here ("" when it does)."""
    if not _enabled():
        return "RAYPD_TRITON_DECODE=0"
    if not _cuda():
        return "no CUDA"
    if _kernels() is None:
        return "triton not importable"
    return ""


def available() -> bool:
    """Whether the kernel can run on this machine's GPUs (decided once per process, except the
    environment switch, which is read each time)."""
    return unavailable_reason() == ""


def kernel_name(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """`NAME` when decode attention over a float pool of `dtype` on `device` runs here, else
    None."""
    if device.type != "cuda" or dtype not in DTYPES or not 0 < head_dim <= MAX_HEAD_DIM:
        return None
    return NAME if available() else None


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` takes q [B, H, D] over a float pool k_cache [N, bs, Hkv, D]."""
    if q.device.type != "cuda" or q.dim() != 3 or k_cache.dim() != 4:
        return False
    h, h_kv = q.shape[1], k_cache.shape[2]
    return (q.dtype in DTYPES and k_cache.dtype in DTYPES and h_kv > 0 and h % h_kv == 0
            and h // h_kv <= MAX_GROUP and kernel_name(q.device, k_cache.dtype, q.shape[2])
            is not None)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(batch: int, kv_heads: int, max_context_len: int, block_n: int,
               num_sms: int) -> tuple[int, int]:
    """(num_splits, partition): enough programs to fill the GPU (about two per multiprocessor)
    without splits shorter than MIN_SPLIT_TOKENS or more than MAX_SPLITS; `partition` is a
    multiple of `block_n` and num_splits * partition >= max_context_len."""
    wanted = cdiv(2 * num_sms, max(1, batch * kv_heads))
    by_length = cdiv(max_context_len, MIN_SPLIT_TOKENS)
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    partition = cdiv(max_context_len, splits)
    partition = cdiv(partition, block_n) * block_n
    return cdiv(max_context_len, partition), partition


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 window: int | None, max_context_len: int) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D] (q's dtype): row b attends to its tokens
    [max(0, len_b - window), len_b) of the pool k_cache/v_cache [num_blocks, bs, Hkv, D] (one
    layer's views; last dimension contiguous), read through block_tables[b] ([B, width] int,
    width * bs >= every len_b); context_lens [B] (>= 1 each) on the device;
    `max_context_len` >= every len_b, known on the host (it sizes the splits; never read back).
    Call `applies` first."""
    kern = _kernels()
    assert kern is not None, "Triton decode attention called where it is unavailable"
    b, h, d = q.shape
    _, bs, h_kv, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == d and h % h_kv == 0
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == b and context_lens.shape == (b,)
    assert bs & (bs - 1) == 0, "block size must be a power of two"
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_tables.stride(1) != 1:       # the kernel indexes a row's blocks at stride 1
        block_tables = block_tables.contiguous()
    if context_lens.stride(0) != 1:
        context_lens = context_lens.contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = h // h_kv
    block_d = _pow2(d, 16)
    block_n = 64 if k_cache.element_size() <= 2 and q.element_size() <= 2 else 32
    num_splits, partition = split_plan(b, h_kv, max(1, max_context_len), block_n,
                                       _num_sms(q.device.index or 0))
    one = num_splits == 1
    if one:
        m = l_sum = acc = out   # unused by the kernel with ONE_SPLIT (any pointer will do)
    else:
        m = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
    kern.paged_decode_split[(b, h_kv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, m, l_sum, acc,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        h, float(scale) * LOG2E, int(window) if window else NO_WINDOW, partition,
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_G=_pow2(group, 16), BLOCK_D=block_d,
        BLOCK_N=block_n, ONE_SPLIT=one, IEEE=q.dtype == torch.float32,
        num_warps=4)
    if not one:
        kern.paged_decode_reduce[(b, h)](
            out, m, l_sum, acc, out.stride(0), out.stride(1), h, num_splits,
            HEAD_DIM=d, BLOCK_S=_pow2(num_splits), BLOCK_D=block_d, num_warps=4)
    return out
