"""A tensor-parallel group's communication channel: ShmComm for the ranks of one host (a shared
memory segment in /dev/shm driven by csrc/shm_comm.cpp), GlooComm over torch.distributed gloo
(across hosts, and the comparison figure), the same four collectives on both.

Every rank makes the same collective calls in the same order. ShmComm's all-reduce gives every
rank the same bits: float32 summed in rank order, bf16 summed in float32 and rounded once. A
peer that dies, a timeout or abort() breaks the group: every waiting rank raises CommError.

Measured (`measure_allreduce_us`, 2 ranks, float32, median us per all-reduce, AMD EPYC 2 vCPUs
(AVX2), 2,000 calls shm / 300 gloo):
    4 KiB: shm 2.9, gloo 814;  36 KiB: 6.0 / 773;  144 KiB: 12.1 / 737;  2 MiB: 169 / 2,995.
A broadcast of 4 KB takes ~2.5 us, a barrier ~1 us; a rank idle in a broadcast sleeps on a futex
(<1% of a core).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import struct
import time
import weakref

import torch

from workers.kernels import bindings

DEFAULT_DIR = "/dev/shm"
PREFIX = "raypd_tp_"            # segments: raypd_tp_<creator pid>_<random hex>
BCAST_BYTES = 1 << 20           # the broadcast area (larger payloads go in several calls)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ALGOS = {"auto": 0, "all_read": 1, "reduce_scatter": 2}
_LEN = struct.Struct("<q")      # a broadcast's total length, ahead of its first chunk


class CommError(RuntimeError):
    """A peer died, a wait timed out, or the group was aborted (the group is then unusable)."""


def _check(rc: int, what: str) -> int:
    """rc when it is not an error code of shm_comm.cpp, else raises CommError / ValueError."""
    if rc >= 0:
        return rc
    if rc == -1:
        raise CommError(f"{what}: timed out waiting for a peer")
    if rc == -2:
        raise CommError(f"{what}: the group was aborted")
    if rc <= -100:
        raise CommError(f"{what}: rank {-100 - rc} died")
    raise ValueError(f"{what}: bad arguments (code {rc})")


def _library():
    lib = bindings.library()
    if lib is None:
        raise RuntimeError("ShmComm needs the native kernels (a C++ compiler, and "
                           "RAYPD_NATIVE_KERNELS not 0); GlooComm works without them")
    return lib


def remove_stale_segments(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink the segments (raypd_tp_<pid>_<hex>) whose creating process no longer exists."""
    removed = []
    for entry in os.scandir(directory):
        parts = entry.name[len(PREFIX):].split("_")
        if not entry.name.startswith(PREFIX) or len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            os.kill(int(parts[0]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.path)
        except PermissionError:  # alive, someone else's
            pass
    return removed


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no page faults in calls
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)


def _release(state: dict) -> None:
    """Unmaps (and for rank 0 unlinks) a ShmComm's segment; at close() or collection."""
    state.pop("anchor", None)   # the ctypes view exports the map's buffer: drop it first
    mapped = state.pop("mapped", None)
    if mapped is not None:
        with contextlib.suppress(BufferError):
            mapped.close()
    if state.pop("unlink", False):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(state["path"])


