"""Every metric raypd exports, by name, with its help text, tags and buckets: the catalogue the
workers (workers/metrics.py), the router (router/metrics.py), the Grafana dashboard and the tests
share.

Ray's metrics agent renames them on the way out: every name gets the prefix `ray_` and counters
the suffix `_total`, so `raypd_evictions` is scraped as `ray_raypd_evictions_total` and the
histogram `raypd_ttft_seconds` as `ray_raypd_ttft_seconds_{bucket,sum,count}` (`exported_names`).
Ray rebuilds a histogram's `_sum` from bucket midpoints, so use `_bucket` (quantiles) and
`_count`, not means.
"""

from __future__ import annotations

PREFIX = "raypd_"


WORKER_TAGS = ("role", "worker_id", "node")


ROUTER_TAGS = ("router",)


TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


WORKER_GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "raypd_queue_depth": (("waiting",), "requests waiting to be scheduled"),
    "raypd_running_requests": (("running",), "requests in the running batch"),
    "raypd_kv_blocks_used": (("blocks_used",), "KV blocks not free (referenced + cached)"),
    "raypd_kv_blocks_cached": (("blocks_cached", "cached"),
                               "KV blocks in the prefix cache with no reference (evictable)"),
    "raypd_kv_blocks_total": (("num_blocks", "total"), "KV blocks in the pool"),
    "raypd_active_leases": (("transfer_active",), "transfer leases pinning blocks (prefill)"),
    "raypd_kv_tier2_blocks": (("tier2_blocks",),
                              "evicted KV blocks held in the host tier (kv_tier2_gb)"),
}


WORKER_COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "raypd_prefix_query_tokens": (("prompt_tokens",),
                                  "prompt tokens looked up in this worker's prefix cache"),
    "raypd_prefix_hit_tokens": (("reused_tokens",),
                                "of those, tokens found in this worker's prefix cache"),
    "raypd_computed_tokens": (("computed_tokens",), "tokens whose KV this worker computed"),
    "raypd_recomputed_tokens": (("recomputed_tokens",), "tokens computed again after preemption"),
    "raypd_evictions": (("evictions",), "cached KV blocks evicted (LRU) for new allocations"),
    "raypd_preemptions": (("preemptions",), "running requests preempted for lack of blocks"),
    "raypd_kv_tier2_hits": (("tier2_hits",), "host-tier KV blocks reloaded for a prefix hit"),
    "raypd_kv_reloaded_tokens": (("reloaded_tokens",), "tokens whose KV was reloaded from the "
                                 "host tier instead of recomputed"),
    "raypd_kv_reload_seconds": (("reload_s",), "seconds spent reloading host-tier KV blocks"),
    "raypd_kv_recompute_avoided_seconds": (("recompute_avoided_s",),
                                           "prefill seconds the reloads saved (reloaded tokens x "
                                           "measured prefill seconds per token)"),
    "raypd_lease_expiries": (("transfer_expired",),
                             "transfer leases that expired before the decode side acked"),
    "raypd_transfers": (("transfer_offered", "transfer_transfers"),
                        "KV transfers staged (prefill) or pulled (decode)"),
    "raypd_transfer_bytes": (("transfer_bytes_staged", "transfer_bytes_received"),
                             "KV bytes staged for sending (prefill) or received (decode)"),
    "raypd_transfer_seconds": (("transfer_seconds",), "seconds spent pulling KV pages (decode)"),
    "raypd_transfer_failures": (("transfer_failures",), "KV transfers that failed (decode)"),
    "raypd_lora_loads": (("lora_loads",), "LoRA adapters loaded into a slot on this worker"),
    "raypd_lora_evictions": (("lora_evictions",), "resident LoRA adapters evicted (LRU)"),
}


WORKER_ADAPTER_COUNTERS: dict[str, tuple[str, str]] = {
    "raypd_lora_requests": ("lora_requests", "requests run under each LoRA adapter"),
    "raypd_lora_computed_tokens": ("lora_tokens", "tokens computed under each LoRA adapter"),
    "raypd_lora_prompt_tokens": ("lora_prompt_tokens",
                                 "prompt tokens of finished requests, per LoRA adapter"),
    "raypd_lora_hit_tokens": ("lora_hit_tokens",
                              "of those, prefix-cache hits (hit rate = hit / prompt)"),
}


