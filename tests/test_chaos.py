"""A short chaos run, each fault kind once: every fault applied (a corrupted copy reached a
decode worker and was refused), nothing lost, leaked or wrong; and the verdict fails a run
that exercised nothing."""

from __future__ import annotations

import pytest

from raypd.bench.chaos import FAULT_KINDS, run_chaos_bench, verdict


@pytest.mark.usefixtures("ray_session")
@pytest.mark.e2e
def test_chaos_each_fault_once_is_applied_detected_and_loses_nothing():
    r = run_chaos_bench(kills=1, faults=FAULT_KINDS, requests=30, max_tokens=24, seed=1,
                        deadline_s=60.0)
    assert r["passed"], r["failures"]
    assert r["faults_not_injected"] == [] and r["stalled_after_requests"] is None
    assert r["requests_total"] == 30
    assert r["requests_lost"] == 0, r["lost_errors"]
    assert r["requests_ok"] + r["requests_failed_explicit"] == 30
    assert r["leaked_blocks"] == 0, (r["leak_holders"], r["ledger"])
    assert r["greedy_mismatches"] == 0
    # a corrupted copy reached a decode worker, and every one that did was refused
    assert r["corrupt_transfers_injected"] >= 1
    assert r["corrupt_transfers_detected"] == r["corrupt_transfers_injected"]
    assert r["transfers_rejected"].get("corrupt", 0) >= 1
    assert len(r["killed"]) == 1          # the worker came back as a new process
    # armed on every worker of the role, disarmed once one applied: a second may land meanwhile
    assert r["delays_applied"] >= 1 and r["acks_dropped"] >= 1 and r["client_aborts"] == 1
    assert r["ledger"]["open_holds"] == 0


def test_verdict_fails_a_run_that_exercised_no_corruption_or_stalled():
    clean = dict(faults=("corrupt",), total=10, ok=10, lost=0, leaked=0, mismatches=0,
                 corrupt_pulled=1, corrupt_detected=1, not_injected=[], stalled_at=None)
    assert verdict(**clean) == []
    assert verdict(**(clean | {"corrupt_pulled": 0, "corrupt_detected": 0})) == [
        "no corrupt transfer was exercised (no corrupted copy reached a decode worker)"]
    assert verdict(**(clean | {"corrupt_detected": 0})) == [
        "corrupt transfers not detected: 1 of 1"]
    stalled = verdict(**(clean | {"stalled_at": 4, "not_injected": ["kill", "delay"]}))
    assert stalled == ["progress stalled after 4 of 10 requests",
                       "faults not injected: delay, kill"]
    assert verdict(**(clean | {"leaked": None})) == [
        "leaked blocks: unknown (a worker could not be counted: leak_unknown)"]


def test_unknown_fault_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown fault kinds \\['meteor'\\]"):
        run_chaos_bench(faults=("kill", "meteor"))
