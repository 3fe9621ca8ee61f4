"""The one typed raypd config: loaded from YAML, validated once at the edge (every error names
its key path; unknown keys are errors), then turned into the PDConfig the cluster runs.

    cfg = load_config("configs/local.yaml", overrides={"model.name": "tiny"})
    cluster = PDCluster(cfg.to_pd_config())

A missing file section, or a missing key, takes the section's default; those defaults are
`configs/local.yaml` (one laptop: smollm2, 1 prefill + 1 decode over shm, 127.0.0.1:8000).

Every default is stated once. A key that the serving side also has takes its default from that
serving dataclass (`_from(EngineConfig, "block_size", ...)`: workers/engine_config.py,
router/flow_config.py, cluster/pd_config.py, router/autoscale_decision.py, ingress/core.py,
ingress/limits.py, ingress/request_checks.py), and only its validation rules are written here;
a YAML-only key (served_model_name, policy_options, slo, server.*, ray.*) keeps its one default
here. `raypd serve`, `raypd generate` and the benches all read this chain: `load_config(path,
overrides)`, the command line's flags over the file, the file over these defaults.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.pd_config import MAX_TP, PDConfig
from ingress.core import IngressSettings
from ingress.limits import IngressLimits
from ingress.request_checks import RequestLimits
from protocol.tp_layout import tp_refusal
from router.autoscale_decision import AutoscaleConfig, AutoscaleConfigError
from router.flow_config import FAILURE_POLICIES, INDEX_MODES, FlowConfig
from workers.engine_config import DTYPES, KV_DTYPES, TP_ALLREDUCES, EngineConfig
from workers.kv_gate import MAX_PPL_DELTA_PCT, NOISE_FLOOR_MULTIPLE

SERVING = "serving"     # field metadata: (serving dataclass, its field) the default comes from


class ConfigError(ValueError):
    """A config value is wrong; the message starts with `source: key.path:`."""


def _opt(default: Any = MISSING, **rules: Any) -> Any:
    """A YAML-only field (its one default is here) with validation rules: min / max
    (inclusive), gt (exclusive), choices, pow2."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=rules)
    return field(default=default, metadata=rules)


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (a fresh one for a default_factory)."""
    f = cls.__dataclass_fields__[name]
    if f.default_factory is not MISSING:
        return f.default_factory()
    if f.default is MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no default")
    return f.default


def _from(cls: type, name: str, **rules: Any) -> Any:
    """A field whose default is serving dataclass `cls`'s field `name` (stated there only),
    with validation rules as `_opt`'s."""
    f = cls.__dataclass_fields__[name]
    meta = {**rules, SERVING: (cls, name)}
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=meta)
    default_of(cls, name)                       # (a default is required)
    return field(default=f.default, metadata=meta)


@dataclass
class ModelSection:
    name: str = _from(EngineConfig, "model")   # smollm2, tiny, or a local HF folder
    dtype: str = _from(EngineConfig, "dtype", choices=DTYPES)
    kv_dtype: str = _from(EngineConfig, "kv_dtype", choices=KV_DTYPES)
    # `raypd serve` serves a quantized kv_dtype only when its recorded `bench kv-quality` gate
    # (this revision, these weights) passes these (workers/kv_gate.py says why the defaults)
    kv_gate_max_ppl_delta_pct: float = _opt(MAX_PPL_DELTA_PCT, min=0)
    kv_gate_noise_floor_multiple: float = _opt(NOISE_FLOOR_MULTIPLE, min=1)
    served_model_name: str | None = None        # the name clients send (default: `name`)
    max_model_len: int | None = _from(EngineConfig, "max_model_len", min=1)  # None: the model's
    lora_adapters: dict[str, str] = _from(EngineConfig, "lora_adapters")  # LoRA name -> folder


