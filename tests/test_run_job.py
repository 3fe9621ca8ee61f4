"""`raypd run`: the whole job (embedded Ray, P/D cluster, HTTP server, synthetic trace, report)
on the tiny model; a bad --trace stops it before anything starts."""

from __future__ import annotations

import argparse
import json

import pytest
import ray

from raypd.cli.run import add_run_parser

CONFIG = "model: {name: tiny}\nengine: {num_blocks: 256}\n"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", *argv])
    return args.func(args)


@pytest.mark.e2e
def test_run_replays_the_builtin_trace_and_writes_the_report(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    out = tmp_path / "report"
    had_ray = ray.is_initialized()     # the job joins a running Ray, else starts its own
    code = _run(["--config", str(cfg), "--requests", "12", "--synth-rate", "30",
                 "--out-dir", str(out), "--no-progress"])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["requests_sent"] == 12 and rep["requests_ok"] == 12
    assert rep["params"]["prefill"] == 1 and rep["params"]["decode"] == 1
    assert rep["params"]["model"] == "tiny" and rep["params"]["block_size"] == 16
    assert rep["hit_rate"] > 0 and rep["reused_tokens"] > 0      # shared system prompts
    assert rep["transfer_bytes"] > 0 and rep["peak_blocks_used"] > 0
    assert {a["role"] for a in rep["per_actor"]} == {"prefill", "decode"}
    assert rep["diagnosis"] and rep["evidence_level"] == "cpu-measured"
    outputs = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 12
    for o in outputs:     # token ids and lifecycle joined from the server side
        assert len(o["token_ids"]) == o["usage"]["completion_tokens"] == \
            o["lifecycle"]["output_tokens"]
    assert (out / "report.html").stat().st_size > 10_000
    assert (out / "trace.jsonl").exists()
    printed = capsys.readouterr().out
    assert "requests: 12 ok, 0 failed of 12 sent" in printed and "diagnosis:" in printed
    assert ray.is_initialized() == had_ray   # ... and shuts down only the one it started


def test_run_with_a_bad_trace_starts_nothing(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt": "a"}\n{"prompt": "b", "session": 3}\n')
    had_ray = ray.is_initialized()
    code = _run(["--trace", str(trace), "--out-dir", str(tmp_path / "r")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: {trace}:2: 'session' must be a string")
    assert ray.is_initialized() == had_ray and not (tmp_path / "r").exists()
