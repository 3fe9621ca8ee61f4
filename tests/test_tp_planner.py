"""Tensor parallelism in the planners: `raypd kv-plan --tp` (a rank's KV heads, bytes, blocks
and weights), the GPU roofline of TP workers (compute and reads split over the ranks, two
all-reduces a layer, the ranks' memory for KV), and `raypd simulate --plan` choosing each
role's TP (small traces, seconds)."""

from __future__ import annotations

import json
import re

import pytest

from kvcache.kv_sizing import KNOWN_CONFIGS, rank_kv_heads, size_kv, weight_bytes
from raypd.cli import main
from raypd.sim.cost_model import (
    MODELS,
    TP_ALLREDUCE,
    AllReduceCost,
    feasible_tps,
    gpu_cost_model,
    tp_allreduce_s,
    tp_refusal,
    worker_kv_tokens,
)
from raypd.sim.planner import plan_text, run_plan, split

KIB = 1024


# ---- kv-plan --tp --------------------------------------------------------------------------
def test_a_rank_holds_its_share_of_the_kv_heads_or_one_replicated():
    assert [rank_kv_heads(8, t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    per_rank = {t: size_kv(KNOWN_CONFIGS["llama-3-8b"], tp=t).bytes_per_token_per_rank
                for t in (1, 2, 8, 16)}
    assert per_rank == {1: 128 * KIB, 2: 64 * KIB, 8: 16 * KIB, 16: 16 * KIB}   # 16: replicated
    mla = size_kv(KNOWN_CONFIGS["deepseek-v3"], tp=8)      # the latent is on every rank
    assert mla.kv_heads_per_rank is None and mla.bytes_per_token_per_rank == mla.bytes_per_token


def test_blocks_per_rank_fill_each_ranks_budget():
    p = size_kv(KNOWN_CONFIGS["llama-3-70b"], block_size=16, budget_gb=1.0, tp=4)
    assert p.bytes_per_block_per_rank == 16 * 80 * KIB
    assert p.blocks_in_budget_per_rank == 2**30 // (16 * 80 * KIB)
    assert p.tokens_in_budget == p.blocks_in_budget_per_rank * 16
    assert size_kv(KNOWN_CONFIGS["llama-3-70b"]).tokens_in_budget * 4 == pytest.approx(
        p.tokens_in_budget, rel=0.01)      # 1 GiB on each of 4 ranks: 4x the tokens


def test_weights_split_over_the_ranks_but_the_embedding():
    total, one = weight_bytes(KNOWN_CONFIGS["llama-3-8b"], 1)
    assert total == one == pytest.approx(8.03e9 * 2, rel=0.001)        # Meta-Llama-3-8B
    _, four = weight_bytes(KNOWN_CONFIGS["llama-3-8b"], 4)
    embed = 128256 * 4096 * 2
    assert four == pytest.approx((total - embed) / 4 + embed, rel=0.01)
    assert weight_bytes(KNOWN_CONFIGS["deepseek-v3"]) is None        # MLA / MoE: not modeled


def test_kv_plan_tp_prints_per_rank_columns_and_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["kv-plan", "--model", "llama-3-70b", "--tp", "4", "--budget-gb", "40",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kv_heads/rank" in text and "weights_GB/rank" in text and "per rank" in text
    d = json.loads(out.read_text())
    assert (d["tp"], d["kv_heads_per_rank"], d["bytes_per_token_per_rank"]) == (4, 2, 80 * KIB)
    assert d["weight_bytes_per_rank"] < d["weight_bytes"] / 3


def test_kv_plan_refuses_a_tp_the_heads_refuse_with_the_rule(capsys):
    assert main(["kv-plan", "--model", "qwen2.5-7b", "--tp", "8"]) == 2
    assert "--tp 8: model qwen2.5-7b: tp 8 does not divide the model's 28 query heads" in \
        capsys.readouterr().err
    assert main(["kv-plan", "--model", "llama-3-8b", "--tp", "0"]) == 2
    assert "tp must be >= 1" in capsys.readouterr().err


# ---- the TP roofline -----------------------------------------------------------------------
def test_allreduce_cost_grows_with_the_ranks():
    m = MODELS["llama3-70b"]
    costs = [tp_allreduce_s(m, 1024, t) for t in (1, 2, 4, 8)]
    assert costs[0] == 0.0 and costs == sorted(costs) and len(set(costs)) == 4
    # a ring: 2 (t - 1) / t of the message a rank, plus the latency; two a layer
    ring = AllReduceCost(100.0, 1e-5)
    assert ring.seconds(1e9, 4) == pytest.approx(1e-5 + 1.5 * 1e9 / 100e9)
    assert tp_allreduce_s(m, 1024, 2) == pytest.approx(
        2 * 80 * TP_ALLREDUCE.seconds(1024 * 8192 * 2, 2))


def test_a_tp_worker_splits_compute_and_reads_and_pays_the_allreduce():
    one, two = gpu_cost_model("h100", "llama3-8b"), gpu_cost_model("h100", "llama3-8b",
                                                                     prefill_tp=2, decode_tp=2)
    # prefill: twice the FLOPs, less the all-reduce's bytes; a step pays its latencies
    assert one.prefill.tok_s < two.prefill.tok_s < 2 * one.prefill.tok_s
    assert two.prefill.step_overhead_s == pytest.approx(
        one.prefill.step_overhead_s + tp_allreduce_s(MODELS["llama3-8b"], 0, 2))
    # decode: half the weight and KV reads a rank, and the all-reduces
    assert two.decode.per_ctx_token_s == pytest.approx(one.decode.per_ctx_token_s / 2)
    assert one.decode.base_s / 2 < two.decode.base_s < one.decode.base_s
    assert two.decode.per_seq_s > one.decode.per_seq_s / 2
    # the KV pool: both ranks' memory after their (halved) weights
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens
    assert "allreduce" in two.notes["tp"] and two.label.endswith("TP P2/D2")


def test_a_model_too_large_for_one_gpu_needs_tp_2():
    assert "weights at tp 1" in tp_refusal("h100", "llama3-70b", 1)
    assert feasible_tps("h100", "llama3-70b") == (2, 4, 8)
    assert feasible_tps("h100", "llama3-8b") == (1, 2, 4, 8)
    assert "does not divide the model's 9 query heads" in tp_refusal("h100", "smollm2-135m", 2)
    with pytest.raises(ValueError, match="decode TP 1 for llama3-70b on h100"):
        gpu_cost_model("h100", "llama3-70b", prefill_tp=2, decode_tp=1)
    assert worker_kv_tokens("h100", "llama3-70b", 4) > 2 * worker_kv_tokens("h100", "llama3-70b", 2)


# ---- the planner chooses each role's TP ----------------------------------------------------
def test_split_places_whole_workers():
    assert split(16, 0.25, 1, 1) == (4, 12)            # TP 1: the shares as before
    assert split(16, 0.25, 8, 8) == (1, 1)
    assert split(16, 0.75, 2, 4) == (6, 1)
    assert split(4, 0.875, 2, 4) is None                # no room for a TP-4 decode worker


def _trace(n=40, prompt=2000, out=64, gap=0.25):
    from raypd.replay.mooncake import WorkloadRequest
    return [WorkloadRequest(j * gap, prompt, out, tuple(1000 * j + i for i in range(4)), j + 1)
            for j in range(n)]


def _plan_70b(gpus: int = 8) -> dict:
    def tp_cost(p_tp, d_tp):
        return gpu_cost_model("h100", "llama3-70b", prefill_tp=p_tp, decode_tp=d_tp)
    return run_plan(_trace(), tp_cost(2, 2), [gpus], 3.0, 0.05, policies=("locality",),
                    requests_per_16=40, budgets=(512,), tp_cost=tp_cost,
                    tp_choices=feasible_tps("h100", "llama3-70b"))


def test_the_plan_gives_a_model_too_large_for_one_gpu_tp_2_or_more():
    plan = _plan_70b()
    s = plan["sizes"]["8"]
    assert s["tp"]["choices"] == [2, 4]                 # 8 GPUs: one P and one D of TP <= 4
    cfgs = s["configs"]
    assert all(r["prefill_tp"] >= 2 and r["decode_tp"] >= 2 for r in cfgs.values())
    assert all(r["gpus_used"] <= 8 for r in cfgs.values())
    assert {(r["prefill_tp"], r["decode_tp"]) for r in cfgs.values() if not r["colocated"]} >= \
        {(2, 2), (4, 4)}
    assert s["best_prefill_tp"] >= 2 and s["best_decode_tp"] >= 2
    assert s["best_goodput_rps"] > 0
    json.dumps(plan)


def test_the_plan_table_has_each_roles_tp_and_the_decode_verdict():
    plan = _plan_70b()
    text = plan_text(plan)
    header = next(line for line in text.splitlines() if "goodput-optimal" in line)
    assert "P-TP" in header and "D-TP" in header
    v = plan["sizes"]["8"]["tp"]["decode"]
    assert set(v["options"]) == {"2", "4"}       # D's GPUs regrouped at each TP size
    assert re.fullmatch(r"decode: TP \d x \d replicas? (beats TP \d x \d replicas? (by \d+% "
                        r"goodput|\(which meets no SLO\))|ties TP \d x \d replicas? .*)",
                        v["line"]), v["line"]
    assert v["line"] in text and isinstance(v["larger_tp_wins"], bool)


def test_without_tp_costs_the_plan_is_tp_1_as_before():
    plan = run_plan(_trace(20), gpu_cost_model("h100"), [4], 3.0, 0.05,
                    policies=("locality",), requests_per_16=20, budgets=(512,))
    cfgs = plan["sizes"]["4"]["configs"]
    assert list(cfgs) == ["1P:3D locality", "2P:2D locality", "3P:1D locality",
                          "colocated 4 b512 locality"]
    assert all((r["prefill_tp"], r["decode_tp"]) == (1, 1) for r in cfgs.values())


def _simulate(tmp_path, *argv) -> int:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 250 * j, "input_length": 2000,
                                         "output_length": 16,
                                         "hash_ids": [0, 1, 2, 9000 + j]})
                             + "\n" for j in range(12)))
    return main(["simulate", str(trace), *argv])


