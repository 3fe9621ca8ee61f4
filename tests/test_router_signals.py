"""Live routing signals: step-rate fits from a worker's own steps, the load report built from
them, per-pair transfer bandwidth, and the hash drift alarm."""

import logging
import random
from types import SimpleNamespace

import pytest

from protocol.messages import LoadReport
from protocol.step_rates import PrefillFit, StepRates, nnls
from router.drift import HashDriftAlarm
from router.policies import RoutingDecision, RoutingRequest, WorkerState
from router.transfer_rates import TransferRates
from router.worker_view import apply_load_report, note_prefill


def test_prefill_fit_recovers_overhead_rate_and_context_cost_from_steps():
    rng = random.Random(0)
    true = PrefillFit(tok_s=6_000.0, ctx_tokens=20_000.0, overhead_s=0.01, num_steps=0)
    rates = StepRates()
    for _ in range(40):
        cached = rng.randrange(0, 30_000)
        u = rng.randrange(64, 4096)
        rates.observe_prefill(true.seconds(cached + u, cached), [(u, cached)])
    fit = rates.prefill_fit()
    assert fit.tok_s == pytest.approx(6_000.0, rel=1e-3)
    assert fit.ctx_tokens == pytest.approx(20_000.0, rel=1e-3)
    assert fit.overhead_s == pytest.approx(0.01, rel=1e-3)


def test_no_fit_before_enough_steps_and_decode_steps_never_enter_the_prefill_fit():
    rates = StepRates(min_steps=4)
    for _ in range(3):
        rates.observe_prefill(0.1, [(500, 0)])
    assert rates.prefill_fit() is None
    for b in range(1, 9):
        rates.observe_decode(0.01 + 0.002 * b, b, 100 * b)
    assert rates.prefill_fit() is None
    d = rates.decode_fit()
    assert d.step_s(4, 400) == pytest.approx(0.018, rel=1e-3)


def test_backlog_pays_one_step_overhead_per_token_budget_not_one_per_prompt():
    """A worker batches its queued prompts into steps of at most its token budget, so ten
    short prompts wait for one step's overhead, not ten (summing `seconds` per prompt
    charged ten, and made a queue of short prompts look long)."""
    fit = PrefillFit(tok_s=1_000.0, ctx_tokens=0.0, overhead_s=0.1, num_steps=8)
    short = [(100, 0)] * 10                       # 1,000 tokens: one step of 2,048
    assert fit.backlog_s(short, 2048) == pytest.approx(0.1 + 1.0)
    assert fit.backlog_s(short, 256) == pytest.approx(4 * 0.1 + 1.0)   # 4 steps of 256
    assert fit.backlog_s([(500, 200), (300, 300)], 2048) == pytest.approx(0.1 + 0.3)
    assert fit.backlog_s([], 2048) == 0.0
    assert fit.backlog_s([(700, 0)], 2048) == pytest.approx(fit.seconds(700, 0))


def test_nnls_keeps_coefficients_non_negative():
    rows = [(1.0, x) for x in range(10)]
    ys = [5.0 - 0.1 * x for x in range(10)]     # a negative slope is not a speed
    c = nnls(rows, ys)
    assert c[1] == 0.0 and c[0] == pytest.approx(sum(ys) / len(ys))


def test_worker_step_observation_separates_prefill_decode_and_mixed_steps():
    from workers.host import observe_step as _observe_step

    def r(computed_after, prompt=1000, outputs=()):
        return SimpleNamespace(num_computed_tokens=computed_after, output_token_ids=list(outputs))
    rates = StepRates(min_steps=1)
    a = r(512)
    _observe_step(rates, [(a, 0, True)], 0.2)                           # prefill only
    b, c = r(701, outputs=[1]), r(301, outputs=[1])
    _observe_step(rates, [(b, 700, False), (c, 300, False)], 0.02)     # decode only
    m1, m2 = r(900), r(51, outputs=[1])
    _observe_step(rates, [(m1, 512, True), (m2, 50, False)], 5.0)      # mixed: neither
    assert rates.prefill_fit().num_steps == 1
    assert rates.decode_fit().num_steps == 1
    assert (rates.last_decode_batch, rates.last_decode_step_s) == (2, 0.02)


def test_report_replaces_what_the_router_added_since():
    fit = PrefillFit(1000.0, 0.0, 0.0, 5)
    st = WorkerState("p0")
    apply_load_report(st, LoadReport("p0", queued_tokens=100, queued_s=0.1, prefill_fit=fit,
                                     kv_bytes_per_token=36_864))
    req = RoutingRequest("r", [1, 2], 1024, 512)
    note_prefill(st, req, RoutingDecision("p0", "min_ttft", 1.0, 1))
    assert (st.queued_tokens, st.routed_s) == (100 + 512, pytest.approx(0.512))
    assert st.wait_s() == pytest.approx(0.612)
    apply_load_report(st, LoadReport("p0", queued_tokens=612, queued_s=0.6, prefill_fit=fit))
    assert (st.queued_tokens, st.routed_s, st.wait_s()) == (612, 0.0, 0.6)


