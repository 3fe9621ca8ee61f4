"""The simulator gives policies exactly what the live router has: WorkerStates built from the
workers' load reports (same interval, with lag) plus the router's own decisions since."""

import copy

import pytest

from raypd.sim.routing_sim import SimConfig, SimRequest, Simulator
from router.policies import BasePolicy, WorkerState, make_policy
from router.worker_view import apply_load_report, note_prefill


def workload(n=240, seed=0):
    import random
    rng = random.Random(seed)
    out, t = [], 0.0
    for j in range(n):
        t += rng.expovariate(8.0)
        shared = rng.randrange(6)
        ids = tuple(1000 * shared + i for i in range(rng.randint(2, 12))) + \
            tuple(10**6 + 100 * j + i for i in range(rng.randint(1, 4)))
        out.append(SimRequest(t, len(ids) * 512 - 7, 16, ids))
    return out


class Recording(BasePolicy):
    """Locality, recording every view of the workers it is handed."""

    name = "recording"

    def __init__(self):
        super().__init__()
        self.inner = make_policy("locality")
        self.seen = []

    def choose_prefill(self, req, workers, matches):
        d = self.inner.choose_prefill(req, workers, matches)
        self.seen.append((req, copy.deepcopy(list(workers)), d))
        return d


CFG = SimConfig(num_workers=3, capacity_blocks=400, report_interval_s=0.1)


def test_policy_inputs_are_a_function_of_delivered_reports_and_own_decisions_only():
    policy = Recording()
    sim = Simulator(policy, CFG, keep_reports=True)
    sim.run(workload())
    log = sim.log.delivered
    assert log and len(policy.seen) == 240
    view = {w.worker_id: WorkerState(w.worker_id) for w in sim.workers}
    i = 0
    for req, states, decision in policy.seen:
        while i < len(log) and log[i][0] <= req.arrival_s:
            apply_load_report(view[log[i][1].worker_id], log[i][1], log[i][0] - CFG.report_rpc_s)
            i += 1
        assert [view[s.worker_id] for s in states] == states
        note_prefill(view[decision.worker_id], req, decision,
                     policy.inner.pooled_fit(list(view.values())), req.arrival_s)


def test_reports_arrive_on_the_report_interval_and_describe_the_past():
    sim = Simulator("locality", CFG, keep_reports=True)
    sim.run(workload())
    for t, rep in sim.log.delivered:
        assert abs(t / CFG.report_interval_s - round(t / CFG.report_interval_s)) < 1e-9
        assert rep.reported_at <= t - CFG.report_rpc_s + 1e-12


def test_a_policy_reading_the_simulators_truth_fails():
    class Peeking(BasePolicy):
        name = "peeking"

        def choose_prefill(self, req, workers, matches):
            return min(workers, key=lambda w: w.backlog_s)   # the old oracle: no such field

    with pytest.raises(AttributeError):
        Simulator(Peeking(), CFG).run(workload(20))


def test_the_hidden_speed_reaches_policies_only_as_a_measured_fit():
    for tok_s in (4_000.0, 16_000.0):
        policy = Recording()
        Simulator(policy, SimConfig(num_workers=3, capacity_blocks=400, prefill_tok_s=tok_s,
                                    attn_ctx_tokens=0.0)).run(workload())
        first_states = policy.seen[0][1]
        assert all(s.prefill_fit is None and s.queued_s is None for s in first_states)
        fits = [s.prefill_fit for s in policy.seen[-1][1] if s.prefill_fit is not None]
        assert fits and all(f.tok_s == pytest.approx(tok_s, rel=0.02) for f in fits)


def test_a_simulated_workers_prefill_fit_leaves_out_its_adapter_loads():
    """As a live worker's (tests/test_lora.py): the seconds an adapter load adds to a step
    reach the router as the worker's lora_load_s, not as a slower prefill fit."""
    from raypd.sim.cost_model import CostModel, PrefillCost
    from raypd.sim.routing_sim import SimWorker, namespace_root
    hidden = PrefillCost(tok_s=8_000.0, attn_ctx_tokens=0.0, step_overhead_s=0.02)
    w = SimWorker("p0", 400, CostModel(prefill=hidden, lora_load_s=1.0), max_loras=2)
    for j in range(6):             # each alone on the worker, each under an adapter not loaded
        ids = tuple(100 * j + i for i in range(4))
        w.serve([hash((j, i)) for i in range(4)], namespace_root(lora=f"a{j}"), ids, 2048,
                10.0 * j, 512, lora=f"a{j}")
    w.advance(float("inf"))
    rep = w.report(100.0)
    assert w.lora_loads == 6 and rep.lora_load_s == pytest.approx(1.0)
    assert rep.prefill_fit.seconds(2048, 0) == pytest.approx(hidden.prefill_s(2048), rel=1e-6)
