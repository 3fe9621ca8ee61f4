"""Disaggregated prefill/decode gives stock transformers generate()'s greedy output, on every path."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from conftest import hf_greedy, random_prompt

from cluster.pd import PDCluster, PDConfig
from kvcache.manager import cdiv
from protocol.messages import RequestInput
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ENGINE = dict(model="tiny", num_blocks=128, block_size=16)
SHARED = random_prompt(40, seed=77)           # 2.5 blocks of shared prefix
PROMPTS = [random_prompt(5, seed=1),          # shorter than one block
           random_prompt(16, seed=2),         # exactly one block
           random_prompt(61, seed=3),
           SHARED + random_prompt(9, seed=4)]


pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def reference(tiny_reference):
    """Greedy outputs of stock transformers generate() on an independently loaded copy of
    the model (stock attention, no paged KV), computed in this process."""
    def run(prompts):
        return [hf_greedy(tiny_reference, p, GREEDY.max_tokens) for p in prompts]
    return run


@pytest.fixture(scope="module")
def shared_cluster(request):
    """A 1P+1D cluster of ENGINE on the transport the test names (`request.param`,
    parametrized indirectly), shared by the tests of that transport, which leave it as they
    found it (each ends with `_clean`). pytest runs them together and shuts this cluster down
    before the next transport's starts, so that only one is up at a time (idle clusters'
    actors and load reporters slow every other test down); the tests that start a cluster of
    their own come first in this file, so that none runs beside a shared one."""
    cluster = PDCluster(PDConfig(engine=ENGINE, flow=FlowConfig(transport=request.param)))
    yield cluster
    cluster.shutdown()


def _clean(cluster: PDCluster) -> None:
    for counts in cluster.check_invariants():
        assert counts["referenced"] == 0, counts


def test_rdt_many_concurrent_transfers_of_different_sizes(reference):
    """Ray pairs RDT sends with receives by order only: two transfers in flight at one actor
    could swap (a gloo size mismatch aborted the decode worker). The orchestrator runs one
    RDT transfer per actor at a time; every page must land where it belongs."""
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=2, num_decode=2, flow=FlowConfig(transport="rdt")))
    try:
        prompts = [random_prompt(5 + 11 * i, seed=300 + i) for i in range(12)]
        results = cluster.generate(prompts, GREEDY)
        assert [r.error for r in results] == [None] * len(prompts)
        assert [r.token_ids for r in results] == reference(prompts)
        assert {r.lifecycle.transferred_blocks for r in results} >= {1, 2, 3, 4, 5}
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_conditional_local_prefill(reference):
    cluster = PDCluster(PDConfig(engine=ENGINE, flow=FlowConfig(local_prefill_max_tokens=20)))
    try:
        short, long_ = PROMPTS[1], PROMPTS[2]
        rs = [cluster.run_request(p, GREEDY) for p in (short, long_)]
        assert [r.token_ids for r in rs] == reference([short, long_])
        assert rs[0].lifecycle.transfer_bytes == 0      # prefilled on D
        assert rs[0].lifecycle.prefill_worker is None
        assert rs[1].lifecycle.transfer_bytes > 0       # 61 uncached tokens > 20
        _clean(cluster)
    finally:
        cluster.shutdown()


def _stage_without_pull(cluster: PDCluster, prompt: list[int], rid: str):
    d, p = cluster.decode[0], cluster.prefill[0]
    request = RequestInput(rid, tuple(prompt), SamplingParams(max_tokens=8), time.time() + 60)
    adm = ray.get(d.admit.remote(request))
    assert adm.admitted and not adm.local
    pre = ray.get(p.prefill.remote(adm.request, adm.plan))
    return d, p, pre


def _land(d, rid: str, pre):
    """D's third round trip: land the staged pages."""
    return ray.get(d.land.remote(rid, 0, pre))


