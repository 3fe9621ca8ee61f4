"""`raypd run`, the main job: start an embedded local Ray with 1 prefill + 1 decode worker on
SmolLM2 behind the HTTP server, replay a built-in synthetic trace (shared system prompts,
multi-turn sessions, Poisson arrivals) through it with `raypd submit`'s client, print the report
summary and write report.json / report.html / outputs.jsonl / trace.jsonl into --out-dir.

    raypd run [--prefill N] [--decode M] [--policy P] [--trace FILE] [--model M] [--requests N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from cluster.cli import add_device_args, add_lora_arg, lora_adapters_from_args
from router.submit import SubmitOptions, add_replay_options, replay, write_reports
from router.trace import TraceError
from router.workload import SynthConfig, load_workload, synth_trace, write_jsonl

DEFAULT_REQUESTS = 100
DEFAULT_RATE = 1.0              # arrivals / s of the built-in trace
DEFAULT_OUT_DIR = Path("raypd-report")


class RecordingBackend:
    """The cluster as the HTTP ingress sees it, keeping each finished request's result (token
    ids, lifecycle) by request id so the report can join them to the client's records."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.results: dict[str, dict] = {}

    def run_request(self, prompt: Any, sampling: Any = None, **kw: Any) -> dict:
        result = self._backend.run_request(prompt, sampling, **kw)
        if kw.get("request_id"):
            self.results[kw["request_id"]] = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="the main job: local P/D cluster on SmolLM2, replay a "
                                          "synthetic trace, print and write the report",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML config (default: configs/local.yaml's defaults)")
    p.add_argument("--model", default=None, help="smollm2 (default), tiny or a local HF folder")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers (1)")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers (1)")
    p.add_argument("--policy", default=None, help="routing policy (locality)")
    p.add_argument("--transport", default=None, help="KV transport (shm)")
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


def cmd_run(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    t_start = time.perf_counter()
    out_dir: Path = args.out_dir
    try:
        overrides = {"model.name": args.model, "workers.prefill.count": args.prefill,
                     "workers.decode.count": args.decode, "router.policy": args.policy,
                     "transfer.transport": args.transport,
                     "model.lora_adapters": lora_adapters_from_args(args),
                     "engine.device": getattr(args, "device", None),
                     "engine.cuda_graphs": False if getattr(args, "no_cuda_graphs", None)
                     else None}
        cfg = load_config(args.config, overrides)
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
    except (TraceError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report, records = _run(cfg, items, opts, trace_path, args)
    files = [out_dir / "report.json", out_dir / "report.html", out_dir / "outputs.jsonl"]
    write_reports(report, records, *files)
    from router.report import print_summary
    print_summary(report, files=files)
    print(f"raypd run: done in {time.perf_counter() - t_start:.0f} s")
    return 0 if report["requests_ok"] else 1


def _run(cfg, items, opts: SubmitOptions, trace_path: Path, args) -> tuple[dict, list]:
    from cluster.bench_kv_quality import GateThresholds, recorded_gates
    from cluster.pd import PDCluster
    from cluster.serve import API_KEY_ENV, connect_ray, start_server
    from kvcache.sampling import SamplingParams
    from router.report import build_report
    from router.request_traces import stage_breakdown
    from router.trace_views import write_chrome_trace

    w = cfg.workers
    print(f"raypd run: starting {w.prefill.count} prefill + {w.decode.count} decode workers "
          f"({cfg.model.name}, policy {cfg.router.policy}, transport {cfg.transfer.transport})",
          file=sys.stderr, flush=True)
    started_ray = connect_ray(cfg.ray)
    cluster = handle = None
    try:
        pd_cfg = cfg.to_pd_config()
        cluster = PDCluster(pd_cfg)
        backend = RecordingBackend(cluster)
        handle = start_server(cfg, "127.0.0.1", 0, backend=backend)   # keys as `raypd serve`
        cluster.run_request("warm-up", SamplingParams(max_tokens=2))  # first-call costs
        opts.url = handle.url
        opts.api_key = cfg.server.api_key or os.environ.get(API_KEY_ENV) or None
        before = cluster.stats()
        print(f"raypd run: replaying {len(items)} requests from {trace_path} through "
              f"{handle.url}", file=sys.stderr, flush=True)
        result = replay(items, opts, cfg.served_model_name)
        after = cluster.stats()
        traces = [t for r in result.records if r.ok
                  and (t := cluster.orchestrator.traces.get(r.request_id)) is not None]
        for r in result.records:
            got = backend.results.get(r.request_id)
            if got is not None:
                r.lifecycle = got.get("lifecycle")
                r.token_ids = got.get("token_ids")
        info = cluster.info[0] if cluster.info else {}
        params = {"model": cfg.model.name, "dtype": cfg.model.dtype,
                  "kv_dtype": after[0].get("kv_dtype") if after else cfg.model.kv_dtype,
                  "block_size": cfg.engine.block_size, "num_blocks": info.get("num_blocks"),
                  "prefill": w.prefill.count, "decode": w.decode.count,
                  "transport": cfg.transfer.transport, "policy": cfg.router.policy,
                  "num_gpus_per_worker": w.num_gpus,
                  "threads_per_worker": cfg.engine.threads_per_worker,
                  "trace": str(trace_path), "requests": len(items),
                  "arrivals": "timestamps" if opts.timestamps else
                  ("poisson" if opts.rate else "closed-loop"), "rate": opts.rate,
                  "concurrency": opts.concurrency, "block_tokens": args.block_tokens,
                  "max_output_tokens": args.max_output_tokens,
                  "routing_decisions": dict(cluster.orchestrator.decisions),
                  "kv_tier2_gb": cfg.engine.kv_tier2_gb,
                  "kv_gates": recorded_gates(cfg.model.name, GateThresholds(
                      cfg.model.kv_gate_max_ppl_delta_pct,
                      cfg.model.kv_gate_min_greedy_agreement))}
        report = build_report(result.records, params=params, wall_s=result.wall_s,
                              stats_before=before, stats_after=after,
                              slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                              concurrency=opts.concurrency, stats_source="in-process",
                              stage_breakdown=stage_breakdown(traces) if traces else None)
        if args.perfetto:
            write_chrome_trace(traces, args.perfetto)
        return report, result.records
    finally:
        if handle is not None:
            handle.stop()
        if cluster is not None:
            cluster.shutdown()
        if started_ray:
            import ray
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raypd")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":     # python -m cluster.run_job [run flags]
    sys.exit(main())
