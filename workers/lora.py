"""LoRA adapters: PEFT folders validated at start, a worker's resident set (`max_loras` slots,
LRU), and the batched per-token low-rank delta the model adds to its projections.

One step's tokens may belong to different adapters and to the base model. Each projection
(fused or not) keeps its stacked A [n_sub, slots, R, in] and one B [slots, R, out_j] per
sub-module (R = the largest rank of the configured adapters, smaller ranks padded with zeros),
and packs them per slot into A [n_sub*R, in] and a B [n_sub*R, out] that is block-diagonal
over the sub-modules (q/k/v, gate/up each land in their slice of the fused output).
Small steps (decodes): three ops per projection over every slot at once,
`y += ((x @ A_all^T) * mask) @ B_all`, where `mask[t]` is the token's adapter scaling on its
slot's columns and 0 elsewhere (all 0 for base tokens); padded and masked terms add exact
zeros. Large steps (>= SEGMENT_MIN_TOKENS, prefill): tokens grouped by adapter with one sort,
each group computing only its own A and B (a loop over the step's adapters, never over
requests). A step without adapter tokens skips all of it.

On the CPU the low-rank products run in float32 whatever the model's dtype: they are a few
percent of the projection's FLOPs, float32 is the more exact, and it goes to MKL's sgemm, while
bfloat16 GEMMs with a rank-sized dimension were measured 10-60x slower than float32 here (an AMD
EPYC without native bf16, under load; on a CPU with avx512_bf16 the comparison was not made).
Elsewhere (cuda) they run in the model's dtype. The delta is added in the output's dtype.
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

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
SEGMENT_MIN_TOKENS = 128   # steps this large group tokens by adapter instead of masking
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def compute_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the adapters' weights and low-rank products (see the module docstring)."""
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


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

    def observe_request(self, name: str) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1

    def observe_tokens(self, name: str, tokens: int) -> None:
        self.tokens[name] = self.tokens.get(name, 0) + tokens

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
        dtype = compute_dtype(dtype, device)
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
        # every slot's A (transposed) and B of a projection, rebuilt on each load:
        # x -> [T, slots*n*R] -> [T, out]
        self.packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.per_slot: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pack()

    def _pack(self) -> None:
        for key, (A, Bs) in self.weights.items():
            subs = self.groups[key[1]]
            # per slot: A [n*R, in] and B [n*R, out], block-diagonal over the sub-modules
            out = sum(size for _, _, size in subs)
            per_slot = []
            for slot in range(self.max_loras):
                b = A.new_zeros(len(subs) * self.rank, out)
                for j, ((_, off, size), B) in enumerate(zip(subs, Bs, strict=True)):
                    b[j * self.rank:(j + 1) * self.rank, off:off + size] = B[slot]
                per_slot.append((A[:, slot].reshape(-1, A.shape[-1]).contiguous(), b))
            self.per_slot[key] = per_slot
            # every slot at once (slot-major rows): one A^T and one B
            self.packed[key] = (torch.cat([a for a, _ in per_slot]).t().contiguous(),
                                torch.cat([b for _, b in per_slot]))

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
        reps = torch.tensor(counts)
        per_token = rows.repeat_interleave(reps, dim=0).to(device)
        segments = None
        if int(reps.sum()) >= SEGMENT_MIN_TOKENS:
            # tokens grouped by adapter (one stable sort): each adapter's tokens compute only
            # their own A and B (a loop over the step's adapters, never over requests)
            slot_of = torch.tensor([slots[n] if n else -1 for n in names])
            token_slot = slot_of.repeat_interleave(reps)
            order = torch.argsort(token_slot, stable=True)
            sizes = torch.bincount(token_slot + 1, minlength=self.max_loras + 1).tolist()
            segments, start = [], sizes[0]           # base tokens (slot -1) sort first: skip
            by_slot = {slots[n]: self.specs[n].scaling for n in active}
            for slot in range(self.max_loras):
                n_tok = sizes[slot + 1]
                if n_tok:
                    idx = order[start:start + n_tok].to(device)
                    segments.append((slot, idx, by_slot[slot]))
                start += n_tok
        return LoRABatch(self, per_token, segments)


class LoRABatch:
    """One step's adapter selection; `apply` adds the delta to one projection's output."""

    def __init__(self, manager: LoRAManager, per_token: torch.Tensor,
                 segments: list[tuple[int, torch.Tensor, float]] | None = None) -> None:
        self.packed = manager.packed
        self.per_slot = manager.per_slot
        self.segments = segments            # large steps: (slot, token indices, scaling)
        self.rank = manager.rank
        self.per_token = per_token          # [T, max_loras] each token's scaling per slot
        self._masks: dict[int, torch.Tensor] = {}

    def _mask(self, n_sub: int) -> torch.Tensor:
        """[T, slots*n_sub*R]: each token's scaling on its slot's columns."""
        m = self._masks.get(n_sub)
        if m is None:
            m = self._masks[n_sub] = self.per_token.repeat_interleave(n_sub * self.rank, dim=1)
        return m

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y + this step's LoRA delta of projection `group` of `layer` for input x
        (leading dims flattened: [..., in] -> [..., out]); y is updated in place."""
        packed = self.packed.get((layer, group))
        if packed is None:
            return y
        if self.segments is not None:
            return self._apply_segments(y, x, self.per_slot[(layer, group)])
        a_t, lora_b = packed
        xa = x.reshape(-1, x.shape[-1]).to(a_t.dtype) @ a_t   # [T, slots*n_sub*R]
        xa.mul_(self._mask(xa.shape[1] // (self.per_token.shape[1] * self.rank)))
        y2 = y.view(-1, y.shape[-1])
        if y2.dtype == lora_b.dtype:
            y2.addmm_(xa, lora_b)
        else:
            y2.add_(xa @ lora_b)
        return y

    def _apply_segments(self, y: torch.Tensor, x: torch.Tensor,
                        per_slot: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for slot, idx, scaling in self.segments:
            a, b = per_slot[slot]
            xa = x2.index_select(0, idx).to(a.dtype) @ a.t()
            y2.index_add_(0, idx, ((xa.mul_(scaling)) @ b).to(y2.dtype))
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
