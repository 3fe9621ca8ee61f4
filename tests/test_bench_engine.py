"""`raypd bench engine`'s figures are taken alike on both sides of each comparison: the read
ceiling is the best sample as the matmul ceiling is; prefill FLOPs are what the engine computes
(torch's own FLOP counter on the engine's forward is the reference); `throughput_ratio_mixed`
runs the same batches on both sides; `step_overhead_ms` is a median of `--repeats` runs; the
kernel-vs-SDPA figure checks that both compute the same attention; options that would be
ignored are refused."""

from __future__ import annotations

import argparse
import statistics

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from raypd.bench import engine as bench
from raypd.bench.prefill_attention import AttentionShape, bench_one
from raypd.bench.spec_bandwidth import spec_read_gbps
from raypd.cli import bench as cli_bench
from workers.engine import EngineConfig, LLMEngine
from workers.model_loader import load_model
from workers.request import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_the_read_ceiling_is_the_best_sample_with_the_mean_beside_it():
    samples = [20.0, 60.0, 25.0, 30.0, 15.0]
    cpu = bench._read_ceiling(samples, torch.device("cpu"), "AMD EPYC")
    assert cpu["memory_read_gbps"] == 60.0
    assert cpu["memory_read_gbps_mean"] == pytest.approx(30.0)
    assert "memory_read_spec_gbps" not in cpu        # a CPU's name gives no bandwidth
    gpu = bench._read_ceiling([3000.0, 2900.0], torch.device("cuda"), "NVIDIA H100 80GB HBM3")
    assert gpu["memory_read_spec_gbps"] == 3350.0
    assert gpu["memory_read_vs_spec"] == pytest.approx(3000.0 / 3350.0)
    unknown = bench._read_ceiling([100.0], torch.device("cuda"), "Some Future GPU")
    assert unknown["memory_read_spec_gbps"] is None and unknown["memory_read_vs_spec"] is None


def test_the_spec_table_tells_apart_names_that_contain_each_other():
    assert spec_read_gbps("NVIDIA H200") == 4800.0
    assert spec_read_gbps("NVIDIA GH200 480GB") == 4000.0
    assert spec_read_gbps("NVIDIA H100 PCIe") == 2000.0
    assert spec_read_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert spec_read_gbps("NVIDIA L40") == 864.0 and spec_read_gbps("NVIDIA L4") == 300.0
    assert spec_read_gbps("NVIDIA H100 80GB HBM3", "cpu") is None


def test_prefill_flops_are_what_the_engine_computes(tiny):
    """The stock model's path (every matmul a torch op torch's FLOP counter sees) through the
    engine's own step: a 100-token prompt computes every layer on every row and lm_head on its
    last row alone. tiny is untied, so counting the head on every row would be 2x off here."""
    hf, tok, info = tiny
    engine = LLMEngine(EngineConfig(model="tiny", model_impl="stock", num_blocks=64,
                                    enable_prefix_caching=False), loaded=(hf, tok, info))
    engine.add_request(list(range(5, 105)), SamplingParams(max_tokens=1, ignore_eos=True))
    with FlopCounterMode(display=False) as counter:
        while engine.has_unfinished():
            engine.step()
    matmuls = counter.get_flop_counts()["Global"]
    counted = sum(v for op, v in matmuls.items() if str(op) in ("aten.mm", "aten.addmm"))
    assert counted == bench.prefill_flops(hf, info, 100, sampled_rows=1).linear
    assert counted < bench.prefill_flops(hf, info, 100, sampled_rows=100).linear


