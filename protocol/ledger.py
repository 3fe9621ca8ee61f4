"""The handoff ledger: every block held for a P/D handoff, who owns it, its lease, why it was let go.

Two kinds of hold: P's staged pages (STAGED, under a transfer lease) and D's reserved blocks
awaiting those pages (RESERVED, until they are filled or given up). Each worker keeps a ledger
of its own holds; the router keeps one of both sides, fed by the workers' answers and their
load reports, so a worker that dies still answers for what it held: a hold nobody closed is
a leak, whether its worker lives or not.

Invariants (check_invariants): a hold is opened once and released at most once, with a reason;
opened == released + open, per kind, in holds and in blocks.

The router learns of a release from whichever answer comes first: a worker's load report can
tell of a lease that ran out before the router's own thread has opened that hold (a slow
router). Such an early release is remembered (a bounded set of recent keys) and closes the hold
as it is opened, with the worker's reason, so it is not left open for ever.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

STAGED, RESERVED = "staged", "reserved"

# why a hold ended
FILLED = "filled"                  # D: the pages landed; the blocks belong to the running request
ACKED = "acked"                    # P: D has the pages
ABORTED = "aborted"                # client abort, or the router gave the attempt up
EXPIRED = "expired"                # the lease ran out (D never pulled, ack lost, deadline passed)
TRANSFER_FAILED = "transfer_failed"  # the pull failed or was rejected; the attempt goes on
FALLBACK_LOCAL = "fallback_local"  # D prefills it itself (no prefill worker left, or the
                                   # pool's backlog is longer: router/local_prefill.py)
PREFILL_FAILED = "prefill_failed"  # P failed before staging
WORKER_DIED = "worker_died"        # the holding worker is gone (its memory with it)
RELEASE_REASONS = (FILLED, ACKED, ABORTED, EXPIRED, TRANSFER_FAILED, FALLBACK_LOCAL,
                   PREFILL_FAILED, WORKER_DIED)


@dataclass
class Hold:
    worker_id: str
    kind: str
    request_id: str            # worker-side id of the attempt (request id + epoch)
    num_blocks: int
    lease_deadline: float      # on the ledger's clock
    opened_at: float
    released: str | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.worker_id, self.kind, self.request_id)


EARLY_KEEP = 4096


class HandoffLedger:
    """Thread-safe. `clock` is injectable (tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_release: Callable[[Hold], None] | None = None) -> None:
        """`on_release(hold)` runs after each release, outside the lock."""
        self._clock = clock
        self._on_release = on_release
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str, str], Hold] = {}
        # releases of holds not open (yet): key -> reason, the most recent EARLY_KEEP
        self._early: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self.opened: Counter[str] = Counter()          # kind -> holds opened
        self.opened_blocks: Counter[str] = Counter()   # kind -> blocks
        self.released: Counter[str] = Counter()        # reason -> holds released
        self.released_blocks: Counter[str] = Counter()  # reason -> blocks
        self._released_by_kind: Counter[str] = Counter()
        self._released_blocks_by_kind: Counter[str] = Counter()

    def hold(self, worker_id: str, kind: str, request_id: str, num_blocks: int,
             lease_s: float) -> Hold:
        assert kind in (STAGED, RESERVED), kind
        assert num_blocks >= 0, num_blocks
        now = self._clock()
        h = Hold(worker_id, kind, request_id, num_blocks, now + lease_s, now)
        with self._lock:
            assert h.key not in self._open, f"hold {h.key} is already open"
            self._open[h.key] = h
            self.opened[kind] += 1
            self.opened_blocks[kind] += num_blocks
            early = self._early.pop(h.key, None)
        if early is not None:              # released before it was opened here
            self.release(worker_id, kind, request_id, early)
        return h

    def release(self, worker_id: str, kind: str, request_id: str, reason: str) -> Hold | None:
        """Close a hold; None (and nothing counted) when it is not open: released twice is
        harmless, the first reason stays."""
        assert reason in RELEASE_REASONS, reason
        with self._lock:
            key = (worker_id, kind, request_id)
            h = self._open.pop(key, None)
            if h is None:
                self._early.setdefault(key, reason)
                while len(self._early) > EARLY_KEEP:
                    self._early.popitem(last=False)
                return None
            h.released = reason
            self.released[reason] += 1
            self.released_blocks[reason] += h.num_blocks
            self._released_by_kind[kind] += 1
            self._released_blocks_by_kind[kind] += h.num_blocks
        if self._on_release is not None:
            self._on_release(h)
        return h

    def is_open(self, worker_id: str, kind: str, request_id: str) -> bool:
        with self._lock:
            return (worker_id, kind, request_id) in self._open

    def open_holds(self, worker_id: str | None = None) -> list[Hold]:
        with self._lock:
            return [h for h in self._open.values() if worker_id in (None, h.worker_id)]

    def held_blocks(self, worker_id: str | None = None) -> int:
        return sum(h.num_blocks for h in self.open_holds(worker_id))

    def due(self, now: float | None = None) -> list[Hold]:
        """Open holds whose lease has run out."""
        now = self._clock() if now is None else now
        return [h for h in self.open_holds() if h.lease_deadline <= now]

    def counters(self) -> dict[str, int]:
        """Released holds per reason (`released_<reason>`) and open holds / blocks."""
        with self._lock:
            out = {f"released_{r}": self.released[r] for r in RELEASE_REASONS}
            out["open_holds"] = len(self._open)
            out["open_blocks"] = sum(h.num_blocks for h in self._open.values())
        return out

    def check_invariants(self) -> None:
        with self._lock:
            for kind in (STAGED, RESERVED):
                open_ = [h for h in self._open.values() if h.kind == kind]
                assert self.opened[kind] == self._released_by_kind[kind] + len(open_), kind
                assert self.opened_blocks[kind] == self._released_blocks_by_kind[kind] + sum(
                    h.num_blocks for h in open_), kind
            assert all(h.released is None for h in self._open.values())
