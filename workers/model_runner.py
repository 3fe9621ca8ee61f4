"""Runs one engine step on the model: builds the flat batch and attention metadata, returns logits.

Owns the worker's KV pool tensor, `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`
(a quantized pool: the packed bytes `[num_layers, 2, num_blocks, block_bytes]` of
workers/kv_quant.py, elements and scales together; dim 2 is the block either way), on the
engine's device (workers/device.py decides it; nothing else here picks one).
The model is the compact Llama-family implementation (workers/llama.py) where it applies, else
the stock transformers model with the paged attention plugged in (`model_impl` says which).
The metadata (token ids, positions, slot mapping, block tables, context lengths, sampled rows)
is built on the host, the decodes' block tables from rows kept across steps (`DecodeRows`, the
persistent batch: a block id is copied in when a block fills, not every step), and reaches the
device in ONE copy (`StepUpload`: packed into one int64 buffer, pinned and non-blocking on cuda).
On cuda, decode steps of bucketed batch sizes replay CUDA graphs (workers/cuda_graphs.py) unless
switched off.
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache.manager import cdiv
from workers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    decode_kernel_name,
    register_paged_attention,
)
from workers.device import PinnedStaging, pinned, synchronize
from workers.kv_quant import QuantizedPool
from workers.llama import CompactLlama, layer_windows
from workers.lora import LoRABatch, LoRAManager, LoRASpec, fused_groups, stock_groups
from workers.request import Request
from workers.scheduler_output import ScheduledChunk, SchedulerOutput
from workers.tp_shard import TPShard

MODEL_IMPLS = ("auto", "compact", "stock")


@dataclass
class StepUpload:
    """A step's host metadata arrays, moved to the device in one copy: every part is packed
    into one flat int64 host buffer (pinned when the device is a GPU), copied once
    (non-blocking), and handed back as views of that one device buffer, in `add` order."""

    device: torch.device
    staging: PinnedStaging | None = None   # the runner's reused pinned buffer (cuda)
    parts: list[np.ndarray] = field(default_factory=list)

    def add(self, t: np.ndarray | torch.Tensor | list[int]) -> int:
        """Queue a host array (or tensor, or list of ints); returns its index in `upload()`'s
        list."""
        if isinstance(t, torch.Tensor):
            assert t.device.type == "cpu", "metadata is built on the host"
            t = t.numpy()
        self.parts.append(np.asarray(t, dtype=np.int64))
        return len(self.parts) - 1

    def pack(self) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """Every part in one flat int64 host buffer, and each part's shape."""
        flat = np.concatenate([p.reshape(-1) for p in self.parts]) if self.parts \
            else np.empty(0, np.int64)
        return torch.from_numpy(flat), [tuple(p.shape) for p in self.parts]

    def upload(self) -> list[torch.Tensor]:
        return self.unpack(*self.pack())

    def unpack(self, flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """The one copy of `flat` to the device, handed back as views of each part."""
        if not shapes:
            return []
        if self.staging is not None:
            flat = ModelRunner.host_to_device(self.staging.stage(flat), self.device)
            self.staging.copied()
        else:
            flat = ModelRunner.host_to_device(pinned(flat, self.device), self.device)
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(flat[offset:offset + n].view(shape))
            offset += n
        return out


@dataclass
class StepInputs:
    """A step's host metadata: its parts (token ids, positions, slot mapping, sample rows, each
    decode group's block tables and context lengths, each prefill segment's block table) in one
    flat int64 buffer, and the structure that reads them. Rank 0 of a TP worker broadcasts it,
    once a step, and every rank runs the same step from it (workers/tp_group.py)."""

    flat: torch.Tensor                 # int64, host
    shapes: list[tuple[int, ...]]      # parts 0-3: tokens, positions, slots, sample rows
    num_decodes: int
    # (tables part, lens part, start, count, max_context_len, needs_mask) per decode group
    groups: list[tuple[int, int, int, int, int, bool]]
    # (q_start, q_len, context_len, block table part or -1) per prefill segment
    segs: list[tuple[int, int, int, int]]

    def to_bytes(self) -> bytes:
        return pickle.dumps((self.flat.numpy(), self.shapes, self.num_decodes, self.groups,
                             self.segs), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepInputs:
        flat, shapes, num_decodes, groups, segs = pickle.loads(data)
        return cls(torch.from_numpy(flat), shapes, num_decodes, groups, segs)


class DecodeRows:
    """The decode batch kept across steps (vLLM v1's persistent batch): a row per decoding
    request holding its block table, updated in place. A request joins when it first decodes
    (its table copied into a free row), gains a block id only when its context crosses into a
    new block, and leaves (its row zeroed and freed) at the first step it does not decode in
    (finished, preempted, paused, or computing a chunk again). `update` returns each decode's
    row; the step reads its block tables and slots from those rows, in the step's order.

    Invariants, for a request with row i: `tables[i, :filled[i]]` is its block table's first
    `filled[i]` ids and the rest of the row is 0; `sources[i]` is that block table itself, the
    KV manager's own list, which grows in place while the request holds its blocks (a request
    that frees and re-allocates them, as a preemption does, gets a new list): the same list
    says the row's ids are still the request's. Between steps the rows are exactly the last
    step's decodes."""

    def __init__(self, block_size: int, rows: int = 16, width: int = 8) -> None:
        self.block_size = block_size
        self.tables = np.zeros((rows, width), np.int64)
        self.row_of: dict[Request, int] = {}
        self.sources: list[list[int] | None] = [None] * rows
        self.filled = [0] * rows
        self._free = list(range(rows - 1, -1, -1))

    def update(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
        """Bring the rows to this step's decode `chunks` (in the step's order), each row's
        table up to its chunk's position (`num_computed_tokens // block_size + 1` blocks);
        returns each chunk's row and position. Requests without a chunk leave."""
        bs, row_of, sources, filled = self.block_size, self.row_of, self.sources, self.filled
        rows: list[int] = []
        positions: list[int] = []
        for ch in chunks:
            req, table = ch.request, ch.block_table
            pos = req.num_computed_tokens
            need = pos // bs + 1
            i = row_of.get(req)
            if i is None:
                i = self._join(req, table)
            elif sources[i] is not table or need < filled[i]:
                self._clear(i, table)     # its blocks were freed and taken anew
            if need > filled[i]:
                if need > self.tables.shape[1]:
                    self._widen(need)
                self.tables[i, filled[i]:need] = table[filled[i]:need]
                filled[i] = need
            rows.append(i)
            positions.append(pos)
        if len(row_of) > len(rows):
            keep = set(rows)
            for req, i in [(r, i) for r, i in row_of.items() if i not in keep]:
                del row_of[req]
                self._clear(i, None)
                self._free.append(i)
        return rows, positions

    def _join(self, req: Request, table: list[int]) -> int:
        if not self._free:
            n, w = self.tables.shape
            self.tables = np.concatenate([self.tables, np.zeros((n, w), np.int64)])
            self.sources += [None] * n
            self.filled += [0] * n
            self._free = list(range(2 * n - 1, n - 1, -1))
        i = self._free.pop()
        self.row_of[req] = i
        self.sources[i] = table
        return i

    def _clear(self, i: int, table: list[int] | None) -> None:
        self.tables[i, :self.filled[i]] = 0
        self.filled[i] = 0
        self.sources[i] = table

    def _widen(self, width: int) -> None:
        n, w = self.tables.shape
        wider = np.zeros((n, max(width, 2 * w)), np.int64)
        wider[:, :w] = self.tables
        self.tables = wider


class ModelRunner:
    h2d_copies = 0   # host -> device metadata copies made (a seam for tests; all runners)

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | str, model_impl: str = "auto",
                 max_positions: int | None = None,
                 lora_specs: dict[str, LoRASpec] | None = None, max_loras: int = 4,
                 device: torch.device | None = None, cuda_graphs: bool = True,
                 release_stock: bool = False,
                 max_num_seqs: int = 64, tp: TPShard | None = None, tp_group=None) -> None:
        """`kv_dtype`: a float dtype, or "int8" / "fp8" for a quantized pool. `device`: where
        weights, pool and metadata live (default: the model's); `cuda_graphs`: replay decode
        steps as CUDA graphs (cuda only; ignored elsewhere); `release_stock`: the caller owns
        `model`, so the stock weights the compact model holds fused copies of are freed.
        `tp`: this runner is one rank of a tensor-parallel worker (its heads' shard of the
        compact model and of the pool); `tp_group` (rank 0 only: workers/tp_group.py) sends
        each step to the other ranks and reaches their pools for page reads and writes."""
        cfg = model.config
        assert model_impl in MODEL_IMPLS, model_impl
        assert tp is None or (model_impl != "stock" and not lora_specs
                              and not isinstance(kv_dtype, str)), \
            "tensor parallelism runs the compact model on a float pool, without LoRA"
        self.tp, self.tp_group = tp, tp_group
        self.block_size = block_size
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads if tp is None else tp.heads.num_kv_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = device if device is not None else next(model.parameters()).device
        self.staging = PinnedStaging(self.device)   # one pinned buffer for every step's upload
        self.decode_rows = DecodeRows(block_size)   # the decodes' block tables, across steps
        reason = CompactLlama.unsupported(cfg)
        if model_impl == "compact" and reason:
            raise ValueError(f"the compact model does not support this checkpoint: {reason}")
        use_compact = model_impl != "stock" and reason is None
        if not use_compact and next(model.parameters()).device != self.device:
            model.to(self.device)   # the stock model computes in place; compact copies below
        # graphs write padded rows into one scratch block past the pool's last (never
        # handed out by the KV manager): allocate it only where graphs can run
        graphs = cuda_graphs and self.device.type == "cuda" and use_compact \
            and not lora_specs and not isinstance(kv_dtype, str) and tp is None
        self.num_blocks = num_blocks
        pool_blocks = num_blocks + 1 if graphs else num_blocks
        self.kv_quant = kv_dtype if isinstance(kv_dtype, str) else ""
        self.kv_scales: torch.Tensor | None = None
        if self.kv_quant:
            pool = QuantizedPool.allocate(self.kv_quant, self.num_layers, pool_blocks, block_size,
                                          self.num_kv_heads, self.head_dim, self.device)
            self.kv_cache = pool.kv_cache      # what transports move: elements + scales
            self.kv_data, self.kv_scales = pool.data, pool.scales
        else:
            self.kv_cache = torch.zeros(self.num_layers, 2, pool_blocks, block_size,
                                        self.num_kv_heads, self.head_dim, dtype=kv_dtype,
                                        device=self.device)
            self.kv_data = self.kv_cache
        self.sliding_window = max((w for w in layer_windows(cfg) if w), default=None)
        self.compact: CompactLlama | None = None
        self.stock_bytes_released = 0
        if use_compact:
            self.compact = CompactLlama(model, max_positions or cfg.max_position_embeddings,
                                        self.device, tp)
            self.model_impl = "compact"
            self.fallback_reason = ""
            if release_stock and not lora_specs:   # stock LoRA hooks never run on compact
                self.stock_bytes_released = CompactLlama.release_fused_sources(
                    model, every_projection=tp is not None)
        else:
            model.set_attn_implementation(register_paged_attention())
            self.model_impl = "stock"
            self.fallback_reason = reason or "model_impl=stock"
        self.model = model
        self.lora: LoRAManager | None = None
        self._lora_batch: LoRABatch | None = None   # the stock model's hooks read it
        if lora_specs:
            groups = fused_groups(cfg) if self.compact is not None else stock_groups(cfg)
            self.lora = LoRAManager(lora_specs, cfg, groups, max_loras, model.dtype, self.device)
            if self.compact is None:
                self._hook_stock_projections()
        self.last_forward_s = 0.0   # the model's share of the last execute()
        self.attention_kernel = decode_kernel_name(   # builds it once, up front
            self.device, self.kv_cache.dtype, self.head_dim)
        if self.kv_quant:   # the native kernel reads float pools; quantized ones dequantize in torch
            self.attention_kernel = f"torch-dequant-{self.kv_quant}"
        # the native and Triton kernels read each sequence's own context: one call for all
        # decodes (they balance over every sequence); torch's gather pads a group to its longest
        self.one_decode_group = self.attention_kernel.startswith(("native", "triton"))
        self.graphs = None   # CUDA graphs of decode steps (cuda only; never built on the CPU)
        if graphs:
            from workers.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_num_seqs, num_blocks,
                                       max_positions or cfg.max_position_embeddings)

    @property
    def linear_kernel(self) -> str:
        return self.compact.linear_kernel if self.compact is not None else "torch"

    @property
    def fused_ops(self) -> str:
        """The compact model's fused small ops: native-cpu, triton-cuda or off."""
        return self.compact.fused_ops if self.compact is not None else "off"

    @staticmethod
    def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The one host -> device copy of a step's metadata (counted: tests check there is
        one per step). Non-blocking: on cuda `t` is pinned and the copy is stream-ordered."""
        ModelRunner.h2d_copies += 1
        return t.to(device, non_blocking=True)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids as an index on the device (page reads and writes, outside steps)."""
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run the model on the scheduled step. Returns logits [n, vocab] (float32, on the
        device) for the chunks that end at their request's last known token, and those chunks'
        indices in `sched.chunks`."""
        order = sched.step_order()
        inputs, sample_chunks = self.host_inputs(sched, order)
        if self.tp_group is not None:    # the other ranks run the same step
            self.tp_group.send_step(inputs)
        input_ids, positions, meta, sample_rows = self.device_inputs(inputs)
        lora = self._lora_step(sched, order)
        t0 = time.perf_counter()
        try:
            if self.graphs is not None and self.graphs.applies(meta, lora):
                return self.graphs.run(input_ids, positions, meta, sample_rows), sample_chunks
            return self._forward(input_ids, positions, meta, sample_rows, lora), sample_chunks
        finally:     # GPU work timed, not its launches (the engine's busy_s rests on it)
            synchronize(self.device)
            self.last_forward_s = time.perf_counter() - t0
            self._lora_batch = None

    def _lora_step(self, sched: SchedulerOutput, order: tuple[list[int], list[int]]
                   ) -> LoRABatch | None:
        """Each token's adapter, in the flat batch's order (`order`: decodes, then prefills)."""
        if self.lora is None:
            return None
        decodes, prefills = order
        chunks = [sched.chunks[i] for i in decodes + prefills]
        return self.lora.batch([ch.request.lora_name for ch in chunks],
                               [ch.num_new_tokens for ch in chunks])

    def _hook_stock_projections(self) -> None:
        """The stock model: each projection's forward hook adds the step's LoRA delta."""
        for layer_idx, layer in enumerate(self.model.model.layers):
            for module in ("self_attn", "mlp"):
                for name, proj in getattr(layer, module).named_children():
                    if name in self.lora.groups:
                        proj.register_forward_hook(self._stock_hook(layer_idx, name))

    def _stock_hook(self, layer_idx: int, name: str):
        def hook(_module, args, out):
            b = self._lora_batch
            return out if b is None else b.apply(out, args[0], layer_idx, name)
        return hook

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_rows: torch.Tensor | list[int], lora: LoRABatch | None = None
                 ) -> torch.Tensor:
        """The model on the flat batch; float32 logits of `sample_rows` (a device index)."""
        if isinstance(sample_rows, list):
            sample_rows = self._index(sample_rows)
        if self.compact is not None:
            hidden = self.compact(input_ids, positions, meta, lora)
            head = self.compact.logits
        else:
            self._lora_batch = lora
            hidden = self.model.model(input_ids=input_ids.unsqueeze(0),
                                      position_ids=positions.unsqueeze(0),
                                      use_cache=False, attn_meta=meta).last_hidden_state[0]
            head = self.model.lm_head
        if not sample_rows.numel():
            return hidden.new_empty(0, 0)
        logits = head(hidden[sample_rows])
        return None if logits is None else logits.float()   # (None: a TP rank other than 0)

    @torch.inference_mode()
    def execute_inputs(self, inputs: StepInputs) -> None:
        """A TP rank other than 0 runs the step rank 0 sent (its logits are rank 0's)."""
        input_ids, positions, meta, sample_rows = self.device_inputs(inputs)
        self._forward(input_ids, positions, meta, sample_rows)

    def prepare(self, sched: SchedulerOutput):
        """(input_ids, positions, AttentionMetadata (with the slot mapping), sample_rows (a device
        index), sample_chunks) of a step: decodes first (shortest context first, so similar
        lengths share a group), then prefill chunks. Everything is built on the host, then
        moved in one copy (`StepUpload`)."""
        inputs, sample_chunks = self.host_inputs(sched)
        return (*self.device_inputs(inputs), sample_chunks)

    def host_inputs(self, sched: SchedulerOutput, order: tuple[list[int], list[int]] | None = None
                    ) -> tuple[StepInputs, list[int]]:
        """The step's metadata built on the host (`prepare`'s first half), and the indices in
        `sched.chunks` of the chunks sampled. `order`: `sched.step_order()`, when known."""
        bs = self.block_size
        chunks: list[ScheduledChunk] = sched.chunks
        decodes, prefills = order or sched.step_order()
        # decodes: one token each at position num_computed_tokens, block tables from their rows
        d_chunks = [chunks[i] for i in decodes]
        rows, d_pos = self.decode_rows.update(d_chunks)
        reqs = [ch.request for ch in d_chunks]
        tokens = [r.token_at(p) for r, p in zip(reqs, d_pos, strict=True)]
        sample_rows = [row for row, (r, p) in enumerate(zip(reqs, d_pos, strict=True))
                       if p + 1 == r.num_tokens]
        sample_chunks = [decodes[row] for row in sample_rows]
        groups, d_slots, d_positions = self._decode_groups(rows, d_pos)
        positions = [d_positions]
        slots = [d_slots]
        segs: list[tuple[int, int, int, np.ndarray | None]] = []
        for i in prefills:
            ch = chunks[i]
            req, n = ch.request, ch.num_new_tokens
            start = req.num_computed_tokens
            q_start = len(tokens)
            tokens.extend(req.token_ids[start:start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.array(ch.block_table[:cdiv(start + n, bs)], np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            if start + n == req.num_tokens:
                sample_rows.append(q_start + n - 1)
                sample_chunks.append(i)
            own_kv = start == 0 and not self.kv_quant   # quantized: read back what was stored
            segs.append((q_start, n, start + n, None if own_kv else table))
        up = StepUpload(self.device)
        for part in (tokens, np.concatenate(positions), np.concatenate(slots), sample_rows):
            up.add(part)
        group_parts = [(up.add(tables), up.add(lens), *shape) for tables, lens, shape in groups]
        seg_parts = [(q_start, n, ctx, -1 if t is None else up.add(t))
                     for q_start, n, ctx, t in segs]
        flat, shapes = up.pack()
        return StepInputs(flat, shapes, len(decodes), group_parts, seg_parts), sample_chunks

    def device_inputs(self, inputs: StepInputs):
        """(input_ids, positions, AttentionMetadata, sample_rows) on the device, from one copy
        of the host metadata."""
        dev = StepUpload(self.device, self.staging).unpack(inputs.flat, inputs.shapes)
        decode_groups = [DecodeGroup(start, count, dev[it], dev[il], max_len, needs_mask)
                         for it, il, start, count, max_len, needs_mask in inputs.groups]
        prefill_segs = [PrefillSegment(q_start, n, ctx, None if it < 0 else dev[it])
                        for q_start, n, ctx, it in inputs.segs]
        meta = AttentionMetadata(self.kv_data, dev[2], inputs.num_decodes, decode_groups,
                                 prefill_segs, self.kv_scales, self.kv_quant)
        return dev[0], dev[1], meta, dev[3]

    def _decode_groups(self, rows: list[int], positions: list[int]):
        """The decodes (rows of `decode_rows`, sorted by context length) split where the block
        count doubles (each group is one gather over its longest context, so padding stays under
        half of what it reads; one group where the native kernel runs, `one_decode_group`):
        per group (host block tables [count, width], padded with block 0, host context lens
        [count], (start, count, max_context_len, needs_mask)); plus the decodes' slot mapping
        and positions (host)."""
        bs = self.block_size
        if not rows:
            return [], np.empty(0, np.int64), np.empty(0, np.int64)
        idx = np.array(rows, np.int64)
        pos = np.array(positions, np.int64)
        lens = pos + 1
        tables = self.decode_rows.tables
        slots = tables[idx, pos // bs] * bs + pos % bs
        nblocks = (pos // bs + 1).tolist()
        padded = tables[idx, :max(nblocks)]   # zeros past each row's own blocks
        groups = []
        start = 0
        while start < len(rows):
            end = len(rows) if self.one_decode_group else start + 1
            while end < len(rows) and nblocks[end] <= 2 * nblocks[start]:
                end += 1
            w = nblocks[end - 1]
            max_len = positions[end - 1] + 1
            needs_mask = positions[start] + 1 != max_len
            groups.append((padded[start:end, :w], lens[start:end],
                           (start, end - start, max_len, needs_mask)))
            start = end
        return groups, slots, pos

    # ---- page access for KV transfer ------------------------------------------------------
    def read_pages(self, block_ids: list[int]) -> torch.Tensor:
        """Contiguous copy of blocks in their stored form: [num_layers, 2, n, ...] (a quantized
        pool's pages carry their scales). A TP worker's rank 0 returns every KV head, gathered
        from its ranks."""
        if self.tp_group is not None:
            return self.tp_group.read_pages(block_ids, self.read_local_pages(block_ids))
        return self.read_local_pages(block_ids)

    def write_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write whole pages (every KV head: a TP worker's ranks each take theirs)."""
        if self.tp_group is not None:
            self.tp_group.write_pages(block_ids, pages)
            pages = self.tp.heads_of(pages)
        self.write_local_pages(block_ids, pages)

    def read_local_pages(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's pool's blocks (its KV heads only, under TP)."""
        return self.kv_cache[:, :, self._index(block_ids)].contiguous()

    def write_local_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        assert pages.shape[2] == len(block_ids) and pages.shape[3:] == self.kv_cache.shape[3:]
        self.kv_cache[:, :, self._index(block_ids)] = pages.to(self.kv_cache)
