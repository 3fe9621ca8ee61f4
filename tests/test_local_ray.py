"""The local Ray that `raypd serve` / `raypd run` start (cluster/serve.py's connect_ray) keeps
no idle worker processes: Ray prestarts one per CPU for tasks raypd never sends, and a worker
that ran a task stays on idle; on a small machine their CPU slices stall the engine's threads.
Checked in a fresh process (the suite's shared Ray is started elsewhere), on the raylet's own
children. The check must first see idle workers (Ray's prestarted ones, or the one a task
leaves): a probe that cannot see them would read "none" whatever Ray keeps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration   # starts a Ray of its own (~8 s)

SCRIPT = r"""
import json
import os
import time
import psutil
import ray
from cluster.config import RaySection
from cluster.serve import connect_ray

assert connect_ray(RaySection(num_cpus=2))
raylet = psutil.Process(ray._private.worker._global_node.all_processes["raylet"][0].process.pid)

def idle_workers():
    out = set()
    for p in raylet.children():
        try:
            if "ray::IDLE" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out

seen = idle_workers()            # Ray prestarts idle workers as the driver registers

@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return "pong"

@ray.remote(num_cpus=0)
def worker_pid():
    return os.getpid()

probe = Probe.remote()
assert ray.get(probe.ping.remote(), timeout=60) == "pong"
task_worker = ray.get(worker_pid.remote(), timeout=60)   # its process goes idle now

# watch until idle workers were seen and none has been left for HOLD_S, or the deadline
HOLD_S, DEADLINE_S = 1.0, 20.0
start, zero_since, left = time.monotonic(), None, None
while time.monotonic() - start < DEADLINE_S:
    now_idle = idle_workers()
    seen |= now_idle
    left = len(now_idle)
    zero_since = (zero_since or time.monotonic()) if left == 0 else None
    if seen and zero_since is not None and time.monotonic() - zero_since >= HOLD_S:
        break
    time.sleep(0.02)
print("RESULT", json.dumps({
    "idle_seen": len(seen), "idle_left": left,
    "task_worker_seen_idle": task_worker in seen,
    "task_worker_alive": psutil.pid_exists(task_worker),
    "actor_alive": ray.get(probe.ping.remote(), timeout=60) == "pong",
    "watched_s": round(time.monotonic() - start, 2)}))
ray.shutdown()
"""


def test_local_ray_keeps_no_idle_worker_processes():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-500:] + run.stderr[-1000:]
    got = json.loads(line.removeprefix("RESULT "))
    # the probe saw idle workers (else it proves nothing), and none is left of them
    assert got["idle_seen"] > 0, f"no ray::IDLE process was ever seen: {got}"
    assert got["idle_left"] == 0, f"idle worker processes stay: {got}"
    assert not got["task_worker_alive"], f"the worker that ran a task stays idle: {got}"
    assert got["actor_alive"], got        # the actor's own process stays
