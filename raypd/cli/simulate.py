"""`raypd simulate TRACE ...` (one cluster simulation, or `--plan` over cluster sizes: JSON, a
text summary, an HTML page), `raypd route-sim` (the routing simulator on one trace) and the
flags of `raypd bench routing`."""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
import sys
from pathlib import Path

from raypd.cli.common import emit
from raypd.replay.mooncake import WorkloadError, load_trace
from raypd.sim.cost_model import (
    GPUS,
    LINKS,
    MODELS,
    TP_CHOICES,
    CostModel,
    cpu_cost_model,
    feasible_tps,
    gpu_cost_model,
    tp_refusal,
)
from raypd.sim.routing_sim import SimConfig, simulate
from router.policies import DEFAULT_POLICY, POLICIES, make_policy

GPU_CHOICES = (*GPUS, "cpu-here")
SIM_DEFAULTS = SimConfig()


def register(sub) -> None:
    add_simulate_parser(sub)
    add_route_sim_parser(sub)


def cost_model_of(args: argparse.Namespace, tp: int | None = None) -> CostModel:
    """The cost model the flags name; `tp`: both roles' TP size (default --prefill-tp and
    --decode-tp)."""
    p_tp, d_tp = (tp, tp) if tp is not None else (args.prefill_tp, args.decode_tp)
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
        if (p_tp, d_tp) != (1, 1):
            raise ValueError("--prefill-tp / --decode-tp: TP is modeled on the GPU rooflines "
                             "(--gpu h100 | h200), not cpu-here")
        return cpu_cost_model(engine)
    return gpu_cost_model(args.gpu, args.model or "llama3-8b", args.link, prefill_tp=p_tp,
                          decode_tp=d_tp)


