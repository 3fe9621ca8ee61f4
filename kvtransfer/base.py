"""The one KV transfer interface: a picklable handle, a result, an error, and the abstract transport.

A transport moves a contiguous page tensor ``[num_layers, 2, n, block_size, num_kv_heads,
head_dim]`` from the prefill actor (producer side: ``stage`` / ``release``) to the decode actor
(consumer side: ``fetch`` / ``fetch_into``). Staged data is a private copy owned by the transport
until ``release(transfer_id)``; the handle is plain data that the orchestrator passes on.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import socket
import threading
import uuid
import warnings
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protocol.messages import TransferHandle

DEFAULT_MAX_TOTAL_BYTES = 4 << 30  # one transfer; a 4 GiB prefix is ~32k tokens of a 7B model
CHECKSUM_ALGO = "crc32"  # zlib.crc32: ~6 GB/s on this machine's CPU


class TransferError(RuntimeError):
    """Any failed transfer: missing or expired transfer, checksum mismatch, oversized frame,
    timeout, unreachable producer, wrong node for the transport."""


@dataclass(frozen=True)
class TransferResult:
    """What one pull cost, for the request's lifecycle record."""

    transfer_id: str
    request_id: str
    transport: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------------------
# small helpers shared by the transports


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in transfer handle")
    return dtype


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view over a contiguous CPU tensor (no copy, any dtype incl. bfloat16)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def from_bytes(buf: Any, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Reinterpret a buffer as a tensor without copying. The tensor shares the buffer's memory."""
    with warnings.catch_warnings():  # read-only buffers: callers only read from these views
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(torch_dtype(dtype)).reshape(tuple(shape))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def crc32(buf: Any, value: int = 0) -> int:
    return zlib.crc32(buf, value)


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """``kv_cache[:, :, block_ids]`` as a new contiguous tensor (a contiguous run is one copy)."""
    ids = list(block_ids)
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return kv_cache[:, :, ids[0] : ids[0] + len(ids)].clone(
            memory_format=torch.contiguous_format
        )
    index = torch.as_tensor(ids, dtype=torch.long, device=kv_cache.device)
    return torch.index_select(kv_cache, 2, index)


def check_fits(
    kv_cache: torch.Tensor, dest_block_ids: Sequence[int], shape: Sequence[int], dtype: str
) -> list[int]:
    """Raise TransferError unless pages of ``shape``/``dtype`` fit ``kv_cache[:, :, ids]``."""
    ids = list(dest_block_ids)
    shape = tuple(shape)
    if len(ids) != shape[2]:
        raise TransferError(f"{len(ids)} destination blocks for {shape[2]} received blocks")
    if tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:]) != shape[:2] + shape[3:]:
        raise TransferError(
            f"received pages of shape {shape} do not fit kv_cache {tuple(kv_cache.shape)}"
        )
    if dtype_name(kv_cache.dtype) != dtype:
        raise TransferError(f"received {dtype} pages for a {kv_cache.dtype} kv_cache")
    if ids and (min(ids) < 0 or max(ids) >= kv_cache.shape[2]):
        raise TransferError(f"destination block ids out of range [0, {kv_cache.shape[2]})")
    return ids


def scatter_blocks(kv_cache: torch.Tensor, dest_block_ids: Sequence[int], pages: torch.Tensor):
    """``kv_cache[:, :, dest_block_ids] = pages``; a contiguous run of ids is a plain copy_."""
    ids = check_fits(kv_cache, dest_block_ids, pages.shape, dtype_name(pages.dtype))
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        kv_cache[:, :, ids[0] : ids[0] + len(ids)].copy_(pages)
    else:
        index = torch.as_tensor(ids, dtype=torch.long, device=kv_cache.device)
        kv_cache.index_copy_(2, index, pages.to(kv_cache.device))