@pytest.mark.parametrize("transport", ["shm", "grpc", "cuda_ipc"])
def test_lease_expires_when_decode_never_pulls(transport):
    # (object_store keeps an expired transfer readable while a handle exists; the data is an
    # immutable copy, so a late pull is still correct there)
    cluster = PDCluster(PDConfig(engine=ENGINE, lease_s=0.3, flow=FlowConfig(transport=transport)))
    try:
        d, p, pre = _stage_without_pull(cluster, PROMPTS[3], "never-pulled")
        time.sleep(0.6)
        assert pre.handle.transfer_id in ray.get(p.expire_leases.remote()) or \
            ray.get(p.stats.remote())["transfer_expired"] == 1
        stats = ray.get(p.stats.remote())
        assert stats["transfer_expired"] == 1 and stats["transfer_active"] == 0
        assert stats["ledger_released_expired"] == 1 and stats["ledger_open_holds"] == 0
        assert ray.get(p.check_invariants.remote())["referenced"] == 0   # nothing pinned
        with pytest.raises(ray.exceptions.RayTaskError, match="late: the lease"):
            _land(d, "never-pulled", pre)
        ray.get(d.abort.remote("never-pulled"))
        _clean(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_transfer_failure_policy(policy, reference):
    cluster = PDCluster(PDConfig(engine=ENGINE, fault_injection=True, flow=FlowConfig(failure_policy=policy)))
    try:
        ray.get(cluster.decode[0].inject_transfer_faults.remote(1))
        [r] = cluster.generate([PROMPTS[2]], GREEDY)
        if policy == "recompute":
            assert r.token_ids == reference([PROMPTS[2]])[0]
            assert r.lifecycle.transfer_bytes == 0     # recomputed on D
        else:
            assert "KV transfer" in r.error
        _clean(cluster)
        [ok] = cluster.generate([PROMPTS[0]], GREEDY)        # the next request is unaffected
        assert ok.token_ids == reference([PROMPTS[0]])[0]
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_unknown_transport_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'.*grpc"):
        PDCluster(PDConfig(engine=ENGINE, flow=FlowConfig(transport="carrier-pigeon")))


def test_decode_first_admission_waits_for_capacity(reference):
    """More concurrent requests than D's pool holds at once: admission waits, none lost."""
    cluster = PDCluster(PDConfig(engine={**ENGINE, "num_blocks": 12}))
    try:
        prompts = [random_prompt(40, seed=200 + i) for i in range(6)]
        results = cluster.generate(prompts, GREEDY)
        assert [r.error for r in results] == [None] * 6
        assert [r.token_ids for r in results] == reference(prompts)
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_router_sends_a_shared_prefix_to_the_prefill_worker_holding_it():
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=2, flow=FlowConfig(policy="locality")))
    try:
        a = cluster.run_request(SHARED + random_prompt(7, seed=8), GREEDY)
        cluster.orchestrator.fleet.refresh()      # the KV events of a's prefill reach the index
        b = cluster.run_request(SHARED + random_prompt(9, seed=9), GREEDY)
        assert b.lifecycle.prefill_worker == a.lifecycle.prefill_worker
        assert b.lifecycle.cached_tokens >= 32
        assert any(k.startswith("locality:cache_hit") for k in cluster.orchestrator.decisions)
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_colocated_mode_without_prefill_workers(reference):
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=0, num_decode=2))
    try:
        results = cluster.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in results] == reference(PROMPTS)
        assert all(r.lifecycle.transfer_bytes == 0 for r in results)
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_corrupt_pages_are_refused_and_prefilled_again_on_another_prefill_worker(reference):
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=2, fault_injection=True, flow=FlowConfig(policy="round_robin")))
    try:
        ray.get(cluster.prefill[0].inject_fault.remote("corrupt", 1))   # round robin: first
        r = cluster.run_request(PROMPTS[2], GREEDY)
        assert r.token_ids == reference([PROMPTS[2]])[0]
        assert r.lifecycle.transfer_bytes > 0              # not recomputed on D
        assert r.lifecycle.handoff_round_trips > 3         # the retry shows
        assert cluster.orchestrator.rejected == {"corrupt": 1}
        assert ray.get(cluster.decode[0].stats.remote())["rejected_corrupt"] == 1
        injected = [ray.get(p.stats.remote())["corrupt_injected"] for p in cluster.prefill]
        assert injected == [1, 0]
        assert r.lifecycle.prefill_worker == "prefill-1"   # the other prefill worker
        counters = cluster.orchestrator.ledger.counters()
        assert counters["released_transfer_failed"] == 1 and counters["open_holds"] == 0
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_a_lost_ack_is_closed_by_the_lease_in_both_ledgers():
    cluster = PDCluster(PDConfig(engine=ENGINE, lease_s=0.5, fault_injection=True))
    try:
        p = cluster.prefill[0]
        ray.get(p.inject_fault.remote("drop_ack", 1))
        assert cluster.run_request(PROMPTS[2], GREEDY).token_ids
        ledger = cluster.orchestrator.ledger
        assert [h.kind for h in ledger.open_holds()] == ["staged"]   # left to the lease
        deadline = time.time() + 60
        while ledger.open_holds() and time.time() < deadline:
            ray.get(p.expire_leases.remote())
            cluster.orchestrator.fleet.refresh()        # P's report says the lease expired
        assert ledger.open_holds() == []
        assert ledger.counters()["released_expired"] == 1
        assert cluster.leaked_blocks() == 0
        _clean(cluster)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="class")
