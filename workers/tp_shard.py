"""One rank's share of a tensor-parallel model: its heads, its slice of the intermediate size and
of the vocabulary, and the group's all-reduce (what workers/llama.py needs to build and run a
shard; workers/tp_group.py starts the ranks).

The lm_head is held one of two ways (`LM_HEADS`), both measured by `raypd bench tp`:
- "rank0": the whole head on rank 0, which alone computes logits (the other ranks skip it);
- "vocab": each rank a vocabulary slice, rank 0 gathering the slices (one gather a step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from protocol.tp_layout import RankHeads

LM_HEADS = ("rank0", "vocab")
DEFAULT_LM_HEAD = "rank0"


@dataclass
class TPShard:
    """Rank `heads.rank` of `heads.tp`; `comm` is the group's channel (workers/kernels/tp_comm:
    all_reduce_, gather, broadcast, barrier)."""

    heads: RankHeads
    comm: Any
    lm_head: str = DEFAULT_LM_HEAD
    vocab: int = 0            # the lm_head's rows (set by vocab_range)
    allreduce_s: float = 0.0  # time in all-reduces (waiting for the slowest rank included)

    def __post_init__(self) -> None:
        assert self.lm_head in LM_HEADS, self.lm_head
        assert self.comm.rank == self.heads.rank and self.comm.world == self.heads.tp

    @property
    def rank(self) -> int:
        return self.heads.rank

    @property
    def size(self) -> int:
        return self.heads.tp

    def intermediate_range(self, size: int) -> tuple[int, int]:
        """This rank's [lo, hi) of an MLP's intermediate size (even split, any remainder spread)."""
        return self.rank * size // self.size, (self.rank + 1) * size // self.size

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """This rank's [lo, hi) rows of an lm_head of `vocab` rows (empty: it computes no
        logits)."""
        self.vocab = vocab
        if self.lm_head == "rank0":
            return (0, vocab) if self.rank == 0 else (0, 0)
        per = self._vocab_per()
        return min(vocab, self.rank * per), min(vocab, (self.rank + 1) * per)

    def _vocab_per(self) -> int:
        return -(-self.vocab // self.size)   # equal slices, the last one short (padded)

    def heads_of(self, pages: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of whole pages [layers, 2, n, block_size, kv_heads, head_dim]."""
        return pages[:, :, :, :, self.heads.kv_lo:self.heads.kv_hi]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (every rank gets the same bits)."""
        assert t.is_contiguous()
        t0 = time.perf_counter()
        out = self.comm.all_reduce_(t)
        self.allreduce_s += time.perf_counter() - t0
        return out

    def logits(self, head, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rank 0's full logits of `hidden`'s rows (None on the other ranks); `head` is this
        rank's slice (None: an empty one)."""
        if self.lm_head == "rank0":
            return head.forward(hidden) if self.rank == 0 else None
        per = self._vocab_per()
        part = head.forward(hidden) if head is not None \
            else hidden.new_zeros(hidden.shape[0], 0)
        if part.shape[1] != per:
            part = torch.nn.functional.pad(part, (0, per - part.shape[1]))
        parts = self.comm.gather(part.contiguous())
        return None if parts is None else torch.cat(parts, dim=1)[:, :self.vocab]
