"""The KV handoff plan between TP sizes: hand-built mappings, its invariants for every legal pair,
bytes equal to D's need, and shards that land exactly D's heads or, when one is bad, nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtransfer.base import TransferError
from kvtransfer.tp_shards import (
    ShardLedger,
    pack_shard,
    run_plan_in_process,
    shard_checksum,
    unpack_shard,
)
from protocol.tp_layout import rank_heads, tp_refusal
from protocol.tp_transfer import ShardMove, plan_tp_transfer

SIZES = (1, 2, 3, 4, 8)
KV_HEADS = (1, 2, 3, 8)
HEADS = 24  # divisible by every size above: only the KV-head rule refuses a pair
LEGAL = [(kv, tp, td) for kv, tp, td in itertools.product(KV_HEADS, SIZES, SIZES)
         if tp_refusal(HEADS, kv, tp) is None and tp_refusal(HEADS, kv, td) is None]
LAYERS, BLOCK, HEAD_DIM, NUM_BLOCKS = 2, 4, 3, 6


def one_head(p, d, h, p_local=0, d_local=0):
    return ShardMove(p, d, h, h + 1, p_local, p_local + 1, d_local, d_local + 1)


# (num_kv_heads, t_p, t_d) -> moves, written out by hand from tp_layout's placement
EXPECTED = {
    (8, 2, 1): [ShardMove(0, 0, 0, 4, 0, 4, 0, 4), ShardMove(1, 0, 4, 8, 0, 4, 4, 8)],
    (8, 1, 2): [ShardMove(0, 0, 0, 4, 0, 4, 0, 4), ShardMove(0, 1, 4, 8, 4, 8, 0, 4)],
    (8, 2, 2): [ShardMove(0, 0, 0, 4, 0, 4, 0, 4), ShardMove(1, 1, 4, 8, 0, 4, 0, 4)],
    # P replicates: P0, P1 hold head 0, P2, P3 head 1; one source each, the nearest replica
    (2, 4, 2): [one_head(0, 0, 0), one_head(2, 1, 1)],
    # D replicates: D0, D1 hold head 0, D2, D3 head 1
    (2, 2, 4): [one_head(0, 0, 0), one_head(0, 1, 0), one_head(1, 2, 1), one_head(1, 3, 1)],
    (3, 1, 3): [one_head(0, d, d, p_local=d) for d in range(3)],
    (3, 3, 1): [one_head(p, 0, p, d_local=p) for p in range(3)],
    (8, 4, 8): [one_head(d // 2, d, d, p_local=d % 2) for d in range(8)],
    # both replicate: head 0 on P0-3 and D0-1, head 1 on P4-7 and D2-3; sources spread out
    (2, 8, 4): [one_head(0, 0, 0), one_head(2, 1, 0), one_head(4, 2, 1), one_head(6, 3, 1)],
    (1, 8, 2): [one_head(0, 0, 0), one_head(4, 1, 0)],
    (2, 4, 4): [one_head(r, r, r // 2) for r in range(4)],
}


@pytest.mark.parametrize("kv, tp, td", sorted(EXPECTED))
def test_plan_matches_hand_built_mapping(kv, tp, td):
    assert list(plan_tp_transfer(HEADS, kv, tp, td).moves) == EXPECTED[(kv, tp, td)]


@pytest.mark.parametrize("kv, tp, td", LEGAL)
def test_plan_invariants_hold_for_every_legal_pair(kv, tp, td):
    plan = plan_tp_transfer(HEADS, kv, tp, td)
    plan.check()
    d_need = sum(rank_heads(HEADS, kv, td, d).num_kv_heads for d in range(td))
    assert plan.bytes(NUM_BLOCKS, 7) == d_need * NUM_BLOCKS * 7  # no shard twice
    assert sum(len(plan.moves_from(p)) for p in range(tp)) == len(plan.moves)
    for h in range(kv):  # a replicated head: the D ranks' fetches spread evenly over holders
        holders = [p for p in range(tp)
                   if rank_heads(HEADS, kv, tp, p).kv_lo <= h < rank_heads(HEADS, kv, tp, p).kv_hi]
        loads = [sum(1 for m in plan.moves_from(p) if m.kv_lo <= h < m.kv_hi) for p in holders]
        assert max(loads) - min(loads) <= 1, (h, loads)


def test_plan_digest_is_stable_and_tells_plans_apart():
    digests = {plan_tp_transfer(HEADS, kv, tp, td).digest() for kv, tp, td in LEGAL}
    assert len(digests) == len(LEGAL)
    assert plan_tp_transfer(HEADS, 8, 2, 4).digest() == plan_tp_transfer(HEADS, 8, 2, 4).digest()


@pytest.mark.parametrize("heads, kv, tp, td, rule", [
    (HEADS, 3, 2, 1, "neither divides"), (HEADS, 2, 1, 3, "neither divides"),
    (9, 3, 3, 2, "does not divide the model's 9 query heads"), (HEADS, 8, 0, 1, "tp must be")])
def test_refused_tp_size_raises_with_the_rule(heads, kv, tp, td, rule):
    with pytest.raises(ValueError, match=rule):
        plan_tp_transfer(heads, kv, tp, td)


def rank_pools(full: torch.Tensor, kv: int, tp: int) -> list[torch.Tensor]:
    return [full[:, :, :, :, r.kv_lo:r.kv_hi].clone()
            for r in (rank_heads(HEADS, kv, tp, i) for i in range(tp))]


def handoff_setup(kv, tp, td, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, kv, HEAD_DIM, generator=g)
    d_pools = [torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK, rank_heads(HEADS, kv, td, d).num_kv_heads,
                           HEAD_DIM) for d in range(td)]
    return plan_tp_transfer(HEADS, kv, tp, td), full, rank_pools(full, kv, tp), d_pools


@pytest.mark.parametrize("src, dst", [([4, 1, 2], [0, 5, 3]), ([1, 2, 3], [3, 4, 5])])
@pytest.mark.parametrize("kv, tp, td", LEGAL)
def test_round_trip_lands_each_d_rank_its_heads(kv, tp, td, src, dst):
    plan, full, p_pools, d_pools = handoff_setup(kv, tp, td)
    ledger = ShardLedger()
    out = run_plan_in_process(plan, p_pools, d_pools, src, dst, ledger=ledger)
    per_head_block = LAYERS * 2 * BLOCK * HEAD_DIM * full.element_size()
    assert out["bytes"] == plan.bytes(len(src), per_head_block) == ledger.bytes_received
    assert out["shards"] == len(plan.moves) == ledger.shards_received == ledger.shards_sent
    for d, pool in enumerate(d_pools):
        r = rank_heads(HEADS, kv, td, d)
        assert torch.equal(pool[:, :, dst], full[:, :, src, :, r.kv_lo:r.kv_hi])
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not pool[:, :, others].any()  # nothing outside the destination blocks


@pytest.mark.parametrize("bad", ["corrupt", "missing"])
def test_one_bad_shard_fails_the_handoff_with_no_d_pool_written(bad):
    plan, _, p_pools, d_pools = handoff_setup(8, 2, 4)
    before = [p.clone() for p in d_pools]
    last = (plan.moves[-1].p_rank, plan.moves[-1].d_rank)  # the earlier shards are all good
    ledger = ShardLedger()
    with pytest.raises(TransferError, match="nothing written"):
        run_plan_in_process(plan, p_pools, d_pools, [0, 1], [2, 3], ledger=ledger, **{bad: {last}})
    assert all(torch.equal(a, b) for a, b in zip(d_pools, before, strict=True))
    assert (ledger.shards_refused, ledger.shards_received) == (1, 0)


def test_unpack_refuses_bad_checksum_and_bad_shape_before_writing():
    pool = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, 4, HEAD_DIM)
    shard = pack_shard(pool, [3, 1], 1, 3)
    assert shard.is_contiguous() and shard.shape == (LAYERS, 2, 2, BLOCK, 2, HEAD_DIM)
    assert torch.equal(shard, pool[:, :, [3, 1], :, 1:3])
    dst = torch.zeros_like(pool)
    with pytest.raises(TransferError, match="checksum"):
        unpack_shard(dst, [0, 2], 0, 2, shard, shard_checksum(shard) ^ 1)
    with pytest.raises(TransferError, match="does not fit"):
        unpack_shard(dst, [0, 2], 0, 3, shard, shard_checksum(shard))
    assert not dst.any()
    unpack_shard(dst, [0, 2], 2, 4, shard, shard_checksum(shard))
    assert torch.equal(dst[:, :, [0, 2], :, 2:4], shard) and not dst[:, :, :, :, :2].any()


def test_pack_refuses_a_quantized_pool():
    packed = torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK * 4 * HEAD_DIM, dtype=torch.uint8)
    with pytest.raises(TransferError, match="quantized pools are not supported"):
        pack_shard(packed, [0], 0, 1)
