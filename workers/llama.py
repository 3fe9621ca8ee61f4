"""A compact Llama-family model (Llama, Qwen2, Mistral) for the engine: fused QKV and gate/up
projections, prepacked linears, paged attention called directly; built from a loaded stock
transformers model's weights (as nano-vllm does), so both compute the same function.

`CompactLlama.unsupported(config)` says why a config cannot run here (the engine then falls
back to the stock model with the paged attention plugged in, and says so in its stats).
"""

from __future__ import annotations

import torch
from torch import nn

from workers import kernels
from workers.attention import AttentionMetadata, paged_attention
from workers.kernels import triton_ops
from workers.layers import Linear, RotaryEmbedding, rms_norm, silu_and_mul
from workers.lora import LoRABatch
from workers.tp_shard import TPShard

COMPACT_MODEL_TYPES = ("llama", "qwen2", "mistral")


def layer_windows(config) -> list[int | None]:
    """Sliding window (tokens) of each layer, None for full attention, as transformers decides
    it: `layer_types` when the config has them, else Mistral's `sliding_window` on every layer."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if config.model_type == "mistral" and window:
        return [window] * n
    return [None] * n


class _Layer(nn.Module):
    def __init__(self, hf_layer, config, window: int | None, device: torch.device,
                 ops, tp: TPShard | None = None) -> None:
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        self.head_dim = hd = a.head_dim
        self.scale = a.scaling
        self.window = window
        self.layer_idx = a.layer_idx
        self.tp = tp
        def on(*ts):   # fused (concatenated) on the engine's device, one layer at a time
            if ts[0] is None:
                return None
            if len(ts) == 1:
                return ts[0].detach().to(device)
            return torch.cat([t.detach().to(device) for t in ts])
        if tp is None:
            self.num_heads = config.num_attention_heads
            self.num_kv_heads = config.num_key_value_heads
            bias = on(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
            self.qkv = Linear(on(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), bias)
            self.o = Linear(on(a.o_proj.weight), on(a.o_proj.bias))
            self.gate_up = Linear(on(m.gate_proj.weight, m.up_proj.weight))
            self.down = Linear(on(m.down_proj.weight))
        else:   # Megatron's split: column-parallel qkv and gate/up, row-parallel o and down
            heads, (i_lo, i_hi) = tp.heads, tp.intermediate_range(m.gate_proj.weight.shape[0])
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
            q = slice(heads.q_lo * hd, heads.q_hi * hd)
            kv = slice(heads.kv_lo * hd, heads.kv_hi * hd)
            def rows(t, sl):
                return None if t is None else t[sl]
            bias = on(rows(a.q_proj.bias, q), rows(a.k_proj.bias, kv), rows(a.v_proj.bias, kv))
            self.qkv = Linear(on(a.q_proj.weight[q], a.k_proj.weight[kv], a.v_proj.weight[kv]),
                              bias)
            # a row-parallel linear's bias is added once, by rank 0, before the all-reduce
            self.o = Linear(on(a.o_proj.weight[:, q]), on(a.o_proj.bias) if tp.rank == 0
                            else None)
            self.gate_up = Linear(on(m.gate_proj.weight[i_lo:i_hi], m.up_proj.weight[i_lo:i_hi]))
            self.down = Linear(on(m.down_proj.weight[:, i_lo:i_hi]))
        self.ln1 = on(hf_layer.input_layernorm.weight)
        self.ln2 = on(hf_layer.post_attention_layernorm.weight)
        self.eps = hf_layer.input_layernorm.variance_epsilon
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.ops = ops   # the fused ops' module for `device` (workers.kernels or its triton_ops)

    def _proj(self, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = getattr(self, name).forward(x)   # no module hooks here: nn.Module's call costs ~5 us
        return y if lora is None else lora.apply(y, x, self.layer_idx, name)

    def forward_fused(self, h: torch.Tensor, delta: torch.Tensor | None,
                      cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      lora: LoRABatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the fused ops (`ops`: workers/kernels/csrc/fused_ops.cpp on the
        CPU, bf16 and float32; workers/kernels/triton_ops.py on cuda): `h` is the residual stream
        and `delta` the previous layer's output still to be added to it (added here, in the same
        pass as this layer's first RMSNorm). Returns (h, this layer's delta)."""
        ops = self.ops
        t = h.shape[0]
        x = ops.add_rms_norm(h, delta, self.ln1, self.eps)
        qkv = self._proj("qkv", x, lora).view(t, self.num_heads + 2 * self.num_kv_heads,
                                              self.head_dim)
        # a quantized pool, or one of another dtype (kv_dtype): attention writes it
        written = meta.kv_scales is None \
            and meta.kv_cache[self.layer_idx][0].dtype == qkv.dtype
        if written:     # q and k rotated in place, k and v written into their slots
            k_cache, v_cache = meta.kv_cache[self.layer_idx]
            ops.rope_and_cache(qkv, *cos_sin, k_cache, v_cache, meta.slot_mapping,
                                   self.num_heads, self.num_kv_heads)
            qk = qkv[:, :self.num_heads + self.num_kv_heads]
        else:
            qk = RotaryEmbedding.apply(qkv[:, :self.num_heads + self.num_kv_heads], cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, self.layer_idx, meta, self.scale, self.window,
                            kv_written=written)
        attn = self._proj("o", o.reshape(t, self.q_size), lora)
        x = ops.add_rms_norm(h, self._reduce(attn), self.ln2, self.eps)
        return h, self._reduce(self._proj("down", ops.silu_mul(self._proj("gate_up", x, lora)),
                                          lora))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's output summed over the ranks (itself without TP)."""
        return partial if self.tp is None else self.tp.all_reduce_(partial)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        t = h.shape[0]
        x = rms_norm(h, self.ln1, self.eps)
        qkv = self._proj("qkv", x, lora).view(t, self.num_heads + 2 * self.num_kv_heads,
                                              self.head_dim)
        qk = RotaryEmbedding.apply(qkv[:, :self.num_heads + self.num_kv_heads], cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]   # q and k rotated together
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, self.layer_idx, meta, self.scale, self.window)
        h = h + self._reduce(self._proj("o", o.reshape(t, self.q_size), lora))
        x = rms_norm(h, self.ln2, self.eps)
        return h + self._reduce(self._proj("down", silu_and_mul(self._proj("gate_up", x, lora)),
                                           lora))


