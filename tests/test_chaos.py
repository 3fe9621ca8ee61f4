"""A short chaos run, each fault kind once: nothing lost, leaked or wrong; corruption detected."""

from __future__ import annotations

import pytest

from raypd.bench.chaos import FAULT_KINDS, run_chaos_bench

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.e2e]


def test_chaos_each_fault_once_loses_nothing_and_leaks_nothing():
    r = run_chaos_bench(kills=1, faults=FAULT_KINDS, requests=30, max_tokens=24, seed=1,
                        deadline_s=60.0)
    assert r["requests_total"] == 30
    assert r["requests_ok"] > 0
    assert r["requests_lost"] == 0, r["lost_errors"]
    assert r["requests_ok"] + r["requests_failed_explicit"] == 30
    assert r["leaked_blocks"] == 0, (r["leak_holders"], r["ledger"])
    assert r["greedy_mismatches"] == 0
    assert r["corrupt_stagings"] >= 1     # the corruption landed in a staged copy
    # every corrupt copy a decode worker pulled was refused (D's own record of what arrived)
    assert r["corrupt_transfers_detected"] == r["corrupt_transfers_injected"]
    assert len(r["killed"]) == 1          # the kill landed while requests were in flight
    assert r["ledger"]["open_holds"] == 0


def test_unknown_fault_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown fault kinds \\['meteor'\\]"):
        run_chaos_bench(faults=("kill", "meteor"))
