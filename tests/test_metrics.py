"""Ray metrics of workers and router: names, the stats-dict mapping, export through Ray's metrics
agent, a real Prometheus server scraping them, and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, fields

import pytest
import ray
from conftest import ROOT, make_engine
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.endpoint import ConsumerStats, ProducerStats
from protocol.lifecycle import RequestLifecycle
from protocol.metric_names import (
    METRIC_NAMES,
    PROMETHEUS_NAMES,
    WORKER_COUNTERS,
    WORKER_GAUGES,
    WORKER_HISTOGRAMS,
    exported_names,
)
from router.metrics import RouterMetrics
from workers.metrics import WorkerMetrics

DASHBOARD = ROOT / "configs" / "grafana" / "raypd.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- names and the stats mapping (no Ray) -------------------------------------------------------
def test_metric_names_are_prefixed_unique_and_exported_the_ray_way():
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    assert all(n.startswith("raypd_") for n in METRIC_NAMES)
    assert exported_names("raypd_evictions") == ("ray_raypd_evictions_total",)
    assert exported_names("raypd_queue_depth") == ("ray_raypd_queue_depth",)
    assert exported_names("raypd_ttft_seconds") == tuple(
        f"ray_raypd_ttft_seconds_{s}" for s in ("bucket", "sum", "count"))
    assert "ray_raypd_router_decisions_total" in PROMETHEUS_NAMES


def test_engine_stats_feed_every_engine_metric(tiny_loaded):
    """The keys WorkerMetrics reads are the ones a worker's stats() dict really has."""
    engine = make_engine(tiny_loaded, num_blocks=32)
    engine.generate([[5, 6, 7, 8] * 5], None)
    stats = {**engine.get_stats(), **engine.kv.pool.counts()}
    prefill = {**stats, **{f"transfer_{k}": v for k, v in asdict(ProducerStats(0, 0, 0, 0, 0, 0))
                           .items()}}
    decode = {**stats, **{f"transfer_{k}": v for k, v in asdict(ConsumerStats(0, 0, 0.0)).items()},
              "transfer_failures": 0}
    transfer_only = {"raypd_active_leases", "raypd_lease_expiries"}   # prefill side only
    decode_only = {"raypd_transfer_seconds", "raypd_transfer_failures"}
    for name, (keys, _) in {**WORKER_GAUGES, **WORKER_COUNTERS}.items():
        if name not in decode_only:
            assert any(k in prefill for k in keys), (name, keys)
        if name not in transfer_only:
            assert any(k in decode for k in keys), (name, keys)
    lifecycle = {f.name for f in fields(RequestLifecycle)}
    assert {key for key, _, _ in WORKER_HISTOGRAMS.values()} <= lifecycle
    assert {"finish_reason", "cached_tokens"} <= lifecycle


# ---- export through Ray's metrics agent ---------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsProbe:
    """Stands in for a worker actor: records what a prefill and a decode worker would."""

    def __init__(self):
        self.prefill = WorkerMetrics("prefill", "prefill-7")
        self.decode = WorkerMetrics("decode", "decode-7", node_id="node-x")

    def record(self) -> str:
        self.prefill.update({"waiting": 3, "running": 2, "blocks_used": 10, "blocks_cached": 4,
                             "num_blocks": 64, "prompt_tokens": 100, "reused_tokens": 32,
                             "evictions": 1, "transfer_offered": 2, "transfer_bytes_staged": 4096,
                             "transfer_active": 1, "transfer_expired": 1})
        self.prefill.update({"prompt_tokens": 160, "reused_tokens": 48, "waiting": 5})
        self.decode.update({"transfer_transfers": 2, "transfer_bytes_received": 4096,
                            "transfer_seconds": 0.25, "transfer_failures": 1})
        self.decode.observe_finished(RequestLifecycle(cached_tokens=32, ttft_s=0.3, tpot_s=0.02,
                                                      e2e_s=1.2, finish_reason="stop"))
        self.decode.observe_finished({"finish_reason": "length", "ttft_s": 0.04})
        return ray.get_runtime_context().get_node_id()


def scrape(port: int, want: str, timeout: float = 20.0, need: tuple | None = None
           ) -> dict[tuple, float]:
    """{(sample name, sorted raypd labels): value} once `want` appears in the export (and, with
    `need`, once that sample key is among them: the Ray instance is shared, so another module's
    workers may have put `want` there first)."""
    keep = ("role", "worker_id", "node", "finish_reason", "le", "router", "status", "policy",
            "reason", "target", "stage", "prefill", "decode")
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out = {}
        if want in text:
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name.startswith("ray_raypd_"):
                        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in keep))
                        out[(s.name, labels)] = s.value
            if need is None or need in out:
                return out
        if time.monotonic() > deadline:
            return out
        time.sleep(0.3)


def test_worker_metrics_reach_the_ray_metrics_port_tagged(metrics_port):
    probe = MetricsProbe.remote()        # kept alive until its metrics were scraped
    node = ray.get(probe.record.remote())
    p = (("node", node), ("role", "prefill"), ("worker_id", "prefill-7"))
    d = (("node", "node-x"), ("role", "decode"), ("worker_id", "decode-7"))
    got = scrape(metrics_port, 'worker_id="decode-7"',
                 need=("ray_raypd_requests_finished_total", (("finish_reason", "length"), *d)))
    assert got[("ray_raypd_queue_depth", p)] == 5
    assert got[("ray_raypd_running_requests", p)] == 2
    assert got[("ray_raypd_kv_blocks_used", p)] == 10
    assert got[("ray_raypd_kv_blocks_total", p)] == 64
    assert got[("ray_raypd_prefix_query_tokens_total", p)] == 160   # deltas, not re-added
    assert got[("ray_raypd_prefix_hit_tokens_total", p)] == 48
    assert got[("ray_raypd_lease_expiries_total", p)] == 1
    assert got[("ray_raypd_transfer_bytes_total", p)] == 4096
    assert got[("ray_raypd_transfer_seconds_total", d)] == 0.25
    assert got[("ray_raypd_transfer_failures_total", d)] == 1
    assert got[("ray_raypd_reused_tokens_total", d)] == 32
    assert got[("ray_raypd_requests_finished_total", (("finish_reason", "stop"), *d))] == 1
    assert got[("ray_raypd_ttft_seconds_count", d)] == 2
    assert got[("ray_raypd_ttft_seconds_bucket", (("le", "0.05"), *d))] == 1
    assert got[("ray_raypd_tpot_seconds_count", d)] == 1
    names = {name for name, _ in got}
    assert names <= set(PROMETHEUS_NAMES), names - set(PROMETHEUS_NAMES)