def test_the_mixed_comparison_runs_the_same_batches_on_both_sides(monkeypatch):
    seen: dict[str, list] = {"hf": [], "engine": []}

    def hf_generate(model, batch, lengths, pad):
        seen["hf"].append(list(zip(map(tuple, batch), lengths, strict=True)))
        return 2.0

    def engine_run(engine, prompts, max_tokens):
        seen["engine"].append(list(zip(map(tuple, prompts), max_tokens, strict=True)))
        return 1.0, 0.5, 0, []
    monkeypatch.setattr(bench, "_hf_generate", hf_generate)
    monkeypatch.setattr(bench, "_engine_run", engine_run)
    mixed = [([7] * n, o) for n, o in zip((30, 10, 50, 20, 40, 60), (3, 1, 4, 1, 5, 9),
                                          strict=True)]
    out = bench._mixed_comparison(None, None, mixed, batch_size=3, pad=0, repeats=1)
    assert seen["hf"] == seen["engine"] and len(seen["hf"]) == 2
    assert [len(b[0][0]) for b in seen["hf"]] == [10, 40]           # sorted by prompt length
    assert out["mixed_batches"] == [3, 3] and out["throughput_ratio_mixed"] == 2.0
    assert out["mixed_output_tokens"] == 23


def test_step_overhead_is_the_median_of_repeats_runs(tiny, monkeypatch):
    """Each run decodes the batch to its end and gives its median; the figure is the median of
    the runs (one run would be a single sample of a noisy machine)."""
    engine = LLMEngine(EngineConfig(model="tiny", num_blocks=128, enable_prefix_caching=False),
                       loaded=tiny)
    steps = []
    real_step = engine.step

    def counted_step():
        steps.append(len(engine.scheduler.running))
        return real_step()
    monkeypatch.setattr(engine, "step", counted_step)
    out = bench._step_overhead(engine, [[5, 6, 7, 8]] * 4, new=6, repeats=3)
    runs = out["step_overhead_ms_runs"]
    assert len(runs) == 3 and all(r > 0 for r in runs)
    assert out["step_overhead_ms"] == statistics.median(runs)
    assert out["step_overhead_batch"] == 4
    assert len(steps) >= 3 * 6                    # three runs of 6 tokens: prefill + 5 decodes
    engine.check_invariants()


def test_the_kernel_figure_is_none_where_the_kernel_disagrees_with_sdpa(monkeypatch):
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16)
    ok = bench_one(shape, 64, torch.float32, repeats=1, calls=1)
    if not ok["kernel_applies"]:
        pytest.skip("no float32 prefill kernel on this machine (AVX2 + FMA)")
    assert ok["agrees"] and ok["speedup_median"] > 0 and ok["max_abs_diff"] < 1e-4
    assert ok["sdpa_baseline"] in ("sdpa_gqa", "sdpa_expanded")
    # a kernel that drops the causal mask: fast or not, it is no figure
    from raypd.bench import prefill_attention

    def full_attention(q, k, v, scale):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale,
                                                             enable_gqa=True)
        return o[0].transpose(0, 1)
    monkeypatch.setattr(prefill_attention, "_kernel", lambda dtype: ("broken", full_attention))
    bad = bench_one(shape, 64, torch.float32, repeats=1, calls=1)
    assert bad["agrees"] is False and bad["speedup_median"] is None
    assert bad["speedup_best"] is None
    monkeypatch.setattr(prefill_attention, "_kernel", lambda dtype: ("none", lambda *a: None))
    none = bench_one(shape, 64, torch.float32, repeats=1, calls=1)
    assert none["kernel_applies"] is False and none["speedup_median"] is None


def _engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["bench", "engine", *argv])


@pytest.mark.parametrize(("argv", "says"), [
    (("--repeats", "0"), "--repeats must be >= 1"),
    (("--lora-only",), "--lora-only needs --lora"),
    (("--attention-only", "--calibration"), "--attention-only takes neither"),
    (("--attention-only", "--lora", "2"), "--attention-only takes neither"),
    (("--attention-only", "--model", "random:llama3-8b"), "needs a model with weights"),
])
def test_options_that_would_be_ignored_are_refused(argv, says):
    args = _engine_args(*argv)
    with pytest.raises(SystemExit, match=says):
        args.func(args)


def test_attention_only_gives_the_kernel_figure_alone():
    out = bench.run_engine_bench(model="tiny", quick=True, repeats=1, attention_only=True)
    assert "decode_step_ms" not in out and "(family" in out["cpu_model"]
    pa = out["prefill_attention"]
    assert pa["shape"] == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert set(pa["float32"]) == {"512"} and pa["repeats"] == 1
    assert set(out["prefill_attention_speedup"]) == {"512"}      # tiny is float32
