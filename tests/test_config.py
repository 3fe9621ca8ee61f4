"""The YAML config: defaults are configs/local.yaml, every error names its key, command-line
overrides go through the same validation, and the result becomes a valid PDConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.config import ConfigError, RaypdConfig, load_config
from raypd.cli.serve import add_serve_parser, overrides_from_args

LOCAL = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def error(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    return str(e.value)


def test_local_yaml_is_the_defaults():
    assert load_config(LOCAL) == RaypdConfig() == load_config(None)


def test_local_yaml_is_one_laptop():
    cfg = load_config(LOCAL)
    assert cfg.model.name == "smollm2" and cfg.served_model_name == "smollm2"
    assert (cfg.workers.prefill.count, cfg.workers.decode.count) == (1, 1)
    assert cfg.transfer.transport == "shm" and cfg.router.policy == "locality"
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert cfg.ray.address is None


def test_every_section_reaches_the_pd_config(tmp_path):
    cfg = load_config(write(tmp_path, """
model: {name: tiny, dtype: float32, kv_dtype: bfloat16, served_model_name: small, max_model_len: 1024}
engine: {block_size: 32, num_blocks: 100, max_num_batched_tokens: 256, max_num_seqs: 8,
         max_step_ms: 25,
         enable_prefix_caching: false, threads_per_worker: 2, device: cpu, cuda_graphs: false}
workers:
  prefill: {count: 2, resources: {prefill: 1}}
  decode: {count: 3, resources: {decode: 0.5}}
  num_gpus: 0
  max_restarts: 5
transfer: {transport: grpc, lease_s: 5, failure_policy: fail, local_prefill_max_tokens: 64}
router: {policy: locality, policy_options: {work_weight: 2.0}, index_mode: approx,
         slo: {ttft_s: 1.5}, admit_timeout_s: 3, request_timeout_s: 60, max_retries: 4,
         report_interval_s: 0.5, health_timeout_s: 7, hang_timeout_s: 90}
