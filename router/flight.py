"""One request's flight through the workers, and how whatever it holds is released.

`Flight` says where a request is (its attempt, its decode and prefill workers, the transfer in
flight, P's ack), so an abort, a failure or the end can release it on both sides.
`AttemptClock` counts an attempt's actor round trips and the time spent waiting in them (the
rest is the router's own overhead). `DeliveredTokens` forwards streamed tokens to the client
once across re-runs, as text. `HandoffReleases` closes the router's ledger holds: by the worker's
confirmation, by a dead worker, by a report of a release the worker made on its own (a lease
that expired), or left to the lease when an ack got lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from frontend.output_text import OutputText, TextDelta
from protocol.ledger import (
    ABORTED,
    ACKED,
    RESERVED,
    STAGED,
    WORKER_DIED,
    HandoffLedger,
)
from protocol.messages import HoldRelease, TokenDelta

CLEANUP_WAIT_S = 10.0   # how long a request waits for workers to confirm a release


async def wait_ref(ref: Any, timeout: float | None = None) -> Any:
    """`ray.get(ref, timeout)` awaited on the router's loop (Ray's own errors as ray.get raises
    them; none in time: GetTimeoutError). The wait holds no thread."""
    fut = asyncio.wrap_future(ref.future())
    try:
        return await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        raise ray.exceptions.GetTimeoutError(
            f"no answer from the worker in {timeout:.1f} s") from None


@dataclass
class AttemptClock:
    """One attempt's handoff cost: actor round trips awaited, and the time spent waiting in
    them, until D's first token (the rest of the time is the router's own overhead)."""

    started: float = field(default_factory=time.perf_counter)
    round_trips: int = 0
    waited_s: float = 0.0

    async def get(self, ref: Any, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        self.round_trips += 1
        try:
            return await wait_ref(ref, timeout)
        finally:
            self.waited_s += time.perf_counter() - t0

    async def sleep(self, seconds: float) -> None:
        """Waiting for capacity is queueing, not the router's own work."""
        await asyncio.sleep(seconds)
        self.waited_s += seconds

    def overhead_ms(self) -> float:
        return max(0.0, time.perf_counter() - self.started - self.waited_s) * 1e3


@dataclass(frozen=True)
class MoveSignal:
    """An inbox item: move this request's running decode to another decode worker (`target`,
    or the policy's pick); `cause` says why (drain, kv_pressure, rebalance)."""

    target: str | None = None
    cause: str = "rebalance"


@dataclass
class Flight:
    """Where one request is, so an abort can release it everywhere, and a move can find it."""

    request_id: str
    epoch: int = 0
    last_epoch: int = 0        # the highest epoch any attempt or move (failed ones too) used
    attempt_id: str = ""       # the id workers know this attempt by (request id + epoch)
    decode: Any = None         # decode worker handle of this attempt
    prefill: Any = None        # prefill worker handle of this attempt
    transfer_id: str | None = None
    aborted: bool = False
    deadline: float | None = None   # wall clock
    ack: Any = None                 # P's ack in flight (settled when the request ends)
    predicted_hit_tokens: int = 0   # the router's predicted prefix hit on the chosen P
    clock: AttemptClock | None = None   # the attempt's clock (cleanup waits count as waiting)
    admitted: Any = None            # the AdmittedRequest, once a decode worker tokenized it
    inbox: Any = None               # this attempt's deltas from D (router/streams.py)
    started: float = field(default_factory=time.monotonic)
    sent: Any = None                # DeliveredTokens: what the client has of its output
    moving: bool = False            # a move was asked and its thread has not taken it yet
    move_after: float = 0.0         # monotonic: no move asked before (one just failed to place)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)   # moves vs inbox

    def new_attempt(self, epoch: int, attempt_id: str) -> None:
        with self.lock:
            self.epoch, self.attempt_id = epoch, attempt_id
            self.last_epoch = max(self.last_epoch, epoch)
            self.decode = self.prefill = self.transfer_id = self.inbox = None
            self.moving = False


class DeliveredTokens:
    """A request's output on its way to the client, once: a re-run after a worker failure (or
    a move) replays tokens the client already has, and only the tokens beyond them go through
    the request's OutputText (the router's detokenizer and stop strings) to `on_delta`. The
    first stop string hit calls `on_stop` (the decode worker ends the request); tokens after
    it are dropped. Invariant: `tokens` = tokens taken = len(output.token_ids) until a stop."""

    def __init__(self, output: OutputText, on_delta: Callable[[TokenDelta], None] | None,
                 on_stop: Callable[[], None] = lambda: None) -> None:
        self.output = output
        self.on_delta = on_delta
        self.on_stop = on_stop
        self.tokens = 0   # output tokens the client has (or that a stop string dropped)

    def new_attempt(self) -> Callable[[Sequence[int]], None]:
        seen = [0]

        def forward(token_ids: Sequence[int]) -> None:
            start = seen[0]
            seen[0] += len(token_ids)
            new = token_ids[max(0, self.tokens - start):]
            self.tokens = max(self.tokens, seen[0])
            if new and not self.output.stopped:
                self._send(self.output.add(new))
        return forward

    def _send(self, d: TextDelta) -> None:
        if d.stopped:
            self.on_stop()
        if (d.token_ids or d.text) and self.on_delta is not None:
            self.on_delta(TokenDelta(d.token_ids, d.text))

    def finish(self, token_ids: Sequence[int]) -> None:
        """The worker's last word: its whole output `token_ids` (any not streamed yet go
        through first), then the text still held back."""
        if not self.output.stopped and len(token_ids) > self.tokens:
            self._send(self.output.add(token_ids[self.tokens:]))
            self.tokens = len(token_ids)
        tail = self.output.finish()
        if tail and self.on_delta is not None:
            self.on_delta(TokenDelta((), tail))


