"""Packing, checking and landing the KV shards of a TP handoff plan (`protocol.tp_transfer`).

A shard is one move's data: all the request's blocks for one head range of one P rank, gathered
into a new contiguous tensor ``[num_layers, 2, n_blocks, block_size, heads, head_dim]`` with one
crc32 over its bytes. D verifies every shard before it writes any: a missing, misshapen or
corrupt shard fails the whole handoff closed and leaves every D rank's pool untouched.
`run_plan_in_process` is the reference executor on in-process pools, and the spec of the
cross-process one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kvtransfer.base import TransferError, as_bytes, crc32
from protocol.tp_transfer import ShardMove, TPTransferPlan

POOL_DIMS = 6  # [num_layers, 2, num_blocks, block_size, rank_kv_heads, head_dim]


@dataclass
class ShardLedger:
    """Shard counters a worker reports: sent, received (verified and written), refused."""

    shards_sent: int = 0
    bytes_sent: int = 0
    shards_received: int = 0
    bytes_received: int = 0
    shards_refused: int = 0


def _check_pool(pool: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int) -> list[int]:
    if pool.dim() != POOL_DIMS:
        raise TransferError(
            f"TP shards need a [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] pool; "
            f"got {pool.dim()} dims {tuple(pool.shape)} (quantized pools are not supported)")
    ids = list(block_ids)
    if ids and (min(ids) < 0 or max(ids) >= pool.shape[2]):
        raise TransferError(f"block ids out of range [0, {pool.shape[2]})")
    if not 0 <= lo < hi <= pool.shape[4]:
        raise TransferError(f"head range [{lo}, {hi}) outside the pool's {pool.shape[4]} heads")
    return ids


def _is_run(ids: list[int]) -> bool:
    return bool(ids) and ids == list(range(ids[0], ids[0] + len(ids)))


def pack_shard(pool: torch.Tensor, block_ids: Sequence[int], p_local_lo: int,
               p_local_hi: int) -> torch.Tensor:
    """``pool[:, :, block_ids, :, lo:hi]`` as a new contiguous tensor, in one gather (one copy
    for a run of consecutive ids)."""
    ids = _check_pool(pool, block_ids, p_local_lo, p_local_hi)
    heads = slice(p_local_lo, p_local_hi)
    if _is_run(ids):
        return pool[:, :, ids[0]:ids[0] + len(ids), :, heads].clone(
            memory_format=torch.contiguous_format)
    index = torch.as_tensor(ids, dtype=torch.long, device=pool.device)
    return pool[:, :, index, :, heads].contiguous()  # faster than index_select on CPU


def shard_checksum(t: torch.Tensor) -> int:
    """crc32 over the shard's bytes (the page checksum's algorithm, one per shard)."""
    return crc32(as_bytes(t.detach().to("cpu").contiguous()))


def verify_shard(pool: torch.Tensor, block_ids: Sequence[int], d_local_lo: int, d_local_hi: int,
                 shard: torch.Tensor, expected_checksum: int) -> list[int]:
    """Raise TransferError unless `shard` fits ``pool[:, :, block_ids, :, lo:hi]`` and matches
    its checksum; returns the block ids. Writes nothing."""
    ids = _check_pool(pool, block_ids, d_local_lo, d_local_hi)
    want = (*pool.shape[:2], len(ids), pool.shape[3], d_local_hi - d_local_lo, pool.shape[5])
    if tuple(shard.shape) != want or shard.dtype != pool.dtype:
        raise TransferError(f"shard {tuple(shard.shape)} {shard.dtype} does not fit "
                            f"{want} {pool.dtype}")
    got = shard_checksum(shard)
    if got != expected_checksum:
        raise TransferError(f"shard checksum mismatch: {got:#x} != {expected_checksum:#x}")
    return ids


def write_shard(pool: torch.Tensor, block_ids: Sequence[int], d_local_lo: int, d_local_hi: int,
                shard: torch.Tensor) -> None:
    """``pool[:, :, block_ids, :, lo:hi] = shard`` (a verified shard)."""
    ids, heads, shard = list(block_ids), slice(d_local_lo, d_local_hi), shard.to(pool.device)
    if _is_run(ids):
        pool[:, :, ids[0]:ids[0] + len(ids), :, heads].copy_(shard)
    else:
        index = torch.as_tensor(ids, dtype=torch.long, device=pool.device)
        pool[:, :, :, :, heads].index_copy_(2, index, shard)


def unpack_shard(pool: torch.Tensor, block_ids: Sequence[int], d_local_lo: int, d_local_hi: int,
                 shard: torch.Tensor, expected_checksum: int) -> None:
    """Verify `shard` (TransferError before writing anything), then write it into `pool`."""
    verify_shard(pool, block_ids, d_local_lo, d_local_hi, shard, expected_checksum)
    write_shard(pool, block_ids, d_local_lo, d_local_hi, shard)


def run_plan_in_process(plan: TPTransferPlan, p_pools: Sequence[torch.Tensor],
                        d_pools: Sequence[torch.Tensor], src_blocks: Sequence[int],
                        dst_blocks: Sequence[int],
                        corrupt: Collection[tuple[int, int]] = frozenset(),
                        missing: Collection[tuple[int, int]] = frozenset(),
                        ledger: ShardLedger | None = None) -> dict:
    """Execute `plan`: pack every move from P rank pools, verify ALL shards, then write them into
    D rank pools. `corrupt` / `missing` name (p_rank, d_rank) shards to flip a byte of after its
    checksum / to drop (tests). Any bad shard raises TransferError with no D pool written.
    Returns {"shards", "bytes", "seconds"}."""
    if (len(p_pools), len(d_pools)) != (plan.t_p, plan.t_d):
        raise TransferError(f"{len(p_pools)} P pools and {len(d_pools)} D pools for a "
                            f"{plan.t_p} -> {plan.t_d} plan")
    if len(src_blocks) != len(dst_blocks) or len(set(dst_blocks)) != len(dst_blocks):
        raise TransferError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations "
                            "(destinations must be distinct)")
    ledger = ledger if ledger is not None else ShardLedger()
    t0 = time.perf_counter()
    sent: dict[tuple[int, int], tuple[ShardMove, torch.Tensor, int]] = {}
    for m in plan.moves:  # P side: one gathered shard and one checksum per rank pair
        shard = pack_shard(p_pools[m.p_rank], src_blocks, m.p_local_lo, m.p_local_hi)
        checksum = shard_checksum(shard)
        ledger.shards_sent += 1
        ledger.bytes_sent += shard.nbytes
        if (m.p_rank, m.d_rank) in corrupt:
            shard.view(torch.uint8).view(-1)[0] ^= 0xFF
        if (m.p_rank, m.d_rank) not in missing:
            sent[(m.p_rank, m.d_rank)] = (m, shard, checksum)
    refused: list[str] = []
    for m in plan.moves:  # D side: every shard checked before any is written
        key = (m.p_rank, m.d_rank)
        try:
            if key not in sent:
                raise TransferError("shard missing")
            _, shard, checksum = sent[key]
            verify_shard(d_pools[m.d_rank], dst_blocks, m.d_local_lo, m.d_local_hi, shard,
                         checksum)
        except TransferError as e:
            refused.append(f"P{m.p_rank}->D{m.d_rank}: {e}")
    if refused:
        ledger.shards_refused += len(refused)
        raise TransferError(f"TP handoff refused, nothing written: {'; '.join(refused)}")
    nbytes = 0
    for m, shard, _ in sent.values():
        write_shard(d_pools[m.d_rank], dst_blocks, m.d_local_lo, m.d_local_hi, shard)
        nbytes += shard.nbytes
    ledger.shards_received += len(sent)
    ledger.bytes_received += nbytes
    return {"shards": len(sent), "bytes": nbytes, "seconds": time.perf_counter() - t0}
