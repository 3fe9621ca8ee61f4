"""Ray metrics (`ray.util.metrics`) for worker actors and the router, fed from plain stats dicts.

Each Ray node's metrics agent serves them as Prometheus text on its metrics export port
(`ray start --metrics-export-port`, `ray.init(_metrics_export_port=...)`; the agent runs with or
without the dashboard). Ray renames them on the way out: every name gets the prefix `ray_` and
counters the suffix `_total`, so `raypd_evictions` is scraped as `ray_raypd_evictions_total` and
the histogram `raypd_ttft_seconds` as `ray_raypd_ttft_seconds_{bucket,sum,count}`. Ray rebuilds a
histogram's `_sum` from bucket midpoints, so use `_bucket` (quantiles) and `_count`, not means.

Torch-free (the router imports it). Counters are fed as deltas of the engine's cumulative
counters, so calling `update` more or less often never double counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

PREFIX = "raypd_"
WORKER_TAGS = ("role", "worker_id", "node")
ROUTER_TAGS = ("router",)

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

# stats-dict key -> gauge (a snapshot; the first key present wins)
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
# stats-dict key(s) -> counter fed with the increase of a cumulative value
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
# stats-dict key holding {adapter name: cumulative value} -> counter tagged with the adapter
WORKER_ADAPTER_COUNTERS: dict[str, tuple[str, str]] = {
    "raypd_lora_requests": ("lora_requests", "requests run under each LoRA adapter"),
    "raypd_lora_computed_tokens": ("lora_tokens", "tokens computed under each LoRA adapter"),
    "raypd_lora_prompt_tokens": ("lora_prompt_tokens",
                                 "prompt tokens of finished requests, per LoRA adapter"),
    "raypd_lora_hit_tokens": ("lora_hit_tokens",
                              "of those, prefix-cache hits (hit rate = hit / prompt)"),
}
# counter with a `reason` tag, fed with the increase of one cumulative stats key per reason
LEASE_RELEASES = "raypd_lease_releases"
LEASE_RELEASE_KEYS = {"acked": "transfer_acked", "aborted": "transfer_aborted",
                      "expired": "transfer_expired"}
WORKER_REASON_COUNTERS = {
    LEASE_RELEASES: "transfer leases released (the staged pages unpinned), by reason: acked by "
                    "the decode side, aborted, expired (prefill)",
}
# from finished requests' lifecycle records
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
}

COUNTER_NAMES = (*WORKER_COUNTERS, *WORKER_REASON_COUNTERS, *WORKER_ADAPTER_COUNTERS,
                 *WORKER_REQUEST_COUNTERS,
                 "raypd_router_requests", "raypd_router_decisions",
                 "raypd_router_pair_transfer_bytes", "raypd_router_pair_transfer_seconds",
                 "raypd_router_hash_drift_alarms")
HISTOGRAM_NAMES = (*WORKER_HISTOGRAMS, "raypd_router_request_seconds",
                   "raypd_router_stage_seconds")
GAUGE_NAMES = (*WORKER_GAUGES, "raypd_router_in_flight", "raypd_router_hash_drift")
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


class WorkerMetrics:
    """One worker actor's metrics, tagged role / worker_id / node.

    `update(stats)` sets the gauges and advances the counters from the actor's `stats()` dict;
    `observe_finished(lifecycle)` records one finished request. Thread-safe."""

    def __init__(self, role: str, worker_id: str, node_id: str | None = None,
                 interval_s: float = 0.5) -> None:
        if node_id is None:
            import ray
            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.tags = {"role": role, "worker_id": worker_id, "node": node_id or ""}
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._next_update = 0.0
        self.gauges = {n: Gauge(n, d, tag_keys=WORKER_TAGS).set_default_tags(self.tags)
                       for n, (_, d) in WORKER_GAUGES.items()}
        self.counters = {n: Counter(n, d, tag_keys=WORKER_TAGS).set_default_tags(self.tags)
                         for n, (_, d) in WORKER_COUNTERS.items()}
        self.adapter_counters = {
            n: Counter(n, d, tag_keys=(*WORKER_TAGS, "adapter")).set_default_tags(self.tags)
            for n, (_, d) in WORKER_ADAPTER_COUNTERS.items()}
        self.finished = Counter("raypd_requests_finished",
                                WORKER_REQUEST_COUNTERS["raypd_requests_finished"],
                                tag_keys=(*WORKER_TAGS, "finish_reason")
                                ).set_default_tags(self.tags)
        self.lease_releases = Counter(LEASE_RELEASES, WORKER_REASON_COUNTERS[LEASE_RELEASES],
                                      tag_keys=(*WORKER_TAGS, "reason")
                                      ).set_default_tags(self.tags)
        self.reused = Counter("raypd_reused_tokens", WORKER_REQUEST_COUNTERS["raypd_reused_tokens"],
                              tag_keys=WORKER_TAGS).set_default_tags(self.tags)
        self.histograms = {n: (key, Histogram(n, d, boundaries=b, tag_keys=WORKER_TAGS)
                               .set_default_tags(self.tags))
                           for n, (key, b, d) in WORKER_HISTOGRAMS.items()}

    def update(self, stats: Mapping[str, Any]) -> None:
        """Gauges := the snapshot; counters += increase of each cumulative value since the
        last call (the first call counts everything so far)."""
        with self._lock:
            for name, (keys, _) in WORKER_GAUGES.items():
                v = _first(stats, keys)
                if v is not None:
                    self.gauges[name].set(float(v))
            for name, (keys, _) in WORKER_COUNTERS.items():
                v = _first(stats, keys)
                if v is None:
                    continue
                delta = float(v) - self._last.get(name, 0.0)
                self._last[name] = float(v)
                if delta > 0:   # a reset (smaller value) restarts the baseline
                    self.counters[name].inc(delta)
            for name, (key, _) in WORKER_ADAPTER_COUNTERS.items():
                for adapter, v in (stats.get(key) or {}).items():
                    last_key = f"{name}/{adapter}"
                    delta = float(v) - self._last.get(last_key, 0.0)
                    self._last[last_key] = float(v)
                    if delta > 0:
                        self.adapter_counters[name].inc(delta, tags={"adapter": adapter})
            for reason, key in LEASE_RELEASE_KEYS.items():
                v = _first(stats, (key,))
                if v is None:
                    continue
                delta = float(v) - self._last.get(key, 0.0)
                self._last[key] = float(v)
                if delta > 0:
                    self.lease_releases.inc(delta, tags={"reason": reason})

    def maybe_update(self, get_stats: Callable[[], Mapping[str, Any]],
                     now: float | None = None) -> bool:
        """`update(get_stats())` if `interval_s` has passed since the last one (cheap to call
        every engine-loop iteration). Returns whether it updated."""
        now = time.monotonic() if now is None else now
        if now < self._next_update:
            return False
        self._next_update = now + self.interval_s
        self.update(get_stats())
        return True

    def observe_finished(self, lifecycle: Any) -> None:
        """One finished request: its RequestLifecycle (or `to_dict()` of it)."""
        lc = asdict(lifecycle) if is_dataclass(lifecycle) else lifecycle
        self.finished.inc(1, tags={"finish_reason": str(lc.get("finish_reason") or "unknown")})
        if lc.get("cached_tokens"):
            self.reused.inc(float(lc["cached_tokens"]))
        for key, hist in self.histograms.values():
            v = lc.get(key)
            if v is not None:
                hist.observe(float(v))

    def observe_many(self, lifecycles: Iterable[Any]) -> None:
        for lc in lifecycles:
            self.observe_finished(lc)


class RouterMetrics:
    """The router's metrics: requests by status, routing decisions, in-flight requests."""

    def __init__(self, router_id: str = "router") -> None:
        tags = {"router": router_id}
        self.requests = Counter("raypd_router_requests", ROUTER_METRICS["raypd_router_requests"],
                                tag_keys=(*ROUTER_TAGS, "status")).set_default_tags(tags)
        self.latency = Histogram("raypd_router_request_seconds",
                                 ROUTER_METRICS["raypd_router_request_seconds"],
                                 boundaries=E2E_BUCKETS, tag_keys=(*ROUTER_TAGS, "status")
                                 ).set_default_tags(tags)
        self.decisions = Counter("raypd_router_decisions",
                                 ROUTER_METRICS["raypd_router_decisions"],
                                 tag_keys=(*ROUTER_TAGS, "policy", "reason", "target")
                                 ).set_default_tags(tags)
        self.in_flight = Gauge("raypd_router_in_flight", ROUTER_METRICS["raypd_router_in_flight"],
                               tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.stages = Histogram("raypd_router_stage_seconds",
                                ROUTER_METRICS["raypd_router_stage_seconds"],
                                boundaries=STAGE_BUCKETS, tag_keys=(*ROUTER_TAGS, "stage")
                                ).set_default_tags(tags)
        pair = (*ROUTER_TAGS, "prefill", "decode")
        self.pair_bytes = Counter("raypd_router_pair_transfer_bytes",
                                  ROUTER_METRICS["raypd_router_pair_transfer_bytes"],
                                  tag_keys=pair).set_default_tags(tags)
        self.pair_seconds = Counter("raypd_router_pair_transfer_seconds",
                                    ROUTER_METRICS["raypd_router_pair_transfer_seconds"],
                                    tag_keys=pair).set_default_tags(tags)

        self.hash_drift = Gauge("raypd_router_hash_drift",
                                ROUTER_METRICS["raypd_router_hash_drift"],
                                tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.hash_drift_alarms = Counter("raypd_router_hash_drift_alarms",
                                         ROUTER_METRICS["raypd_router_hash_drift_alarms"],
                                         tag_keys=ROUTER_TAGS).set_default_tags(tags)

    def record_hash_drift(self, alarm: bool, went_on: bool) -> None:
        """The hash drift alarm's state after a request (router/drift.py)."""
        self.hash_drift.set(1.0 if alarm else 0.0)
        if went_on:
            self.hash_drift_alarms.inc(1)

    def record_request(self, status: int | str, seconds: float | None = None) -> None:
        """One request ended with `status` (an HTTP code: 200, 400, 429, 499, 500, ...)."""
        tags = {"status": str(status)}
        self.requests.inc(1, tags=tags)
        if seconds is not None:
            self.latency.observe(float(seconds), tags=tags)

    def record_decision(self, policy: str, reason: str, target: str = "") -> None:
        """One routing decision; `target` is the role chosen for (prefill / decode)."""
        self.decisions.inc(1, tags={"policy": policy, "reason": reason, "target": target})

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(float(n))

    def record_trace(self, trace: Any) -> None:
        """One finished request's handoff trace (kvcache.request_trace.RequestTrace): each
        stage's seconds, and its transfer under its P -> D pair."""
        if trace.status != 200:
            return
        secs = trace.stage_seconds()
        for stage, s in secs.items():
            self.stages.observe(s, tags={"stage": stage})
        if trace.transfer_bytes and trace.prefill_worker and trace.decode_worker:
            pair = {"prefill": trace.prefill_worker, "decode": trace.decode_worker}
            self.pair_bytes.inc(float(trace.transfer_bytes), tags=pair)
            if secs.get("transfer", 0.0) > 0:
                self.pair_seconds.inc(secs["transfer"], tags=pair)


def _first(stats: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = stats.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None
