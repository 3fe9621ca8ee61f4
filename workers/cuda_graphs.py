"""CUDA graphs of decode-only steps: one graph per (batch bucket, block-width bucket), all captured
when the runner starts (never in the serving loop) and replayed after copying the step's metadata
into the graph's static buffers.

Shapes a graph fixes: the batch (padded up to the next bucket) and the block-table width. Where
the decode attention reads the pool in place (the Triton kernel, `attention_kernel`
triton-cuda) the width is the model's whole context in blocks for every graph: each row reads
only its own blocks, so one graph per batch bucket covers every step and no gather is padded.
Where it gathers (the torch path) the width is a bucket (the next power of two, capped at the
model's context) and fixes the gathered length (width x block_size; rows are masked to their own
context length, so padding changes nothing); start-up captures the narrowest widths first, up to
MAX_GRAPHS, and a wider step runs eagerly, where each decode group gathers only its own width.
Padded rows write their K/V into one scratch block past the pool's last block (the ModelRunner
allocates it only when graphs are on; the KV manager never hands it out) and read only it.
Used only on cuda, for the compact model without LoRA and with a float KV pool
(`ModelRunner` builds this class only then); a step with prefill chunks, more decodes than the
largest bucket or a shape with no graph runs eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from workers.attention import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from workers.lora import LoRABatch
    from workers.model_runner import ModelRunner

MAX_GRAPHS = 64   # shapes captured at start-up, at most; the others run eagerly


class Replayable(Protocol):
    """What a captured step is: torch.cuda.CUDAGraph, or a test's stand-in."""

    def replay(self) -> None: ...


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 16, and max_num_seqs."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n is over the largest."""
    return next((b for b in buckets if b >= n), None)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Every block-table width `width_bucket` can answer: the powers of two below `max_width`,
    and `max_width`."""
    widths = [1 << i for i in range(max(1, max_width).bit_length()) if 1 << i < max_width]
    return (*widths, max_width)


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
    one decode group of the shape's width. Device-agnostic (a CPU test runs it eagerly, for any
    shape, to check that the padded step computes what the eager step computes);
    `DecodeGraphs` adds capture at start-up and replay.

    `in_place`: the runner's decode attention reads each row's own blocks in place (its
    `attention_kernel` is triton-cuda), so every shape has the one width `max_width`."""

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
        self.in_place = runner.attention_kernel.startswith("triton")
        self.widths = (self.max_width,) if self.in_place else width_buckets(self.max_width)
        self.replays = 0

    def startup_shapes(self) -> list[tuple[int, int]]:
        """The (batch, width) shapes captured at start-up: every batch bucket at each width,
        narrowest widths first, at most MAX_GRAPHS (in place: one per batch bucket)."""
        return [(b, w) for w in self.widths for b in self.buckets][:MAX_GRAPHS]

    def _width(self, meta: AttentionMetadata) -> int | None:
        need = max(g.block_tables.shape[1] for g in meta.decode_groups)
        if self.in_place:
            return self.max_width if need <= self.max_width else None
        return width_bucket(need, self.max_width)

    def _ready(self, shape: tuple[int, int]) -> bool:
        """Whether a step of `shape` can run here (eagerly: any shape)."""
        return True

    def _shape(self, meta: AttentionMetadata) -> tuple[int, int] | None:
        if meta.prefills or not meta.num_decodes:
            return None
        b = bucket_for(meta.num_decodes, self.buckets)
        w = self._width(meta)
        if b is None or w is None or not self._ready((b, w)):
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
    """`StaticDecode` captured as CUDA graphs, every shape of `startup_shapes()` when built (the
    runner's start-up), and replayed; a step of any other shape runs eagerly, so nothing is
    captured while serving. Captures share one memory pool."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, scratch_block: int,
                 max_positions: int) -> None:
        self._check_device(runner)
        super().__init__(runner, max_num_seqs, scratch_block, max_positions)
        self._pool = None
        self._graphs: dict[tuple[int, int], tuple[Replayable, torch.Tensor]] = {}
        t0 = time.perf_counter()
        for b, w in self.startup_shapes():
            self._graphs[(b, w)] = self._capture(b, w)
        self.capture_s = time.perf_counter() - t0

    @staticmethod
    def _check_device(runner: ModelRunner) -> None:
        assert runner.device.type == "cuda", "CUDA graphs run on cuda only"

    def _ready(self, shape: tuple[int, int]) -> bool:
        return shape in self._graphs

    def _capture(self, b: int, w: int) -> tuple[Replayable, torch.Tensor]:
        tables = self._fill(b, w, self.input_ids, self.positions, None)   # padding only
        return self._record(self._forward(b, tables))

    def _record(self, forward: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """(graph, its static logits) of `forward` (warmed up first: allocator, cuBLAS
        workspaces and Triton's compilation happen outside the capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a transfer copying in another thread of the actor meanwhile (a decode
        # worker's pull runs outside the engine lock) neither breaks nor joins the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        self._pool = graph.pool()
        return graph, logits

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of `sample_rows`, by replaying the step's graph (captured at
        start-up; `applies()` is False for any other shape)."""
        shape = self._shape(meta)
        assert shape is not None, "call applies() first"
        graph, logits = self._graphs[shape]
        self._fill(*shape, input_ids, positions, meta)
        graph.replay()
        self.replays += 1
        return logits[sample_rows]   # a new tensor: the next replay may overwrite `logits`
