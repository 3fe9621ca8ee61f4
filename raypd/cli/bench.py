"""`raypd bench ...`: every benchmark's flags and handler (the benchmarks themselves live in
raypd/bench/, imported only when their command runs). Each prints JSON and writes it with --json;
the keys are the benchmark's.

The benchmarks that build an engine or a cluster (engine, chaos, autoscale, disagg, transfer)
start from the config chain `raypd serve` reads (--config FILE, default configs/local.yaml's
values; their engine flags over it; --print-config prints it and exits), then set what their
measurement fixes (pool sizes, worker counts, policy, transport), as each bench's doc says."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raypd.cli.common import add_config_args, add_device_args, config_from_args, emit, print_config
from raypd.cli.simulate import add_bench_routing_parser
from workers.engine_config import DTYPES, KV_DTYPES, QUANTIZED_KV_DTYPES


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="paged engine vs transformers generate(), side by side")
    add_config_args(be)
    be.add_argument("--model", default=None,
                    help="model.name (default smollm2): smollm2, tiny, a local folder, or "
                    "random:llama3-8b (random weights of that shape; only the engine's own "
                    "figures)")
    be.add_argument("--quick", action="store_true")
    be.add_argument("--threads", type=int, default=None)
    be.add_argument("--dtype", default=None, choices=DTYPES,
                    help="model.dtype: the weights' (default auto)")
    be.add_argument("--repeats", type=int, default=3,
                    help="runs per figure (median; >= 1): step_overhead_ms too")
    be.add_argument("--lora", type=int, default=0, metavar="N",
                    help="also compare a batch spread over the base and N random LoRA adapters "
                    "with a base-only batch (lora_throughput_ratio)")
    be.add_argument("--lora-only", action="store_true", help="with --lora: only that figure")
    be.add_argument("--calibration", action="store_true",
                    help="only the engine's prefill tok/s vs length and decode step time vs "
                    "batch and context that `raypd simulate --gpu cpu-here --engine-json` fits "
                    "(no transformers baseline; ~5 min; measured in this process, while "
                    "`simulate --validate` measures it in a Ray task placed like the workers)")
    be.add_argument("--attention-only", action="store_true",
                    help="only raypd's prefill attention kernel against torch SDPA on one "
                    "layer of the model's heads at 512 and 2,048 tokens (--quick: 512), in the "
                    "model's dtype and float32: prefill_attention, prefill_attention_speedup")
    add_device_args(be)
    be.add_argument("--json", metavar="PATH")
    be.set_defaults(func=cmd_bench_engine)

    bt = bsub.add_parser("tp", help="tensor-parallel engines: all-reduce per backend, decode "
                         "step TP=2 vs TP=1, greedy equality, handoffs between TP sizes, a "
                         "rank killed (CPU, float32)")
    bt.add_argument("--quick", action="store_true",
                    help="fewer steps and a 512-token handoff prompt (default 2,048)")
    bt.add_argument("--repeats", type=int, default=3, help="runs per step figure (median)")
    bt.add_argument("--parts", default="",
                    help="comma-separated subset of: allreduce,steps,sizes,greedy,handoffs,"
                    "rank_kill (default all)")
    bt.add_argument("--json", metavar="PATH")
    bt.set_defaults(func=cmd_bench_tp)

    bc = bsub.add_parser("chaos", help="inject faults during a replay; count losses and leaks "
                         "(exit 1 unless: 0 lost, 0 leaked, 0 mismatches, every corrupt "
                         "transfer detected, >= 90%% ok)")
    bc.add_argument("--kills", type=int, default=5,
                    help="how many faults of each kind (kills included)")
    bc.add_argument("--faults", default="kill",
                    help="comma-separated: kill,corrupt,delay,drop_ack,abort")
    bc.add_argument("--deadline-s", type=float, default=120.0,
                    help="every request must have ended by this many seconds after it started")
    add_config_args(bc)
    bc.add_argument("--model", default="tiny", help="model.name (this bench's default: tiny)")
    bc.add_argument("--requests", type=int, default=100)
    bc.add_argument("--max-tokens", type=int, default=32)
    bc.add_argument("--transport", default="object_store",
                    help="KV transport (this bench's default: object_store, as recorded)")
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--json", metavar="PATH")
    bc.set_defaults(func=cmd_bench_chaos)

    ba = bsub.add_parser(
        "autoscale", help="live runs with the autoscaler on (quiet, burst, quiet) against every "
        "static P:D of every size from the smallest that serves the quiet phase up to the "
        "autoscaled peak, --repeats runs a side (exit 1 unless: 0 lost, 0 leaked, 0 "
        "mismatches, a scale-down that migrated, attainment within 5 points of the best "
        "static, fewer worker-seconds than the smallest static within 5 points of it). SLOs "
        "and rates are multiples of this machine's step times, measured first as the workers "
        "run: TTFT SLO = --slo-ttft-x x the idle TTFT of the longest prompt on 1P:1D, TPOT "
        "SLO = --slo-tpot-x x its idle TPOT, rates = --quiet-x / --burst-x x one worker "
        "pair's request capacity. ~20 min on 2 cores with the defaults")
    add_config_args(ba)
    from raypd.bench.autoscale_targets import Multiples
    m = Multiples()
    ba.add_argument("--model", default="tiny", help="model.name (this bench's default: tiny)")
    ba.add_argument("--slo-ttft-x", type=float, default=m.slo_ttft_x,
                    help="TTFT SLO in idle TTFTs (default %(default)s)")
    ba.add_argument("--slo-tpot-x", type=float, default=m.slo_tpot_x,
                    help="TPOT SLO in idle TPOTs (default %(default)s)")
    ba.add_argument("--burst-x", type=float, default=m.burst_x,
                    help="burst rate in measured request capacity (default %(default)s)")
    ba.add_argument("--quiet-x", type=float, default=m.quiet_x,
                    help="quiet rate in measured request capacity (default %(default)s)")
    ba.add_argument("--quiet-rps", type=float, default=None,
                    help="a fixed quiet rate instead of --quiet-x's (the JSON says so)")
    ba.add_argument("--burst-rps", type=float, default=None,
                    help="a fixed burst rate instead of --burst-x's (the JSON says so)")
    ba.add_argument("--quiet-s", type=float, default=6.0, help="the first quiet phase")
    ba.add_argument("--burst-s", type=float, default=12.0)
    ba.add_argument("--tail-s", type=float, default=14.0, help="the quiet phase after it")
    ba.add_argument("--max-tokens", type=int, default=256)
    ba.add_argument("--long-share", type=float, default=0.1,
                    help="share of requests that generate --long-tokens instead")
    ba.add_argument("--long-tokens", type=int, default=1024)
    ba.add_argument("--slo-ttft-s", type=float, default=None,
                    help="a fixed TTFT SLO instead of --slo-ttft-x's (the JSON says so)")
    ba.add_argument("--slo-tpot-s", type=float, default=None,
                    help="a fixed TPOT SLO instead of --slo-tpot-x's (the JSON says so)")
    ba.add_argument("--max-prefill", type=int, default=2)
    ba.add_argument("--max-decode", type=int, default=3)
    ba.add_argument("--repeats", type=int, default=2,
                    help="runs of each side (autoscaled, every static): medians and spreads "
                         "(default %(default)s)")
    ba.add_argument("--initial", default="1:2", metavar="P:D",
                    help="the autoscaled cluster's size at start (the deployment's config)")
    ba.add_argument("--seed", type=int, default=0)
    ba.add_argument("--json", metavar="PATH")
    ba.set_defaults(func=cmd_bench_autoscale)

    add_bench_routing_parser(bsub)
    add_bench_transfer_parser(bsub)
    add_bench_disagg_parser(bsub)
    add_bench_badinput_parser(bsub)
    add_bench_kv_quality_parser(bsub)
    add_bench_capacity_parser(bsub)


def _bench_config(args: argparse.Namespace, in_process: bool = False,
                  overrides: dict | None = None):
    """The config chain of a bench (--config, its engine flags and `overrides` over it); None
    after --print-config printed it (the command then exits 0)."""
    cfg = config_from_args(args, overrides, in_process=in_process)
    return None if print_config(cfg, args) else cfg


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """model, dtype, device and cuda_graphs come from the chain; the pools are the bench's.
    Options that would be ignored are refused."""
    if args.repeats < 1:
        raise SystemExit(f"bench engine: --repeats must be >= 1, got {args.repeats}")
    if args.lora_only and not args.lora:
        raise SystemExit("bench engine: --lora-only needs --lora N")
    if args.attention_only and (args.calibration or args.lora):
        raise SystemExit("bench engine: --attention-only takes neither --calibration nor --lora")
    cfg = _bench_config(args, in_process=True)
    if cfg is None:
        return 0
    from raypd.bench.engine import run_calibration, run_engine_bench
    from workers.random_model import is_random
    model, dtype, device = cfg.model.name, cfg.model.dtype, cfg.engine.device
    if args.attention_only and is_random(model):
        raise SystemExit("bench engine: --attention-only needs a model with weights, not "
                         f"{model!r}")
    if args.calibration:
        return emit(run_calibration(model=model, threads=args.threads, dtype=dtype,
                                     repeats=args.repeats, device=device,
                                     max_num_batched_tokens=cfg.engine.max_num_batched_tokens),
                    args)
    return emit(run_engine_bench(model=model, quick=args.quick, threads=args.threads,
                                  dtype=dtype, repeats=args.repeats, lora=args.lora,
                                  lora_only=args.lora_only, device=device,
                                  cuda_graphs=cfg.engine.cuda_graphs,
                                  attention_only=args.attention_only), args)


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    cfg = _bench_config(args)
    if cfg is None:
        return 0
    from raypd.bench.chaos import run_chaos_bench
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    result = run_chaos_bench(kills=args.kills, faults=faults, model=args.model,
                             requests=args.requests, max_tokens=args.max_tokens,
                             transport=args.transport, seed=args.seed,
                             deadline_s=args.deadline_s, engine=cfg.engine_config())
    emit(result, args)
    for why in result["failures"]:
        print(f"chaos: FAILED: {why}", file=sys.stderr)
    return 0 if result["passed"] else 1


def _sizes(text: str) -> tuple[int, int]:
    """"1:2" -> (1, 2): prefill and decode workers (P >= 0, D >= 1)."""
    try:
        p, d = (int(x) for x in text.split(":"))
        if p < 0 or d < 1:
            raise ValueError
        return p, d
    except ValueError:
        raise ValueError(f"--initial must be P:D with P >= 0 and D >= 1, got {text!r}") \
            from None


def cmd_bench_autoscale(args: argparse.Namespace) -> int:
    cfg = _bench_config(args)
    if cfg is None:
        return 0
    from raypd.bench.autoscale import run_autoscale_bench, summary_text
    from raypd.bench.autoscale_targets import Multiples
    initial = _sizes(args.initial)     # refused before anything starts
    result = run_autoscale_bench(engine=cfg.engine_config(),
        model=args.model, quiet_rps=args.quiet_rps, burst_rps=args.burst_rps,
        quiet_s=args.quiet_s, burst_s=args.burst_s, tail_s=args.tail_s,
        max_tokens=args.max_tokens, long_share=args.long_share, long_tokens=args.long_tokens,
        slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s,
        multiples=Multiples(args.slo_ttft_x, args.slo_tpot_x, args.burst_x, args.quiet_x),
        max_prefill=args.max_prefill, max_decode=args.max_decode,
        repeats=args.repeats, seed=args.seed, initial=initial)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(summary_text(result))
    return 0 if result["passed"] else 1


def cmd_bench_kv_quality(args: argparse.Namespace) -> int:
    """Measure, print (and --json) the gate figures; exit 1 when the format fails its gate."""
    if args.noise_floor_multiple < 1:
        raise ValueError(f"--noise-floor-multiple must be >= 1 (1: no worse than bf16 itself), "
                         f"got {args.noise_floor_multiple}")
    if args.max_ppl_delta_pct < 0 or args.text_tokens < 2:
        raise ValueError("--max-ppl-delta-pct must be >= 0 and --text-tokens >= 2")
    quick = args.quick
    from raypd.bench.kv_quality import run_kv_quality, summary_text
    from workers.kv_gate import GateThresholds
    result = run_kv_quality(
        model=args.model, kv_dtype=args.kv_dtype, dtype=args.dtype, texts=args.texts,
        text_tokens=256 if quick else args.text_tokens, chunk=64 if quick else 256,
        prompts=4 if quick else 32, prompt_tokens=32 if quick else 64,
        max_tokens=8 if quick else 64, threads=args.threads,
        thresholds=GateThresholds(max_ppl_delta_pct=args.max_ppl_delta_pct,
                                  noise_floor_multiple=args.noise_floor_multiple),
        record=not quick)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(summary_text(result), file=sys.stderr)      # the gate table, beside the JSON
    return 0 if result["gate_passed"] else 1


def add_bench_kv_quality_parser(bsub) -> None:
    from workers.kv_gate import MIN_FLOOR_TEXTS, POLICY_MULTIPLES, GateThresholds
    p = bsub.add_parser("kv-quality", help="quantized KV pool vs full precision, teacher-forced "
                        "(agreement, mean / p99 KL, perplexity) against the noise floor of a "
                        "bf16 pool over several texts; records the gate `raypd serve` enforces; "
                        "prints the gate table on stderr; exit 1: gate failed")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv-dtype", default="int8", choices=QUANTIZED_KV_DTYPES)
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the weights' dtype (the gate is recorded per weights dtype)")
    p.add_argument("--text-tokens", type=int, default=2048,
                   help="tokens of each text window scored teacher-forced (capped by the "
                   "context)")
    p.add_argument("--texts", type=int, default=MIN_FLOOR_TEXTS,
                   help=f"text windows the format and the noise floor are measured over (at "
                   f"least {MIN_FLOOR_TEXTS}; the gate reads the floor's upper confidence bound)")
    p.add_argument("--max-ppl-delta-pct", type=float, default=GateThresholds.max_ppl_delta_pct)
    p.add_argument("--noise-floor-multiple", type=float,
                   default=GateThresholds.noise_floor_multiple,
                   help="policy: the logit-error multiple of the bf16 noise floor's upper "
                   "bound a format may reach (KL limits: its square; verdicts at "
                   f"{', '.join(f'{m:g}x' for m in POLICY_MULTIPLES)} printed beside it; see "
                   "workers/kv_gate.py NOISE_FLOOR_MULTIPLE)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny settings (smoke test, not recorded)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_kv_quality)


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    quick = args.quick
    from raypd.bench.capacity import record_curves, render_html, run_capacity
    r = run_capacity(args.model, args.kv_dtype, args.budget_gb, args.block_size,
                     args.shared_frac,
                     contexts=[256, 512, 1024] if quick else None,
                     concurrencies=[1, 4, 16, 64] if quick else None,
                     tpot_contexts=[256] if quick else None, threads=args.threads)
    record_curves(r)       # run reports of this model draw them beside their growth
    text = json.dumps(r, indent=2)
    print(json.dumps(r["headline"], indent=2))
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.html:
        Path(args.html).write_text(render_html(r))
    return 0


def add_bench_capacity_parser(bsub) -> None:
    p = bsub.add_parser("capacity", help="KV growth vs context and concurrency: plain cache, "
                        "paged pool, paged + prefix sharing; max concurrency in a budget")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    p.add_argument("--budget-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--shared-frac", type=float, default=0.5,
                   help="fraction of each context that is the shared system prompt")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="few points (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--html", metavar="PATH")
    p.set_defaults(func=cmd_bench_capacity)


def add_bench_badinput_parser(bsub) -> None:
    from raypd.bench.badinput import CATALOGUE
    p = bsub.add_parser("badinput", help="run the bad-input catalogue against a server")
    p.add_argument("--url", required=True, help="the server's HTTP base URL")
    p.add_argument("--grpc", metavar="HOST:PORT", help="its gRPC ingress (else gRPC cases skip)")
    p.add_argument("--keys-file", metavar="FILE",
                   help="the server's API keys file (names admin, acme, globex, slow); without "
                        "it the key cases skip and requests carry no key")
    p.add_argument("--catalogue", default=str(CATALOGUE), metavar="FILE")
    p.add_argument("--slow-wait-s", type=float, default=15.0,
                   help="how long a stalling client waits (above server.limits timeouts)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_bench_badinput)


def cmd_bench_badinput(args: argparse.Namespace) -> int:
    from raypd.bench.badinput import Target, load_catalogue, read_keys, run_catalogue
    t = Target(args.url.rstrip("/"), args.grpc,
               read_keys(args.keys_file) if args.keys_file else {}, args.slow_wait_s)
    result = run_catalogue(t, load_catalogue(args.catalogue))
    text = json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["clean"] == result["cases"] else 1


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from raypd.bench.tp import run_bench_tp
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    known = {"allreduce", "steps", "sizes", "greedy", "handoffs", "rank_kill"}
    if set(parts) - known or args.repeats < 1:
        print(f"raypd bench tp: --parts takes {', '.join(sorted(known))}; --repeats >= 1",
              file=sys.stderr)
        return 2
    return emit(run_bench_tp(quick=args.quick, repeats=args.repeats, parts=parts), args)


def cmd_bench_disagg(args: argparse.Namespace) -> int:
    cfg = _bench_config(args)
    if cfg is None:
        return 0
    from raypd.bench.disagg import run_bench_disagg
    return emit(run_bench_disagg(quick=args.quick, model=args.model,
                                 engine=cfg.engine_config()), args)


def add_bench_disagg_parser(bsub) -> argparse.ArgumentParser:
    """Register `bench disagg` on the `bench` subparsers."""
    p = bsub.add_parser("disagg", help="mixed load: 1 prefill + 1 decode vs 2 colocated workers; "
                        "CPU-seconds per output token of each process, the serving process's "
                        "threads with 1 and 256 HTTP streams open, the detokenizer's cost per "
                        "token at the end of a 4,000-token output")
    add_config_args(p)
    p.add_argument("--model", default="smollm2", help="model.name (this bench's default: "
                   "smollm2)")
    p.add_argument("--quick", action="store_true", help="a shorter, lighter load (~3 min)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.set_defaults(func=cmd_bench_disagg)
    return p


def _transport_list(text: str) -> tuple[str, ...]:
    """"shm,grpc" -> ("shm", "grpc"): transports the CPU bandwidth part measures."""
    from raypd.bench.transport_bandwidth import ORDER
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in ORDER]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {bad or text!r}; choose from "
                                         f"{','.join(ORDER)}")
    return names


def _sizes_list(text: str) -> tuple[int, ...]:
    """"1,16" -> (1, 16): message sizes in MiB, each >= 1."""
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be integers >= 1 (MiB), got {text!r}")
    return sizes


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    """The CPU clusters' engine comes from the chain (--model: its model.name, default
    smollm2); --device cuda builds its own GPU cluster (see raypd/bench/transfer.py), so
    --device is this bench's choice, not engine.device."""
    cfg = _bench_config(args, overrides={"engine.device": None})
    if cfg is None:
        return 0
    from raypd.bench.transfer import run_bench_transfer, run_gpu_transfer_bench
    if args.device == "cuda":
        if args.transports or args.sizes_mib:
            raise SystemExit("raypd bench transfer: --transports and --sizes-mib are for the CPU "
                             "bench; --device cuda measures cuda_ipc at its own sizes")
        result = run_gpu_transfer_bench(model=args.model or "random:llama3-8b",
                                        ttft_prompt_tokens=args.ttft_prompt_tokens or 4096)
        emit(result, args)
        return 1 if "error" in result else 0
    return emit(run_bench_transfer(quick=args.quick, model=cfg.model.name,
                                    ttft_prompt_tokens=args.ttft_prompt_tokens or 2048,
                                    transports=args.transports, sizes_mib=args.sizes_mib,
                                    engine=cfg.engine_config()), args)


def add_bench_transfer_parser(bsub) -> argparse.ArgumentParser:
    """Register `bench transfer` on the `bench` subparsers."""
    p = bsub.add_parser("transfer", help="KV transport GB/s vs memcpy; transfer share of TTFT; "
                                         "bytes a decode-side prefix hit saves")
    add_config_args(p)
    p.add_argument("--model", default=None, help="model of the TTFT / delta clusters "
                   "(default smollm2; with --device cuda: random:llama3-8b)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: cuda_ipc between GPU actors vs a device copy_, TTFT share on a "
                   "GPU (see the module doc)")
    p.add_argument("--ttft-prompt-tokens", type=int, default=None,
                   help="prompt length of the TTFT share (default 2048; cuda: 4096)")
    p.add_argument("--quick", action="store_true",
                   help="sizes 1, 16, 64 MiB; TTFT on shm only")
    p.add_argument("--transports", default=None, type=_transport_list,
                   help="comma-separated transports of the bandwidth part (default: all)")
    p.add_argument("--sizes-mib", default=None, type=_sizes_list,
                   help="comma-separated sizes of the bandwidth part, MiB (overrides --quick's)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.set_defaults(func=cmd_bench_transfer)
    return p
