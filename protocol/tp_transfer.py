"""The rank-to-rank KV handoff plan between a prefill worker of TP size t_p and a decode worker
of TP size t_d: which P rank sends which KV heads to which D rank (torch- and Ray-free).

Every D rank needs exactly the KV heads it holds (`tp_layout.rank_heads`). Each head comes from
exactly one P rank that holds it; when P replicates a head, the source is the holder nearest to
D rank d's proportional position `d * t_p // t_d` (clamped into the holders' range), so equal
sizes pair rank r with rank r and replicated heads spread evenly (within one D rank) over their
replicas. All heads one D rank takes from one P rank form one contiguous range, hence one move:
one bulk transfer of all the request's blocks for that head range, with its own checksum.

Invariants (`TPTransferPlan.check`): each D rank's heads are covered exactly once, every source
holds what it sends, one move per (p_rank, d_rank) pair; so the bytes moved equal D's need.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocol.tp_layout import RankHeads, rank_heads, tp_refusal


@dataclass(frozen=True)
class ShardMove:
    """P rank `p_rank` sends KV heads [kv_lo, kv_hi) (global) to D rank `d_rank`; the same range
    is [p_local_lo, p_local_hi) in P's pool and [d_local_lo, d_local_hi) in D's pool."""

    p_rank: int
    d_rank: int
    kv_lo: int
    kv_hi: int
    p_local_lo: int
    p_local_hi: int
    d_local_lo: int
    d_local_hi: int

    def __post_init__(self) -> None:
        n = self.kv_hi - self.kv_lo
        assert n > 0, self
        assert self.p_local_hi - self.p_local_lo == n == self.d_local_hi - self.d_local_lo, self

    @property
    def num_kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo


def kv_ranks(num_kv_heads: int, tp: int) -> list[RankHeads]:
    """Each rank's KV heads; query heads do not move KV placement, so any legal count serves."""
    return [rank_heads(num_kv_heads * tp, num_kv_heads, tp, r) for r in range(tp)]


@dataclass(frozen=True)
class TPTransferPlan:
    """All shard moves of one handoff from a TP-`t_p` prefill worker to a TP-`t_d` decode worker,
    ordered by (d_rank, kv_lo)."""

    num_kv_heads: int
    t_p: int
    t_d: int
    moves: tuple[ShardMove, ...]

    def moves_to(self, d_rank: int) -> tuple[ShardMove, ...]:
        return tuple(m for m in self.moves if m.d_rank == d_rank)

    def moves_from(self, p_rank: int) -> tuple[ShardMove, ...]:
        return tuple(m for m in self.moves if m.p_rank == p_rank)

    def bytes(self, num_blocks: int, bytes_per_head_block: int) -> int:
        """Total bytes moved for `num_blocks` blocks; `bytes_per_head_block` is one KV head of one
        block over all layers, K and V (num_layers * 2 * block_size * head_dim * itemsize)."""
        return sum(m.num_kv_heads for m in self.moves) * num_blocks * bytes_per_head_block

    def digest(self) -> str:
        """A stable hex digest of the plan, carried in transfer handles."""
        text = f"{self.num_kv_heads}|{self.t_p}|{self.t_d}|" + ";".join(
            f"{m.p_rank},{m.d_rank},{m.kv_lo},{m.kv_hi}" for m in self.moves)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def check(self) -> None:
        """Assert the plan's invariants (see the module docstring)."""
        p_ranks = kv_ranks(self.num_kv_heads, self.t_p)
        d_ranks = kv_ranks(self.num_kv_heads, self.t_d)
        pairs = [(m.p_rank, m.d_rank) for m in self.moves]
        assert len(set(pairs)) == len(pairs), f"more than one move for a rank pair: {pairs}"
        for m in self.moves:
            assert 0 <= m.p_rank < self.t_p and 0 <= m.d_rank < self.t_d, m
            p, d = p_ranks[m.p_rank], d_ranks[m.d_rank]
            assert p.kv_lo <= m.kv_lo and m.kv_hi <= p.kv_hi, f"P rank lacks the heads: {m}"
            assert (m.p_local_lo, m.d_local_lo) == (m.kv_lo - p.kv_lo, m.kv_lo - d.kv_lo), m
        for d in d_ranks:
            got = sorted(h for m in self.moves_to(d.rank) for h in range(m.kv_lo, m.kv_hi))
            assert got == list(range(d.kv_lo, d.kv_hi)), f"D rank {d.rank} gets heads {got}"


def plan_tp_transfer(num_heads: int, num_kv_heads: int, t_p: int, t_d: int) -> TPTransferPlan:
    """The handoff plan from TP size `t_p` to `t_d` (ValueError with tp_layout's rule when a
    size is refused)."""
    for tp in (t_p, t_d):
        reason = tp_refusal(num_heads, num_kv_heads, tp)
        if reason:
            raise ValueError(reason)
    p_ranks = kv_ranks(num_kv_heads, t_p)
    holders: dict[int, list[int]] = {}
    for p in p_ranks:
        for h in range(p.kv_lo, p.kv_hi):
            holders.setdefault(h, []).append(p.rank)
    moves: list[ShardMove] = []
    for d in kv_ranks(num_kv_heads, t_d):
        anchor = d.rank * t_p // t_d
        runs: list[list[int]] = []  # [p_rank, kv_lo, kv_hi]; sources rise with h: one run each
        for h in range(d.kv_lo, d.kv_hi):
            src = min(max(anchor, holders[h][0]), holders[h][-1])
            if runs and runs[-1][0] == src:
                runs[-1][2] = h + 1
            else:
                runs.append([src, h, h + 1])
        for src, lo, hi in runs:
            p = p_ranks[src]
            moves.append(ShardMove(src, d.rank, lo, hi, lo - p.kv_lo, hi - p.kv_lo,
                                   lo - d.kv_lo, hi - d.kv_lo))
    plan = TPTransferPlan(num_kv_heads, t_p, t_d, tuple(moves))
    plan.check()
    return plan
