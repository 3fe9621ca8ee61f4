"""The colocated baseline a real engine would be, and the simulator's honesty toward policies:
chunked prefill with decode mixed into each step under a token budget, `max_decode_batch`
enforced, decode KV reserved by `max_tokens` (never the true output), each plan replica on its
own arrivals."""

import math

import pytest

from raypd.sim.cluster_sim import ClusterConfig, ClusterSim
from raypd.sim.colocated_sim import ColocatedGPU
from raypd.sim.cost_model import CostModel, DecodeCost, LinkCost, PrefillCost, gpu_cost_model
from raypd.sim.planner import own_arrivals, plan_workload
from raypd.sim.routing_sim import SimRequest, namespace_root, trace_hashes
from router.policies import BasePolicy, make_policy

# prefill 10k tok/s, no attention term, 10 ms a step; decode 10 ms a step whatever the batch
COST = CostModel(prefill=PrefillCost(tok_s=10_000.0, attn_ctx_tokens=0.0, step_overhead_s=0.01,
                                     chunk_tokens=8192),
                 decode=DecodeCost(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0),
                 link=LinkCost(gbps=1e6, latency_s=0.0), kv_capacity_tokens=512 * 400)


def _long_prompt_beside_a_decode(budget: int) -> tuple[ColocatedGPU, float, float]:
    """Request 0 (one block, 201 tokens of output) decodes when request 1 (a 20k-token
    prompt) arrives; returns the GPU, the longest step request 0 sat in while request 1
    prefilled, and request 1's TTFT."""
    gpu = ColocatedGPU("g", COST, 400, budget, 8, 512)
    root = namespace_root()
    work = [SimRequest(0.0, 500, 201, (1,)), SimRequest(0.5, 40 * 512 - 3, 2,
                                                        tuple(range(100, 140)))]
    for j, (r, hs) in enumerate(zip(work, trace_hashes(work), strict=True)):
        gpu.serve(j, hs, root, r.hash_ids, r.num_tokens, r.output_tokens, r.timestamp_s,
                  math.ceil((r.num_tokens + 256) / 512))
        gpu.advance(r.timestamp_s)
    gpu.advance(math.inf)
    first = {rid: f for f, rid in [(s.end, m.rid) for s in gpu.steps for m, _ in s.members
                                   if m.pos >= m.num_tokens]}
    beside = [(s.end - s.start) / s.k for s in gpu.steps
              if s.batch and any(m.rid == 1 for m, _ in s.members)]
    assert beside, "request 0 never decoded beside request 1's prefill"
    assert all(s.batch == 1 for s in gpu.steps if any(m.rid == 1 for m, _ in s.members))
    return gpu, max(beside), first[1] - 0.5


def test_colocated_step_mixes_decode_into_prefill_chunks_under_the_budget():
    """A running decode gets a token in every step while a long prompt is prefilled in
    chunks: its longest wait is one budget's step (the decode token plus budget - 1 prompt
    tokens), not the 2 s the whole prompt takes; a bigger budget trades its TPOT for the
    prompt's TTFT."""
    small, gap_small, ttft_small = _long_prompt_beside_a_decode(512)
    big, gap_big, ttft_big = _long_prompt_beside_a_decode(8192)
    assert gap_small == pytest.approx(COST.mixed_step_s([(511, 0)], 1, 0), rel=1e-6)
    assert gap_small < 0.07 < 2.0 < ttft_small             # 20k tokens take > 2 s at 10k tok/s
    assert gap_big == pytest.approx(COST.mixed_step_s([(8191, 0)], 1, 0), rel=1e-6)
    assert ttft_big < ttft_small and gap_big > 10 * gap_small
    (rid, first, fin), = [f for f in small.finished if f[0] == 0]
    assert (fin - first) / 200 <= gap_small                # its TPOT is bounded by the budget
    # every block is back: prompt blocks cached (evictable), nothing held or promised
    assert small.reserved == 0 and small.pool.num_used_blocks == 0


