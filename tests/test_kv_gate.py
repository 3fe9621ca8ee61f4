"""The kv-quality gate: the bench measures a KV dtype teacher-forced against the noise floor of a
bf16 pool, and records it per model revision, weights dtype and KV dtype; the gate passes bf16
itself and fails a format that injects large noise; `raypd serve` refuses a quantized KV dtype
that was never measured (naming the command that measures it) or whose gate failed."""

from __future__ import annotations

import json

import pytest
import torch

import raypd.bench.kv_quality as bench
import workers.kv_gate as kvq
import workers.kv_quant as kv_quant
from cluster.config import load_config
from cluster.serve import check_kv_quality_gate
from raypd.cli import main
from workers.kv_gate import Deviation, GateThresholds

FOUR = ("teacher_forced_agreement", "mean_kl", "p99_kl", "ppl_delta_pct")
SMALL = dict(text_tokens=256, chunk=48, prompts=3, prompt_tokens=16, max_tokens=4)


@pytest.fixture
def gates_file(tmp_path, monkeypatch):
    path = tmp_path / "kv_gates.json"
    monkeypatch.setattr(kvq, "_gates_path", lambda: path)
    return path


FLOOR = Deviation(teacher_forced_agreement=0.99, mean_kl=1e-5, p99_kl=1e-4,
                  ppl_delta_pct=0.01, positions=1000)


def _record(model: str, kv_dtype: str, dev: Deviation, weights: str = "float32") -> None:
    kvq.record_gate({"model": model, "revision": kvq._revision(model), "kv_dtype": kv_dtype,
                     "dtype": weights, **dev.to_dict(), "noise_floor": FLOOR.to_dict(),
                     "noise_floor_multiple": 8.0, "ppl_ref": 10.0,
                     "ppl_quant": 10.0 * (1 + dev.ppl_delta_pct / 100),
                     "greedy_agreement": 0.5, "capacity_ratio": 1.9, "decode_tok_s_ratio": 0.8,
                     "evidence": "cpu-measured", "text": "t", "text_tokens": 1001})


def _dev(**changes) -> Deviation:
    return Deviation(**{**FLOOR.to_dict(), **changes})


def test_the_bench_reports_the_issue_keys_and_records_its_gate_per_weights_dtype(gates_file):
    r = bench.run_kv_quality("tiny", "int8", **SMALL)
    for key in (*FOUR, "noise_floor", "gate_passed", "noise_floor_multiple", "greedy_agreement"):
        assert key in r
    assert set(FOUR) <= set(r["noise_floor"])
    assert r["noise_floor"]["kv_dtype"] == "bfloat16" and r["noise_floor"]["dtype"] == "float32"
    assert r["noise_floor_multiple"] == kvq.NOISE_FLOOR_MULTIPLE
    assert 0 < r["noise_floor"]["mean_kl"] <= r["noise_floor"]["p99_kl"]
    assert r["text"].startswith("/usr/share/") and r["evidence"] == "cpu-measured"
    assert r["positions"] == r["text_tokens"] - 1 == 255
    assert r["bytes_per_token_ref"] == 4 * r["bytes_per_token_quant"] - 8   # + scales
    gate = kvq.recorded_gate("tiny", r["revision"], "float32", "int8")
    assert gate["mean_kl"] == r["mean_kl"] and gate["noise_floor"]["mean_kl"] > 0
    assert kvq.recorded_gate("tiny", r["revision"], "bfloat16", "int8") is None


def test_the_gate_passes_bf16_itself(gates_file):
    r = bench.run_kv_quality("tiny", "bfloat16", record=False, **SMALL)
    assert {k: r[k] for k in FOUR} == {k: r["noise_floor"][k] for k in FOUR}
    assert r["gate_passed"] and r["gate_failures"] == []


def test_the_gate_fails_a_format_that_injects_large_noise(gates_file, monkeypatch):
    honest = kv_quant.quantize
    g = torch.Generator().manual_seed(0)

    def noisy(x, scale, fmt):      # int8 that adds ~20 steps of noise to every element
        return honest(x + 20 * scale * torch.randn(x.shape, generator=g), scale, fmt)

    clean = bench.run_kv_quality("tiny", "int8", record=False, **SMALL)
    monkeypatch.setattr(kv_quant, "quantize", noisy)
    broken = bench.run_kv_quality("tiny", "int8", record=False, **SMALL)
    assert not broken["gate_passed"]
    assert any(f.startswith("mean_kl") for f in broken["gate_failures"])
    assert broken["mean_kl"] > 10 * clean["mean_kl"]
    assert broken["noise_floor"] == clean["noise_floor"]     # the floor is not the format's


