"""Ray Direct Transport (RDT): the staged tensor travels actor to actor over a collective group
(gloo on CPU, nccl on GPU), routed by the process that created the group (the router).

How raypd's P/D flow uses it (workers/prefill_host.py, workers/decode_host.py,
router/orchestrator.py):

    # once, in the router's process, before any transfer:
    rdt.ensure_group([*prefill_actors, *decode_actors], backend="gloo")
    # per request, after P.prefill returned a PrefillResult whose handle is on "rdt":
    send = prefill.kv_send.options(tensor_transport="gloo")   # P: rdt.send_pages(producer, id)
    pages = send.remote(result.handle.transfer_id)            # an RDT ref, never fetched here
    decode.stream.remote(request_id, epoch, result, pages, sent_at=time.time())
    # D's stream gets the tensor as an argument: KVConsumer.accept(handle, pages) checks it
    # (check_arrived: shape, dtype, checksum), then D verifies the page checksums and lands it

Both actor classes are declared with ``enable_tensor_transport=True``. `route` and
`receive_pages` do the same for a plain producer / consumer pair (the transport benchmark).

Rules measured on Ray 2.60: the receiving class must have ``enable_tensor_transport=True`` or
the transfer hangs until the RDT timeout; the group must exist before ``kv_send`` is called;
only the process that created the group may route the ref; a transfer timeout kills both actors
and the group. An actor can be in one group per backend, so make one group for the whole pool.
Ray pairs a send with a receive by order only (no tags), and a threaded actor need not run its
transfer tasks in submission order: keep one transfer in flight per actor (the orchestrator holds
a lock per actor), or two transfers can swap and gloo aborts the receiver on the size mismatch.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtransfer.base import (
    KVTransport,
    TransferError,
    TransferHandle,
    TransferResult,
    as_bytes,
    dtype_name,
)

_GROUP_BACKEND = {"gloo": "torch_gloo", "torch_gloo": "torch_gloo", "nccl": "nccl"}
_TENSOR_TRANSPORT = {"gloo": "gloo", "torch_gloo": "gloo", "nccl": "nccl"}
_groups_lock = threading.Lock()


def default_backend() -> str:
    """Return "nccl" where this process sees a GPU, else "gloo" (call it where the actors run)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class PoolDevice:
    """Where one worker's KV pool lives, as the worker reports it (``pool_device``)."""

    kind: str                # "cuda" or "cpu"
    gpu: str = ""            # cuda: the physical GPU (its UUID, else "<node>:<physical index>")
    worker: str = ""         # the worker's id, for messages

    @classmethod
    def from_info(cls, info: dict) -> PoolDevice:
        """From a worker's ``info()`` (keys "device", "gpu", "worker_id")."""
        return cls(info.get("device", "cpu"), info.get("gpu", ""), info.get("worker_id", ""))


def pool_device(device: torch.device, worker: str = "") -> PoolDevice:
    """This process's description of the KV pool on ``device``: a GPU is named by its UUID
    (the same name in every process, whatever its CUDA_VISIBLE_DEVICES), else by node and
    physical index (CUDA_VISIBLE_DEVICES mapped back)."""
    if device.type != "cuda":
        return PoolDevice(device.type, worker=worker)
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        gpu = str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError):
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                   if v.strip()]
        gpu = f"{socket.gethostname()}:{visible[index] if index < len(visible) else index}"
    return PoolDevice("cuda", gpu, worker)


def backend_for_devices(devices: Sequence[str | PoolDevice]) -> str:
    """The collective backend for pages living on `devices` (the workers' KV pools, as they
    report them; a bare string is a device kind): nccl for cuda tensors, gloo for CPU tensors.
    GPUs reserved for a worker do not decide it: where its pool really is does. Mixed devices
    cannot share one group (ValueError), and neither can two workers on one GPU under nccl
    (NCCL refuses two ranks on one device; ValueError naming cuda_ipc, the transport for
    workers sharing a GPU)."""
    pools = [d if isinstance(d, PoolDevice) else PoolDevice(d) for d in devices]
    kinds = {p.kind for p in pools} or {"cpu"}
    if len(kinds) > 1:
        raise ValueError(f"rdt needs every worker's KV pool on one kind of device, got "
                         f"{', '.join(sorted(kinds))}; use device 'cuda' everywhere, or "
                         "another transport")
    if kinds != {"cuda"}:
        return "gloo"
    on_gpu: dict[str, list[str]] = {}
    for i, p in enumerate(pools):
        if p.gpu:
            on_gpu.setdefault(p.gpu, []).append(p.worker or f"worker #{i}")
    shared = {gpu: names for gpu, names in on_gpu.items() if len(names) > 1}
    if shared:
        gpu, names = next(iter(shared.items()))
        raise ValueError(f"rdt over nccl cannot serve workers that share a GPU ({', '.join(names)} "
                         f"are all on GPU {gpu}): NCCL refuses two ranks on one device; use "
                         "transport 'cuda_ipc' for workers on one GPU (or give each worker a "
                         "GPU of its own)")
    return "nccl"


