"""On a real 1P+1D cluster: the workers' reports carry speeds fitted from their own steps, the
model's KV bytes per token, and the router measures transfer bandwidth per (P, D) pair."""

from __future__ import annotations

import pytest
from conftest import random_prompt

from cluster.pd import PDCluster, PDConfig
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

pytestmark = pytest.mark.usefixtures("ray_session")


def test_live_reports_carry_measured_speeds_and_the_router_measures_pair_bandwidth():
    cluster = PDCluster(PDConfig(engine=dict(model="tiny", num_blocks=256, block_size=16), num_prefill=1, flow=FlowConfig(policy="locality")))
    try:
        shared = random_prompt(48, seed=5)
        for i in range(6):
            cluster.run_request(shared + random_prompt(20 + 7 * i, seed=10 + i),
                                SamplingParams(max_tokens=8, ignore_eos=True))
        orch = cluster.orchestrator
        orch.fleet.refresh()
        states = list(orch.fleet.state.values())
        prefill = [s for s in states if s.worker_id.startswith("prefill")]
        decode = [s for s in states if s.worker_id.startswith("decode")]
        assert prefill and decode
        p = prefill[0]
        assert p.prefill_fit is not None and p.prefill_fit.tok_s > 0
        assert p.prefill_fit.num_steps >= 4 and p.decode_fit is None   # P never decodes
        assert decode[0].decode_fit is not None                        # D's own decode steps
        assert p.kv_bytes_per_token > 0 and p.queued_s == 0.0
        pairs = orch.transfer_rates.pairs
        assert pairs and all(r.gbps > 0 and r.transfers >= 1 for r in pairs.values())
        # the router's predicted prefix hits match what the engines found (the drift alarm's
        # own figure; the alarm itself needs 16 samples, this run has 5 with a prediction)
        drift = orch.drift.status()
        assert drift.window >= 5 and drift.predicted_tokens >= 5 * 48 // 16 * 16
        assert drift.shortfall_ratio <= orch.drift.margin / 2, drift
    finally:
        cluster.shutdown()
