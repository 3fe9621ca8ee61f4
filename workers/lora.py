"""LoRA adapters: PEFT folders validated at start, a worker's resident set (`max_loras` slots,
LRU), and the batched per-token low-rank delta the model adds to its projections.

One step's tokens may belong to different adapters and to the base model. Each projection
(fused or not) keeps its stacked A [n_sub, slots, R, in] and one B [slots, R, out_j] per
sub-module (R = the largest rank of the configured adapters, smaller ranks padded with zeros; a fused
projection such as qkv has one A over all its sub-modules and one B per sub-module, added into
that sub-module's slice of the fused output).
The delta of a step is prepacked matmuls over every slot (repacked when an adapter loads):
`((x @ A_all^T) * mask) @ B_all` (per sub-module slice), where `mask[t]` is the token's adapter scaling on its slot's
columns and 0 elsewhere (all 0 for base tokens): no loop over requests; padded and masked
terms add exact zeros. A step without adapter tokens skips all of it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.layers import Linear

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter folder cannot be served; the message names the file and what is wrong."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class LoRASpec:
    """A validated adapter: what serving it needs to know before its weights are loaded."""

    name: str
    path: str
    weights_file: str
    content_hash: str          # sha256 of adapter_config.json + the weights: the cache key
    rank: int
    scaling: float             # lora_alpha / r (or / sqrt(r) with use_rslora)
    target_modules: tuple[str, ...]


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able projection of a Llama-family config."""
    h = config.hidden_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _file_sha256(h, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def read_adapter(name: str, path: str | Path, base_config) -> LoRASpec:
    """Validate a PEFT LoRA folder against the base model (peft type, rank, target modules,
    every weight's layer and shape). Raises LoRAError naming the file."""
    folder = Path(path).expanduser()
    cfg_file = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} is not a directory", name)
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} does not exist", name)
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {cfg_file}: {e}", name) from e

    def bad(msg: str, file: Path = cfg_file) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r}: {file}: {msg}", name)

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise bad(f"{key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise bad(f"target_modules must be a list of module names, got the pattern {targets!r}")
    unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unknown or not targets:
        raise bad(f"target_modules {unknown or targets} not supported; "
                  f"supported: {', '.join(SUPPORTED_TARGETS)}")
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / (rank ** 0.5) if cfg.get("use_rslora") else alpha / rank
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if weights is None:
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has none of "
                        f"{', '.join(WEIGHT_FILES)}", name)
    try:
        tensors = _read_tensors(weights)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise bad(f"cannot read weights: {e}", weights) from e
    shapes = module_shapes(base_config)
    n_layers = base_config.num_hidden_layers
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise bad(f"unexpected tensor {key!r} (not a LoRA A/B weight of a projection)",
                      weights)
        layer, module, ab = int(m[1]), m[2], m[3]
        if layer >= n_layers or module not in targets:
            raise bad(f"tensor {key!r} does not fit the base model ({n_layers} layers, "
                      f"targets {targets})", weights)
        fin, fout = shapes[module]
        want = (rank, fin) if ab == "A" else (fout, rank)
        if tuple(t.shape) != want:
            raise bad(f"tensor {key!r} has shape {tuple(t.shape)}, the base model needs {want}",
                      weights)
    if not tensors:
        raise bad("no LoRA weights", weights)
    h = hashlib.sha256()
    _file_sha256(h, cfg_file)
    _file_sha256(h, weights)
    return LoRASpec(name, str(folder.resolve()), str(weights), h.hexdigest(), rank, scaling,
                    tuple(targets))


def validate_adapters(model: str, adapters: dict[str, str]) -> dict[str, LoRASpec]:
    """Check every adapter against the base model `model` (its config only), at start."""
    from workers.model_loader import base_config
    config = base_config(model)
    return {name: read_adapter(name, path, config) for name, path in adapters.items()}


