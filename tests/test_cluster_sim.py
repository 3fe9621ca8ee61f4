"""Cluster simulator: decode batching, KV backpressure, colocation interference, cost models,
planning and the `raypd simulate` CLI (small traces, seconds)."""

import json

import pytest

from raypd.cli.simulate import add_simulate_parser
from raypd.sim.cluster_sim import ClusterConfig, ClusterSim, DecodeSim, _Seq, _slowed
from raypd.sim.cost_model import CostModel, DecodeCost, cpu_cost_model, gpu_cost_model
from raypd.sim.planner import parse_gpus, plan_text, run_plan
from raypd.sim.routing_sim import SimRequest


def reqs(n=60, rate=4.0, prompt_blocks=4, out=20, shared=True):
    return [SimRequest(j / rate, prompt_blocks * 512 - 5, out,
                       tuple(range(prompt_blocks - 1)) + (10_000 + j,) if shared else
                       tuple(10_000 * j + i for i in range(prompt_blocks)))
            for j in range(n)]


def test_decode_batch_advances_in_jumps_exactly_like_steps():
    cost = CostModel(decode=DecodeCost(base_s=0.01, per_seq_s=0.001, per_ctx_token_s=0.0))
    d = DecodeSim("d0", cost, 100, 64)
    d.join(0.0, _Seq(0, 10, 100, 0.0, []))
    d.join(0.05, _Seq(1, 3, 100, 0.05, []))
    d.advance(10.0)
    fin = {rid: f for rid, _, f in d.finished}
    # seq 0 alone: 0.011 s a step; from the first step end after 0.05 s (5 steps, 0.055 s)
    # both run at 0.012 s a step; seq 1 needs 3: ends at 0.055 + 0.036 (the join waits for the
    # running step in reality; the simulator joins at 0.05 and counts the partial step)
    assert fin[1] == pytest.approx(0.05 + 0.005 + 3 * 0.012 - 0.005, abs=0.012)
    assert fin[0] > fin[1] and fin[0] == pytest.approx(fin[1] + 2 * 0.011, abs=0.012)


def test_decode_kv_capacity_holds_requests_back_and_frees_every_block():
    cost = CostModel(kv_capacity_tokens=512 * 12)     # 12 blocks: two requests at a time
    sim = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin",
                                         slo_ttft_s=0.5, slo_tpot_s=1.0))
    res = sim.run(reqs(40, rate=50.0, out=200))
    d = sim.decode[0]
    assert res["shed"]["admission_timeout"] > 0          # waited past the TTFT SLO: shed
    assert res["served"] + res["shed_total"] == 40
    assert d.pool.num_free_blocks == d.pool.num_blocks   # every reservation released


def test_colocated_decode_pays_for_prefill_chunks_by_the_budget_and_saves_the_transfer():
    """Long prompts beside decodes: a colocated GPU's decode steps carry prefill chunks, so its
    TPOT rises with the token budget (decode-only D workers keep theirs); no KV is moved."""
    cost = gpu_cost_model("h100")
    work = [SimRequest(j * 0.2, 40 * 512 - 3, 64, tuple(100 * j + i for i in range(40)))
            for j in range(60)]
    dis = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="round_robin",
                                         slo_ttft_s=30, slo_tpot_s=1)).run(work)
    col = {b: ClusterSim(cost, ClusterConfig(num_prefill=2, colocated=True,
                                             policy="round_robin", slo_ttft_s=30, slo_tpot_s=1,
                                             colocated_budget=b)).run(work)
           for b in (512, 8192)}
    assert dis["tpot_p99_s"] < col[512]["tpot_p99_s"] < col[8192]["tpot_p99_s"]
    assert col[8192]["ttft_p50_s"] < col[512]["ttft_p50_s"]
    assert dis["transfer_gb"] > 0 and col[512]["transfer_gb"] == 0


def test_locality_sheds_what_it_cannot_serve_in_slo():
    cost = gpu_cost_model("h100")
    res = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="locality",
                                         slo_ttft_s=0.3, slo_tpot_s=1)).run(
        reqs(200, rate=40.0, prompt_blocks=30, shared=False))
    assert res["shed"]["slo_reject"] > 0 and res["served"] < 200