@dataclass
class EngineSection:
    block_size: int = _from(EngineConfig, "block_size", min=1, pow2=True)
    kv_cache_gb: float = _from(EngineConfig, "kv_cache_gb", gt=0)   # KV pool per worker
    num_blocks: int | None = _from(EngineConfig, "num_blocks", min=1)   # overrides kv_cache_gb
    kv_tier2_gb: float = _from(EngineConfig, "kv_tier2_gb", min=0)  # host tier (0: off)
    kv_tier2_dir: str | None = _from(EngineConfig, "kv_tier2_dir")  # its mmap file's folder
    max_num_batched_tokens: int | None = _from(EngineConfig, "max_num_batched_tokens", min=1)
    max_step_ms: float | None = _from(EngineConfig, "max_step_ms", gt=0)   # TPOT target
    max_num_seqs: int = _from(EngineConfig, "max_num_seqs", min=1)
    enable_prefix_caching: bool = _from(EngineConfig, "enable_prefix_caching")
    threads_per_worker: int = _from(PDConfig, "threads_per_actor", min=1)  # torch threads
    share_idle_threads: bool = _from(PDConfig, "share_idle_threads")  # + idle workers' threads
    model_impl: str = _from(EngineConfig, "model_impl", choices=("auto", "compact", "stock"))
    max_loras: int = _from(EngineConfig, "max_loras", min=1)   # resident per worker (LRU)
    device: str = _from(EngineConfig, "device", choices=("auto", "cpu", "cuda"))  # auto: cuda
                                                    # if the worker holds a GPU (num_gpus)
    cuda_graphs: bool = _from(EngineConfig, "cuda_graphs")   # cuda: decode replays CUDA graphs
    tp_allreduce: str = _from(EngineConfig, "tp_allreduce", choices=TP_ALLREDUCES)  # TP ranks'
                                                    # all-reduce (workers.*.tp > 1)


@dataclass
class PrefillSection:
    count: int = _from(PDConfig, "num_prefill", min=0)   # 0: colocated (decode prefills)
    resources: dict[str, float] = _from(PDConfig, "prefill_resources")   # e.g. {prefill: 1}
    tp: int = _from(PDConfig, "prefill_tp", min=1, max=MAX_TP)   # tensor-parallel ranks


@dataclass
class DecodeSection:
    count: int = _from(PDConfig, "num_decode", min=0)
    resources: dict[str, float] = _from(PDConfig, "decode_resources")   # Ray custom resources
    tp: int = _from(PDConfig, "decode_tp", min=1, max=MAX_TP)   # (and the colocated engine's)



@dataclass
class WorkersSection:
    prefill: PrefillSection = field(default_factory=PrefillSection)
    decode: DecodeSection = field(default_factory=DecodeSection)
    num_gpus: float = _from(PDConfig, "num_gpus_per_worker", min=0)   # per worker, both roles
    max_restarts: int = _from(PDConfig, "max_restarts", min=0)   # Ray restarts a dead worker


@dataclass
class TransferSection:
    transport: str = _from(FlowConfig, "transport")   # one of kvtransfer.base.TRANSPORT_NAMES
    options: dict[str, Any] = _from(PDConfig, "transport_cfg")   # transport keyword arguments
    lease_s: float = _from(PDConfig, "lease_s", gt=0)
    failure_policy: str = _from(FlowConfig, "failure_policy", choices=FAILURE_POLICIES)
    local_prefill_max_tokens: int = _from(FlowConfig, "local_prefill_max_tokens", min=0)
    local_prefill_when_backlogged: bool = _from(FlowConfig, "local_prefill_when_backlogged")
                                                # (router/local_prefill.py)


@dataclass
class SLOSection:
    ttft_s: float | None = _opt(None, gt=0)     # locality policy: 429 when no worker meets it


@dataclass
class RouterSection:
    policy: str = _from(FlowConfig, "policy")   # one of router.policies.POLICIES
    policy_options: dict[str, Any] = _opt({})   # keyword arguments of the policy
    index_mode: str = _from(FlowConfig, "index_mode", choices=INDEX_MODES)
    slo: SLOSection = field(default_factory=SLOSection)
    max_inflight: int = _from(IngressSettings, "max_inflight", min=1)   # more -> 429
    admit_timeout_s: float = _from(FlowConfig, "admit_timeout_s", gt=0)
    request_timeout_s: float = _from(FlowConfig, "request_timeout_s", gt=0)
    max_retries: int = _from(FlowConfig, "max_retries", min=0)   # re-runs after a worker died
    report_interval_s: float = _from(FlowConfig, "report_interval_s", gt=0)
    health_timeout_s: float = _from(FlowConfig, "health_timeout_s", gt=0)
    hang_timeout_s: float = _from(FlowConfig, "hang_timeout_s", gt=0)
    migrate_on_kv_pressure: bool = _from(FlowConfig, "migrate_on_kv_pressure")
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)   # router/autoscale_decision.py


