"""Same-node transport for pages on a GPU: P stages them in a private device buffer and exports it
as a CUDA IPC handle; D maps the handle and copies device to device (no host round trip).

Works for two workers on one GPU (fractional `num_gpus`: both map the same device) and for
workers on different GPUs of one node when D's process can see P's GPU (the handle names the
GPU by UUID; D refuses with TransferError when it cannot see it: use `rdt` over NCCL then).

The protocol, whatever the memory:
  stage    P copies the pages into a private buffer (a gather straight out of its kv_cache with
           `stage_blocks`), creates the transfer's ticket file in /dev/shm, and returns a
           handle whose `export` (SharedPages) says how to map the buffer.
  fetch    D claims the transfer by renaming its ticket to `<ticket>.pulled` (atomic: one pull
           of a handle ever wins; a second is refused), maps the buffer, copies it into memory
           it owns (`fetch`) or into its kv_cache blocks (`fetch_into`), waits for the copy, and
           checks that the claimed file is still there: a transfer released (lease ended)
           meanwhile is refused.
  release  P unlinks the ticket (late readers now fail), or the claimed file when a pull won
           the ticket first, then drops the buffer: no reference to it stays in this module.
           torch's CUDA IPC reference counting keeps GPU memory that a reader still maps alive
           until the reader lets go, so a late reader never reads reused memory either.

One receive per send (torch's contract for a CUDA IPC export): each staged buffer is exported
once, and exactly one side performs its one receive. The pull that claimed the ticket does
(mapping the buffer, or, where it cannot, giving the receive up with `forgo`); when P's release
wins the ticket instead (never pulled: lease expiry, abort, fallback, shutdown), P does it with
`forgo`. Until then torch keeps a dropped buffer in its IPC limbo (a reader may still map it);
after it, the memory returns to P's caching allocator. torch's IPC calls sit behind `IPC`
(TorchCudaIpc) so the bookkeeping is tested on CPU with a fake.
The lease, plan digest and page checksums of the handoff (protocol/messages.py,
workers/kv_handoff.py) sit above this and apply unchanged.

Staging pool (GPU pages, `staging_pool_mib` > 0, the default): P stages into byte ranges of a
few long-lived segments (kvtransfer/staging_pool.py) instead of a fresh buffer per transfer. Each
export is still one send with one receive, but every transfer staged in a segment shares its
CUDA allocation, so D keeps its mapping of the segment (`_MAPPED`, per producer process and
segment) and torch's receive cache makes a later open of it a reference-count release instead of
a map and an unmap. Because such a receive does not wait on the export's event, P waits for its
staging copy before it publishes. A released range goes back to the pool only after the ticket
is unlinked, so a pull that read a reused range fails its final check, as above.

The CPU stand-in: pages on the CPU are staged in the ticket file itself (a POSIX shared-memory
file, mapped by both sides), with the same handle, checks and release order, so the protocol
runs end to end on machines without a GPU. `device="cuda"` asks for the GPU path only: on a
process without a GPU the transport refuses at construction (TransferError).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtransfer.base import (
    KVTransport,
    TransferError,
    TransferHandle,
    as_bytes,
    check_fits,
    scatter_blocks,
    torch_dtype,
)
from kvtransfer.shm import DEFAULT_DIR, remove_stale_files
from kvtransfer.staging_pool import Range, StagingPool

PREFIX = "raypd-ipc"
CLAIMED = ".pulled"   # suffix of a ticket a pull has claimed
DEVICES = ("auto", "cuda", "cpu")
_LOCAL: dict[str, torch.Tensor] = {}   # transfer_id -> staged buffer, for readers in this
                                       # process (CUDA cannot open its own IPC handles)
MAX_MAPPED = 16                        # pool segments a reader keeps mapped (least recent out)
_MAPPED: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()  # (pid, segment) -> a view
_MAPPED_LOCK = threading.Lock()


@dataclass(frozen=True)
class SharedPages:
    """How D maps a staged buffer: `kind` "cuda" (torch's CUDA IPC rebuild arguments, the
    GPU's UUID) or "cpu" (the stand-in: the pages are the ticket file's bytes)."""

    kind: str
    ticket: str                      # /dev/shm path; exists exactly while the pages are staged
    pid: int                         # the producer's process
    rebuild_args: tuple = ()         # cuda: torch.multiprocessing.reductions.reduce_tensor's
    gpu_uuid: str = ""               # cuda: the physical GPU holding the buffer
    segment: str = ""                # cuda: the staging-pool segment, "" for a private buffer


class TorchCudaIpc:
    """torch's CUDA IPC, the calls this transport makes (a test swaps in a fake).

    Invariant kept by the callers: for every `export`, exactly one `open` or one `forgo`."""

    def export(self, buffer: torch.Tensor) -> tuple:
        """Share `buffer` (its one send): the arguments a reader rebuilds it from."""
        from torch.multiprocessing.reductions import reduce_tensor
        # _share_cuda_ records an event after the copy on this stream; the reader's rebuild
        # waits on it, so the copy need not be synchronized here
        _, args = reduce_tensor(buffer)
        return tuple(args)

    def open(self, rebuild_args: tuple, index: int) -> torch.Tensor:
        """The receive: map the exported buffer on this process's GPU `index`. Dropping the
        returned tensor gives the producer's memory back (torch's cross-process refcount)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        args = list(rebuild_args)
        args[6] = index   # storage_device: the producer's index, renumbered for this process
        return rebuild_cuda_tensor(*args)

    def forgo(self, rebuild_args: tuple) -> None:
        """The receive given up without mapping: release the export's reference count, so
        the producer's buffer leaves torch's IPC limbo once the producer drops it."""
        ref_counter_handle, ref_counter_offset = rebuild_args[11], rebuild_args[12]
        torch.UntypedStorage._release_ipc_counter(ref_counter_handle, ref_counter_offset,
                                                  device=rebuild_args[6])

    def collect(self) -> None:
        """Free dropped buffers whose receive has happened (torch.cuda.ipc_collect)."""
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