def load_weights(spec: LoRASpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, module): (A [r, in], B [out, r])} of a validated adapter."""
    out: dict[tuple[int, str], list] = {}
    for key, t in _read_tensors(Path(spec.weights_file)).items():
        m = _KEY.search(key)
        assert m is not None, key   # read_adapter checked every key
        pair = out.setdefault((int(m[1]), m[2]), [None, None])
        pair[0 if m[3] == "A" else 1] = t
    return {k: (a, b) for k, (a, b) in out.items() if a is not None and b is not None}


# A projection the model runs as one matmul: its LoRA sub-modules and their output slices.
Group = tuple[tuple[str, int, int], ...]   # ((module, out_offset, out_size), ...)


def fused_groups(config) -> dict[str, Group]:
    """The compact model's projections: qkv, o, gate_up, down."""
    s = module_shapes(config)
    q, kv, inter, h = s["q_proj"][1], s["k_proj"][1], s["gate_proj"][1], s["o_proj"][1]
    return {"qkv": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
            "o": (("o_proj", 0, h),),
            "gate_up": (("gate_proj", 0, inter), ("up_proj", inter, inter)),
            "down": (("down_proj", 0, h),)}


def stock_groups(config) -> dict[str, Group]:
    """The stock model's projections: one per module."""
    return {m: ((m, 0, out),) for m, (_, out) in module_shapes(config).items()}


