"""`ray up` for real on this machine (scripts/cluster-smoke.sh): a throwaway user and sshd on
127.0.0.1, configs/cluster-local.yaml rendered for a one-node cluster, the router on the head,
`raypd status`, 20 requests of the shared trace, Prometheus through Ray's service discovery,
`ray down`, nothing left running. Marked `cluster` (about 90 s); .ci/run runs it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ROOT, shared_dir

ARTIFACTS = os.environ.get("RAYPD_TEST_ARTIFACTS", str(ROOT / "out" / "test-artifacts"))


@pytest.mark.e2e
@pytest.mark.cluster
def test_ray_up_serves_the_shared_trace_and_ray_down_leaves_nothing():
    if os.geteuid() != 0:
        pytest.skip("the ray up smoke run needs root (it adds a throwaway user and an sshd)")
    trace = shared_dir() / "traces" / "mooncake_synthetic_trace.jsonl"
    if not trace.exists():
        pytest.skip(f"no shared trace at {trace}")
    out_dir = os.path.join(ARTIFACTS, "cluster-smoke")
    env = dict(os.environ, RAYPD_SMOKE_OUT=out_dir, RAYPD_SHARED_DIR=str(shared_dir()))
    env.pop("RAY_ADDRESS", None)                # the launcher's own commands pick their Ray
    run = subprocess.run(["bash", str(ROOT / "scripts" / "cluster-smoke.sh")], env=env,
                         capture_output=True, text=True, timeout=900)
    last = (run.stdout.strip().splitlines() or [""])[-1]
    if run.returncode == 77:
        pytest.skip(last.removeprefix("cluster-smoke: "))
    assert run.returncode == 0, run.stderr[-4000:]
    assert last.startswith("cluster-smoke: ok nodes=1 requests_ok=20/20 seconds="), last
    timings = json.loads(open(os.path.join(out_dir, "timings.json")).read())
    assert timings["requests_ok"] == timings["requests"] == 20
    checks = json.loads(open(os.path.join(out_dir, "prometheus-check.json")).read())
    assert {c["role"] for c in checks if c["ok"]} == {"prefill", "decode", "router"}
    timeline = open(os.path.join(out_dir, "trace-request.log")).read()
    assert "prefill-0 -> decode-0" in timeline and "transfer" in timeline


def test_the_smoke_config_is_the_template_rendered_for_one_loopback_node():
    """What the smoke run hands `ray up`: Ray's own validation passes, head 127.0.0.1 with no
    other node, every port the script picked, and the head advertising all three roles."""
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    from scripts.cluster_smoke_config import SmokePorts, SmokeTarget, render
    ports = SmokePorts(*range(20001, 20013))
    target = SmokeTarget("raypd-smoke-1", "rpsmoke1", "/tmp/k", "python3 p.py 127.0.0.1 2222",
                         str(ROOT))
    cfg = render(yaml.safe_load((ROOT / "configs" / "cluster-local.yaml").read_text()),
                 ports, target)
    validate_config(prepare_config(json.loads(json.dumps(cfg))))
    assert cfg["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    assert cfg["auth"]["ssh_proxy_command"].endswith("127.0.0.1 2222")
    head = "\n".join(cfg["head_start_ray_commands"])
    for flag in (f"--port={ports.gcs}", f"--metrics-export-port={ports.metrics}",
                 f"--dashboard-port={ports.dashboard}", "--dashboard-host=127.0.0.1",
                 f"--port {ports.router} --model tiny", "--host 127.0.0.1"):
        assert flag in head, flag
    assert "0.0.0.0" not in head and "6379" not in head and "8080" not in head
    assert """--resources='{"router": 1, "prefill": 1, "decode": 1}'""" in head


def test_rendering_fails_when_the_template_changes_shape():
    import yaml

    from scripts.cluster_smoke_config import SmokePorts, SmokeTarget, render
    cfg = yaml.safe_load((ROOT / "configs" / "cluster-local.yaml").read_text())
    cfg["head_start_ray_commands"] = [c.replace("--port=6379", "--port=7000")
                                      for c in cfg["head_start_ray_commands"]]
    with pytest.raises(ValueError, match="--port=6379"):
        render(cfg, SmokePorts(*range(20001, 20013)),
               SmokeTarget("c", "u", "/k", "p", str(ROOT)))
