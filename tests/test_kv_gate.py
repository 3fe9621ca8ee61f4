"""The kv-quality gate: the bench measures a KV dtype teacher-forced against the noise floor of a
bf16 pool over at least four texts, and records it per model revision, weights dtype and KV
dtype with the engine's numerics version; the gate reads the floor at its upper confidence bound,
passes bf16 itself and fails a format that injects large noise, and reports the verdicts at 6x,
8x and 10x beside its policy; `raypd serve` refuses a quantized KV dtype that was never measured
(naming the command that measures it), whose gate failed, or whose gate was measured under other
kernels (asking for a re-run)."""

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
from workers.kv_gate import Deviation, GateThresholds, NoiseFloor, student_t_quantile

FOUR = ("teacher_forced_agreement", "mean_kl", "p99_kl", "ppl_delta_pct")
SMALL = dict(text_tokens=256, chunk=48, prompts=3, prompt_tokens=16, max_tokens=4)


@pytest.fixture
def gates_file(tmp_path, monkeypatch):
    path = tmp_path / "kv_gates.json"
    monkeypatch.setattr(kvq, "_gates_path", lambda: path)
    return path


ONE = Deviation(teacher_forced_agreement=0.99, mean_kl=1e-5, p99_kl=1e-4,
                ppl_delta_pct=0.01, positions=250)
FLOOR = NoiseFloor((ONE,) * 4)          # no spread: its upper bound is its mean


def _record(model: str, kv_dtype: str, dev: Deviation, weights: str = "float32") -> None:
    kvq.record_gate({"model": model, "revision": kvq._revision(model), "kv_dtype": kv_dtype,
                     "dtype": weights, **dev.to_dict(), "noise_floor": FLOOR.to_dict(),
                     "numerics_version": kvq.numerics_version(), "cpu_model": "c",
                     "noise_floor_multiple": 8.0, "ppl_ref": 10.0,
                     "ppl_quant": 10.0 * (1 + dev.ppl_delta_pct / 100),
                     "greedy_agreement": 0.5, "capacity_ratio": 1.9, "decode_tok_s_ratio": 0.8,
                     "evidence": "cpu-measured", "texts": [], "text_tokens": 251})


def _dev(**changes) -> Deviation:
    return Deviation(**{**ONE.to_dict(), "positions": 1000, **changes})


def test_the_bench_reports_the_issue_keys_and_records_its_gate_per_weights_dtype(gates_file):
    r = bench.run_kv_quality("tiny", "int8", **SMALL)
    for key in (*FOUR, "noise_floor", "gate_passed", "noise_floor_multiple", "greedy_agreement"):
        assert key in r
    assert set(FOUR) <= set(r["noise_floor"])
    assert r["noise_floor"]["kv_dtype"] == "bfloat16" and r["noise_floor"]["dtype"] == "float32"
    assert r["noise_floor_multiple"] == kvq.NOISE_FLOOR_MULTIPLE
    assert 0 < r["noise_floor"]["mean_kl"] <= r["noise_floor"]["p99_kl"]
    assert all(t["text"].startswith("/usr/share/") for t in r["texts"])
    assert r["evidence"] == "cpu-measured"
    assert r["positions"] == 4 * (r["text_tokens"] - 1) == 4 * 255
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
    lim = t.limits(FLOOR)           # FLOOR has no spread: its upper bound is its mean
    assert lim["disagreement"] == pytest.approx(4 * 0.01)
    assert lim["mean_kl"] == pytest.approx(16e-5) and lim["p99_kl"] == pytest.approx(16e-4)
    assert t.passes(_dev(mean_kl=15e-5, teacher_forced_agreement=0.965), FLOOR)
    assert t.failures(_dev(mean_kl=17e-5), FLOOR) == ["mean_kl 0.00017 > 0.00016"]
    assert t.failures(_dev(teacher_forced_agreement=0.95), FLOOR)[0].startswith("disagreement")
    assert t.failures(_dev(ppl_delta_pct=1.5), FLOOR) == ["ppl_delta_pct 1.5 > 1"]
    assert not t.passes(_dev(mean_kl=float("nan")), FLOOR)
    # a floor that never disagreed is read at its resolution, one position in `positions`
    perfect = NoiseFloor((_dev(teacher_forced_agreement=1.0, positions=250),) * 4)
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