def pausable_cluster():
    """A 1P+1D cluster of workers/faults.py hosts, whose engine loops a test pauses with a
    request in the stage it names (`pause_at`); up only while the tests of its class run."""
    cluster = PDCluster(PDConfig(engine=ENGINE, fault_injection=True))
    yield cluster
    cluster.shutdown()


def _abort_in_stage(cluster: PDCluster, worker, stage: str, rid: str, max_tokens: int,
                    min_output_tokens: int = 0):
    """Run request `rid` through the cluster API; once `worker`'s loop holds it in `stage`
    (with at least `min_output_tokens` output tokens) the loop pauses before its next step,
    the client aborts, and the loop resumes only after the worker has let the request go.
    Returns where it was paused, the result, and the token ids the client got."""
    ray.get(worker.pause_at.remote(rid, stage, min_output_tokens))
    streamed: list[int] = []
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=cluster.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid,
        on_delta=lambda d: streamed.extend(d.token_ids))))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while (at := ray.get(worker.paused_at.remote())) is None:
            assert time.monotonic() < deadline, f"{rid} never reached {stage} on the worker"
            time.sleep(0.02)
        assert cluster.abort(rid)
        while ray.get(worker.stage_of.remote(rid)) is not None:
            assert time.monotonic() < deadline, f"the abort did not end {rid} in {stage}"
            time.sleep(0.02)
    finally:
        ray.get(worker.resume.remote())
        t.join(60)
    assert not t.is_alive()
    return at, out["r"][0], streamed


def _all_released(cluster: PDCluster) -> None:
    """No hold left on either side nor in the router's ledger, no block referenced."""
    for w in (*cluster.prefill, *cluster.decode):
        assert ray.get(w.ledger_holds.remote()) == []
    assert cluster.orchestrator.ledger.open_holds() == []
    _clean(cluster)


class TestClientAbort:
    """A client abort through the cluster API lands in the stage each test names: the worker
    holding the request pauses before its next step (no timing decides where it is), the
    abort is sent, and the loop resumes once the request is gone from that worker."""

    def test_client_abort_during_prefill_releases_both_sides(self, pausable_cluster):
        cluster = pausable_cluster
        p, d = cluster.prefill[0], cluster.decode[0]
        offered = ray.get(p.stats.remote())["transfer_offered"]
        pulled = ray.get(d.stats.remote())["transfer_transfers"]
        at, r, streamed = _abort_in_stage(cluster, p, "prefill", "abort-in-prefill", 12)
        assert (at.stage, at.output_tokens) == ("prefill", 0)   # no prompt token computed
        assert "aborted" in r.error and streamed == []
        # it ended in prefill: P staged no page of it, D pulled none
        assert ray.get(p.stats.remote())["transfer_offered"] == offered
        assert ray.get(d.stats.remote())["transfer_transfers"] == pulled
        _all_released(cluster)
        assert cluster.generate([PROMPTS[0]], GREEDY)[0].error is None    # still serving

    def test_client_abort_during_decode_releases_both_sides(self, pausable_cluster):
        cluster = pausable_cluster
        d = cluster.decode[0]
        at, r, streamed = _abort_in_stage(cluster, d, "decode", "abort-in-decode", 64,
                                          min_output_tokens=3)
        assert at.stage == "decode" and at.output_tokens >= 3     # D decoded some already
        assert "aborted" in r.error
        # it ended where it was paused: no token after that reached the client
        assert len(streamed) <= at.output_tokens < 64
        assert ray.get(d.stats.remote())["running"] == 0
        _all_released(cluster)
        assert cluster.generate([PROMPTS[0]], GREEDY)[0].error is None    # still serving


@pytest.mark.parametrize("shared_cluster", ["object_store", "shm", "grpc", "rdt", "cuda_ipc"],
                         indirect=True)
def test_disagg_matches_transformers_generate_for_every_transport(reference, shared_cluster):
    cluster = shared_cluster
    results = cluster.generate(PROMPTS, GREEDY)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == reference(PROMPTS)
    for r, p in zip(results, PROMPTS, strict=True):
        lc = r.lifecycle
        assert lc.transferred_blocks == cdiv(len(p), 16) - lc.skipped_blocks
        assert lc.transfer_bytes > 0 and lc.transfer_s > 0
        assert lc.prefill_worker == "prefill-0" and lc.decode_worker == "decode-0"
        assert lc.handoff_round_trips == 3      # admit, prefill, stream (pull + decode)
        assert lc.router_overhead_ms >= 0
    _clean(cluster)


