"""The KV quality gate: a quantized KV dtype is served only when `raypd bench kv-quality` measured
it, for this model revision, weights dtype and engine numerics version, within the policy's
multiple of the noise floor (how far a bf16 KV pool, an accepted change, moves the model from a
float32 one, measured over several texts and read at its upper confidence bound) and with
perplexity up by less than MAX_PPL_DELTA_PCT. Measuring is the benchmark's
(raypd/bench/kv_quality.py); the figures' types, the verdict, the record (raypd's cache,
kv_gates.json) and the check `raypd serve` runs are the serving side's, here.

Invariants: a gate is keyed by (model, revision, weights dtype, KV dtype), so a measurement on
float32 weights never vouches for bfloat16 ones; a gate recorded under another numerics version
(the kernels changed since) or with a floor of fewer than MIN_FLOOR_TEXTS texts asks for a re-run
and never passes; the verdict is recomputed from the recorded per-text figures under the
caller's thresholds (never stored as a bare boolean); a quantized KV dtype without a record is
refused, naming the command that measures it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GATES_FILE = "kv_gates.json"

MAX_PPL_DELTA_PCT = 1.0
"""The perplexity of the texts may rise by less than 1% (the issue's bound: a change a reader
would not notice in any quality benchmark, and one a format with deviations near the floor stays
far below)."""

NOISE_FLOOR_MULTIPLE = 8.0
"""POLICY, not a derivation: a format may add up to 8x the noise floor's logit error (the floor
read at its upper confidence bound, NoiseFloor). Nothing in the formats fixes the number. An
earlier text argued from float16 and bf16 both being accepted KV dtypes, 3 bits apart; but the
floor is bf16's own error, so 8x (2^3) the floor allows a format 3 bits *below* bf16 (6 below
float16), outside the range the accepted formats span: the argument gave no support for 8x.
8x is where the line is drawn, and `raypd bench kv-quality` prints the verdicts at 6x, 8x and
10x (POLICY_MULTIPLES) beside it, so a verdict that turns within that range reads as the
judgment call it is. What the multiple scales is a model, stated: argmax disagreements
(positions whose top-two margin is under the logit error e) grow as e, KL grows as e^2 (for small
perturbations KL ~ var(e) / 2); so the limits are the multiple times the floor's disagreement
rate and its square times the floor's mean and p99 KL."""

POLICY_MULTIPLES = (6.0, 8.0, 10.0)
"""The multiples whose verdicts the bench prints beside the chosen one."""

MIN_FLOOR_TEXTS = 4
"""The noise floor is measured over at least this many texts (one text gave about 8
disagreements: +-35% of counting noise alone)."""

FLOOR_CONFIDENCE = 0.95
"""The one-sided confidence of the floor's upper bound (NoiseFloor.upper_bound)."""

FLOOR_FIGURES = ("disagreement", "mean_kl", "p99_kl")
"""The figures judged against the floor (perplexity has its own absolute bound)."""


