"""CPU-seconds and OS threads of each process of a server under test (raypd/bench/proc_stats.py
reads /proc), for scripts/bench-vs-vllm.sh.

  python scripts/bench_vs_vllm_cpu.py snapshot LEADER_PID OUT.json
      every process of the server (its session and descendants) with its CPU ticks and threads
  python scripts/bench_vs_vllm_cpu.py threads LEADER_PID OUT.json STOP_FILE
      samples the server's processes' thread counts every SAMPLE_EVERY_S until STOP_FILE
      exists (the script starts it beside a run's client), then writes each one's peak
  python scripts/bench_vs_vllm_cpu.py threads-summary WORK OUT.json
      adds to OUT.json (bench_vs_vllm.py's summary) `serve_threads_under_load` and
      `threads_under_load` from the scored runs' peaks (see `threads_summary`)

A server starts under `setsid`, so its first process (LEADER_PID) leads a session that every
process it starts inherits (Ray's raylet, GCS and worker actors, vLLM's engine core). The leader
is named by the server's kind (`LEADER_ROLE`: `serve` for raypd, `api_server` for vLLM, `server`
for llama.cpp), every other process by proc_stats.process_label.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from raypd.bench import proc_stats
from raypd.bench.proc_stats import snapshot

__all__ = ["CpuTally", "LEADER_ROLE", "process_label", "read_client_seconds",
           "run_cpu_seconds", "snapshot", "threads_summary"]

LEADER_ROLE = {"vllm": "api_server", "raypd": "serve", "llamacpp": "server"}
SAMPLE_EVERY_S = 1.0
VLLM_BLOCKS = ("vllm1", "vllm2")      # vLLM's two scored blocks: one server in the summary


def process_label(cmd: str, is_leader: bool, server: str) -> str:
    """What a process of a `server` kind (vllm, raypd, llamacpp) is, from its cmdline."""
    return proc_stats.process_label(cmd, LEADER_ROLE[server] if is_leader else None)


def run_cpu_seconds(before: dict, after: dict, server: str) -> tuple[dict[str, float], list[str]]:
    """CPU-seconds of each process of a `server` kind over a run, and the labels of those that
    exited during it (proc_stats.cpu_seconds)."""
    return proc_stats.cpu_seconds(before, after, LEADER_ROLE[server])


def read_client_seconds(text: str) -> float | None:
    """bash's `time` with TIMEFORMAT='%3U %3S': user and system seconds of the client and every
    process it waited for; None where the file is empty or not that."""
    try:
        user, system = (float(x) for x in text.split())
    except ValueError:
        return None
    return user + system


@dataclass
class CpuTally:
    """CPU-seconds per process over a server's runs, and the output tokens of the same runs."""
    seconds: dict[str, float]
    client_s: float
    output_tokens: int
    runs_read: int = 0
    runs_unread: int = 0        # no snapshot, no client time or no output-token count
    exited: int = 0             # processes gone during a run (their share is missing)

    @classmethod
    def empty(cls) -> CpuTally:
        return cls(seconds={}, client_s=0.0, output_tokens=0)

    def add(self, cpu: dict[str, float] | None, client_s: float | None,
            output_tokens: int | None, exited: int = 0) -> None:
        if cpu is None or client_s is None or not output_tokens:
            self.runs_unread += 1
            return
        for k, v in cpu.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.client_s += client_s
        self.output_tokens += output_tokens
        self.runs_read += 1
        self.exited += exited

    def merged(self, other: CpuTally) -> CpuTally:
        t = CpuTally(dict(self.seconds), self.client_s, self.output_tokens, self.runs_read,
                     self.runs_unread, self.exited)
        for k, v in other.seconds.items():
            t.seconds[k] = t.seconds.get(k, 0.0) + v
        t.client_s += other.client_s
        t.output_tokens += other.output_tokens
        t.runs_read += other.runs_read
        t.runs_unread += other.runs_unread
        t.exited += other.exited
        return t

    def per_output_token(self) -> dict | None:
        """CPU-seconds per output token of each process, `server_total` (all of the server's
        processes) and `client`; None where no run was read (unknown, never zero)."""
        if not self.runs_read:
            return None
        out: dict = proc_stats.per_output_token(self.seconds, self.output_tokens)
        out["client"] = self.client_s / self.output_tokens
        out["runs_read"] = self.runs_read
        out["runs_unread"] = self.runs_unread
        out["processes_exited_during_runs"] = self.exited
        return out