def _noisy(rng, t: float, sigma: float = 0.03) -> float:
    """A measurement of `t` with a 3% (one sigma, log-normal) timing noise."""
    import math
    return t * math.exp(rng.gauss(0.0, sigma))


def test_cpu_cost_model_predicts_prefill_at_lengths_it_was_not_built_from():
    """A worker that is not of the fit's form (attention cost growing as context^1.3, batched
    steps slowing with their size), run at its 512-token step budget (longer prompts in
    chunks), measured with 3% noise at three lengths and two batched steps: over ten noise
    draws the model predicts four lengths it never saw (between, past and far past them)
    within 12% (4 sigma of the noise, which covers the form's misfit too)."""
    import random
    budget = 512

    def chunk_s(u: int, c: int) -> float:
        return 0.003 + u / 1200 * (1 + ((c + u / 2) / 3000) ** 1.3)

    def true_s(n: int) -> float:
        return sum(chunk_s(min(budget, n - d), d) for d in range(0, n, budget))

    def batch_s(b: int, n: int) -> float:
        return 0.003 + b * (chunk_s(n, 0) - 0.003) * (1 + b * n / 20000)
    worst = 0.0
    for seed in range(10):
        rng = random.Random(seed)
        engine = {"prefill_tok_s": {str(n): n / _noisy(rng, true_s(n)) for n in (128, 512, 2048)},
                  "prefill_batch_s": [{"batch": b, "tokens": n,
                                       "step_s": _noisy(rng, batch_s(b, n))}
                                      for b, n in ((4, 128), (2, 256))],
                  "max_num_batched_tokens": budget,      # what the calibration ran at
                  "decode_step_ms_b1": 12.0, "decode_step_ms_b16": 42.0}
        c = cpu_cost_model(engine, chunk_tokens=budget)
        for n in (300, 1024, 1536, 3072):            # held out
            worst = max(worst, abs(c.prefill.prefill_s(n) / true_s(n) - 1))
    assert worst <= 0.12, worst
    assert "measured" in c.label and "stated defaults" in cpu_cost_model().label


def test_cpu_cost_model_fits_decode_steps_to_batch_and_context_from_a_calibration():
    """`bench engine --calibration` measures decode steps at several (batch, context) points;
    from them (3% noise, a step time not of the fit's linear form: the per-sequence cost
    sublinear in the batch, the KV reads superlinear in the context) the cost model predicts
    four batches and contexts it never saw within 15% over ten noise draws, where a plain
    bench (two batch sizes at one context: no context term) misses them by more."""
    import math
    import random

    def truth(b: int, c: int) -> float:        # ms
        return 30.0 + 4.0 * b ** 0.9 + 0.01 * b * c * (1 + 0.15 * math.log1p(c / 1024))
    held_out = ((8, 1024), (2, 768), (12, 256), (24, 512))
    worst = worst_plain = 0.0
    for seed in range(10):
        rng = random.Random(seed)
        grid = [{"batch": b, "context": c, "step_ms": _noisy(rng, truth(b, c))}
                for b, c in ((1, 128), (1, 1024), (4, 512), (16, 128), (16, 512))]
        engine = {"prefill_tok_s": {"128": 800.0, "512": 1100.0, "2048": 900.0},
                  "decode_step_ms_grid": grid, "decode_step_ms_b1": grid[0]["step_ms"],
                  "decode_step_ms_b16": grid[3]["step_ms"]}
        c = cpu_cost_model(engine)
        plain = cpu_cost_model({k: v for k, v in engine.items() if k != "decode_step_ms_grid"})
        assert c.decode.per_ctx_token_s > 0 and "context" in c.notes["decode_fit"]
        assert plain.decode.per_ctx_token_s == 0.0
        for b, ctx in held_out:
            want = truth(b, ctx) / 1e3
            worst = max(worst, abs(c.decode.step_s(b, b * ctx) / want - 1))
            worst_plain = max(worst_plain, abs(plain.decode.step_s(b, b * ctx) / want - 1))
    assert worst <= 0.15, worst
    assert worst_plain > 2 * worst, (worst_plain, worst)