def test_the_cli_writes_the_issue_keys_prints_the_policy_table_and_refuses_a_multiple_below_one(
        gates_file, tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = main(["bench", "kv-quality", "--model", "tiny", "--quick", "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == (0 if r["gate_passed"] else 1)
    table = capsys.readouterr().err
    for label, v in r["policy_table"].items():
        verdict = "PASS" if v["passed"] else "FAIL"
        assert any(ln.split()[:2] == [label, verdict] for ln in table.splitlines())
    assert list(r["policy_table"]) == ["6x", "8x", "10x"]
    assert [ln.split()[0] for ln in table.splitlines() if "<- chosen policy" in ln] == ["8x"]
    assert len(r["noise_floor"]["texts"]) == 4 and "upper bound" in table
    assert {*FOUR, "noise_floor", "gate_passed", "noise_floor_multiple"} <= set(r)
    assert not gates_file.exists()                       # --quick is not recorded
    assert main(["bench", "kv-quality", "--model", "tiny", "--quick",
                 "--noise-floor-multiple", "0.5"]) == 2


def test_the_noise_floor_is_measured_over_at_least_four_texts(gates_file, capsys):
    r = bench.run_kv_quality("tiny", "int8", record=False, **SMALL)
    floor = r["noise_floor"]
    windows = [(t["text"], t["start"]) for t in floor["texts"]]
    assert len(windows) >= 4 and len(set(windows)) == len(windows)
    assert len({path for path, _ in windows}) == len(windows)      # four texts, not one
    assert windows == [(t["text"], t["start"]) for t in r["texts"]]  # the format's, the same
    for name in ("mean_kl", "p99_kl", "teacher_forced_agreement"):
        per_text = [t[name] for t in floor["texts"]]
        assert floor[name] == pytest.approx(sum(per_text) / len(per_text))
    kl = [t["mean_kl"] for t in floor["texts"]]
    assert floor["spread"]["mean_kl"]["sd"] == pytest.approx(torch.tensor(kl).std().item())
    assert floor["spread"]["mean_kl"]["sd"] > 0                      # the texts differ
    assert floor["upper_bound"]["mean_kl"] > floor["mean_kl"]
    with pytest.raises(ValueError, match="at least 4 texts"):
        bench.run_kv_quality("tiny", "int8", record=False, **dict(SMALL, texts=3))
    assert main(["bench", "kv-quality", "--model", "tiny", "--quick", "--texts", "3"]) == 2


def test_the_gate_reads_the_floor_at_its_upper_confidence_bound(gates_file):
    # one-sided 95% quantiles of Student's t, from a printed table
    for df, t in ((1, 6.314), (3, 2.353), (4, 2.132), (9, 1.833), (30, 1.697)):
        assert student_t_quantile(0.95, df) == pytest.approx(t, abs=1e-3)
    texts = [_dev(mean_kl=k * 1e-5, teacher_forced_agreement=1 - a, positions=250)
             for k, a in ((1, 0.002), (2, 0.004), (3, 0.006), (4, 0.008))]
    floor = NoiseFloor(tuple(texts))
    sd = (sum((k - 2.5) ** 2 for k in (1, 2, 3, 4)) / 3) ** 0.5         # 1.291
    ub_kl = 2.5e-5 + 2.353 * sd * 1e-5 / 2
    ub_dis = 0.005 + 2.353 * sd * 0.002 / 2
    assert floor.upper_bound()["mean_kl"] == pytest.approx(ub_kl, rel=1e-3)
    assert floor.upper_bound()["disagreement"] == pytest.approx(ub_dis, rel=1e-3)
    t = GateThresholds(noise_floor_multiple=8.0)
    assert t.limits(floor)["mean_kl"] == pytest.approx(64 * ub_kl, rel=1e-3)
    assert t.limits(floor)["disagreement"] == pytest.approx(8 * ub_dis, rel=1e-3)
    # above 64x the floor's mean, below 64x its upper bound: passes
    assert t.passes(_dev(mean_kl=64 * 3.5e-5, teacher_forced_agreement=1 - 8 * 0.0065), floor)
    assert t.failures(_dev(mean_kl=64 * 4.1e-5), floor)[0].startswith("mean_kl")
    # the recorded gate is judged on the bound recomputed from its recorded texts
    kvq.record_gate({"model": "tiny", "revision": kvq._revision("tiny"), "kv_dtype": "int8",
                     "dtype": "float32", **_dev(mean_kl=64 * 3.5e-5).to_dict(),
                     "noise_floor": floor.to_dict(), "noise_floor_multiple": 8.0,
                     "numerics_version": kvq.numerics_version(), "cpu_model": "c",
                     "ppl_ref": 10.0, "ppl_quant": 10.0, "greedy_agreement": 0.5,
                     "capacity_ratio": 1.9, "decode_tok_s_ratio": 0.8, "evidence": "cpu-measured",
                     "texts": [], "text_tokens": 251})
    cfg = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    assert check_kv_quality_gate(cfg)["mean_kl"] == 64 * 3.5e-5


def test_the_verdicts_at_6x_8x_and_10x_stand_beside_the_chosen_policy():
    between = _dev(teacher_forced_agreement=1 - 7 * 0.01)      # 7x the floor's disagreement
    table = GateThresholds().policy_table(between, FLOOR)
    assert {k: (v["passed"], v["chosen"]) for k, v in table.items()} == {
        "6x": (False, False), "8x": (True, True), "10x": (True, False)}
    assert table["6x"]["failures"][0].startswith("disagreement 0.07 > 0.06")
    own = GateThresholds(noise_floor_multiple=7.5).policy_table(between, FLOOR)
    assert list(own) == ["6x", "7.5x", "8x", "10x"] and own["7.5x"] == {
        "multiple": 7.5, "chosen": True, "passed": True, "failures": []}


def test_a_gate_measured_under_other_kernels_asks_for_a_rerun(gates_file, monkeypatch, tmp_path):
    import workers.kernels.build as build
    _record("tiny", "int8", _dev(mean_kl=2e-5))
    cfg = load_config(None, {"model.name": "tiny", "model.kv_dtype": "int8"})
    assert check_kv_quality_gate(cfg)["mean_kl"] == 2e-5
    # the numerics version is the kernel sources' hash: a changed source changes it
    sources, copies = build.SOURCES, []
    for src in build.SOURCES:
        copies.append(tmp_path / src.name)
        copies[-1].write_bytes(src.read_bytes())
    monkeypatch.setattr(build, "SOURCES", tuple(copies))
    recorded = json.loads(gates_file.read_text())
    assert [g["numerics_version"] for g in recorded.values()] == [kvq.numerics_version()]
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    command = "raypd bench kv-quality --model tiny --kv-dtype int8 --dtype float32"
    with pytest.raises(ValueError, match="must be measured again.*numerics version") as e:
        check_kv_quality_gate(cfg)
    assert command in str(e.value)
    assert kvq.recorded_gates("tiny")["int8"]["passed"] is False
    assert kvq.recorded_gates("tiny")["int8"]["failures"][0].startswith("re-run needed")
    # a gate recorded before the version was kept asks for a re-run too
    monkeypatch.setattr(build, "SOURCES", sources)
    gates = json.loads(gates_file.read_text())
    for g in gates.values():
        g.pop("numerics_version")
    gates_file.write_text(json.dumps(gates))
    with pytest.raises(ValueError, match="none recorded"):
        check_kv_quality_gate(cfg)
