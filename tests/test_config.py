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
                             device="cpu", cuda_graphs=False)
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
