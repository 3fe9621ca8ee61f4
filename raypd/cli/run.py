"""`raypd run`, the main job (raypd/replay/run_job.py): flags and handler."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from raypd.cli.common import add_device_args, add_lora_arg, config_from_args
from raypd.cli.replay import add_replay_options
from raypd.replay.mooncake import WorkloadError
from raypd.replay.run_job import (
    DEFAULT_NUM_BLOCKS,
    DEFAULT_OUT_DIR,
    DEFAULT_RATE,
    DEFAULT_REQUESTS,
    run_job,
)
from raypd.replay.submit import SubmitOptions, write_reports
from raypd.replay.workload import SynthConfig, load_workload, synth_trace, write_jsonl


def register(sub) -> None:
    add_run_parser(sub)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    from raypd.replay import run_job
    p = subparsers.add_parser("run", help="the main job: local P/D cluster on SmolLM2, replay a "
                                          "synthetic trace, print and write the report",
                              description=run_job.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML config (default: configs/local.yaml's defaults)")
    p.add_argument("--model", default=None, help="smollm2 (default), tiny or a local HF folder")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers (1)")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers (1)")
    p.add_argument("--policy", default=None, help="routing policy (locality)")
    p.add_argument("--transport", default=None, help="KV transport (shm)")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV pool per worker in blocks (engine.num_blocks); default: "
                   f"{DEFAULT_NUM_BLOCKS} without --config (a pool the built-in trace fills, so "
                   "the report shows the capacity boundary), the config's pool with it")
    add_lora_arg(p)
    p.add_argument("--trace", type=Path, default=None,
                   help="replay this trace instead of the built-in synthetic one")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                   help="requests of the built-in trace (default %(default)s)")
    p.add_argument("--synth-rate", type=float, default=DEFAULT_RATE,
                   help="arrivals/s of the built-in trace (default %(default)s)")
    add_replay_options(p, timestamps_default=True)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help="where the report files go (default %(default)s/)")
    add_device_args(p)
    p.set_defaults(func=cmd_run)
    return p


def run_config(args: argparse.Namespace):
    """The main job's RaypdConfig: --config (or the defaults), then the flags over it; without
    --config the pool is DEFAULT_NUM_BLOCKS blocks unless --num-blocks says otherwise."""
    return config_from_args(args, {
        "workers.prefill.count": args.prefill, "workers.decode.count": args.decode,
        "router.policy": args.policy, "transfer.transport": args.transport,
        "engine.num_blocks": args.num_blocks if args.num_blocks is not None
        else None if args.config else DEFAULT_NUM_BLOCKS})


def cmd_run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    out_dir: Path = args.out_dir
    try:
        cfg = run_config(args)
        if args.trace is not None:
            trace_path = args.trace
        else:
            trace_path = out_dir / "trace.jsonl"
            write_jsonl(synth_trace(SynthConfig(requests=args.requests, rate=args.synth_rate)),
                        trace_path)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        items = load_workload(trace_path, limit=args.limit, block_tokens=args.block_tokens,
                              vocab_size=args.vocab_size,
                              max_output_tokens=args.max_output_tokens)
        opts = SubmitOptions("", rate=args.rate, timestamps=args.timestamps and not args.rate,
                             concurrency=args.concurrency, seed=args.seed,
                             progress=not args.no_progress)
        opts.validate()
        from cluster.serve import check_kv_quality_gate
        check_kv_quality_gate(cfg)   # a quantized KV dtype serves only once its gate passed
    except (WorkloadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report, records = run_job(cfg, items, opts, trace_path, block_tokens=args.block_tokens,
                              max_output_tokens=args.max_output_tokens,
                              slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                              perfetto=args.perfetto)
    files = [out_dir / "report.json", out_dir / "report.html", out_dir / "outputs.jsonl"]
    write_reports(report, records, *files)
    from raypd.replay.report import print_summary
    print_summary(report, files=files)
    print(f"raypd run: done in {time.perf_counter() - t_start:.0f} s")
    return 0 if report["requests_ok"] else 1
