"""`raypd submit` (replay a workload through a server and report), `raypd trace synth` (make a
workload) and `raypd trace-request` (one request's handoff timeline from a server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from raypd.replay.mooncake import WorkloadError
from raypd.replay.submit import DEFAULT_CONCURRENCY, DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S
from raypd.replay.trace_views import API_KEY_ENV
from raypd.replay.workload import DEFAULT_VOCAB_SIZE, SynthConfig, synth_trace


def register(sub) -> None:
    add_submit_parser(sub)
    add_trace_parser(sub)
    add_trace_request_parser(sub)


def add_replay_options(p: argparse.ArgumentParser, timestamps_default: bool = False) -> None:
    """Options shared by `raypd submit` and `raypd run` (whose default pacing is the trace's
    timestamps: `--closed-loop` turns that off)."""
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, default=None,
                      help="Poisson arrivals at R requests/s (default: "
                           + ("the trace's timestamps)" if timestamps_default else
                              "as fast as --concurrency allows)"))
    if timestamps_default:
        pace.add_argument("--closed-loop", dest="timestamps", action="store_false",
                          help="ignore the trace's timestamps: as fast as --concurrency allows")
        p.set_defaults(timestamps=True)
    else:
        pace.add_argument("--timestamps", action="store_true",
                          help="send each request at the trace's own timestamp")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="replay only the first N requests")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="C",
                   help="at most C requests in flight (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=16, metavar="N",
                   help="Mooncake traces: tokens each 512-token hash block expands to "
                        "(default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="Mooncake traces: expanded token ids are < this (default "
                        "%(default)s, SmolLM2)")
    p.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                   help="cap every request's output length at N tokens (default: the trace's)")
    p.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO_TTFT_S, metavar="S",
                   help="TTFT SLO for goodput, seconds (default %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO_TPOT_S, metavar="S",
                   help="TPOT SLO for goodput, seconds (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of --rate arrivals")
    p.add_argument("--perfetto", type=Path, default=None, metavar="PATH",
                   help="also write the replayed requests' handoff traces as Chrome trace / "
                        "Perfetto JSON (one track per actor)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_submit_parser(subparsers) -> argparse.ArgumentParser:
    """`raypd submit TRACE --url URL ... --out report.json`."""
    p = subparsers.add_parser("submit", help="replay a trace through a raypd server and "
                                             "report latency, goodput and KV figures")
    p.add_argument("trace", type=Path,
                   help="Mooncake JSONL (hash_ids), raypd JSONL (prompt or messages), or "
                        "`raypd trace synth` output")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    add_replay_options(p)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None, help="bearer token, when the server wants one")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--out", required=True, type=Path, help="report JSON")
    p.add_argument("--html", type=Path, default=None, help="also a self-contained HTML report")
    p.add_argument("--outputs", type=Path, default=None,
                   help="JSONL: one line per request with its id, token ids, text, lifecycle")
    p.set_defaults(func=cmd_submit)
    return p


def load_items(args: argparse.Namespace) -> list:
    from raypd.replay.workload import load_workload
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    return load_workload(args.trace, limit=args.limit, block_tokens=args.block_tokens,
                         vocab_size=args.vocab_size, max_output_tokens=args.max_output_tokens)


def cmd_submit(args: argparse.Namespace) -> int:
    from raypd.bench.capacity import recorded_curves
    from raypd.replay.report import build_report, print_summary
    from raypd.replay.submit import (
        SubmitOptions,
        replay,
        request_traces,
        server_kv_timeline,
        server_model,
        server_stats,
        write_reports,
    )
    from raypd.replay.trace_views import write_chrome_trace
    from router.request_traces import stage_breakdown
    try:
        items = load_items(args)
        opts = SubmitOptions(args.url, rate=args.rate, timestamps=args.timestamps,
                             concurrency=args.concurrency, model=args.model,
                             timeout_s=args.timeout, seed=args.seed, api_key=args.api_key,
                             progress=not args.no_progress)
        opts.validate()
        model = opts.model or server_model(opts.url, opts.api_key)
    except (WorkloadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    before = server_stats(opts.url, opts.api_key)
    result = replay(items, opts, model)
    after = server_stats(opts.url, opts.api_key)
    timeline = server_kv_timeline(opts.url, result.started_at, opts.api_key)
    traces = request_traces(opts.url, result.records, opts.api_key)
    params = {"model": model, "url": opts.url, "trace": str(args.trace),
              "requests": len(items), "rate": opts.rate,
              "arrivals": "timestamps" if opts.timestamps else
              ("poisson" if opts.rate else "closed-loop"),
              "concurrency": opts.concurrency, "block_tokens": args.block_tokens,
              "max_output_tokens": args.max_output_tokens,
              **((after or {}).get("config") or {})}
    report = build_report(result.records, params=params, wall_s=result.wall_s,
                          stats_before=(before or {}).get("workers"),
                          stats_after=(after or {}).get("workers"),
                          slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                          concurrency=opts.concurrency,
                          stats_source=(after or {}).get("source"),
                          stage_breakdown=stage_breakdown(traces) if traces else None,
                          kv_timeline=timeline,
                          capacity_curves=recorded_curves(model, params.get("kv_dtype")))
    write_reports(report, result.records, args.out, args.html, args.outputs)
    if args.perfetto:
        write_chrome_trace(traces, args.perfetto)
    print_summary(report, files=[f for f in (args.out, args.html, args.outputs, args.perfetto)
                                 if f])
    return 0


def _int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW,HIGH, got {text!r}") from None


def cmd_trace_synth(args: argparse.Namespace) -> int:
    from raypd.replay.workload import write_jsonl
    try:
        rows = synth_trace(SynthConfig(requests=args.requests,
                                       system_prompts=args.system_prompts, turns=args.turns,
                                       rate=args.rate, seed=args.seed,
                                       max_tokens=args.max_tokens, tenant=args.tenant))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} requests to {args.out}", file=sys.stderr)
    return 0


def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    """`raypd trace synth --out FILE [...]`."""
    trace = subparsers.add_parser("trace", help="make workload traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    d = SynthConfig()
    p = tsub.add_parser("synth", help="synthetic raypd JSONL: shared system prompts, "
                                      "multi-turn sessions, Poisson arrivals")
    p.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--system-prompts", type=int, default=d.system_prompts,
                   help="distinct shared system prompts (default %(default)s)")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per session")
    p.add_argument("--rate", type=float, default=d.rate, help="arrivals per second")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-tokens", type=_int_range, default=d.max_tokens, metavar="LOW,HIGH",
                   help="output tokens per request (default %(default)s)")
    p.add_argument("--tenant", default="")
    p.set_defaults(func=cmd_trace_synth)
    return trace


def add_trace_request_parser(subparsers) -> argparse.ArgumentParser:
    from raypd.replay import trace_views
    p = subparsers.add_parser("trace-request", help="print one request's handoff timeline",
                              description=trace_views.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("request_id", help="the id of a completion (its `id` / X-Request-Id)")
    p.add_argument("--url", default=os.environ.get("RAYPD_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--json", action="store_true", help="print the trace as JSON")
    p.add_argument("--perfetto", type=Path, default=None, metavar="PATH",
                   help="also write it as Chrome trace / Perfetto JSON")
    p.set_defaults(func=cmd_trace_request)
    return p


def cmd_trace_request(args: argparse.Namespace) -> int:
    from raypd.replay.trace_views import (
        TraceNotFound,
        fetch_trace,
        timeline_lines,
        write_chrome_trace,
    )
    try:
        t = fetch_trace(args.url, args.request_id, args.api_key)
    except (TraceNotFound, PermissionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(t.to_dict(), indent=2))
    else:
        print("\n".join(timeline_lines(t)))
    if args.perfetto:
        print(f"wrote {write_chrome_trace([t], args.perfetto)}", file=sys.stderr)
    return 0

