"""Leases on staged transfers: every pinned transfer is released exactly once, by ack, abort or
expiry, and the release callback says which. Torch-free and Ray-free.

Invariant: a transfer id is in the table from ``pin`` until its single release; the callbacks
run after it left the table and outside the lock, so they may call back into the table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ReleaseCallback = Callable[[str, str], None]  # (transfer_id, reason)

ACKED, EXPIRED, ABORTED = "acked", "expired", "aborted"


@dataclass
class Lease:
    transfer_id: str
    deadline: float
    on_release: ReleaseCallback | None


class LeaseTable:
    """Pins staged transfers until ack, abort or the lease deadline.

    ``on_release`` (table-wide) and the per-lease callback given to ``pin`` are both called with
    ``(transfer_id, reason)``; reason is "acked", "expired" or "aborted". Nothing runs on its own:
    call ``expire()`` regularly (the producer does so on every offer and ack). ``clock`` returns
    seconds and is injectable for tests.
    """

    def __init__(
        self,
        lease_s: float = 30.0,
        *,
        on_release: ReleaseCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = float(lease_s)
        self._on_release = on_release
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.acked_total = 0
        self.aborted_total = 0
        self.expired_total = 0

    def pin(
        self,
        transfer_id: str,
        on_release: ReleaseCallback | None = None,
        lease_s: float | None = None,
    ) -> float:
        """Start a lease; returns its deadline on the table's clock."""
        deadline = self._clock() + (self.lease_s if lease_s is None else float(lease_s))
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"transfer {transfer_id} is already leased")
            self._leases[transfer_id] = Lease(transfer_id, deadline, on_release)
        return deadline

    def ack(self, transfer_id: str) -> bool:
        """The consumer has the pages: release. False if unknown or already released."""
        return self._release([transfer_id], ACKED) == [transfer_id]

    def abort(self, transfer_id: str) -> bool:
        """Give up on the transfer (client abort, consumer death): release."""
        return self._release([transfer_id], ABORTED) == [transfer_id]

    def expire(self, now: float | None = None) -> list[str]:
        """Release every lease whose deadline has passed; returns their transfer ids."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [tid for tid, lease in self._leases.items() if lease.deadline <= now]
        return self._release(due, EXPIRED)

    def deadline(self, transfer_id: str) -> float | None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            return None if lease is None else lease.deadline

    def active(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._leases

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _release(self, transfer_ids: list[str], reason: str) -> list[str]:
        released: list[Lease] = []
        with self._lock:
            for tid in transfer_ids:
                lease = self._leases.pop(tid, None)
                if lease is not None:
                    released.append(lease)
            counter = f"{reason}_total"
            setattr(self, counter, getattr(self, counter) + len(released))
        first_error: BaseException | None = None
        for lease in released:  # every callback runs even if one fails; the first error surfaces
            for callback in (self._on_release, lease.on_release):
                if callback is None:
                    continue
                try:
                    callback(lease.transfer_id, reason)
                except Exception as exc:
                    log.exception("on_release(%s, %s) failed", lease.transfer_id, reason)
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return [lease.transfer_id for lease in released]
