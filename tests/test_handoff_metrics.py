"""The handoff metrics reach Ray's metrics port: the router's per-stage histogram and per P->D
pair transfer counters (fed by finished request traces), and the prefill worker's lease releases
by reason (fed by the producer's acked / aborted / expired counts)."""

from __future__ import annotations

import pytest
import ray
from test_metrics import scrape

from protocol.metric_names import PROMETHEUS_NAMES
from protocol.request_trace import PrefillTiming
from router.metrics import RouterMetrics
from router.request_traces import TraceStore
from workers.metrics import WorkerMetrics


@ray.remote(num_cpus=0)
class LeaseProbe:
    def record(self) -> None:
        m = WorkerMetrics("prefill", "prefill-9", node_id="n")
        m.update({"transfer_acked": 3, "transfer_aborted": 1, "transfer_expired": 0})
        m.update({"transfer_acked": 5, "transfer_aborted": 1, "transfer_expired": 2})


def test_finished_traces_feed_stage_histograms_and_pair_transfer(metrics_port):
    t = [1000.0]
    store = TraceStore(clock=lambda: t[0], on_finish=RouterMetrics("router-h").record_trace)
    store.start("r")
    t[0] += 0.002
    store.routed("r", "decode-1")
    store.admitted("r", "decode-1", local=False)
    t[0] += 0.05
    store.prefilled("r", "prefill-2", PrefillTiming(0.01, 0.03, 0.005))
    t[0] += 0.02
    store.transferred("r", "decode-1", {"transfer_bytes": 2_000_000})
    store.tokens("r", 1)
    t[0] += 0.01
    store.tokens("r", 1)
    store.finish("r", 200)
    store.start("bad")
    store.finish("bad", 429)                       # failed requests feed no stage
    r = ("router", "router-h")
    pair = (("decode", "decode-1"), ("prefill", "prefill-2"), r)
    got = scrape(metrics_port, 'router="router-h"',
                 need=("ray_raypd_router_pair_transfer_seconds_total", pair))
    for stage in ("route", "prefill_queue", "prefill_compute", "staging", "transfer"):
        assert got[("ray_raypd_router_stage_seconds_count", (r, ("stage", stage)))] == 1, stage
    assert got[("ray_raypd_router_stage_seconds_bucket",
                (("le", "0.025"), r, ("stage", "transfer")))] == 1
    assert got[("ray_raypd_router_pair_transfer_bytes_total", pair)] == 2_000_000
    assert got[("ray_raypd_router_pair_transfer_seconds_total", pair)] == pytest.approx(0.02)
    assert {n for n, _ in got} <= set(PROMETHEUS_NAMES)


def test_lease_releases_are_counted_by_reason(metrics_port):
    probe = LeaseProbe.remote()          # kept alive until its metrics were scraped
    ray.get(probe.record.remote())
    p = (("node", "n"), ("role", "prefill"), ("worker_id", "prefill-9"))
    got = scrape(metrics_port, 'worker_id="prefill-9"',
                 need=("ray_raypd_lease_releases_total", (*p[:1], ("reason", "expired"), *p[1:])))
    by = {reason: got.get(("ray_raypd_lease_releases_total", (*p[:1], ("reason", reason),
                                                               *p[1:])))
          for reason in ("acked", "aborted", "expired")}
    assert by == {"acked": 5, "aborted": 1, "expired": 2}