def test_a_mixed_step_costs_at_least_its_decode_and_its_prefill():
    c = gpu_cost_model("h100")
    chunks = [(1000, 4000)]
    assert c.mixed_step_s(chunks, 0, 0) == c.prefill.step_s(chunks)
    assert c.mixed_step_s([], 64, 64 * 3000) == c.decode.step_s(64, 64 * 3000)
    both = c.mixed_step_s(chunks, 64, 64 * 3000)
    assert both >= max(c.prefill.step_s(chunks), c.decode.step_s(64, 64 * 3000))
    assert both < c.prefill.step_s(chunks) + c.decode.step_s(64, 64 * 3000)   # one weight read


@pytest.mark.parametrize("colocated", [False, True])
def test_no_step_decodes_more_than_max_decode_batch(colocated):
    work = [SimRequest(0.01 * j, 500, 100, (j,)) for j in range(24)]
    cfg = ClusterConfig(num_prefill=1, num_decode=1, colocated=colocated,
                        policy="round_robin", slo_ttft_s=60, slo_tpot_s=60, max_decode_batch=4)
    sim = ClusterSim(COST, cfg)
    res = sim.run(work)
    assert res["served"] == 24 and res["max_decode_batch_seen"] == 4
    wide = ClusterSim(COST, ClusterConfig(**{**cfg.__dict__, "max_decode_batch": 64})).run(work)
    assert wide["max_decode_batch_seen"] > 4
    assert res["tpot_p99_s"] > wide["tpot_p99_s"]       # the waiting ones wait for a slot


class Recording(BasePolicy):
    """Round robin, recording the output length each request shows the policy."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_policy("round_robin")
        self.seen: list[int] = []

    def choose_decode(self, req, workers, matches):
        self.seen.append(req.output_tokens)
        return self.inner.choose_decode(req, workers, matches)

    def choose_prefill(self, req, workers, matches):
        self.seen.append(req.output_tokens)
        return self.inner.choose_prefill(req, workers, matches)


@pytest.mark.parametrize("colocated", [False, True])
def test_decode_kv_is_reserved_by_max_tokens_not_the_true_output(colocated):
    """Two requests of 4 blocks with a 2-token output arrive together on a 12-block worker:
    reserved by their true output (5 blocks each) both would run at once; the router only
    knows max_tokens = 2048 (8 blocks each), so the second waits for the first; the policy
    is shown max_tokens, never the output."""
    cost = CostModel(prefill=COST.prefill, decode=COST.decode, link=COST.link,
                     kv_capacity_tokens=512 * 12)
    work = [SimRequest(0.0, 4 * 512 - 5, 2, (1, 2, 3, 4)),
            SimRequest(0.0, 4 * 512 - 5, 2, (5, 6, 7, 8))]

    def run(max_tokens: int) -> tuple[dict, Recording]:
        pol = Recording()
        cfg = ClusterConfig(num_prefill=1, num_decode=1, colocated=colocated, slo_ttft_s=60,
                            slo_tpot_s=60, max_tokens=max_tokens)
        sim = ClusterSim(cost, cfg, policy=pol)
        sim.run(work)
        return sim.ttft_s, pol
    tight, _ = run(8)
    wide, pol = run(2048)
    assert set(pol.seen) == {2048}
    assert wide[1] > tight[1] + 0.05    # the second waited for the first's blocks
    gpu = ColocatedGPU("g", cost, 12, 2048, 8, 512)
    gpu.serve(0, trace_hashes(work[:1])[0], namespace_root(), (1, 2, 3, 4), work[0].num_tokens,
              2, 0.0, math.ceil((work[0].num_tokens + 2048) / 512))
    assert gpu.room() == 12 - 8          # reserved for max_tokens, though it decodes 2


def test_replicas_draw_their_own_arrivals():
    """Each replica keeps the trace's gaps on its own timeline: timelines differ, and the
    busiest second of a 4-replica cluster is not 4 times a single replica's."""
    import random

    from raypd.replay.mooncake import WorkloadRequest
    rng = random.Random(3)
    rows, t = [], 0.0
    for b in range(8):                        # 8 bursts of 10 at random times
        t += rng.uniform(20, 80)
        rows += [WorkloadRequest(t, 1000, 16, (100 * b + i,), len(rows) + 1) for i in range(10)]
    one = plan_workload(rows, 16, 80)
    four = plan_workload(rows, 64, 80)
    assert len(four) == 4 * len(one)
    lines = {}
    for r in four:
        lines.setdefault(r.tenant, []).append(r.timestamp_s)
    assert len({tuple(v) for v in lines.values()}) == 4

    def peak(rs):
        ts = sorted(r.timestamp_s for r in rs)
        return max(sum(1 for u in ts if s <= u < s + 1.0) for s in ts)
    assert peak(one) == 10 and peak(four) <= 2 * peak(one)   # aligned: 40
    base = [SimRequest(r.timestamp_s, 512, 16, (i,)) for i, r in enumerate(rows)]
    gaps = sorted(b.timestamp_s - a.timestamp_s for a, b in zip(base, base[1:], strict=False))
    mine = own_arrivals(base, 2)
    mine_gaps = sorted(b.timestamp_s - a.timestamp_s for a, b in zip(mine, mine[1:],
                                                                      strict=False))
    assert sum(g == 0 for g in mine_gaps) == sum(g == 0 for g in gaps)   # bursts kept


