"""Each routing policy's choice on small hand-built cases."""

import pytest

from kvcache.hashing import hash_block
from protocol.errors import RoutingRejected, SLOUnmeetable
from protocol.step_rates import PrefillFit
from router.policies import POLICIES, RoutingRequest, WorkerState, make_policy

BS = 512


def req(n_blocks: int, tag: int = 0, rid: str = "r", t: float = 0.0, **kw) -> RoutingRequest:
    parent, hashes = 12345, []
    for i in range(n_blocks):
        parent = hash_block(parent, (tag, i))
        hashes.append(parent)
    return RoutingRequest(rid, hashes, n_blocks * BS, BS, arrival_s=t, **kw)


FIT = PrefillFit(tok_s=10_000.0, ctx_tokens=0.0, overhead_s=0.0, num_steps=8)


def ws(n: int, **kw) -> list[WorkerState]:
    return [WorkerState(f"w{i}", prefill_fit=FIT, **kw) for i in range(n)]


def test_make_policy_by_name_and_unknown_name_lists_valid():
    assert set(POLICIES) == {"round_robin", "least_loaded", "cache_aware", "kv_cost", "locality"}
    assert make_policy().name == "locality"
    with pytest.raises(ValueError) as e:
        make_policy("fastest")
    for name in POLICIES:
        assert name in str(e.value)


def test_round_robin_cycles_and_skips_draining():
    p = make_policy("round_robin")
    workers = ws(3)
    workers[1].draining = True
    picks = [p.choose_prefill(req(2), workers, {}).worker_id for _ in range(4)]
    assert picks == ["w0", "w2", "w0", "w2"]


def test_all_draining_is_rejected():
    workers = ws(2, draining=True)
    for name in POLICIES:
        with pytest.raises(RoutingRejected) as e:
            make_policy(name).choose_prefill(req(2), workers, {})
        assert e.value.reason == "no_workers"


def test_least_loaded_counts_tokens_not_requests():
    workers = ws(2)
    workers[0].num_requests, workers[0].running_tokens = 1, 100_000   # one huge prompt
    workers[1].num_requests, workers[1].queued_tokens = 6, 6_000      # six small ones
    d = make_policy("least_loaded").choose_prefill(req(2), workers, {})
    assert d.worker_id == "w1" and d.reason == "least_loaded"


# ---- cache_aware (SGLang) -----------------------------------------------------------------
def test_cache_aware_routes_to_best_match_above_threshold():
    r = req(10)
    workers = ws(3, num_requests=2)
    p = make_policy("cache_aware", use_index_matches=True)
    d = p.choose_prefill(r, workers, {"w1": 4, "w2": 2})   # 0.4 > 0.3
    assert (d.worker_id, d.reason, d.matched_blocks) == ("w1", "cache_hit", 4)


def test_cache_aware_uses_its_own_routing_tree_by_default():
    p = make_policy("cache_aware")
    workers = ws(3, num_requests=1)
    first = p.choose_prefill(req(10, rid="a"), workers, {})
    again = p.choose_prefill(req(10, rid="b"), workers, {})  # index knows nothing yet
    assert again.worker_id == first.worker_id and again.reason == "cache_hit"


def test_cache_aware_imbalance_needs_both_thresholds():
    p = make_policy("cache_aware", use_index_matches=True, balance_abs_threshold=8,
                    balance_rel_threshold=1.5)
    workers = ws(2)
    workers[0].num_requests, workers[1].num_requests = 30, 25   # abs 5 <= 8: balanced
    assert p.choose_prefill(req(4), workers, {"w0": 4}).reason == "cache_hit"
    workers[0].num_requests, workers[1].num_requests = 40, 30   # abs 10 > 8, 40 < 45: balanced
    assert p.choose_prefill(req(4), workers, {"w0": 4}).worker_id == "w0"
    workers[0].num_requests, workers[1].num_requests = 50, 30   # 20 > 8 and 50 > 45
    d = p.choose_prefill(req(4), workers, {"w0": 4})
    assert (d.worker_id, d.reason) == ("w1", "balance")


def test_cache_aware_miss_goes_to_smallest_tree():
    p = make_policy("cache_aware")
    workers = ws(3, num_requests=1)
    p.tree.record("w0", req(50, tag=1).block_hashes, now=0.0)
    p.tree.record("w2", req(30, tag=2).block_hashes, now=0.0)
    d = p.choose_prefill(req(4, tag=3), workers, {})
    assert (d.worker_id, d.reason) == ("w1", "smallest_tree")


