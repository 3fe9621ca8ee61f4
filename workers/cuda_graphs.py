"""CUDA graphs of decode-only steps: one graph per (batch bucket, block-width bucket), captured on
first use and replayed after copying the step's metadata into the graph's static buffers.

Shapes a graph fixes: the batch (padded up to the next bucket), the block-table width (padded to
the next power of two, capped at the model's context), and so the gathered context length
(width x block_size; rows are masked to their own context length, so padding changes nothing).
Padded rows write their K/V into one scratch block past the pool's last block (the ModelRunner
allocates it only when graphs are on; the KV manager never hands it out) and read only it.
Used only on cuda, for the compact model without LoRA and with a float KV pool
(`ModelRunner` builds this class only then); a step with prefill chunks, more decodes than the
largest bucket or a wider table than the largest width runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.attention import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from workers.lora import LoRABatch
    from workers.model_runner import ModelRunner

MAX_GRAPHS = 64   # beyond this many (batch, width) shapes, new shapes run eagerly


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16, and max_num_seqs."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n is over the largest."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(width: int, max_width: int) -> int | None:
    """Block-table width a graph is captured for: the next power of two, capped at
    `max_width` (the model's context in blocks); None when `width` is over it."""
    if width > max_width:
        return None
    w = 1
    while w < width:
        w *= 2
    return min(w, max_width)


class StaticDecode:
    """The static-shape decode step a graph replays: fixed buffers, padding to the bucket and
    one decode group of the bucket's width. Device-agnostic (a CPU test runs it eagerly to
    check that the padded step computes what the eager step computes); `DecodeGraphs` adds
    capture and replay."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, scratch_block: int,
                 max_positions: int) -> None:
        assert runner.compact is not None and not runner.kv_quant
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        bs = runner.block_size
        self.max_width = -(-max_positions // bs)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * bs
        dev, max_b = runner.device, self.buckets[-1]
        self.input_ids = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(max_b, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_b * self.max_width, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    def _shape(self, meta: AttentionMetadata) -> tuple[int, int] | None:
        if meta.prefills or not meta.num_decodes:
            return None
        b = bucket_for(meta.num_decodes, self.buckets)
        w = width_bucket(max(g.block_tables.shape[1] for g in meta.decode_groups),
                         self.max_width)
        if b is None or w is None:
            return None
        if (b, w) not in self._graphs and len(self._graphs) >= MAX_GRAPHS:
            return None
        return b, w

    def applies(self, meta: AttentionMetadata, lora: LoRABatch | None) -> bool:
        return lora is None and self._shape(meta) is not None

    def _fill(self, b: int, w: int, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata | None) -> torch.Tensor:
        """Copy a step's (device) metadata into the static buffers, padding rows n..b to the
        scratch block; returns the [b, w] block-table view. meta None: all rows padding."""
        n = 0 if meta is None else meta.num_decodes
        tables = self.tables[:b * w].view(b, w)
        tables.fill_(self.scratch_block)
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slots[n:b].fill_(self.scratch_slot)
        self.context_lens[n:b].fill_(1)
        if meta is not None:
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(positions)
            self.slots[:n].copy_(meta.slot_mapping)
            for g in meta.decode_groups:
                rows = slice(g.start, g.start + g.count)
                tables[rows, :g.block_tables.shape[1]].copy_(g.block_tables)
                self.context_lens[rows].copy_(g.context_lens)
        return tables

    def _static_meta(self, b: int, tables: torch.Tensor) -> AttentionMetadata:
        r = self.runner
        group = DecodeGroup(0, b, tables, self.context_lens[:b],
                            tables.shape[1] * r.block_size, needs_mask=True)
        return AttentionMetadata(r.kv_data, self.slots[:b], b, [group], [])

    def _forward(self, b: int, tables: torch.Tensor):
        """The step on the static buffers (what a graph captures): float32 logits [b, vocab]."""
        compact = self.runner.compact
        meta = self._static_meta(b, tables)
        return lambda: compact.logits(compact(self.input_ids[:b], self.positions[:b],
                                              meta)).float()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of `sample_rows`, by the padded static step (eagerly here)."""
        shape = self._shape(meta)
        assert shape is not None, "call applies() first"
        b, w = shape
        tables = self._fill(b, w, input_ids, positions, meta)
        self.replays += 1
        return self._forward(b, tables)()[sample_rows]


class DecodeGraphs(StaticDecode):
    """`StaticDecode` captured once per shape as a CUDA graph and replayed."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, scratch_block: int,
                 max_positions: int) -> None:
        assert runner.device.type == "cuda", "CUDA graphs run on cuda only"
        super().__init__(runner, max_num_seqs, scratch_block, max_positions)
        self._pool = None

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        tables = self._fill(b, w, self.input_ids, self.positions, None)   # padding only
        forward = self._forward(b, tables)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):   # warm-up: allocator and cuBLAS workspaces before capture
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a transfer copying in another thread of the actor meanwhile (a decode
        # worker's pull runs outside the engine lock) neither breaks nor joins the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        self._pool = graph.pool()
        self._graphs[(b, w)] = (graph, logits)
        return graph, logits

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of `sample_rows`, by replaying the step's graph (captured now if new)."""
        shape = self._shape(meta)
        assert shape is not None, "call applies() first"
        b, w = shape
        graph, logits = self._graphs.get(shape) or self._capture(b, w)
        self._fill(b, w, input_ids, positions, meta)
        graph.replay()
        self.replays += 1
        return logits[sample_rows]   # a new tensor: the next replay may overwrite `logits`
