"""Trace formats, `raypd submit` end to end against the HTTP server, and the report's figures."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from raypd.cli.replay import add_submit_parser
from raypd.replay.mooncake import WorkloadError
from raypd.replay.report import build_report, diagnose
from raypd.replay.submit import RequestRecord, parse_metrics, request_body
from raypd.replay.workload import (
    SynthConfig,
    expand_hash_ids,
    load_workload,
    parse_raypd_line,
    repeated_prefix_shares,
    synth_trace,
    write_jsonl,
)
from router.percentiles import percentiles

MOONCAKE_LINES = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 3]},
    {"timestamp": 900, "input_length": 200, "output_length": 4, "hash_ids": [9]},
]


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ---- workloads -----------------------------------------------------------------------------
def test_mooncake_expansion_is_deterministic_and_shares_prefixes(tmp_path):
    path = _write(tmp_path / "m.jsonl", MOONCAKE_LINES)
    a = load_workload(path, block_tokens=8, vocab_size=259)
    b = load_workload(path, block_tokens=8, vocab_size=259)
    assert [i.prompt for i in a] == [i.prompt for i in b]
    assert [len(i.prompt) for i in a] == [18, 24, 4]       # ceil(len * 8 / 512)
    assert a[0].prompt[:16] == a[1].prompt[:16]              # hash ids 0, 1 shared
    assert a[0].prompt[16:] != a[1].prompt[16:18]           # hash id 2 vs 3
    assert a[2].prompt != a[0].prompt[:4]
    assert all(100 <= t < 259 for i in a for t in i.prompt)
    assert [i.max_tokens for i in a] == [5, 3, 4] and all(i.ignore_eos for i in a)
    assert expand_hash_ids([7], 16, 16) == expand_hash_ids([7, 8], 16, 16)
    assert repeated_prefix_shares(a) == [0.0, pytest.approx(2 / 3), 0.0]


def test_synth_trace_shares_system_prompts_and_repeats_conversations():
    rows = synth_trace(SynthConfig(requests=40, system_prompts=3, turns=3, rate=5, seed=1))
    assert rows == synth_trace(SynthConfig(requests=40, system_prompts=3, turns=3, rate=5,
                                           seed=1))
    assert len(rows) == 40
    assert len({r["messages"][0]["content"] for r in rows}) <= 3
    ts = [r["timestamp"] for r in rows]
    assert ts == sorted(ts) and ts[-1] > 0
    by_session: dict[str, list[dict]] = {}
    for r in rows:
        by_session.setdefault(r["session"], []).append(r)
    multi = [s for s in by_session.values() if len(s) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt["messages"][:len(prev["messages"])] == prev["messages"]
            assert nxt["messages"][len(prev["messages"])]["role"] == "assistant"
    assert all(16 <= r["max_tokens"] <= 32 for r in rows)


@pytest.mark.parametrize("bad, words", [
    ('{"prompt": "hi", "max_token": 3}', "unknown key 'max_token'"),
    ('{"prompt": "hi", "messages": []}', "exactly one of"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),  # the server's words
    ('{"prompt": [1, -2]}', "prompt: token ids must be"),
    ('{"prompt": "hi", "tenant": "' + "t" * 200 + '"}', "tenant: must be at most"),
    ('{"prompt": "hi", "timestamp": -1}', "'timestamp'"),
    ('{"prompt": "hi", "max_tokens": 0}', "'max_tokens'"),
    ('{"prompt": "hi"', "invalid JSON"),
])
def test_malformed_raypd_line_names_file_and_line(tmp_path, bad, words):
    path = _write(tmp_path / "t.jsonl", ['{"prompt": "a"}', "", bad, '{"prompt": "b"}'])
    with pytest.raises(WorkloadError) as e:
        load_workload(path)
    assert str(e.value).startswith(f"{path}:3: ") and words in str(e.value)


def test_malformed_mooncake_line_names_file_and_line(tmp_path):
    rows = [*MOONCAKE_LINES[:2], {"timestamp": 1, "input_length": 1100, "output_length": 5,
                                  "hash_ids": [1]}]
    path = _write(tmp_path / "m.jsonl", rows)
    with pytest.raises(WorkloadError, match=re.escape(f"{path}:3: len(hash_ids)")):
        load_workload(path)


def test_request_bodies_follow_the_trace():
    items = synth_trace(SynthConfig(requests=1))
    path, body = request_body(parse_raypd_line(items[0], 1), "m")
    assert path == "/v1/chat/completions" and body["messages"] == items[0]["messages"]
    assert body["ignore_eos"] is True and body["max_tokens"] == items[0]["max_tokens"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


# ---- the report on made-up records ---------------------------------------------------------
def _rec(i, ok=True, ttft=0.1, dur=1.0, out=11, prompt=100, cached=0, inflight=1, rep=0.0):
    return RequestRecord(f"r{i}", ok=ok, status=200 if ok else 429,
                         error="" if ok else "busy", sent_s=i, first_token_s=i + ttft,
                         end_s=i + ttft + dur, output_tokens=out if ok else 0,
                         prompt_tokens=prompt, cached_tokens=cached,
                         in_flight_at_send=inflight, repeated_prefix=rep,
                         itl_s=[dur / (out - 1)] * (out - 1) if ok else [])


def test_percentiles_interpolate():
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (p["p50"], p["p90"], p["mean"], p["n"]) == (3.0, 4.6, 3.0, 5)
    assert percentiles([])["p50"] is None


def test_report_counts_goodput_and_hit_rate():
    recs = [_rec(0, ttft=0.1), _rec(1, ttft=3.0), _rec(2, dur=5.0), _rec(3, ok=False),
            _rec(4, cached=50)]
    rep = build_report(recs, params={"model": "m"}, wall_s=10.0, slo_ttft_s=1.0,
                       slo_tpot_s=0.2, concurrency=4)
    assert rep["requests_ok"] + rep["requests_failed"] == rep["requests_sent"] == 5
    assert rep["requests_failed"] == 1 and rep["failures_by_status"] == {"429": 1}
    assert rep["goodput"] == pytest.approx(2 / 5)   # r1: TTFT, r2: TPOT 0.5, r3: failed
    assert rep["hit_rate"] == pytest.approx(50 / 400) and rep["reused_tokens"] == 50
    assert rep["ttft_s"]["n"] == 4 and rep["tpot_s"]["p50"] == pytest.approx(0.1)
    assert rep["evidence_level"] == "cpu-measured"
    json.dumps(rep)


def _findings(m, records=(), per_actor=()):
    return [d["finding"].split(":")[0] for d in diagnose(m, list(records), list(per_actor))]


def test_diagnosis_rules_fire_on_their_figures():
    assert _findings({"peak_block_share": 0.97, "evictions": 40}) == ["capacity bound",
                                                                      "capacity action"]
    assert _findings({"repeated_prefix_share": 0.7, "hit_rate": 0.1}) == ["reuse not effective"]
    slow_hits = [_rec(i, ttft=1.0, cached=90) for i in range(6)] + \
                [_rec(i + 6, ttft=1.0, cached=0) for i in range(6)]
    assert _findings({"repeated_prefix_share": 0.5, "hit_rate": 0.45},
                     slow_hits) == ["reuse not effective"]
    crowd = [_rec(i, ttft=0.1, inflight=1) for i in range(12)] + \
            [_rec(i + 12, ttft=1.0, inflight=8) for i in range(12)]
    assert _findings({"block_utilization": 0.5}, crowd) == ["allocation or scheduling"]
    assert _findings({"peak_block_share": 0.2}, per_actor=[{"busy_share": 0.1}]) == \
        ["request organisation"]
    none = diagnose({"peak_block_share": 0.6}, [], [{"busy_share": 0.9}])
    assert none[0]["finding"].startswith("no rule") and "peak_block_share" in none[0]["because"]


def test_parse_metrics_reads_per_worker_gauges():
    text = ('raypd_kv_blocks_used{role="decode",worker="decode-0"} 7.0\n'
            '# TYPE raypd_kv_evictions_total counter\n'
            'raypd_kv_evictions_total{role="decode",worker="decode-0"} 3.0\n'
            'raypd_kv_blocks_total{role="prefill",worker="prefill-0"} 64.0\n')
    rows = {r["worker_id"]: r for r in parse_metrics(text)}
    assert rows["decode-0"]["blocks_used"] == 7 and rows["decode-0"]["evictions"] == 3
    assert rows["prefill-0"] == {"worker_id": "prefill-0", "role": "prefill", "num_blocks": 64}


# ---- end to end through the HTTP server ----------------------------------------------------
@pytest.fixture(scope="module")
def server(ray_session):
    from cluster.config import load_config
    from cluster.pd import PDCluster
    from cluster.serve import start_server
    from raypd.replay.run_job import RecordingBackend
    cfg = load_config(None, {"model.name": "tiny", "engine.num_blocks": 256})
    cluster = PDCluster(cfg.to_pd_config())
    backend = RecordingBackend(cluster)
    handle = start_server(cfg, "127.0.0.1", 0, backend=backend)
    yield handle, backend
    handle.stop()
    cluster.shutdown()


def _submit(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_submit_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["submit", *argv])
    return args.func(args)


def test_submit_replays_a_small_trace_and_counts_add_up(server, tmp_path, capsys):
    handle, backend = server
    rows = synth_trace(SynthConfig(requests=8, system_prompts=2, turns=2, rate=50,
                                   max_tokens=(3, 5)))
    rows.insert(3, {"id": "too-big-id", "prompt": [5, 999999], "max_tokens": 3})
    rows.append({"id": "ids", "prompt": [7, 8, 9, 10], "max_tokens": 4})
    trace = tmp_path / "t.jsonl"
    write_jsonl(rows, trace)
    out, html_path, outputs = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "o.jsonl"
    code = _submit([str(trace), "--url", handle.url, "--timestamps", "--concurrency", "4",
                    "--out", str(out), "--html", str(html_path), "--outputs", str(outputs),
                    "--no-progress"])
    assert code == 0
    rep = json.loads(out.read_text())
    assert rep["requests_sent"] == 10
    assert rep["requests_ok"] + rep["requests_failed"] == rep["requests_sent"]
    assert rep["requests_failed"] == 1 and rep["failures_by_status"] == {"400": 1}
    assert rep["errors"][0]["id"] == "too-big-id" and "token ids" in rep["errors"][0]["error"]
    assert rep["ttft_s"]["n"] == 9 and rep["throughput_tok_s"] > 0
    assert rep["hit_rate"] > 0                         # shared system prompts
    assert {a["worker_id"] for a in rep["per_actor"]} == {"prefill-0", "decode-0"}
    lines = [json.loads(x) for x in outputs.read_text().splitlines()]
    arrival = sorted(rows, key=lambda r: r.get("timestamp", 0))   # no timestamp: 0
    assert [x["id"] for x in lines] == [r["id"] for r in arrival]
    by_id = {x["id"]: x for x in lines}
    assert by_id["ids"]["usage"]["completion_tokens"] == 4
    assert by_id["ids"]["text"] == backend.results[by_id["ids"]["request_id"]].text
    page = html_path.read_text()
    assert "data:image/png;base64," in page and not re.search(r"(src|href)=['\"]http", page)
    assert "requests: 9 ok, 1 failed of 10 sent" in capsys.readouterr().out


def test_submit_bad_trace_line_replays_nothing(server, tmp_path, capsys):
    handle, backend = server
    trace = _write(tmp_path / "bad.jsonl", ['{"prompt": "a", "max_tokens": 2}',
                                            '{"prompt": "b", "max_tokens": "two"}'])
    seen = len(backend.results)
    code = _submit([trace, "--url", handle.url, "--out", str(tmp_path / "r.json")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: {trace}:2: 'max_tokens'")
    assert len(backend.results) == seen and not (tmp_path / "r.json").exists()
