"""`raypd run`, the main job: start an embedded local Ray with 1 prefill + 1 decode worker on
SmolLM2 behind the HTTP server, replay a built-in synthetic trace (shared system prompts,
multi-turn sessions, Poisson arrivals) through it with `raypd submit`'s client, print the report
summary and write report.json / report.html / outputs.jsonl / trace.jsonl into --out-dir.

    raypd run [--prefill N] [--decode M] [--policy P] [--trace FILE] [--model M] [--requests N]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from protocol.messages import RequestResult
from raypd.replay.submit import SubmitOptions, replay

DEFAULT_REQUESTS = 100
DEFAULT_RATE = 1.0              # arrivals / s of the built-in trace
# The main job's KV pool per worker (engine.num_blocks, without --config): small enough that the
# built-in trace's running requests fill the decode worker's pool, so the report shows growth to
# the boundary, evictions, recomputed tokens and the capacity action. configs/local.yaml's 1 GiB
# (~2,900 blocks of SmolLM2) peaks at ~2% with this trace.
DEFAULT_NUM_BLOCKS = 40
DEFAULT_OUT_DIR = Path("raypd-report")
REPORT_TIMELINE_POINTS = 400    # per worker in report.json's kv_timeline
REPORT_TIMELINE_LEAD_S = 2.0    # the timeline starts this long before the replay (the baseline)


class RecordingBackend:
    """The cluster as the HTTP ingress sees it, keeping each finished request's result (token
    ids, lifecycle) by request id so the report can join them to the client's records."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.results: dict[str, RequestResult] = {}

    async def run_request_async(self, prompt: Any, sampling: Any = None,
                                **kw: Any) -> RequestResult:
        result = await self._backend.run_request_async(prompt, sampling, **kw)
        if kw.get("request_id"):
            self.results[kw["request_id"]] = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def run_job(cfg, items, opts: SubmitOptions, trace_path: Path, *, block_tokens: int,
            max_output_tokens: int | None, slo_ttft_s: float, slo_tpot_s: float,
            perfetto: Path | None = None) -> tuple[dict, list]:
    """Serve `cfg` on a local Ray, replay `items` through HTTP, return (report, records)."""
    from cluster.pd import PDCluster
    from cluster.serve import API_KEY_ENV, connect_ray, start_server
    from protocol.sampling import SamplingParams
    from raypd.bench.capacity import recorded_curves
    from raypd.replay.report import build_report
    from raypd.replay.trace_views import write_chrome_trace
    from router.request_traces import stage_breakdown
    from workers.kv_gate import gate_thresholds, recorded_gates

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
        timeline = cluster.kv_timeline(since=result.started_at - REPORT_TIMELINE_LEAD_S,
                                       t0=result.started_at,
                                       max_points=REPORT_TIMELINE_POINTS)
        traces = [t for r in result.records if r.ok
                  and (t := cluster.orchestrator.traces.get(r.request_id)) is not None]
        for r in result.records:
            got = backend.results.get(r.request_id)
            if got is not None:
                r.lifecycle = got.lifecycle.to_dict() if got.lifecycle else None
                r.token_ids = list(got.token_ids)
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
                  "concurrency": opts.concurrency, "block_tokens": block_tokens,
                  "max_output_tokens": max_output_tokens,
                  "routing_decisions": dict(cluster.orchestrator.decisions),
                  "kv_tier2_gb": cfg.engine.kv_tier2_gb,
                  "kv_gates": recorded_gates(cfg.model.name, gate_thresholds(cfg.model),
                                             dtype=cfg.model.dtype)}
        report = build_report(result.records, params=params, wall_s=result.wall_s,
                              stats_before=before, stats_after=after,
                              slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                              concurrency=opts.concurrency, stats_source="in-process",
                              stage_breakdown=stage_breakdown(traces) if traces else None,
                              kv_timeline=timeline,
                              capacity_curves=recorded_curves(cfg.model.name,
                                                              params["kv_dtype"]))
        if perfetto:
            write_chrome_trace(traces, perfetto)
        return report, result.records
    finally:
        if handle is not None:
            handle.stop()
        if cluster is not None:
            cluster.shutdown()
        if started_ray:
            import ray
            ray.shutdown()