def _route_misses(policy, workers, n, prefill_tok_s=10_000.0):
    """Route n distinct misses, adding each to the chosen worker's queue as a router would."""
    picks = []
    for j in range(n):
        r = req(8, tag=1000 + j, rid=f"m{j}", t=0.0)
        d = policy.choose_prefill(r, workers, {})
        w = next(w for w in workers if w.worker_id == d.worker_id)
        w.num_requests += 1
        w.queued_tokens += r.num_tokens
        picks.append(d.worker_id)
    return picks


def test_smallest_tree_miss_overloads_a_fresh_worker_but_locality_does_not():
    """A worker that just joined (empty tree) but already has a queue below SGLang's imbalance
    threshold: every miss goes to it under cache_aware; locality spreads by estimated TTFT."""
    def cluster():
        workers = ws(4)
        for w in workers[:3]:
            w.num_requests, w.queued_tokens = 2, 4_000
        workers[3].num_requests, workers[3].queued_tokens = 30, 200_000  # 20 s of work queued
        return workers

    sglang = make_policy("cache_aware")
    for i in range(3):
        sglang.tree.record(f"w{i}", req(2000, tag=50 + i).block_hashes, now=0.0)
    picks = _route_misses(sglang, cluster(), 12)
    assert picks == ["w3"] * 12

    ours = _route_misses(make_policy("locality"), cluster(), 12)
    assert "w3" not in ours
    assert {ours.count(w) for w in ("w0", "w1", "w2")} == {4}


# ---- kv_cost (Dynamo) ---------------------------------------------------------------------
def test_kv_cost_logits_by_hand():
    r = req(10)   # 5120 tokens, 10 blocks
    workers = ws(2)
    workers[0].queued_tokens, workers[0].active_blocks = 2048, 6
    workers[1].active_blocks = 2
    p = make_policy("kv_cost")
    # w0: (2048 + 5120 - 8*512)/512 = 6 prefill blocks + 6 + (10 - 8) active = 14
    # w1: 5120/512 = 10 prefill blocks + 2 + 10 active = 22
    assert p.logits(r, workers, {"w0": 8}) == [14.0, 22.0]
    assert p.choose_prefill(r, workers, {"w0": 8}).worker_id == "w0"


def test_kv_cost_overlap_weight_trades_cache_for_load():
    r = req(10)
    workers = ws(2)
    workers[0].queued_tokens, workers[0].active_blocks = 2048, 16   # holds 8 blocks, busier
    workers[1].active_blocks = 2
    # w0: 6 w + 16 + 2, w1: 10 w + 2 + 10
    assert make_policy("kv_cost").choose_prefill(r, workers, {"w0": 8}).worker_id == "w1"
    assert make_policy("kv_cost", overlap_score_weight=2.0).choose_prefill(
        r, workers, {"w0": 8}).worker_id == "w0"


def test_kv_cost_temperature_samples_cheaper_workers_more_often():
    workers = ws(2)
    workers[1].queued_tokens = 50 * BS
    p = make_policy("kv_cost", temperature=0.5, seed=1)
    picks = [p.choose_prefill(req(10), workers, {}).worker_id for _ in range(400)]
    assert 0.5 < picks.count("w0") / 400 < 1.0


# ---- locality (ours) ----------------------------------------------------------------------
def test_locality_prefers_the_holder_when_its_queue_is_short():
    r = req(20)
    workers = ws(3)
    workers[1].queued_tokens = 1_000
    d = make_policy("locality").choose_prefill(r, workers, {"w1": 16})
    assert (d.worker_id, d.reason, d.matched_blocks) == ("w1", "cache_hit", 16)
    # estimate = wait 0.1 s + the 4 uncached blocks at 10k tok/s
    assert d.est_ttft_s == pytest.approx(0.1 + 4 * BS / 10_000.0)


def test_locality_spills_a_hot_prefix_when_the_holder_is_overloaded():
    r = req(20)
    workers = ws(3)
    workers[1].queued_tokens = 400_000   # 40 s queued behind the hot prefix
    d = make_policy("locality").choose_prefill(r, workers, {"w1": 20})
    assert d.worker_id in ("w0", "w2") and d.reason == "min_ttft"


