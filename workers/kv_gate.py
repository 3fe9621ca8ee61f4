"""The KV quality gate: what `raypd bench kv-quality` measured for a quantized KV dtype, recorded
per model revision in raypd's cache (kv_gates.json), and the check `raypd serve` runs before it
serves that dtype. Measuring is the benchmark's (raypd/bench/kv_quality.py); keeping and
enforcing the record is the serving side's, here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GATES_FILE = "kv_gates.json"


@dataclass(frozen=True)
class GateThresholds:
    max_ppl_delta_pct: float = 1.0
    min_greedy_agreement: float = 0.95

    def passes(self, ppl_delta_pct: float, greedy_agreement: float) -> bool:
        return ppl_delta_pct <= self.max_ppl_delta_pct and \
            greedy_agreement >= self.min_greedy_agreement


def _gates_path() -> Path:
    from workers.model_loader import cache_dir
    return cache_dir() / GATES_FILE


def _gate_key(model: str, revision: str, kv_dtype: str) -> str:
    return f"{model}@{revision}:{kv_dtype}"


def _revision(model: str) -> str:
    """The model's content revision, as load_model reports it (without loading weights, except
    for the in-memory tiny model)."""
    from workers.model_loader import _checkpoint_revision, load_model, resolve_model_dir
    if model == "tiny":
        return load_model("tiny")[2].revision
    return _checkpoint_revision(resolve_model_dir(model))


def record_gate(result: dict) -> None:
    path = _gates_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    gates = json.loads(path.read_text()) if path.is_file() else {}
    gates[_gate_key(result["model"], result["revision"], result["kv_dtype"])] = {
        k: result[k] for k in ("dtype", "ppl_ref", "ppl_quant", "ppl_delta_pct", "greedy_agreement",
                               "mean_kl", "capacity_ratio", "decode_tok_s_ratio", "evidence",
                               "text", "text_tokens")}
    path.write_text(json.dumps(gates, indent=2) + "\n")


def recorded_gate(model: str, revision: str, kv_dtype: str) -> dict | None:
    path = _gates_path()
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(_gate_key(model, revision, kv_dtype))


def recorded_gates(model: str, thresholds: GateThresholds | None = None) -> dict[str, dict]:
    """{kv_dtype: recorded gate + `passed`} of every quantized dtype measured for `model` at its
    current revision (what the report's capacity action weighs for compress); {} if none, or
    when the model's revision cannot be read."""
    from workers.kv_quant import QUANT_FORMATS
    thresholds = thresholds or GateThresholds()
    try:
        revision = _revision(model)
    except (OSError, ValueError):
        return {}
    out = {}
    for fmt in QUANT_FORMATS:
        gate = recorded_gate(model, revision, fmt)
        if gate is not None:
            out[fmt] = dict(gate, passed=thresholds.passes(gate["ppl_delta_pct"],
                                                           gate["greedy_agreement"]))
    return out


def check_kv_gate(model: str, kv_dtype: str, thresholds: GateThresholds) -> dict | None:
    """The recorded gate figures of a quantized `kv_dtype` for `model` (None: not measured, or
    not quantized); raises ValueError when they fail `thresholds`."""
    from workers.kv_quant import is_quantized
    if not is_quantized(kv_dtype):
        return None
    gate = recorded_gate(model, _revision(model), kv_dtype)
    if gate is not None and not thresholds.passes(gate["ppl_delta_pct"],
                                                  gate["greedy_agreement"]):
        raise ValueError(
            f"kv_dtype {kv_dtype} failed its quality gate for model {model}: ppl_delta_pct "
            f"{gate['ppl_delta_pct']:.3f} (max {thresholds.max_ppl_delta_pct}), greedy_agreement "
            f"{gate['greedy_agreement']:.3f} (min {thresholds.min_greedy_agreement}); "
            f"see `raypd bench kv-quality`, or loosen model.kv_gate_* in the config")
    return gate