def test_work_routed_after_the_reports_snapshot_stays_counted():
    fit = PrefillFit(1000.0, 0.0, 0.0, 5)
    st = WorkerState("p0")
    req = RoutingRequest("r", [1, 2], 1024, 512)
    apply_load_report(st, LoadReport("p0", queued_s=0.0, prefill_fit=fit), now=0.0)
    note_prefill(st, req, RoutingDecision("p0", "min_ttft", 1.0, 0), now=10.0)
    note_prefill(st, req, RoutingDecision("p0", "min_ttft", 1.0, 0), now=10.5)
    # a report made at 10.6 of a snapshot 0.3 s old (taken at 10.3): it has the first only
    apply_load_report(st, LoadReport("p0", queued_tokens=1024, queued_s=1.024, prefill_fit=fit,
                                     age_s=0.3), now=10.6)
    assert st.queued_tokens == 2048 and st.wait_s() == pytest.approx(2.048)


def test_wait_is_aged_by_the_reports_age_and_the_work_routed_since():
    """A worker that reported 1 s of backlog 0.4 s ago has worked 0.4 s of it off; work the
    router sent since joins the backlog as it was sent (an idle stretch is not banked)."""
    fit = PrefillFit(1000.0, 0.0, 0.0, 5)
    st = WorkerState("p0")
    apply_load_report(st, LoadReport("p0", queued_s=1.0, prefill_fit=fit, age_s=0.1), now=10.1)
    assert st.wait_s(fit, now=10.4) == pytest.approx(0.6)
    assert st.wait_s(fit, now=12.0) == 0.0
    assert st.wait_s(fit) == pytest.approx(1.0)          # no clock: unaged, as before
    req = RoutingRequest("r", [1, 2], 1000, 512)        # 1 s of work by the fit
    note_prefill(st, req, RoutingDecision("p0", "min_ttft", 1.0, 0), now=11.5)
    # the backlog ran out at 11.0; the request sent at 11.5 started then: 0.7 s left at 11.8
    assert st.wait_s(fit, now=11.8) == pytest.approx(0.7)


def test_transfer_rates_are_per_pair_and_absent_until_measured():
    t = TransferRates(alpha=0.5)
    assert t.gbps("p0", "d0") is None
    t.observe("p0", "d0", 2_000_000_000, 1.0)
    t.observe("p0", "d0", 4_000_000_000, 1.0)
    t.observe("p1", "d0", 1_000_000_000, 1.0)
    t.observe("p1", "d1", 0, 0.0)                  # nothing moved: not a measurement
    assert t.gbps("p0", "d0") == pytest.approx(3.0)
    assert t.from_worker("p1") == {"d0": pytest.approx(1.0)}


def test_hash_drift_alarm_fires_on_predicted_hits_the_engine_does_not_find(caplog):
    fired = []
    alarm = HashDriftAlarm(window=20, margin=0.25, min_samples=10, on_alarm=fired.append)
    for _ in range(30):                     # predictions come true: quiet
        assert not alarm.observe(1024, 1024)
    for _ in range(5):                      # nothing predicted: nothing to drift from
        alarm.observe(0, 0)
    with caplog.at_level(logging.WARNING, logger="raypd.router.drift"):
        states = [alarm.observe(1024, 0) for _ in range(20)]  # hashes drifted: 0 real hits
    assert states[-1] and alarm.episodes == 1 and len(fired) == 1
    assert fired[0].shortfall_ratio > 0.25
    assert "hash drift" in caplog.text
    for _ in range(20):                     # fixed: the alarm clears, and may fire again
        alarm.observe(1024, 1024)
    assert not alarm.alarm and alarm.status().shortfall_ratio == 0.0


def test_hash_drift_within_the_margin_stays_quiet():
    alarm = HashDriftAlarm(window=32, margin=0.25, min_samples=8)
    for i in range(64):                     # real hit 90% of predicted: within margin
        alarm.observe(1000, 900 if i % 2 else 1000)
    assert not alarm.alarm and alarm.episodes == 0


def test_orchestrator_feeds_the_drift_alarm_and_raises_the_metric():
    import threading

    from router.orchestrator import Orchestrator

    class Metrics:
        def __init__(self):
            self.calls = []

        def record_hash_drift(self, alarm, went_on):
            self.calls.append((alarm, went_on))

    orch = Orchestrator.__new__(Orchestrator)     # the wiring only: no workers needed
    orch._lock, orch.drift, orch.metrics = threading.Lock(), HashDriftAlarm(min_samples=4), \
        Metrics()
    for _ in range(8):
        orch.observe_prefill_hit(predicted_tokens=4096, real_tokens=0)
    assert orch.metrics.calls[-1] == (True, False)
    assert orch.metrics.calls.count((True, True)) == 1     # went on once
    assert orch.drift.status().shortfall_ratio == 1.0
