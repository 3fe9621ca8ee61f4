"""`raypd simulate TRACE ...`: one cluster simulation, or `--plan` over cluster sizes (JSON,
a text summary, an HTML page)."""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

from router.cost_model import GPUS, LINKS, MODELS, CostModel, cpu_cost_model, gpu_cost_model
from router.policies import POLICIES
from router.trace import TraceError, load_trace

GPU_CHOICES = (*GPUS, "cpu-here")


def cost_model_of(args: argparse.Namespace) -> CostModel:
    if args.gpu == "cpu-here":
        engine = None
        if args.engine_json is not None:
            try:
                engine = json.loads(Path(args.engine_json).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--engine-json {args.engine_json}: {e}") from None
            missing = [k for k in ("prefill_tok_s", "decode_step_ms_b1", "decode_step_ms_b16")
                       if k not in engine]
            if missing:
                raise ValueError(f"--engine-json {args.engine_json}: no {missing[0]!r} (a "
                                 "`raypd bench engine --json` file is needed)")
        return cpu_cost_model(engine)
    return gpu_cost_model(args.gpu, args.model or "llama3-8b", args.link)


def _html(title: str, rows: list[dict], notes: dict) -> str:
    keys = list(rows[0]) if rows else []
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(
        f"<td>{html.escape(f'{r[k]:.4g}' if isinstance(r[k], float) else str(r[k]))}</td>"
        for k in keys) + "</tr>" for r in rows)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            "</title><style>body{font-family:sans-serif}td,th{border:1px solid #ccc;"
            "padding:2px 6px}table{border-collapse:collapse}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table>"
            f"<pre>{html.escape(json.dumps(notes, indent=1, default=str))}</pre></body></html>")


def cmd_simulate(args: argparse.Namespace) -> int:
    from router.cluster_sim import ClusterConfig, simulate_cluster
    from router.plan import parse_gpus, plan_text, run_plan

    try:
        cost = cost_model_of(args)
        if args.validate:
            if args.gpu != "cpu-here":
                raise ValueError("--validate compares with a real cluster here: use "
                                 "--gpu cpu-here (--engine-json optional)")
            from router.validate import validate
            # without --engine-json the calibration is measured here first, right before the
            # replay (router/validate.py)
            result = validate(cost if args.engine_json is not None else None)
            print(json.dumps(result, indent=2, default=str))
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
            return 0
        if args.trace is None:
            raise ValueError("a TRACE is needed (except with --validate)")
        trace = load_trace(args.trace, limit=args.limit)
        if not trace:
            raise ValueError(f"{args.trace}: the trace is empty")
        if args.plan:
            plan = run_plan(trace, cost, parse_gpus(args.gpus), args.slo_ttft, args.slo_tpot,
                            requests_per_16=args.plan_requests)
            text = plan_text(plan)
            print(text)
            result, rows = plan, [
                {"gpus": g, "config": k, **{x: v for x, v in r.items()
                                            if isinstance(v, int | float | str | bool)}}
                for g, s in plan["sizes"].items() for k, r in s["configs"].items()]
            title = "raypd simulate --plan"
        else:
            cfg = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode,
                                colocated=args.colocated, policy=args.policy,
                                slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
            result = simulate_cluster(trace, cost, cfg, args.rate_scale)
            result["label"] = f"simulated ({cost.label})"
            result["trace"] = str(args.trace)
            print(json.dumps({k: v for k, v in result.items() if k != "cost_model"},
                             indent=2, default=str))
            rows = [{k: v for k, v in result.items() if isinstance(v, int | float | str)}]
            title = f"raypd simulate {args.trace}"
    except (TraceError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cost.notes.get("source", "").startswith("no bench engine"):
        print("note: cpu-here without --engine-json uses stated defaults "
              "(router/cost_model.py CPU_DEFAULTS)", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(_html(title, rows, {"cost_model": cost.to_dict(),
                                                 "label": result.get("label")}))
    return 0


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="cluster simulator: P/D pools, transfer, SLO goodput; --plan sweeps",
        description="Simulate a prefill/decode cluster on a Mooncake-format trace with the "
                    "production policies, prefix index and block pools (router/cluster_sim.py)")
    p.add_argument("trace", type=Path, nargs="?", default=None,
                   help="Mooncake-format JSONL trace (not needed with --validate)")
    p.add_argument("--prefill", type=int, default=1, help="prefill GPUs/workers")
    p.add_argument("--decode", type=int, default=1, help="decode GPUs/workers")
    p.add_argument("--colocated", action="store_true",
                   help="--prefill GPUs that each prefill and decode (no transfer)")
    p.add_argument("--gpu", choices=GPU_CHOICES, default="h100",
                   help="cost model: GPU roofline, or cpu-here (from --engine-json)")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="model shape for the GPU roofline (default llama3-8b)")
    p.add_argument("--link", choices=sorted(LINKS), default="400g",
                   help="P -> D link for the GPU roofline (default %(default)s)")
    p.add_argument("--engine-json", type=Path, default=None,
                   help="`raypd bench engine --json` output measured here (cpu-here)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="locality")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, s")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO, s")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the trace's request rate (default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--plan", action="store_true",
                   help="sweep P:D ratios and policies per cluster size (--gpus)")
    p.add_argument("--gpus", default="16..256", help="plan sizes: LOW..HIGH (doublings) or "
                                                     "a list (default %(default)s)")
    p.add_argument("--plan-requests", type=int, default=800,
                   help="requests per 16 GPUs in the plan's replay (default %(default)s)")
    p.add_argument("--validate", action="store_true",
                   help="a short replay on a real 1P+1D cluster here against the simulator "
                        "(cpu-here, calibrated here first unless --engine-json is given): "
                        "sim_vs_real_error")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--html", type=Path, default=None, metavar="PATH")
    p.set_defaults(func=cmd_simulate)
    return p
