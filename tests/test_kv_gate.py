"""The kv-quality gate: the bench measures and records it; `raypd serve` refuses a quantized KV
dtype whose recorded gate fails the configured thresholds, and serves one that passes."""

from __future__ import annotations

import pytest

import raypd.bench.kv_quality as bench
import workers.kv_gate as kvq
from cluster.config import load_config
from cluster.serve import check_kv_quality_gate
from raypd.cli import main


@pytest.fixture
def gates_file(tmp_path, monkeypatch):
    path = tmp_path / "kv_gates.json"
    monkeypatch.setattr(kvq, "_gates_path", lambda: path)
    return path


def _record(model: str, kv_dtype: str, ppl_delta_pct: float, agreement: float) -> None:
    kvq.record_gate({"model": model, "revision": kvq._revision(model), "kv_dtype": kv_dtype,
                     "dtype": "float32",
                     "ppl_ref": 10.0, "ppl_quant": 10.0 * (1 + ppl_delta_pct / 100),
                     "ppl_delta_pct": ppl_delta_pct, "greedy_agreement": agreement,
                     "mean_kl": 0.01, "capacity_ratio": 1.9, "decode_tok_s_ratio": 0.8,
                     "evidence": "cpu-measured", "text": "t", "text_tokens": 1})


def test_the_bench_reports_the_issue_keys_and_records_its_gate(gates_file):
    r = bench.run_kv_quality("tiny", "int8", text_tokens=128, chunk=48, prompts=3,
                           prompt_tokens=16, max_tokens=4)
    for key in ("ppl_ref", "ppl_quant", "ppl_delta_pct", "greedy_agreement", "mean_kl",
                "bytes_per_token_ref", "bytes_per_token_quant", "capacity_ratio",
                "decode_tok_s_ratio"):
        assert key in r
    assert r["text"].startswith("/usr/share/") and r["evidence"] == "cpu-measured"
    assert r["bytes_per_token_ref"] == 4 * r["bytes_per_token_quant"] - 8   # + scales
    assert r["mean_kl"] >= 0 and 0 <= r["greedy_agreement"] <= 1
    gate = kvq.recorded_gate("tiny", r["revision"], "int8")
    assert gate["ppl_delta_pct"] == r["ppl_delta_pct"]


def test_serve_refuses_a_kv_dtype_whose_gate_failed(gates_file):
    _record("tiny", "fp8", ppl_delta_pct=4.0, agreement=0.99)
    cfg = load_config(None, {"model.name": "tiny", "model.kv_dtype": "fp8"})
    with pytest.raises(ValueError, match="failed its quality gate"):
        check_kv_quality_gate(cfg)
    assert main(["serve", "--model", "tiny", "--kv-dtype", "fp8", "--port", "0"]) == 2


def test_thresholds_are_configurable(gates_file):
    _record("tiny", "int8", ppl_delta_pct=0.5, agreement=0.9)
    strict = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    with pytest.raises(ValueError, match="greedy_agreement 0.900"):
        check_kv_quality_gate(strict)
    loose = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8",
                               "model.kv_gate_min_greedy_agreement": 0.85})
    assert check_kv_quality_gate(loose)["greedy_agreement"] == 0.9


def test_float_pools_and_unmeasured_dtypes_are_not_gated(gates_file):
    assert check_kv_quality_gate(load_config(None, {"model.name": "tiny"})) is None
    unmeasured = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    assert check_kv_quality_gate(unmeasured) is None
