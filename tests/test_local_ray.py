"""The local Ray that `raypd serve` / `raypd run` start (cluster/serve.py's connect_ray) keeps
no idle worker processes: Ray prestarts one per CPU for tasks raypd never sends, and on a small
machine their CPU slices stall the engine's threads. Checked in a fresh process (the suite's
shared Ray is started elsewhere), on the raylet's own children."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts a Ray of its own (~8 s)

SCRIPT = r"""
import time
import psutil
import ray
from cluster.config import RaySection
from cluster.serve import connect_ray

assert connect_ray(RaySection(num_cpus=2))
raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid

@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return "pong"

probe = Probe.remote()
assert ray.get(probe.ping.remote(), timeout=60) == "pong"

def idle_workers():
    out = 0
    for p in psutil.Process(raylet).children():
        try:
            out += "ray::IDLE" in " ".join(p.cmdline())
        except psutil.Error:
            pass
    return out

# Ray prestarts its idle workers when the driver registers; wait until they were seen and are
# gone (or, never seen, until well after they would have started), else report what is left
start, seen, left = time.monotonic(), False, None
while time.monotonic() - start < 20:
    left = idle_workers()
    seen = seen or left > 0
    if left == 0 and (seen or time.monotonic() - start > 5):
        break
    time.sleep(0.2)
assert ray.get(probe.ping.remote(), timeout=60) == "pong"   # the actor's own process stays
print("IDLE_WORKERS", left)
ray.shutdown()
"""


def test_local_ray_keeps_no_idle_worker_processes():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "IDLE_WORKERS 0" in run.stdout, run.stdout[-500:] + run.stderr[-1000:]
