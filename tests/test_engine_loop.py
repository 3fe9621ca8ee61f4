"""A worker's engine loop cannot be killed by a request: an engine step that raises fails the
requests of that step (and only those) with a clear error while the worker goes on serving; a
loop that breaks anyway takes the actor down, Ray restarts it and the router retries its
requests elsewhere. Sampling never produces NaN, whatever the temperature or seed."""

from __future__ import annotations

import threading

import pytest
import ray
import torch
from conftest import random_prompt, wait_until

from cluster.pd import PDCluster, PDConfig
from ingress.errors import classify
from protocol.sampling import SamplingParams
from workers.request import Request
from workers.sampler import sample

ENGINE = dict(model="tiny", num_blocks=256, block_size=16)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("ray_session")


def _referenced(cluster) -> int:
    return sum(c["referenced"] for c in cluster.check_invariants())


def test_a_failing_step_fails_only_its_requests_and_the_worker_serves_on():
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=0, num_decode=1, fault_injection=True))
    try:
        decode = cluster.decode[0]
        deltas, out = [], {}

        def run():
            try:
                out["r"] = cluster.run_request(random_prompt(30, seed=1), LONG,
                                               on_delta=deltas.append)
            except Exception as e:   # noqa: BLE001 - the test looks at it
                out["e"] = e
        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: len(deltas) >= 3)
        ray.get(decode.fail_next_steps.remote(1))
        t.join(60)
        assert "e" in out, "the request of the failed step did not fail"
        err = classify(out["e"])
        assert err.status == 500 and err.code == "engine_step_failed"
        assert "engine step failed" in err.message
        # the loop lives: the next request is served, the failed one left no block behind
        assert len(cluster.run_request(random_prompt(20, seed=2), SHORT).token_ids) == 8
        wait_until(lambda: _referenced(cluster) == 0, 60)
        s = ray.get(decode.stats.remote())
        assert s["loop_error"] is None and s["step_failures"] == 1
    finally:
        cluster.shutdown()


def test_a_broken_loop_restarts_the_actor_and_its_request_is_retried():
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=1, num_decode=2, lease_s=2.0, fault_injection=True))
    try:
        deltas, out = [], {}

        def run():
            out["r"] = cluster.run_request(random_prompt(30, seed=3), LONG,
                                           on_delta=deltas.append)
        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: len(deltas) >= 3)
        orch = cluster.orchestrator
        victim = orch.in_flight_flights()[0].decode
        victim.crash_loop.remote()
        t.join(180)
        assert len(out["r"].token_ids) == LONG.max_tokens
        assert out["r"].lifecycle.retries >= 1
        wait_until(lambda: _pingable(victim), 120)      # restarted by Ray
        assert ray.get(victim.stats.remote())["loop_error"] is None
        assert [len(r.token_ids) for r in
                cluster.generate([random_prompt(10, seed=s) for s in range(4)], SHORT)] == [8] * 4
        wait_until(lambda: _expire_and_count(cluster) == 0, 30)
    finally:
        cluster.shutdown()


def _expire_and_count(cluster) -> int:
    cluster.expire_leases()                # pages staged for the dead attempt expire
    return _referenced(cluster)


def _pingable(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
        return True
    except Exception:   # noqa: BLE001 - restarting
        return False


class _Req:
    """What the sampler reads of a request."""

    def __init__(self, sp: SamplingParams) -> None:
        self.sampling, self.output_token_ids, self.eos_token_ids = sp, [], ()
        self.generator = None


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1e-30), SamplingParams(temperature=1e-7, seed=-(1 << 63)),
    SamplingParams(temperature=0.5, seed=(1 << 63) - 1, top_k=3, top_p=0.5),
    SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(10**6,)),
])
def test_sampling_never_fails_on_edge_values(sp):
    logits = torch.randn(1, 50) * 30
    tok = sample(logits, [_Req(sp)])[0]            # type: ignore[list-item]
    assert 0 <= tok < 50
    if sp.temperature < 1e-6:
        assert tok == int(logits.argmax())


def test_request_type_is_what_the_sampler_reads():
    assert {"sampling", "output_token_ids", "eos_token_ids", "generator"} <= \
        set(Request.__dataclass_fields__)
