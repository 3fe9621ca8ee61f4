"""Runs one engine step on the model: builds the flat batch and attention metadata, returns logits.

Owns the worker's KV pool tensor, `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    register_paged_attention,
)
from workers.request import Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    block_table: list[int]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_cache = torch.zeros(self.num_layers, 2, num_blocks, block_size,
                                    self.num_kv_heads, self.head_dim, dtype=kv_dtype)
        model.set_attn_implementation(register_paged_attention())

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """Run the model on `chunks` (decodes first). Returns logits [n, vocab] for the chunks
        that end at their request's last known token, and those chunks' indices."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        # decodes first, shortest context first, so similar lengths share one padded SDPA
        order = sorted(range(len(chunks)), key=lambda i: (
            chunks[i].num_new_tokens != 1,
            chunks[i].request.num_computed_tokens if chunks[i].num_new_tokens == 1 else 0))
        for i in order:
            ch = chunks[i]
            req, n = ch.request, ch.num_new_tokens
            start = req.num_computed_tokens
            toks = req.all_token_ids[start:start + n]
            q_start = len(input_ids)
            input_ids.extend(toks)
            positions.extend(range(start, start + n))
            table = ch.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == req.num_tokens:
                sample_rows.append(q_start + n - 1)
                sample_chunks.append(i)
            if n == 1 and not prefills:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                n_blocks = -(-(start + n) // bs)
                prefills.append(PrefillSegment(
                    q_start, n, start + n,
                    None if start == 0 else torch.tensor(table[:n_blocks], dtype=torch.long)))

        meta = AttentionMetadata(self.kv_cache, torch.tensor(slots, dtype=torch.long),
                                 len(decode_tables), self._decode_groups(decode_tables, decode_lens),
                                 prefills)
        hidden = self.model.model(input_ids=torch.tensor([input_ids]),
                                  position_ids=torch.tensor([positions]),
                                  use_cache=False, attn_meta=meta).last_hidden_state
        if not sample_rows:
            return hidden.new_empty(0, 0), []
        logits = self.model.lm_head(hidden[0, sample_rows]).float()
        return logits, sample_chunks

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decodes (sorted by length) where the block count doubles: each group is one
        SDPA over its longest context, so padding stays under half of what it reads."""
        groups: list[DecodeGroup] = []
        bs = self.block_size
        start = 0
        while start < len(tables):
            end = start + 1
            while end < len(tables) and len(tables[end]) <= 2 * len(tables[start]):
                end += 1
            width = max(len(t) for t in tables[start:end])
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[start:end]],
                                        dtype=torch.long)
            mask = None
            if any(n != width * bs for n in lens[start:end]):
                mask = torch.arange(width * bs).view(1, 1, 1, -1) < \
                    torch.tensor(lens[start:end]).view(-1, 1, 1, 1)
            groups.append(DecodeGroup(start, end - start, block_tables, mask))
            start = end
        return groups

    # ---- page access for KV transfer ------------------------------------------------------
    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy of blocks: [num_layers, 2, n, block_size, kv_heads, head_dim]."""
        return self.kv_cache[:, :, torch.tensor(block_ids, dtype=torch.long)].contiguous()

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        assert pages.shape[2] == len(block_ids) and pages.shape[3:] == self.kv_cache.shape[3:]
        self.kv_cache[:, :, torch.tensor(block_ids, dtype=torch.long)] = pages.to(self.kv_cache.dtype)
