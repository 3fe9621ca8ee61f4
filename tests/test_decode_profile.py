"""scripts/gpu/decode_profile.py (where a decode step's time goes, for the GPU machine) runs here
on the CPU: every (graphs, batch) it was asked for, with the step's host share and its kernel
time in groups, labelled cpu-measured; CUDA graphs without a GPU are refused."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "decode_profile", ROOT / "scripts" / "gpu" / "decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (a GPU takes graphs on)")
def test_a_cpu_run_reports_each_batch_with_its_host_share_and_kernel_groups(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert _script().main(["--model", "tiny", "--batches", "1,3", "--prompt", "40",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["evidence"] == "cpu-measured" and report["device"] == "cpu"
    for b in (1, 3):
        row = report[f"graphs=off batch={b}"]
        assert row["replay_ms"] is None and row["step_ms"] > 0
        assert row["host_ms"] == pytest.approx(row["step_ms"] - row["execute_ms"])
        assert row["kernel_ms"]["gemm"] > 0
    assert "cProfile" not in capsys.readouterr().out   # the host profile is the graphed step's


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without a GPU")
@pytest.mark.parametrize("argv", [["--graphs", "on"], ["--graphs", "both"],
                                  ["--batches", "0"], ["--batches", "a,b"]])
def test_what_it_cannot_do_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--model", "tiny", *argv])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_kernel_names_fall_into_their_groups():
    group = _script().group_of
    assert group("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "gemm"
    assert group("void cublasLt::splitKreduce_kernel<32, 16>") == "gemm"
    assert group("paged_decode_reduce") == "attention"
    assert group("void at::native::vectorized_layer_norm_kernel") == "norm"
    assert group("void at::native::index_elementwise_kernel") == "elementwise"
    assert group("mkldnn::_linear_pointwise") == "gemm"
