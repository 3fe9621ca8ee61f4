"""Moving KV pages between workers: one interface (base.KVTransport), several transports
(object_store, shm, grpc, rdt, cuda_ipc), leases, and the producer/consumer ends that actors compose.

Names are imported lazily so that ``kvtransfer.lease`` stays importable without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KVTransport": "kvtransfer.base",
    "TransferError": "kvtransfer.base",
    "TransferHandle": "kvtransfer.base",
    "TransferResult": "kvtransfer.base",
    "TRANSPORT_NAMES": "kvtransfer.base",
    "make_transport": "kvtransfer.base",
    "KVProducer": "kvtransfer.endpoint",
    "KVConsumer": "kvtransfer.endpoint",
    "LeaseTable": "kvtransfer.lease",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
