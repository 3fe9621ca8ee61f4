"""`raypd generate --disagg`: one request through N prefill + M decode workers on local Ray."""

from __future__ import annotations

import argparse

import ray

from cluster.cli import engine_fields
from cluster.pd import PDCluster, PDConfig
from workers.request import SamplingParams


def run_disagg_generate(args: argparse.Namespace, sampling: SamplingParams) -> dict:
    cfg = PDConfig(engine=engine_fields(args), num_prefill=args.prefill, num_decode=args.decode,
                   transport=args.transport, threads_per_actor=args.threads or 1)
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
    return result
