"""Per-request handoff traces: the typed record, the bounded store the orchestrator feeds, the
stage breakdown, the text timeline and the Chrome trace export (no Ray, no model); then one
served request's trace over HTTP and `raypd trace-request` (tiny model, 1P + 1D)."""

from __future__ import annotations

import json

import pytest

from protocol.request_trace import STAGES, PrefillTiming, RequestTrace
from raypd.replay.trace_views import chrome_trace, timeline_lines
from router.request_traces import TraceStore, stage_breakdown


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> None:
        self.t += dt


def one_request(store: TraceStore, clock: Clock, rid: str = "r1", tokens: int = 4) -> None:
    """Drive the hooks in the orchestrator's order with known durations (seconds)."""
    store.start(rid)
    clock.tick(0.010)
    store.routed(rid, "decode-0")
    clock.tick(0.005)
    store.admitted(rid, "decode-0", local=False)
    clock.tick(0.100)          # P round trip: queue 0.02 (0.005 in its engine) + compute 0.07 + staging 0.01
    store.prefilled(rid, "prefill-0", PrefillTiming(0.005, 0.07, 0.01))
    clock.tick(0.030)
    store.transferred(rid, "decode-0", {"transfer_bytes": 4096})
    for _ in range(tokens):
        clock.tick(0.004)
        store.tokens(rid, 1)
    clock.tick(0.001)
    store.finish(rid, 200)


def test_hooks_build_each_stage_with_its_actor_and_duration():
    clock = Clock()
    store = TraceStore(clock=clock)
    one_request(store, clock)
    t = store.get("r1")
    secs = t.stage_seconds()
    want = {"route": 0.010, "admit": 0.005, "prefill_queue": 0.02, "prefill_compute": 0.07,
            "staging": 0.01, "transfer": 0.030, "first_decode": 0.008, "decode": 0.008}
    assert set(secs) == set(want)
    for stage, s in want.items():
        assert secs[stage] == pytest.approx(s), stage
    actors = {s.stage: s.actor for s in t.spans}
    assert actors["route"] == "router" and actors["admit"] == "decode-0"
    assert actors["prefill_compute"] == "prefill-0" and actors["transfer"] == "decode-0"
    assert (t.prefill_worker, t.decode_worker, t.status) == ("prefill-0", "decode-0", 200)
    assert t.ttft_s == pytest.approx(0.149) and t.transfer_bytes == 4096
    assert t.prefill_engine_queue_s == pytest.approx(0.005)
    assert len(t.token_times) == 4 and t.e2e_s == pytest.approx(0.162)
    # P's stages fill the round trip from admission to its answer, contiguous
    spans = {s.stage: s for s in t.spans}
    assert spans["admit"].end == pytest.approx(spans["prefill_queue"].start)
    assert spans["prefill_queue"].end == pytest.approx(spans["prefill_compute"].start)
    # ... and the stages tile the whole request up to its last token
    assert sum(secs.values()) == pytest.approx(t.token_times[-1] - t.arrival)
    assert spans["prefill_compute"].end == pytest.approx(spans["staging"].start)
    assert spans["staging"].end == pytest.approx(spans["transfer"].start)


def test_store_keeps_only_the_last_n_and_ignores_unknown_ids():
    clock = Clock()
    store = TraceStore(capacity=3, clock=clock)
    for i in range(5):
        one_request(store, clock, rid=f"r{i}")
    assert len(store) == 3 and store.get("r0") is None and store.get("r1") is None
    assert [t.request_id for t in store.recent()] == ["r2", "r3", "r4"]
    for hook in (store.routed, store.transferred):     # evicted / unknown: nothing happens
        hook("r0", "decode-0")
    store.tokens("nope", 3)
    store.finish("nope", 200)
    assert store.get("nope") is None


def test_unfinished_requests_are_not_in_the_breakdown():
    clock = Clock()
    store = TraceStore(clock=clock)
    one_request(store, clock, "done")
    store.start("running")
    assert [t.request_id for t in store.recent()] == ["done"]


def test_stage_breakdown_gives_p50_and_p99_per_stage_of_ok_requests():
    clock = Clock()
    store = TraceStore(clock=clock)
    for i in range(10):
        one_request(store, clock, rid=f"r{i}", tokens=2 + i)
    store.start("bad")
    store.finish("bad", 429)
    b = stage_breakdown(store.recent())
    assert [s for s in b if s in STAGES] == [s for s in STAGES if s in b]
    assert b["transfer"]["n"] == 10 and b["transfer"]["p50"] == pytest.approx(0.030)
    decode = [0.004 * i for i in range(10)]    # 2 + i tokens: i gaps after the first decode
    assert b["decode"]["p99"] == pytest.approx(decode[-2] + 0.91 * (decode[-1] - decode[-2]))
    assert b["ttft"]["n"] == 10 and b["e2e"]["p50"] > b["ttft"]["p50"]


def test_trace_round_trips_through_json():
    clock = Clock()
    store = TraceStore(clock=clock)
    one_request(store, clock)
    t = store.get("r1")
    back = RequestTrace.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t