def test_cpu_cost_model_tells_step_size_from_attention_by_batched_prefills():
    """One sequence of n tokens cannot tell a step's size (T^2) from attention (n^2 / 2):
    `prefill_batch_s` (b sequences in one step) can; the fit recovers both."""
    from raypd.sim.cost_model import PrefillCost
    truth = PrefillCost(tok_s=250.0, attn_ctx_tokens=4096.0, step_overhead_s=0.02,
                        chunk_tokens=2048, step_tok_sq_s=2e-7)
    engine = {"prefill_tok_s": {str(n): n / truth.step_s([(n, 0)])
                                for n in (128, 512, 1024, 2048)},
              "prefill_batch_s": [{"batch": b, "tokens": n, "step_s": truth.step_s([(n, 0)] * b)}
                                  for b, n in ((4, 128), (2, 512), (8, 128))],
              "decode_step_ms_b1": 100.0, "decode_step_ms_b16": 200.0}
    fit = cpu_cost_model(engine).prefill
    assert fit.step_tok_sq_s == pytest.approx(2e-7, rel=1e-3)
    assert fit.fit_s([(384, 0), (128, 0)]) == pytest.approx(
        truth.step_s([(384, 0), (128, 0)]), rel=1e-3)


def test_cpu_prefill_of_one_sequence_follows_the_measured_table_and_batches_by_the_fit():
    """A per-token cost flat to 512 tokens and steep after it (as measured here) is not the
    fit's form: one sequence costs what the table says at its points and in between,
    chunks continue the curve, and a batched step scales the solo costs by the fit's ratio."""
    engine = {"prefill_tok_s": {"128": 200.0, "512": 200.0, "1024": 160.0, "2048": 130.0},
              "decode_step_ms_b1": 100.0, "decode_step_ms_b16": 200.0}
    p = cpu_cost_model(engine, chunk_tokens=2048).prefill   # every table point in one step
    for n, tok_s in engine["prefill_tok_s"].items():
        assert p.step_s([(int(n), 0)]) == pytest.approx(int(n) / tok_s, rel=1e-9)
    assert p.step_s([(768, 0)]) == pytest.approx((2.56 + 6.4) / 2, rel=1e-9)
    # chunked: the two chunks add up to the whole (one step overhead more)
    assert p.step_s([(512, 0)]) + p.step_s([(512, 512)]) == pytest.approx(
        6.4 + p.step_overhead_s, rel=1e-9)
    # past the table: the fit's cost of those tokens at their context (a second chunk)
    assert p.step_s([(1000, 2048)]) == pytest.approx(p.fit_s([(1000, 2048)]), rel=1e-9)
    assert max(abs(p.fit_s([(int(n), 0)]) * v / int(n) - 1)    # the fit alone misses some
               for n, v in engine["prefill_tok_s"].items()) > 0.03
    batch = [(384, 0), (128, 0)]
    solo = p.step_s([batch[0]]) + p.step_s([batch[1]])
    assert p.step_s(batch) == pytest.approx(
        solo * p.fit_s(batch) / (p.fit_s([batch[0]]) + p.fit_s([batch[1]])), rel=1e-9)


def test_a_cost_model_rescaled_keeps_its_shapes():
    """--validate re-anchors the calibration's level to the probe: every prefill second x k_p,
    every decode second x k_d, the same curves."""
    c = cpu_cost_model({"prefill_tok_s": {"128": 200.0, "512": 200.0, "1024": 160.0},
                        "decode_step_ms_b1": 100.0, "decode_step_ms_b16": 200.0})
    s = c.scaled(1.25, 0.8)
    for n in (100, 700, 3000):
        assert s.prefill.prefill_s(n) == pytest.approx(1.25 * c.prefill.prefill_s(n))
    assert s.prefill.step_s([(300, 0), (200, 600)]) == pytest.approx(
        1.25 * c.prefill.step_s([(300, 0), (200, 600)]))
    assert s.decode.step_s(4, 2000) == pytest.approx(0.8 * c.decode.step_s(4, 2000))