class CompactLlama(nn.Module):
    """forward(input_ids [T], positions [T], meta, lora) -> hidden [T, hidden]; logits(hidden).
    `lora` (workers/lora.py) adds each token's adapter delta to qkv, o, gate_up and down.
    Its weights are copies on `device` (default: the stock model's); the stock model is left
    where it is. With `tp` (workers/tp_shard.py) it holds one rank's shard: its query and KV
    heads, its slice of the intermediate size, the row-parallel outputs all-reduced (two a
    layer); the embedding is replicated (a lookup: splitting it by vocabulary would add an
    all-reduce a step to save a few MB), and the lm_head is `tp.lm_head`'s choice."""

    def __init__(self, hf_model: nn.Module, max_positions: int,
                 device: torch.device | None = None, tp: TPShard | None = None) -> None:
        super().__init__()
        config = hf_model.config
        reason = self.unsupported(config)
        assert reason is None, reason
        inner = hf_model.model
        w = inner.embed_tokens.weight
        device = torch.device(device if device is not None else w.device)
        self.ops = triton_ops if device.type == "cuda" else kernels
        self.embed = w.detach().to(device)
        self.tp = tp
        self.layers = nn.ModuleList(_Layer(layer, config, window, device, self.ops, tp)
                                    for layer, window in zip(inner.layers, layer_windows(config),
                                                             strict=True))
        self.norm = inner.norm.weight.detach().to(device)
        self.eps = inner.norm.variance_epsilon
        head = hf_model.lm_head.weight
        # tied embeddings: one copy on the device serves both
        head = self.embed if head is w else head.detach().to(device)
        # TP: the whole head on rank 0 (the others skip it), or each rank's vocabulary slice
        self.vocab_range = (0, head.shape[0]) if tp is None else tp.vocab_range(head.shape[0])
        lo, hi = self.vocab_range
        self.lm_head = Linear(head if (lo, hi) == (0, head.shape[0]) else head[lo:hi]) \
            if hi > lo else None
        self.rope = RotaryEmbedding(config, self.layers[0].head_dim, max_positions, w.dtype,
                                    device)
        # the small ops are fused: on the CPU by workers/kernels/csrc/fused_ops.cpp, bf16 and
        # float32 (a few float32 ulps from transformers'), on cuda by
        # workers/kernels/triton_ops.py;
        # RAYPD_FUSED_OPS=0 keeps torch's own ops
        self.fused = triton_ops.applies(w.dtype, device, config.hidden_size,
                                        self.layers[0].head_dim) if device.type == "cuda" \
            else kernels.fused_ops_apply(w.dtype, device, config.hidden_size)
        # what the engine reports as `fused_ops`
        self.fused_ops = ("triton-cuda" if device.type == "cuda" else "native-cpu") \
            if self.fused else "off"
        # a pure decode step runs every layer in one native call
        # (workers/kernels/csrc/decode_layers.cpp: the same kernels, bit for bit, without the
        # Python between them) where the native kernels run all of them: float32 activations on
        # bf16-held linears, or bf16 on VNNI-packed ones; up to `one_call_rows` rows; False: one
        # call per operation
        # (not under TP: the all-reduces sit between the layers)
        self.one_call_rows, self.one_call_amx = self._one_call_rows() \
            if self.fused and device.type == "cpu" and tp is None else (0, False)
        self.one_call_decode = self.one_call_rows > 0
        self._words: tuple[torch.Tensor, torch.Tensor] | None = None   # (pool, its words)

    def _one_call_rows(self) -> tuple[int, bool]:
        """The most rows decode_layers takes for this model (0: it does not apply: a float32
        model with a linear not held as bf16, a bf16 model with a linear not VNNI-packed or
        not all on the same kernel (AMX or AVX512-BF16), another dtype, layers of different
        scales or norm eps, a norm weight not of the model's dtype, heads beyond the decode
        kernel's limits), and whether its linears run on AMX."""
        first, dtype = self.layers[0], self.embed.dtype
        # the decode kernel's limits (kernels.paged_decode checks them per call; here, once)
        if dtype not in kernels.FUSED_DTYPES or not kernels.paged_decode_heads_fit(
                first.num_heads, first.num_kv_heads, first.head_dim):
            return 0, False
        amx = bool(first.qkv.amx_m)
        rows = []
        for layer in self.layers:
            lins = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if layer.gate_up.bias is not None or layer.down.bias is not None \
                    or layer.scale != first.scale or layer.eps != first.eps:
                return 0, False
            if any(n.dtype != dtype or not n.is_contiguous() for n in (layer.ln1, layer.ln2)):
                return 0, False
            if dtype == torch.float32:
                if any(lin.w16 is None for lin in lins):
                    return 0, False
                rows += [lin.w16.max_rows for lin in lins]
            else:
                if any(lin.vnni is None or bool(lin.amx_m) != amx for lin in lins):
                    return 0, False
                rows += [lin.amx_m if amx else lin.small_m for lin in lins]
        return min(rows), amx

    def decode_words(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layers' operands for decode_layers ([L, kernels.LAYER_WORDS] int64: packed
        linears, biases, norms, this pool's K and V of the layer, sliding window), built once
        per pool (the tensors they point into are held by this model and the pool)."""
        if self._words is not None and self._words[0] is kv_cache:
            return self._words[1]
        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()
        def packed(lin: Linear) -> int:   # what the step's linear kernel reads
            return (lin.w16.packed if lin.w16 is not None else lin.vnni).data_ptr()
        rows = []
        for layer in self.layers:
            k, v = kv_cache[layer.layer_idx]
            rows.append([packed(layer.qkv), ptr(layer.qkv.bias), packed(layer.o),
                         ptr(layer.o.bias), packed(layer.gate_up), packed(layer.down),
                         layer.ln1.data_ptr(), layer.ln2.data_ptr(), k.data_ptr(), v.data_ptr(),
                         layer.window or 0])
        words = torch.tensor(rows, dtype=torch.int64)
        self._words = (kv_cache, words)
        return words

    def _one_call(self, h: torch.Tensor, meta: AttentionMetadata,
                  lora: LoRABatch | None) -> bool:
        """Whether this step's layers run as one native call."""
        kv = meta.kv_cache
        first = self.layers[0]
        return self.one_call_decode and lora is None and not meta.prefills \
            and meta.kv_scales is None and 0 < h.shape[0] == meta.num_decodes \
            and h.shape[0] <= self.one_call_rows and kv.dtype == h.dtype \
            and kv.device.type == "cpu" and kv.is_contiguous() \
            and kv.shape[4:] == (first.num_kv_heads, first.head_dim)

    def _decode_one_call(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                         meta: AttentionMetadata) -> torch.Tensor:
        t = h.shape[0]
        first, kv = self.layers[0], meta.kv_cache
        cos, sin = (x.reshape(t, -1).contiguous() for x in cos_sin)
        groups = [(g.start, g.block_tables, g.context_lens) for g in meta.decode_groups]
        dims = (t, h.shape[1], first.num_heads, first.num_kv_heads, first.head_dim,
                first.gate_up.out_features // 2, kv.shape[3], kv.shape[2])
        delta = kernels.decode_layers(self.decode_words(kv), groups, h, dims, first.eps,
                                      first.scale, cos, sin,
                                      meta.slot_mapping.to(torch.int64).contiguous(),
                                      self.one_call_amx)
        return kernels.add_rms_norm(h, delta, self.norm, self.eps)

    @staticmethod
    def release_fused_sources(hf_model: nn.Module, every_projection: bool = False) -> int:
        """Free the stock weights this model holds fused copies of (q/k/v, gate/up): an owner
        that keeps only the compact model should not hold them twice (~9 GB for an 8B model).
        The stock model cannot run afterwards (`raypd_stock_released` says so). Returns the
        bytes freed. Only for a stock model nothing else uses (an engine's own load)."""
        freed = 0
        for layer in hf_model.model.layers:
            a, m = layer.self_attn, layer.mlp
            # a TP rank holds copies of its slices of o and down too (`every_projection`)
            extra = (a.o_proj, m.down_proj) if every_projection else ()
            for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj, *extra):
                w = lin.weight
                freed += w.numel() * w.element_size()
                lin.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        hf_model.raypd_stock_released = True
        return freed

    @staticmethod
    def unsupported(config) -> str | None:
        """Why this config cannot run on the compact model, or None."""
        if config.model_type not in COMPACT_MODEL_TYPES:
            return f"model_type {config.model_type!r}"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r}"
        if getattr(config, "mlp_bias", False):
            return "mlp_bias"
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            return "partial rotary embedding"
        return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        h = self.embed[input_ids]
        cos_sin = self.rope.tables(positions)
        if self._one_call(h, meta, lora):   # (one_call_decode implies the fused ops)
            return self._decode_one_call(h, cos_sin, meta)
        if self.fused:
            delta = None
            for layer in self.layers:
                h, delta = layer.forward_fused(h, delta, cos_sin, meta, lora)
            return self.ops.add_rms_norm(h, delta, self.norm, self.eps)
        for layer in self.layers:
            h = layer(h, cos_sin, meta, lora)
        return rms_norm(h, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of `hidden`'s rows; under TP rank 0's full logits (None on the other ranks)."""
        if self.tp is None:
            return self.lm_head.forward(hidden)
        return self.tp.logits(self.lm_head, hidden)

    @property
    def linear_kernel(self) -> str:
        return (self.lm_head or self.layers[0].qkv).kernel