server: {host: 0.0.0.0, port: 9000, grpc_port: 9001, api_key: secret}
ray: {address: auto}
"""))
    pd = cfg.to_pd_config()
    pd.validate()
    assert cfg.served_model_name == "small"
    assert pd.engine == dict(model="tiny", dtype="float32", kv_dtype="bfloat16", block_size=32,
                             num_blocks=100, kv_cache_gb=1.0, kv_tier2_gb=0.0,
                             kv_tier2_dir=None, max_num_batched_tokens=256,
                             max_step_ms=25, max_num_seqs=8, max_model_len=1024, enable_prefix_caching=False,
                             model_impl="auto", lora_adapters={}, max_loras=4,
                             device="cpu", cuda_graphs=False, tp_allreduce="shm")
    assert (pd.num_prefill, pd.num_decode, pd.threads_per_actor) == (2, 3, 2)
    assert pd.prefill_resources == {"prefill": 1.0} and pd.decode_resources == {"decode": 0.5}
    assert (pd.flow.transport, pd.lease_s, pd.flow.failure_policy) == ("grpc", 5.0, "fail")
    flow = pd.flow
    assert flow.local_prefill_max_tokens == 64 and flow.index_mode == "approx"
    assert flow.policy_cfg == {"work_weight": 2.0, "ttft_slo_s": 1.5}
    assert (flow.admit_timeout_s, flow.request_timeout_s) == (3.0, 60.0)
    assert (flow.max_retries, flow.report_interval_s, flow.health_timeout_s,
            flow.hang_timeout_s, pd.max_restarts) == (4, 0.5, 7.0, 90.0, 5)


def test_an_empty_file_is_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == RaypdConfig()
    assert load_config(write(tmp_path, "workers:\n")) == RaypdConfig()


@pytest.mark.parametrize("text,words", [
    ("workers:\n  prefill:\n    count: two\n",
     "workers.prefill.count: must be an integer >= 0, got 'two'"),
    ("workers: {prefill: {count: -1}}", "workers.prefill.count: must be an integer >= 0"),
    ("workers: {decode: {count: 0}}", "workers.decode.count: must be an integer >= 1"),
    ("workers: {prefil: {count: 1}}", "workers.prefil: unknown key"),
    ("router: {polcy: locality}", "did you mean 'policy'?"),
    ("modle: {name: tiny}", "modle: unknown key (valid: model, engine"),
    ("engine: {block_size: 12}", "engine.block_size: must be a power of two >= 1, got 12"),
    ("engine: {kv_cache_gb: 0}", "engine.kv_cache_gb: must be a number > 0, got 0"),
    ("engine: {enable_prefix_caching: 1}", "engine.enable_prefix_caching: must be true or false"),
    ("engine: {max_num_seqs: 2.5}", "engine.max_num_seqs: must be an integer >= 1, got 2.5"),
    ("model: {dtype: fp8}", "model.dtype: must be one of auto, float32, bfloat16, got 'fp8'"),
    ("model: {name: /no/such/dir}", "model.name: must be smollm2 or tiny or a local model"),
    ("model: {name: ''}", "model.name: must be a non-empty string"),
    ("transfer: {transport: tcp}", "transfer.transport: must be one of cuda_ipc, grpc, object_store"),
    ("transfer: {failure_policy: retry}", "transfer.failure_policy: must be one of recompute"),
    ("router: {policy: fastest}", "router.policy: must be one of cache_aware"),
    ("router: {policy: round_robin, slo: {ttft_s: 1}}",
     "router.slo.ttft_s: only the locality policy enforces"),
    ("router: {slo: {ttft_s: -1}}", "router.slo.ttft_s: must be a number > 0 or null"),
    ("router: {policy_options: {speed: 3}}", "router.policy_options: not accepted by policy"),
    ("router: {max_inflight: 0}", "router.max_inflight: must be an integer >= 1"),
    ("workers: {prefill: {resources: {gpu_node: -1}}}",
     "workers.prefill.resources.gpu_node: must be a number >= 0"),
    ("workers: {prefill: {resources: [a]}}", "workers.prefill.resources: must be a mapping"),
    ("server: {port: 70000}", "server.port: must be an integer >= 0 and <= 65535"),
    ("server: {port: 8000, grpc_port: 8000}", "server.grpc_port: must differ from server.port"),
    ("workers: 3", "workers: must be a mapping, got 3"),
    ("- a\n- b\n", "the top level must be a mapping"),
    ("model: {name: tiny\n", "not valid YAML"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, words):
    message = error(tmp_path, text)
    assert message.startswith(str(tmp_path / "x.yaml") + ": "), message
    assert words in message, message


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml")


def test_overrides_are_validated_and_blamed_on_the_command_line(tmp_path):
    path = write(tmp_path, "model: {name: tiny}\nworkers: {decode: {count: 2}}\n")
    cfg = load_config(path, {"workers.prefill.count": 3, "server.port": None})
    assert (cfg.workers.prefill.count, cfg.workers.decode.count) == (3, 2)
    assert cfg.server.port == 8000                       # None: flag not given
    message = error(tmp_path, "model: {name: tiny}", {"workers.decode.count": 0})
    assert message.startswith("command line: workers.decode.count:"), message
    message = error(tmp_path, "model: {name: tiny}", {"transfer.transport": "pigeon"})
    assert message.startswith("command line: transfer.transport:"), message


def test_serve_flags_become_overrides(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "tiny", "--served-model-name", "mini",
                              "--prefill", "0", "--decode", "2", "--transport", "object_store",
                              "--policy", "cache_aware", "--port", "0", "--api-key", "k",
                              "--address", "auto", "--dtype", "float32"])
    cfg = load_config(LOCAL, overrides_from_args(args))
    assert cfg.model.dtype == "float32" and cfg.to_pd_config().engine["dtype"] == "float32"
    assert cfg.served_model_name == "mini" and cfg.model.name == "tiny"
    assert (cfg.workers.prefill.count, cfg.workers.decode.count) == (0, 2)
    assert (cfg.transfer.transport, cfg.router.policy) == ("object_store", "cache_aware")
    assert (cfg.server.port, cfg.server.api_key, cfg.ray.address) == (0, "k", "auto")
    assert args.func.__name__ == "cmd_serve"
    bare = load_config(LOCAL, overrides_from_args(parser.parse_args(["serve"])))
    assert bare == RaypdConfig()


def test_lora_adapters_are_validated_at_start_naming_key_and_file(tmp_path):
    from workers.lora import write_random_adapter
    from workers.model_loader import base_config
    good = write_random_adapter(tmp_path / "good", base_config("tiny"), rank=4)
    cfg = load_config(None, {"model.name": "tiny", "model.lora_adapters": {"a": str(good)}})
    assert cfg.to_pd_config().engine["lora_adapters"] == {"a": str(good)}
    with pytest.raises(ConfigError, match=r"model.lora_adapters.b: .*missing.*not a directory"):
        load_config(None, {"model.name": "tiny",
                           "model.lora_adapters": {"b": str(tmp_path / "missing")}})


def test_a_transport_option_the_transport_does_not_take_is_refused_at_load_naming_it(tmp_path):
    """transfer.options go to the transport's constructor in every worker actor: a key it does
    not take is a config error naming the key and the options it does take (not a TypeError
    in each worker); the keys it takes pass."""
    cfg = load_config(None, {"transfer.transport": "cuda_ipc",
                             "transfer.options": {"staging_pool_mib": 0, "checksum": True}})
    assert cfg.to_pd_config().transport_cfg == {"staging_pool_mib": 0, "checksum": True}
    path = tmp_path / "c.yaml"
    path.write_text("transfer:\n  transport: shm\n  options: {staging_pool_mib: 64}\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*transfer.options: 'staging_pool_mib' not "
                       r"taken by transport 'shm'; it takes: checksum, .*pool_bytes"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="'worker_id' not taken"):   # the worker sets it
        load_config(None, {"transfer.options": {"worker_id": "x"}})


# ---- every default stated once -------------------------------------------------------------
def _section_fields(cls: type, prefix: str = ""):
    """(dotted key, dataclass field) of every config key, sections recursed into."""
    import typing
    from dataclasses import fields, is_dataclass
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            yield from _section_fields(hints[f.name], key + ".")
        else:
            yield key, f


# the keys whose default is a serving dataclass's (its field there)
SERVING_KEYS = {
    **{f"model.{k}": ("EngineConfig", v) for k, v in (
        ("name", "model"), ("dtype", "dtype"), ("kv_dtype", "kv_dtype"),
        ("max_model_len", "max_model_len"), ("lora_adapters", "lora_adapters"))},
    **{f"engine.{k}": ("EngineConfig", k) for k in (
        "block_size", "kv_cache_gb", "num_blocks", "kv_tier2_gb", "kv_tier2_dir",
        "max_num_batched_tokens", "max_step_ms", "max_num_seqs", "enable_prefix_caching",
        "model_impl", "max_loras", "device", "cuda_graphs", "tp_allreduce")},
    "engine.threads_per_worker": ("PDConfig", "threads_per_actor"),
    "engine.share_idle_threads": ("PDConfig", "share_idle_threads"),
    "workers.prefill.count": ("PDConfig", "num_prefill"),
    "workers.prefill.resources": ("PDConfig", "prefill_resources"),
    "workers.decode.count": ("PDConfig", "num_decode"),
    "workers.decode.resources": ("PDConfig", "decode_resources"),
    "workers.prefill.tp": ("PDConfig", "prefill_tp"),
    "workers.decode.tp": ("PDConfig", "decode_tp"),
    "workers.num_gpus": ("PDConfig", "num_gpus_per_worker"),
    "workers.max_restarts": ("PDConfig", "max_restarts"),
    "transfer.options": ("PDConfig", "transport_cfg"),
    "transfer.lease_s": ("PDConfig", "lease_s"),
    **{f"transfer.{k}": ("FlowConfig", k) for k in (
        "transport", "failure_policy", "local_prefill_max_tokens",
        "local_prefill_when_backlogged")},
    **{f"router.{k}": ("FlowConfig", k) for k in (
        "policy", "index_mode", "admit_timeout_s", "request_timeout_s", "max_retries",
        "report_interval_s", "health_timeout_s", "hang_timeout_s", "migrate_on_kv_pressure")},
    "router.max_inflight": ("IngressSettings", "max_inflight"),
    "server.protect_metrics": ("IngressSettings", "protect_metrics"),
}


def test_every_key_with_a_serving_counterpart_reads_its_default_from_there():
    """A key the serving side also has is declared `_from(ServingClass, "field")`: its default
    is that field's own object (or default factory), not a second literal that could drift."""
    from dataclasses import MISSING

    from cluster.config import SERVING, default_of
    sourced = {key: f for key, f in _section_fields(RaypdConfig) if SERVING in f.metadata}
    assert {k: (c.__name__, n) for k, (c, n) in
            ((k, f.metadata[SERVING]) for k, f in sourced.items())} == SERVING_KEYS
    for key, f in sourced.items():
        cls, name = f.metadata[SERVING]
        theirs = cls.__dataclass_fields__[name]
        if theirs.default_factory is not MISSING:
            assert f.default_factory is theirs.default_factory, key
        else:
            assert f.default is theirs.default, key
        assert _get(RaypdConfig(), key) == default_of(cls, name), key


