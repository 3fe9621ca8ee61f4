"""Live decode-to-decode migration: a running request moves D1 -> D2 with its KV blocks, its
sampler state and its stream position; the client's stream neither repeats nor loses a token;
a move that fails after the freeze re-prefills elsewhere, never an error."""

from __future__ import annotations

import pytest
import ray
from conftest import hf_greedy, random_prompt, start_streaming, wait_until

from cluster.pd import PDCluster, PDConfig
from kvcache.manager import cdiv
from protocol.ledger import ACKED, FILLED
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

ENGINE = dict(model="tiny", num_blocks=128, block_size=16)
LONG = SamplingParams(max_tokens=160, ignore_eos=True)
PROMPT = random_prompt(37, seed=11)        # 2 full blocks + a partial one
MOVE_AT = 5                                # tokens streamed before the move is asked

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def expected(tiny_reference):
    return hf_greedy(tiny_reference, PROMPT, LONG.max_tokens)


@pytest.fixture(scope="module")
def cluster(request):
    """A 1P+2D cluster (fault injection on) of the transport the test names (`request.param`,
    parametrized indirectly), shared by the tests of that transport: pytest runs them together
    and shuts this cluster down before the next transport's starts, so that only one is up at a
    time (idle clusters' actors and load reporters slow every other test down). The tests that
    start a cluster of their own come first in this file: none runs beside a shared one."""
    c = PDCluster(PDConfig(engine=ENGINE, num_prefill=1, num_decode=2, fault_injection=True,
                           flow=FlowConfig(transport=request.param)))
    yield c
    c.shutdown()


def run_moving(cluster: PDCluster, sampling: SamplingParams, rid: str,
               target: str | None = None, arm=None):
    """Run PROMPT, asking its decode to move once MOVE_AT tokens reached the client (from
    the request's own thread: no sleep, no race with its end). `target` "other": the decode
    worker it is not on, after `arm(that worker's handle)`. Returns (result, streamed token
    ids, streamed text, whether the move was asked)."""
    tokens: list[int] = []
    text: list[str] = []
    asked: list[bool] = []
    o = cluster.orchestrator

    def on_delta(d) -> None:
        tokens.extend(d.token_ids)
        text.append(d.text)
        if len(tokens) >= MOVE_AT and not asked:
            to = target
            if to == "other":
                here = o.fleet.worker_id(o._flights[rid].decode)
                to = next(w for w in ("decode-0", "decode-1") if w != here)
                arm(o.fleet.handle(to))
            asked.append(o.migrate(rid, target=to))
    result = cluster.run_request(PROMPT, sampling, request_id=rid, on_delta=on_delta)
    return result, tokens, "".join(text), asked == [True]


def _clean(cluster: PDCluster) -> None:
    for counts in cluster.check_invariants():
        assert counts["referenced"] == 0, counts
    assert cluster.leaked_blocks() == 0


def _wait_restarted(cluster: PDCluster, timeout_s: float = 120.0) -> None:
    """Until every worker answers and the router takes requests on it again: one that exited
    restarts (max_restarts), and a call that reaches it meanwhile fails with
    ActorUnavailableError (the request may well have finished before Ray has brought it back,
    on a slow machine); the router marks it healthy at its next report after that, and until
    then a move there is refused ("unplaced")."""
    fleet = cluster.orchestrator.fleet

    def answers() -> bool:
        try:
            ray.get([w.check_invariants.remote() for w in cluster.workers])
        except ray.exceptions.ActorUnavailableError:
            return False
        return all(fleet.takes_requests(fleet.worker_id(w)) for w in cluster.workers)
    wait_until(answers, timeout_s)