@dataclass
class ServerSection:
    host: str = "127.0.0.1"
    port: int = _opt(8000, min=0, max=65535)    # 0: any free port
    grpc_port: int | None = _opt(None, min=0, max=65535)
    api_key: str | None = None                  # one bearer token with every scope
    api_keys_file: str | None = None            # keys -> tenant, scopes (ingress/auth.py)
    protect_metrics: bool = _from(IngressSettings, "protect_metrics")  # /metrics: admin key
    limits: IngressLimits = field(default_factory=IngressLimits)
    request_limits: RequestLimits = field(default_factory=RequestLimits)


@dataclass
class RaySection:
    address: str | None = None                  # null: start a local Ray; auto / host:port: join
    num_cpus: int | None = _opt(None, min=1)    # local Ray only
    include_dashboard: bool = False             # local Ray only


@dataclass
class RaypdConfig:
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    transfer: TransferSection = field(default_factory=TransferSection)
    router: RouterSection = field(default_factory=RouterSection)
    server: ServerSection = field(default_factory=ServerSection)
    ray: RaySection = field(default_factory=RaySection)

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.name

    def engine_config(self) -> dict:
        """EngineConfig fields (workers/engine_config.py) shared by every worker."""
        m, e = self.model, self.engine
        return dict(model=m.name, dtype=m.dtype, kv_dtype=m.kv_dtype, block_size=e.block_size,
                    num_blocks=e.num_blocks, kv_cache_gb=e.kv_cache_gb,
                    kv_tier2_gb=e.kv_tier2_gb, kv_tier2_dir=e.kv_tier2_dir,
                    max_num_batched_tokens=e.max_num_batched_tokens,
                    max_step_ms=e.max_step_ms, max_num_seqs=e.max_num_seqs, max_model_len=m.max_model_len,
                    enable_prefix_caching=e.enable_prefix_caching, model_impl=e.model_impl,
                    lora_adapters=dict(m.lora_adapters), max_loras=e.max_loras,
                    device=e.device, cuda_graphs=e.cuda_graphs, tp_allreduce=e.tp_allreduce)

    def flow_config(self) -> FlowConfig:
        """How requests flow through the workers (router.* and transfer.* keys)."""
        r, t = self.router, self.transfer
        policy_cfg = dict(r.policy_options)
        if r.slo.ttft_s is not None:
            policy_cfg["ttft_slo_s"] = r.slo.ttft_s
        return FlowConfig(policy=r.policy, policy_cfg=policy_cfg, index_mode=r.index_mode,
                          local_prefill_max_tokens=t.local_prefill_max_tokens,
                          local_prefill_when_backlogged=t.local_prefill_when_backlogged,
                          failure_policy=t.failure_policy, transport=t.transport,
                          admit_timeout_s=r.admit_timeout_s,
                          request_timeout_s=r.request_timeout_s,
                          report_interval_s=r.report_interval_s,
                          health_timeout_s=r.health_timeout_s, hang_timeout_s=r.hang_timeout_s,
                          max_retries=r.max_retries,
                          migrate_on_kv_pressure=r.migrate_on_kv_pressure)

    def autoscale_config(self) -> AutoscaleConfig:
        """`router.autoscale` (validated at load)."""
        return self.router.autoscale

    def to_pd_config(self) -> PDConfig:
        w = self.workers
        return PDConfig(engine=self.engine_config(), num_prefill=w.prefill.count,
                        num_decode=w.decode.count, prefill_tp=w.prefill.tp,
                        decode_tp=w.decode.tp, transport_cfg=dict(self.transfer.options),
                        lease_s=self.transfer.lease_s,
                        threads_per_actor=self.engine.threads_per_worker,
                        share_idle_threads=self.engine.share_idle_threads,
                        prefill_resources=dict(w.prefill.resources),
                        decode_resources=dict(w.decode.resources), num_gpus_per_worker=w.num_gpus,
                        max_restarts=w.max_restarts, flow=self.flow_config(),
                        autoscale=self.router.autoscale if self.router.autoscale.enabled
                        else None)

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)

    def to_yaml(self) -> str:
        """The whole config as YAML that `load_config` reads back equal (--print-config)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# ---- loading -----------------------------------------------------------------------------------
def load_config(path: str | Path | None = None,
                overrides: dict[str, Any] | None = None, *,
                in_process: bool = False) -> RaypdConfig:
    """Read `path` (None: the defaults), apply `overrides` ({"workers.prefill.count": 2, ...};
    None values are skipped), validate, and return the typed config. Raises ConfigError.
    `in_process`: the engine runs in this process (`raypd generate`, `raypd bench engine`), not
    in worker actors, so the workers' placement is not checked (engine.device cuda without
    workers.num_gpus)."""
    source = str(path) if path is not None else "defaults"
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{source}: cannot read the config file: {e.strerror}") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections, "
                              f"got {type(raw).__name__}")
    cli = set()
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        _set_path(raw, key, value, source)
        cli.add(key)
    v = _Validator(source, cli)
    cfg = v.build(RaypdConfig, raw, "")
    v.cross_checks(cfg, in_process)
    return cfg


def _set_path(raw: dict, key: str, value: Any, source: str) -> None:
    *parents, last = key.split(".")
    node = raw
    for i, p in enumerate(parents):
        nxt = node.setdefault(p, {})
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {'.'.join(parents[:i + 1])}: must be a mapping, "
                              f"got {nxt!r}")
        node = nxt
    node[last] = value


class _Validator:
    def __init__(self, source: str, cli_keys: set[str]) -> None:
        self.source = source
        self.cli_keys = cli_keys

    def fail(self, key: str, message: str) -> typing.NoReturn:
        cli = any(key == k or key.startswith(k + ".") for k in self.cli_keys)
        where = "command line" if cli else self.source
        raise ConfigError(f"{where}: {key}: {message}")

    def build(self, cls: type, raw: Any, path: str) -> Any:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            self.fail(path or "(top level)", f"must be a mapping, got {raw!r}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in fields(cls)]
        for key in raw:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.fail(_join(path, key), f"unknown key (valid: {', '.join(names)}){hint}")
        kwargs = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            key, value, hint = _join(path, f.name), raw[f.name], hints[f.name]
            if is_dataclass(hint):
                kwargs[f.name] = self.build(hint, value, key)
            else:
                kwargs[f.name] = self.value(key, value, hint, dict(f.metadata))
        return cls(**kwargs)

    def value(self, key: str, value: Any, hint: Any, rules: dict) -> Any:
        args = typing.get_args(hint)
        optional = _is_union(hint) and type(None) in args
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
            if value is None:
                return None
        want = _describe(hint, rules) + (" or null" if optional else "")
        origin = typing.get_origin(hint)
        if origin is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                self.fail(key, f"must be {want}, got {value!r}")
            if typing.get_args(hint)[1] is float:
                for k, v in value.items():
                    if not _is_number(v) or v < 0:
                        self.fail(f"{key}.{k}", f"must be a number >= 0, got {v!r}")
                return {k: float(v) for k, v in value.items()}
            return dict(value)
        ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
              float: _is_number,
              bool: lambda x: isinstance(x, bool),
              str: lambda x: isinstance(x, str) and x != ""}[hint]
        if not ok(value):
            self.fail(key, f"must be {want}, got {value!r}")
        if "choices" in rules and value not in rules["choices"]:
            self.fail(key, f"must be {want}, got {value!r}")
        if ("min" in rules and value < rules["min"]) or ("max" in rules and value > rules["max"]) \
                or ("gt" in rules and value <= rules["gt"]):
            self.fail(key, f"must be {want}, got {value!r}")
        if rules.get("pow2") and value & (value - 1):
            self.fail(key, f"must be {want}, got {value!r}")
        return float(value) if hint is float else value

    def cross_checks(self, cfg: RaypdConfig, in_process: bool = False) -> None:
        """Checks that need another module's names or more than one key."""
        from kvtransfer.base import TRANSPORT_NAMES, transport_options  # (imports torch)
        from router.policies import POLICIES, make_policy
        from workers.model_loader import BUILTIN_MODELS
        from workers.random_model import is_random
        w, r = cfg.workers, cfg.router
        if w.decode.count < 1:
            self.fail("workers.decode.count", f"must be an integer >= 1 (0 prefill workers is "
                      f"the colocated mode; decode workers are required), got {w.decode.count}")
        if cfg.transfer.transport not in TRANSPORT_NAMES:
            self.fail("transfer.transport", f"must be one of {', '.join(TRANSPORT_NAMES)}, "
                      f"got {cfg.transfer.transport!r}")
        else:
            takes = transport_options(cfg.transfer.transport)
            unknown = sorted(set(cfg.transfer.options) - takes)
            if unknown:
                self.fail("transfer.options", f"{', '.join(map(repr, unknown))} not taken by "
                          f"transport {cfg.transfer.transport!r}; it takes: "
                          f"{', '.join(sorted(takes))}")
        if r.policy not in POLICIES:
            self.fail("router.policy", f"must be one of {', '.join(sorted(POLICIES))}, "
                      f"got {r.policy!r}")
        if r.slo.ttft_s is not None and r.policy != "locality":
            self.fail("router.slo.ttft_s", f"only the locality policy enforces a TTFT SLO "
                      f"(router.policy is {r.policy!r})")
        try:
            r.autoscale.validate()
        except AutoscaleConfigError as e:
            self.fail(f"router.autoscale.{e.field}", str(e).removeprefix(f"{e.field}: "))
        try:
            make_policy(r.policy, **r.policy_options)
        except TypeError as e:
            self.fail("router.policy_options", f"not accepted by policy {r.policy!r}: {e}")
        m = cfg.model.name
        if m not in BUILTIN_MODELS and cfg.ray.address is None and not Path(m).is_dir() \
                and not is_random(m):
            self.fail("model.name", f"must be {' or '.join(BUILTIN_MODELS)} or a local model "
                      f"folder; {m!r} is neither")
        for name, path in cfg.model.lora_adapters.items():
            key = f"model.lora_adapters.{name}"
            if not isinstance(path, str) or not path:
                self.fail(key, f"must be the path of a PEFT adapter folder, got {path!r}")
            if name == cfg.served_model_name:
                self.fail(key, "an adapter name must differ from the served model name")
        if cfg.model.lora_adapters and cfg.ray.address is None:
            from workers.lora import LoRAError, validate_adapters
            try:
                validate_adapters(m, cfg.model.lora_adapters)
            except LoRAError as e:
                self.fail(f"model.lora_adapters.{e.name}", str(e))
        for role in ("prefill", "decode"):
            tp = getattr(w, role).tp
            heads = model_heads(m) if tp > 1 else None   # None: not known here (a remote path)
            reason = tp_refusal(*heads, tp) if heads else None
            if reason:
                self.fail(f"workers.{role}.tp", f"{reason}; model {m!r} has {heads[0]} query "
                          f"and {heads[1]} KV heads")
        if cfg.engine.device == "cuda" and w.num_gpus == 0 and not in_process:
            self.fail("engine.device", "cuda needs GPUs for the workers: set workers.num_gpus "
                      "(e.g. 0.5 puts a prefill and a decode worker on one GPU)")
        if cfg.server.grpc_port is not None and cfg.server.grpc_port == cfg.server.port != 0:
            self.fail("server.grpc_port", f"must differ from server.port ({cfg.server.port})")
        if cfg.server.api_keys_file is not None:
            if cfg.server.api_key is not None:
                self.fail("server.api_keys_file", "give server.api_key or server.api_keys_file, "
                          "not both")
            from ingress.auth import KeyRing
            try:
                KeyRing.load(cfg.server.api_keys_file)
            except ValueError as e:
                self.fail("server.api_keys_file", str(e))


