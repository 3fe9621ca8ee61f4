"""`simulate --validate`'s judgement (raypd/bench/sim_validation.py): per-metric errors where an
unjudgeable metric is reported instead of hidden by a max, goodput over every request sent
(failed ones count as missed), and calibration kept apart from the replay."""

from __future__ import annotations

import math

from raypd.bench import sim_validation as sv


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
