"""Render configs/cluster-local.yaml for a one-node `ray up` on this machine (the cluster smoke
run, scripts/cluster-smoke.sh): head 127.0.0.1, every port one the script picked, roles by
custom resources on that one node, the router on the tiny model.

    python scripts/cluster_smoke_config.py --template configs/cluster-local.yaml --out cluster.yaml \
        --user U --key KEY --proxy-command "PY PROXY 127.0.0.1 2222" --ports '{"gcs": 6380, ...}'

Every edit is a replacement of a text the template must contain: when the template changes
shape, rendering fails naming the text it missed, instead of launching something else.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

# Ray's ports on the head, each set explicitly so that nothing collides with another Ray on the
# same machine (`ray start` flag -> SmokePorts field).
RAY_PORT_FLAGS = {
    "--ray-client-server-port": "client",
    "--dashboard-port": "dashboard",
    "--dashboard-agent-listen-port": "agent_http",
    "--dashboard-agent-grpc-port": "agent_grpc",
    "--node-manager-port": "node_manager",
    "--object-manager-port": "object_manager",
    "--runtime-env-agent-port": "runtime_env",
}


@dataclass(frozen=True)
class SmokePorts:
    """Free loopback ports the smoke script picked (one each)."""
    gcs: int
    metrics: int
    router: int
    client: int
    dashboard: int
    agent_http: int
    agent_grpc: int
    node_manager: int
    object_manager: int
    runtime_env: int
    min_worker: int
    max_worker: int

    def __post_init__(self) -> None:
        assert self.min_worker < self.max_worker, "worker port range is empty"


@dataclass(frozen=True)
class SmokeTarget:
    """Who and where: the throwaway ssh user, its key and how ssh reaches the loopback sshd."""
    cluster_name: str
    ssh_user: str
    ssh_private_key: str
    ssh_proxy_command: str
    repo_root: str
    model: str = "tiny"
    num_cpus: int = 4
    object_store_bytes: int = 512 * 1024 * 1024


def _replace(text: str, old: str, new: str) -> str:
    if old not in text:
        raise ValueError(f"cluster template: expected {old!r} in a start command")
    return text.replace(old, new)


def _head_commands(commands: list[str], ports: SmokePorts, target: SmokeTarget) -> list[str]:
    out = []
    for cmd in commands:
        if "ray start --head" in cmd:
            cmd = _replace(cmd, "--port=6379", f"--port={ports.gcs}")
            cmd = _replace(cmd, "--metrics-export-port=8080", f"--metrics-export-port={ports.metrics}")
            cmd = _replace(cmd, "--dashboard-host=0.0.0.0", "--dashboard-host=127.0.0.1")
            cmd = _replace(cmd, "--resources='{\"router\": 1}'",
                           "--resources='{\"router\": 1, \"prefill\": 1, \"decode\": 1}'")
            extra = [f"{flag}={getattr(ports, field)}" for flag, field in RAY_PORT_FLAGS.items()]
            extra += [f"--min-worker-port={ports.min_worker}",
                      f"--max-worker-port={ports.max_worker}",
                      "--node-ip-address=127.0.0.1", f"--num-cpus={target.num_cpus}",
                      f"--object-store-memory={target.object_store_bytes}"]
            cmd = cmd + " " + " ".join(extra)
        elif "raypd serve" in cmd:
            cmd = _replace(cmd, "--host 0.0.0.0 --port 8000",
                           f"--host 127.0.0.1 --port {ports.router} --model {target.model}")
        out.append(cmd)
    if not any("ray start --head" in c for c in out) or not any("raypd serve" in c for c in out):
        raise ValueError("cluster template: head_start_ray_commands lost `ray start --head` "
                         "or `raypd serve`")
    return out


def render(template: dict, ports: SmokePorts, target: SmokeTarget) -> dict:
    """The launcher config for `ray up`: the template with the placeholders filled for a head
    at 127.0.0.1 and no other node (the head advertises router, prefill and decode)."""
    cfg = json.loads(json.dumps(template))       # deep copy of plain YAML data
    cfg["cluster_name"] = target.cluster_name
    cfg["provider"]["head_ip"] = "127.0.0.1"
    cfg["provider"]["worker_ips"] = []
    cfg["auth"] = {"ssh_user": target.ssh_user, "ssh_private_key": target.ssh_private_key,
                   "ssh_proxy_command": target.ssh_proxy_command}
    mounts = cfg["file_mounts"]
    assert list(mounts.values()) == ["."], "the template mounts the repository as '.'"
    cfg["file_mounts"] = {dest: target.repo_root for dest in mounts}
    cfg["head_start_ray_commands"] = _head_commands(cfg["head_start_ray_commands"], ports, target)
    text = json.dumps(cfg)
    assert "<" not in json.dumps(cfg["provider"]) and "<SSH_USER>" not in text, \
        "a placeholder survived rendering"
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/cluster_smoke_config.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--template", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cluster-name", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--proxy-command", required=True)
    p.add_argument("--repo-root", required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--ports", required=True, help="JSON object of SmokePorts fields")
    args = p.parse_args(argv)
    try:
        ports = SmokePorts(**json.loads(args.ports))
        target = SmokeTarget(cluster_name=args.cluster_name, ssh_user=args.user,
                             ssh_private_key=args.key, ssh_proxy_command=args.proxy_command,
                             repo_root=args.repo_root, model=args.model)
        cfg = render(yaml.safe_load(args.template.read_text()), ports, target)
    except (ValueError, TypeError, KeyError) as e:
        print(f"error: {args.template}: {e}", file=sys.stderr)
        return 2
    args.out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
