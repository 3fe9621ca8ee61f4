"""`raypd kv-plan`: the KV representation planner (kvcache/kv_sizing.py) on the command line;
with --tp N, what one rank of a TP-N worker holds (KV heads, bytes, blocks, weights), a TP size
the model's heads refuse (protocol/tp_layout.py tp_refusal) an error naming the rule."""

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


def check_tp(cfg: dict, model: str, tp: int) -> None:
    """A TP size the model's heads refuse is an error naming the model and the rule."""
    from protocol.tp_layout import tp_refusal
    heads = int(cfg["num_attention_heads"])
    reason = tp_refusal(heads, int(cfg.get("num_key_value_heads") or heads), tp)
    if reason:
        raise ValueError(f"--tp {tp}: model {model}: {reason}")


def _gb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e9:.2f}"


def _table(plans: list[KVSizing]) -> str:
    head = (f"{'model':<18} {'kind':<4} {'kv_dtype':<8} {'KiB/token':>10} {'KiB/block':>10} "
            f"{'tokens_in_budget':>16} {'transfer_s_4k':>13}   {'tp':>2} {'kv_heads/rank':>13} "
            f"{'KiB/token/rank':>14} {'blocks/rank':>11} {'weights_GB':>10} "
            f"{'weights_GB/rank':>15}")
    rows = [head] + [
        f"{p.model:<18} {p.attention_kind:<4} {p.kv_dtype:<8} {p.bytes_per_token / 1024:>10.3f} "
        f"{p.bytes_per_block / 1024:>10.1f} {p.tokens_in_budget:>16} {p.transfer_s_4k:>13.5f}"
        f"   {p.tp:>2} {p.kv_heads_per_rank or 'latent':>13} "
        f"{p.bytes_per_token_per_rank / 1024:>14.3f} {p.blocks_in_budget_per_rank:>11} "
        f"{_gb(p.weight_bytes):>10} {_gb(p.weight_bytes_per_rank):>15}"
        for p in plans]
    return "\n".join(rows)


def cmd_kv_plan(args: argparse.Namespace) -> int:
    configs = {m: model_config(m) for m in args.model}
    for m, cfg in configs.items():
        check_tp(cfg, m, args.tp)
    plans = [size_kv(cfg, args.kv_dtype, args.block_size, args.budget_gb, args.link, model=m,
                     tp=args.tp, weight_dtype=args.weight_dtype) for m, cfg in configs.items()]
    print(_table(plans))
    print(f"(budget {args.budget_gb} GiB" + (" per rank" if args.tp > 1 else "")
          + f", block_size {args.block_size}, link {args.link}, weights in {args.weight_dtype}"
          "; per rank: KV heads split 1/tp, one replicated head when tp exceeds them, the MLA "
          "latent whole; weights: projections and MLP 1/tp, an untied lm_head 1/tp by "
          "vocabulary, the embedding and norms replicated, biases left out)")
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
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks of a worker: per-rank KV bytes, blocks in a "
                   "--budget-gb of each rank, weights per rank (default %(default)s)")
    p.add_argument("--weight-dtype", default="bfloat16",
                   choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype for the weight bytes (default %(default)s)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_kv_plan)
