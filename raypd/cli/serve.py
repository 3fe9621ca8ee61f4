"""`raypd serve`: flags (each a dotted config key over the YAML config) and handler; serving
itself is cluster/serve.py's."""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

from raypd.cli.common import (
    add_config_args,
    add_device_args,
    add_lora_arg,
    lora_adapters_from_args,
    print_config,
)
from workers.engine_config import DTYPES, KV_DTYPES

API_KEY_ENV = "RAYPD_API_KEY"


def register(sub) -> None:
    add_serve_parser(sub)


def _module_doc(name: str) -> str | None:
    """A module's docstring read from its source, without importing it (cluster.serve imports
    Ray and the HTTP stack, which `raypd generate` and `raypd bench engine` must not need)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text()), clean=False)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over OpenAI-compatible HTTP",
                              description=_module_doc("cluster.serve"),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--model", help="model.name: smollm2, tiny or a local HF folder")
    p.add_argument("--dtype", choices=DTYPES,
                   help="model.dtype: the weights' dtype (auto: bfloat16 where the hardware "
                   "multiplies it natively, as AVX512-BF16/AMX CPUs and GPUs from Ampere on "
                   "do; float32 on other CPUs; else the checkpoint's own)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="model.kv_dtype (a quantized dtype "
                   "must have passed its recorded kv-quality gate)")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    add_lora_arg(p)
    p.add_argument("--address", help="ray.address: auto or host:port joins a running cluster "
                   "(default: start a local Ray)")
    p.add_argument("--host", help="server.host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="server.port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="server.grpc_port: also serve gRPC")
    p.add_argument("--api-key", help=f"one key with every scope: 'Authorization: Bearer KEY' "
                   f"(default: server.api_key, else ${API_KEY_ENV})")
    p.add_argument("--api-keys-file", metavar="FILE",
                   help="server.api_keys_file: keys with tenants and scopes (ingress/auth.py)")
    p.add_argument("--prefill", type=int, metavar="N", help="workers.prefill.count")
    p.add_argument("--decode", type=int, metavar="M", help="workers.decode.count")
    p.add_argument("--transport", help="transfer.transport")
    p.add_argument("--policy", help="router.policy")
    p.add_argument("--max-inflight", type=int, help="router.max_inflight (then 429)")
    p.add_argument("--autoscale", action="store_true",
                   help="router.autoscale.enabled: size the prefill and decode pools from the "
                        "SLOs and the load (bounds, SLOs, cooldowns: router.autoscale.*); a "
                        "pool shrinks by draining a worker, its running decodes move away")
    add_device_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """Command-line flags as dotted config keys (None: not given)."""
    g = lambda name: getattr(args, name, None)  # noqa: E731
    return {"model.name": g("model"), "model.dtype": g("dtype"),
            "model.kv_dtype": g("kv_dtype"),
            "model.served_model_name": g("served_model_name"),
            "ray.address": g("address"), "server.host": g("host"), "server.port": g("port"),
            "server.grpc_port": g("grpc_port"), "server.api_key": g("api_key"),
            "server.api_keys_file": g("api_keys_file"),
            "workers.prefill.count": g("prefill"), "workers.decode.count": g("decode"),
            "transfer.transport": g("transport"), "router.policy": g("policy"),
            "router.max_inflight": g("max_inflight"),
            "router.autoscale.enabled": True if g("autoscale") else None,
            "model.lora_adapters": lora_adapters_from_args(args),
            "engine.device": g("device"),
            "engine.cuda_graphs": False if g("no_cuda_graphs") else None}


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    cfg = load_config(args.config, overrides_from_args(args))
    if print_config(cfg, args):
        return 0
    from cluster.serve import serve_forever
    return serve_forever(cfg, args.log_level)
