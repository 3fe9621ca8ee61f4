"""The fallback transport: pages as one uint8 numpy array in the Ray object store (any node).

A numpy array is stored raw and read back zero-copy from shared memory, unlike a pickled torch
tensor. Release drops the producer's reference; a consumer still holding the handle keeps the
(immutable) copy alive until the handle is gone, so a late fetch after expiry still returns
correct pages instead of failing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import ray
import torch

from kvtransfer.base import KVTransport, TransferError, TransferHandle, as_bytes, from_bytes


class ObjectStoreTransport(KVTransport):
    name = "object_store"

    def _stage(self, handle: TransferHandle, pages: torch.Tensor) -> TransferHandle:
        data = as_bytes(pages)
        checksum, algo = self._checksum_of(data)
        ref = ray.put(data)
        self._keep(handle.transfer_id, ref)   # our reference keeps the object alive
        return replace(handle, checksum=checksum, checksum_algo=algo, object_ref=ref)

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        return self._fetch_view(handle).clone()  # the object store copy is read-only

    def _fetch_view(self, handle: TransferHandle) -> torch.Tensor:
        self._check_handle(handle)
        if handle.object_ref is None:
            raise TransferError(f"object_store handle {handle.transfer_id} carries no object ref")
        try:
            data = ray.get(handle.object_ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TransferError(
                f"timed out after {self.timeout_s}s fetching transfer {handle.transfer_id}"
            ) from exc
        except ray.exceptions.RayError as exc:
            raise TransferError(
                f"transfer {handle.transfer_id} is gone from the object store "
                f"(producer {handle.producer_id} died or the object was lost): {exc}"
            ) from exc
        if not isinstance(data, np.ndarray) or data.nbytes != handle.nbytes:
            raise TransferError(
                f"transfer {handle.transfer_id}: expected {handle.nbytes} bytes, got "
                f"{getattr(data, 'nbytes', type(data).__name__)}"
            )
        self._verify(handle, data)
        return from_bytes(data, handle.dtype, handle.shape)