def test_shared_host_slows_decode_during_prefill_steps_and_prefill_beside_decode():
    """Validation's 1P+1D on one host: decode steps overlapping a prefill step run decode_x
    slower, a prefill step starting while decode has a batch prefill_x slower."""
    import dataclasses

    from raypd.sim.cost_model import HostSlowdown, PrefillCost, SharedHost
    base = CostModel(prefill=PrefillCost(tok_s=1000.0, attn_ctx_tokens=0.0,
                                         step_overhead_s=0.0, chunk_tokens=4096),
                     decode=DecodeCost(base_s=0.1, per_seq_s=0.0, per_ctx_token_s=0.0),
                     link=dataclasses.replace(CostModel().link, gbps=1e6, latency_s=0.0),
                     kv_capacity_tokens=16 * 1000)
    slow = dataclasses.replace(base, shared_host=SharedHost(
        (HostSlowdown(1, prefill_x=1.5, decode_x=2.0),)))
    # request 0 decodes 40 tokens (4 s) from ~0.1 s; request 1 (2000 tokens: 2 s alone)
    # arrives at 1 s, while request 0 decodes
    work = [SimRequest(0.0, 100, 41, (1,)), SimRequest(1.0, 2000, 2, (2, 3, 4, 5))]

    def run(cost, shared):
        sim = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, block_tokens=512,
                                             policy="round_robin", slo_ttft_s=1e9,
                                             slo_tpot_s=1e9, shared_host=shared))
        sim.run(work)
        return sim.ttft_s, sim.tpot_s
    (t0, p0), (t1, p1) = run(base, False), run(slow, True)
    assert run(base, True) == (t0, p0)                 # factors of 1: no change
    assert t1[1] == pytest.approx(1.5 * t0[1], rel=0.01)   # 2 s prefill -> 3 s
    # request 0's 4 s of decode: the 3 s it overlaps the prefill (1..4 s) at half speed
    # make 1.5 s of progress, losing 1.5 s
    assert p0[0] * 40 == pytest.approx(4.0)
    assert p1[0] * 40 == pytest.approx(4.0 + 3.0 * (1 - 1 / 2.0), abs=0.01)
    # a step the decode batch outlives in part
    assert _slowed(0.0, 2.0, 1.0, 2.0) == pytest.approx(1.0 + (2.0 - 1.0 / 2.0))
    assert _slowed(0.0, 2.0, 0.0, 2.0) == 2.0 and _slowed(0.0, 2.0, 9.0, 2.0) == 4.0
    with pytest.raises(ValueError, match="shared_host"):
        ClusterConfig(num_prefill=2, num_decode=1, shared_host=True).validate()


def test_shared_host_factors_are_taken_at_the_decode_batch():
    from raypd.sim.cost_model import NO_SLOWDOWN, HostSlowdown, SharedHost
    eight = HostSlowdown(8, prefill_x=2.6, decode_x=1.8, handoff_x=2.9, handoff_s=0.2,
                         stage_x=1.4, send_s_per_token=1e-4, land_s_per_token=4e-4)
    one = HostSlowdown(1, prefill_x=1.2, decode_x=1.1, handoff_x=1.5, land_s_per_token=2e-4)
    sh = SharedHost((eight, one))
    assert sh.at(0) == NO_SLOWDOWN                     # an idle decode worker slows nothing
    assert sh.at(1) == one
    mid = sh.at(4.5)                                   # linear between the batches
    assert (mid.prefill_x, mid.decode_x, mid.handoff_x, mid.handoff_s, mid.stage_x,
            mid.send_s_per_token, mid.land_s_per_token) == pytest.approx(
        (1.9, 1.45, 2.2, 0.1, 1.2, 5e-5, 3e-4))
    assert sh.at(40) == eight                          # past the last: its figures
    assert SharedHost().at(5) == NO_SLOWDOWN
    with pytest.raises(ValueError, match=">= 1"):
        HostSlowdown(8, prefill_x=0.9)
    with pytest.raises(ValueError, match=">= 0"):
        HostSlowdown(1, send_s_per_token=-1e-4)
    with pytest.raises(ValueError, match=">= 0"):
        HostSlowdown(1, land_s_per_token=-1e-4)
    with pytest.raises(ValueError, match="distinct"):
        SharedHost((HostSlowdown(1), HostSlowdown(1, 2.0)))