def test_limits_scale_the_floor_by_the_multiple_for_disagreement_and_its_square_for_kl():
    t = GateThresholds(noise_floor_multiple=4.0)
    lim = t.limits(FLOOR)
    assert lim["disagreement"] == pytest.approx(4 * 0.01)
    assert lim["mean_kl"] == pytest.approx(16e-5) and lim["p99_kl"] == pytest.approx(16e-4)
    assert t.passes(_dev(mean_kl=15e-5, teacher_forced_agreement=0.965), FLOOR)
    assert t.failures(_dev(mean_kl=17e-5), FLOOR) == ["mean_kl 0.00017 > 0.00016"]
    assert t.failures(_dev(teacher_forced_agreement=0.95), FLOOR)[0].startswith("disagreement")
    assert t.failures(_dev(ppl_delta_pct=1.5), FLOOR) == ["ppl_delta_pct 1.5 > 1"]
    assert not t.passes(_dev(mean_kl=float("nan")), FLOOR)
    # a floor that never disagreed is read at its resolution, one position in `positions`
    perfect = _dev(teacher_forced_agreement=1.0)
    assert t.limits(perfect)["disagreement"] == pytest.approx(4 / 1000)


def test_serve_refuses_an_unmeasured_quantized_kv_dtype_naming_the_command(gates_file, capsys):
    cfg = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    command = "raypd bench kv-quality --model tiny --kv-dtype int8 --dtype float32"
    with pytest.raises(ValueError, match="no recorded quality gate") as e:
        check_kv_quality_gate(cfg)
    assert command in str(e.value)
    assert main(["serve", "--model", "tiny", "--kv-dtype", "int8", "--port", "0"]) == 2
    assert command in capsys.readouterr().err


def test_a_gate_vouches_only_for_the_weights_dtype_it_measured(gates_file):
    _record("tiny", "int8", _dev(mean_kl=2e-5), weights="float32")
    f32 = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    assert check_kv_quality_gate(f32)["mean_kl"] == 2e-5
    bf16 = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8",
                              "model.dtype": "bfloat16"})
    with pytest.raises(ValueError, match="--kv-dtype int8 --dtype bfloat16"):
        check_kv_quality_gate(bf16)


def test_serve_refuses_a_kv_dtype_whose_gate_failed(gates_file):
    _record("tiny", "fp8", _dev(mean_kl=1e-2))          # 1000x the floor's KL
    cfg = load_config(None, {"model.name": "tiny", "model.kv_dtype": "fp8"})
    with pytest.raises(ValueError, match="failed its quality gate.*mean_kl 0.01 > 0.00064"):
        check_kv_quality_gate(cfg)
    assert main(["serve", "--model", "tiny", "--kv-dtype", "fp8", "--port", "0"]) == 2


def test_the_noise_floor_multiple_is_configurable(gates_file):
    _record("tiny", "int8", _dev(mean_kl=1e-3))          # 100x the floor's KL: 10x its error
    strict = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    with pytest.raises(ValueError, match="mean_kl"):
        check_kv_quality_gate(strict)
    loose = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8",
                               "model.kv_gate_noise_floor_multiple": 11})
    assert check_kv_quality_gate(loose)["mean_kl"] == 1e-3
    assert kvq.recorded_gates("tiny")["int8"]["passed"] is False


def test_float_pools_are_not_gated(gates_file):
    assert check_kv_quality_gate(load_config(None, {"model.name": "tiny"})) is None
    assert check_kv_quality_gate(load_config(None, {"model.name": "tiny",
                                                    "model.kv_dtype": "bfloat16"})) is None


def test_the_cli_writes_the_issue_keys_and_refuses_a_multiple_below_one(gates_file, tmp_path):
    out = tmp_path / "q.json"
    rc = main(["bench", "kv-quality", "--model", "tiny", "--quick", "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == (0 if r["gate_passed"] else 1)
    assert {*FOUR, "noise_floor", "gate_passed", "noise_floor_multiple"} <= set(r)
    assert not gates_file.exists()                       # --quick is not recorded
    assert main(["bench", "kv-quality", "--model", "tiny", "--quick",
                 "--noise-floor-multiple", "0.5"]) == 2
