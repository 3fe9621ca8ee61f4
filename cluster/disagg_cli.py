"""`raypd generate --disagg`: one request through N prefill + M decode workers on local Ray."""

from __future__ import annotations

import argparse

import ray

from cluster.pd import PDCluster, PDConfig
from workers.request import SamplingParams


def engine_fields(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype,
                block_size=args.block_size, num_blocks=args.num_blocks,
                kv_cache_gb=args.kv_cache_gb, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching)


def run_disagg_generate(args: argparse.Namespace, sampling: SamplingParams) -> dict:
    cfg = PDConfig(engine=engine_fields(args), num_prefill=args.prefill, num_decode=args.decode,
                   transport=args.transport, threads_per_actor=args.threads or 1)
    cfg.validate()   # a bad transport name fails before Ray starts
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    cluster = PDCluster(cfg)
    try:
        result = cluster.run_request(args.prompt, sampling, chat=args.chat)
        cluster.check_invariants()
    finally:
        cluster.shutdown()
        ray.shutdown()
    return result
