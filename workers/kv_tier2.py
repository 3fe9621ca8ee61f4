"""The second KV tier's bytes: a host store of evicted blocks in their stored form, one slot per
block (all layers, K and V; a quantized block's scales included), driven by the pool through
`demote` / `reload` (kvcache/tier2.py says which slot holds which hash).

Where the pool is on a GPU the store is host memory (pinned where CUDA is available); where the
pool itself is in host memory it is a memory-mapped file on local disk (`tier2_dir`, default the
system temp folder; the file is unlinked once mapped, so nothing is left behind), so tier 2 does
not compete with the pool for RAM.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch


def slot_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block's stored form across all layers (one tier-2 slot)."""
    return kv_cache[:, :, 0].numel() * kv_cache.element_size()


class HostKVStore:
    """`store[slot]` = one block's pages `[num_layers, 2, ...]`, same dtype as the pool."""

    def __init__(self, pool_tensor: Callable[[], torch.Tensor], num_slots: int,
                 tier2_dir: str | None = None) -> None:
        """`pool_tensor()` returns the pool `[num_layers, 2, num_blocks, ...]` (block at dim 2)."""
        assert num_slots > 0
        self._pool = pool_tensor
        kv = pool_tensor()
        shape = (num_slots, kv.shape[0], kv.shape[1], *kv.shape[3:])
        nbytes = num_slots * slot_bytes(kv)
        if kv.device.type == "cpu":
            self.kind = "mmap"
            fd, path = tempfile.mkstemp(prefix="raypd-kv-tier2-", suffix=".bin",
                                        dir=tier2_dir or None)
            try:
                os.ftruncate(fd, nbytes)
                raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            finally:
                os.close(fd)
                os.unlink(path)
            self.store = raw.view(kv.dtype).view(shape)
        else:
            self.kind = "host"
            self.store = torch.empty(shape, dtype=kv.dtype,
                                     pin_memory=torch.cuda.is_available())
        self.num_slots = num_slots
        self.nbytes = nbytes

    def demote(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        kv = self._pool()
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
        self.store[torch.tensor(list(slots), dtype=torch.long)] = \
            kv[:, :, ids].movedim(2, 0).to("cpu")

    def reload(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        kv = self._pool()
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
        pages = self.store[torch.tensor(list(slots), dtype=torch.long)]
        kv[:, :, ids] = pages.to(kv.device, non_blocking=True).movedim(0, 2)
        if kv.device.type == "cuda":    # the pool times this call: the copy must have landed
            torch.cuda.synchronize(kv.device)


# ---- engine hooks (kept here so the engine carries three one-line calls) ------------------------
def attach_tier2(pool, runner, tier2_dir: str | None = None) -> HostKVStore | None:
    """Give `pool` (kvcache BlockPool with a Tier2Index) a host store over `runner.kv_cache`."""
    if pool.tier2 is None:
        return None
    store = HostKVStore(lambda: runner.kv_cache, pool.tier2.num_slots, tier2_dir)
    pool.mover = store
    return store


def observe_prefill_cost(costs, chunks, seconds: float) -> None:
    """Feed a step's time to the reload/recompute cost model: steps that prefill (a chunk of
    more than one token) give the seconds per computed token a recompute would cost; decode-only
    steps say nothing about it (one token per request, bound by reading weights)."""
    if not any(ch.num_new_tokens > 1 for ch in chunks):
        return
    costs.observe_prefill(sum(ch.num_new_tokens for ch in chunks), seconds)


def tier2_counters(kv) -> dict:
    """The tier-2 counters of engine stats / metrics, plus the measured costs they came from."""
    pool = kv.pool
    d = asdict(pool.tier2_stats)
    d.update(tier2_blocks=pool.num_tier2_blocks,
             tier2_slots=pool.tier2.num_slots if pool.tier2 is not None else 0,
             reload_s_per_token=kv.costs.reload_s_per_token,
             prefill_s_per_token=kv.costs.prefill_s_per_token)
    return d
