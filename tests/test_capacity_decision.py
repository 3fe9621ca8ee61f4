"""The decision table's capacity actions: when the pool is the boundary, the report names the
action (keep, evict to tier 2, recompute, compress) that would have served the run best, with
the measured figures it used; when the pool is not the boundary it names none."""

from __future__ import annotations

from conftest import make_engine, random_prompt

from raypd.replay.report import build_report, capacity_action
from raypd.replay.submit import RequestRecord
from workers.request import SamplingParams

SP = SamplingParams(max_tokens=4, ignore_eos=True)
GATE_PASS = {"int8": {"passed": True, "ppl_delta_pct": 0.05, "greedy_agreement": 0.97,
                      "capacity_ratio": 3.76, "evidence": "cpu-measured"}}
GATE_FAIL = {"int8": {"passed": False, "ppl_delta_pct": 0.05, "greedy_agreement": 0.53,
                      "capacity_ratio": 3.76, "evidence": "cpu-measured"}}


def _replay(engine, prompts) -> list[RequestRecord]:
    """Run prompts one after another through one engine; records as a replay would make them
    (repeated_prefix: share of the prompt's full blocks an earlier prompt had)."""
    seen: set[int] = set()
    records = []
    for i, p in enumerate(prompts):
        [r] = engine.generate([p], SP)
        hashes = r.block_hashes[:len(p) // 16]
        rep = sum(h in seen for h in hashes) * 16 / len(p)
        seen.update(hashes)
        lc = r.lifecycle
        records.append(RequestRecord(str(i), ok=True, status=200, sent_s=float(i),
                                     first_token_s=i + lc.ttft_s, end_s=i + lc.e2e_s,
                                     prompt_tokens=len(p), output_tokens=len(r.output_token_ids),
                                     cached_tokens=lc.cached_tokens, repeated_prefix=rep))
    return records


def _workload() -> list[list[int]]:
    """Two system prompts taking turns, each followed by its own question: a small pool evicts
    one system prompt while serving the other."""
    systems = [random_prompt(64, seed=s) for s in (1, 2)]
    return [systems[i % 2] + random_prompt(8, seed=100 + i) for i in range(6)]


def _report(engine, records, kv_gates=None) -> dict:
    stats = dict(engine.get_stats(), worker_id="w0", role="prefill")
    return build_report(records, params={"model": "tiny", "kv_gates": kv_gates}, wall_s=6.0,
                        stats_after=[stats])


def _capacity(report) -> list[dict]:
    return [d for d in report["diagnosis"] if d["finding"].startswith("capacity action")]


def test_a_run_bound_by_its_pool_names_the_capacity_action_with_its_figures(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=5, kv_tier2_gb=1e-3)
    report = _report(engine, _replay(engine, _workload()), GATE_FAIL)
    [action] = _capacity(report)
    why = action["because"]
    assert why["tier2_enabled"] and why["tier2_hits"] > 0 and why["evictions"] > 0
    assert why["reloaded_tokens"] == 16 * why["tier2_hits"]
    assert why["prefill_s_per_token"] > 0 and why["reload_s_per_token"] > 0
    assert why["kv_gate"]["int8"]["passed"] is False
    # the action is the one its measured figures imply (the int8 gate failed: no compress)
    cheaper = why["reload_s_per_token"] < why["prefill_s_per_token"]
    assert why["action"] == ("evict to tier 2" if cheaper else "recompute")
    assert why["estimated_s"]["recompute_s"] is not None
    engine.check_invariants()


def test_a_run_with_room_in_its_pool_names_no_capacity_action(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, kv_tier2_gb=1e-3)
    report = _report(engine, _replay(engine, _workload()), GATE_PASS)
    assert not _capacity(report)
    assert not any(d["finding"].startswith("capacity bound") for d in report["diagnosis"])
    assert report["evictions"] == 0 and report["tier2_hits"] == 0


def _m(**kw) -> dict:
    m = {"peak_block_share": 0.95, "evictions": 10, "preemptions": 0, "recomputed_tokens": 0,
         "repeated_prefix_share": 0.5, "prompt_tokens": 1000, "reused_tokens": 500,
         "tier2_slots": 0, "prefill_s_per_token": 1e-3, "reload_s_per_token": None}
    m.update(kw)
    return m


def test_capacity_action_follows_the_measured_figures():
    # evictions dropped nothing that was needed again: keep
    assert capacity_action(_m())["because"]["action"] == "keep"
    # reuse lost, tier 2 off, int8 gate failed: recompute, and it says tier 2 was not measured
    a = capacity_action(_m(reused_tokens=200), GATE_FAIL)
    assert a["because"]["action"] == "recompute" and "kv_tier2_gb" in a["finding"]
    assert a["because"]["reuse_lost_tokens"] == 300
    # reload measured cheaper than prefill: evict to tier 2
    a = capacity_action(_m(reused_tokens=400, tier2_slots=64, reloaded_tokens=160,
                           reload_s_per_token=1e-5))
    assert a["because"]["action"] == "evict to tier 2"
    assert a["because"]["estimated_s"]["evict_to_tier2_s"] < \
        a["because"]["estimated_s"]["recompute_s"]
    # requests preempted and the int8 gate passed: compress (only capacity helps them)
    a = capacity_action(_m(preemptions=3, recomputed_tokens=900, tier2_slots=64,
                           reload_s_per_token=1e-5), GATE_PASS)
    assert a["because"]["action"] == "compress" and "int8" in a["finding"]