def test_timeline_prints_one_line_per_stage_in_time_order():
    clock = Clock()
    store = TraceStore(clock=clock)
    one_request(store, clock)
    lines = timeline_lines(store.get("r1"))
    assert "prefill-0 -> decode-0" in lines[0]
    body = [ln.split()[0] for ln in lines[3:]]
    assert body == ["route", "admit", "prefill_queue", "prefill_compute", "staging",
                    "transfer", "first_decode", "decode", "tokens", "finish"]
    assert all(ln.count("|") == 2 for ln in lines[3:-1])       # bars on one scale


def test_chrome_trace_has_one_track_per_actor_and_every_stage():
    clock = Clock()
    store = TraceStore(clock=clock)
    one_request(store, clock, "a")
    one_request(store, clock, "b")
    doc = chrome_trace(store.recent())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["decode-0", "prefill-0", "router"]
    stages = [e for e in doc["traceEvents"] if e.get("cat") == "stage"]
    assert len(stages) == 2 * 8
    for e in stages:
        span = next(s for s in store.get(e["args"]["request_id"]).spans if s.stage == e["name"])
        assert names[e["tid"]] == span.actor
        assert e["ts"] == pytest.approx(span.start * 1e6) and e["dur"] >= 0
    tokens = [e for e in doc["traceEvents"] if e.get("cat") == "token"]
    assert len(tokens) == 8 and {names[e["tid"]] for e in tokens} == {"decode-0"}


# ---- served: one request's trace over HTTP -----------------------------------------------------
KEY = "trace-key"


@pytest.fixture(scope="module")
def server(ray_session):
    from cluster.config import load_config
    from cluster.serve import start_server
    cfg = load_config("configs/local.yaml", {"model.name": "tiny", "engine.num_blocks": 128,
                                             "transfer.transport": "shm"})
    handle = start_server(cfg, "127.0.0.1", 0, api_key=KEY)
    yield handle
    handle.stop()


def test_a_served_request_has_every_handoff_stage_in_its_trace(server, tmp_path, capsys):
    import requests

    from raypd.cli import main
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(server.url + "/v1/completions", headers=auth, timeout=120,
                      json={"model": "tiny", "prompt": "one two three four five six seven "
                            "eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
                            "seventeen", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    url = f"{server.url}/v1/requests/{rid}/trace"
    assert requests.get(url, timeout=30).status_code == 401            # the key is needed
    assert requests.get(server.url + "/v1/requests/nope/trace", headers=auth,
                        timeout=30).status_code == 404
    t = RequestTrace.from_dict(requests.get(url, headers=auth, timeout=30).json())
    assert t.status == 200 and len(t.token_times) == 5
    assert (t.prefill_worker, t.decode_worker) == ("prefill-0", "decode-0")
    assert set(t.stage_seconds()) == set(STAGES)
    assert t.arrival <= t.routed_at <= t.admitted_at <= t.token_times[0] <= t.finished_at
    assert sum(t.stage_seconds().values()) == pytest.approx(t.token_times[-1] - t.arrival,
                                                            abs=1e-6)   # no time unaccounted
    transfer = next(s for s in t.spans if s.stage == "transfer")
    staging = next(s for s in t.spans if s.stage == "staging")
    assert staging.start <= transfer.start and transfer.end <= t.token_times[0] + 1e-3
    assert t.transfer_bytes > 0

    assert requests.get(server.url + "/api/traces", timeout=30).status_code == 401
    summary = requests.get(server.url + "/api/traces", headers=auth, timeout=30).json()
    assert summary["requests"] >= 1 and summary["breakdown"]["transfer"]["n"] >= 1

    out = tmp_path / "one.json"
    assert main(["trace-request", rid, "--url", server.url, "--api-key", KEY,
                 "--perfetto", str(out)]) == 0
    printed = capsys.readouterr().out
    assert rid in printed and "prefill_compute" in printed and "transfer" in printed
    assert {e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"]
            if e["name"] == "thread_name"} == {"router", "prefill-0", "decode-0"}
    assert main(["trace-request", rid, "--url", server.url]) == 2      # no key: clear error
    assert "api-key" in capsys.readouterr().err


def test_submit_reports_the_stage_breakdown_and_writes_perfetto(server, tmp_path, capsys):
    from raypd.cli import main
    from raypd.replay.workload import write_jsonl
    trace = tmp_path / "t.jsonl"
    write_jsonl([{"prompt": f"alpha beta gamma delta epsilon {i} zeta eta theta iota kappa "
                  "lambda mu nu xi omicron pi rho", "max_tokens": 4} for i in range(6)], trace)
    out, perfetto = tmp_path / "report.json", tmp_path / "run.perfetto.json"
    assert main(["submit", str(trace), "--url", server.url, "--api-key", KEY, "--no-progress",
                 "--out", str(out), "--perfetto", str(perfetto)]) == 0
    assert "handoff stages p50/p99: route" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["requests_ok"] == 6
    b = report["stage_breakdown"]
    assert set(STAGES) <= set(b) and all(b[s]["n"] == 6 for s in STAGES)
    assert all(0 <= b[s]["p50"] <= b[s]["p99"] for s in STAGES)
    events = json.loads(perfetto.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {"router", "prefill-0", "decode-0"}
    assert len({e["args"]["request_id"] for e in events if e.get("cat") == "stage"}) == 6