def test_drain_under_load_moves_running_decodes_and_loses_nothing(tiny_reference):
    """Scale decode workers 2 -> 1 while both decode: the drained worker's running requests
    move with their KV (not recomputed), all complete with generate()'s tokens, the worker is
    removed, and every hold on it ended with a release reason. The remaining worker's pool
    (72 blocks) holds its own three requests to the end (63 or 66 blocks of 16 tokens) but not
    a moved one besides: it preempts and recomputes, and the tokens are still generate()'s."""
    cluster = PDCluster(PDConfig(engine=dict(ENGINE, num_blocks=72), num_prefill=1,
                                 num_decode=2, flow=FlowConfig(policy="round_robin")))
    try:
        prompts = [random_prompt(20 + 7 * i, seed=100 + i) for i in range(6)]
        sampling = SamplingParams(max_tokens=300, ignore_eos=True)   # still decoding at the drain
        want = [hf_greedy(tiny_reference, p, sampling.max_tokens) for p in prompts]
        threads, results = start_streaming(cluster, prompts, sampling)
        cluster.scale(decode=1, wait=True, timeout_s=120)
        for t in threads:
            t.join(120)
        assert [r.token_ids for r in results] == want
        moved = sum(r.lifecycle.migrations for r in results)
        assert moved >= 1 and cluster.orchestrator.migrations["moved"] == moved
        assert all(r.lifecycle.decode_worker != "decode-1" for r in results
                   if r.lifecycle.migrations)
        assert [cluster.orchestrator.fleet.worker_id(w) for w in cluster.decode] == ["decode-0"]
        assert sum(s.get("preemptions", 0) for s in cluster.stats()) >= 1
        ledger = cluster.orchestrator.ledger
        assert ledger.open_holds() == []          # every hold ended with a release reason
        assert ledger.released[ACKED] >= moved
        _clean(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("migrate", [False, True])
def test_kv_pressure_moves_a_decode_instead_of_preempting(migrate, tiny_reference):
    """Two long requests start on decode-0 while decode-1 is draining; decode-0's pool cannot
    hold both to the end (9 blocks of 64 tokens, of 8). decode-1 then takes requests again.
    Without migrate_on_kv_pressure decode-0 preempts and recomputes; with it the router moves
    one to decode-1 first (decode-0 is under pressure from the start: fewer free blocks than
    4 per running sequence, ~160 decode steps before it would preempt): no preemption, the
    same tokens."""
    engine = dict(ENGINE, num_blocks=8, block_size=64)
    flow = FlowConfig(report_interval_s=0.02, migrate_on_kv_pressure=migrate)
    cluster = PDCluster(PDConfig(engine=engine, num_prefill=1, num_decode=2, flow=flow))
    try:
        fleet = cluster.orchestrator.fleet
        fleet.drain("decode-1")
        shared = random_prompt(64, seed=5)
        prompts = [shared + random_prompt(6, seed=6), shared + random_prompt(6, seed=7)]
        sampling = SamplingParams(max_tokens=250, ignore_eos=True)
        want = [hf_greedy(tiny_reference, p, sampling.max_tokens) for p in prompts]
        threads, results = start_streaming(cluster, prompts, sampling)
        fleet.undrain("decode-1")
        for t in threads:
            t.join(120)
        assert [r.token_ids for r in results] == want
        preempted = sum(s.get("preemptions", 0) for s in cluster.stats())
        moved = sum(r.lifecycle.migrations for r in results)
        if migrate:
            assert moved >= 1 and preempted == 0, (
                [(r.lifecycle.decode_worker, r.lifecycle.migrations) for r in results],
                cluster.orchestrator.moved_by_cause)
        else:
            assert moved == 0 and preempted >= 1   # the scenario does exhaust decode-0
        _clean(cluster)
    finally:
        cluster.shutdown()


def test_rebalance_moves_half_the_gap_to_a_worker_that_joined(tiny_reference):
    """Four long requests decode on decode-0 while decode-1 drains; decode-1 takes requests
    again (a worker that joined): rebalance_decodes moves half the gap (2) to it, the
    requests asking for the most output first; every request ends with generate()'s tokens."""
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=1, num_decode=2,
                                 flow=FlowConfig(report_interval_s=0.05)))
    try:
        fleet, o = cluster.orchestrator.fleet, cluster.orchestrator
        fleet.drain("decode-1")
        prompts = [random_prompt(20 + 3 * i, seed=400 + i) for i in range(4)]
        lengths = [150, 200, 250, 300]       # the moves take a few ms: all still decode
        want = [hf_greedy(tiny_reference, p, n) for p, n in zip(prompts, lengths, strict=True)]
        threads, results = start_streaming(
            cluster, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
        fleet.undrain("decode-1")
        assert o.rebalance_decodes() == 2    # 4 on decode-0, 0 on decode-1
        assert o.rebalance_decodes() == 0    # under way, or done: 2 and 2
        for t in threads:
            t.join(120)
        assert [r.token_ids for r in results] == want
        moved = [r.lifecycle.migrations for r in results]
        assert moved == [0, 0, 1, 1]         # the two asking for the most output
        assert {r.lifecycle.decode_worker for r in results[2:]} == {"decode-1"}
        _clean(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("cluster", ["object_store", "shm", "grpc", "rdt", "cuda_ipc"],
                         indirect=True)
def test_migration_mid_stream_gives_generate_tokens_with_no_gap_or_repeat(cluster, expected):
    # as on a new cluster (another test of this transport may have run first): nothing of
    # PROMPT cached, so that all of it travels at the handoff and again at the move
    ray.get([w.reset_prefix_cache.remote() for w in cluster.workers])
    result, streamed, text, asked = run_moving(cluster, LONG,
                                               f"mig-{cluster.cfg.flow.transport}")
    assert asked
    lc = result.lifecycle
    assert lc.migrations == 1 and lc.migration_fallbacks == 0 and lc.retries == 0
    assert result.token_ids == expected
    assert streamed == result.token_ids           # every token once, in order
    assert text == result.text
    assert lc.decode_worker in ("decode-0", "decode-1")
    assert lc.transferred_blocks > cdiv(len(PROMPT), 16)   # the prompt's and the output's
    assert cluster.orchestrator.migrations["moved"] >= 1
    ledger = cluster.orchestrator.ledger
    assert ledger.released[ACKED] >= 2 and ledger.released[FILLED] >= 2
    _clean(cluster)


@pytest.mark.parametrize("cluster", ["shm"], indirect=True)
def test_migration_to_a_named_worker_and_back(expected, cluster):
    first, *_ = run_moving(cluster, LONG, "to-1", target="decode-1")
    assert first.lifecycle.decode_worker == "decode-1" and first.lifecycle.migrations == 1
    second, *_ = run_moving(cluster, LONG, "to-0", target="decode-0")
    assert second.lifecycle.migrations in (0, 1)       # already there: nothing to move
    assert second.lifecycle.decode_worker == "decode-0"
    assert first.token_ids == second.token_ids == expected
    _clean(cluster)


@pytest.mark.parametrize("cluster", ["shm"], indirect=True)
def test_seeded_sampling_gives_the_same_tokens_with_and_without_a_move(cluster):
    seeded = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=4321,
                            ignore_eos=True)
    still = cluster.run_request(PROMPT, seeded)
    moved, streamed, _, asked = run_moving(cluster, seeded, "seeded")
    assert asked and moved.lifecycle.migrations == 1
    assert moved.token_ids == still.token_ids == streamed
    _clean(cluster)


@pytest.mark.parametrize("cluster", ["object_store"], indirect=True)
def test_a_failed_move_re_prefills_and_completes(expected, cluster):
    """D2 dies pulling the pages, then (restarted) refuses them (a failed pull): each time the
    request re-prefills on a live worker and completes with the same tokens; no block stays
    held anywhere. In this order the re-prefill can land on D2 while the failed move's
    cleanup (an abort of the epoch the move used) is still on its way there: the retry runs
    under a later epoch, so that abort does not end it (it did: RequestAborted)."""

    for fault in ("died", "refused"):
        def arm(d2, fault=fault) -> None:
            if fault == "refused":
                ray.get(d2.inject_transfer_faults.remote(1))
            else:
                ray.get(d2.inject_exit_on_pull.remote())
        result, streamed, text, asked = run_moving(cluster, LONG, f"fail-{fault}", "other",
                                                   arm)
        assert asked
        assert result.lifecycle.migration_fallbacks == 1 and result.lifecycle.migrations == 0
        assert result.token_ids == expected == streamed
        assert text == result.text
        if fault == "died":
            cluster.orchestrator.fleet.refresh()
            _wait_restarted(cluster)
        _clean(cluster)
    assert cluster.orchestrator.migrations["fallback"] >= 2
