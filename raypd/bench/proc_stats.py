"""CPU-seconds and OS threads of each process of a served system, read from /proc.

A served system is a leader process and everything it started: `server_tree` takes the leader,
every process of its session (a server started under `setsid` leads one that its children
inherit) and every descendant of any of them (Ray's raylet and GCS, which the driver starts, and
the worker actors the raylet forks). A `snapshot` records each one's cmdline, utime + stime (all
of its threads, /proc/PID/stat) and thread count. Over a run, `cpu_seconds` subtracts a
before-snapshot from an after-snapshot matched on (pid, start time): a process born during the
run counts from zero; one that exited during it is named in `exited` (its last ticks are not
readable, so its share is missing, never guessed).

Processes are named by what they are, from the cmdline (`process_label`): the leader by the
caller's name for it (`serve`, `api_server`, `driver`), Ray's worker actors `actor:<Class>`
(their title is `ray::Class` or `ray::Class.method()`, idle ones `ray_idle_worker`), other set
titles in snake case (vLLM's `VLLM::EngineCore` -> `engine_core`), binaries by their file name
(`raylet`, `gcs_server`), Python scripts by theirs (`python -m mod` by the module, `python -c`
for an inline one); two processes of one name are `name`, `name#2`, ... in start order.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

Key = tuple[int, int]          # (pid, start): a process, even where its pid is reused


@dataclass(frozen=True)
class ProcSample:
    pid: int
    start: int          # start time since boot, in clock ticks (/proc/PID/stat field 22)
    ppid: int
    session: int
    ticks: int          # utime + stime, all threads, in clock ticks
    threads: int        # OS threads (/proc/PID/stat field 20, as many as /proc/PID/task holds)
    cmd: str            # cmdline, NULs as spaces


def parse_stat(pid: int, stat: str, cmd: str) -> ProcSample:
    """One /proc/PID/stat line (its comm may hold spaces and parentheses: fields after the last
    ')' are counted from the state, field 3)."""
    f = stat[stat.rindex(")") + 2:].split()
    return ProcSample(pid=pid, start=int(f[19]), ppid=int(f[1]), session=int(f[3]),
                      ticks=int(f[11]) + int(f[12]), threads=int(f[17]), cmd=cmd)


def read_procs(proc: str = "/proc") -> list[ProcSample]:
    """Every process readable under `proc` (one that exits while it is read is left out)."""
    out = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append(parse_stat(int(name), stat, cmd))
    return out


def server_tree(procs: list[ProcSample], leader: int) -> list[ProcSample]:
    """The leader, every process of its session, and every descendant of any of them, in start
    order."""
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
    """The served system's processes now, as JSON-ready data: {leader, clk_tck, procs}."""
    return {"leader": leader, "clk_tck": os.sysconf("SC_CLK_TCK"),
            "procs": [asdict(p) for p in server_tree(read_procs(proc), leader)]}


def thread_count(pid: int | str = "self", proc: str = "/proc") -> int:
    """A process's OS threads now: the entries of /proc/PID/task."""
    return len(os.listdir(os.path.join(proc, str(pid), "task")))


def process_label(cmd: str, leader_label: str | None = None) -> str:
    """What a process is, from its cmdline; `leader_label` names the leader (see the module
    docstring)."""
    if leader_label is not None:
        return leader_label
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


def labelled(snap: dict, leader_label: str) -> dict[Key, tuple[str, dict]]:
    """(pid, start) -> (label, the process's snapshot record); duplicate labels numbered in
    start order."""
    seen: dict[str, int] = {}
    out = {}
    for p in sorted(snap["procs"], key=lambda p: (p["start"], p["pid"])):
        label = process_label(p["cmd"], leader_label if p["pid"] == snap["leader"] else None)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out[(p["pid"], p["start"])] = (label, p)
    return out


def cpu_seconds(before: dict, after: dict, leader_label: str) -> tuple[dict[str, float],
                                                                       list[str]]:
    """CPU-seconds of each process between two snapshots of one system, and the labels of
    those that exited in between. A process's label is the after-snapshot's (Ray renames a
    worker while it runs a method; the class stays)."""
    assert before["clk_tck"] == after["clk_tck"] and before["leader"] == after["leader"]
    b, a = labelled(before, leader_label), labelled(after, leader_label)
    hz = after["clk_tck"]
    cpu = {label: (p["ticks"] - (b[key][1]["ticks"] if key in b else 0)) / hz
           for key, (label, p) in a.items()}
    exited = [label for key, (label, _) in b.items() if key not in a]
    return cpu, exited


def per_output_token(seconds: dict[str, float], output_tokens: int) -> dict[str, float]:
    """CPU-seconds per output token of each process and `server_total` (all of them)."""
    assert output_tokens > 0
    out = {k: v / output_tokens for k, v in sorted(seconds.items())}
    out["server_total"] = sum(seconds.values()) / output_tokens
    return out


class ThreadPeaks:
    """The most OS threads each process of a served system held over a series of samples
    (`sample` now and then while a load runs): {(pid, start): (cmd, peak)}. Every
    `rescan_every`-th sample walks all of /proc for the system's processes (one born between
    two such walks joins at the next); the others read only the stat files of those known, so
    that sampling takes little of the CPU it measures."""

    def __init__(self, leader: int, proc: str = "/proc", rescan_every: int = 5) -> None:
        self.leader, self.proc, self.rescan_every = leader, proc, rescan_every
        self.samples = 0
        self.peaks: dict[Key, tuple[str, int]] = {}

    def _known(self) -> list[ProcSample]:
        out = []
        for (pid, start), (cmd, _) in self.peaks.items():
            try:
                with open(os.path.join(self.proc, str(pid), "stat")) as f:
                    p = parse_stat(pid, f.read(), cmd)
            except OSError:          # exited
                continue
            if p.start == start:     # not a reused pid
                out.append(p)
        return out

    def sample(self) -> None:
        rescan = self.samples % self.rescan_every == 0
        procs = server_tree(read_procs(self.proc), self.leader) if rescan else self._known()
        for p in procs:
            _, peak = self.peaks.get((p.pid, p.start), (p.cmd, 0))
            self.peaks[(p.pid, p.start)] = (p.cmd, max(peak, p.threads))
        self.samples += 1

    def to_json(self) -> dict:
        """Snapshot-shaped ({leader, samples, procs}) so that `labelled` names its processes;
        each record's `threads` is its peak."""
        return {"leader": self.leader, "samples": self.samples,
                "procs": [{"pid": pid, "start": start, "cmd": cmd, "threads": peak}
                          for (pid, start), (cmd, peak) in sorted(self.peaks.items(),
                                                                  key=lambda kv: kv[0][::-1])]}
