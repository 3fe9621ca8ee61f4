"""Which attention heads each rank of a tensor-parallel worker holds (torch- and Ray-free).

A worker of TP size t splits a model's query heads evenly over its ranks, and its KV heads too
when t divides them; when t exceeds the KV heads (t a multiple of them) every KV head is
replicated t // num_kv_heads times, rank r holding head r // (t // num_kv_heads), as vLLM does.
Either way rank r's query heads attend to exactly its own KV heads (the GQA group stays on one
rank), so attention runs per rank with no communication.

`tp_refusal` is the one rule a TP size must keep; configs and engines both call it.
"""

from __future__ import annotations

from dataclasses import dataclass


def tp_refusal(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why TP size `tp` cannot split a model of these heads, or None."""
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    if num_heads % tp:
        return (f"tp {tp} does not divide the model's {num_heads} query heads "
                "(a rank holds num_attention_heads / tp of them)")
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"tp {tp} neither divides the model's {num_kv_heads} KV heads nor is a "
                "multiple of them (KV heads are split evenly, or replicated when tp exceeds them)")
    return None


@dataclass(frozen=True)
class RankHeads:
    """Rank `rank` of `tp`: its query heads [q_lo, q_hi) and KV heads [kv_lo, kv_hi), global
    indices; `replicas` is how many ranks hold each of its KV heads (1: split, not replicated)."""

    rank: int
    tp: int
    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    replicas: int

    @property
    def num_heads(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo


def rank_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> RankHeads:
    """The heads rank `rank` of a TP-`tp` worker holds (raises ValueError on a refused tp)."""
    reason = tp_refusal(num_heads, num_kv_heads, tp)
    if reason:
        raise ValueError(reason)
    assert 0 <= rank < tp, (rank, tp)
    q = num_heads // tp
    if num_kv_heads >= tp:
        kv = num_kv_heads // tp
        return RankHeads(rank, tp, rank * q, (rank + 1) * q, rank * kv, (rank + 1) * kv, 1)
    replicas = tp // num_kv_heads
    head = rank // replicas
    return RankHeads(rank, tp, rank * q, (rank + 1) * q, head, head + 1, replicas)


def all_rank_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[RankHeads]:
    return [rank_heads(num_heads, num_kv_heads, tp, r) for r in range(tp)]