def test_locality_spills_hot_work_once_its_holder_got_more_than_its_share():
    """The holder of a hot prefix wins every request while the (lagging) reports still show
    its queue short; the balance term charges it for the compute it was sent beyond the
    mean, so part of the hot work goes elsewhere before its queue says so. Without the term
    (balance_ratio=None) it all goes to the holder."""
    def route(policy) -> dict[str, int]:
        workers, counts = ws(4), {}
        for j in range(40):
            d = policy.choose_prefill(req(20, tag=j, rid=f"r{j}", t=0.5 * j), workers,
                                      {"w1": 16})   # w1 holds the first 16 blocks of each
            counts[d.worker_id] = counts.get(d.worker_id, 0) + 1
        return counts
    assert route(make_policy("locality", balance_ratio=None)) == {"w1": 40}
    balanced = route(make_policy("locality"))
    assert 0 < balanced.get("w1", 0) < 40 and len(balanced) > 1


def test_locality_balance_leaves_a_quiet_clusters_first_requests_to_their_prefixes():
    """A couple of requests is no imbalance: the second request of a quiet two-worker cluster
    still goes where its prefix is, though that worker got all the work so far."""
    p, workers = make_policy("locality"), ws(2)
    first = p.choose_prefill(req(20, tag=1, rid="a", t=0.0), workers, {})
    second = p.choose_prefill(req(20, tag=2, rid="b", t=1.0), workers, {first.worker_id: 16})
    assert second.worker_id == first.worker_id and second.reason == "cache_hit"


def _spills_at(n_blocks: int, hit_blocks: int) -> float:
    """The smallest excess (the holder's sent compute over the others', as a fraction of the
    mean) at which `locality` sends a request whose first `hit_blocks` blocks w0 holds to an
    idle non-holder."""
    lo, hi = 0.0, 4.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        p, workers = make_policy("locality"), ws(4)
        big = 1000.0                   # seconds sent lately: far past the handful-of-requests gate
        p._sent = {w.worker_id: (big * (1 + mid if i == 0 else 1), 0.0)
                   for i, w in enumerate(workers)}
        d = p.choose_prefill(req(n_blocks, tag=n_blocks), workers, {"w0": hit_blocks})
        lo, hi = (lo, mid) if d.worker_id != "w0" else (mid, hi)
    return hi


def test_locality_spills_a_cheap_hit_at_the_same_imbalance_as_a_long_prompt():
    """The balance term is charged in the unit of what a spill costs (the spread of the
    request's compute over the workers), so a holder over its share spills at the same
    relative excess whether what the holder would compute is one block or forty; charged in
    the holder's own compute, the cheap hit would never spill."""
    cheap, long = _spills_at(40, 39), _spills_at(80, 40)
    assert 0 < cheap < 1 and cheap == pytest.approx(long, abs=0.01)


def test_locality_counts_no_imbalance_until_the_mean_covers_a_few_dozen_requests():
    """A cold cluster's first seconds: a worker that got a few prompts more than the others
    (the cold prefixes it happened to take) still gets the hot requests of its prefixes; the
    same excess over a mean of many requests spills them."""
    def holder_wins(sent_s: float) -> bool:
        p, workers = make_policy("locality"), ws(4)
        p._sent = {w.worker_id: (sent_s * (3 if i == 0 else 1), 0.0)
                   for i, w in enumerate(workers)}
        return p.choose_prefill(req(20), workers, {"w0": 16}).worker_id == "w0"
    one_request_s = 20 * BS / FIT.tok_s           # the request's compute on a non-holder
    assert holder_wins(2 * one_request_s)         # 4 requests' worth over a mean of 2
    assert not holder_wins(100 * one_request_s)   # 200 over a mean of 100


