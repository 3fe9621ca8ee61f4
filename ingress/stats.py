"""What the ingress reports about itself and its workers: Prometheus metrics (/metrics) and the
rows of /api/stats (one per actor, each asked on its own so a dead worker loses only its row)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ingress.backend import Backend, OperatedBackend
from router.percentiles import percentile

STATS_TIMEOUT_S = 5.0          # a worker that does not answer stats() by then shows unhealthy


class IngressMetrics:
    """Prometheus metrics of one ingress, in their own registry: request counts by status,
    client-side latency histograms, and (at scrape time) every worker's KV gauges."""

    def __init__(self, backend: Backend | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("raypd_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("raypd_ttft_seconds", "time to first token seen by the ingress",
                              registry=r, buckets=buckets)
        self.tpot = Histogram("raypd_tpot_seconds", "time per output token after the first",
                              registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25,
                                                   .5, 1))
        self.e2e = Histogram("raypd_e2e_seconds", "request latency, arrival to last token",
                             registry=r, buckets=buckets)
        self.prompt_tokens = Counter("raypd_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("raypd_cached_prompt_tokens",
                                     "prompt tokens served from a prefix cache", registry=r)
        self.output_tokens = Counter("raypd_generation_tokens", "generated tokens", registry=r)
        self.inflight = Gauge("raypd_requests_in_flight", "sub-requests running", registry=r)
        if backend is not None:
            r.register(_WorkerCollector(backend))

    def observe(self, lc: dict, ttft_s: float | None, e2e_s: float, n_out: int) -> None:
        self.prompt_tokens.inc(lc.get("prompt_tokens") or 0)
        self.cached_tokens.inc(lc.get("cached_tokens") or 0)
        self.output_tokens.inc(n_out)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if n_out > 1:
                self.tpot.observe((e2e_s - ttft_s) / (n_out - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector:
    """Per-worker gauges from `backend.stats()`, labelled by worker id and role."""

    GAUGES = [("raypd_kv_blocks_used", "blocks_used", "KV blocks referenced by requests"),
              ("raypd_kv_blocks_cached", "blocks_cached", "KV blocks cached, unreferenced"),
              ("raypd_kv_blocks_total", "num_blocks", "KV blocks in the pool"),
              ("raypd_prefix_cache_hit_rate", "hit_rate", "prompt tokens reused / queried"),
              ("raypd_worker_requests_running", "running", "requests running in the engine"),
              ("raypd_worker_requests_waiting", "waiting", "requests waiting in the engine")]
    COUNTERS = [("raypd_prefix_reused_tokens", "reused_tokens", "prompt tokens reused"),
                ("raypd_kv_evictions", "evictions", "cached KV blocks evicted"),
                ("raypd_preemptions", "preemptions", "requests preempted (recomputed)"),
                ("raypd_worker_computed_tokens", "computed_tokens", "tokens computed")]

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def describe(self) -> list:
        return []

    def collect(self):
        up = GaugeMetricFamily("raypd_backend_up", "1 when every worker answered stats()")
        try:
            stats = self.backend.stats()
        except Exception:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        labels = ["worker", "role"]
        for family, table in ((GaugeMetricFamily, self.GAUGES),
                              (CounterMetricFamily, self.COUNTERS)):
            for name, key, doc in table:
                m = family(name, doc, labels=labels)
                for s in stats:
                    if key in s:
                        m.add_metric([str(s.get("worker_id")), str(s.get("role"))],
                                     float(s[key]))
                yield m


_ACTOR_FIELDS = ("waiting", "running", "blocks_used", "blocks_cached", "free", "num_blocks",
                 "block_size", "hit_rate", "prompt_tokens", "reused_tokens", "computed_tokens",
                 "recomputed_tokens", "evictions", "preemptions", "peak_blocks_used",
                 "requests_finished", "requests_rejected", "steps", "busy_s",
                 "block_utilization", "loop_error")


def worker_stats(backend: Backend) -> tuple[list[dict], str | None]:
    """Every worker's stats() row, and what went wrong with those that did not answer (the
    backend asks each worker on its own: one that is dead, hung or just removed by a scale-in
    only loses its own row)."""
    try:
        rows = list(backend.stats(STATS_TIMEOUT_S) if isinstance(backend, OperatedBackend)
                    else backend.stats())
    except Exception as e:      # noqa: BLE001 - the page shows it
        return [], f"{type(e).__name__}: {e}"
    out = [r for r in rows if "error" not in r]
    errors = [str(r["error"]).split(":")[0] for r in rows if "error" in r]
    return out, (f"{len(errors)} worker(s) did not answer ({', '.join(errors)})"
                 if errors else None)


def actor_row(s: dict, info: dict) -> dict:
    """One /api/stats actor row from a worker's stats() and info()."""
    row = {"worker_id": s["worker_id"], "role": s.get("role") or info.get("role"),
           "node_id": info.get("node_id"), "pid": info.get("pid")}
    row.update({k: s.get(k) for k in _ACTOR_FIELDS})
    row["num_blocks"] = s.get("num_blocks") or info.get("num_blocks")
    row["queue"] = (s.get("waiting") or 0) + (s.get("running") or 0) if "waiting" in s else None
    used, total = s.get("blocks_used"), row["num_blocks"]
    row["kv_usage"] = used / total if used is not None and total else None
    if row["role"] == "prefill":     # pages staged for decode workers
        row.update(transfer_count=s.get("transfer_offered"),
                   transfer_bytes=s.get("transfer_bytes_staged"), transfer_seconds=None,
                   transfer_active=s.get("transfer_active"),
                   transfer_failures=(s.get("transfer_aborted") or 0)
                   + (s.get("transfer_expired") or 0) if "transfer_offered" in s else None)
    else:                            # pages pulled from prefill workers
        row.update(transfer_count=s.get("transfer_transfers"),
                   transfer_bytes=s.get("transfer_bytes_received"),
                   transfer_seconds=s.get("transfer_seconds"), transfer_active=None,
                   transfer_failures=s.get("transfer_failures"))
    return row


def actor_order(row: dict) -> tuple:
    name, _, idx = str(row["worker_id"]).rpartition("-")
    return ({"prefill": 0, "decode": 1}.get(row["role"], 2), name,
            int(idx) if idx.isdigit() else 0, str(row["worker_id"]))


def summarize(values: list) -> dict | None:
    """count, mean, p50, p95, max of the values that are not None (None when there are none)."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"count": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50),
            "p95": percentile(v, 95), "max": max(v)}
