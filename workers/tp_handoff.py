"""A KV handoff between tensor-parallel workers of any sizes on one host, rank to rank: each P
rank gathers, for every D rank it serves in the plan (protocol/tp_transfer.py), the blocks' head
slices into one staging segment (one bulk transfer a (P rank, D rank) pair, with its checksum);
each D rank reads its segments, every D rank verifies every shard it takes, and only when all
of them verified does any D rank write (a missing or corrupt shard fails the whole handoff
closed: nothing written, the request re-prefills).

Rank 0 of each worker drives its ranks with one message a phase (workers/tp_group.py `call`);
the segments live in /dev/shm under the transfer id until `release_tp_shards`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtransfer.base import TransferError
from kvtransfer.tp_shards import ShardLedger, pack_shard, shard_checksum, verify_shard, write_shard
from protocol.tp_transfer import ShardMove, TPTransferPlan, plan_tp_transfer

SHM_DIR = "/dev/shm"
PREFIX = "raypd_tps_"


def shard_path(transfer_id: str, m: ShardMove) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{transfer_id}_p{m.p_rank}_d{m.d_rank}")


@dataclass(frozen=True)
class StagedShards:
    """What P hands D: the plan, the transfer id and each move's checksum (plan order)."""

    transfer_id: str
    plan: TPTransferPlan
    checksums: tuple[int, ...]
    nbytes: int


@dataclass
class HandoffResult:
    shards: int
    nbytes: int
    seconds: float
    ledger: ShardLedger = field(default_factory=ShardLedger)


def plan_for(p_engine, d_engine) -> TPTransferPlan:
    cfg = p_engine.model.config
    return plan_tp_transfer(cfg.num_attention_heads, cfg.num_key_value_heads,
                            p_engine.cfg.tp, d_engine.cfg.tp)


def _rank(runner) -> int:
    return 0 if runner.tp is None else runner.tp.rank


def _collect(comm, values: torch.Tensor) -> torch.Tensor:
    """Each rank's per-move values (0 where not its move) summed on rank 0 (None elsewhere)."""
    if comm is None:
        return values
    parts = comm.gather(values)
    return None if parts is None else torch.stack(parts).sum(0)


def stage_rank(runner, comm, plan: TPTransferPlan, src_blocks: list[int], tid: str):
    """A P rank: its moves' shards packed, written to their segments, checksums to rank 0."""
    sums = torch.zeros(len(plan.moves), dtype=torch.int64)
    for i, m in enumerate(plan.moves):
        if m.p_rank == _rank(runner):
            shard = pack_shard(runner.kv_cache, src_blocks, m.p_local_lo, m.p_local_hi)
            raw = shard.reshape(-1).view(torch.uint8).numpy()
            with open(shard_path(tid, m), "wb") as f:
                f.write(memoryview(raw))
            sums[i] = shard_checksum(shard)
    return _collect(comm, sums)


_pending: dict[str, list[tuple[ShardMove, torch.Tensor]]] = {}   # verified, not yet written


def verify_rank(runner, comm, staged: StagedShards, dst_blocks: list[int]):
    """A D rank: its shards read and verified (kept for `commit_rank`); 1 a verified move,
    -1 a refused one, to rank 0."""
    ok = torch.zeros(len(staged.plan.moves), dtype=torch.int64)
    pool, keep = runner.kv_cache, []
    for i, m in enumerate(staged.plan.moves):
        if m.d_rank != _rank(runner):
            continue
        shape = (*pool.shape[:2], len(dst_blocks), pool.shape[3], m.num_kv_heads, pool.shape[5])
        try:
            raw = np.fromfile(shard_path(staged.transfer_id, m), dtype=np.uint8)
            if raw.size * 1 != int(np.prod(shape)) * pool.element_size():
                raise TransferError(f"shard P{m.p_rank}->D{m.d_rank}: {raw.size} bytes")
            shard = torch.from_numpy(raw).view(pool.dtype).view(shape)
            verify_shard(pool, dst_blocks, m.d_local_lo, m.d_local_hi, shard,
                         staged.checksums[i])
            keep.append((m, shard))
            ok[i] = 1
        except (OSError, TransferError, RuntimeError):
            ok[i] = -1
    _pending[staged.transfer_id] = keep
    return _collect(comm, ok)


def commit_rank(runner, comm, tid: str, dst_blocks: list[int], write: bool) -> None:
    """A D rank writes its verified shards (`write`), or drops them (the handoff failed)."""
    for m, shard in _pending.pop(tid, []):
        if write:
            write_shard(runner.kv_cache, dst_blocks, m.d_local_lo, m.d_local_hi, shard)


