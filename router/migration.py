"""Live migration of running decodes (the Orchestrator's LiveMigration part): a request's decode
moves to another decode worker with its KV, sampler state and stream position, for a drain, KV
pressure or a rebalance. A move is asked from any thread (`migrate` puts a MoveSignal in the
request's inbox); the request's own coroutine does it between two of its tokens (`_move`):
D1 freezes it, D2 admits it under the next epoch and plans the blocks it lacks, D1 stages
exactly that plan, D2 pulls, verifies, lands and replays the output so far on its stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import ray

from kvcache.manager import cdiv
from protocol.errors import RequestError, RoutingRejected, TransferRejected
from protocol.ledger import ABORTED, ACKED, FILLED, RESERVED, STAGED, TRANSFER_FAILED
from protocol.messages import Admission, MigratedRequest, PrefillResult
from router.flight import CLEANUP_WAIT_S, AttemptClock, Flight, MoveSignal, wait_ref

PRESSURE_FREE_SHARE = 0.05  # migrate_on_kv_pressure: a decode worker with fewer free blocks
PRESSURE_BLOCKS_PER_SEQ = 4  # than this share of its pool, or than this many per running
                             # sequence (each takes a block every block_size steps), sheds one
ROOM_FREE_SHARE = 0.25      # ... to a decode worker with at least this share of its pool free
MOVE_RETRY_S = 1.0          # a request whose move did not happen is asked again after this
REBALANCE_MIN_GAP = 4       # rebalance: decode batches this far apart (and the busier at
                            # least twice the idler) move half the gap to the idler


class MoveFailed(Exception):
    """A live move failed after its source froze the decode: the request re-prefills."""


async def unwrap(aw: Any) -> Any:
    """Await a Ray call; a RequestError raised inside the worker comes out as itself."""
    try:
        return await aw
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RequestError):
            raise e.cause from None
        raise


class LiveMigration:
    """The Orchestrator's live moves (a mixin: it uses the orchestrator's fleet, flights,
    ledger, streams, releases, loop and `_land`). Counters: `migrations` (outcome -> count:
    moved, fallback, unplaced) and `moved_by_cause`."""

    def _init_migration(self) -> None:
        self.migrations: dict[str, int] = {"moved": 0, "fallback": 0, "unplaced": 0}
        self.moved_by_cause: dict[str, int] = {}  # moves that happened: cause -> count
        self._move_ended: dict[str, float] = {}   # worker id -> monotonic end of its last move

    def migrate(self, request_id: str, target: str | None = None, cause: str = "rebalance"
                ) -> bool:
        """Ask a request to move its running decode to another decode worker (`target`, or
        the policy's pick among the others), with its KV, sampler state and stream position.
        The request's own coroutine does the move between two of its tokens (`_move`). False
        when the request is not on a decode worker now or a move is already asked. From any
        thread."""
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None:
            return False
        with flight.lock:
            inbox = flight.inbox
            if inbox is None or flight.moving or flight.aborted:
                return False
            flight.moving = True
        self.loop.call_soon(inbox.put_nowait, MoveSignal(target, cause))
        return True

    def move_off(self, worker_id: str, cause: str = "drain") -> int:
        """Ask every request decoding on `worker_id` to move away (a drain); a request whose
        last move did not happen is asked again after MOVE_RETRY_S. Returns how many were
        asked now."""
        w = self.fleet.handle(worker_id)
        now, asked = time.monotonic(), 0
        for f in self.in_flight_flights():
            if f.decode is w and now >= f.move_after and \
                    self.migrate(f.request_id, cause=cause):
                asked += 1
        return asked

    async def _move(self, flight: Flight, signal: MoveSignal) -> bool:
        """In the request's coroutine, between two of its tokens: move its running decode from
        D1 (flight.decode) to D2. D1 freezes it (None: not a running decode there now: nothing
        to do); D2 admits it under the next epoch, reserving what D1 computed and planning the
        blocks it lacks; D1 stages exactly that plan (checksums, sampler state); D2 pulls,
        verifies and lands it, then replays the output so far on its stream. No room on any
        D2: D1 decodes it on. D1 or D2 failing after the freeze: MoveFailed (the request
        re-prefills elsewhere; both sides are released). True when it moved."""
        source = self.fleet.worker_id(flight.decode)
        try:
            return await self._move_now(flight, signal)
        finally:      # a move is "moving" until it ended, whichever way (no second ask)
            self._move_ended[source] = time.monotonic()
            with flight.lock:
                flight.moving = False
                flight.move_after = time.monotonic() + MOVE_RETRY_S

    async def _move_now(self, flight: Flight, signal: MoveSignal) -> bool:
        d1, old = flight.decode, flight.attempt_id
        d1_id = self.fleet.worker_id(d1)
        if flight.aborted or flight.admitted is None:
            return False
        left = max(1.0, self._deadline_left(flight))
        frozen = await unwrap(wait_ref(d1.freeze.remote(old), left))
        if frozen is None:
            return False
        await self.releases.settle_ack(flight)     # P's ack (its ledger key names this attempt)
        epoch = max(flight.epoch, flight.last_epoch) + 1
        with flight.lock:
            flight.last_epoch = epoch        # used, whether the move succeeds or not
        admitted = replace(flight.admitted, epoch=epoch)
        new = admitted.worker_request_id
        moved = MigratedRequest(admitted, d1_id, frozen)
        placed = await self._admit_moved(moved, d1_id, signal.target)
        if placed is None:                   # nobody has room: it goes on where it is
            await wait_ref(d1.unfreeze.remote(old), left)
            self._count_move("unplaced", signal.cause)
            return False
        d2, adm, inbox = placed
        d2_id = self.fleet.worker_id(d2)
        self.ledger.hold(d2_id, RESERVED, new, adm.reserved_blocks, left)
        transfer_id = None
        try:
            result: PrefillResult = await unwrap(wait_ref(
                d1.stage_migration.remote(old, adm.plan), left))
            if result.handle is not None:
                transfer_id = result.handle.transfer_id
                self.ledger.hold(d1_id, STAGED, old, adm.plan.num_blocks, result.lease_s)
            await self._land(d1, d2, flight.request_id, epoch, result, AttemptClock(), left)
        except Exception as e:   # noqa: BLE001 - any failure after the freeze re-prefills
            if isinstance(e, ray.exceptions.RayTaskError) and \
                    isinstance(getattr(e, "cause", None), TransferRejected):
                reason = e.cause.reason
                with self._lock:
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
                    self.recent_rejections.append((reason, d1_id, new))
            if transfer_id is not None:
                await self.releases.confirm(d1.abort_transfer.remote(transfer_id), d1_id,
                                            STAGED, old, TRANSFER_FAILED)
            await self.releases.confirm(d2.abort.remote(new), d2_id, RESERVED, new, ABORTED)
            self.streams.close(d2_id, new)
            self._count_move("fallback", signal.cause)
            raise MoveFailed(f"moving request {flight.request_id} from {d1_id} to {d2_id} "
                             f"failed: {type(e).__name__}: {e}"[:400]) from e
        self.ledger.release(d2_id, RESERVED, new, FILLED)
        self._move_ended[d1_id] = self._move_ended[d2_id] = time.monotonic()
        if transfer_id is not None:
            await self.releases.confirm(d1.ack.remote(transfer_id), d1_id, STAGED, old, ACKED)
        self.streams.close(d1_id, old)
        with flight.lock:
            flight.decode, flight.inbox, flight.epoch, flight.attempt_id = d2, inbox, epoch, new
            flight.prefill, flight.transfer_id = None, None
        self._count_move("moved", signal.cause)
        return True

    async def _admit_moved(self, moved: MigratedRequest, source: str, target: str | None):
        """The first decode worker other than `source` (`target` alone when given) that
        admits the moved request: (handle, Admission, its inbox), or None."""
        if target is not None:
            order = [self.fleet.handle(target)] if self.fleet.takes_requests(target) else []
        else:
            live = [d for d in self.fleet.live("decode") if self.fleet.worker_id(d) != source]
            try:
                first = self._decide("decode", self._routing_request(moved.admitted),
                                     frozenset({source}))
                order = [first] + [d for d in live if d is not first]
            except RoutingRejected:
                order = live
        new = moved.admitted.worker_request_id
        for d in order:
            did = self.fleet.worker_id(d)
            inbox = self.streams.open(d, did, new)
            try:
                adm: Admission = await unwrap(wait_ref(d.admit_migration.remote(moved),
                                                       CLEANUP_WAIT_S))
            except (ray.exceptions.RayError, RequestError):
                self.streams.close(did, new)
                continue
            if adm.admitted:
                return d, adm, inbox
            self.streams.close(did, new)
        return None

    def _count_move(self, outcome: str, cause: str) -> None:
        with self._lock:
            self.migrations[outcome] += 1
            if outcome == "moved":
                self.moved_by_cause[cause] = self.moved_by_cause.get(cause, 0) + 1
        record = getattr(self.metrics, "record_migration", None)
        if record is not None:
            record(outcome, cause)

    def relieve_kv_pressure(self) -> int:
        """migrate_on_kv_pressure: for each live decode worker whose pool is nearly full by its
        last report (free blocks under PRESSURE_FREE_SHARE of the pool, or under
        PRESSURE_BLOCKS_PER_SEQ per running sequence: its batch would exhaust them within a few
        blocks' steps), ask its largest request (prompt + the tokens the client has) to move,
        one move at a time per worker, before its engine would have to preempt and recompute.
        The target is the decode worker with the most free blocks that keeps ROOM_FREE_SHARE
        of its pool free after taking the request's blocks (so it is not the next one under
        pressure, and a request does not bounce back); none such: nothing moves. A worker a
        move left or reached sits out until its reports show the move (stale figures would
        move a second request). Returns the moves asked."""
        fleet, asked = self.fleet, 0
        now = time.monotonic()
        # a worker a move just left or reached reports its new pool a little later: until
        # then its figures are stale (a second move off it would be one too many)
        settle = max(0.25, 3 * self.cfg.report_interval_s)
        with fleet.lock:
            states = [(st.worker_id, st.free_blocks, st.total_blocks, st.decode_batch)
                      for st in fleet.states("decode") if not st.draining and
                      now - self._move_ended.get(st.worker_id, -math.inf) >= settle]
        bs = self._block_size                # learned from the admissions
        flights = self.in_flight_flights()
        for wid, free, total, batch in states:
            low = max(PRESSURE_FREE_SHARE * total, PRESSURE_BLOCKS_PER_SEQ * batch)
            if not total or not batch or free >= low:
                continue
            w = fleet.handle(wid)
            mine = [f for f in flights if f.decode is w and f.admitted is not None]
            if not mine or any(f.moving for f in mine):
                continue
            ready = [f for f in mine if now >= f.move_after]
            if not ready:
                continue
            biggest = max(ready, key=_tokens_held)
            targets = [(f2, w2) for w2, f2, t2, _ in states if w2 != wid and t2 and
                       f2 - cdiv(_tokens_held(biggest), bs) >= ROOM_FREE_SHARE * t2]
            if targets:
                to = max(targets)[1]
                asked += self.migrate(biggest.request_id, target=to, cause="kv_pressure")
        return asked

    def rebalance_decodes(self, max_moves: int = 8) -> int:
        """Move running decodes from the busiest live decode worker to the idlest (a worker
        that just joined takes its share at once instead of only new requests) when the
        requests the router has on them differ by at least REBALANCE_MIN_GAP and the busiest
        has at least twice the idlest's: half the gap (at most `max_moves`), the requests with
        the most output asked for first (then the newest). The router's own flights, not the
        reports, so a move is counted where it went at once; nothing while a move off the
        busiest is still under way. Returns the moves asked."""
        live = self.fleet.live("decode")
        if len(live) < 2:
            return 0
        flights = [f for f in self.in_flight_flights() if f.admitted is not None]
        on = {id(w): [f for f in flights if f.decode is w] for w in live}
        hi = max(live, key=lambda w: len(on[id(w)]))
        lo = min(live, key=lambda w: len(on[id(w)]))
        mine, gap = on[id(hi)], len(on[id(hi)]) - len(on[id(lo)])
        if gap < REBALANCE_MIN_GAP or len(mine) < 2 * len(on[id(lo)]) or \
                any(f.moving for f in mine):
            return 0
        mine.sort(key=lambda f: (f.admitted.sampling.max_tokens, f.started), reverse=True)
        to = self.fleet.worker_id(lo)
        return sum(self.migrate(f.request_id, target=to, cause="rebalance")
                   for f in mine[:min(max_moves, gap // 2)])

    def _pressure_loop(self) -> None:
        """migrate_on_kv_pressure's thread: relieve pressure every report interval."""
        while not self._stop.wait(self.cfg.report_interval_s):
            try:
                self.relieve_kv_pressure()
            except Exception:   # noqa: BLE001 - a worker left meanwhile: next round
                pass


def _tokens_held(flight: Flight) -> int:
    """The tokens a decoding request holds KV for, as the router knows them: its prompt and
    the output its client has."""
    sent = flight.sent.tokens if flight.sent is not None else 0
    return flight.admitted.num_tokens + sent
