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


def test_the_main_jobs_pool_is_sized_for_its_trace_unless_a_config_or_flag_says(tmp_path):
    """`raypd run` alone: DEFAULT_NUM_BLOCKS per worker (the built-in trace fills it: the report
    shows the boundary); --num-blocks wins; --config keeps its own pool; a pool of 0 is refused."""
    from cluster.config import ConfigError
    from raypd.cli.run import run_config
    from raypd.replay.run_job import DEFAULT_NUM_BLOCKS

    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers())
    assert run_config(parser.parse_args(["run"])).engine.num_blocks == DEFAULT_NUM_BLOCKS
    assert run_config(parser.parse_args(["run", "--num-blocks", "96"])).engine.num_blocks == 96
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert run_config(parser.parse_args(["run", "--config", str(cfg)])).engine.num_blocks == 256
    with pytest.raises(ConfigError, match="num_blocks"):
        run_config(parser.parse_args(["run", "--num-blocks", "0"]))
