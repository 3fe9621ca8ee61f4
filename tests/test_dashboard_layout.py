"""The built-in /dashboard and report.html pass a person's eye, checked in headless Chromium over
the DevTools protocol at 1280x800: nothing overflows its container or overlaps a sibling (from
the rendered boxes), the dashboard shows the handoff stage breakdown, the latest request's
trace and the per-actor KV usage, and with the API key set it asks for the key (the page never
carries it) and works once it is typed in. Screenshots go to the test artifacts
($RAYPD_TEST_ARTIFACTS, default out/test-artifacts/)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import requests
from conftest import ROOT

from protocol.request_trace import STAGES

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)),
                None)
pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="no chromium binary: apt-get install -y chromium")
ARTIFACTS = Path(os.environ.get("RAYPD_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))
KEY = "layout-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
W, H = 1280, 800


@pytest.fixture(scope="module")
def server(ray_session):
    from cluster.config import load_config
    from cluster.serve import start_server
    cfg = load_config("configs/local.yaml", {"model.name": "tiny", "engine.num_blocks": 256,
                                             "transfer.transport": "shm"})
    handle = start_server(cfg, "127.0.0.1", 0, api_key=KEY)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def report_html(server, tmp_path_factory):
    """A report of 8 requests replayed through the server (`raypd submit --html`)."""
    from raypd.cli import main
    from raypd.replay.workload import write_jsonl
    d = tmp_path_factory.mktemp("report")
    write_jsonl([{"prompt": "shared system prompt " * 6 + f"question {i}", "max_tokens": 6}
                 for i in range(8)], d / "t.jsonl")
    assert main(["submit", str(d / "t.jsonl"), "--url", server.url, "--api-key", KEY,
                 "--no-progress", "--out", str(d / "report.json"),
                 "--html", str(d / "report.html")]) == 0
    return d / "report.html"


def browser(tmp_path):
    from chromium_cdp import Browser
    return Browser(CHROMIUM, tmp_path)


def test_dashboard_asks_for_the_key_then_shows_stages_trace_and_kv_without_overlap(
        server, report_html, tmp_path):
    page_html = requests.get(server.url + "/dashboard", timeout=30).text
    assert KEY not in page_html
    with browser(tmp_path) as b:
        b.open(server.url + "/dashboard", W, H)
        # with keys configured every API the page polls needs one: it asks for it
        b.wait("document.querySelector('#trace').dataset.auth === 'needed'")
        assert b.eval("getComputedStyle(document.querySelector('#key-form')).display") == "flex"
        assert b.eval("document.querySelector('#api-key').type") == "password"
        problems = b.layout_problems()
        assert problems == [], problems
        b.type_into("#api-key", KEY)
        b.press_enter()
        b.wait("document.querySelector('#trace').dataset.auth === 'ok' && "
               "document.querySelectorAll('#trace-svg [data-span]').length >= 8")
        assert b.eval("sessionStorage.getItem('raypd.apiKey')") == KEY
        assert KEY not in b.eval("document.documentElement.outerHTML")  # typed, never shown
        shown = b.eval("[...document.querySelectorAll('#trace-svg [data-span]')]"
                       ".map(g => g.dataset.span)")
        assert set(shown) == set(STAGES)
        latest = b.eval("document.querySelector('#trace-svg').dataset.traceRequest")
        t = requests.get(f"{server.url}/v1/requests/{latest}/trace", headers=AUTH,
                         timeout=30).json()
        assert t["status"] == 200 and t["decode_worker"] == "decode-0"
        doc = requests.get(server.url + "/api/traces", headers=AUTH, timeout=30).json()
        b.wait(f"document.querySelector(\"[data-field='traces.requests']\").dataset.value"
               f" === '{doc['requests']}'")
        for st in STAGES:
            for k in ("p50", "p99"):
                v = b.eval(f"document.querySelector(\"[data-field='stage.{st}.{k}']\")"
                           f".dataset.value")
                assert float(v) == pytest.approx(doc["breakdown"][st][k]), (st, k)
        for w in ("prefill-0", "decode-0"):           # per-actor KV usage
            for f in ("blocks_used", "num_blocks", "blocks_cached"):
                assert b.eval(f"!!document.querySelector('[data-worker=\"{w}\"]"
                              f"[data-field=\"{f}\"]')"), (w, f)
        problems = b.layout_problems()
        assert problems == [], problems
        b.eval("window.scrollTo(0, 0)")
        shot = b.screenshot(ARTIFACTS / "dashboard-1280x800.png")
        b.eval("document.querySelector('#stages').scrollIntoView()")
        handoff = b.screenshot(ARTIFACTS / "dashboard-1280x800-handoff.png")
    assert shot.stat().st_size > 20_000 and handoff.stat().st_size > 20_000


def test_report_html_has_the_stage_breakdown_and_nothing_overflows(report_html, tmp_path):
    with browser(tmp_path) as b:
        b.open(report_html.as_uri(), W, H)
        headings = b.eval("[...document.querySelectorAll('h2')].map(h => h.textContent)")
        assert any(h.startswith("Handoff stages") for h in headings), headings
        stages = b.eval("[...document.querySelectorAll('table')].find(t => "
                        "t.querySelector('th')?.textContent === 'stage')"
                        ".querySelectorAll('tbody tr, tr').length")
        assert stages >= len(STAGES)
        problems = b.layout_problems()
        assert problems == [], problems
        shot = b.screenshot(ARTIFACTS / "report-1280x800.png")
    assert shot.stat().st_size > 20_000


PHONE = (390, 844)


def test_kv_timeline_api_serves_every_worker_and_refuses_bad_parameters(server):
    doc = requests.get(server.url + "/api/kv_timeline", headers=AUTH, timeout=30).json()
    assert [w["worker_id"] for w in doc["workers"]] == ["prefill-0", "decode-0"]
    for w in doc["workers"]:
        assert w["t"] and w["total_blocks"] == 256 and w["block_size"] > 0
        n = len(w["t"])
        assert all(len(w[k]) == n for k in ("blocks_used", "blocks_cached", "blocks_free",
                                            "hit_rate"))
        for i in range(n):   # every block is referenced, cached or free
            assert w["blocks_used"][i] + w["blocks_cached"][i] + w["blocks_free"][i] == \
                w["total"][i]
    assert requests.get(server.url + "/api/kv_timeline", timeout=30).status_code == 401
    for q, param in (("max_points=1", "max_points"), ("window_s=nan", "window_s"),
                     ("since=soon", "since"), ("points=3", "points")):
        r = requests.get(f"{server.url}/api/kv_timeline?{q}", headers=AUTH, timeout=30)
        assert r.status_code == 400, q
        assert param in r.json()["error"]["message"], r.json()


def test_dashboard_kv_timeline_grows_and_fits_a_phone(server, report_html, tmp_path):
    with browser(tmp_path) as b:
        b.open(server.url + f"/dashboard#key={KEY}", *PHONE)   # a phone
        b.wait("document.querySelectorAll('#kv-cards svg[data-points]').length === 2")
        n0 = {w: b.eval(f"+document.querySelector('#kv-cards svg[data-worker=\"{w}\"]')"
                        ".dataset.points") for w in ("prefill-0", "decode-0")}
        # the timeline grows while the page is open (a request makes the workers step)
        requests.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": "grow the timeline", "max_tokens": 4})
        b.wait("+document.querySelector('#kv-cards svg[data-worker=\"decode-0\"]')"
               f".dataset.points > {n0['decode-0']} || "
               f"{n0['decode-0']} >= 300", timeout_s=30)
        doc = requests.get(server.url + "/api/kv_timeline", headers=AUTH, timeout=30).json()
        for w in doc["workers"]:        # the pool size shown is the worker's
            v = b.eval(f"document.querySelector('[data-worker=\"{w['worker_id']}\"]"
                       "[data-field=\"kv.total_blocks\"]').dataset.value")
            assert int(v) == w["total_blocks"] == 256
        problems = b.layout_problems()
        assert problems == [], problems
        b.eval("document.querySelector('#kv-timeline').scrollIntoView()")
        shot = b.screenshot(ARTIFACTS / "dashboard-390x844-kv.png")
    with browser(tmp_path / "wide") as b:       # a fresh profile for each browser
        b.open(server.url + f"/dashboard#key={KEY}", W, H)
        b.wait("document.querySelectorAll('#kv-cards svg[data-points]').length === 2")
        problems = b.layout_problems()
        assert problems == [], problems
        b.eval("document.querySelector('#kv-timeline').scrollIntoView()")
        wide = b.screenshot(ARTIFACTS / "dashboard-1280x800-kv.png")
    assert shot.stat().st_size > 10_000 and wide.stat().st_size > 10_000


def test_report_first_screen_answers_was_it_good_with_the_json_figures(report_html, tmp_path):
    import json
    report = json.loads((report_html.parent / "report.json").read_text())
    tl = report["kv_timeline"]
    assert [w["worker_id"] for w in tl["workers"]] == ["prefill-0", "decode-0"]
    assert all(w["t"] for w in tl["workers"])
    assert report["kv_story"]["boundary"] and report["kv_story"]["reuse"]["t"]
    for size, name in (((W, H), "report-1280x800-first-screen.png"),
                       (PHONE, "report-390x844-first-screen.png")):
        with browser(tmp_path / name) as b:     # a fresh profile for each browser
            b.open(report_html.as_uri(), *size)
            first = b.eval("document.querySelector('#verdict').getBoundingClientRect().top")
            assert first < 120            # the answer comes first, before any parameters
            shown = b.eval("Object.fromEntries([...document.querySelectorAll('#verdict "
                           ".tile')].map(t => [t.dataset.field, t.dataset.value]))")
            assert float(shown["throughput_tok_s"]) == pytest.approx(report["throughput_tok_s"])
            assert float(shown["goodput"]) == pytest.approx(report["goodput"])
            assert float(shown["ttft_s.p50"]) == pytest.approx(report["ttft_s"]["p50"])
            assert float(shown["peak_kv_share"]) == pytest.approx(
                report["kv_story"]["peak_kv_share"])
            assert int(shown["requests_failed"]) == report["requests_failed"]
            evidence = b.eval("[...document.querySelectorAll('#verdict .tile .ev')]"
                              ".map(e => e.textContent)")
            assert evidence and set(evidence) == {report["evidence_level"]}
            order = b.eval("[...document.querySelectorAll('h2')].map(h => h.textContent)")
            assert order.index("Was it good?") < order.index("KV cache over time") < \
                order.index("Parameters") < len(order) - 1   # raw keys last
            assert order[-1].startswith("All figures")
            problems = b.layout_problems()
            assert problems == [], problems
            shot = b.screenshot(ARTIFACTS / name)
            assert shot.stat().st_size > 10_000
