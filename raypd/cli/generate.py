"""`raypd generate`: one prompt through one engine in this process, or with --disagg through N
prefill + M decode worker actors on a local Ray. The engine (and with --disagg the cluster) is
the config chain `raypd serve` reads: --config FILE (default: configs/local.yaml's values), the
flags given over it; --print-config prints it and exits. --tp N runs the engine on N
tensor-parallel ranks (workers.decode.tp: it is a colocated decode worker's engine); with
--disagg, --prefill-tp / --decode-tp set each role's (workers.prefill.tp / workers.decode.tp)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from raypd.cli.common import (
    add_engine_args,
    config_from_args,
    engine_config_from_args,
    print_config,
)


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", help="the prompt (required unless --print-config)")
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
    gen.add_argument("--prefill", type=int, metavar="N",
                     help="workers.prefill.count (--disagg; default 1)")
    gen.add_argument("--decode", type=int, metavar="M",
                     help="workers.decode.count (--disagg; default 1)")
    gen.add_argument("--transport", help="transfer.transport: KV transport (--disagg; "
                     "default shm)")
    gen.add_argument("--tp", type=int, metavar="N",
                     help="workers.decode.tp: tensor-parallel ranks of the engine in this "
                     "process, a colocated decode worker's (not with --disagg; default 1)")
    gen.add_argument("--prefill-tp", type=int, metavar="N",
                     help="workers.prefill.tp: tensor-parallel ranks of each prefill worker "
                     "(--disagg; default 1)")
    gen.add_argument("--decode-tp", type=int, metavar="N",
                     help="workers.decode.tp: tensor-parallel ranks of each decode worker "
                     "(--disagg; default 1)")
    gen.set_defaults(func=cmd_generate)


def tp_overrides(args: argparse.Namespace, disagg: bool) -> dict:
    """The TP flags as config keys: --prefill-tp / --decode-tp with --disagg, --tp without
    (the engine in this process is a colocated decode worker's: workers.decode.tp); a flag of
    the other mode is refused, never ignored. The config chain validates the values (range and
    the model's heads, errors naming the key)."""
    wrong = ["--tp"] if disagg and args.tp is not None else \
        [f for f, v in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp))
         if not disagg and v is not None]
    if wrong:
        raise SystemExit(f"raypd generate: error: {', '.join(wrong)}: " + (
            "use --prefill-tp / --decode-tp with --disagg" if disagg else "only with --disagg "
            "(without it: --tp)"))
    if disagg:
        return {"workers.prefill.tp": args.prefill_tp, "workers.decode.tp": args.decode_tp}
    return {"workers.decode.tp": args.tp}


def _sampling_from_args(args: argparse.Namespace):
    from workers.request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    disagg = getattr(args, "disagg", False)
    cfg = config_from_args(args, {"workers.prefill.count": args.prefill,
                                  "workers.decode.count": args.decode,
                                  "transfer.transport": args.transport,
                                  **tp_overrides(args, disagg)}, in_process=not disagg)
    if print_config(cfg, args):
        return 0
    if args.prompt is None:
        raise SystemExit("raypd generate: error: the following arguments are required: --prompt")
    from workers.engine import LLMEngine
    sampling = _sampling_from_args(args)
    if disagg:
        result = run_disagg_generate(args, sampling, cfg)
    else:
        engine = LLMEngine(replace(engine_config_from_args(args, cfg), tp=cfg.workers.decode.tp))
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


def run_disagg_generate(args: argparse.Namespace, sampling, cfg) -> dict:
    """`cfg`: the RaypdConfig `cmd_generate` resolved; its ray.* keys start Ray."""
    import ray

    from cluster.pd import PDCluster
    pd = cfg.to_pd_config()
    pd.validate()   # a bad transport name fails before Ray starts
    ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus,
             include_dashboard=cfg.ray.include_dashboard, log_to_driver=False,
             configure_logging=False)
    cluster = PDCluster(pd)
    try:
        result = cluster.run_request(args.prompt, sampling, chat=args.chat,
                                     lora_id=args.lora_name or "")
        cluster.check_invariants()
    finally:
        cluster.shutdown()
        ray.shutdown()
    return {"text": result.text, "token_ids": result.token_ids,
            "lifecycle": result.lifecycle.to_dict()}
