"""Mooncake trace loading: malformed lines name the file and line, and nothing is replayed."""

import json
from argparse import Namespace

import pytest

from raypd.cli import main
from raypd.cli.simulate import cmd_route_sim
from raypd.replay.mooncake import (
    WorkloadError,
    chained_hashes,
    load_trace,
    namespace_root,
    scaled_tokens,
)

GOOD = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 40, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 90, "input_length": 512, "output_length": 0, "hash_ids": [3]},
]


def write(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines))
    return path


def test_loads_a_good_trace(tmp_path):
    reqs = load_trace(write(tmp_path, GOOD + [""]))  # a blank line is skipped
    assert [r.timestamp_s for r in reqs] == [0.0, 0.04, 0.09]
    assert reqs[1].hash_ids == (0, 1, 2) and reqs[1].line == 2
    assert len(load_trace(write(tmp_path, GOOD), limit=2)) == 2


BAD_LINES = {
    "invalid JSON": '{"timestamp": 5, "input_length": ',
    "missing key 'hash_ids'": {"timestamp": 5, "input_length": 10, "output_length": 1},
    "'input_length' must be an integer": {"timestamp": 5, "input_length": "10",
                                          "output_length": 1, "hash_ids": [9]},
    "'output_length' must be an integer": {"timestamp": 5, "input_length": 10,
                                           "output_length": True, "hash_ids": [9]},
    "'timestamp' must be a finite number": {"timestamp": -1, "input_length": 10,
                                            "output_length": 1, "hash_ids": [9]},
    "'hash_ids' must hold integers": {"timestamp": 5, "input_length": 10, "output_length": 1,
                                      "hash_ids": ["a"]},
    "len(hash_ids) = 1, expected": {"timestamp": 5, "input_length": 600, "output_length": 1,
                                    "hash_ids": [9]},
    "expected a JSON object": [1, 2, 3],
}


@pytest.mark.parametrize("what", list(BAD_LINES))
def test_malformed_line_names_file_and_line(tmp_path, what):
    path = write(tmp_path, [GOOD[0], "", GOOD[1], BAD_LINES[what], GOOD[2]])
    with pytest.raises(WorkloadError) as e:
        load_trace(path)
    assert str(e.value).startswith(f"{path}:4: ")
    assert what in str(e.value)
    assert e.value.line == 4 and e.value.path == str(path)


def _args(trace, **kw):
    base = dict(trace=trace, policy="locality", prefill_workers=2, capacity_blocks=64,
                block_tokens=512, prefill_tok_s=8000.0, overhead_s=0.02,
                attn_ctx_tokens=32768.0, index="precise", approx_ttl_s=120.0, ttft_slo_s=None,
                limit=None, json=None)
    base.update(kw)
    return Namespace(**base)


def test_route_sim_on_a_malformed_trace_replays_nothing(tmp_path, capsys):
    path = write(tmp_path, [GOOD[0], GOOD[1], {"timestamp": 1}])
    out_json = tmp_path / "out.json"
    assert cmd_route_sim(_args(path, json=out_json)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {path}:3: missing key")
    assert captured.out == "" and not out_json.exists()


def test_route_sim_replays_every_request_of_a_good_trace(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    out_json = tmp_path / "sub" / "out.json"
    assert main(["route-sim", str(path), "--policy", "cache_aware", "--prefill-workers", "1",
                 "--capacity-blocks", "16", "--json", str(out_json)]) == 0
    d = json.loads(out_json.read_text())
    assert d == json.loads(capsys.readouterr().out)
    assert d["num_requests"] == 3 and d["rejected"] == 0
    # request 2 reuses both blocks of request 1: 1024 of 1500 tokens; 3,012 prompt tokens in all
    assert d["hit_rate"] == pytest.approx(1024 / 3012)
    assert d["ceiling_hit_rate"] == pytest.approx(1024 / 3012)
    assert d["hit_ratio_of_ceiling"] == pytest.approx(1.0)
    for key in ("max_over_mean_load", "ttft_p50_s", "ttft_p99_s"):
        assert key in d


def test_bad_cli_values_are_errors(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert cmd_route_sim(_args(path, capacity_blocks=0)) == 2
    assert "--capacity-blocks must be > 0" in capsys.readouterr().err
    assert cmd_route_sim(_args(tmp_path / "missing.jsonl")) == 2


def test_block_tokens_scale_prompt_lengths_not_blocks():
    assert scaled_tokens(1000, 512) == 1000
    assert scaled_tokens(513, 64) == 65            # still 2 blocks of 64
    assert scaled_tokens(1024, 16) == 32


def test_trace_ids_become_chained_hashes_per_tenant():
    a, b = chained_hashes([0, 1], namespace_root()), chained_hashes([0, 2], namespace_root())
    assert a[0] == b[0] and a[1] != b[1]
    assert not set(a) & set(chained_hashes([0, 1], namespace_root("tenant-b")))