def plan_tps(args: argparse.Namespace) -> tuple[int, ...]:
    """The TP sizes --plan searches: --tp-choices (default 1,2,4,8) that the model's heads and
    the GPU's memory allow (cost_model.tp_refusal); cpu-here: 1. None allowed: an error with
    each size's reason."""
    if args.tp_choices is None:
        wanted = TP_CHOICES
    else:
        try:
            wanted = tuple(sorted({int(x) for x in args.tp_choices.split(",")}))
            if not wanted or any(not 1 <= t <= 8 for t in wanted):
                raise ValueError
        except ValueError:
            raise ValueError(f"--tp-choices must be TP sizes between 1 and 8, got "
                             f"{args.tp_choices!r}") from None
    if args.gpu == "cpu-here":
        if wanted != (1,) and args.tp_choices is not None:
            raise ValueError("--tp-choices: TP is modeled on the GPU rooflines (--gpu h100 | "
                             "h200), not cpu-here")
        return (1,)
    model = args.model or "llama3-8b"
    ok = feasible_tps(args.gpu, model, wanted)
    if not ok:
        raise ValueError(f"no TP size of {', '.join(map(str, wanted))} fits {model} on "
                         f"{args.gpu}: " + "; ".join(f"tp {t}: {tp_refusal(args.gpu, model, t)}"
                                                     for t in wanted))
    return ok


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
    from raypd.sim import planner
    from raypd.sim.cluster_sim import ClusterConfig, simulate_cluster

    try:
        if args.plan:
            if (args.prefill_tp, args.decode_tp) != (1, 1):
                raise ValueError("--prefill-tp / --decode-tp: --plan searches each role's TP "
                                 "itself (--tp-choices)")
            tps = plan_tps(args)
            # the plan's stated cost model: its smallest TP (a 70B shape needs 2 on one GPU)
            cost = cost_model_of(args, tps[0])
        else:
            if args.tp_choices is not None:
                raise ValueError("--tp-choices is searched by --plan; one run takes "
                                 "--prefill-tp and --decode-tp")
            cost = cost_model_of(args)
        if args.plan_rps_per_gpu != args.defaults["plan_rps_per_gpu"] and not args.plan:
            raise ValueError("--plan-rps-per-gpu: only with --plan")
        _positive("--plan-rps-per-gpu", args.plan_rps_per_gpu)
        if args.colocated_budgets is not None and not args.plan:
            raise ValueError("--colocated-budgets is swept by --plan; one run takes "
                             "--colocated --token-budget N")
        if args.token_budget is not None and not args.colocated:
            raise ValueError("--token-budget is a colocated GPU's step budget: add --colocated "
                             "(--plan sweeps --colocated-budgets)")
        if args.max_tokens < 1 or args.max_decode_batch < 1:
            raise ValueError("--max-tokens and --max-decode-batch must be >= 1")
        given = [d for d in AUTOSCALE_ONLY if getattr(args, d) != args.defaults[d]]
        if given and not args.autoscale:
            raise ValueError(f"{', '.join(_flags(given))}: only with --autoscale")
        given = [d for d in VALIDATE_ONLY if getattr(args, d) != args.defaults[d]]
        if given and not args.validate:
            raise ValueError(f"{', '.join(_flags(given))}: only with --validate")
        if args.slo_ttft is None:   # --validate's own (per load) only when not given
            args.slo_ttft = ClusterConfig.slo_ttft_s if not args.validate else None
        if args.slo_tpot is None:
            args.slo_tpot = ClusterConfig.slo_tpot_s if not args.validate else None
        if args.autoscale:
            given = [d for d, v in args.defaults.items()
                     if d not in AUTOSCALE_OPTIONS and getattr(args, d) != v]
            if given:
                raise ValueError(f"{', '.join(_flags(given))}: not used by --autoscale (it "
                                 "sizes the pools itself, up to --gpus, against the static "
                                 "P:D splits of that size)")
            if args.trace is None:
                raise ValueError("a TRACE is needed")
            return _autoscale(args, cost)
        if args.validate:
            given = [d for d, v in args.not_for_validate.items() if getattr(args, d) != v]
            if given:
                names = ["TRACE" if d == "trace" else "--" + d.replace("_", "-") for d in given]
                raise ValueError(f"{', '.join(names)}: not used by --validate (it replays its "
                                 "own requests on 1P+1D; it takes --engine-json, --slo-ttft, "
                                 "--slo-tpot, --json)")
            if args.gpu != "cpu-here":
                raise ValueError("--validate compares with a real cluster here: use "
                                 "--gpu cpu-here (--engine-json optional)")
            from raypd.bench.sim_validation import validate
            # without --engine-json the calibration is measured here first, right before the
            # replay (raypd/bench/sim_validation.py)
            replay = {}
            if args.replay_seed is not None:
                replay["replay_seed"] = args.replay_seed
            if args.replay_lens is not None:
                replay["replay_lens"] = _lengths(args.replay_lens)
            # the judged load's SLOs when given; else each load's from its own real p50
            slos = {f"slo_{k}_s": getattr(args, f"slo_{k}") for k in ("ttft", "tpot")
                    if getattr(args, f"slo_{k}") is not None}
            result = validate(cost if args.engine_json is not None else None, **slos,
                              **replay)
            print(json.dumps(result, indent=2, default=str))
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
            # the development seed's verdict is reported apart (passed_in_sample)
            return 0 if result["passed"] or result.get("passed_in_sample") else 1
        if args.trace is None:
            raise ValueError("a TRACE is needed (except with --validate)")
        trace = load_trace(args.trace, limit=args.limit)
        if not trace:
            raise ValueError(f"{args.trace}: the trace is empty")
        if args.plan:
            if args.colocated or args.token_budget is not None:
                raise ValueError("--plan sweeps colocation itself: use --colocated-budgets, "
                                 "not --colocated / --token-budget")
            budgets = planner.COLOCATED_BUDGETS if args.colocated_budgets is None else \
                planner.parse_budgets(args.colocated_budgets)
            tp_cost = None if tps == (1,) else (
                lambda p_tp, d_tp: gpu_cost_model(args.gpu, args.model or "llama3-8b", args.link,
                                                  prefill_tp=p_tp, decode_tp=d_tp))
            plan = planner.run_plan(trace, cost, planner.parse_gpus(args.gpus), args.slo_ttft,
                                    args.slo_tpot, requests_per_16=args.plan_requests,
                                    budgets=budgets, max_tokens=args.max_tokens,
                                    max_decode_batch=args.max_decode_batch, tp_cost=tp_cost,
                                    tp_choices=tps, base_rps_per_gpu=args.plan_rps_per_gpu)
            text = planner.plan_text(plan)
            print(text)
            result, rows = plan, [
                {"gpus": g, "config": k, **{x: v for x, v in r.items()
                                            if isinstance(v, int | float | str | bool)}}
                for g, s in plan["sizes"].items() for k, r in s["configs"].items()]
            title = "raypd simulate --plan"
        else:
            cfg = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode,
                                colocated=args.colocated, policy=args.policy,
                                slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                max_tokens=args.max_tokens,
                                max_decode_batch=args.max_decode_batch,
                                colocated_budget=args.token_budget or 2048)
            if args.colocated and args.prefill_tp != args.decode_tp:
                raise ValueError("--colocated: one engine prefills and decodes, at one TP "
                                 "size: --prefill-tp and --decode-tp must be equal")
            result = simulate_cluster(trace, cost, cfg, args.rate_scale)
            gpus = args.prefill * args.prefill_tp + (0 if args.colocated else
                                                     args.decode * args.decode_tp)
            result.update(num_gpus=gpus, goodput_rps_per_gpu=result["goodput_rps"] / gpus,
                          prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
            result["label"] = f"simulated ({cost.label})"
            result["trace"] = str(args.trace)
            print(json.dumps({k: v for k, v in result.items() if k != "cost_model"},
                             indent=2, default=str))
            rows = [{k: v for k, v in result.items() if isinstance(v, int | float | str)}]
            title = f"raypd simulate {args.trace}"
    except (WorkloadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cost.notes.get("source", "").startswith("no bench engine"):
        print("note: cpu-here without --engine-json uses stated defaults "
              "(raypd/sim/cost_model.py CPU_DEFAULTS)", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(_html(title, rows, {"cost_model": cost.to_dict(),
                                                 "label": result.get("label")}))
    return 0


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    from raypd.sim.cluster_sim import ClusterConfig
    p = subparsers.add_parser(
        "simulate", help="cluster simulator: P/D pools, transfer, SLO goodput; --plan sweeps",
        description="Simulate a prefill/decode cluster on a Mooncake-format trace with the "
                    "production policies, prefix index and block pools (raypd/sim/cluster_sim.py)")
    p.add_argument("trace", type=Path, nargs="?", default=None,
                   help="Mooncake-format JSONL trace (not needed with --validate)")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers (each --prefill-tp GPUs)")
    p.add_argument("--decode", type=int, default=1,
                   help="decode workers (each --decode-tp GPUs)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="GPU rooflines: tensor-parallel GPUs of each prefill worker (default "
                        "%(default)s; --plan searches it)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N",
                   help="GPU rooflines: tensor-parallel GPUs of each decode worker (default "
                        "%(default)s; --plan searches it)")
    p.add_argument("--colocated", action="store_true",
                   help="--prefill GPUs that each prefill and decode (no transfer): chunked "
                        "prefill with decode mixed into each step")
    p.add_argument("--token-budget", type=int, default=None,
                   help="--colocated: tokens one step holds, decode tokens first, prefill "
                        "chunks in the rest (default 2048)")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="max_tokens every simulated client sends: decode KV is reserved for "
                        "prompt + this; a longer trace output stops here (default %(default)s)")
    p.add_argument("--max-decode-batch", type=int, default=256,
                   help="sequences one decode step holds at most (default %(default)s)")
    p.add_argument("--gpu", choices=GPU_CHOICES, default="h100",
                   help="cost model: GPU roofline, or cpu-here (from --engine-json)")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="model shape for the GPU roofline (default llama3-8b)")
    p.add_argument("--link", choices=sorted(LINKS), default="400g",
                   help="P -> D link for the GPU roofline (default %(default)s)")
    p.add_argument("--engine-json", type=Path, default=None,
                   help="`raypd bench engine --json` output measured here (cpu-here)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="locality")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help=f"TTFT SLO, s (default {ClusterConfig.slo_ttft_s}; --validate: each "
                        "load's from its own real p50 unless given)")
    p.add_argument("--slo-tpot", type=float, default=None,
                   help=f"TPOT SLO, s (default {ClusterConfig.slo_tpot_s}; --validate: as "
                        "--slo-ttft)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the trace's request rate (default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--plan", action="store_true",
                   help="sweep P:D ratios and policies per cluster size (--gpus)")
    p.add_argument("--gpus", default="16..256", help="plan sizes: LOW..HIGH (doublings) or "
                                                     "a list (default %(default)s)")
    p.add_argument("--plan-requests", type=int, default=800,
                   help="requests per 16 GPUs in the plan's replay (default %(default)s)")
    p.add_argument("--plan-rps-per-gpu", type=float, default=0.5,
                   help="--plan: the base request rate per GPU its probes scale (x0.35 to x8, "
                        "then up to x128; a configuration failing at the first has goodput 0): "
                        "lower it for a large model (default %(default)s)")
    p.add_argument("--tp-choices", default=None, metavar="T1,T2",
                   help="--plan: TP sizes each role may take (default 1,2,4,8; those the "
                        "model's heads and the GPU's memory allow)")
    p.add_argument("--colocated-budgets", default=None, metavar="B1,B2",
                   help="--plan: colocated token budgets swept (default 512,1024,2048,4096,"
                        "8192); the DistServe check takes the best")
    p.add_argument("--validate", action="store_true",
                   help="a short replay on a real 1P+1D cluster here against the simulator "
                        "(cpu-here, calibrated here first unless --engine-json is given): "
                        "sim_vs_real_error")
    p.add_argument("--replay-seed", type=int, default=None,
                   help="--validate: the replay's seed (default: a fresh one each run, "
                        "`replay_seed` in the JSON; 7, the simulator's development replay, "
                        "is reported in sample, as passed_in_sample)")
    p.add_argument("--replay-lens", default=None, metavar="N1,N2,...",
                   help="--validate: the replay's prompt lengths (default 200,450,900); none "
                        "the calibration or the probe measures (128, 512, 1024, 2048)")
    p.add_argument("--autoscale", action="store_true",
                   help="the autoscaler (router/autoscale_decision.py) sizing P and D during the replay, "
                        "up to --gpus in all, against every static P:D split of every size from "
                        "1P:1D up to the autoscaled peak on the same requests (the trace "
                        "scaled to the size as --plan does): worker-seconds and SLO attainment "
                        "of the autoscaled run, the smallest static within 5 points of it "
                        "and the best static (medians of --repeats)")
    p.add_argument("--startup-s", type=float, default=30.0,
                   help="--autoscale: seconds from a scale-up decision until the worker serves "
                        "(default %(default)s: a GPU worker's launch and weight load)")
    p.add_argument("--interval-s", type=float, default=5.0,
                   help="--autoscale: evaluation interval (default %(default)s)")
    p.add_argument("--cooldown-s", type=float, default=30.0,
                   help="--autoscale: no scale-down of a role within this of its last change "
                        "(default %(default)s)")
    p.add_argument("--up-cooldown-s", type=float, default=10.0,
                   help="--autoscale: no scale-up of a role within this of its last change "
                        "(default %(default)s)")
    p.add_argument("--initial", default=None, metavar="P:D",
                   help="--autoscale: pool sizes at the start (default 1:1, the minimum)")
    p.add_argument("--repeats", type=int, default=2,
                   help="--autoscale: runs of each side (autoscaled and every static), each "
                        "on its own arrival timeline of the trace; medians and spreads "
                        "(default %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--html", type=Path, default=None, metavar="PATH")
    # what --validate / --autoscale do not use: given with it, refused (never accepted and
    # ignored)
    defaults = {a.dest: a.default for a in p._actions if a.dest != "help"}
    p.set_defaults(func=cmd_simulate, defaults=defaults, not_for_validate={
        d: v for d, v in defaults.items() if d not in VALIDATE_OPTIONS})
    return p


VALIDATE_ONLY = ("replay_seed", "replay_lens")
VALIDATE_OPTIONS = ("help", "validate", "gpu", "engine_json", "slo_ttft", "slo_tpot", "json",
                    *VALIDATE_ONLY)
AUTOSCALE_ONLY = ("startup_s", "interval_s", "cooldown_s", "up_cooldown_s", "initial",
                  "repeats")
AUTOSCALE_OPTIONS = (*AUTOSCALE_ONLY, "autoscale", "trace", "gpu", "model", "link",
                     "engine_json", "policy", "slo_ttft", "slo_tpot", "rate_scale", "gpus",
                     "plan_requests", "max_tokens", "max_decode_batch", "json")


def _lengths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--replay-lens {text!r}: comma-separated token counts") from None
    return out


def _flags(dests) -> list[str]:
    return ["TRACE" if d == "trace" else "--" + d.replace("_", "-") for d in dests]


def _autoscale(args: argparse.Namespace, cost: CostModel) -> int:
    """`simulate --autoscale`: per size in --gpus, the autoscaled replay against the static
    P:D splits; a table on stdout, everything in --json."""
    from raypd.sim.autoscale_sim import compare, compare_text
    from raypd.sim.cluster_sim import ClusterConfig
    from raypd.sim.planner import parse_gpus
    from router.autoscale_decision import AutoscaleConfig
    initial = None
    if args.initial is not None:
        try:
            p0, d0 = (int(x) for x in args.initial.split(":"))
            if p0 < 1 or d0 < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"--initial must be P:D with both >= 1, got {args.initial!r}") \
                from None
        initial = (p0, d0)
    if args.startup_s < 0:
        raise ValueError(f"--startup-s must be >= 0, got {args.startup_s}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    _positive("--rate-scale", args.rate_scale)
    trace = load_trace(args.trace)
    if not trace:
        raise ValueError(f"{args.trace}: the trace is empty")
    results = []
    for g in parse_gpus(args.gpus):
        cfg = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=g - 1, min_decode=1,
                              max_decode=g - 1, max_total=g, ttft_s=args.slo_ttft,
                              tpot_s=args.slo_tpot, interval_s=args.interval_s,
                              cooldown_s=args.cooldown_s, up_cooldown_s=args.up_cooldown_s)
        cfg.validate()
        if initial and sum(initial) > g:
            raise ValueError(f"--initial {args.initial}: more than --gpus {g}")
        cluster = ClusterConfig(policy=args.policy, slo_ttft_s=args.slo_ttft,
                                slo_tpot_s=args.slo_tpot, max_tokens=args.max_tokens,
                                max_decode_batch=args.max_decode_batch)
        results.append(compare(trace, cost, g, cfg, cluster, args.plan_requests,
                               args.rate_scale, args.startup_s, initial, args.repeats))
    header = (f"raypd simulate --autoscale  simulated ({cost.label}), trace "
              f"{args.trace.name} (head {args.plan_requests} requests per 16 GPUs, replicated "
              f"as --plan does), rate x{args.rate_scale:g}; SLO TTFT <= {args.slo_ttft:g} s, "
              f"TPOT <= {args.slo_tpot:g} s; start-up {args.startup_s:g} s, interval "
              f"{args.interval_s:g} s, cooldown {args.cooldown_s:g} s (up "
              f"{args.up_cooldown_s:g} s), initial {args.initial or '1:1'}; against every "
              f"static P:D from 1P:1D up to the autoscaled peak, {args.repeats} runs a side")
    print(compare_text(results, header))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"label": f"simulated ({cost.label})",
                                         "cost_model": cost.to_dict(), "sizes": results},
                                        indent=2, default=str) + "\n")
    return 0