def test_simulate_cli_runs_a_colocated_budget_and_refuses_options_out_of_place(tmp_path, capsys):
    import argparse
    import json

    from raypd.cli.simulate import add_simulate_parser

    def cli(*argv: str) -> int:
        parser = argparse.ArgumentParser()
        add_simulate_parser(parser.add_subparsers(dest="cmd"))
        args = parser.parse_args(["simulate", *argv])
        return args.func(args)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 500 * j, "input_length": 3000,
                                         "output_length": 40,
                                         "hash_ids": [j, *range(100 * j + 100, 100 * j + 105)]}) + "\n"
                             for j in range(20)))
    out = tmp_path / "r.json"
    assert cli(str(trace), "--colocated", "--prefill", "2", "--token-budget", "512",
               "--max-tokens", "64", "--max-decode-batch", "8", "--json", str(out)) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["colocated_budget"], cfg["max_tokens"], cfg["max_decode_batch"]) == (512, 64, 8)
    for argv, word in ((["--token-budget", "512"], "--colocated"),
                       (["--colocated-budgets", "512"], "--plan"),
                       (["--plan", "--gpus", "4", "--colocated"], "--colocated-budgets"),
                       (["--plan", "--gpus", "4", "--colocated-budgets", "0"], "budgets"),
                       (["--max-tokens", "0"], "--max-tokens")):
        capsys.readouterr()
        assert cli(str(trace), *argv) == 2, argv
        assert word in capsys.readouterr().err, argv


def test_a_transfers_latency_does_not_hold_the_decode_workers_link():
    """Two prompts prefilled back to back (60 ms each) go to one D over a link of 1 s latency
    and ~no bandwidth cost: each first token comes ~1 s after its prefill, not the second 1 s
    after the first's (round trips overlap; only the bytes queue on the link)."""
    cost = CostModel(prefill=COST.prefill, decode=COST.decode,
                     link=LinkCost(gbps=1e6, latency_s=1.0), kv_capacity_tokens=512 * 400)
    work = [SimRequest(0.0, 500, 4, (1,)), SimRequest(0.0, 500, 4, (2,))]
    sim = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin",
                                         slo_ttft_s=60, slo_tpot_s=60))
    sim.run(work)
    one = COST.prefill.step_s([(500, 0)])
    assert sim.ttft_s[0] == pytest.approx(one + 1.0, abs=1e-3)
    assert sim.ttft_s[1] < 2 * one + 1.0 + 1e-3 < sim.ttft_s[0] + 1.0
