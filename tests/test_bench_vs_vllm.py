"""scripts/bench_vs_vllm.py: each run's prefix-cache fraction from the servers' /metrics."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_vs_vllm",
                                               os.path.join(ROOT, "scripts", "bench_vs_vllm.py"))
bvv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bvv)

VLLM_BEFORE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 0.0
vllm:prompt_tokens_created 1.7e9
"""
VLLM_AFTER = """vllm:prompt_tokens_total{engine="0",model_name="m"} 33768.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 16384.0
"""
RAYPD_BEFORE = "raypd_prompt_tokens_total 2048.0\nraypd_cached_prompt_tokens_total 512.0\n"
RAYPD_AFTER = "raypd_prompt_tokens_total 6144.0\nraypd_cached_prompt_tokens_total 1536.0\n"


def test_counter_sum_adds_every_label_set_and_ignores_other_names():
    text = ('x_total 5\nraypd_prompt_tokens_total{a="1"} 3.0\n'
            'raypd_prompt_tokens_total{a="2"} 4.0\nraypd_prompt_tokens_created 9\n')
    assert bvv.counter_sum(text, bvv.PROMPT_COUNTERS) == 7.0
    assert bvv.counter_sum(text, bvv.CACHED_COUNTERS) is None


def test_cached_fraction_of_a_run_for_both_servers():
    assert bvv.cached_fraction(VLLM_BEFORE, VLLM_AFTER) == 16384 / 32768
    assert bvv.cached_fraction(RAYPD_BEFORE, RAYPD_AFTER) == 1024 / 4096


def test_cached_fraction_is_none_without_counters_or_prompts():
    assert bvv.cached_fraction("", "") is None                  # llama.cpp: no /metrics
    assert bvv.cached_fraction(RAYPD_BEFORE, RAYPD_BEFORE) is None   # no prompt in between


def test_summary_reports_each_runs_cached_fraction_and_their_median(tmp_path):
    run = {"completed": 4, "failed": 0, "output_throughput": 10.0, "median_ttft_ms": 1.0,
           "p99_tpot_ms": 2.0, "median_tpot_ms": 1.5}
    for r, (before, after) in enumerate([(VLLM_BEFORE, VLLM_AFTER), ("", "")]):
        stem = tmp_path / f"vllm.random_x.{r}"
        json.dump(run, open(f"{stem}.json", "w"))
        (tmp_path / f"vllm.random_x.{r}.metrics.before").write_text(before)
        (tmp_path / f"vllm.random_x.{r}.metrics.after").write_text(after)
    out = tmp_path / "out.json"
    bvv.summarize(str(tmp_path), str(out), 2, ["random_x|vllm|vllm|--dataset-name random"])
    s = json.load(open(out))["workloads"]["random_x"]["servers"]["vllm"]
    assert [r["prompt_cached_fraction"] for r in s["per_run"]] == [0.5, None]
    assert s["prompt_cached_fraction"] == 0.5


def _one_run(work, server, name, before, after):
    run = {"completed": 4, "failed": 0, "output_throughput": 10.0, "median_ttft_ms": 1.0,
           "p99_tpot_ms": 2.0, "median_tpot_ms": 1.5}
    json.dump(run, open(work / f"{server}.{name}.0.json", "w"))
    (work / f"{server}.{name}.0.metrics.before").write_text(before)
    (work / f"{server}.{name}.0.metrics.after").write_text(after)


def test_prefix_hits_in_a_workload_not_built_for_reuse_miss_its_targets(tmp_path):
    """Half of a random workload's prompts from cache (once: seeds shared across workloads)
    means the figures are not the workload's: every one of its targets counts as missed."""
    table = []
    for name in ("random_x", "prefix_repetition_c8"):
        for server in ("vllm", "default", "colocated"):
            hit = server == "vllm"
            _one_run(tmp_path, server, name, VLLM_BEFORE if hit else RAYPD_BEFORE,
                     VLLM_AFTER if hit else RAYPD_BEFORE.replace("2048", "3048"))
        table.append(f"{name}|vllm,default,colocated|vllm|--dataset-name random")
    out = bvv.summarize(str(tmp_path), str(tmp_path / "out.json"), 1, table)
    rnd, rep = out["targets_met"]["random_x"], out["targets_met"]["prefix_repetition_c8"]
    assert out["workloads"]["random_x"]["prompt_cached_fraction_max"] == 0.5
    assert rnd["no_accidental_prefix_hits"] is False and not any(rnd.values())
    assert "no_accidental_prefix_hits" not in rep        # built to reuse: hits are the point
    assert rep["default_output_tok_s_ratio>=0.9"] and rep["no_failed_requests"]


def test_a_random_workload_without_prefix_hits_keeps_its_targets(tmp_path):
    for server in ("vllm", "default", "colocated"):
        _one_run(tmp_path, server, "random_x", RAYPD_BEFORE,
                 RAYPD_BEFORE.replace("2048", "3048"))
    out = bvv.summarize(str(tmp_path), str(tmp_path / "out.json"), 1,
                        ["random_x|vllm,default,colocated|vllm|--dataset-name random"])
    t = out["targets_met"]["random_x"]
    assert t["no_accidental_prefix_hits"] and t["default_output_tok_s_ratio>=0.9"]


def test_a_run_whose_counters_were_not_read_is_not_taken_for_clean(tmp_path):
    """No fraction for a raypd run (its /metrics unreadable, or a counter renamed) is unknown,
    not zero: the guard must not pass a run it could not check."""
    for server in ("vllm", "default"):
        _one_run(tmp_path, server, "random_x", RAYPD_BEFORE,
                 RAYPD_BEFORE.replace("2048", "3048"))
    _one_run(tmp_path, "colocated", "random_x", "", "")
    out = bvv.summarize(str(tmp_path), str(tmp_path / "out.json"), 1,
                        ["random_x|vllm,default,colocated|vllm|--dataset-name random"])
    assert out["targets_met"]["random_x"]["no_accidental_prefix_hits"] is False