@pytest.mark.parametrize("shared_cluster", ["object_store", "shm", "grpc", "rdt"], indirect=True)
def test_prefix_hits_on_prefill_decode_and_both(reference, shared_cluster):
    first, second = SHARED + random_prompt(7, seed=5), SHARED + random_prompt(13, seed=6)
    expected = reference([first, second])
    cluster = shared_cluster
    p, d = cluster.prefill[0], cluster.decode[0]
    # forget the other side's cache between the two requests: a hit on P only, D only, both
    for forget, p_hit, d_hit in [(d, True, False), (p, False, True), (None, True, True)]:
        for w in (p, d):
            ray.get(w.reset_prefix_cache.remote())
        reused_before = ray.get(p.stats.remote())["reused_tokens"]
        a = cluster.run_request(first, GREEDY)
        if forget is not None:
            ray.get(forget.reset_prefix_cache.remote())
        b = cluster.run_request(second, GREEDY)
        assert [a.token_ids, b.token_ids] == expected
        assert a.lifecycle.skipped_blocks == 0
        assert (b.lifecycle.skipped_blocks == 2) == d_hit
        p_reused = ray.get(p.stats.remote())["reused_tokens"] - reused_before
        assert (p_reused == 32) == p_hit, p_reused
        if d_hit:   # delta transfer: only the blocks D lacks travel
            assert b.lifecycle.transferred_blocks == 4 - 2
            assert b.lifecycle.transfer_bytes < a.lifecycle.transfer_bytes
        else:
            assert b.lifecycle.transferred_blocks == 4
        _clean(cluster)


@pytest.mark.parametrize("shared_cluster", ["object_store"], indirect=True)
def test_abort_mid_transfer_releases_both_sides(shared_cluster):
    cluster = shared_cluster
    d, p = cluster.decode[0], cluster.prefill[0]
    for w in (p, d):          # as a new cluster would: nothing of the prompt cached
        ray.get(w.reset_prefix_cache.remote())
    unknown_before = ray.get(d.stats.remote()).get("rejected_unknown", 0)
    _, _, pre = _stage_without_pull(cluster, PROMPTS[2], "abort-me")
    assert [h.kind for h in ray.get(p.ledger_holds.remote())] == ["staged"]
    assert [h.kind for h in ray.get(d.ledger_holds.remote())] == ["reserved"]
    assert ray.get(d.check_invariants.remote())["referenced"] > 0      # reserved
    assert ray.get(p.abort_transfer.remote(pre.handle.transfer_id))
    assert ray.get(d.abort.remote("abort-me"))
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown: no reservation"):
        _land(d, "abort-me", pre)
    assert ray.get(p.ledger_holds.remote()) == [] == ray.get(d.ledger_holds.remote())
    assert ray.get(d.stats.remote())["rejected_unknown"] == unknown_before + 1
    _clean(cluster)


@pytest.mark.parametrize("shared_cluster", ["object_store"], indirect=True)
def test_streamed_deltas_add_up_to_the_final_text(shared_cluster):
    cluster = shared_cluster
    free = cluster.run_request("stream me please", SamplingParams(max_tokens=16,
                                                                  ignore_eos=True))
    deltas: list[dict] = []
    r = cluster.run_request("stream me please", SamplingParams(max_tokens=16,
                                                               ignore_eos=True),
                            on_delta=deltas.append)
    assert "".join(d.text for d in deltas) == r.text == free.text
    assert [t for d in deltas for t in d.token_ids] == r.token_ids
    stop = free.text[4:7]
    if stop.strip():
        deltas.clear()
        s = cluster.run_request("stream me please", SamplingParams(
            max_tokens=16, ignore_eos=True, stop=(stop,)), on_delta=deltas.append)
        streamed = "".join(d.text for d in deltas)
        assert streamed == s.text and stop not in streamed
        assert s.lifecycle.finish_reason == "stop"
    _clean(cluster)


@pytest.mark.parametrize("shared_cluster", ["object_store"], indirect=True)
def test_seeded_sampling_is_the_same_single_engine_and_disaggregated(tiny_loaded, shared_cluster):
    """P draws the first token from the request's seeded generator; its state travels in
    the PrefillResult and D draws the rest from it: the same tokens as one engine."""
    from conftest import make_engine
    sampling = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                              ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    engine = make_engine(tiny_loaded, num_blocks=128)
    expected = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    assert expected[0] != expected[1]
    cluster = shared_cluster
    results = [cluster.run_request(p, sampling) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert all(r.lifecycle.transferred_blocks > 0 for r in results)
    _clean(cluster)
