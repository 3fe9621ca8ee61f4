"""A short chaos run: random workers killed mid-replay; nothing lost, leaked or wrong."""

from __future__ import annotations

import pytest

from cluster.bench_chaos import run_chaos_bench

pytestmark = pytest.mark.usefixtures("ray_session")


def test_chaos_kills_lose_nothing_and_leak_nothing():
    r = run_chaos_bench(kills=3, requests=40, max_tokens=48, seed=1)
    assert r["requests_total"] == 40
    assert r["requests_lost"] == 0
    assert r["requests_ok"] + r["requests_failed_explicit"] == 40
    assert r["leaked_blocks"] == 0
    assert r["greedy_mismatches"] == 0
    assert len(r["killed"]) == 3          # each kill lands while requests are in flight
