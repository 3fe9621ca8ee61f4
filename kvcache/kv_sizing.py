"""KV sizing (what `raypd kv-plan` prints): from a model's config alone, what its KV cache costs per token and
per block in a given KV dtype, how many tokens fit a budget, and how long a 4k-token prompt's
pages take on a link.

Attention kinds: MHA (kv_heads == heads), GQA (1 < kv_heads < heads), MQA (kv_heads == 1) store a
K and a V vector of head_dim per KV head per layer; MLA (DeepSeek-V2/V3) stores one compressed
latent of kv_lora_rank plus the decoupled RoPE key of qk_rope_head_dim per layer. A quantized KV
dtype (int8, fp8) stores one byte per element plus a float32 scale per block, per layer, per K/V
and per KV head (MLA: per layer), which is what the engine's pool allocates
(workers/kv_quant.py). `bytes_per_token` is what a paged pool that keeps every layer allocates
(raypd's pool does); sliding-window layers hold at most `window` tokens, so
`windowed_bytes_per_token_4k` gives the per-token cost of a 4k context where the pool frees
blocks that left the window.

Tensor parallelism (`tp`): one rank of a TP-t worker holds num_kv_heads / t KV heads, or one when
t exceeds them (each replicated t / num_kv_heads times; MLA's latent is on every rank), so its
pool costs that share per token; `budget_gb` is then each rank's and the blocks that fit it are
a rank's (every rank holds the same blocks, its heads of each). Weights per rank (dense Llama
family only, `weight_bytes`): Megatron's split as workers/llama.py shards them.
protocol/tp_layout.py's `tp_refusal` is the rule a TP size keeps; callers refuse first.

Torch-free: the router may import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# bytes per element of each KV dtype the engine accepts (fp8 = float8_e4m3fn)
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
QUANTIZED_KV_DTYPES = ("int8", "fp8")
SCALE_BYTES = 4   # one float32 scale per (layer, K/V, block, KV head)

# one-direction bandwidth of each link, bytes/s (nominal: NVLink 4 = 450 GB/s per direction,
# PCIe 5 x16 = 64 GB/s, InfiniBand NDR 400 Gb/s, Ethernet 100 Gb/s)
LINKS_BPS = {"nvlink": 450e9, "pcie5": 64e9, "ib400": 50e9, "eth100": 12.5e9}

# the fields of public config.json files the planner reads (Hugging Face hub, as published)
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
                   "max_position_embeddings": 8192, "intermediate_size": 14336,
                   "vocab_size": 128256, "tie_word_embeddings": False},
    "llama-3-70b": {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "hidden_size": 8192, "head_dim": 128,
                    "max_position_embeddings": 8192, "intermediate_size": 28672,
                    "vocab_size": 128256, "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "hidden_size": 3584,
                   "max_position_embeddings": 32768, "sliding_window": 131072,
                   "use_sliding_window": False, "max_window_layers": 28,
                   "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "deepseek-v3": {"model_type": "deepseek_v3", "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "max_position_embeddings": 163840},
    "mistral-7b-v0.1": {"model_type": "mistral", "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                        "head_dim": 128, "sliding_window": 4096,
                        "max_position_embeddings": 32768, "intermediate_size": 14336,
                        "vocab_size": 32000, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class KVLayout:
    """What one token of one layer stores: `vectors` vectors of `width` elements each."""

    attention_kind: str             # MHA | GQA | MQA | MLA
    num_layers: int
    vectors: int                    # K and V per KV head (2 * kv_heads), or 1 latent (MLA)
    width: int                      # head_dim, or kv_lora_rank + qk_rope_head_dim (MLA)
    windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full
    max_position_embeddings: int


@dataclass(frozen=True)
class KVSizing:
    model: str
    attention_kind: str
    kv_dtype: str
    block_size: int
    num_layers: int
    bytes_per_token: float          # every layer, scales included (what the pool allocates)
    bytes_per_block: int
    windowed_bytes_per_token_4k: float   # sliding-window layers capped at their window
    budget_bytes: int
    tokens_in_budget: int           # tokens a worker holds with budget_bytes on each rank
    link: str
    transfer_s_4k: float            # one 4096-token prompt's pages over `link`
    transfer_s_4k_by_link: dict[str, float]
    tp: int                         # tensor-parallel ranks of the worker
    kv_heads_per_rank: int | None   # None: MLA (one latent, on every rank)
    bytes_per_token_per_rank: float
    bytes_per_block_per_rank: int
    blocks_in_budget_per_rank: int  # `budget_bytes` is each rank's
    weight_dtype: str
    weight_bytes: float | None      # the whole model; None: not modeled (MLA / MoE)
    weight_bytes_per_rank: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def layer_windows(cfg: Any) -> list[int | None]:
    """Sliding window (tokens) of each layer, None for full attention, as transformers decides it:
    `layer_types` when the config has them; Qwen2's `use_sliding_window` from
    `max_window_layers` on; Mistral's `sliding_window` on every layer."""
    n = _get(cfg, "num_hidden_layers")
    window = _get(cfg, "sliding_window")
    types = _get(cfg, "layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if _get(cfg, "model_type") == "qwen2":
        if window and _get(cfg, "use_sliding_window", False):
            first = _get(cfg, "max_window_layers", n)
            return [window if i >= first else None for i in range(n)]
        return [None] * n
    if _get(cfg, "model_type") == "mistral" and window:
        return [window] * n
    return [None] * n


def kv_layout(cfg: Any) -> KVLayout:
    """The per-token KV layout of a transformers config (object or config.json dict)."""
    layers = int(_get(cfg, "num_hidden_layers"))
    heads = int(_get(cfg, "num_attention_heads"))
    max_pos = int(_get(cfg, "max_position_embeddings", 0) or 0)
    if _get(cfg, "kv_lora_rank"):
        width = int(_get(cfg, "kv_lora_rank")) + int(_get(cfg, "qk_rope_head_dim", 0) or 0)
        return KVLayout("MLA", layers, 1, width, tuple(layer_windows(cfg)), max_pos)
    kv_heads = int(_get(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(_get(cfg, "head_dim", None) or _get(cfg, "hidden_size") // heads)
    kind = "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"
    return KVLayout(kind, layers, 2 * kv_heads, head_dim, tuple(layer_windows(cfg)), max_pos)


def rank_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank of a TP-`tp` worker holds: num_kv_heads / tp, or 1 when tp exceeds
    them (replicated), as protocol/tp_layout.py rank_heads lays them out (a tp its tp_refusal
    refuses is the caller's error)."""
    assert tp >= 1 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0), (num_kv_heads, tp)
    return max(1, num_kv_heads // tp)


def rank_layout(layout: KVLayout, tp: int) -> KVLayout:
    """What one rank of a TP-`tp` worker stores per token and layer: its KV heads' K and V
    (MLA: the whole latent, which every rank keeps)."""
    if tp == 1 or layout.attention_kind == "MLA":
        return layout
    return replace(layout, vectors=2 * rank_kv_heads(layout.vectors // 2, tp))


def weight_bytes(cfg: Any, tp: int = 1, dtype_bytes: int = 2) -> tuple[float, float] | None:
    """(the whole model's, one TP-`tp` rank's) weight bytes of a dense Llama-family config;
    None where not modeled (MLA or mixture-of-experts configs, or one without
    intermediate_size / vocab_size). Split 1/tp (Megatron, as workers/llama.py shards): the
    q and o projections, the MLP, an untied lm_head (by vocabulary); the k and v projections
    by the rank's KV heads (replicated past num_kv_heads); replicated on every rank: the input
    embedding (a lookup; a tied lm_head is that copy) and the norms. Biases are left out."""
    if _get(cfg, "kv_lora_rank") or _get(cfg, "num_local_experts") \
            or _get(cfg, "n_routed_experts"):
        return None
    inter, vocab = _get(cfg, "intermediate_size"), _get(cfg, "vocab_size")
    if not inter or not vocab:
        return None
    layers, hidden = int(_get(cfg, "num_hidden_layers")), int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(_get(cfg, "head_dim", None) or hidden // heads)
    q = hidden * heads * head_dim           # q_proj; o_proj the same
    kv = hidden * kv_heads * head_dim       # k_proj; v_proj the same
    mlp = 3 * hidden * int(inter)           # gate, up, down
    norms = 2 * hidden
    embed = int(vocab) * hidden
    head = 0 if _get(cfg, "tie_word_embeddings", False) else embed
    total = layers * (2 * q + 2 * kv + mlp + norms) + embed + head + hidden
    share = rank_kv_heads(kv_heads, tp) / kv_heads
    rank = layers * ((2 * q + mlp) / tp + 2 * kv * share + norms) + embed + head / tp + hidden
    return total * dtype_bytes, rank * dtype_bytes


def bytes_per_layer_block(layout: KVLayout, kv_dtype: str, block_size: int) -> int:
    """Bytes one block of one layer holds: the elements, plus a scale per vector group when
    quantized (one per K/V per KV head; one per latent for MLA)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    data = block_size * layout.vectors * layout.width * KV_DTYPE_BYTES[kv_dtype]
    scales = layout.vectors * SCALE_BYTES if kv_dtype in QUANTIZED_KV_DTYPES else 0
    return data + scales


def size_kv(cfg: Any, kv_dtype: str = "bfloat16", block_size: int = 16, budget_gb: float = 1.0,
            link: str = "pcie5", model: str = "", tp: int = 1,
            weight_dtype: str = "bfloat16") -> KVSizing:
    """The sizing of `cfg` (module doc); with `tp`, `budget_gb` is each rank's."""
    if weight_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"weight_dtype must be float32, bfloat16 or float16, got "
                         f"{weight_dtype!r}")
    if link not in LINKS_BPS:
        raise ValueError(f"link must be one of {', '.join(LINKS_BPS)}, got {link!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    layout = kv_layout(cfg)
    per_layer_block = bytes_per_layer_block(layout, kv_dtype, block_size)
    bytes_per_block = layout.num_layers * per_layer_block
    budget = int(budget_gb * 2**30)
    tokens_4k = 4096
    blocks_4k = math.ceil(tokens_4k / block_size)
    held = sum(min(blocks_4k, math.ceil(w / block_size) + 1) if w else blocks_4k
               for w in layout.windows)   # blocks each layer still holds at 4k tokens
    pages_4k = blocks_4k * bytes_per_block   # a prompt's pages: every layer, every block
    rank = rank_layout(layout, tp)
    rank_block = rank.num_layers * bytes_per_layer_block(rank, kv_dtype, block_size)
    weights = weight_bytes(cfg, tp, KV_DTYPE_BYTES[weight_dtype])
    return KVSizing(
        model=model, attention_kind=layout.attention_kind, kv_dtype=kv_dtype,
        block_size=block_size, num_layers=layout.num_layers,
        bytes_per_token=bytes_per_block / block_size, bytes_per_block=bytes_per_block,
        windowed_bytes_per_token_4k=held * per_layer_block / tokens_4k,
        budget_bytes=budget, tokens_in_budget=budget // rank_block * block_size,
        link=link, transfer_s_4k=pages_4k / LINKS_BPS[link],
        transfer_s_4k_by_link={k: pages_4k / bps for k, bps in LINKS_BPS.items()},
        tp=tp, kv_heads_per_rank=None if layout.attention_kind == "MLA" else rank.vectors // 2,
        bytes_per_token_per_rank=rank_block / block_size, bytes_per_block_per_rank=rank_block,
        blocks_in_budget_per_rank=budget // rank_block, weight_dtype=weight_dtype,
        weight_bytes=weights[0] if weights else None,
        weight_bytes_per_rank=weights[1] if weights else None)


def read_config(path: str | Path) -> dict:
    """A config.json (file, or a folder holding one) as a dict; errors name the file."""
    p = Path(path).expanduser()
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"{f}: no such config file")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}:{e.lineno}: not valid JSON ({e.msg})") from e
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{f}: config lacks {', '.join(missing)}")
    return cfg