def _get(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_default_config_is_the_serving_defaults():
    """Behaviourally: the defaults' PDConfig is PDConfig(), its flow FlowConfig(), its engine
    EngineConfig()'s fields, its ingress IngressSettings()'s: whatever a key's declaration, a
    default that drifts from the serving side's fails here."""
    from dataclasses import asdict, replace

    from cluster.pd_config import PDConfig
    from ingress.core import IngressSettings
    from router.flow_config import FlowConfig
    from workers.engine_config import EngineConfig
    cfg = RaypdConfig()
    pd = cfg.to_pd_config()
    engine = asdict(EngineConfig())
    assert pd.engine == {k: engine[k] for k in pd.engine}
    # not config keys; tp: each role's (workers.*.tp), set at launch (cluster/pd.py)
    assert set(engine) - set(pd.engine) == {"num_threads", "seed", "tp"}
    assert pd.flow.policy_cfg == {}                     # router.policy_options (YAML-only)
    assert replace(pd.flow, policy_cfg=None) == FlowConfig()
    assert replace(pd, engine={}, flow=FlowConfig()) == PDConfig()
    ingress = IngressSettings()
    assert (cfg.router.max_inflight, cfg.server.protect_metrics, cfg.server.limits,
            cfg.server.request_limits) == (ingress.max_inflight, ingress.protect_metrics,
                                           ingress.limits, ingress.request_limits)


def test_the_two_old_disagreements_are_serves_values():
    from router.flow_config import FlowConfig
    assert FlowConfig().transport == "shm" == RaypdConfig().transfer.transport
    assert FlowConfig().local_prefill_when_backlogged is True
    assert RaypdConfig().transfer.local_prefill_when_backlogged is True


def test_local_yaml_states_every_key():
    """configs/local.yaml is the defaults (above) and lists every key, so it documents them."""
    import yaml
    opaque = {"options", "policy_options", "lora_adapters", "resources"}   # free-form maps

    def keys(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in opaque:
                out |= keys(v, f"{prefix}{k}.")
        return out
    assert keys(yaml.safe_load(LOCAL.read_text())) == keys(RaypdConfig().to_dict())


def test_one_dtype_list_and_one_model_list():
    from raypd.cli import build_parser
    from workers.device import DTYPES as TORCH_DTYPES
    from workers.engine_config import DTYPES, KV_DTYPES, QUANTIZED_KV_DTYPES, WEIGHT_DTYPES
    from workers.kv_quant import QUANT_FORMATS
    assert tuple(TORCH_DTYPES) == WEIGHT_DTYPES and DTYPES == ("auto", *WEIGHT_DTYPES)
    assert tuple(QUANT_FORMATS) == QUANTIZED_KV_DTYPES
    assert KV_DTYPES == (*DTYPES, *QUANTIZED_KV_DTYPES)
    from cluster.config import EngineSection, ModelSection  # noqa: F401
    assert ModelSection.__dataclass_fields__["dtype"].metadata["choices"] is DTYPES
    assert ModelSection.__dataclass_fields__["kv_dtype"].metadata["choices"] is KV_DTYPES
    parser = build_parser()
    for argv in (["serve"], ["generate"], ["bench", "engine"]):
        sub = parser
        for word in argv:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)
                       ).choices[word]
        by_dest = {a.dest: a for a in sub._actions}
        assert tuple(by_dest["dtype"].choices) == DTYPES, argv
        if "kv_dtype" in by_dest:
            assert tuple(by_dest["kv_dtype"].choices) == KV_DTYPES, argv
    import cluster.config as config_module
    assert not hasattr(config_module, "BUILTIN_MODELS")   # workers/model_loader.py's only