def student_t_quantile(p: float, df: int) -> float:
    """The p-quantile (p >= 0.5) of Student's t with `df` >= 1 degrees of freedom: bisection on
    its CDF, in closed form for integer df (Abramowitz & Stegun 26.7.3 / 26.7.4)."""
    assert 0.5 <= p < 1 and df >= 1

    def cdf(t: float) -> float:
        theta = math.atan(t / math.sqrt(df))
        c2 = math.cos(theta) ** 2
        if df % 2:      # odd: (2/pi) (theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ...))
            term, total = 1.0, 0.0
            for j in range(1, (df - 1) // 2 + 1):
                total += term
                term *= (2 * j) / (2 * j + 1) * c2
            a = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
        else:           # even: sin (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ...)
            term, total = 1.0, 0.0
            for j in range(1, df // 2 + 1):
                total += term
                term *= (2 * j - 1) / (2 * j) * c2
            a = math.sin(theta) * total
        return 0.5 + a / 2

    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Deviation:
    """How far a KV pool moves the model from a reference pool (same weights), teacher-forced on
    one text, or the mean over several (mean_deviation): at every position both see the same
    reference prefix, so errors never compound.

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


def mean_deviation(per_text: list[Deviation] | tuple[Deviation, ...]) -> Deviation:
    """Each figure's mean over the texts (every text weighs the same), positions summed."""
    assert per_text, "no texts"
    return Deviation(**{k: statistics.fmean(getattr(d, k) for d in per_text) for k in
                        ("teacher_forced_agreement", "mean_kl", "p99_kl", "ppl_delta_pct")},
                     positions=sum(d.positions for d in per_text))


@dataclass(frozen=True)
class NoiseFloor:
    """The noise floor, one Deviation per text (a bf16 pool against a float32 one), and the upper
    confidence bound the gate reads it at.

    upper_bound: for each of FLOOR_FIGURES, the one-sided FLOOR_CONFIDENCE (95%) Student-t bound
    of its mean over the n texts, mean + t(0.95, n - 1) * sd / sqrt(n) (sd: the sample standard
    deviation over the texts, which holds both the texts' differences and the counting noise of
    a few disagreements a text; t(0.95, 3) = 2.35 for the default 4 texts). A disagreement bound
    is never below one disagreement in all the positions scored: zero observed is not zero noise.
    Invariant: at least two texts (the gate asks for MIN_FLOOR_TEXTS).
    """

    texts: tuple[Deviation, ...]

    def __post_init__(self) -> None:
        assert len(self.texts) >= 2, "a floor's spread needs at least two texts"

    @property
    def mean(self) -> Deviation:
        return mean_deviation(self.texts)

    def spread(self) -> dict[str, dict[str, float]]:
        """{figure: {sd, min, max}} over the texts."""
        out = {}
        for name in FLOOR_FIGURES:
            xs = [getattr(d, name) for d in self.texts]
            out[name] = {"sd": statistics.stdev(xs), "min": min(xs), "max": max(xs)}
        return out

    def upper_bound(self) -> dict[str, float]:
        n = len(self.texts)
        t = student_t_quantile(FLOOR_CONFIDENCE, n - 1)
        mean, spread = self.mean, self.spread()
        ub = {k: getattr(mean, k) + t * spread[k]["sd"] / math.sqrt(n) for k in FLOOR_FIGURES}
        ub["disagreement"] = max(ub["disagreement"], 1.0 / mean.positions)
        return ub

    def to_dict(self) -> dict:
        """The mean figures, per text, spread and upper bound (the bench adds each text's name)."""
        return dict(self.mean.to_dict(), texts=[d.to_dict() for d in self.texts],
                    spread=self.spread(), upper_bound=self.upper_bound(),
                    bound=f"one-sided {FLOOR_CONFIDENCE:.0%} Student-t bound of the mean over "
                          f"{len(self.texts)} texts: mean + t * sd / sqrt(n)")

    @classmethod
    def from_dict(cls, d: dict) -> NoiseFloor:
        return cls(tuple(Deviation.from_dict(t) for t in d["texts"]))


@dataclass(frozen=True, kw_only=True)
class GateThresholds:
    """The gate's bounds: perplexity change, and the policy's multiple of the noise floor's
    logit error (see NOISE_FLOOR_MULTIPLE: a policy, with what it scales)."""

    max_ppl_delta_pct: float = MAX_PPL_DELTA_PCT
    noise_floor_multiple: float = NOISE_FLOOR_MULTIPLE

    def limits(self, floor: NoiseFloor) -> dict[str, float]:
        """The largest figure each criterion allows against `floor`'s upper bound."""
        m, ub = self.noise_floor_multiple, floor.upper_bound()
        return {"disagreement": m * ub["disagreement"], "mean_kl": m * m * ub["mean_kl"],
                "p99_kl": m * m * ub["p99_kl"], "ppl_delta_pct": self.max_ppl_delta_pct}

    def failures(self, dev: Deviation, floor: NoiseFloor) -> list[str]:
        """Each criterion `dev` (the format's mean over the floor's texts) misses, with its
        figure and limit; [] when the format passes."""
        lim = self.limits(floor)
        got = {"disagreement": dev.disagreement, "mean_kl": dev.mean_kl, "p99_kl": dev.p99_kl,
               "ppl_delta_pct": dev.ppl_delta_pct}
        out = []
        for name, value in got.items():
            if not value <= lim[name]:      # NaN fails
                out.append(f"{name} {value:.3g} > {lim[name]:.3g}")
        return out

    def passes(self, dev: Deviation, floor: NoiseFloor) -> bool:
        return not self.failures(dev, floor)

    def policy_table(self, dev: Deviation, floor: NoiseFloor) -> dict[str, dict]:
        """{"6x": {multiple, chosen, passed, failures}, "8x": ..., "10x": ...}: the verdict at
        each of POLICY_MULTIPLES and at the chosen multiple, in increasing order."""
        out = {}
        for m in sorted({*POLICY_MULTIPLES, self.noise_floor_multiple}):
            failures = replace(self, noise_floor_multiple=m).failures(dev, floor)
            out[f"{m:g}x"] = {"multiple": m, "chosen": m == self.noise_floor_multiple,
                              "passed": not failures, "failures": failures}
        return out


def gate_thresholds(model_section) -> GateThresholds:
    """The thresholds of a config's `model` section (model.kv_gate_*)."""
    return GateThresholds(max_ppl_delta_pct=model_section.kv_gate_max_ppl_delta_pct,
                          noise_floor_multiple=model_section.kv_gate_noise_floor_multiple)


def numerics_version() -> str:
    """The engine's numerics version: a hash of the CPU kernels' sources and headers, the files
    the kernel build keys its cache on (workers/kernels/build.py SOURCES, HEADERS). A gate
    recorded under another version asks for a re-run."""
    from workers.kernels.build import sources_digest
    return sources_digest()


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
                 "greedy_agreement", "capacity_ratio", "decode_tok_s_ratio", "evidence", "texts",
                 "text_tokens", "numerics_version", "cpu_model")


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


def rerun_reason(gate: dict) -> str | None:
    """Why a recorded gate no longer vouches for this engine and must be measured again (None:
    it still does): the kernels changed since it was measured, or its floor has too few texts."""
    recorded, current = gate.get("numerics_version"), numerics_version()
    if recorded != current:
        return (f"it was measured under engine numerics version {recorded or 'none recorded'} "
                f"and the engine is now at {current} (the kernel sources changed since)")
    texts = len(gate.get("noise_floor", {}).get("texts", ()))
    if texts < MIN_FLOOR_TEXTS:
        return f"its noise floor covers {texts} texts, fewer than {MIN_FLOOR_TEXTS}"
    return None


def gate_failures(gate: dict, thresholds: GateThresholds) -> list[str]:
    """What a recorded gate misses under `thresholds` ([]: it passes); a stale gate (rerun_reason)
    fails with the reason and a request to re-run."""
    reason = rerun_reason(gate)
    if reason is not None:
        return [f"re-run needed: {reason}"]
    return thresholds.failures(Deviation.from_dict(gate), NoiseFloor.from_dict(gate["noise_floor"]))


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
    it was never measured for this revision and weights dtype, when it must be measured again
    (rerun_reason: the kernels changed since), and with the failed criteria when its figures miss
    `thresholds`."""
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
    reason = rerun_reason(gate)
    if reason is not None:
        raise ValueError(
            f"kv_dtype {kv_dtype}'s quality gate for model {model} ({weights_dtype} weights) "
            f"must be measured again: {reason}; re-run `{command}`")
    failures = gate_failures(gate, thresholds)
    if failures:
        raise ValueError(
            f"kv_dtype {kv_dtype} failed its quality gate for model {model} ({weights_dtype} "
            f"weights, noise floor multiple {thresholds.noise_floor_multiple:g}, a policy): "
            f"{'; '.join(failures)} (measured by `{command}`; thresholds: model.kv_gate_*)")
    return gate