def test_locality_estimate_uses_the_reported_fit_queue_and_measured_pair_bandwidth():
    r = RoutingRequest("r", req(8).block_hashes, 8 * BS, BS, decode_worker="d1")
    fit = PrefillFit(tok_s=4_000.0, ctx_tokens=8_192.0, overhead_s=0.03, num_steps=10)
    w = WorkerState("w0", prefill_fit=fit, queued_s=2.0, routed_s=0.5, kv_bytes_per_token=1000,
                    transfer_gbps_to={"d0": 50.0, "d1": 5.0})
    est, compute = make_policy("locality").estimate(r, w, 2)
    want_compute = 0.03 + 6 * BS / 4_000.0 * (1 + (8 * BS + 2 * BS) / (2 * 8_192.0))
    assert compute == pytest.approx(want_compute)
    # wait = reported queue + routed since the report; transfer at the d1 pair's 5 GB/s
    assert est == pytest.approx(2.5 + want_compute + 8 * BS * 1000 / 5e9)
    assert fit.seconds(4096, 0) == pytest.approx(0.03 + 4096 / 4000 * 1.25)


def test_locality_without_measurements_ranks_but_claims_no_estimate_and_never_rejects():
    workers = [WorkerState(f"w{i}", queued_tokens=10**7) for i in range(2)]
    workers[1].queued_tokens = 0
    p = make_policy("locality", ttft_slo_s=0.001)
    d = p.choose_prefill(req(4), workers, {})
    assert d.worker_id == "w1" and d.est_ttft_s is None


def test_locality_estimates_an_unmeasured_worker_by_the_pooled_fit():
    slow = PrefillFit(tok_s=1_000.0, ctx_tokens=0.0, overhead_s=0.0, num_steps=8)
    workers = [WorkerState("w0", prefill_fit=slow), WorkerState("w1")]
    p = make_policy("locality")
    pooled = p.pooled_fit(workers)
    assert pooled is slow
    assert p.estimate(req(4), workers[1], 0, pooled)[1] == pytest.approx(4 * BS / 1_000.0)


def test_worker_state_has_no_room_for_anything_but_reported_fields():
    w = WorkerState("w0")
    with pytest.raises(AttributeError):
        w.backlog_s = 1.0     # the simulator's oracle of old: not a field, cannot be added


def test_locality_rejects_early_when_no_worker_meets_the_slo():
    workers = ws(2, queued_tokens=300_000)   # 30 s queued everywhere
    p = make_policy("locality", ttft_slo_s=5.0)
    with pytest.raises(SLOUnmeetable) as e:
        p.choose_prefill(req(4), workers, {})
    assert e.value.reason == "slo_reject" and e.value.retry_after_s >= 25
    workers[0].queued_tokens = 0
    assert p.choose_prefill(req(4), workers, {}).worker_id == "w0"


def test_locality_joins_a_prefix_still_being_computed():
    """The index learns of blocks only when their prefill finishes; locality remembers where it
    just sent a prefix and queues the follow-up behind it."""
    p = make_policy("locality")
    workers = ws(4)
    first = p.choose_prefill(req(60, rid="a", t=0.0), workers, {})
    w = next(w for w in workers if w.worker_id == first.worker_id)
    w.queued_tokens = 60 * BS
    follow = RoutingRequest("b", list(req(60).block_hashes) + [7], 61 * BS, BS, arrival_s=0.5)
    d = p.choose_prefill(follow, workers, {})
    assert d.worker_id == first.worker_id and d.matched_blocks == 60


# ---- decode choice -------------------------------------------------------------------------
def test_decode_prefers_the_worker_holding_the_prefix():
    r = req(16, output_tokens=256)
    dec = [WorkerState(f"d{i}", free_blocks=1000, total_blocks=1000) for i in range(3)]
    d = make_policy("locality").choose_decode(r, dec, {"d2": 12})
    assert (d.worker_id, d.matched_blocks) == ("d2", 12)


def test_decode_skips_full_workers_and_balances_running_tokens():
    r = req(16, output_tokens=256)
    dec = [WorkerState("d0", free_blocks=5, running_tokens=0),
           WorkerState("d1", free_blocks=500, running_tokens=200_000),
           WorkerState("d2", free_blocks=400, running_tokens=10_000)]
    # d0 cannot hold the 17 blocks; d1 has room but 200k running tokens
    assert make_policy("locality").choose_decode(r, dec, {}).worker_id == "d2"
    # holding the prompt, d0 only needs the block for the output: it fits and pulls nothing
    assert make_policy("locality").choose_decode(r, dec, {"d0": 16}).worker_id == "d0"
    for d in dec:
        d.free_blocks = 3
    with pytest.raises(RoutingRejected) as e:
        make_policy("round_robin").choose_decode(r, dec, {})
    assert e.value.reason == "no_decode_capacity"
