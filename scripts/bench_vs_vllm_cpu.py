"""CPU-seconds of each process of a server under test, from /proc before and after a run.

  python scripts/bench_vs_vllm_cpu.py snapshot LEADER_PID OUT.json

A server of scripts/bench-vs-vllm.sh starts under `setsid`, so its first process (LEADER_PID) leads
a session that every process it starts inherits (Ray's raylet, GCS and worker actors, vLLM's
engine core): a snapshot takes every process of that session, or below LEADER_PID in the process
tree, with its cmdline and utime + stime (/proc/PID/stat: all of its threads). A run's CPU-seconds
per process are the after-snapshot's ticks minus the before's, matched on (pid, start time): a
process born during the run counts from zero; one that exited during it is named in `exited`
(its last ticks are not readable, so its share is missing, never guessed).

Processes are named by what they are, from the cmdline (see `process_label`): the leader is
the server's front process (`serve` for raypd, `api_server` for vLLM, `server` for llama.cpp),
Ray's worker actors `actor:<Class>` (their title is `ray::Class` or `ray::Class.method()`),
other set titles in snake case (vLLM's `VLLM::EngineCore` -> `engine_core`, and on a CPU the
`VLLM::Worker` that runs the model -> `worker`), binaries by their file name (`raylet`,
`gcs_server`), Python scripts by theirs (`python -c` for an inline one: multiprocessing's
resource tracker); two processes of one name are `name`, `name#2`, ... in start order.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass

LEADER_ROLE = {"vllm": "api_server", "raypd": "serve", "llamacpp": "server"}


@dataclass(frozen=True)
class ProcSample:
    pid: int
    start: int          # start time since boot, in clock ticks (/proc/PID/stat field 22)
    ppid: int
    session: int
    ticks: int          # utime + stime, all threads, in clock ticks
    cmd: str            # cmdline, NULs as spaces


def parse_stat(pid: int, stat: str, cmd: str) -> ProcSample:
    """One /proc/PID/stat line (its comm may hold spaces and parentheses: fields after the last
    ')' are counted from the state, field 3)."""
    f = stat[stat.rindex(")") + 2:].split()
    return ProcSample(pid=pid, start=int(f[19]), ppid=int(f[1]), session=int(f[3]),
                      ticks=int(f[11]) + int(f[12]), cmd=cmd)


def read_procs(proc: str = "/proc") -> list[ProcSample]:
    out = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:          # exited while we read
            continue
        out.append(parse_stat(int(name), stat, cmd))
    return out


def server_tree(procs: list[ProcSample], leader: int) -> list[ProcSample]:
    """The leader, every process of its session, and every descendant of any of them."""
    children: dict[int, list[ProcSample]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    keep = {p.pid: p for p in procs if p.pid == leader or p.session == leader}
    todo = list(keep)
    while todo:
        for c in children.get(todo.pop(), []):
            if c.pid not in keep:
                keep[c.pid] = c
                todo.append(c.pid)
    return sorted(keep.values(), key=lambda p: (p.start, p.pid))


def snapshot(leader: int, proc: str = "/proc") -> dict:
    return {"leader": leader, "clk_tck": os.sysconf("SC_CLK_TCK"),
            "procs": [asdict(p) for p in server_tree(read_procs(proc), leader)]}


def process_label(cmd: str, is_leader: bool, server: str) -> str:
    """What a process is, from its cmdline (see the module docstring)."""
    if is_leader:
        return LEADER_ROLE[server]
    argv = cmd.split()
    if not argv:
        return "unnamed"
    head = argv[0]
    if head.startswith("ray::"):
        cls = head[len("ray::"):].split(".")[0].split("(")[0]
        return "ray_idle_worker" if cls == "IDLE" else f"actor:{cls}"
    if "::" in head:            # a title set with setproctitle: VLLM::EngineCore -> engine_core
        title = head.split("::", 1)[1]
        return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", title).lower()
    if os.path.basename(head).startswith("python"):
        rest = iter(argv[1:])
        for a in rest:
            if a == "-m":
                return next(rest, "python -m")
            if a == "-c":
                return "python -c"
            if not a.startswith("-"):
                return os.path.basename(a)
    return os.path.basename(head)


def _labelled(snap: dict, server: str) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, start) -> (label, ticks); duplicate labels numbered in start order."""
    seen: dict[str, int] = {}
    out = {}
    for p in sorted(snap["procs"], key=lambda p: (p["start"], p["pid"])):
        label = process_label(p["cmd"], p["pid"] == snap["leader"], server)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out[(p["pid"], p["start"])] = (label, p["ticks"])
    return out


def run_cpu_seconds(before: dict, after: dict, server: str) -> tuple[dict[str, float], list[str]]:
    """CPU-seconds of each process over a run, and the labels of those that exited during it.
    A process's label is the after-snapshot's (Ray renames a worker while it runs a method; the
    class stays)."""
    assert before["clk_tck"] == after["clk_tck"] and before["leader"] == after["leader"]
    b, a = _labelled(before, server), _labelled(after, server)
    hz = after["clk_tck"]
    cpu = {label: (ticks - b.get(key, ("", 0))[1]) / hz for key, (label, ticks) in a.items()}
    exited = [label for key, (label, _) in b.items() if key not in a]
    return cpu, exited


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
        n = self.output_tokens
        out = {k: v / n for k, v in sorted(self.seconds.items())}
        out["server_total"] = sum(self.seconds.values()) / n
        out["client"] = self.client_s / n
        out["runs_read"] = self.runs_read
        out["runs_unread"] = self.runs_unread
        out["processes_exited_during_runs"] = self.exited
        return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["snapshot"] and len(argv) == 3:
        with open(argv[2], "w") as f:
            json.dump(snapshot(int(argv[1])), f)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
