"""A Llama checkpoint loaded for the compact model without transformers' model or config code.

An engine that loads its own model (every worker actor) needs only the weights and a handful of
config fields: the compact model (workers/llama.py) computes everything itself. transformers'
`LlamaForCausalLM` and even `LlamaConfig` import ~3-4 s of modules a process (its model
loading, torch.distributed.tensor, torch._dynamo, sympy) and build a second, stock copy of every
weight first. Here:

- `LightConfig`: the config.json fields the engine reads, with transformers' Llama defaults;
- `LightLlama`: the weights under the stock model's attribute names (`model.layers[i].self_attn
  .q_proj.weight`, ...), which is all `CompactLlama` and a `ModelRunner` given its device (as
  an engine gives it) read from a model;
- `load_light_dir`: a local folder of safetensors; `tiny_state_dict`: the seeded tiny model's
  weights (workers/model_loader.py builds the stock tiny model from the same tensors, so both
  loads compute the same function).

What it takes (`light_unsupported` says why not, and the loader then uses transformers):
model_type llama, SiLU, no MLP bias, the default rotary embedding (no rope scaling), weights in
safetensors, and a tokenizer that `PreTrainedTokenizerFast` loads as it is (tokenizer_class
`TokenizersBackend` or `PreTrainedTokenizerFast`). The stock model (model_impl stock) and LoRA
adapters keep the transformers load.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# transformers' LlamaConfig defaults, for the fields the engine reads
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "attention_bias": False, "mlp_bias": False, "head_dim": None, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": None, "sliding_window": None, "layer_types": None,
    "rope_scaling": None,
}
LIGHT_TOKENIZER_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")


class LightConfig(SimpleNamespace):
    """The config.json fields of a Llama checkpoint, as attributes (transformers' defaults
    where the file is silent); `rope_parameters` as transformers 5 spells it."""

    @classmethod
    def from_dict(cls, d: dict) -> LightConfig:
        fields = {**LLAMA_DEFAULTS, **d}
        if fields["num_key_value_heads"] is None:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if fields["head_dim"] is None:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        params = dict(fields.get("rope_parameters") or {})
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", fields["rope_theta"])
        fields["rope_parameters"] = params
        fields["dtype"] = fields.get("dtype") or fields.get("torch_dtype") or "float32"
        return cls(**fields)


def light_unsupported(config: dict, tokenizer_config: dict | None = None) -> str | None:
    """Why a checkpoint of this config.json (and tokenizer_config.json) needs transformers'
    load, or None."""
    if config.get("model_type") != "llama":
        return f"model_type {config.get('model_type')!r}"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r}"
    if config.get("mlp_bias"):
        return "mlp_bias"
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default" \
            or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "a rope scaling"
    cls = (tokenizer_config or {}).get("tokenizer_class")
    if cls not in LIGHT_TOKENIZER_CLASSES:
        return f"tokenizer_class {cls!r}"
    return None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SimpleNamespace:
    return SimpleNamespace(weight=weight, bias=bias)


class LightLlama:
    """A Llama's weights under the stock model's attribute names (what `CompactLlama` reads);
    it cannot run by itself (the compact model runs it)."""

    def __init__(self, config: LightConfig, weights: dict[str, torch.Tensor],
                 generation_eos: Any = None) -> None:
        self.config = config
        w = weights
        n = config.num_hidden_layers
        eps = config.rms_norm_eps
        head_dim = config.head_dim

        def norm(name: str) -> SimpleNamespace:
            return SimpleNamespace(weight=w[name], variance_epsilon=eps)

        def lin(prefix: str, bias: bool = False) -> SimpleNamespace:
            return _linear(w[f"{prefix}.weight"], w.get(f"{prefix}.bias") if bias else None)

        layers = []
        for i in range(n):
            p = f"model.layers.{i}"
            a = p + ".self_attn"
            attn = SimpleNamespace(
                q_proj=lin(a + ".q_proj", config.attention_bias),
                k_proj=lin(a + ".k_proj", config.attention_bias),
                v_proj=lin(a + ".v_proj", config.attention_bias),
                o_proj=lin(a + ".o_proj", config.attention_bias),
                head_dim=head_dim, scaling=head_dim ** -0.5, layer_idx=i)
            mlp = SimpleNamespace(gate_proj=lin(p + ".mlp.gate_proj"),
                                  up_proj=lin(p + ".mlp.up_proj"),
                                  down_proj=lin(p + ".mlp.down_proj"))
            layers.append(SimpleNamespace(self_attn=attn, mlp=mlp,
                                          input_layernorm=norm(p + ".input_layernorm.weight"),
                                          post_attention_layernorm=norm(
                                              p + ".post_attention_layernorm.weight")))
        embed = w["model.embed_tokens.weight"]
        self.model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed), layers=layers,
                                     norm=norm("model.norm.weight"))
        head = embed if config.tie_word_embeddings or "lm_head.weight" not in w \
            else w["lm_head.weight"]
        self.lm_head = _linear(head)
        self.dtype = embed.dtype
        self.generation_config = SimpleNamespace(
            eos_token_id=config.eos_token_id if generation_eos is None else generation_eos)


def tiny_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The seeded tiny model's weights, in the stock model's names: every linear and the
    embedding normal(0, initializer_range) (the padding row zero, as transformers' init
    leaves it), norms one. The caller's RNG state is left untouched."""
    cfg = LightConfig.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    std = cfg.initializer_range
    hd, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w: dict[str, torch.Tensor] = {}
    embed = normal(cfg.vocab_size, cfg.hidden_size)
    if cfg.pad_token_id is not None:
        embed[cfg.pad_token_id] = 0
    w["model.embed_tokens.weight"] = embed
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = normal(h * hd, cfg.hidden_size)
        w[f"{p}.self_attn.k_proj.weight"] = normal(kv * hd, cfg.hidden_size)
        w[f"{p}.self_attn.v_proj.weight"] = normal(kv * hd, cfg.hidden_size)
        w[f"{p}.self_attn.o_proj.weight"] = normal(cfg.hidden_size, h * hd)
        w[f"{p}.mlp.gate_proj.weight"] = normal(cfg.intermediate_size, cfg.hidden_size)
        w[f"{p}.mlp.up_proj.weight"] = normal(cfg.intermediate_size, cfg.hidden_size)
        w[f"{p}.mlp.down_proj.weight"] = normal(cfg.hidden_size, cfg.intermediate_size)
        w[f"{p}.input_layernorm.weight"] = torch.ones(cfg.hidden_size)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size)
    w["model.norm.weight"] = torch.ones(cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = normal(cfg.vocab_size, cfg.hidden_size)
    return w


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a folder (sharded: those its index names), [] when it has
    none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(read_json(index)["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def load_light_dir(path: Path, config: dict, dtype: torch.dtype) -> LightLlama:
    """The folder's weights in `dtype` (`config`: its config.json; the caller checked
    `light_unsupported` and that it has safetensors files)."""
    from safetensors.torch import load_file
    weights: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        for name, t in load_file(str(f)).items():
            weights[name] = t.to(dtype)
    eos = read_json(path / "generation_config.json").get("eos_token_id")
    return LightLlama(LightConfig.from_dict(config), weights, generation_eos=eos)
