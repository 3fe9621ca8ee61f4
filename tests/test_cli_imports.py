"""The `raypd` command imports only what a command needs: `raypd generate` and `raypd bench
engine` run where ray, fastapi, starlette and uvicorn cannot be imported (the GPU machine has
none of them until the bundle is unpacked), and the SmolLM2 conversion (gguf, transformers'
GgufConfig) is imported only when the model "smollm2" is asked for."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "fastapi", "starlette", "uvicorn", "gguf")
# a meta-path finder that refuses the blocked packages, then the command line itself
RUNNER = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Refuse())
from raypd.cli import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
assert not leaked, leaked
sys.exit(code)
"""


def run_blocked(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAYPD_TEST_THREADS": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_generate_runs_without_ray_or_the_http_stack():
    proc = run_blocked("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "4",
                       "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["token_ids"]) == 4


def test_bench_engine_runs_without_ray_or_the_http_stack():
    """The whole bench runs (RUNNER fails it on any blocked import, even one caught inside,
    and on a blocked module left in sys.modules) and gives every figure it promises, each a
    finite number that could have come out otherwise."""
    proc = run_blocked("bench", "engine", "--model", "tiny", "--quick", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["model"] == "tiny" and out["device"] == "cpu"
    figures = ["decode_ratio_b16", "throughput_ratio_mixed", "prefix_ttft_ratio",
               "step_overhead_ms", "sample_ms_b16", "decode_step_ms", "decode_bound_ms",
               "memory_read_gbps", "memory_read_gbps_mean", "matmul_peak_gflops",
               "python_overhead_ms_b1", "python_overhead_ms_b16", "attn_decode_gbps"]
    for key in figures:
        assert isinstance(out[key], float) and math.isfinite(out[key]), (key, out.get(key))
    for key in ("prefill_tok_s", "hf_prefill_tok_s", "prefill_gflops",
                "prefill_attention_speedup"):
        assert set(out[key]) == {"512"}, key           # --quick: one prefill length
    assert out["mixed_batches"] == [8, 8] and len(out["step_overhead_ms_runs"]) == 1
    # a measured step is never faster than its floor (both ceilings are best samples)
    for b in (1, 16):
        assert out[f"decode_step_ms_b{b}"] >= out[f"decode_roofline_ms_b{b}"] > 0


def test_print_config_runs_without_ray_or_the_http_stack():
    """--print-config resolves the config chain (cluster/config.py) without Ray or torch."""
    for argv in (("generate", "--print-config"), ("bench", "engine", "--print-config")):
        proc = run_blocked(*argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "transport: shm" in proc.stdout and "block_size: 16" in proc.stdout


def test_every_command_is_listed_without_ray():
    proc = run_blocked("--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serve" in proc.stdout and "bench" in proc.stdout


def test_model_loader_imports_the_smollm2_conversion_only_inside_a_function():
    tree = ast.parse((ROOT / "workers" / "model_loader.py").read_text())
    top_level = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom | ast.Import)
                 for alias in node.names} | {node.module for node in tree.body
                                             if isinstance(node, ast.ImportFrom)}
    assert "GgufConfig" not in top_level and "gguf" not in top_level
    assert "workers.smollm2_convert" not in top_level
