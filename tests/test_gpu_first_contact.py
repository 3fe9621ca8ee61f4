"""scripts/gpu-first-contact.sh: without a GPU it answers one no-GPU JSON (exit 2) and runs no
step; its dry run (CPU stand-ins) runs the steps and brings back exactly two files, the JSON
printed last. The dry runs are e2e (the whole suite runs them; --fast does not)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-first-contact.sh"


def run(tmp_path: Path, *args: str, timeout: int, **env: str) -> tuple[int, dict]:
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "RAYPD_GPU_SITE": str(tmp_path / "site"),
                "RAYPD_GPU_GREEDY_MODELS": "tiny", **env}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    report = json.loads(proc.stdout)   # the JSON is all that goes to stdout
    assert sorted(p.name for p in out.iterdir()) == ["first-contact-logs.tar.gz",
                                                     "first-contact.json"]
    assert json.loads((out / "first-contact.json").read_text()) == report
    return proc.returncode, report


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    code, report = run(tmp_path, timeout=60, PATH=f"{fake}:{os.environ['PATH']}",
                       RAYPD_GPU_BUNDLE=str(tmp_path / "none"))
    assert code == 2 and report["ok"] is False and report["error"].startswith("no GPU")
    assert report["steps"] == {}


@pytest.mark.e2e
def test_steps_names_the_only_steps_that_run(tmp_path):
    """`--steps a` (a rerun of what failed) runs the probe alone."""
    code, report = run(tmp_path, "--dry-run", "--steps", "a", timeout=120)
    assert code == 0, json.dumps(report, indent=1)[-4000:]
    assert set(report["steps"]) == {"probe"} and report["steps"]["probe"]["ok"]


@pytest.mark.e2e
@pytest.mark.integration
def test_dry_run_of_every_step_passes_on_tiny(tmp_path):
    """Steps (c) and (e) start a local Ray: the CPU stand-ins of 1P+1D over cuda_ipc (shm)."""
    code, report = run(tmp_path, "--dry-run", timeout=420, RAYPD_GPU_BUDGET_S="400")
    assert code == 0, json.dumps(report, indent=1)[-4000:]
    assert set(report["steps"]) == {"probe", "greedy", "disagg_ipc", "decode_kernel",
                                    "bench_engine_graphs", "bench_engine_eager",
                                    "bench_transfer"}
    assert report["steps"]["greedy"]["result"]["cases"][0]["model"] == "tiny"
    # the TTFT share is named by the prompt length it was measured at (--ttft-prompt-tokens)
    transfer = report["steps"]["bench_transfer"]["result"]
    assert transfer["ttft_prompt_tokens"] == 256
    assert 0 < transfer["transfer_share_of_ttft_256"] < 1 and "ttft_256" in transfer
    assert "transfer_share_of_ttft_2048" not in transfer
