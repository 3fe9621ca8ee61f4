"""Same-node transport: each staged transfer is one file in /dev/shm; the producer writes it
through a persistent memory map and the consumer ``preadv``s it straight into its kv_cache, so
each side costs about one memcpy.

Files are reused: a released transfer's file is renamed back into a free pool (fresh tmpfs pages
cost 3-5x a copy; resident ones do not). The file name is the staging: the consumer opens the
transfer's path, reads, then checks that the path still names the inode it read; if the transfer
was released meanwhile (late reader after lease expiry), the read is refused with TransferError
because the file may already carry another transfer. Names are ``raypd-kv-<pid>-<transfer_id>``
and ``raypd-kv-<pid>-free<k>``; a producer that dies leaks its files until
``remove_stale_files`` runs.
"""

from __future__ import annotations

import itertools
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvcache.manager import cdiv
from kvtransfer.base import (
    KVTransport,
    TransferError,
    TransferHandle,
    as_bytes,
    check_fits,
    crc32,
    from_bytes,
    torch_dtype,
)

DEFAULT_DIR = "/dev/shm"
PREFIX = "raypd-kv"
SEGMENT_ALIGN = 2 << 20
IOV_BATCH = 512  # below IOV_MAX (1024 on Linux)


def remove_stale_files(directory: str = DEFAULT_DIR, prefix: str = PREFIX) -> list[str]:
    """Unlink transfer files (``<prefix>-<pid>-<name>``) whose producer pid no longer exists on
    this host."""
    removed = []
    for entry in os.scandir(directory):
        parts = entry.name.split("-")
        if not entry.name.startswith(prefix + "-") or len(parts) != 4 or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except FileNotFoundError:
                pass
        except PermissionError:  # alive, someone else's
            pass
    return removed