def test_router_metrics_reach_the_ray_metrics_port(metrics_port):
    m = RouterMetrics("router-test")
    m.record_request(200, 0.4)
    m.record_request(429)
    m.record_decision("locality", "prefix_hit", "prefill")
    m.set_in_flight(2)
    r = ("router", "router-test")
    got = scrape(metrics_port, 'router="router-test"', need=("ray_raypd_router_in_flight", (r,)))
    assert got[("ray_raypd_router_requests_total", (r, ("status", "200")))] == 1
    assert got[("ray_raypd_router_requests_total", (r, ("status", "429")))] == 1
    assert got[("ray_raypd_router_request_seconds_count", (r, ("status", "200")))] == 1
    assert got[("ray_raypd_router_decisions_total", (("policy", "locality"),
                                                     ("reason", "prefix_hit"), r,
                                                     ("target", "prefill")))] == 1
    assert got[("ray_raypd_router_in_flight", (r,))] == 2


def test_maybe_update_is_throttled():
    m = WorkerMetrics("decode", "decode-t", node_id="n", interval_s=0.5)
    calls = []
    stats = lambda: calls.append(1) or {"waiting": 1}   # noqa: E731
    assert m.maybe_update(stats, now=10.0)
    assert not m.maybe_update(stats, now=10.2)
    assert m.maybe_update(stats, now=10.6)
    assert len(calls) == 2


# ---- a real Prometheus server scrapes them ------------------------------------------------------
def prom_query(base: str, query: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="the prometheus binary is not installed "
                           "(apt-get install -y --no-install-recommends prometheus)")
def test_prometheus_scrapes_raypd_metrics(metrics_port, tmp_path):
    probe = MetricsProbe.remote()
    ray.get(probe.record.remote())
    web = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    base = f"http://127.0.0.1:{web}"
    try:
        deadline, result = time.monotonic() + 40, []
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                result = prom_query(base, 'ray_raypd_queue_depth{worker_id="prefill-7"}')
            except OSError:
                result = []   # not listening yet
            if result:
                break
            time.sleep(0.5)
        log = (tmp_path / "prometheus.log").read_text()[-2000:]
        assert result, f"Prometheus never returned ray_raypd_queue_depth; its log:\n{log}"
        assert result[0]["metric"]["role"] == "prefill"
        assert float(result[0]["value"][1]) == 5
        hits = prom_query(base, 'ray_raypd_prefix_hit_tokens_total{worker_id="prefill-7"}')
        assert float(hits[0]["value"][1]) == 48
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- the Grafana dashboard ----------------------------------------------------------------------
PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "on", "ignoring",
    "group_left", "group_right", "max", "min", "avg", "count", "clamp_min", "clamp_max", "topk",
    "bottomk", "label_values", "and", "or", "unless", "offset", "vector", "le", "abs", "delta",
    "deriv", "time", "scalar", "bool",
}


def promql_metric_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that are neither functions, keywords, label names
    (inside {...}, by/without (...) or label_values' second argument), ranges nor Grafana
    variables."""
    expr = re.sub(r"label_values\(([^,]*),[^)]*\)", r"\1", expr)  # label_values(metric, label)
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)    # grouping labels
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # ranges: [5m], [$__rate_interval]
    expr = re.sub(r"\$\w+|\$\{[^}]*\}", "", expr)              # Grafana variables
    expr = re.sub(r'"[^"]*"', "", expr)                        # strings
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in PROMQL_WORDS}


def dashboard_queries(board: dict) -> tuple[list[str], dict[str, str]]:
    """(every panel target's expr, {query variable name: its query})."""
    exprs = []
    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(board["panels"])
    variables = {}
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            variables[v["name"]] = q["query"] if isinstance(q, dict) else q
    return exprs, variables


def test_grafana_dashboard_queries_only_name_raypd_metrics():
    board = json.loads(DASHBOARD.read_text())
    exprs, variables = dashboard_queries(board)
    assert len(exprs) >= 10
    exported = set(PROMETHEUS_NAMES)
    used = set()
    for q in [*exprs, *variables.values()]:
        names = promql_metric_names(q)
        assert names, f"no metric in query {q!r}"
        assert names <= exported, f"{q!r} names {names - exported}, which raypd doesn't export"
        used |= names
    for needed in ("ray_raypd_ttft_seconds_bucket", "ray_raypd_tpot_seconds_bucket",
                   "ray_raypd_router_decisions_total", "ray_raypd_router_requests_total",
                   "ray_raypd_kv_blocks_used", "ray_raypd_lease_expiries_total"):
        assert needed in used, needed
    assert variables["worker"].startswith("label_values(") and "worker_id)" in variables["worker"]
    per_actor = [q for q in exprs if '"$worker"' in q]
    assert len(per_actor) >= 10, "worker panels should be filtered by the $worker variable"
