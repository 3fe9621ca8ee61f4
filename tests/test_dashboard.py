"""The router's /api/stats and /dashboard, served in-process over the tiny model (1P + 1D): the
stats list every actor with its KV and queue numbers and the finished requests' timelines; the
page is self-contained, and headless Chromium renders it showing every actor with the numbers
/api/stats gives; the admin routes need the API key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests

from cluster.config import load_config
from cluster.serve import start_server

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIG = {"model.name": "tiny", "engine.num_blocks": 256, "engine.max_num_batched_tokens": 512,
          "transfer.transport": "shm"}
N_REQUESTS = 5
CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)),
                None)
# numbers that cannot change while the server is idle: the page must show exactly these
STABLE_FIELDS = ("role", "state", "node_id", "num_blocks", "blocks_used", "blocks_cached",
                 "waiting", "running", "hit_rate", "reused_tokens", "evictions", "preemptions",
                 "requests_finished", "transfer_count", "transfer_bytes")


@pytest.fixture(scope="module")
def server(ray_session):
    cfg = load_config("configs/local.yaml", CONFIG)
    handle = start_server(cfg, "127.0.0.1", 0, api_key=KEY)
    words = " ".join(uuid.uuid4().hex[:6] for _ in range(30))
    for i in range(N_REQUESTS):        # the same prefix: later requests hit both caches
        r = requests.post(handle.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "tiny", "prompt": words + f" {i}", "max_tokens": 6,
                                "ignore_eos": True})
        assert r.status_code == 200, r.text
    yield handle
    handle.stop()


def stats(server) -> dict:
    r = requests.get(server.url + "/api/stats", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_api_stats_has_a_row_per_actor_with_queue_and_kv_numbers(server):
    s = stats(server)
    actors = {a["worker_id"]: a for a in s["actors"]}
    assert set(actors) == {"prefill-0", "decode-0"}
    for wid, a in actors.items():
        assert a["role"] == wid.split("-")[0] and a["state"] == "active"
        assert a["node_id"] and a["pid"] > 0
        assert a["num_blocks"] == 256 and a["blocks_used"] == 0 and a["queue"] == 0
        assert a["blocks_cached"] > 0 and a["requests_finished"] == N_REQUESTS
        assert 0 < a["hit_rate"] <= 1 and a["reused_tokens"] > 0
        assert a["transfer_count"] == N_REQUESTS and a["transfer_bytes"] > 0
        assert a["ttft"]["count"] == N_REQUESTS and a["tpot"]["p50"] > 0
    assert actors["decode-0"]["transfer_seconds"] > 0
    r = s["router"]
    assert r["policy"] == "locality" and r["live"] == {"prefill": 1, "decode": 1}
    assert r["requests"] == {"200": N_REQUESTS} and r["in_flight"] == 0
    assert r["draining"] == [] and r["unhealthy"] == [] and sum(r["decisions"].values()) > 0


def test_api_stats_keeps_each_finished_requests_lifecycle_timeline(server):
    reqs = stats(server)["requests"]
    assert len(reqs) == N_REQUESTS
    for q in reqs:
        assert q["status"] == 200 and q["finish_reason"] == "length"
        assert q["arrival"] <= q["first_token"] <= q["finish"]
        assert (q["prefill_worker"], q["decode_worker"]) == ("prefill-0", "decode-0")
        assert q["output_tokens"] == 6 and q["prompt_tokens"] > 0 and q["transfer_bytes"] > 0
    assert reqs[-1]["cached_tokens"] > 0                         # the shared prefix hit
    assert [q["arrival"] for q in reqs] == sorted(q["arrival"] for q in reqs)
    assert len(requests.get(server.url + "/api/stats?requests=2", headers=AUTH, timeout=30)
               .json()["requests"]) == 2


def test_dashboard_page_is_self_contained(server):
    r = requests.get(server.url + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text.lower()
    assert "api/stats" in page and "<svg" in page
    for external in ("<script src", "<link", "@import", "url(", "https://"):
        assert external not in page, external


def test_admin_routes_need_the_api_key(server):
    assert requests.get(server.url + "/admin/status", timeout=30).status_code == 401
    ok = requests.get(server.url + "/admin/status", headers=AUTH, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["actors"]) == 2
    r = requests.post(server.url + "/admin/scale", json={"decode": 2}, timeout=30)
    assert r.status_code == 401
    for body, words in [({}, "prefill and/or decode"), ({"decode": -1}, "decode"),
                        ({"decode": True}, "decode"), ({"prefill": "2"}, "prefill"),
                        ({"decode": 1, "workers": 3}, "workers"),
                        ({"decode": 1, "wait": "yes"}, "wait")]:
        r = requests.post(server.url + "/admin/scale", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = requests.post(server.url + "/admin/scale", json={"decode": 0}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "decode" in r.json()["error"]["message"]   # need >= 1
    assert [a["worker_id"] for a in stats(server)["actors"]] == ["prefill-0", "decode-0"]


# ---- the page in headless Chromium ------------------------------------------------------------
class _Fields(HTMLParser):
    """Collect (data-worker, data-field) -> data-value, actor rows and timeline requests."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple[str | None, str], str] = {}
        self.rows: dict[str, dict] = {}
        self.timeline: list[str] = []
        self.polls = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.polls = int(a.get("data-polls") or 0)
        if tag == "tr" and "data-worker" in a:
            self.rows[a["data-worker"]] = a
        if tag == "g" and "data-request" in a:
            self.timeline.append(a["data-request"])
        if "data-field" in a and "data-value" in a:
            self.values[(a.get("data-worker"), a["data-field"])] = a["data-value"]


def chromium(url: str, tmp_path: Path, *extra: str) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=5000", *extra, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def same(shown: str, value) -> bool:
    if value is None:
        return shown == ""
    if isinstance(value, float):
        return abs(float(shown) - value) < 1e-9
    return shown == str(value)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary: apt-get install -y chromium")
def test_chromium_renders_every_actor_with_the_numbers_of_api_stats(server, tmp_path):
    dom = chromium(server.url + f"/dashboard#key={KEY}", tmp_path, "--dump-dom")
    s = stats(server)                      # idle server: the stable numbers did not move
    page = _Fields()
    page.feed(dom)
    assert page.polls >= 2, "the page did not poll /api/stats twice"
    assert set(page.rows) == {a["worker_id"] for a in s["actors"]}
    for a in s["actors"]:
        w = a["worker_id"]
        assert page.rows[w]["data-role"] == a["role"]
        assert page.rows[w]["data-state"] == a["state"]
        for f in STABLE_FIELDS:
            assert (w, f) in page.values, (w, f)
            assert same(page.values[(w, f)], a[f]), (w, f, page.values[(w, f)], a[f])
        assert (w, "ttft.p50") in page.values and (w, "transfer_rate") in page.values
    r = s["router"]
    for f, v in [("router.max_inflight", r["max_inflight"]), ("router.policy", r["policy"]),
                 ("router.live.prefill", 1), ("router.live.decode", 1),
                 ("router.retries", r["retries"]), ("router.in_flight", 0)]:
        assert same(page.values[(None, f)], v), f
    assert json.loads(page.values[(None, "router.requests")]) == r["requests"]
    assert page.timeline == [q["request_id"] for q in s["requests"]][-40:]

    shot = Path(os.environ.get("RAYPD_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    chromium(server.url + f"/dashboard#key={KEY}", tmp_path, f"--screenshot={shot}",
             "--window-size=1400,1000")
    assert shot.stat().st_size > 10_000
