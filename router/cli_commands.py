"""`raypd route-sim` and `raypd bench routing`: argparse registration and handlers for the
cluster CLI, also runnable alone (`python -m router.cli_commands route-sim|bench-routing`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from router.policies import DEFAULT_POLICY, POLICIES, make_policy
from router.sim import SimConfig, simulate
from router.trace import TraceError, load_trace

_DEFAULTS = SimConfig()


def _add_sim_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity-blocks", type=int, default=_DEFAULTS.capacity_blocks,
                   help="prefix-cache blocks per prefill worker (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=_DEFAULTS.block_tokens,
                   help="tokens a trace block stands for; input lengths scale with it "
                        "(default %(default)s)")
    p.add_argument("--prefill-tok-s", type=float, default=_DEFAULTS.prefill_tok_s,
                   help="prefill rate of a worker at zero context, tokens/s (default %(default)s)")
    p.add_argument("--overhead-s", type=float, default=_DEFAULTS.overhead_s,
                   help="fixed seconds per prefill request (default %(default)s)")
    p.add_argument("--attn-ctx-tokens", type=float, default=_DEFAULTS.attn_ctx_tokens,
                   help="context at which attention doubles a token's cost; 0: linear "
                        "(default %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the result here")


def _sim_config(args: argparse.Namespace, num_workers: int = 8) -> SimConfig:
    return SimConfig(num_workers=num_workers, capacity_blocks=args.capacity_blocks,
                     block_tokens=args.block_tokens, prefill_tok_s=args.prefill_tok_s,
                     overhead_s=args.overhead_s, attn_ctx_tokens=args.attn_ctx_tokens,
                     index_mode=getattr(args, "index", _DEFAULTS.index_mode),
                     approx_ttl_s=getattr(args, "approx_ttl_s", _DEFAULTS.approx_ttl_s))


def _emit(result: dict, json_path: Path | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=False)
    print(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def cmd_route_sim(args: argparse.Namespace) -> int:
    """Handler of `route-sim`: replay the trace, print the JSON report (exit 2 on bad input)."""
    try:
        _positive("--prefill-workers", args.prefill_workers)
        _positive("--capacity-blocks", args.capacity_blocks)
        _positive("--block-tokens", args.block_tokens)
        _positive("--prefill-tok-s", args.prefill_tok_s)
        cfg = _sim_config(args, args.prefill_workers)
        policy_cfg = {}
        if args.policy == "locality" and args.ttft_slo_s is not None:
            policy_cfg["ttft_slo_s"] = args.ttft_slo_s
        policy = make_policy(args.policy, **policy_cfg)
        requests = load_trace(args.trace, limit=args.limit)
        result = simulate(requests, policy, cfg)
    except (TraceError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["trace"] = str(args.trace)
    _emit(result, args.json)
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    """Handler of `bench routing`: the full benchmark (or --quick), printed as JSON."""
    from router.bench import BENCH_CONFIG, run_routing_bench  # numpy-heavy; only when asked

    try:
        cfg = dataclasses.replace(BENCH_CONFIG, prefill_tok_s=args.prefill_tok_s,
                                  overhead_s=args.overhead_s,
                                  attn_ctx_tokens=args.attn_ctx_tokens)
        only = tuple(args.workloads.split(",")) if args.workloads else None
        result = run_routing_bench(args.trace, quick=args.quick, config=cfg, only=only,
                                   seed=args.seed)
    except (TraceError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _emit(result, args.json)
    return 0


def add_route_sim_parser(subparsers) -> argparse.ArgumentParser:
    """Register `route-sim TRACE --policy P --prefill-workers N --capacity-blocks C ...`."""
    p = subparsers.add_parser(
        "route-sim", help="replay a Mooncake trace through the router's index and policies",
        description="Replay a Mooncake-format trace (timestamp, input_length, output_length, "
                    "hash_ids) through the prefix index and a routing policy, with prefill "
                    "workers that each hold an LRU cache of C blocks (no model).")
    p.add_argument("trace", type=Path, help="Mooncake-format JSONL trace")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="routing policy (default %(default)s)")
    p.add_argument("--prefill-workers", type=int, default=8,
                   help="number of prefill workers (default %(default)s)")
    _add_sim_options(p)
    p.add_argument("--index", choices=("precise", "approx"), default=_DEFAULTS.index_mode,
                   help="prefix index fed by KV events, or predicted from routing with a TTL")
    p.add_argument("--approx-ttl-s", type=float, default=_DEFAULTS.approx_ttl_s,
                   help="TTL of the approximate index's entries (default %(default)s)")
    p.add_argument("--ttft-slo-s", type=float, default=None,
                   help="locality only: reject (429) requests whose best estimated TTFT "
                        "exceeds this")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.set_defaults(func=cmd_route_sim)
    return p


def add_bench_routing_parser(bench_subparsers, name: str = "routing") -> argparse.ArgumentParser:
    """Register `bench routing [--trace PATH] [--quick] --json PATH` under `raypd bench`."""
    p = bench_subparsers.add_parser(
        name, help="routing policies side by side on five workloads, decision latency")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake trace (default ../shared/traces/mooncake_synthetic_trace.jsonl"
                        " beside the repository, or $RAYPD_SHARED_DIR/traces/...)")
    p.add_argument("--quick", action="store_true",
                   help="about a quarter of each workload, fewer latency samples")
    p.add_argument("--workloads", default=None, metavar="A,B",
                   help="only these workloads (default: all of router/sim_workloads.py; "
                        "block size and cache capacity are each workload's own)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw the synthesized workloads with this seed (default: each "
                        "workload's own; the shared trace is unchanged)")
    _add_sim_options(p)
    p.set_defaults(func=cmd_bench_routing)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router.cli_commands")
    sub = parser.add_subparsers(dest="command", required=True)
    add_route_sim_parser(sub)
    add_bench_routing_parser(sub, name="bench-routing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_route_sim_parser", "add_bench_routing_parser", "cmd_route_sim",
           "cmd_bench_routing", "main"]