def current_ids() -> tuple[str, str]:
    """(worker id, node id) of this process: the Ray actor/worker and node when inside Ray."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            worker = ctx.get_actor_id() or ctx.get_worker_id()
            return str(worker), str(ctx.get_node_id())
    except Exception:  # pragma: no cover - Ray missing or half started: fall back to the host
        pass
    return f"pid-{os.getpid()}", socket.gethostname()


# ---------------------------------------------------------------------------------------------


class KVTransport(ABC):
    """Moves staged page tensors from one producer process to consumers.

    Producer side (inside the prefill actor): ``stage`` / ``stage_blocks`` make pages available
    and keep them until ``release``. ``take`` returns the staged tensor (the RDT send path).
    Consumer side (inside the decode actor): ``fetch`` returns a tensor the caller owns;
    ``fetch_into`` scatters straight into the caller's kv_cache, skipping intermediate copies
    where the transport can. Every failure raises ``TransferError``.
    """

    name: str = ""

    def __init__(
        self,
        *,
        checksum: bool = False,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        timeout_s: float = 30.0,
        worker_id: str | None = None,
        node_id: str | None = None,
    ):
        self.checksum = checksum
        self.max_total_bytes = int(max_total_bytes)
        self.timeout_s = float(timeout_s)
        default_worker, default_node = current_ids()
        self.worker_id = worker_id or default_worker
        self.node_id = node_id or default_node
        self._lock = threading.Lock()
        self._staged: dict[str, Any] = {}   # transfer_id -> what this transport keeps for it

    # -- producer side ------------------------------------------------------------------------

    def stage(
        self, request_id: str, pages: torch.Tensor, block_hashes: Sequence[int]
    ) -> TransferHandle:
        """Make ``pages`` pullable; the transport keeps its own copy (or, for grpc and rdt, a
        reference: do not write into ``pages`` until release) until ``release``."""
        self._check_pages(tuple(pages.shape), pages.dtype, block_hashes)
        handle = self._new_handle(request_id, tuple(pages.shape), pages.dtype, block_hashes)
        return self._stage(handle, self._to_host(pages))

    def stage_blocks(
        self,
        request_id: str,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
    ) -> TransferHandle:
        """Stage ``kv_cache[:, :, block_ids]``; the gather makes a private copy, so the caller's
        blocks may be reused as soon as this returns."""
        return self.stage(request_id, gather_blocks(kv_cache, block_ids), block_hashes)

    def _keep(self, transfer_id: str, item: Any) -> None:
        with self._lock:
            self._staged[transfer_id] = item

    def _kept(self, transfer_id: str) -> Any:
        """What `_keep` stored for this transfer; TransferError when it is not staged (any
        more). The caller holds the item, so a concurrent release cannot free it under it."""
        with self._lock:
            item = self._staged.get(transfer_id)
        if item is None:
            raise TransferError(
                f"transfer {transfer_id} is not staged here: released, expired or never staged"
            )
        return item

    def release(self, transfer_id: str) -> bool:
        """Drop a staged transfer; True if it was staged. Releasing twice is harmless."""
        with self._lock:
            return self._staged.pop(transfer_id, None) is not None

    def take(self, transfer_id: str) -> torch.Tensor:
        """The staged tensor itself (no copy); the RDT send path returns it from an actor method."""
        raise TransferError(f"transport {self.name!r} does not hand out staged tensors")

    def staged_ids(self) -> list[str]:
        """Transfer ids currently staged here."""
        with self._lock:
            return list(self._staged)

    # -- consumer side ------------------------------------------------------------------------

    @abstractmethod
    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        """Pull the pages of ``handle``; the returned tensor is the caller's to keep and write."""

    def fetch_into(
        self, handle: TransferHandle, kv_cache: torch.Tensor, dest_block_ids: Sequence[int]
    ) -> None:
        """Pull the pages of ``handle`` and scatter them into ``kv_cache[:, :, dest_block_ids]``."""
        scatter_blocks(kv_cache, dest_block_ids, self._fetch_view(handle))

    def _fetch_view(self, handle: TransferHandle) -> torch.Tensor:
        """Like fetch, but may return a read-only view (only read by fetch_into)."""
        return self.fetch(handle)

    def close(self) -> None:
        """Release everything staged and stop background services."""
        for transfer_id in self.staged_ids():
            self.release(transfer_id)

    # -- shared implementation ----------------------------------------------------------------

    @abstractmethod
    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        """Keep ``pages`` (contiguous, host unless rdt) under ``handle.transfer_id`` (usually
        with ``_keep``: the base class's ``release`` / ``staged_ids`` / ``_kept`` read that
        table); return the handle completed with checksum and transport-specific fields."""

    def _to_host(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.detach().to("cpu").contiguous()

    def _check_pages(
        self, shape: tuple[int, ...], dtype: torch.dtype, block_hashes: Sequence[int]
    ) -> None:
        if len(shape) < 3:
            raise TransferError(f"pages must be [num_layers, 2, n, ...], got {shape}")
        if shape[2] != len(block_hashes):
            raise TransferError(f"{shape[2]} staged blocks but {len(block_hashes)} block hashes")
        nbytes = _nbytes(shape, dtype)
        if nbytes == 0:
            raise TransferError("empty transfer: no pages to stage")
        if nbytes > self.max_total_bytes:
            raise TransferError(
                f"transfer of {nbytes} bytes exceeds max_total_bytes={self.max_total_bytes}"
            )

    def _new_handle(
        self,
        request_id: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        block_hashes: Sequence[int],
    ) -> TransferHandle:
        return TransferHandle(
            transfer_id=uuid.uuid4().hex,
            request_id=str(request_id),
            transport=self.name,
            producer_id=self.worker_id,
            node_id=self.node_id,
            block_hashes=tuple(int(h) for h in block_hashes),
            shape=tuple(shape),
            dtype=dtype_name(dtype),
            nbytes=_nbytes(shape, dtype),
        )

    def _checksum_of(self, data: Any) -> tuple[int | None, str | None]:
        if not self.checksum:
            return None, None
        return crc32(data), CHECKSUM_ALGO

    def _check_handle(self, handle: TransferHandle) -> None:
        if handle.transport != self.name:
            raise TransferError(
                f"handle of transport {handle.transport!r} given to the {self.name!r} transport"
            )
        if handle.nbytes > self.max_total_bytes:
            raise TransferError(
                f"transfer {handle.transfer_id} of {handle.nbytes} bytes exceeds "
                f"max_total_bytes={self.max_total_bytes}"
            )

    @staticmethod
    def _verify(handle: TransferHandle, data: Any, crc: int | None = None) -> None:
        if handle.checksum is None:
            return
        if handle.checksum_algo != CHECKSUM_ALGO:
            raise TransferError(f"unsupported checksum algorithm {handle.checksum_algo!r}")
        got = crc32(data) if crc is None else crc
        if got != handle.checksum:
            raise TransferError(
                f"checksum mismatch for transfer {handle.transfer_id} (request "
                f"{handle.request_id}): expected crc32 {handle.checksum:#010x}, got {got:#010x}; "
                "the pages were corrupted in staging or on the wire"
            )


# ---------------------------------------------------------------------------------------------

_TRANSPORTS = {
    "cuda_ipc": ("kvtransfer.cuda_ipc", "CudaIpcTransport"),
    "grpc": ("kvtransfer.grpc_pages", "GrpcTransport"),
    "object_store": ("kvtransfer.object_store", "ObjectStoreTransport"),
    "rdt": ("kvtransfer.rdt", "RdtTransport"),
    "shm": ("kvtransfer.shm", "ShmTransport"),
}
TRANSPORT_NAMES = tuple(sorted(_TRANSPORTS))


SET_BY_WORKER = frozenset({"worker_id", "node_id"})   # a worker fills these in itself


def transport_options(name: str) -> frozenset[str]:
    """The options (`transfer.options` keys) transport `name` takes: its constructor's keyword
    arguments and KVTransport's, less the ones a worker sets itself."""
    module, cls = _TRANSPORTS[name]
    names: set[str] = set()
    for klass in getattr(importlib.import_module(module), cls).__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or init is None:
            continue
        names |= {p.name for p in inspect.signature(init).parameters.values()
                  if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"}
    return frozenset(names - SET_BY_WORKER)


def make_transport(name: str, **cfg: Any) -> KVTransport:
    """Build a transport by name: one of TRANSPORT_NAMES; ``cfg`` goes to its constructor."""
    if name not in _TRANSPORTS:
        raise ValueError(
            f"unknown KV transport {name!r}; valid names: {', '.join(TRANSPORT_NAMES)}"
        )
    module, cls = _TRANSPORTS[name]
    return getattr(importlib.import_module(module), cls)(**cfg)