class ShmComm:
    """A TP group's channel on one host: all-reduce (sum), broadcast from rank 0, gather to rank
    0, barrier. Rank 0 creates the segment (`create`), the others `attach` by its name."""

    name: str
    rank: int
    world: int

    def __init__(self, path: str, mapped: mmap.mmap, rank: int, world: int, slot_bytes: int,
                 *, owner: bool) -> None:
        self.name, self.rank, self.world = os.path.basename(path), rank, world
        self.slot_bytes = slot_bytes
        self._lib = _library()
        self._all_reduce = self._lib.shm_all_reduce     # the hot call, looked up once
        anchor = ctypes.c_char.from_buffer(mapped)
        self._base = ctypes.addressof(anchor)
        self._state = {"path": path, "mapped": mapped, "anchor": anchor, "unlink": owner}
        self._finalizer = weakref.finalize(self, _release, self._state)
        _check(self._lib.shm_comm_join(self._base, rank, world, slot_bytes), "join")
        self.bcast_bytes = int(self._lib.shm_comm_bcast_bytes(self._base))
        self._inbox = bytearray(self.bcast_bytes)   # a follower's broadcast buffer
        self._inbox_ptr = ctypes.addressof((ctypes.c_char * self.bcast_bytes).from_buffer(
            self._inbox))

    @classmethod
    def create(cls, world: int, slot_bytes: int = 4 << 20, name: str | None = None, *,
               bcast_bytes: int = BCAST_BYTES, directory: str = DEFAULT_DIR) -> ShmComm:
        """Rank 0: a new segment (named raypd_tp_<pid>_<hex> unless `name` is given), its header
        written before it appears under its name, so an attaching rank never sees it half made."""
        lib = _library()
        size = _check(lib.shm_comm_bytes(world, slot_bytes, bcast_bytes), "segment size")
        remove_stale_segments(directory)
        name = name or f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        path = os.path.join(directory, name)
        tmp = f"{path}.{secrets.token_hex(4)}.init"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        try:
            mapped = _map(tmp, size)
            anchor = ctypes.c_char.from_buffer(mapped)
            _check(lib.shm_comm_init(ctypes.addressof(anchor), world, slot_bytes, bcast_bytes),
                   "init")
            del anchor
            os.link(tmp, path)      # fails if the name is taken (a rename would replace it)
        finally:
            os.unlink(tmp)
        return cls(path, mapped, 0, world, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, slot_bytes: int = 4 << 20, *,
               timeout_s: float = 30.0, directory: str = DEFAULT_DIR) -> ShmComm:
        """Rank `rank` (>= 1) joins rank 0's segment `name`, waiting up to `timeout_s` for it to
        appear (ranks may start before rank 0 has made it)."""
        path = os.path.join(directory, name)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                size = os.stat(path).st_size
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise CommError(f"no segment {path} after {timeout_s} s") from None
                time.sleep(0.005)
        return cls(path, _map(path, size), rank, world, slot_bytes, owner=False)

    def all_reduce_(self, t: torch.Tensor, timeout_s: float = 60.0,
                    algo: str = "auto") -> torch.Tensor:
        """t = the sum of every rank's t, in place (contiguous CPU float32 or bf16, any size)."""
        code = DTYPE_CODES.get(t.dtype)
        if code is None or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"all_reduce_ takes a contiguous CPU float32 or bf16 tensor, not "
                             f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})")
        rc = self._all_reduce(self._base, self.rank, t.data_ptr(), t.numel(), code, ALGOS[algo],
                              timeout_s)
        if rc:
            _check(rc, "all_reduce")
        return t

    def broadcast(self, payload: bytes | None, timeout_s: float | None = None) -> bytes:
        """Rank 0 gives `payload`, every rank gets it back. The others pass None and may wait
        long (an idle worker between steps: they back off to short sleeps); timeout None waits
        for ever, still raising CommError when a peer dies or the group is aborted."""
        timeout = -1.0 if timeout_s is None else float(timeout_s)
        room = self.bcast_bytes
        if self.rank == 0:
            if payload is None:
                raise ValueError("rank 0 broadcasts bytes, not None")
            data = _LEN.pack(len(payload)) + bytes(payload)
            for off in range(0, len(data), room):
                chunk = data[off:off + room]
                _check(self._lib.shm_broadcast(self._base, 0, chunk, len(chunk), timeout),
                       "broadcast")
            return bytes(payload)
        n = _check(self._lib.shm_broadcast(self._base, self.rank, self._inbox_ptr, room, timeout),
                   "broadcast")
        total = _LEN.unpack_from(self._inbox)[0] + _LEN.size
        parts = [bytes(self._inbox[_LEN.size:n])]
        got = n
        while got < total:
            n = _check(self._lib.shm_broadcast(self._base, self.rank, self._inbox_ptr, room,
                                               timeout), "broadcast")
            parts.append(bytes(self._inbox[:n]))
            got += n
        return b"".join(parts)

    def gather(self, t: torch.Tensor, timeout_s: float = 60.0) -> list[torch.Tensor] | None:
        """Every rank's t (the same shape and dtype on every rank, any CPU dtype) to rank 0, as
        a list by rank; None on the other ranks."""
        src = t.contiguous()
        if src.device.type != "cpu":
            raise ValueError(f"gather takes a CPU tensor, not one on {src.device}")
        out = torch.empty((self.world, *src.shape), dtype=src.dtype) if self.rank == 0 else None
        nbytes = src.numel() * src.element_size()
        _check(self._lib.shm_gather(self._base, self.rank, src.data_ptr(), nbytes,
                                    out.data_ptr() if out is not None else None, timeout_s),
               "gather")
        return list(out.unbind(0)) if out is not None else None

    def barrier(self, timeout_s: float = 60.0) -> None:
        """Returns once every rank has called it."""
        _check(self._lib.shm_barrier(self._base, self.rank, timeout_s), "barrier")

    def abort(self) -> None:
        """Breaks the group: every rank waiting in a call, or entering one, raises CommError."""
        if self._state.get("mapped") is not None:
            self._lib.shm_comm_abort(self._base)

    def close(self) -> None:
        """Detaches; rank 0 also unlinks the segment (attached ranks keep their mapping)."""
        self._finalizer()