def test_a_prefill_and_a_handoff_beside_a_large_decode_batch_take_its_slowdown():
    """Eight decodes run from ~1 s; a 2000-token prompt (2 s alone) arrives at 3 s: its step
    and its handoff take the batch-8 factors, not batch 1's (the probe measures both)."""
    import dataclasses

    from raypd.sim.cost_model import HostSlowdown, PrefillCost, SharedHost

    def host(**at8) -> SharedHost:      # nothing at batch 1, `at8` at batch 8
        return SharedHost((HostSlowdown(1), HostSlowdown(8, **at8)))
    base = CostModel(prefill=PrefillCost(tok_s=1000.0, attn_ctx_tokens=0.0,
                                         step_overhead_s=0.0, chunk_tokens=4096),
                     decode=DecodeCost(base_s=0.1, per_seq_s=0.0, per_ctx_token_s=0.0),
                     link=dataclasses.replace(CostModel().link, gbps=1e6, latency_s=0.25),
                     kv_capacity_tokens=64 * 1000)
    work = [SimRequest(0.0, 100, 200, (j,)) for j in range(8)]
    work.append(SimRequest(3.0, 2000, 2, (100, 101, 102, 103)))

    def run(shared: SharedHost) -> ClusterSim:
        sim = ClusterSim(dataclasses.replace(base, shared_host=shared),
                         ClusterConfig(num_prefill=1, num_decode=1, block_tokens=512,
                                       policy="round_robin", slo_ttft_s=1e9, max_tokens=200,
                                       slo_tpot_s=1e9, shared_host=True))
        sim.run(work)
        return sim

    def ttft_of_last(shared: SharedHost) -> float:
        return run(shared).ttft_s[len(work) - 1]
    # the prompt's landing holds the 8 running decodes up by 1e-3 s a token at batch 8
    landing = run(host(land_s_per_token=1e-3)).tpot_s[0]
    assert 199 * (landing - run(SharedHost()).tpot_s[0]) == pytest.approx(2.0, abs=1e-6)
    flat = ttft_of_last(SharedHost((HostSlowdown(1, prefill_x=1.5, handoff_x=2.0),)))
    assert flat == pytest.approx(2.0 * 1.5 + 0.25, abs=1e-6)
    steep = ttft_of_last(SharedHost((HostSlowdown(1, prefill_x=1.5, handoff_x=2.0),
                                     HostSlowdown(8, prefill_x=3.0, handoff_x=4.0,
                                                  handoff_s=0.5))))
    # the link's bytes take no time here: handoff_x does not apply to its latency;
    # handoff_s adds to it
    assert steep == pytest.approx(2.0 * 3.0 + 0.25 + 0.5, abs=1e-6)
    # a link whose bytes take 1 s for the 2000-token prompt: handoff_x stretches them
    base = dataclasses.replace(base, link=dataclasses.replace(
        base.link, gbps=2000 * base.kv_bytes_per_token / 1e9))
    assert ttft_of_last(host(handoff_x=3.0)) == pytest.approx(2.0 + 3.0 + 0.25, abs=1e-6)
    # a 1000-token prompt right behind it starts while its pages go to D: at batch 8 it
    # computes 1e-4 s longer per token sent (2000)
    work.append(SimRequest(3.5, 1000, 2, (200, 201)))
    sending = host(send_s_per_token=1e-4)
    assert ttft_of_last(sending) == pytest.approx(
        ttft_of_last(SharedHost()) + 1e-4 * 2000, abs=1e-6)


def test_gpu_roofline_states_its_efficiency_factors():
    c = gpu_cost_model("h200")
    assert c.notes["efficiency"]["prefill_mfu"] > 0 and c.notes["gpu"]["name"] == "h200"
    assert c.kv_capacity_tokens > gpu_cost_model("h100").kv_capacity_tokens


