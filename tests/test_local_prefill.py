"""Conditional disaggregation (router/local_prefill.py): a decode worker prefills a prompt itself
when the prefill pool's backlog is longer than the prefill takes on it, and only then."""

from __future__ import annotations

import threading

import pytest
from conftest import random_prompt, wait_until

from protocol.sampling import SamplingParams
from protocol.step_rates import PrefillFit
from router.local_prefill import NO_LIMIT, local_prefill_limit
from router.policies import WorkerState

FIT = PrefillFit(tok_s=500.0, ctx_tokens=0.0, overhead_s=0.01, num_steps=8)


def _prefill(wid: str, queued_s: float | None, fit: PrefillFit | None = FIT,
             draining: bool = False) -> WorkerState:
    return WorkerState(wid, queued_s=queued_s, prefill_fit=fit, draining=draining)


@pytest.mark.parametrize("fit", [FIT, PrefillFit(300.0, 1500.0, 0.02, 8),
                                 PrefillFit(2000.0, 64.0, 0.0, 8)])
def test_tokens_within_inverts_seconds(fit):
    for s in (0.0, 0.005, 0.03, 0.5, 2.0, 9.0):
        n = fit.tokens_within(s)
        assert n >= 0
        if n:
            assert fit.seconds(n, 0) <= s + 1e-9
        assert fit.seconds(n + 1, 0) > s


def test_no_prefill_worker_live_means_decode_prefills_everything():
    d = WorkerState("d0")
    assert local_prefill_limit([], d, 0, True, now=0.0) == NO_LIMIT
    assert local_prefill_limit([_prefill("p0", 1.0, draining=True)], d, 0, False,
                               now=0.0) == NO_LIMIT


def test_off_only_the_static_limit_applies():
    d = WorkerState("d0")
    assert local_prefill_limit([_prefill("p0", 30.0)], d, 64, False, now=0.0) == 64


def test_nothing_measured_admits_nothing_beyond_the_static_limit():
    d = WorkerState("d0")
    assert local_prefill_limit([_prefill("p0", None, fit=None)], d, 16, True, now=0.0) == 16


def test_decode_takes_what_it_finishes_before_the_least_waiting_prefill_worker_starts():
    d = WorkerState("d0")
    idle = local_prefill_limit([_prefill("p0", 0.0)], d, 0, True, now=0.0)
    assert idle == 0                                     # an idle pool keeps every prefill
    busy = [_prefill("p0", 4.0), _prefill("p1", 2.0), _prefill("p2", 0.5, draining=True)]
    assert local_prefill_limit(busy, d, 0, True, now=0.0) == FIT.tokens_within(2.0) == 995
    assert local_prefill_limit(busy, d, 2000, True, now=0.0) == 2000   # the static floor


def test_decode_counts_its_own_prefill_work_and_what_was_just_sent_to_it():
    busy = [_prefill("p0", 2.0)]
    d = WorkerState("d0", prefill_tokens=500)            # 1 s of its own prefill left
    assert local_prefill_limit(busy, d, 0, True, now=0.0) == FIT.tokens_within(1.0)
    d.routed.append((0.0, 450, 0.9, ""))                 # a local prefill admitted since
    assert local_prefill_limit(busy, d, 0, True, now=0.0) == FIT.tokens_within(0.1)
    d.prefill_fit = PrefillFit(250.0, 0.0, 0.01, 8)      # its own fit, once measured
    assert local_prefill_limit(busy, d, 0, True, now=0.0) == 0


def test_each_running_decode_must_be_worth_its_wait():
    """A local prefill stalls D's b running decodes: it must save the request (1 + b) times
    its own length."""
    busy = [_prefill("p0", 2.0)]
    for b in (0, 1, 3, 9):
        d = WorkerState("d0", decode_batch=b)
        assert local_prefill_limit(busy, d, 0, True, now=0.0) == FIT.tokens_within(2.0 / (1 + b))


@pytest.mark.usefixtures("ray_session")
def test_a_backlogged_prefill_pool_sends_the_next_prompt_to_the_decode_worker():
    """Live, 1P+1D on a SmolLM2-shaped random model (1 thread each: a long prompt keeps P busy
    for seconds): warm-ups on an idle pool go to P; while P prefills a long prompt, a short one
    is prefilled on D, and nothing leaks (the tokens of a local prefill are
    test_disagg.py::test_conditional_local_prefill's)."""
    from cluster.pd import PDCluster, PDConfig
    from router.orchestrator import FlowConfig
    engine = dict(model="random:smollm2-135m", num_blocks=96, block_size=16)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    cluster = PDCluster(PDConfig(engine=engine,
                                 flow=FlowConfig(local_prefill_when_backlogged=True)))
    try:
        orch = cluster.orchestrator
        did = cluster.info[1]["worker_id"]

        def limit() -> int:
            with orch.fleet.lock:
                return orch._local_prefill_limit(did)
        warm = [cluster.run_request(random_prompt(64, seed=i), greedy) for i in range(5)]
        assert all(r.lifecycle.prefill_worker for r in warm)   # an idle pool prefills them
        assert limit() < 48
        long_prompt, short = random_prompt(600, seed=50), random_prompt(48, seed=51)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(long=cluster.run_request(long_prompt,
                                                                                greedy)))
        t.start()
        wait_until(lambda: limit() >= len(short), timeout=30)
        r = cluster.run_request(short, greedy)
        t.join(timeout=120)
        assert r.lifecycle.prefill_worker is None and r.lifecycle.transfer_bytes == 0
        assert out["long"].lifecycle.prefill_worker
        assert orch.decisions["local:backlog"] == 1
        assert len(r.token_ids) == len(out["long"].token_ids) == greedy.max_tokens
        for counts in cluster.check_invariants():
            assert counts["referenced"] == 0, counts
    finally:
        cluster.shutdown()
