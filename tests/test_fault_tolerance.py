"""Workers die, restart and scale while requests run: every request completes or ends with an
explicit error, greedy outputs stay right, and no block stays referenced."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from conftest import make_engine, random_prompt, wait_until

from cluster.pd import PDCluster, PDConfig
from protocol.messages import RequestInput
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

ENGINE = dict(model="tiny", num_blocks=256, block_size=16)
LONG = SamplingParams(max_tokens=300, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("ray_session")


def _reference(tiny_loaded, prompts, sampling):
    return [r.output_token_ids for r in make_engine(tiny_loaded).generate(prompts, sampling)]


def _drained(cluster: PDCluster, timeout=60.0) -> None:
    """Every worker's ledger holds, and nothing stays referenced (leases expire)."""
    def clean():
        try:   # a restarted worker answers once it is back (with an empty pool)
            cluster.expire_leases()
            return all(c["referenced"] == 0 for c in cluster.check_invariants())
        except ray.exceptions.ActorUnavailableError:
            return False
    wait_until(clean, timeout)


def _start(cluster, prompts, sampling):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=cluster.generate(prompts, sampling)))
    t.start()
    return t, out


def test_decode_worker_killed_mid_decode_request_completes(tiny_loaded):
    prompt = random_prompt(30, seed=1)
    expected = _reference(tiny_loaded, [prompt], LONG)
    cluster = PDCluster(PDConfig(engine=ENGINE, num_decode=2, lease_s=2.0))
    try:
        deltas = []
        result = {}

        def run():
            result["r"] = cluster.run_request(prompt, LONG, on_delta=deltas.append)
        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: sum(len(d.token_ids) for d in deltas) >= 20)
        victim = cluster.orchestrator.in_flight_flights()[0].decode
        ray.kill(victim, no_restart=False)          # Ray restarts it (max_restarts)
        t.join(120)
        r = result["r"]
        assert r.token_ids == expected[0]
        assert r.lifecycle.retries >= 1
        # the client saw every token exactly once across the failure
        assert [tok for d in deltas for tok in d.token_ids] == expected[0]
        assert cluster.orchestrator.retries >= 1
        _drained(cluster)
    finally:
        cluster.shutdown()


def test_prefill_worker_killed_requests_retry_elsewhere(tiny_loaded):
    prompts = [random_prompt(40 + i, seed=10 + i) for i in range(6)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = _reference(tiny_loaded, prompts, sampling)
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=2, lease_s=2.0,
                                 fault_injection=True))
    try:
        victim = cluster.prefill[0]
        ray.get(victim.stall_next_step.remote(5.0))     # its next prefill hangs: kill lands
        t, out = _start(cluster, prompts, sampling)     # while a request is in it
        wait_until(lambda: ray.get(victim.load_report.remote()).busy_for_s > 0.2, 30)
        ray.kill(victim, no_restart=False)
        t.join(180)
        results = out["r"]
        assert len(results) == len(prompts)
        for r, exp in zip(results, expected, strict=True):   # all completed, elsewhere
            assert r.error is None, r.error
            assert r.token_ids == exp
        assert cluster.orchestrator.prefill_retries >= 1     # the killed prefill re-ran
        _drained(cluster)
    finally:
        cluster.shutdown()


def test_pages_pinned_for_a_dead_decode_worker_expire():
    cluster = PDCluster(PDConfig(engine=ENGINE, lease_s=0.5, max_restarts=0))
    try:
        d, p = cluster.decode[0], cluster.prefill[0]
        request = RequestInput("orphan", tuple(random_prompt(40, seed=3)),
                               SamplingParams(max_tokens=4), time.time() + 60)
        adm = ray.get(d.admit.remote(request))
        ray.get(p.prefill.remote(adm.request, adm.plan))
        assert [h.kind for h in ray.get(p.ledger_holds.remote())] == ["staged"]
        ray.kill(d, no_restart=True)
        time.sleep(0.8)
        ray.get(p.expire_leases.remote())
        assert ray.get(p.check_invariants.remote())["referenced"] == 0
        assert ray.get(p.ledger_holds.remote()) == []
        stats = ray.get(p.stats.remote())
        assert stats["transfer_expired"] == 1 and stats["ledger_released_expired"] == 1
    finally:
        cluster.shutdown()


def test_live_scaling_under_load_loses_nothing(tiny_loaded):
    prompts = [random_prompt(20 + 3 * i, seed=50 + i) for i in range(12)]
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = _reference(tiny_loaded, prompts, sampling)
    cluster = PDCluster(PDConfig(engine=ENGINE))
    try:
        t, out = _start(cluster, prompts, sampling)
        assert cluster.scale(prefill=2, decode=2) == {"prefill": 2, "decode": 2}
        time.sleep(0.5)
        assert cluster.scale(prefill=1, decode=1) == {"prefill": 1, "decode": 1}
        t.join(180)
        assert [r.error for r in out["r"]] == [None] * len(prompts)
        assert [r.token_ids for r in out["r"]] == expected
        cluster.scale(wait=True)
        assert len(cluster.prefill) == 1 and len(cluster.decode) == 1
        _drained(cluster)
        # the scaled-in cluster still serves
        assert cluster.generate(prompts[:2], sampling)[0].token_ids == expected[0]
    finally:
        cluster.shutdown()


def test_hung_prefill_worker_is_routed_around(tiny_loaded):
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [random_prompt(30, seed=90 + i) for i in range(3)]
    expected = _reference(tiny_loaded, prompts, sampling)
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=2, fault_injection=True, flow=FlowConfig(hang_timeout_s=1.0, policy="round_robin")))
    try:
        stuck = cluster.prefill[0]
        # its next step hangs for 3.5 s: found hung (1 s) and routed around (~0.1 s) well within
        ray.get(stuck.stall_next_step.remote(3.5))
        t, out = _start(cluster, prompts[:1], sampling)    # round robin: lands on prefill-0
        wait_until(lambda: "prefill-0" in cluster.orchestrator.fleet.unhealthy, 20)
        assert cluster.orchestrator.fleet.state["prefill-0"].draining
        results = cluster.generate(prompts[1:], sampling)  # served by prefill-1 meanwhile
        assert [r.token_ids for r in results] == expected[1:]
        assert {r.lifecycle.prefill_worker for r in results} == {"prefill-1"}
        t.join(60)
        assert out["r"][0].token_ids == expected[0]     # the stalled request finished too
        wait_until(lambda: "prefill-0" not in cluster.orchestrator.fleet.unhealthy, 20)
        _drained(cluster)
    finally:
        cluster.shutdown()