class GlooComm:
    """The same all_reduce_ / broadcast / gather / barrier over torch.distributed gloo (across
    hosts; and the comparison figure). Its waits have the process group's timeout, not the
    calls' `timeout_s`."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    @classmethod
    def init(cls, rank: int, world: int, init_method: str,
             timeout_s: float = 60.0) -> GlooComm:
        """Joins the gloo group at `init_method` (e.g. "tcp://127.0.0.1:PORT")."""
        import datetime

        import torch.distributed as dist
        if dist.is_initialized():   # torch.distributed holds one default group a process
            raise CommError("this process already belongs to a gloo group (one TP worker "
                            "with tp_allreduce gloo a process; shm has no such limit)")
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                    world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise CommError(f"gloo group at {init_method}: {e}") from e
        return cls(rank, world)

    def all_reduce_(self, t: torch.Tensor, timeout_s: float = 60.0) -> torch.Tensor:
        import torch.distributed as dist
        with _gloo_errors():
            dist.all_reduce(t)
        return t

    def broadcast(self, payload: bytes | None, timeout_s: float | None = None) -> bytes:
        import torch.distributed as dist
        n = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
        with _gloo_errors():
            dist.broadcast(n, 0)
            buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                   else torch.empty(int(n.item()), dtype=torch.uint8))
            if buf.numel():
                dist.broadcast(buf, 0)
        return bytes(payload) if self.rank == 0 else buf.numpy().tobytes()

    def gather(self, t: torch.Tensor, timeout_s: float = 60.0) -> list[torch.Tensor] | None:
        import torch.distributed as dist
        src = t.contiguous()
        out = [torch.empty_like(src) for _ in range(self.world)] if self.rank == 0 else None
        with _gloo_errors():
            dist.gather(src, out, dst=0)
        return out

    def barrier(self, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist
        with _gloo_errors():
            dist.barrier()

    def abort(self) -> None:
        """gloo has no abort: the group's peers see this process's sockets close."""
        self.close()

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _gloo_errors():
    """A gloo collective's failure (a peer gone, the group's timeout) as CommError."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        raise CommError(f"gloo: {e}") from e


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo group's init_method)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_rank(rank: int, world: int, where: str, sizes: list[int], dtype: torch.dtype,
                  backend: str, iters: int, out) -> None:
    """One rank of measure_allreduce_us: rank 0 puts {size: median us} on `out`."""
    torch.set_num_threads(1)
    if backend == "shm":
        slot = max(4 << 20, max(sizes))
        comm = (ShmComm.create(world, slot, name=where) if rank == 0
                else ShmComm.attach(where, rank, world, slot))
    else:
        comm = GlooComm.init(rank, world, where)
    medians = {}
    try:
        for size in sizes:
            src = torch.randn(max(1, size // torch.empty((), dtype=dtype).element_size()),
                              generator=torch.Generator().manual_seed(rank)).to(dtype)
            x = src.clone()
            times = []
            for i in range(iters + max(10, iters // 10)):   # warm-up first, not counted
                x.copy_(src)
                t0 = time.perf_counter_ns()
                comm.all_reduce_(x)
                if i >= max(10, iters // 10):
                    times.append(time.perf_counter_ns() - t0)
            comm.barrier()
            medians[size] = statistics.median(times) / 1e3
    finally:
        if rank == 0:
            out.put(medians)
        comm.barrier()
        comm.close()


def measure_allreduce_us(world: int, sizes_bytes: list[int], dtype: torch.dtype = torch.float32,
                         backend: str = "shm", iters: int = 1000) -> dict[int, float]:
    """{message bytes: median microseconds per all-reduce, on rank 0} over `world` spawned
    processes (backend "shm": ShmComm, "gloo": GlooComm), warm-up calls excluded."""
    if backend not in ("shm", "gloo"):
        raise ValueError(f"backend is 'shm' or 'gloo', not {backend!r}")
    if backend == "shm":
        _library()   # built once here, not by every rank at once
    ctx = mp.get_context("spawn")
    where = (f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}" if backend == "shm"
             else f"tcp://127.0.0.1:{free_port()}")
    out = ctx.Queue()
    procs = [ctx.Process(target=_measure_rank,
                         args=(r, world, where, list(sizes_bytes), dtype, backend, iters, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result