def test_the_config_loader_imports_neither_torch_nor_ray():
    import subprocess
    import sys
    code = ("import sys, cluster.config, raypd.cli.common; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=LOCAL.parents[1], text=True,
                         capture_output=True, check=True).stdout
    assert out.strip() == "[]"


# ---- generate and the benches read serve's chain ---------------------------------------------
def _parse(*argv: str) -> argparse.Namespace:
    from raypd.cli import build_parser
    return build_parser().parse_args(list(argv))


def test_generate_reads_the_config_file_then_the_flags(tmp_path):
    from raypd.cli.common import config_from_args, engine_config_from_args
    path = write(tmp_path, "model: {name: tiny, dtype: float32}\n"
                 "engine: {block_size: 32, num_blocks: 99, max_num_seqs: 8}\n")
    args = _parse("generate", "--prompt", "x", "--config", str(path), "--max-num-seqs", "4",
                  "--no-prefix-caching", "--kv-dtype", "int8")
    ec = engine_config_from_args(args)
    assert (ec.model, ec.dtype, ec.block_size, ec.num_blocks) == ("tiny", "float32", 32, 99)
    assert (ec.max_num_seqs, ec.enable_prefix_caching, ec.kv_dtype) == (4, False, "int8")
    assert ec.num_threads is None                       # --threads not given: torch's own
    bare = engine_config_from_args(_parse("generate", "--prompt", "x"))
    from workers.engine_config import EngineConfig
    assert bare == EngineConfig()                       # no file, no flags: the defaults
    disagg = config_from_args(_parse("generate", "--prompt", "x", "--disagg", "--prefill", "2",
                                     "--decode", "3", "--model", "tiny", "--threads", "2"),
                              {"workers.prefill.count": 2, "workers.decode.count": 3})
    pd = disagg.to_pd_config()
    assert (pd.num_prefill, pd.num_decode, pd.threads_per_actor) == (2, 3, 2)
    assert pd.flow.transport == "shm"                   # serve's, no longer object_store


def test_a_bad_generate_flag_is_a_config_error_naming_the_key():
    from raypd.cli.common import config_from_args
    with pytest.raises(ConfigError, match="command line: engine.block_size: must be a power"):
        config_from_args(_parse("generate", "--prompt", "x", "--block-size", "12"))


@pytest.mark.parametrize("argv", [
    ["generate"], ["generate", "--model", "tiny", "--transport", "grpc", "--decode", "2"],
    ["bench", "engine", "--model", "tiny"], ["bench", "chaos"], ["bench", "autoscale"],
    ["bench", "disagg"], ["bench", "transfer"], ["serve", "--port", "0"],
])
def test_print_config_prints_the_resolved_config_and_exits_0(argv, capsys, tmp_path):
    import yaml

    from raypd.cli import main
    path = write(tmp_path, "engine: {max_num_seqs: 7}\n")
    assert main([*argv, "--config", str(path), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    again = load_config(write(tmp_path, yaml.safe_dump(printed)))
    assert again.to_dict() == printed and again.engine.max_num_seqs == 7
    if "--model" in argv:
        assert again.model.name == "tiny"
    if "grpc" in argv:
        assert (again.transfer.transport, again.workers.decode.count) == ("grpc", 2)