@dataclass
class _Segment:
    path: str
    capacity: int
    mapped: mmap.mmap
    flat: torch.Tensor  # uint8 view of the whole map

    def view(self, nbytes: int, dtype: str, shape: Sequence[int]) -> torch.Tensor:
        return self.flat[:nbytes].view(torch_dtype(dtype)).reshape(tuple(shape))

    def close(self) -> None:
        self.flat = None  # drop the buffer export before closing the map
        try:
            self.mapped.close()
        except BufferError:  # a view is still alive somewhere: the GC will unmap it
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmTransport(KVTransport):
    """``pool_bytes`` bounds the free segments kept for reuse (staged ones are not counted)."""

    name = "shm"

    def __init__(
        self,
        *,
        directory: str = DEFAULT_DIR,
        pool_bytes: int = 1 << 30,
        cleanup_stale: bool = True,
        **cfg,
    ):
        super().__init__(**cfg)
        self.directory = directory
        self.pool_bytes = int(pool_bytes)
        self._free: list[_Segment] = []
        self._names = itertools.count()
        if cleanup_stale:
            remove_stale_files(directory)
        # Unlink our files at interpreter exit too (a SIGKILLed process leaves them to the next
        # ShmTransport's stale-file cleanup).
        self._finalizer = weakref.finalize(self, _unlink_all, self._staged, self._free)

    # -- producer ---------------------------------------------------------------------------

    def _to_host(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.detach()  # copied straight into the segment from any device and layout

    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        segment = self._acquire(handle.nbytes)
        segment.view(handle.nbytes, handle.dtype, handle.shape).copy_(pages)
        return self._publish(handle, segment)

    def stage_blocks(
        self,
        request_id: str,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
    ) -> TransferHandle:
        """Gather ``kv_cache[:, :, block_ids]`` straight into the segment: one copy."""
        ids = list(block_ids)
        shape = (*kv_cache.shape[:2], len(ids), *kv_cache.shape[3:])
        self._check_pages(shape, kv_cache.dtype, block_hashes)
        handle = self._new_handle(request_id, shape, kv_cache.dtype, block_hashes)
        segment = self._acquire(handle.nbytes)
        out = segment.view(handle.nbytes, handle.dtype, handle.shape)
        if kv_cache.device.type == "cpu" and ids == list(range(ids[0], ids[0] + len(ids))):
            out.copy_(kv_cache[:, :, ids[0] : ids[0] + len(ids)])
        elif kv_cache.device.type == "cpu":
            torch.index_select(kv_cache, 2, torch.as_tensor(ids, dtype=torch.long), out=out)
        else:
            index = torch.as_tensor(ids, dtype=torch.long, device=kv_cache.device)
            out.copy_(torch.index_select(kv_cache, 2, index))
        return self._publish(handle, segment)

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            segment = self._staged.pop(transfer_id, None)
            if segment is None:
                return False
            free_path = os.path.join(
                self.directory, f"{PREFIX}-{os.getpid()}-free{next(self._names)}"
            )
            try:
                os.rename(segment.path, free_path)  # unpublish first: late readers now fail
            except FileNotFoundError:  # removed behind our back: forget the segment
                evicted = [segment]
            else:
                segment.path = free_path
                self._free.append(segment)
                evicted = self._trim_pool()
        for old in evicted:
            old.close()
        return True

    def close(self) -> None:
        super().close()
        with self._lock:
            free = list(self._free)
            self._free.clear()
        for segment in free:
            segment.close()

    def _acquire(self, nbytes: int) -> _Segment:
        with self._lock:
            fits = [s for s in self._free if s.capacity >= nbytes]
            if fits:
                best = min(fits, key=lambda s: s.capacity)
                self._free.remove(best)
                return best
        capacity = cdiv(nbytes, SEGMENT_ALIGN) * SEGMENT_ALIGN
        path = os.path.join(self.directory, f"{PREFIX}-{os.getpid()}-free{next(self._names)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, capacity)
                mapped = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
        except OSError as exc:
            raise TransferError(
                f"cannot allocate {capacity} bytes of shm in {path}: {exc}"
            ) from exc
        return _Segment(path, capacity, mapped, torch.frombuffer(mapped, dtype=torch.uint8))

    def _publish(self, handle: TransferHandle, segment: _Segment) -> TransferHandle:
        if self.checksum:
            checksum, algo = self._checksum_of(as_bytes(segment.flat[: handle.nbytes]))
            handle = replace(handle, checksum=checksum, checksum_algo=algo)
        path = os.path.join(self.directory, f"{PREFIX}-{os.getpid()}-{handle.transfer_id}")
        with self._lock:
            os.rename(segment.path, path)
            segment.path = path
            self._staged[handle.transfer_id] = segment
        return replace(handle, address=path)

    def _trim_pool(self) -> list[_Segment]:
        evicted = []
        self._free.sort(key=lambda s: s.capacity)
        while self._free and sum(s.capacity for s in self._free) > self.pool_bytes:
            evicted.append(self._free.pop())  # the largest first
        return evicted

    # -- consumer ---------------------------------------------------------------------------

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        out = torch.empty(handle.nbytes, dtype=torch.uint8)
        self._read(handle, [as_bytes(out)])
        return from_bytes(out.numpy(), handle.dtype, handle.shape)

    def fetch_into(
        self, handle: TransferHandle, kv_cache: torch.Tensor, dest_block_ids: Sequence[int]
    ) -> None:
        """``preadv`` straight into the kv_cache blocks (CPU, contiguous kv_cache)."""
        ids = check_fits(kv_cache, dest_block_ids, handle.shape, handle.dtype)
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return super().fetch_into(handle, kv_cache, ids)
        runs = []  # (destination start, length) of consecutive destination ids, in source order
        for dest in ids:
            if runs and runs[-1][0] + runs[-1][1] == dest:
                runs[-1][1] += 1
            else:
                runs.append([dest, 1])
        buffers = [
            as_bytes(kv_cache[layer, kv, start : start + length])
            for layer in range(kv_cache.shape[0])
            for kv in range(kv_cache.shape[1])
            for start, length in runs
        ]
        self._read(handle, buffers)

    def _read(self, handle: TransferHandle, buffers: list) -> None:
        """Fill ``buffers`` (in file order) from the staged file, then check it stayed staged."""
        self._check_handle(handle)
        if handle.node_id != self.node_id:
            raise TransferError(
                f"shm transfer {handle.transfer_id} was staged on node {handle.node_id} but this "
                f"process runs on node {self.node_id}; shm works within one node only, use the "
                "'grpc' or 'object_store' transport across nodes"
            )
        try:
            fd = os.open(handle.address, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise self._gone(handle) from exc
        try:
            size = os.fstat(fd).st_size
            if size < handle.nbytes:
                raise TransferError(
                    f"transfer {handle.transfer_id}: file has {size} bytes, handle says "
                    f"{handle.nbytes}"
                )
            _preadv_exact(fd, buffers)
            try:
                still_staged = os.stat(handle.address).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                still_staged = False
            if not still_staged:
                raise self._gone(handle, while_reading=True)
        finally:
            os.close(fd)
        if handle.checksum is not None:
            crc = 0
            for buffer in buffers:
                crc = crc32(buffer, crc)
            self._verify(handle, None, crc=crc)

    @staticmethod
    def _gone(handle: TransferHandle, while_reading: bool = False) -> TransferError:
        when = "was released while being read" if while_reading else "is not staged"
        return TransferError(
            f"transfer {handle.transfer_id} (request {handle.request_id}) {when} at "
            f"{handle.address}: released, expired or never staged"
        )


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _unlink_all(staged: dict[str, _Segment], free: list[_Segment]) -> None:
    for segment in [*staged.values(), *free]:
        try:
            os.unlink(segment.path)
        except OSError:
            pass


def _preadv_exact(fd: int, buffers: list) -> None:
    offset = 0
    for start in range(0, len(buffers), IOV_BATCH):
        batch = buffers[start : start + IOV_BATCH]
        want = sum(b.nbytes for b in batch)
        got = os.preadv(fd, batch, offset)
        if got != want:  # short read (not expected on tmpfs): finish buffer by buffer
            _pread_rest(fd, batch, offset, got)
        offset += want


def _pread_rest(fd: int, batch: list, offset: int, already: int) -> None:
    position = offset
    for buffer in batch:
        view = memoryview(buffer).cast("B")
        end = position + len(view)
        if end <= offset + already:
            position = end
            continue
        filled = max(0, offset + already - position)
        while filled < len(view):
            n = os.preadv(fd, [view[filled:]], position + filled)
            if n == 0:
                raise TransferError("shm transfer file ended early")
            filled += n
        position = end