def watch_threads(leader: int, out: str, stop_file: str, every_s: float = SAMPLE_EVERY_S) -> None:
    """Sample the server's thread counts until `stop_file` exists (or the leader is gone: the
    script was stopped); write their peaks."""
    peaks = proc_stats.ThreadPeaks(leader)
    while True:
        peaks.sample()
        if os.path.exists(stop_file) or not os.path.exists(f"/proc/{leader}"):
            break
        time.sleep(every_s)
    with open(out, "w") as f:
        json.dump(peaks.to_json(), f)


SCORED_RUN = re.compile(r"^([^.]+)\.([^.]+)\.(\d+)\.threads$")   # LABEL.WORKLOAD.RUN.threads


def threads_summary(work: str) -> dict:
    """From the scored runs' thread peaks (WORK/LABEL.WORKLOAD.RUN.threads) and the snapshots
    before them: per server (vLLM's two blocks as one), `serve_threads_under_load` (the
    leader's most threads during any run, per workload, and its fewest just before one) and
    `threads_under_load` (each process's most during any run)."""
    from bench_vs_vllm_runs import server_kind  # it imports this module
    serve: dict[str, dict] = {}
    every: dict[str, dict[str, int]] = {}
    for path in sorted(glob.glob(os.path.join(work, "*.threads"))):
        m = SCORED_RUN.match(os.path.basename(path))
        if m is None:
            continue
        label, workload, _ = m.groups()
        kind = server_kind(label)
        server = "vllm" if label in VLLM_BLOCKS else label
        leader_label = LEADER_ROLE[kind]
        with open(path) as f:
            peaks = json.load(f)
        s = serve.setdefault(server, {"process": leader_label, "peak": 0, "at_rest": None,
                                      "per_workload": {}, "samples": 0})
        s["samples"] += peaks["samples"]
        most = every.setdefault(server, {})
        for name, p in proc_stats.labelled(peaks, leader_label).values():
            most[name] = max(most.get(name, 0), p["threads"])
            if name == leader_label:
                s["peak"] = max(s["peak"], p["threads"])
                s["per_workload"][workload] = max(s["per_workload"].get(workload, 0),
                                                  p["threads"])
        try:
            with open(path.removesuffix(".threads") + ".procs.before") as f:
                before = json.load(f)
        except (OSError, ValueError):
            continue
        rest = [p["threads"] for p in before["procs"]
                if p["pid"] == before["leader"] and "threads" in p]
        if rest:
            s["at_rest"] = min(rest + ([s["at_rest"]] if s["at_rest"] is not None else []))
    return {"serve_threads_under_load": serve,
            "threads_under_load": {k: dict(sorted(v.items())) for k, v in every.items()}}


def main(argv: list[str]) -> int:
    if argv[:1] == ["snapshot"] and len(argv) == 3:
        with open(argv[2], "w") as f:
            json.dump(snapshot(int(argv[1])), f)
        return 0
    if argv[:1] == ["threads"] and len(argv) == 4:
        watch_threads(int(argv[1]), argv[2], argv[3])
        return 0
    if argv[:1] == ["threads-summary"] and len(argv) == 3:
        with open(argv[2]) as f:
            result = json.load(f)
        result.update(threads_summary(argv[1]))
        with open(argv[2], "w") as f:
            json.dump(result, f, indent=2)
        print("serve threads under load:", json.dumps(
            {k: {"peak": v["peak"], "at_rest": v["at_rest"]}
             for k, v in result["serve_threads_under_load"].items()}))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
