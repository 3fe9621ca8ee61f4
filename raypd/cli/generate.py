"""`raypd generate`: one prompt through one engine in this process, or with --disagg through N
prefill + M decode worker actors on a local Ray."""

from __future__ import annotations

import argparse
import json

from raypd.cli.common import add_engine_args, engine_config_from_args, engine_fields


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(gen)
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


def _sampling_from_args(args: argparse.Namespace):
    from workers.request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from workers.engine import LLMEngine
    sampling = _sampling_from_args(args)
    if getattr(args, "disagg", False):
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


def run_disagg_generate(args: argparse.Namespace, sampling) -> dict:
    import ray

    from cluster.pd import PDCluster, PDConfig
    from router.orchestrator import FlowConfig
    cfg = PDConfig(engine=engine_fields(args), num_prefill=args.prefill, num_decode=args.decode, threads_per_actor=args.threads or 1, flow=FlowConfig(transport=args.transport))
    cfg.validate()   # a bad transport name fails before Ray starts
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    cluster = PDCluster(cfg)
    try:
        result = cluster.run_request(args.prompt, sampling, chat=args.chat,
                                     lora_id=args.lora_name or "")
        cluster.check_invariants()
    finally:
        cluster.shutdown()
        ray.shutdown()
    return {"text": result.text, "token_ids": result.token_ids,
            "lifecycle": result.lifecycle.to_dict()}