def test_parse_gpus():
    assert parse_gpus("16..256") == [16, 32, 64, 128, 256]
    assert parse_gpus("8,12") == [8, 12]
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus("256..16")


def test_plan_distserve_verdict_follows_the_slo_and_the_budget_sweep_matters():
    """Long prompts (8k tokens), short outputs, on 4 GPUs. Under a tight TPOT (20 ms) a
    colocated step cannot carry enough prefill to keep up: disaggregation wins. Under a loose
    TPOT (50 ms) the four colocated GPUs all prefill in small chunks and colocation wins; there
    the best budget (512) beats a budget as large as a prompt (a near-stalled decode) by far."""
    from raypd.replay.mooncake import WorkloadRequest
    trace = [WorkloadRequest(j * 0.25, 8000, 64, tuple(1000 * j + i for i in range(16)), j + 1)
             for j in range(60)]

    def plan(tpot: float) -> dict:
        return run_plan(trace, gpu_cost_model("h100"), [4], slo_ttft_s=3.0, slo_tpot_s=tpot,
                        policies=("locality",), requests_per_16=60, budgets=(512, 8192))
    tight, loose = plan(0.02)["sizes"]["4"], plan(0.05)
    assert tight["distserve"]["winner"] == "disaggregated"
    # by a margin (smaller once the measured per-request handoff latency is in the model)
    assert tight["distserve"]["goodput_ratio"] > 1.2
    s = loose["sizes"]["4"]
    assert s["distserve"]["winner"] == "colocated" and not s["distserve"]["direction_holds"]
    assert s["distserve"]["colocated_budget"] == 512
    cfgs = s["configs"]
    assert cfgs["colocated 4 b512 locality"]["goodput_rps"] > \
        1.5 * cfgs["colocated 4 b8192 locality"]["goodput_rps"]
    assert s["best"] == s["distserve"]["colocated"]
    assert "colocated" in plan_text(loose)
    json.dumps(loose)


def _cli(argv):
    import argparse
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_simulate_cli_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                   "not json\n")
    assert _cli([str(bad)]) == 2
    assert f"{bad}" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    engine = tmp_path / "engine.json"
    engine.write_text("{}")
    assert _cli([str(good), "--gpu", "cpu-here", "--engine-json", str(engine)]) == 2
    assert "prefill_tok_s" in capsys.readouterr().err


def test_simulate_cli_writes_json_and_html(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(
        json.dumps({"timestamp": 100 * j, "input_length": 600, "output_length": 8,
                    "hash_ids": [1, 2 + j]}) + "\n" for j in range(20)))
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    assert _cli([str(good), "--gpu", "cpu-here", "--json", str(out), "--html", str(page)]) == 0
    d = json.loads(out.read_text())
    assert d["served"] == 20 and "cpu-here stated defaults" in d["label"]
    assert "stated defaults" in capsys.readouterr().err
    assert "<table>" in page.read_text()


def test_validate_simulator_side_replays_the_same_requests():
    from raypd.bench.sim_validation import replay_requests, run_sim
    replay = replay_requests(6, (128, 384), gap_s=1.0)
    assert [len(p) for _, p in replay] == [128, 384] * 3
    arrivals = [at for at, _ in replay]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(set(arrivals)) == 6
    sim = run_sim(replay, 8, cpu_cost_model(), block_tokens=16)
    assert sim["served"] == 6 and 0 < sim["ttft_p50_s"] <= sim["ttft_p99_s"]
    assert sim["tpot_p50_s"] > 0


def test_validate_needs_cpu_here_and_refuses_what_it_does_not_use(capsys):
    assert _cli(["--validate", "--gpu", "h100"]) == 2
    assert "cpu-here" in capsys.readouterr().err
    # what it does not use is refused, never accepted and ignored
    assert _cli(["trace.jsonl", "--validate", "--gpu", "cpu-here", "--rate-scale", "2"]) == 2
    assert "TRACE, --rate-scale: not used by --validate" in capsys.readouterr().err
    # another replay: only with --validate, and never at a length the calibration or the
    # probe measures (refused before any cluster starts)
    assert _cli(["trace.jsonl", "--replay-seed", "3"]) == 2
    assert "--replay-seed: only with --validate" in capsys.readouterr().err
    assert _cli(["--validate", "--gpu", "cpu-here", "--replay-lens", "300,512"]) == 2
    assert "none the calibration or the probe measured" in capsys.readouterr().err
    assert _cli(["--validate", "--gpu", "cpu-here", "--replay-lens", "300,x"]) == 2
    assert "comma-separated" in capsys.readouterr().err


