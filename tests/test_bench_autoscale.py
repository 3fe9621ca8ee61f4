"""raypd bench autoscale's pieces that decide its verdict: the trace's phases, SLOs and rates as
multiples of the machine's measured steps, the static fleets it compares with (every split of
every size), the rival (the smallest static within 5 points, never the peak by construction),
and the targets (each of which can fail)."""

from __future__ import annotations

import pytest

from raypd.bench.autoscale import Phase, quiet_fleet, trace, verdict
from raypd.bench.autoscale_targets import Multiples, StepTimes, derive
from raypd.cli import main
from raypd.sim.static_rivals import fleet_splits, judge


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


def test_fleet_splits_are_every_split_of_every_size_with_both_roles():
    assert fleet_splits(range(2, 5)) == [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (3, 1)]
    assert fleet_splits([1, 3]) == [(1, 2), (2, 1)]         # one worker: no P:D split


STEPS = StepTimes(prefill_step_s=0.01, decode_step_s=0.0005, engine_prefill_step_s=0.002,
                  engine_decode_step_s=0.0002, prefill_tok_s=16_000.0,
                  decode_tok_s=16_000.0, prompt_tokens=160, threads=1,
                  max_num_batched_tokens=512)


def test_slos_and_rates_are_multiples_of_the_measured_steps():
    """A machine 3x slower at every step gets 3x looser SLOs and a third of the rates: the
    bench asks the same of every CPU kind."""
    m = Multiples()
    fast = derive(STEPS, m, mean_prompt=96, mean_output=333)
    slow = derive(StepTimes(**{**STEPS.__dict__, "prefill_step_s": 0.03,
                               "decode_step_s": 0.0015, "prefill_tok_s": 16_000 / 3,
                               "decode_tok_s": 16_000 / 3}), m, 96, 333)
    assert fast.slo_ttft_s == pytest.approx(m.slo_ttft_x * 0.01)
    assert fast.slo_tpot_s == pytest.approx(m.slo_tpot_x * 0.0005)
    assert fast.capacity_rps == pytest.approx(16_000 / 333)          # decode-bound here
    assert fast.burst_rps == pytest.approx(m.burst_x * fast.capacity_rps)
    assert slow.slo_ttft_s == pytest.approx(3 * fast.slo_ttft_s)
    assert slow.slo_tpot_s == pytest.approx(3 * fast.slo_tpot_s)
    assert slow.burst_rps == pytest.approx(fast.burst_rps / 3)
    assert slow.quiet_rps == pytest.approx(fast.quiet_rps / 3)
    with pytest.raises(ValueError, match="quiet_x"):
        Multiples(quiet_x=0.5, burst_x=0.4).validate()


def test_the_quiet_fleet_grows_with_the_quiet_load():
    assert quiet_fleet(STEPS, 1.0, 96, 333) == 2
    assert quiet_fleet(STEPS, 100.0, 96, 333) == 1 + 3     # 9.6k prompt, 33.3k output tok/s


def _row(ws: list[float], att: list[float]) -> list[dict]:
    return [{"worker_seconds": w, "slo_attainment": a} for w, a in zip(ws, att, strict=True)]


def test_the_rival_is_the_smallest_static_within_5_points_not_the_peak():
    auto = _row([200, 220], [0.90, 0.92])                   # median 210 worker-s, 0.91
    statics = {(1, 1): _row([100, 100], [0.50, 0.60]),       # 0.55: not within 5 points
               (1, 2): _row([150, 152], [0.84, 0.90]),       # 0.87: within 5 points (>= 0.86)
               (2, 1): _row([150, 150], [0.70, 0.70]),
               (2, 2): _row([200, 200], [0.95, 0.97])}       # the peak: best, 0.96
    j = judge(auto, statics)
    assert j["smallest_static_meeting_slo"] == "static 1P:2D"
    assert j["worker_seconds_smallest_static_meeting_slo"] == 151
    assert j["best_static"] == "static 2P:2D" and j["slo_attainment_best_static"] == 0.96
    assert j["static_sizes_tried"] == [2, 3, 4]
    assert j["autoscaled_row"]["slo_attainment"]["spread"] == pytest.approx(0.02)
    # 210 worker-s against the rival's 151: missed, though below the peak's 200 it is not
    assert j["targets"] == {"fewer_worker_seconds_than_smallest_static_meeting_slo": False,
                            "slo_within_5_points_of_best_static": True}
    cheaper = judge(_row([140, 145], [0.90, 0.92]), statics)
    assert cheaper["targets"]["fewer_worker_seconds_than_smallest_static_meeting_slo"]


def test_no_static_within_5_points_is_null_and_fails_closed():
    j = judge(_row([100, 100], [0.99, 0.99]), {(1, 1): _row([50, 50], [0.5, 0.5])})
    assert j["smallest_static_meeting_slo"] is None
    assert j["worker_seconds_smallest_static_meeting_slo"] is None
    assert not j["targets"]["fewer_worker_seconds_than_smallest_static_meeting_slo"]


def test_attainment_more_than_5_points_below_the_best_static_fails():
    j = judge(_row([100, 100], [0.80, 0.80]), {(1, 1): _row([90, 90], [0.86, 0.86])})
    assert not j["targets"]["slo_within_5_points_of_best_static"]


def _run(**kw) -> dict:
    r = {"requests_lost": 0, "leaked_blocks": 0, "greedy_mismatches": 0, "scale_downs": 1,
         "moved_by_cause": {"drain": 1}}
    r.update(kw)
    return r


@pytest.mark.parametrize("change, target", [
    ({"requests_lost": 1}, "no_lost"), ({"leaked_blocks": 2}, "no_leaked"),
    ({"leaked_blocks": None}, "no_leaked"), ({"greedy_mismatches": 1}, "no_mismatches"),
    ({"moved_by_cause": {"rebalance": 3}}, "scale_down_migrated"),
    ({"scale_downs": 0}, "scale_down_migrated")])
def test_each_run_target_can_fail(change, target):
    static = {"requests_lost": 0, "leaked_blocks": 0, "greedy_mismatches": 0}
    assert all(verdict([_run(), _run()], [static]).values())
    got = verdict([_run(), _run(**change)], [static])      # one bad repeat is enough
    assert [k for k, v in got.items() if not v] == [target]


def test_a_static_run_that_lost_a_request_fails_the_no_lost_target():
    got = verdict([_run()], [{"requests_lost": 1, "leaked_blocks": 0,
                              "greedy_mismatches": 0}])
    assert not got["no_lost"]


def test_bench_autoscale_refuses_a_bad_initial_size(capsys):
    assert main(["bench", "autoscale", "--initial", "2"]) != 0
    assert "--initial must be P:D" in capsys.readouterr().err