IPC = TorchCudaIpc()


def claimed_path(ticket: str) -> str:
    """Where a pull moves the ticket when it claims the transfer."""
    return ticket + CLAIMED


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, or None when it cannot see it."""
    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


@dataclass
class _Staged:
    export: SharedPages
    buffer: torch.Tensor             # cuda: the device buffer; cpu: a view of the mapping
    mapped: mmap.mmap | None = None  # cpu stand-in only
    pool: StagingPool | None = None  # cuda, pooled: where `range` goes back after release
    range: Range | None = None


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self, *, device: str = "auto", directory: str = DEFAULT_DIR,
                 cleanup_stale: bool = True, staging_pool_mib: int = 1024, **cfg: Any) -> None:
        """`device`: "auto" (GPU pages over CUDA IPC, CPU pages over the stand-in), "cuda"
        (GPU only: refuses without a GPU and refuses CPU pages) or "cpu" (the stand-in, GPU
        pages are copied to the host first). `staging_pool_mib`: the most GPU memory P keeps
        for staging between transfers (the module doc's staging pool; 0: a private buffer per
        transfer). torch's caching allocator keeps freed staging buffers reserved anyway, so
        the pool holds about what the private buffers' peak would have."""
        if device not in DEVICES:
            raise TransferError(f"cuda_ipc device must be one of {', '.join(DEVICES)}, "
                                f"got {device!r}")
        if not isinstance(staging_pool_mib, int) or staging_pool_mib < 0:
            raise TransferError(f"cuda_ipc staging_pool_mib must be an integer >= 0, "
                                f"got {staging_pool_mib!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise TransferError("the cuda_ipc transport was asked for device 'cuda' but this "
                                "process sees no GPU (torch.cuda.is_available() is False); give "
                                "the workers GPUs (workers.num_gpus) or use transport 'shm'")
        super().__init__(**cfg)
        self.device = device
        self.directory = directory
        self.staging_pool_bytes = staging_pool_mib << 20
        self._pools: dict[torch.device, StagingPool] = {}
        # the last pull's seconds by phase (`raypd bench transfer` reports them): map (open
        # the IPC handle, or the stand-in's file), copy (the caller's copy and a stream sync),
        # release (close the mapping), checks (claim, node and GPU checks, the ticket's stat)
        self.last_phases: dict[str, float] = {}
        if cleanup_stale:
            remove_stale_files(directory, PREFIX)
        self._finalizer = weakref.finalize(self, _release_all, self._staged)

    def close(self) -> None:
        super().close()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    # -- producer -------------------------------------------------------------------------

    def _to_host(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.detach()   # stays where it is; _stage makes the private copy

    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        buffer, staged = self._allocate(handle, pages.device)
        buffer.copy_(pages)
        return self._publish(handle, buffer, staged)

    def stage_blocks(self, request_id: str, kv_cache: torch.Tensor, block_ids: Sequence[int],
                     block_hashes: Sequence[int]) -> TransferHandle:
        """Gather ``kv_cache[:, :, block_ids]`` straight into the staging buffer: one copy."""
        ids = list(block_ids)
        shape = (*kv_cache.shape[:2], len(ids), *kv_cache.shape[3:])
        self._check_pages(shape, kv_cache.dtype, block_hashes)
        handle = self._new_handle(request_id, shape, kv_cache.dtype, block_hashes)
        buffer, staged = self._allocate(handle, kv_cache.device)
        index = torch.as_tensor(ids, dtype=torch.long, device=kv_cache.device)
        if buffer.device == kv_cache.device:
            torch.index_select(kv_cache, 2, index, out=buffer)
        else:
            buffer.copy_(torch.index_select(kv_cache, 2, index))
        return self._publish(handle, buffer, staged)

    def _kind_for(self, device: torch.device) -> str:
        if device.type == "cuda" and self.device != "cpu":
            return "cuda"
        if self.device == "cuda":
            raise TransferError(f"cuda_ipc (device 'cuda') was given pages on {device}; it "
                                "moves GPU pages only")
        return "cpu"

    def _allocate(self, handle: TransferHandle, device: torch.device
                  ) -> tuple[torch.Tensor, _Staged]:
        """The staging buffer (a pool range, else a private buffer) and its ticket (the cpu
        stand-in: one file, both)."""
        kind = self._kind_for(device)
        ticket = os.path.join(self.directory, f"{PREFIX}-{os.getpid()}-{handle.transfer_id}")
        try:
            fd = os.open(ticket, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TransferError(f"cannot create the transfer ticket {ticket}: {exc}") from exc
        dtype = torch_dtype(handle.dtype)
        mapped = pool = taken = None
        try:
            if kind == "cpu":
                os.ftruncate(fd, handle.nbytes)
                mapped = mmap.mmap(fd, handle.nbytes, flags=mmap.MAP_SHARED)
                flat = torch.frombuffer(mapped, dtype=torch.uint8)
                buffer = flat.view(dtype).view(handle.shape)
            else:
                pool = self._pool_for(device)
                taken = pool.take(handle.nbytes) if pool is not None else None
                buffer = (taken.view.view(dtype).view(handle.shape) if taken is not None
                          else torch.empty(handle.shape, dtype=dtype, device=device))
        except (OSError, RuntimeError) as exc:
            if taken is not None:
                pool.give(taken)
            os.close(fd)
            _unlink(ticket)
            raise TransferError(f"cannot allocate {handle.nbytes} bytes to stage "
                                f"{handle.transfer_id} on {device}: {exc}") from exc
        os.close(fd)
        export = SharedPages(kind, ticket, os.getpid(),
                             segment=taken.segment if taken is not None else "")
        return buffer, _Staged(export, buffer, mapped, pool if taken is not None else None,
                               taken)

    def _pool_for(self, device: torch.device) -> StagingPool | None:
        if self.staging_pool_bytes == 0:
            return None
        with self._lock:
            pool = self._pools.get(device)
            if pool is None:
                pool = self._pools[device] = StagingPool(device, self.staging_pool_bytes)
            return pool

    def _publish(self, handle: TransferHandle, buffer: torch.Tensor,
                 staged: _Staged) -> TransferHandle:
        export = staged.export
        if export.segment and buffer.device.type == "cuda":
            # a reader that maps the segment already does not wait on the export's event
            torch.cuda.current_stream(buffer.device).synchronize()
        if export.kind == "cuda":
            export = replace(export, rebuild_args=IPC.export(buffer),
                             gpu_uuid=gpu_uuid(buffer.device.index or 0))
            staged.export = export
        if self.checksum:
            crc, algo = self._checksum_of(as_bytes(buffer.detach().to("cpu").contiguous()))
            handle = replace(handle, checksum=crc, checksum_algo=algo)
        with self._lock:
            self._staged[handle.transfer_id] = staged
            if export.kind == "cuda":
                _LOCAL[handle.transfer_id] = buffer
        return replace(handle, address=export.ticket, export=export)

    def release(self, transfer_id: str) -> bool:
        """End a staging (the lease's ack, abort or expiry, or close): unpublish it, give the
        export its one receive when no pull claimed it, and drop every reference to the buffer
        held here. True if it was staged; releasing twice is harmless."""
        with self._lock:
            staged = self._staged.pop(transfer_id, None)
            _LOCAL.pop(transfer_id, None)
        if staged is None:
            return False
        _release(staged)
        return True

    # -- consumer -------------------------------------------------------------------------

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        """A copy the caller owns, on the device the pages were staged on (cuda: this
        process's index of that GPU)."""
        out = self._read(handle, lambda pages: pages.clone())
        self._verify_copy(handle, out)
        return out

    def fetch_into(self, handle: TransferHandle, kv_cache: torch.Tensor,
                   dest_block_ids: Sequence[int]) -> None:
        """Copy device to device straight into ``kv_cache[:, :, dest_block_ids]``."""
        ids = check_fits(kv_cache, dest_block_ids, handle.shape, handle.dtype)
        self._read(handle, lambda pages: scatter_blocks(kv_cache, ids, pages))
        if handle.checksum is not None:
            self._verify_copy(handle, kv_cache[:, :, ids])

    def _verify_copy(self, handle: TransferHandle, pages: torch.Tensor) -> None:
        if handle.checksum is not None:
            self._verify(handle, as_bytes(pages.detach().to("cpu").contiguous()))

    def _read(self, handle: TransferHandle, use):
        t_start = time.perf_counter()
        self._check_handle(handle)
        export = handle.export
        if not isinstance(export, SharedPages):
            raise TransferError(f"cuda_ipc handle {handle.transfer_id} carries no export")
        if handle.node_id != self.node_id:
            raise TransferError(
                f"cuda_ipc transfer {handle.transfer_id} was staged on node {handle.node_id} "
                f"but this process runs on node {self.node_id}; CUDA IPC works within one node "
                "only: use 'rdt' (NCCL) or 'grpc' across nodes")
        local = (export.kind == "cuda" and export.pid == os.getpid()
                 and handle.transfer_id in _LOCAL)
        index = None
        if export.kind == "cuda" and not local:
            index = local_gpu_index(export.gpu_uuid)
            if index is None:
                raise TransferError(
                    f"cuda_ipc transfer {handle.transfer_id} is on GPU {export.gpu_uuid}, "
                    "which this process cannot see (no GPU here, or another GPU of the node "
                    "outside its CUDA_VISIBLE_DEVICES); use 'rdt' (NCCL) between those workers")
        inode = self._claim(handle, export)
        # from here this pull owns the export's one receive: it maps it, or forgoes it
        mapped = None
        pages = None
        t_map = t_copy = t_release = time.perf_counter()
        try:
            if export.kind == "cuda":
                pages = self._map_cuda(handle, export, index)
            else:
                pages, mapped = self._map_cpu(handle, export)
            t_copy = time.perf_counter()
            out = use(pages)
            if pages.device.type == "cuda":
                torch.cuda.current_stream(pages.device).synchronize()
            if export.segment and not local:
                _keep_mapping(export, pages)
        finally:
            t_release = time.perf_counter()
            received = pages is not None and export.kind == "cuda" and not local
            pages = None
            if export.kind == "cuda" and not received and export.rebuild_args:
                IPC.forgo(export.rebuild_args)    # same process, or the map failed
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:   # a view is still alive: the GC unmaps it
                    pass
        t_checks = time.perf_counter()
        try:
            still = os.stat(claimed_path(export.ticket)).st_ino == inode
        except FileNotFoundError:
            still = False
        self.last_phases = {"map": t_copy - t_map, "copy": t_release - t_copy,
                            "release": t_checks - t_release,
                            "checks": (t_map - t_start) + (time.perf_counter() - t_checks)}
        if not still:
            raise self._gone(handle, while_reading=True)
        return out

    @staticmethod
    def _claim(handle: TransferHandle, export: SharedPages) -> int:
        """Win the transfer's one pull (rename its ticket); the claimed file's inode.
        TransferError when it was pulled already or is no longer staged."""
        claimed = claimed_path(export.ticket)
        try:
            os.rename(export.ticket, claimed)
            return os.stat(claimed).st_ino
        except FileNotFoundError as exc:
            if os.path.exists(claimed):
                raise TransferError(
                    f"transfer {handle.transfer_id} (request {handle.request_id}) was pulled "
                    "already: a staged cuda_ipc buffer is received once (torch's contract: one "
                    "receive per send); stage the pages again for another pull") from exc
            raise CudaIpcTransport._gone(handle) from exc

    @staticmethod
    def _map_cuda(handle: TransferHandle, export: SharedPages,
                  index: int | None) -> torch.Tensor:
        if index is None:                 # staged by this process: CUDA cannot open its own
            local = _LOCAL.get(handle.transfer_id)
            if local is None:
                raise CudaIpcTransport._gone(handle, while_reading=True)
            return local
        try:
            return IPC.open(export.rebuild_args, index)
        except RuntimeError as exc:
            raise TransferError(f"cannot map the CUDA IPC handle of {handle.transfer_id}: "
                                f"{exc}") from exc

    @staticmethod
    def _map_cpu(handle: TransferHandle, export: SharedPages
                 ) -> tuple[torch.Tensor, mmap.mmap]:
        try:
            fd = os.open(claimed_path(export.ticket), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CudaIpcTransport._gone(handle, while_reading=True) from exc
        try:
            if os.fstat(fd).st_size < handle.nbytes:
                raise TransferError(f"transfer {handle.transfer_id}: staged file is shorter "
                                    f"than the handle's {handle.nbytes} bytes")
            mapped = mmap.mmap(fd, handle.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        import warnings
        with warnings.catch_warnings():   # read-only mapping: only read from
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        return flat.view(torch_dtype(handle.dtype)).view(handle.shape), mapped

    @staticmethod
    def _gone(handle: TransferHandle, while_reading: bool = False) -> TransferError:
        when = "was released while being read" if while_reading else "is not staged"
        return TransferError(f"transfer {handle.transfer_id} (request {handle.request_id}) "
                             f"{when}: released, expired or never staged")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _keep_mapping(export: SharedPages, pages: torch.Tensor) -> None:
    """Keep a view of a pool segment mapped (its storage is the segment's), so the next
    transfer staged in it is received without a new map; the least recently used beyond
    MAX_MAPPED, and those of producers that exited, are let go."""
    key = (export.pid, export.segment)
    with _MAPPED_LOCK:
        known = key in _MAPPED
        _MAPPED[key] = pages
        _MAPPED.move_to_end(key)
        if known:          # a pull of a segment mapped already: nothing else changed
            return
        for old in [k for k in _MAPPED if k[0] != export.pid and not _alive(k[0])]:
            del _MAPPED[old]
        while len(_MAPPED) > MAX_MAPPED:
            _MAPPED.popitem(last=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release(staged: _Staged) -> None:
    """Unpublish first (late readers fail), then let the memory go. Whoever removes the
    ticket's name owns the export's one receive: when no pull claimed it, P forgoes it here."""
    export = staged.export
    try:
        os.unlink(export.ticket)
        unclaimed = True
    except FileNotFoundError:        # a pull claimed it (and receives it)
        unclaimed = False
        _unlink(claimed_path(export.ticket))
    if unclaimed and export.kind == "cuda" and export.rebuild_args:
        IPC.forgo(export.rebuild_args)
    staged.buffer = None   # type: ignore[assignment]
    if staged.mapped is not None:
        try:
            staged.mapped.close()
        except BufferError:   # a view is still alive somewhere: the GC will unmap it
            pass
    if staged.range is not None and staged.pool is not None:
        staged.pool.give(staged.range)   # after the unlink: a pull of it now fails its check
        staged.range = None
    elif export.kind == "cuda":
        IPC.collect()


def _release_all(staged: dict[str, _Staged]) -> None:
    for item in list(staged.values()):
        _release(item)