def ensure_group(actors: Sequence[Any], backend: str = "gloo"):
    """Return the collective group holding all ``actors`` for ``backend``, creating it once.

    Idempotent per set of actors. Since an actor can join only one group per backend, actors
    that already sit in other groups are merged: those groups are destroyed and one group over
    the union is made. Merge only while no transfer is in flight (e.g. at scale-out).
    """
    from ray.experimental import collective

    group_backend = _group_backend(backend)
    actors = list(actors)
    with _groups_lock:
        existing = collective.get_collective_groups(actors, backend=group_backend)
        if existing:
            return existing[0]
        members = {a._ray_actor_id: a for a in actors}
        for actor in actors:
            for group in collective.get_collective_groups([actor], backend=group_backend):
                members.update({a._ray_actor_id: a for a in group.actors})
                collective.destroy_collective_group(group)
        return collective.create_collective_group(list(members.values()), backend=group_backend)


def route(
    producer: Any,
    consumer: Any,
    handle: TransferHandle,
    *args: Any,
    backend: str = "gloo",
    send_method: str = "kv_send",
    recv_method: str = "kv_recv",
    **kwargs: Any,
):
    """Send the staged pages of ``handle`` from ``producer`` to ``consumer``; returns the ref of
    ``consumer.<recv_method>(handle, pages, *args, sent_at=..., **kwargs)``."""
    sent_at = time.time()
    send = getattr(producer, send_method).options(tensor_transport=_tensor_transport(backend))
    pages_ref = send.remote(handle.transfer_id)
    return getattr(consumer, recv_method).remote(
        handle, pages_ref, *args, sent_at=sent_at, **kwargs
    )


def send_pages(producer: Any, transfer_id: str) -> torch.Tensor:
    """Body of the producer's ``kv_send``: the staged tensor (``producer`` is a KVProducer)."""
    return producer.take(transfer_id)


def receive_pages(
    consumer: Any,
    handle: TransferHandle,
    pages: torch.Tensor,
    kv_cache: torch.Tensor | None = None,
    dest_block_ids: Sequence[int] | None = None,
    sent_at: float | None = None,
) -> TransferResult:
    """Body of the consumer's ``kv_recv`` (``consumer`` is a KVConsumer): check the arrived
    tensor against the handle and scatter it into ``kv_cache`` when given."""
    return consumer.accept(handle, pages, kv_cache, dest_block_ids, sent_at=sent_at)


def check_arrived(handle: TransferHandle, pages: torch.Tensor) -> None:
    """The tensor that RDT delivered matches the handle (shape, dtype, checksum)."""
    if tuple(pages.shape) != tuple(handle.shape) or dtype_name(pages.dtype) != handle.dtype:
        raise TransferError(
            f"transfer {handle.transfer_id}: received {tuple(pages.shape)} {pages.dtype}, "
            f"handle says {handle.shape} {handle.dtype}"
        )
    if handle.checksum is not None:
        KVTransport._verify(handle, as_bytes(pages.detach().to("cpu").contiguous()))


class RdtTransport(KVTransport):
    """Keeps staged tensors (on their device) for ``take``; nothing is pulled: see ``route``."""

    name = "rdt"

    def _to_host(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.detach().contiguous()  # stays on its device: nccl sends GPU tensors

    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        if self.checksum:
            checksum, algo = self._checksum_of(as_bytes(pages.to("cpu")))
            handle = replace(handle, checksum=checksum, checksum_algo=algo)
        self._keep(handle.transfer_id, pages)
        return handle

    def take(self, transfer_id: str) -> torch.Tensor:
        return self._kept(transfer_id)

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        raise TransferError(
            f"rdt transfer {handle.transfer_id} cannot be pulled: the orchestrator sends it with "
            "kvtransfer.rdt.route(producer, consumer, handle, ...)"
        )


def _group_backend(backend: str) -> str:
    if backend not in _GROUP_BACKEND:
        raise ValueError(f"unknown RDT backend {backend!r}; valid: gloo, nccl")
    return _GROUP_BACKEND[backend]


def _tensor_transport(backend: str) -> str:
    _group_backend(backend)
    return _TENSOR_TRANSPORT[backend]