LEASE_RELEASES = "raypd_lease_releases"


LEASE_RELEASE_KEYS = {"acked": "transfer_acked", "aborted": "transfer_aborted",
                      "expired": "transfer_expired"}


WORKER_REASON_COUNTERS = {
    LEASE_RELEASES: "transfer leases released (the staged pages unpinned), by reason: acked by "
                    "the decode side, aborted, expired (prefill)",
}


WORKER_REQUEST_COUNTERS = {
    "raypd_requests_finished": "requests finished here, by finish_reason",
    "raypd_reused_tokens": "prompt tokens of finished requests not computed for them anywhere "
                           "(prefix hits on the prefill or decode side)",
}


WORKER_HISTOGRAMS = {
    "raypd_ttft_seconds": ("ttft_s", TTFT_BUCKETS, "time to first token (on a prefill worker: "
                           "its prefill; on a decode worker: admission to first token)"),
    "raypd_tpot_seconds": ("tpot_s", TPOT_BUCKETS, "mean time per output token after the first"),
    "raypd_e2e_seconds": ("e2e_s", E2E_BUCKETS, "request latency on this worker"),
}


STAGE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 60.0]


ROUTER_METRICS = {
    "raypd_router_stage_seconds": "seconds each handoff stage of a finished request took, by "
                                  "stage (route, admit, prefill_queue, prefill_compute, staging,"
                                  " transfer, first_decode, decode; router/request_traces.py)",
    "raypd_router_pair_transfer_bytes": "KV bytes moved per prefill -> decode worker pair",
    "raypd_router_pair_transfer_seconds": "seconds of KV transfer per prefill -> decode worker "
                                          "pair (the router's view: staging done -> D has them)",
    "raypd_router_requests": "requests ended, by status (HTTP-style code)",
    "raypd_router_request_seconds": "request latency at the router, by status",
    "raypd_router_decisions": "routing decisions, by policy, reason and target role",
    "raypd_router_in_flight": "requests in flight through the router",
    "raypd_router_hash_drift": "1 while the router's predicted prefix hits exceed the hits the "
                               "engines report beyond the drift margin (router/drift.py)",
    "raypd_router_hash_drift_alarms": "times the hash drift alarm went on",
    "raypd_router_migrations": "live moves of a running decode to another decode worker, by "
                               "outcome (moved: its KV went with it; fallback: the move failed "
                               "and it re-prefilled elsewhere; unplaced: no worker had room, it "
                               "stayed) and cause (drain, kv_pressure, rebalance)",
    "raypd_autoscale_workers": "the autoscaler's view of each pool at its last evaluation, by "
                               "role and kind (live, starting, draining, target)",
    "raypd_autoscale_decisions": "autoscaler evaluations by role and direction (up, down, hold)",
}


COUNTER_NAMES = (*WORKER_COUNTERS, *WORKER_REASON_COUNTERS, *WORKER_ADAPTER_COUNTERS,
                 *WORKER_REQUEST_COUNTERS,
                 "raypd_router_requests", "raypd_router_decisions",
                 "raypd_router_pair_transfer_bytes", "raypd_router_pair_transfer_seconds",
                 "raypd_router_hash_drift_alarms", "raypd_router_migrations",
                 "raypd_autoscale_decisions")


HISTOGRAM_NAMES = (*WORKER_HISTOGRAMS, "raypd_router_request_seconds",
                   "raypd_router_stage_seconds")


GAUGE_NAMES = (*WORKER_GAUGES, "raypd_router_in_flight", "raypd_router_hash_drift",
               "raypd_autoscale_workers")


METRIC_NAMES = (*WORKER_GAUGES, *WORKER_COUNTERS, *WORKER_REASON_COUNTERS,
                *WORKER_ADAPTER_COUNTERS, *WORKER_REQUEST_COUNTERS, *WORKER_HISTOGRAMS,
                *ROUTER_METRICS)


def exported_names(name: str) -> tuple[str, ...]:
    """The Prometheus series names Ray's metrics agent exports for one raypd metric."""
    full = "ray_" + name
    if name in COUNTER_NAMES:
        return (full + "_total",)
    if name in HISTOGRAM_NAMES:
        return (full + "_bucket", full + "_sum", full + "_count")
    return (full,)


PROMETHEUS_NAMES = tuple(n for name in METRIC_NAMES for n in exported_names(name))

