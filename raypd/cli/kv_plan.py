"""`raypd kv-plan`: the KV representation planner (kvcache/kv_sizing.py) on the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcache.kv_sizing import (
    KNOWN_CONFIGS,
    KV_DTYPE_BYTES,
    LINKS_BPS,
    KVSizing,
    read_config,
    size_kv,
)


def model_config(model: str) -> dict:
    """The config of `model`: a known public model (KNOWN_CONFIGS), a loadable built-in (tiny,
    smollm2) or a local checkpoint folder / config.json."""
    if model.lower() in KNOWN_CONFIGS:
        return dict(KNOWN_CONFIGS[model.lower()])
    if model == "tiny":
        from workers.model_loader import load_model
        return load_model("tiny")[0].config.to_dict()
    if model == "smollm2":
        from workers.model_loader import resolve_model_dir
        return read_config(resolve_model_dir("smollm2"))
    if not Path(model).expanduser().exists():
        raise ValueError(f"unknown model {model!r}: a path to a config.json / checkpoint folder, "
                         f"tiny, smollm2, or one of {', '.join(KNOWN_CONFIGS)}")
    return read_config(model)


def _table(plans: list[KVSizing]) -> str:
    head = (f"{'model':<18} {'kind':<4} {'kv_dtype':<8} {'KiB/token':>10} {'KiB/block':>10} "
            f"{'tokens_in_budget':>16} {'transfer_s_4k':>13}")
    rows = [head] + [
        f"{p.model:<18} {p.attention_kind:<4} {p.kv_dtype:<8} {p.bytes_per_token / 1024:>10.3f} "
        f"{p.bytes_per_block / 1024:>10.1f} {p.tokens_in_budget:>16} {p.transfer_s_4k:>13.5f}"
        for p in plans]
    return "\n".join(rows)


def cmd_kv_plan(args: argparse.Namespace) -> int:
    plans = [size_kv(model_config(m), args.kv_dtype, args.block_size, args.budget_gb, args.link,
                  model=m) for m in args.model]
    print(_table(plans))
    print(f"(budget {args.budget_gb} GiB, block_size {args.block_size}, link {args.link})")
    if args.json:
        out = plans[0].to_dict() if len(plans) == 1 else [p.to_dict() for p in plans]
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def register(sub) -> None:
    add_kv_plan_parser(sub)


def add_kv_plan_parser(sub) -> None:
    p = sub.add_parser("kv-plan", help="KV bytes per token/block, tokens in a budget, transfer "
                       "time of a 4k prompt, from the model config alone")
    p.add_argument("--model", action="append", required=True,
                   help="config.json / checkpoint folder, tiny, smollm2, or "
                   + ", ".join(KNOWN_CONFIGS) + " (repeatable)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=list(KV_DTYPE_BYTES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget-gb", type=float, default=1.0, help="KV budget (GiB)")
    p.add_argument("--link", default="pcie5", choices=list(LINKS_BPS))
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_kv_plan)