def test_bench_engine_calibration_feeds_the_cpu_cost_model():
    """`raypd bench engine --calibration` on a real (tiny) engine: the figures the cpu-here
    cost model reads, measured, and accepted by it."""
    from raypd.bench.engine import run_calibration
    cal = run_calibration(model="tiny", repeats=1, prefill_lens=(32, 64, 128),
                          decode_points=((1, 32), (2, 64), (4, 32)), decode_steps=3,
                          prefill_batches=((2, 32),))
    assert cal["evidence"] == "cpu-measured" and set(cal["prefill_tok_s"]) == {"32", "64", "128"}
    assert all(v > 0 for v in cal["prefill_tok_s"].values())
    assert [(g["batch"], g["context"]) for g in cal["decode_step_ms_grid"]] == [
        (1, 32), (2, 64), (4, 32)]
    assert all(g["step_ms"] > 0 for g in cal["decode_step_ms_grid"])
    assert [(p["batch"], p["tokens"]) for p in cal["prefill_batch_s"]] == [(2, 32)]
    c = cpu_cost_model(cal)
    assert c.label == "cpu-here measured" and c.decode.step_s(1, 32) > 0


def test_validation_anchors_speeds_and_the_link_to_the_probe():
    """The probe's prefills alone set the level of prefill and decode seconds, and the link:
    the line through what its two sizes of prompts spent besides their compute and staging
    before their first token, against their KV's bytes; a line that does not rise keeps the
    stated bandwidth (latency never below 0)."""
    from raypd.bench.sim_validation import _anchor
    c = cpu_cost_model({"prefill_tok_s": {"128": 600.0, "512": 600.0, "1024": 480.0},
                        "decode_step_ms_b1": 30.0, "decode_step_ms_b16": 60.0})
    kv = c.kv_bytes_per_token
    probe = {"prefill_tokens": 768, "context": 384, "decode_tokens": 40,
             "prefill_compute_s_alone": 1.1 * c.prefill.prefill_s(768),
             "decode_gap_s_outside": 0.9 * c.decode.step_s(1, 384 + 20),
             "handoff_s_alone": 0.02 + 768 * kv / 0.5e9,        # 20 ms + 0.5 GB/s
             "handoff_s_alone_short": 0.02 + 384 * kv / 0.5e9}
    a = _anchor(c, probe)
    assert (a["prefill_k"], a["decode_k"]) == (pytest.approx(1.1), pytest.approx(0.9))
    assert (a["link_latency_s"], a["link_gbps"]) == (pytest.approx(0.02), pytest.approx(0.5))
    flat = _anchor(c, {**probe, "handoff_s_alone": 0.12, "handoff_s_alone_short": 0.13})
    transfer = 768 * kv / (c.link.gbps * 1e9)
    assert flat["link_gbps"] == c.link.gbps
    assert flat["link_latency_s"] == pytest.approx(0.12 - transfer)
    tiny = _anchor(c, {**probe, "handoff_s_alone": transfer / 2,
                       "handoff_s_alone_short": transfer})
    assert tiny["link_latency_s"] == 0.0


def test_cpu_cost_model_moves_kv_in_the_calibrated_pools_dtype():
    base = {"prefill_tok_s": {"128": 600.0, "512": 600.0, "1024": 480.0},
            "decode_step_ms_b1": 30.0, "decode_step_ms_b16": 60.0}
    assert cpu_cost_model(base).kv_bytes_per_token == 2 * 30 * 3 * 64 * 4   # fp32 if unsaid
    assert cpu_cost_model({**base, "kv_dtype": "bfloat16"}).kv_bytes_per_token == \
        2 * 30 * 3 * 64 * 2
