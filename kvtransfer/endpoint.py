"""The two ends actors compose: KVProducer (prefill: stage under a lease) and KVConsumer
(decode: pull, measure, scatter).

Invariant: every offered transfer is released by the transport exactly once, when its lease
ends by ack, abort, expiry or ``close`` (or at once, when its lease cannot start); the
caller's ``on_release(transfer_id, reason)`` runs then. After that release nothing here or in
the transport refers to the staged pages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtransfer.base import (
    KVTransport,
    TransferError,
    TransferHandle,
    TransferResult,
    make_transport,
    scatter_blocks,
)
from kvtransfer.lease import LeaseTable, ReleaseCallback


@dataclass(frozen=True)
class ProducerStats:
    offered: int
    bytes_staged: int
    active: int
    acked: int
    aborted: int
    expired: int


@dataclass(frozen=True)
class ConsumerStats:
    transfers: int
    bytes_received: int
    seconds: float


def _transport(transport: KVTransport | str, cfg: dict[str, Any]) -> KVTransport:
    if isinstance(transport, KVTransport):
        if cfg:
            raise ValueError("transport config given with an already built transport")
        return transport
    return make_transport(transport, **cfg)


class KVProducer:
    """Prefill side. ``offer`` stages pages and leases them; ``ack``/``abort``/``expire`` end the
    lease and release the staging. Expiry runs lazily on every offer and ack, or when the owner
    calls ``expire()`` from its loop. All methods return plain data, so they can back actor
    methods directly."""

    def __init__(
        self,
        transport: KVTransport | str,
        lease_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        **transport_cfg: Any,
    ):
        self.transport = _transport(transport, transport_cfg)
        self.leases = LeaseTable(lease_s, on_release=self._release_staging, clock=clock)
        self._lock = threading.Lock()
        self._offered = 0
        self._bytes_staged = 0

    def offer(
        self,
        request_id: str,
        pages: torch.Tensor,
        block_hashes: Sequence[int],
        on_release: ReleaseCallback | None = None,
        lease_s: float | None = None,
    ) -> TransferHandle:
        """Stage ``pages`` ([num_layers, 2, n, ...], one hash per block) under a new lease.
        If this raises (TransferError), nothing was staged or leased."""
        self.expire()
        return self._lease(
            self.transport.stage(request_id, pages, block_hashes), on_release, lease_s
        )

    def offer_blocks(
        self,
        request_id: str,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        on_release: ReleaseCallback | None = None,
        lease_s: float | None = None,
    ) -> TransferHandle:
        """Stage ``kv_cache[:, :, block_ids]``; the staged copy is private, so the blocks
        themselves need no pin for the transfer's sake."""
        self.expire()
        handle = self.transport.stage_blocks(request_id, kv_cache, block_ids, block_hashes)
        return self._lease(handle, on_release, lease_s)

    def ack(self, transfer_id: str) -> bool:
        """The consumer has the pages. False if the lease had already ended (harmless)."""
        released = self.leases.ack(transfer_id)
        self.expire()
        return released

    def abort(self, transfer_id: str) -> bool:
        return self.leases.abort(transfer_id)

    def expire(self, now: float | None = None) -> list[str]:
        return self.leases.expire(now)

    def take(self, transfer_id: str) -> torch.Tensor:
        """The staged tensor of a leased transfer (RDT send path)."""
        if transfer_id not in self.leases:
            raise TransferError(
                f"transfer {transfer_id} has no lease here: acked, aborted, expired or unknown"
            )
        return self.transport.take(transfer_id)

    def stats(self) -> ProducerStats:
        with self._lock:
            offered, staged = self._offered, self._bytes_staged
        return ProducerStats(
            offered=offered,
            bytes_staged=staged,
            active=len(self.leases),
            acked=self.leases.acked_total,
            aborted=self.leases.aborted_total,
            expired=self.leases.expired_total,
        )

    def close(self) -> None:
        """Abort every lease (callbacks run) and close the transport."""
        for transfer_id in self.leases.active():
            self.leases.abort(transfer_id)
        self.transport.close()

    def _lease(
        self, handle: TransferHandle, on_release: ReleaseCallback | None, lease_s: float | None
    ) -> TransferHandle:
        """Lease a staged transfer; if the lease cannot start, the staging is released here
        (a staged copy exists only under a lease: nothing else would ever release it)."""
        lease_s = self.leases.lease_s if lease_s is None else float(lease_s)
        try:
            self.leases.pin(handle.transfer_id, on_release, lease_s)
        except BaseException:
            self.transport.release(handle.transfer_id)
            raise
        with self._lock:
            self._offered += 1
            self._bytes_staged += handle.nbytes
        return replace(handle, lease_s=lease_s)

    def _release_staging(self, transfer_id: str, reason: str) -> None:
        self.transport.release(transfer_id)


class KVConsumer:
    """Decode side. Pulls by the transport named in each handle (``transport`` is the one built
    up front with ``cfg``; others are built on first use with defaults) and records cost."""

    def __init__(self, transport: KVTransport | str | None = None, **transport_cfg: Any):
        self._transports: dict[str, KVTransport] = {}
        if transport is not None:
            built = _transport(transport, transport_cfg)
            self._transports[built.name] = built
        self._lock = threading.Lock()
        self._transfers = 0
        self._bytes = 0
        self._seconds = 0.0

    def transport_for(self, handle: TransferHandle) -> KVTransport:
        with self._lock:
            transport = self._transports.get(handle.transport)
            if transport is None:
                transport = make_transport(handle.transport)
                self._transports[handle.transport] = transport
            return transport

    def pull(self, handle: TransferHandle) -> tuple[torch.Tensor, TransferResult]:
        """The pages as a tensor of the handle's shape and dtype, which the caller owns."""
        start = time.perf_counter()
        pages = self.transport_for(handle).fetch(handle)
        return pages, self._record(handle, time.perf_counter() - start)

    def pull_into(
        self, handle: TransferHandle, kv_cache: torch.Tensor, dest_block_ids: Sequence[int]
    ) -> TransferResult:
        """Pull and scatter into ``kv_cache[:, :, dest_block_ids]`` (fewest copies)."""
        start = time.perf_counter()
        self.transport_for(handle).fetch_into(handle, kv_cache, dest_block_ids)
        return self._record(handle, time.perf_counter() - start)

    def accept(
        self,
        handle: TransferHandle,
        pages: torch.Tensor,
        kv_cache: torch.Tensor | None = None,
        dest_block_ids: Sequence[int] | None = None,
        *,
        sent_at: float | None = None,
    ) -> TransferResult:
        """Pages delivered by RDT: verify them against the handle and scatter when asked.
        Seconds count from ``sent_at`` (wall clock, set by rdt.route) when given."""
        from kvtransfer.rdt import check_arrived

        start = time.perf_counter()
        check_arrived(handle, pages)
        if kv_cache is not None:
            scatter_blocks(kv_cache, dest_block_ids or [], pages)
        seconds = time.perf_counter() - start
        if sent_at is not None:
            seconds = max(seconds, time.time() - sent_at)
        return self._record(handle, seconds)

    def stats(self) -> ConsumerStats:
        with self._lock:
            return ConsumerStats(self._transfers, self._bytes, self._seconds)

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()

    def _record(self, handle: TransferHandle, seconds: float) -> TransferResult:
        with self._lock:
            self._transfers += 1
            self._bytes += handle.nbytes
            self._seconds += seconds
        return TransferResult(
            handle.transfer_id, handle.request_id, handle.transport, handle.nbytes, seconds
        )