def _on_ranks(engine, fn, *args):
    """`fn` on every rank of `engine` (ranks 1.. by one message, rank 0 here); rank 0's
    collected result."""
    group = engine.tp_group
    if group is not None:
        group.call(fn, *args)
        return fn(engine.runner, group.comm, *args)
    return fn(engine.runner, None, *args)


def stage_tp_shards(p_engine, plan: TPTransferPlan, src_blocks: list[int],
                    transfer_id: str) -> StagedShards:
    sums = _on_ranks(p_engine, stage_rank, plan, list(src_blocks), transfer_id)
    pool = p_engine.runner.kv_cache
    per_head_block = pool[:, :, 0, :, 0].numel() * pool.element_size()
    return StagedShards(transfer_id, plan, tuple(int(s) for s in sums),
                        plan.bytes(len(src_blocks), per_head_block))


def pull_tp_shards(d_engine, staged: StagedShards, dst_blocks: list[int],
                   ledger: ShardLedger | None = None) -> HandoffResult:
    """Every D rank takes its shards; all written, or none (raises TransferError)."""
    t0 = time.perf_counter()
    ledger = ledger or ShardLedger()
    ok = _on_ranks(d_engine, verify_rank, staged, list(dst_blocks))
    bad = [m for m, v in zip(staged.plan.moves, ok.tolist(), strict=True) if v != 1]
    _on_ranks(d_engine, commit_rank, staged.transfer_id, list(dst_blocks), not bad)
    if bad:
        ledger.shards_refused += len(bad)
        raise TransferError("TP handoff refused, nothing written: " + ", ".join(
            f"P{m.p_rank}->D{m.d_rank}" for m in bad))
    ledger.shards_received += len(staged.plan.moves)
    ledger.bytes_received += staged.nbytes
    return HandoffResult(len(staged.plan.moves), staged.nbytes, time.perf_counter() - t0,
                         ledger)


def release_tp_shards(staged: StagedShards) -> None:
    """P's staging segments removed (after D's ack, an abort or the lease)."""
    for m in staged.plan.moves:
        try:
            os.unlink(shard_path(staged.transfer_id, m))
        except FileNotFoundError:
            pass


@dataclass
class TPDisaggResult:
    """One request prefilled on P and decoded on D through a rank-to-rank handoff."""

    output_token_ids: list[int]
    handoff: HandoffResult
    bytes_lacked: int          # what D's ranks lacked: blocks past D's hit x each rank's heads
    blocks_moved: int


def disagg_generate(p_engine, d_engine, prompt_ids: list[int], sampling,
                    transfer_id: str) -> TPDisaggResult:
    """`prompt_ids` prefilled on `p_engine` (its first token sampled there), its blocks D lacks
    handed to `d_engine` rank to rank, then decoded there to the end (both engines in this
    process, their ranks wherever they run). P's blocks are released after the handoff;
    a refused handoff re-prefills on D (and raises nothing)."""
    from dataclasses import replace

    from kvcache.manager import cdiv
    preq = p_engine.inputs.make_request(list(prompt_ids), replace(sampling, max_tokens=1,
                                                                   min_tokens=0))
    preq.hold_kv = True
    p_engine.add_request(None, request=preq)
    while p_engine.has_unfinished():
        p_engine.step()
    first = preq.output_token_ids[0]
    nb = cdiv(len(prompt_ids), p_engine.cfg.block_size)
    src = p_engine.handoff.block_table(preq.request_id)[:nb]
    dreq = d_engine.inputs.make_request(list(prompt_ids), sampling)
    hit = d_engine.handoff.reserve(dreq)
    assert hit is not None, "D's pool cannot take the request"
    dst = d_engine.handoff.block_table(dreq.request_id)[:nb]
    plan = plan_for(p_engine, d_engine)
    staged = stage_tp_shards(p_engine, plan, src[hit:], transfer_id)
    try:
        result = pull_tp_shards(d_engine, staged, dst[hit:])
        d_engine.handoff.fill(dreq, dst[hit:], None, first)
    except TransferError:
        result = HandoffResult(0, 0, 0.0)
        d_engine.handoff.fallback(dreq)     # fails closed: D prefills it
    finally:
        release_tp_shards(staged)
        p_engine.handoff.release(preq.request_id)
    while d_engine.has_unfinished():
        d_engine.step()
    pool = d_engine.runner.kv_cache
    per_rank_block = pool[:, :, 0].numel() * pool.element_size()
    return TPDisaggResult(list(dreq.output_token_ids), result,
                          (nb - hit) * per_rank_block * d_engine.cfg.tp, nb - hit)
