"""The cluster launcher configs pass Ray's own checks (the schema shipped inside Ray) and
dedicate nodes to roles through custom resources."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest
import yaml
from conftest import ROOT
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

LOCAL = ROOT / "configs" / "cluster-local.yaml"
AWS = ROOT / "configs" / "cluster-aws-gpu.yaml"
PLACEHOLDERS = {"<HEAD_IP>": "10.0.0.1", "<PREFILL_IP_1>": "10.0.0.2",
                "<DECODE_IP_1>": "10.0.0.3", "<SSH_USER>": "ubuntu"}


def load(path, fill: bool = False) -> dict:
    text = path.read_text()
    if fill:
        for k, v in PLACEHOLDERS.items():
            text = text.replace(k, v)
    return yaml.safe_load(text)


def commands(cfg: dict, key: str) -> str:
    return "\n".join(cfg.get(key, []))


@pytest.mark.parametrize("path", [LOCAL, AWS], ids=["local", "aws-gpu"])
def test_config_passes_rays_validation(path):
    """What `ray up` runs before it contacts a node: defaults merged, then Ray's schema."""
    cfg = prepare_config(load(path))
    validate_config(cfg)
    assert cfg["max_workers"] >= 2


def test_local_config_bootstraps_like_ray_up():
    """The local provider's whole bootstrap (no node contacted), with placeholders filled."""
    cfg = _bootstrap_config(load(LOCAL, fill=True), no_config_cache=True)
    assert cfg["provider"]["worker_ips"] == ["10.0.0.2", "10.0.0.3"]
    node_type = cfg["available_node_types"][cfg["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == 2


def test_validation_is_not_vacuous():
    bad = load(AWS)
    bad["available_node_types"]["prefill_gpu"]["min_worker"] = 1   # typo
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


@pytest.mark.parametrize("path", [LOCAL, AWS], ids=["local", "aws-gpu"])
def test_every_node_installs_raypd_and_the_head_starts_the_router(path):
    cfg = load(path)
    assert cfg["file_mounts"] == {"~/raypd": "."}
    assert "scripts/setup.sh" in commands(cfg, "setup_commands")
    head = commands(cfg, "head_start_ray_commands")
    assert "ray start --head" in head and "--metrics-export-port=8080" in head
    assert "raypd serve --address auto" in head and "--config configs/cluster-serve" in head
    assert "--metrics-export-port=8080" in commands(cfg, "worker_start_ray_commands")
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        subprocess.run(["bash", "-n"], input=commands(load(path, fill=True), key), text=True,
                       check=True)


def test_aws_node_types_dedicate_gpus_to_roles():
    cfg = load(AWS)
    types = cfg["available_node_types"]
    assert types["prefill_gpu"]["resources"] == {"GPU": 1, "prefill": 1}
    assert types["decode_gpu"]["resources"] == {"GPU": 1, "decode": 1}
    assert not {"GPU", "prefill", "decode"} & set(types[cfg["head_node_type"]]["resources"])
    assert all(t["node_config"]["InstanceType"].startswith(("g5", "g6", "p4", "p5"))
               for name, t in types.items() if name != cfg["head_node_type"])


@pytest.mark.parametrize("ip,role", [("10.0.0.2", "prefill"), ("10.0.0.3", "decode")])
def test_local_worker_advertises_its_role(ip, role, tmp_path):
    """Run the worker start command with `ray` stubbed out: the listed IP becomes prefill."""
    (tmp_path / "ray").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "ray").chmod(0o755)
    (tmp_path / "hostname").write_text(f'#!/bin/sh\necho "{ip} fe80::1"\n')
    (tmp_path / "hostname").chmod(0o755)
    script = commands(load(LOCAL, fill=True), "worker_start_ray_commands")
    script = script.replace("~/raypd/.venv/bin/ray", str(tmp_path / "ray"))
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1"})
    start = out.stdout.strip().splitlines()[-1]
    assert start.startswith("start --address=10.0.0.1:6379")
    assert json.loads(start.split("--resources=", 1)[1]) == {role: 1}


def test_local_head_advertises_only_the_router():
    head = commands(load(LOCAL), "head_start_ray_commands")
    assert "--resources='{\"router\": 1}'" in head
    assert "prefill" not in head and "decode" not in head


def test_placeholders_are_the_documented_ones():
    text = LOCAL.read_text()
    cfg = load(LOCAL, fill=True)
    assert all(k in text for k in PLACEHOLDERS)
    assert "<" not in json.dumps(cfg["provider"]) and "<" not in json.dumps(cfg["auth"])


@pytest.mark.parametrize("path", [LOCAL, AWS], ids=["local", "aws-gpu"])
def test_the_routers_serve_config_places_roles_on_their_resources(path):
    """The head's `raypd serve --config X`: X puts prefill on `prefill` and decode on `decode`
    nodes, and moves pages with a transport that crosses nodes."""
    serve = re.search(r"--config (\S+)", commands(load(path), "head_start_ray_commands"))[1]
    if not (ROOT / serve).exists():
        pytest.skip(f"{serve} is not in the repository yet")
    from cluster.config import load_config
    pd = load_config(ROOT / serve, {"ray.address": "auto"}).to_pd_config()
    assert pd.prefill_resources == {"prefill": 1} and pd.decode_resources == {"decode": 1}
    assert pd.flow.transport != "shm"
    assert (pd.num_gpus_per_worker > 0) == (path == AWS)