def _add_sim_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity-blocks", type=int, default=SIM_DEFAULTS.capacity_blocks,
                   help="prefix-cache blocks per prefill worker (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=SIM_DEFAULTS.block_tokens,
                   help="tokens a trace block stands for; input lengths scale with it "
                        "(default %(default)s)")
    _add_cost_options(p)


def _add_cost_options(p: argparse.ArgumentParser) -> None:
    """The hidden cost model's options (and --json)."""
    p.add_argument("--prefill-tok-s", type=float, default=SIM_DEFAULTS.prefill_tok_s,
                   help="prefill rate of a worker at zero context, tokens/s (default %(default)s)")
    p.add_argument("--overhead-s", type=float, default=SIM_DEFAULTS.overhead_s,
                   help="fixed seconds per prefill request (default %(default)s)")
    p.add_argument("--attn-ctx-tokens", type=float, default=SIM_DEFAULTS.attn_ctx_tokens,
                   help="context at which attention doubles a token's cost; 0: linear "
                        "(default %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the result here")


def _sim_config(args: argparse.Namespace, num_workers: int = 8) -> SimConfig:
    return SimConfig(num_workers=num_workers, capacity_blocks=args.capacity_blocks,
                     block_tokens=args.block_tokens, prefill_tok_s=args.prefill_tok_s,
                     overhead_s=args.overhead_s, attn_ctx_tokens=args.attn_ctx_tokens,
                     index_mode=getattr(args, "index", SIM_DEFAULTS.index_mode),
                     approx_ttl_s=getattr(args, "approx_ttl_s", SIM_DEFAULTS.approx_ttl_s))


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
    except (WorkloadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["trace"] = str(args.trace)
    emit(result, args)
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    """Handler of `bench routing`: the full benchmark (or --quick), printed as JSON."""
    from raypd.bench.routing import BENCH_CONFIG, run_routing_bench  # numpy-heavy; only when asked

    try:
        _positive("--prefill-tok-s", args.prefill_tok_s)
        cfg = dataclasses.replace(BENCH_CONFIG, prefill_tok_s=args.prefill_tok_s,
                                  overhead_s=args.overhead_s,
                                  attn_ctx_tokens=args.attn_ctx_tokens)
        only = tuple(args.workloads.split(",")) if args.workloads else None
        result = run_routing_bench(args.trace, quick=args.quick, config=cfg, only=only,
                                   seed=args.seed)
    except (WorkloadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(result, args)
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
    p.add_argument("--index", choices=("precise", "approx"), default=SIM_DEFAULTS.index_mode,
                   help="prefix index fed by KV events, or predicted from routing with a TTL")
    p.add_argument("--approx-ttl-s", type=float, default=SIM_DEFAULTS.approx_ttl_s,
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
                   help="only these workloads (default: all of raypd/sim/workloads.py; "
                        "block size and cache capacity are each workload's own)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw the in-sample table's synthesized workloads with this seed "
                        "(default: each workload's own; the shared trace is unchanged; the "
                        "scores always use the unseen seeds)")
    _add_cost_options(p)     # block size and cache capacity are each workload's own
    p.set_defaults(func=cmd_bench_routing)
    return p