class HandoffReleases:
    """The router's view of every handoff hold (P's staged pages, D's reservations) and how
    each closes: the worker confirms a release, the worker died, the worker reports that it let
    the hold go itself, or (ack lost) the lease ends it."""

    def __init__(self, ledger: HandoffLedger, worker_id: Callable[[Any], str]) -> None:
        self.ledger = ledger
        self._worker_id = worker_id
        self._lock = threading.Lock()
        self.lease_pending: set[tuple[str, str, str]] = set()   # ledger keys left to a lease
        self.acks_lost = 0                                     # acks P did not confirm

    # ---- what the workers report -------------------------------------------------------------
    def worker_released(self, worker_id: str, released: Sequence[HoldRelease]) -> None:
        """Holds a worker let go on its own (lease expiry), from its load report."""
        with self._lock:
            for rel in released:
                self.ledger.release(worker_id, rel.kind, rel.request_id, rel.reason)
                self.lease_pending.discard((worker_id, rel.kind, rel.request_id))

    def worker_restarted(self, worker_id: str, live_attempts: set[str]) -> None:
        """Close the holds a restarted worker can no longer hold, for requests still in flight
        or left to a lease. A hold of a request that ended without closing it stays open: a
        leak, even though the worker died."""
        with self._lock:
            for h in self.ledger.open_holds(worker_id):
                key = (worker_id, h.kind, h.request_id)
                if h.request_id in live_attempts or key in self.lease_pending:
                    self.ledger.release(worker_id, h.kind, h.request_id, WORKER_DIED)
                    self.lease_pending.discard(key)

    # ---- releasing one flight ------------------------------------------------------------------
    async def settle_ack(self, flight: Flight) -> None:
        """Close P's staged hold by the ack's answer (sent after D's first token)."""
        ack = flight.ack
        if ack is None:
            return
        flight.ack = None
        key = (self._worker_id(flight.prefill), STAGED, flight.attempt_id)
        try:
            reason = await wait_ref(ack, CLEANUP_WAIT_S)
        except ray.exceptions.RayActorError:
            self.ledger.release(*key, WORKER_DIED)
            return
        except Exception:
            reason = "lost"
        if reason == ACKED:
            self.ledger.release(*key, ACKED)
        else:                                # ack lost: the lease frees it; P reports that
            with self._lock:
                self.acks_lost += 1
                if self.ledger.is_open(*key):
                    self.lease_pending.add(key)
        flight.transfer_id = None

    async def release_staged(self, flight: Flight, reason: str) -> None:
        """Drop P's staged copy of this attempt and wait until P confirms."""
        if flight.prefill is None or not flight.transfer_id:
            return
        ref = flight.prefill.abort_transfer.remote(flight.transfer_id)
        flight.transfer_id = None
        await self.confirm(ref, self._worker_id(flight.prefill), STAGED, flight.attempt_id,
                           reason, flight.clock)

    async def confirm(self, ref: Any, worker_id: str, kind: str, attempt_id: str, reason: str,
                      clock: AttemptClock | None = None) -> None:
        """Close a ledger hold once the worker answered the release (a dead worker: died)."""
        try:
            await (clock or AttemptClock()).get(ref, timeout=CLEANUP_WAIT_S)
        except ray.exceptions.RayActorError:
            self.ledger.release(worker_id, kind, attempt_id, WORKER_DIED)
            return
        except Exception:
            return                           # no answer: the hold stays open (lease / deadline)
        self.ledger.release(worker_id, kind, attempt_id, reason)

    async def release(self, flight: Flight) -> None:
        """Release the attempt's state on both sides and wait for the workers to confirm
        (calls to a dead worker just fail: its holds close as worker_died, the others as
        aborted)."""
        rid = flight.attempt_id or flight.request_id
        await self.settle_ack(flight)
        if flight.prefill is not None:
            flight.prefill.abort.remote(rid)
            await self.release_staged(flight, ABORTED)
        if flight.decode is not None:
            await self.confirm(flight.decode.abort.remote(rid), self._worker_id(flight.decode),
                               RESERVED, rid, ABORTED, flight.clock)