def model_heads(model: str) -> tuple[int, int] | None:
    """(query heads, KV heads) of `model` (a model.name) from its config alone, no weights
    loaded and no transformers: tiny's built-in config, a `random:` shape, SmolLM2-135M's
    published shape (workers/random_model.py SHAPES), a local folder's config.json; None when the name is not resolvable here (a path that only the
    workers of a remote cluster see). The workers check again (protocol/tp_layout.py)."""
    from kvcache.kv_sizing import read_config
    from workers.model_loader import TINY_CONFIG
    from workers.random_model import PREFIX, SHAPES, is_random
    cfg: dict | None = None
    if model == "tiny":
        cfg = TINY_CONFIG
    elif is_random(model):
        cfg = SHAPES.get(model.removeprefix(PREFIX))
    elif model == "smollm2":      # (converting it first would fetch the wheel)
        cfg = SHAPES["smollm2-135m"]
    elif Path(model).expanduser().is_dir():
        try:
            cfg = read_config(model)
        except ValueError:
            return None           # model.name's own check (and the loader) say what is wrong
    if cfg is None:
        return None
    heads = int(cfg["num_attention_heads"])
    return heads, int(cfg.get("num_key_value_heads") or heads)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _describe(hint: Any, rules: dict) -> str:
    if "choices" in rules:
        return "one of " + ", ".join(rules["choices"])
    if typing.get_origin(hint) is dict:
        return "a mapping"
    base = {int: "an integer", float: "a number", bool: "true or false",
            str: "a non-empty string"}[hint]
    if rules.get("pow2"):
        base = "a power of two"
    bounds = []
    if "min" in rules:
        bounds.append(f">= {rules['min']}")
    if "gt" in rules:
        bounds.append(f"> {rules['gt']}")
    if "max" in rules:
        bounds.append(f"<= {rules['max']}")
    return f"{base} {' and '.join(bounds)}".strip()
