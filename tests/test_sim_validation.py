"""`simulate --validate`'s judgement (raypd/bench/sim_validation.py): per-metric errors where an
unjudgeable metric is reported instead of hidden by a max, goodput over every request sent
(failed ones count as missed), and calibration kept apart from the replay."""

from __future__ import annotations

import math

from raypd.bench import sim_validation as sv
from raypd.bench.engine import calibration_batches


def test_an_error_that_cannot_be_computed_is_reported_not_hidden_by_max():
    real = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "tpot_p50_s": 0.1, "tpot_p99_s": math.nan,
            "goodput": 0.0}
    sim = {"ttft_p50_s": 1.2, "ttft_p99_s": 1.0, "tpot_p50_s": 0.1, "tpot_p99_s": 0.2,
           "goodput": 0.25}
    err = sv.errors_of(sim, real)
    assert abs(err["ttft_p50_s"] - 0.2) < 1e-12
    assert err["ttft_p99_s"] == 0.5 and err["tpot_p50_s"] == 0.0
    assert err["tpot_p99_s"] is None            # NaN on the real side: not judged
    assert err["goodput"] == 0.25               # real share 0: the absolute difference
    assert sv.worst(err) is None                # so the worst is unknown, not 0.5
    assert sv.worst({k: v for k, v in err.items() if v is not None}) == 0.5


def test_goodput_is_over_every_request_sent():
    summary = {"per_request": {0: {"ttft_s": 0.5, "tpot_s": 0.05},
                               1: {"ttft_s": 3.0, "tpot_s": 0.05},     # TTFT missed
                               2: {"ttft_s": 0.5, "tpot_s": 0.5}}}     # TPOT missed
    assert sv.goodput(summary, 2.0, 0.25, sent=3) == 1 / 3
    assert sv.goodput(summary, 2.0, 0.25, sent=4) == 1 / 4   # one failed: not served


def test_the_replay_never_uses_a_length_the_calibration_or_the_probe_measured():
    from raypd.bench.engine import CALIBRATION_PREFILL
    probe = {sv.PROBE_CONTEXT, sv.PROBE_PREFILL}
    assert not set(sv.REPLAY_LENS) & (set(CALIBRATION_PREFILL) | probe)
    assert probe <= set(CALIBRATION_PREFILL)
    assert len(sv.LOADS) >= 2 and min(u for _, u in sv.LOADS) < 0.5 < max(u for _, u in sv.LOADS)
    a = sv.replay_requests(8, sv.REPLAY_LENS, 1.0, seed=sv.REPLAY_SEED)
    b = sv.replay_requests(8, sv.REPLAY_LENS, 1.0, seed=sv.REPLAY_SEED + 1)
    assert [at for at, _ in a] != [at for at, _ in b]      # each load its own arrivals


def test_every_run_draws_its_own_replay_seed_away_from_the_development_one():
    seeds = {sv.draw_replay_seed() for _ in range(50)}
    assert len(seeds) > 45                               # fresh, not one fixed seed
    assert all(abs(s - sv.REPLAY_SEED) > 16 for s in seeds)


def test_light_load_slos_sit_at_its_real_p50_so_its_goodput_can_miss():
    """The real p50s set the SLOs (x SLO_P50_MULTIPLE): a simulator whose TTFTs run 40% short
    of real counts every request within them while real counts only some: a goodput error."""
    real = {"ttft_p50_s": 1.0, "tpot_p50_s": 0.1,
            "per_request": {i: {"ttft_s": t, "tpot_s": 0.1}
                            for i, t in enumerate((0.8, 1.0, 1.2, 2.0))}}
    slo = sv.slos_of(real)
    assert (slo["ttft_s"], slo["tpot_s"]) == (1.25, sv.SLO_P50_MULTIPLE * 0.1)
    assert sv.slos_of(real, 3.0)["ttft_s"] == 3.0            # given: the judged load's
    sim = {"per_request": {i: {"ttft_s": 0.6 * r["ttft_s"], "tpot_s": 0.1}
                           for i, r in real["per_request"].items()}}
    g_real = sv.goodput(real, slo["ttft_s"], slo["tpot_s"], 4)
    g_sim = sv.goodput(sim, slo["ttft_s"], slo["tpot_s"], 4)
    assert (g_real, g_sim) == (0.75, 1.0)
    assert sv.errors_of({"goodput": g_sim}, {"goodput": g_real})["goodput"] > sv.TOLERANCE


def test_calibration_runs_at_the_workers_step_budget_and_threads():
    from protocol.step_rates import default_batched_tokens
    s = sv.worker_settings({"block_size": 16}, cpus=8)
    assert s.step_budget == default_batched_tokens("cpu")
    assert (s.threads_per_worker, s.calibration_threads) == (1, 2)  # its own + the idle one's
    assert sv.worker_settings({"max_num_batched_tokens": 256}, cpus=1).step_budget == 256
    assert sv.worker_settings({}, cpus=1).calibration_threads == 1  # never more than the CPUs
    for budget in (256, 512, 2048):
        batches = calibration_batches(budget)
        assert len(batches) >= 2 and all(b * n <= budget for b, n in batches)


def test_the_light_load_is_placed_by_the_prefill_workers_whole_time_per_prompt():
    """The loads' gaps come from the calibrated prefill worker's seconds per prompt: its
    compute beside a decode (prefill_x), its staging and the send cost, not its compute alone."""
    import dataclasses

    from raypd.sim.cost_model import CostModel, HostSlowdown, PrefillCost, SharedHost
    base = CostModel(prefill=PrefillCost(tok_s=1000.0, attn_ctx_tokens=0.0,
                                         step_overhead_s=0.0, chunk_tokens=512,
                                         stage_s_per_token=1e-4))
    assert sv.prefill_service_s(base, 500) == 0.5 + 0.05
    slow = dataclasses.replace(base, shared_host=SharedHost((HostSlowdown(
        1, prefill_x=2.0, stage_x=1.5, send_s_per_token=2e-4),)))
    assert abs(sv.prefill_service_s(slow, 500) - (1.0 + 0.075 + 0.1)) < 1e-12


def test_busy_seconds_is_the_union_of_spans():
    assert sv.busy_seconds([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == 3.0
    assert sv.busy_seconds([]) == 0.0
