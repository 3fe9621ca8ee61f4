"""Worker actors on one machine lend each other the threads they are not using.

Each raypd worker actor reserves `threads_per_worker` threads. With 1 prefill + 1 decode worker
on a 2-core machine that is one core each, and whenever one role has nothing to do (a burst's
decode tail, a prefill-only start) its core sits idle while the other runs on one thread.
Here each worker keeps a slot in a machine-wide folder (tmpfs): its pid, its own thread count
and whether it has work. Before each engine step a busy worker takes its own threads plus its
share of the idle workers' (split over the busy workers by their own counts, rounded down), never
more than the CPUs it may run on. So the threads in use stay within what the live workers
reserved, give or take the one step that is running when a peer turns busy.

A slot whose process is gone (its pid and start time no longer name a live process) is ignored
and removed. Workers of other raypd clusters on the same machine share the folder: they compete
for the same cores.

Invariant: `threads()` is within [own, max(own, cpus)].
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
from pathlib import Path

SLOT = struct.Struct("<iiiq")    # pid, own threads, busy (0/1), the process's start time
RESCAN_S = 1.0                   # how often the folder is listed again for new / gone peers
HAVE_PROC = Path("/proc/self/stat").exists()   # start times readable (else pids alone)


def default_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"raypd-threads-{os.getuid()}"


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc; -1 where it cannot be read):
    with the pid it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _alive(pid: int, started: int) -> bool:
    if HAVE_PROC:
        return start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # someone else's process: alive
        return True
    return True


class ThreadShare:
    def __init__(self, worker_id: str, own: int, folder: Path | None = None,
                 cpus: int | None = None, rescan_s: float = RESCAN_S) -> None:
        assert own >= 1, own
        self.own, self.rescan_s = own, rescan_s
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.folder = folder or default_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self.started = start_time(self.pid)
        # a worker id is unique in a cluster; the pid keeps two clusters' "decode-0" apart
        self.path = self.folder / f"{worker_id}.{self.pid}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._busy: bool | None = None
        self._peers: dict[str, int] = {}     # file name -> open fd
        self._scanned = float("-inf")
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        """This worker has work (its engine has unfinished requests) or not."""
        if busy != self._busy:
            os.pwrite(self._fd, SLOT.pack(self.pid, self.own, int(busy), self.started), 0)
            self._busy = busy

    def _scan(self) -> None:
        names = {p.name for p in self.folder.iterdir()} - {self.path.name}
        for gone in set(self._peers) - names:
            os.close(self._peers.pop(gone))
        for name in names - set(self._peers):
            try:
                self._peers[name] = os.open(self.folder / name, os.O_RDONLY)
            except FileNotFoundError:
                pass
        self._scanned = time.monotonic()

    def peers(self) -> list[tuple[int, bool]]:
        """(own threads, busy) of every live peer."""
        if time.monotonic() - self._scanned >= self.rescan_s:
            self._scan()
        out = []
        for name, fd in list(self._peers.items()):
            raw = os.pread(fd, SLOT.size, 0)
            if len(raw) < SLOT.size:
                continue                      # being created
            pid, own, busy, started = SLOT.unpack(raw)
            if not _alive(pid, started):
                os.close(self._peers.pop(name))
                (self.folder / name).unlink(missing_ok=True)
                continue
            out.append((own, bool(busy)))
        return out

    def threads(self) -> int:
        """Threads for this worker's next step (call with it marked busy)."""
        peers = self.peers()
        idle = sum(own for own, busy in peers if not busy)
        busy_own = self.own + sum(own for own, busy in peers if busy)
        n = self.own + idle * self.own // busy_own
        return max(self.own, min(n, self.cpus))

    def close(self) -> None:
        """Gone: no threads to lend or take (a peer holding the slot open reads 0 of them)."""
        os.pwrite(self._fd, SLOT.pack(self.pid, 0, 0, self.started), 0)
        for fd in self._peers.values():
            os.close(fd)
        self._peers.clear()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
