"""`simulate --validate` end to end on the tiny model (a smoke test of the calibration, the probe,
the replay and the judgement on a real 1P+1D cluster; small lengths, one round, ~1 min): the
calibration runs at the workers' own step budget and threads, every run draws its own replay
seed, and each load is judged at SLOs from its own real p50."""

from __future__ import annotations

import json
import math

from raypd.bench import sim_validation as sv


def test_validate_calibrates_probes_and_replays_on_tiny_at_the_workers_settings(ray_session):
    out = sv.validate(engine={"model": "tiny", "block_size": 16}, num_requests=4, max_tokens=4,
                      rounds=1, replay_lens=(40, 90), probe_lens=(64, 160),
                      probe_batches=(1, 2), calibration_repeats=1)
    json.dumps(out)                                       # the CLI writes it as JSON
    settings = out["worker_settings"]
    assert settings == {"step_budget": 512, "threads_per_worker": 1,
                        "share_idle_threads": True,
                        "calibration_threads": settings["calibration_threads"]}
    cal = out["calibration"]                              # measured at the workers' settings
    assert cal["max_num_batched_tokens"] == 512
    assert cal["threads"] == settings["calibration_threads"] >= 1
    assert all(b * n <= 512 for b, n in ((p["batch"], p["tokens"])
                                         for p in cal["prefill_batch_s"]))
    assert out["cost_model_fit"]["prefill"]["chunk_tokens"] == 512
    # a fresh seed, not the development one, reported
    assert out["replay_seed_drawn"] and out["out_of_sample"]
    assert out["replay_seed"] != sv.REPLAY_SEED == out["development_seed"]
    probe = out["probe"]                                  # both batches probed
    assert probe["prefill_tokens"] == 160 and probe["context"] == 64
    assert [row["batch"] for row in probe["at_batch"]] == [2]
    assert all(probe[k] >= 1.0 for k in ("prefill_x", "decode_x", "handoff_x", "stage_x"))
    assert probe["prefill_compute_s_alone"] > 0
    loads = {x["load"]: x for x in out["loads"]}
    assert set(loads) == {"light", "near_saturation"} and out["judged_load"] == "near_saturation"
    for row in loads.values():
        assert row["real_failed"] == 0 and row["samples_real"] == row["samples_sim"] == 4
        assert set(row["sim_vs_real_error"]) == {*sv.METRICS, "goodput"}
        real = row["real"]
        assert row["slo"]["ttft_s"] == sv.SLO_P50_MULTIPLE * real["ttft_p50_s"]
        assert row["slo"]["tpot_s"] == sv.SLO_P50_MULTIPLE * real["tpot_p50_s"]
        assert 0 < row["real_prefill_utilization"] and not math.isnan(row["mean_gap_s"])
        assert isinstance(row["passed"], bool)
    assert "light_is_light" in loads["light"] and "light_is_light" not in loads[
        "near_saturation"]
    assert out["sim_vs_real_error"] == loads["near_saturation"]["sim_vs_real_error_worst"]
    assert out["passed"] == loads["near_saturation"]["passed"]
    assert out["light_passed"] == loads["light"]["passed"]
