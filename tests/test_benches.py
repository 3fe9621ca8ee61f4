"""`bench transfer` and `bench disagg` run end to end on the tiny model and report every key."""

from __future__ import annotations

import argparse
import math

import pytest

from raypd.bench.disagg import Workload, make_jobs, run_bench_disagg
from raypd.bench.transfer import run_bench_transfer
from raypd.cli.bench import add_bench_disagg_parser, add_bench_transfer_parser
from router.percentiles import percentile

TINY_LOAD = Workload(window_s=2.0, num_short=4, short_at_start=2, short_prompt=(8, 32),
                     short_output=(8, 16), num_long=2, first_long_s=0.5,
                     long_prompt=(256, 512), long_output=(2, 4))


pytestmark = pytest.mark.usefixtures("ray_session")


def _finite(result: dict, keys: list[str]) -> None:
    for key in keys:
        assert key in result, key
        assert isinstance(result[key], int | float) and math.isfinite(result[key]), \
            (key, result[key])


@pytest.mark.e2e
def test_bench_transfer_reports_every_key_and_halves_bytes_with_a_half_prefix_hit():
    # one transport for both parts: the TTFT part starts a 1P+1D cluster per transport (~8 s
    # each); every transport's own path is tested in test_disagg.py
    r = run_bench_transfer(model="tiny", sizes_mib=(1,), ttft_prompt_tokens=256,
                           transports=("shm",), ttft_transports=("shm",))
    _finite(r, ["memcpy_gbps", "best_same_node_ratio", "transfer_share_of_ttft_256",
                "delta_bytes_saved_ratio"])
    assert r["transports"]["shm"]["1"] > 0
    assert r["ttft_prompt_tokens"] == 256 and r["ttft_transport"] == "shm"
    assert 0 < r["transfer_share_of_ttft_256"] < 1 and "transfer_share_of_ttft_2048" not in r
    assert 0.4 <= r["delta_bytes_saved_ratio"] <= 0.6
    assert r["delta_skipped_blocks"] == r["delta_transferred_blocks"] == 8


@pytest.mark.e2e
def test_bench_disagg_reports_every_key_for_both_setups():
    r = run_bench_disagg(model="tiny", workload=TINY_LOAD, rounds=1, router_baseline=False)
    _finite(r, ["tpot_p99_disagg_s", "tpot_p99_coloc_s", "tpot_p99_ratio", "throughput_ratio",
                "itl_p99_disagg_s", "itl_p99_coloc_s", "ttft_p50_disagg_s",
                "ttft_p99_coloc_s", "wall_s_disagg", "wall_s_coloc"])
    expected = sum(j.max_tokens for j in make_jobs(TINY_LOAD))
    for setup in ("disagg", "coloc"):
        assert r[setup]["errors"] == 0, r[setup]["error_samples"]
        assert r[f"output_tokens_{setup}"] == expected
    assert r["disagg"]["prefilled_by_decode"] == 0          # every prompt went through P
    assert r["coloc"]["prefilled_by_decode"] == len(make_jobs(TINY_LOAD))
    per_worker = r["coloc"]["per_run"][0]["workers"]
    assert [w["requests"] for w in per_worker.values()] == [3, 3]   # pinned alternately


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 99))


def test_parsers_register_quick_model_and_json():
    parser = argparse.ArgumentParser()
    bsub = parser.add_subparsers(dest="bench")
    add_bench_transfer_parser(bsub)
    add_bench_disagg_parser(bsub)
    for name in ("transfer", "disagg"):
        args = parser.parse_args([name, "--quick", "--model", "tiny", "--json", "out.json"])
        assert (args.quick, args.model, args.json) == (True, "tiny", "out.json")
        assert callable(args.func)


def test_bench_transfer_limits_transports_and_sizes_and_refuses_what_it_cannot_do(capsys):
    parser = argparse.ArgumentParser()
    add_bench_transfer_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["transfer", "--transports", "shm,grpc", "--sizes-mib", "1,4"])
    assert (args.transports, args.sizes_mib) == (("shm", "grpc"), (1, 4))
    for bad, says in ((["--transports", "shm,carrier-pigeon"], "unknown transport"),
                      (["--sizes-mib", "0"], "integers >= 1"), (["--sizes-mib", "1,x"], "1,x")):
        with pytest.raises(SystemExit):
            parser.parse_args(["transfer", *bad])
        assert says in capsys.readouterr().err
    args = parser.parse_args(["transfer", "--device", "cuda", "--transports", "shm"])
    with pytest.raises(SystemExit, match="for the CPU bench"):
        args.func(args)
