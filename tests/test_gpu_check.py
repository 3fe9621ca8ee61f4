"""scripts/gpu-check.sh on a machine without a GPU answers one clear no-GPU JSON (exit 2) before
installing anything; its one JSON passes only when every check and target passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def test_script_syntax_and_no_gpu_answer(tmp_path):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu-check.sh")]).returncode == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu-check.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["ok"] is False and answer["error"].startswith("no GPU")


def _junit(path: Path, cases: dict[str, str]) -> None:
    body = "".join(f'<testcase name="{n}">' + ("<failure/>" if s == "failed" else "")
                   + "</testcase>" for n, s in cases.items())
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")


def _write_all(d: Path, share: float = 0.02) -> None:
    _junit(d / "pytest.xml", {"test_tiny_greedy_on_cuda_matches_generate_on_cuda[True]": "ok",
                              "test_smollm2_greedy_on_cuda_matches_generate": "ok",
                              "test_cuda_ipc_between_two_actors_sharing_one_gpu": "ok"})
    (d / "chat.json").write_text(json.dumps({"ok": True, "answer": "Paris."}))
    (d / "bench_engine.json").write_text(json.dumps({"decode_vs_bound_b64": 0.6,
                                                     "evidence": "gpu-measured",
                                                     "device_name": "NVIDIA H200"}))
    (d / "bench_transfer.json").write_text(json.dumps({
        "transfer_vs_device_copy": 0.7, "transfer_share_of_ttft_4096": share,
        "evidence": "gpu-measured"}))


def test_report_passes_only_when_every_check_and_target_passes(tmp_path):
    _write_all(tmp_path)
    rep = gpu_check.assemble(tmp_path)
    assert rep["ok"] and rep["evidence"] == "gpu-measured"
    assert all(t["pass"] for t in rep["targets"].values())
    assert len(rep["checks"]["greedy_equality_cuda"]["tests"]) == 2
    json.dumps(rep)

    _write_all(tmp_path, share=0.05)             # transfer over 3% of TTFT
    rep = gpu_check.assemble(tmp_path)
    assert not rep["ok"] and not rep["targets"]["transfer_share_of_ttft_4096"]["pass"]

    _write_all(tmp_path)
    (tmp_path / "bench_engine.json").unlink()    # a step that crashed: its log comes along
    (tmp_path / "bench_engine.log").write_text("Traceback ...\nCUDA out of memory\n")
    rep = gpu_check.assemble(tmp_path)
    assert not rep["ok"] and rep["targets"]["decode_vs_bound_b64"]["why"] == "not measured"
    assert rep["failed_logs"]["bench_engine"][-1] == "CUDA out of memory"

    _write_all(tmp_path)
    _junit(tmp_path / "pytest.xml", {"test_tiny_greedy_on_cuda_matches_generate[False]":
                                     "failed"})
    rep = gpu_check.assemble(tmp_path)
    assert not rep["ok"] and not rep["checks"]["greedy_equality_cuda"]["pass"]
