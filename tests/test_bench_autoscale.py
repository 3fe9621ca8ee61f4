"""raypd bench autoscale's pieces that decide its verdict: the trace's phases, the static
splits it compares with, and the targets (each of which can fail)."""

from __future__ import annotations

import pytest

from raypd.bench.autoscale import Phase, static_splits, trace, verdict
from raypd.cli import main


def test_trace_has_a_quiet_phase_a_burst_and_a_quiet_phase_again():
    reqs = trace([Phase(1.0, 60), Phase(20.0, 30), Phase(1.0, 60)], (8, 16), 250, seed=3,
                 max_tokens=64, long_share=0.2, long_tokens=900)
    at = [t for t, _, _ in reqs]
    assert at == sorted(at)
    quiet1 = sum(t < 60 for t in at)
    burst = sum(60 <= t < 90 for t in at)
    quiet2 = sum(t >= 90 for t in at)
    assert 30 < quiet1 < 100 and 450 < burst < 750 and 30 < quiet2 < 100
    assert all(8 <= len(p) <= 16 and min(p) >= 3 for _, p, _ in reqs)
    longs = sum(n == 900 for _, _, n in reqs)
    assert {n for _, _, n in reqs} == {64, 900} and 0.1 < longs / len(reqs) < 0.3
    assert reqs == trace([Phase(1.0, 60), Phase(20.0, 30), Phase(1.0, 60)], (8, 16), 250, 3,
                         64, 0.2, 900)


def test_static_splits_keep_both_roles_and_try_the_autoscaled_split_first():
    assert static_splits(4, (2, 2), 3) == [(2, 2), (1, 3), (3, 1)]
    assert static_splits(2, (0, 2), 5) == [(1, 1)]       # colocated peak: not a static split
    assert static_splits(5, (1, 4), 1) == [(1, 4)]


def _run(**kw) -> dict:
    r = {"requests_lost": 0, "leaked_blocks": 0, "greedy_mismatches": 0, "scale_downs": 1,
         "migrations": 1, "migrations_by_cause": {"drain": 1}, "slo_attainment": 0.95, "slo_attainment_static": 0.97,
         "worker_seconds": 100.0, "worker_seconds_static": 150.0}
    r.update(kw)
    return r


@pytest.mark.parametrize("change, target", [
    ({"requests_lost": 1}, "no_lost"), ({"leaked_blocks": 2}, "no_leaked"),
    ({"greedy_mismatches": 1}, "no_mismatches"),
    ({"migrations_by_cause": {"rebalance": 3}}, "scale_down_migrated"),
    ({"scale_downs": 0}, "scale_down_migrated"), ({"slo_attainment": 0.91},
                                                  "slo_within_5_points"),
    ({"worker_seconds": 150.0}, "fewer_worker_seconds")])
def test_each_target_can_fail(change, target):
    static = {"requests_lost": 0, "leaked_blocks": 0}
    assert all(verdict(_run(), [static]).values())
    got = verdict(_run(**change), [static])
    assert [k for k, v in got.items() if not v] == [target]


def test_a_static_run_that_lost_a_request_fails_the_no_lost_target():
    got = verdict(_run(), [{"requests_lost": 1, "leaked_blocks": 0}])
    assert not got["no_lost"]


def test_bench_autoscale_refuses_a_bad_initial_size(capsys):
    assert main(["bench", "autoscale", "--initial", "2"]) != 0
    assert "--initial must be P:D" in capsys.readouterr().err