@dataclass
class LoRAStats:
    loads: int = 0
    evictions: int = 0
    load_s_total: float = 0.0
    last_load_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)   # per adapter name
    tokens: dict[str, int] = field(default_factory=dict)     # computed tokens per adapter
    prompt_tokens: dict[str, int] = field(default_factory=dict)   # of finished requests
    hit_tokens: dict[str, int] = field(default_factory=dict)      # their prefix-cache hits

    def to_dict(self) -> dict:
        return {"lora_loads": self.loads, "lora_evictions": self.evictions,
                "lora_load_s_mean": self.load_s_total / self.loads if self.loads else 0.0,
                "lora_requests": dict(self.requests), "lora_tokens": dict(self.tokens),
                "lora_prompt_tokens": dict(self.prompt_tokens),
                "lora_hit_tokens": dict(self.hit_tokens)}

    def observe_finished(self, name: str, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt_tokens[name] = self.prompt_tokens.get(name, 0) + prompt_tokens
        self.hit_tokens[name] = self.hit_tokens.get(name, 0) + hit_tokens


class LoRAManager:
    """The worker's adapters: every configured spec, at most `max_loras` resident in slots of
    the stacked weights (loaded on first use, evicted least-recently-used)."""

    def __init__(self, specs: dict[str, LoRASpec], config, groups: dict[str, Group],
                 max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        assert specs and max_loras >= 1
        self.specs = specs
        self.groups = groups
        self.max_loras = max_loras
        self.rank = max(s.rank for s in specs.values())
        shapes = module_shapes(config)
        targeted = {m for s in specs.values() for m in s.target_modules}
        # (layer, projection) -> (A [n_sub, slots, R, in], [B_j [slots, R, out_j] per sub])
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for layer in range(config.num_hidden_layers):
            for g, subs in groups.items():
                if not any(m in targeted for m, _, _ in subs):
                    continue
                fin = shapes[subs[0][0]][0]
                self.weights[(layer, g)] = (
                    torch.zeros(len(subs), max_loras, self.rank, fin, dtype=dtype,
                                device=device),
                    [torch.zeros(max_loras, self.rank, size, dtype=dtype, device=device)
                     for _, _, size in subs])
        self.resident: OrderedDict[str, int] = OrderedDict()   # name -> slot, LRU first
        self.stats = LoRAStats()
        # every slot's A and B of a projection as two prepacked linears, rebuilt on each load:
        # x -> [T, slots*n*R] -> [T, out] (oneDNN's kernels, as the base weights)
        self.packed: dict[tuple[int, str], tuple[Linear, Linear]] = {}
        self._pack()

    def _pack(self) -> None:
        for key, (A, Bs) in self.weights.items():
            subs = self.groups[key[1]]
            self.packed[key] = (Linear(A.reshape(-1, A.shape[-1])),
                                [(off, size, Linear(B.reshape(-1, size).t().contiguous()))
                                 for (_, off, size), B in zip(subs, Bs, strict=True)])

    def _load(self, name: str, slot: int) -> None:
        t0 = time.perf_counter()
        spec = self.specs[name]
        loaded = load_weights(spec)
        for (layer, g), (A, Bs) in self.weights.items():
            for j, (module, _, _) in enumerate(self.groups[g]):
                A[j, slot].zero_()
                Bs[j][slot].zero_()
                ab = loaded.get((layer, module))
                if ab is not None:
                    A[j, slot, :spec.rank] = ab[0].to(A)
                    Bs[j][slot, :spec.rank] = ab[1].t().to(A)
        self._pack()
        dt = time.perf_counter() - t0
        self.stats.loads += 1
        self.stats.load_s_total += dt
        self.stats.last_load_s = dt

    def ensure_resident(self, names: list[str]) -> dict[str, int]:
        """Slots of `names` (distinct, at most max_loras), loading and evicting as needed."""
        assert len(names) <= self.max_loras, (names, self.max_loras)
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            if len(self.resident) < self.max_loras:
                slot = len(self.resident)
            else:
                victim = next(n for n in self.resident if n not in names)
                slot = self.resident.pop(victim)
                self.stats.evictions += 1
            self._load(name, slot)
            self.resident[name] = slot
        return {n: self.resident[n] for n in names}

    def batch(self, names: list[str], counts: list[int]) -> LoRABatch | None:
        """The step's per-token adapter selection: `names[i]` ("" = base) for the next
        `counts[i]` tokens of the flat batch. None when no token uses an adapter."""
        active = list(dict.fromkeys(n for n in names if n))
        if not active:
            return None
        slots = self.ensure_resident(active)
        A0 = next(iter(self.weights.values()))[0]
        dtype, device = A0.dtype, A0.device
        # per chunk: its adapter's scaling in its slot's column, zeros elsewhere (base: all 0)
        rows = torch.zeros(len(names), self.max_loras, dtype=dtype)
        for i, n in enumerate(names):
            if n:
                rows[i, slots[n]] = self.specs[n].scaling
        per_token = rows.repeat_interleave(torch.tensor(counts), dim=0).to(device)
        return LoRABatch(self, per_token)


class LoRABatch:
    """One step's adapter selection; `apply` adds the delta to one projection's output."""

    def __init__(self, manager: LoRAManager, per_token: torch.Tensor) -> None:
        self.packed = manager.packed
        self.rank = manager.rank
        self.per_token = per_token          # [T, max_loras] each token's scaling per slot
        self._m: torch.Tensor | None = None

    def _mask(self) -> torch.Tensor:
        """[T, slots*R]: each token's scaling on its slot's R columns."""
        if self._m is None:
            self._m = self.per_token.repeat_interleave(self.rank, dim=1)
        return self._m

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y + this step's LoRA delta of projection `group` of `layer` for input x
        (leading dims flattened: [..., in] -> [..., out]); y is updated in place."""
        packed = self.packed.get((layer, group))
        if packed is None:
            return y
        lora_a, lora_bs = packed
        mask = self._mask()
        width = mask.shape[1]
        xa = lora_a(x.reshape(-1, x.shape[-1]))             # [T, n_sub*slots*R], sub-major
        y2 = y.view(-1, y.shape[-1])
        if len(lora_bs) == 1:
            off, size, lora_b = lora_bs[0]
            y2.add_(lora_b(xa.mul_(mask)))
            return y
        xa = xa.view(xa.shape[0], len(lora_bs), width).mul_(mask.unsqueeze(1))
        for j, (off, size, lora_b) in enumerate(lora_bs):  # q/k/v or gate/up: own slices
            y2[:, off:off + size].add_(lora_b(xa[:, j].contiguous()))
        return y


def write_random_adapter(folder: str | Path, config, rank: int = 8, alpha: float = 16.0,
                         targets: tuple[str, ...] = SUPPORTED_TARGETS, seed: int = 0,
                         std: float = 0.05) -> Path:
    """A PEFT-format LoRA folder with random non-zero A and B (benchmarks, examples)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in targets:
            fin, fout = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * std
    save_file(tensors, str(folder / WEIGHT_FILES[0]))
    (folder / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": getattr(config, "_name_or_path", "")}))
    return folder