def test_simulate_plan_tp_flags(tmp_path, capsys):
    assert _simulate(tmp_path, "--plan", "--gpus", "4", "--model", "llama3-70b",
                     "--tp-choices", "1") == 2
    assert "no TP size of 1 fits llama3-70b on h100: tp 1: llama3-70b's weights" in \
        capsys.readouterr().err
    assert _simulate(tmp_path, "--plan", "--gpus", "4", "--decode-tp", "2") == 2
    assert "--plan searches each role's TP" in capsys.readouterr().err
    assert _simulate(tmp_path, "--tp-choices", "2") == 2
    assert "--tp-choices is searched by --plan" in capsys.readouterr().err
    assert _simulate(tmp_path, "--model", "llama3-70b") == 2      # one run at TP 1: refused
    assert "prefill TP 1 for llama3-70b on h100: llama3-70b's weights at tp 1" in \
        capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert _simulate(tmp_path, "--plan", "--gpus", "4", "--model", "llama3-70b",
                     "--colocated-budgets", "512", "--plan-requests", "12",
                     "--slo-ttft", "5", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "P-TP" in text and "decode:" in text
    d = json.loads(out.read_text())
    assert d["tp_choices"] == [2, 4, 8] and d["sizes"]["4"]["tp"]["choices"] == [2]


def test_simulate_one_run_at_a_tp_counts_its_gpus(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _simulate(tmp_path, "--model", "llama3-70b", "--prefill-tp", "2", "--decode-tp",
                     "4", "--prefill", "2", "--json", str(out)) == 0
    d = json.loads(out.read_text())
    assert (d["num_gpus"], d["prefill_tp"], d["decode_tp"]) == (8, 2, 4)
    assert "TP P2/D4" in d["label"]
    capsys.readouterr()
