"""The KV quality gate: a quantized KV dtype is served only when `raypd bench kv-quality` measured
it, for this model revision and weights dtype, within a stated multiple of the noise floor (how far
a bf16 KV pool, an accepted change, moves the model from a float32 one) and with perplexity up by
less than MAX_PPL_DELTA_PCT. Measuring is the benchmark's (raypd/bench/kv_quality.py); the
figures' type, the verdict, the record (raypd's cache, kv_gates.json) and the check `raypd serve`
runs are the serving side's, here.

Invariants: a gate is keyed by (model, revision, weights dtype, KV dtype), so a measurement on
float32 weights never vouches for bfloat16 ones; the verdict is recomputed from the recorded
figures under the caller's thresholds (never stored as a bare boolean); a quantized KV dtype
without a record is refused, naming the command that measures it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GATES_FILE = "kv_gates.json"

MAX_PPL_DELTA_PCT = 1.0
"""The perplexity of the text may rise by less than 1% (the issue's bound: a change a reader
would not notice in any quality benchmark, and one a format with deviations near the floor stays
far below)."""

NOISE_FLOOR_MULTIPLE = 8.0
"""How many times the noise floor's logit error a format may add: 8x, i.e. up to 3 bits less
precise than bf16. Why 3 bits: the floor is an accepted change (storing KV in bf16, 8 significant
bits, instead of float32), and float16 (11 significant bits) and bf16 are both accepted KV dtypes,
3 bits apart; a format may sit that far below bf16, and no further, to stay within the spread of
formats already accepted. The deviation figures scale differently with the logit error e:
argmax disagreements (positions whose top-two margin is under e) grow as e, KL grows as e^2 (for
small perturbations KL ~ var(e) / 2). So the limits are 8x the floor's disagreement rate and
64x (KL_MULTIPLE) its mean and p99 KL."""

KL_MULTIPLE = NOISE_FLOOR_MULTIPLE ** 2


@dataclass(frozen=True)
class Deviation:
    """How far a KV pool moves the model from a reference pool (same weights), teacher-forced on
    one text: at every position both see the same reference prefix, so errors never compound.

    teacher_forced_agreement  fraction of positions whose argmax next token is the reference's
    mean_kl / p99_kl          KL(reference || pool) of the next-token distributions, over positions
    ppl_delta_pct             100 * (ppl_pool - ppl_ref) / ppl_ref on the text
    positions                 how many positions were scored (the text's tokens minus one)
    """

    teacher_forced_agreement: float
    mean_kl: float
    p99_kl: float
    ppl_delta_pct: float
    positions: int

    @property
    def disagreement(self) -> float:
        return 1.0 - self.teacher_forced_agreement

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Deviation:
        return cls(**{k: d[k] for k in ("teacher_forced_agreement", "mean_kl", "p99_kl",
                                         "ppl_delta_pct", "positions")})


@dataclass(frozen=True, kw_only=True)
class GateThresholds:
    """The gate's bounds: perplexity change, and the multiple of the noise floor's logit error
    (see NOISE_FLOOR_MULTIPLE for what the default means and why)."""

    max_ppl_delta_pct: float = MAX_PPL_DELTA_PCT
    noise_floor_multiple: float = NOISE_FLOOR_MULTIPLE

    def limits(self, floor: Deviation) -> dict[str, float]:
        """The largest figure each criterion allows against `floor`. A floor that disagreed
        nowhere is read at its resolution (one position of `positions`): zero observed is not
        zero noise."""
        m = self.noise_floor_multiple
        return {"disagreement": m * max(floor.disagreement, 1.0 / floor.positions),
                "mean_kl": m * m * floor.mean_kl, "p99_kl": m * m * floor.p99_kl,
                "ppl_delta_pct": self.max_ppl_delta_pct}

    def failures(self, dev: Deviation, floor: Deviation) -> list[str]:
        """Each criterion `dev` misses, with its figure and limit; [] when the format passes."""
        lim = self.limits(floor)
        got = {"disagreement": dev.disagreement, "mean_kl": dev.mean_kl, "p99_kl": dev.p99_kl,
               "ppl_delta_pct": dev.ppl_delta_pct}
        out = []
        for name, value in got.items():
            if not value <= lim[name]:      # NaN fails
                out.append(f"{name} {value:.3g} > {lim[name]:.3g}")
        return out

    def passes(self, dev: Deviation, floor: Deviation) -> bool:
        return not self.failures(dev, floor)


def gate_thresholds(model_section) -> GateThresholds:
    """The thresholds of a config's `model` section (model.kv_gate_*)."""
    return GateThresholds(max_ppl_delta_pct=model_section.kv_gate_max_ppl_delta_pct,
                          noise_floor_multiple=model_section.kv_gate_noise_floor_multiple)


def _gates_path() -> Path:
    from workers.model_loader import cache_dir
    return cache_dir() / GATES_FILE


def _gate_key(model: str, revision: str, weights_dtype: str, kv_dtype: str) -> str:
    return f"{model}@{revision}:{weights_dtype}:{kv_dtype}"


def _revision(model: str) -> str:
    """The model's content revision, as load_model reports it (without loading weights, except
    for the in-memory tiny model)."""
    from workers.model_loader import _checkpoint_revision, load_model, resolve_model_dir
    if model == "tiny":
        return load_model("tiny")[2].revision
    return _checkpoint_revision(resolve_model_dir(model))


def resolve_weights_dtype(model: str, dtype: str, device: torch.device) -> str:
    """The weights' dtype a worker on `device` loads for `dtype` ("auto" resolved as the loader
    does: the GPU decides on cuda; on a CPU the checkpoint's dtype and the CPU's bf16 support;
    tiny stays float32), without loading weights."""
    import torch

    from workers.device import auto_dtype, load_dtype
    from workers.model_loader import base_config
    resolved = load_dtype(dtype, model, device)
    if resolved != "auto":
        return resolved
    if model == "tiny":
        return "float32"
    saved = base_config(model).dtype
    saved = str(saved).removeprefix("torch.") if saved is not None else "float32"
    return auto_dtype(saved, torch.device("cpu"))


def measure_command(model: str, kv_dtype: str, weights_dtype: str) -> str:
    """The command that measures and records the gate of (model, weights dtype, kv dtype)."""
    return f"raypd bench kv-quality --model {model} --kv-dtype {kv_dtype} --dtype {weights_dtype}"


RECORDED_KEYS = ("teacher_forced_agreement", "mean_kl", "p99_kl", "ppl_delta_pct", "positions",
                 "noise_floor", "noise_floor_multiple", "dtype", "ppl_ref", "ppl_quant",
                 "greedy_agreement", "capacity_ratio", "decode_tok_s_ratio", "evidence", "text",
                 "text_tokens")


def record_gate(result: dict) -> None:
    """Keep a bench result's figures under (model, revision, weights dtype, KV dtype); the
    latest measurement of a key replaces the earlier one."""
    path = _gates_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    gates = json.loads(path.read_text()) if path.is_file() else {}
    key = _gate_key(result["model"], result["revision"], result["dtype"], result["kv_dtype"])
    gates[key] = {k: result[k] for k in RECORDED_KEYS}
    path.write_text(json.dumps(gates, indent=2) + "\n")


def recorded_gate(model: str, revision: str, weights_dtype: str, kv_dtype: str) -> dict | None:
    path = _gates_path()
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(_gate_key(model, revision, weights_dtype, kv_dtype))


def gate_failures(gate: dict, thresholds: GateThresholds) -> list[str]:
    """What a recorded gate misses under `thresholds` ([]: it passes)."""
    return thresholds.failures(Deviation.from_dict(gate), Deviation.from_dict(gate["noise_floor"]))


def recorded_gates(model: str, thresholds: GateThresholds | None = None,
                   dtype: str = "auto") -> dict[str, dict]:
    """{kv_dtype: recorded gate + `passed` + `failures`} of every quantized dtype measured for
    `model` at its current revision and the weights dtype `dtype` resolves to on this host
    (what the report's capacity action weighs for compress); {} if none, or when the model's
    revision cannot be read."""
    import torch

    from workers.kv_quant import QUANT_FORMATS
    thresholds = thresholds or GateThresholds()
    try:
        revision = _revision(model)
        weights = resolve_weights_dtype(model, dtype, torch.device("cpu"))
    except (OSError, ValueError):
        return {}
    out = {}
    for fmt in QUANT_FORMATS:
        gate = recorded_gate(model, revision, weights, fmt)
        if gate is not None:
            failures = gate_failures(gate, thresholds)
            out[fmt] = dict(gate, passed=not failures, failures=failures)
    return out


def check_kv_gate(model: str, kv_dtype: str, weights_dtype: str,
                  thresholds: GateThresholds) -> dict | None:
    """The recorded gate of a quantized `kv_dtype` for `model` with `weights_dtype` weights
    (None: a float pool, not gated). Raises ValueError, naming the command that measures it, when
    it was never measured for this revision and weights dtype, and with the failed criteria when
    its figures miss `thresholds`."""
    from workers.kv_quant import is_quantized
    if not is_quantized(kv_dtype):
        return None
    revision = _revision(model)
    gate = recorded_gate(model, revision, weights_dtype, kv_dtype)
    command = measure_command(model, kv_dtype, weights_dtype)
    if gate is None:
        raise ValueError(
            f"kv_dtype {kv_dtype} has no recorded quality gate for model {model} (revision "
            f"{revision[:12]}, {weights_dtype} weights); a quantized KV pool is served only "
            f"once measured: run `{command}` first")
    failures = gate_failures(gate, thresholds)
    if failures:
        raise ValueError(
            f"kv_dtype {kv_dtype} failed its quality gate for model {model} ({weights_dtype} "
            f"weights, noise floor multiple {thresholds.noise_floor_multiple:g}): "
            f"{'; '.join(failures)} (measured by `{command}`; thresholds: model.kv_gate_*)")
    return gate
