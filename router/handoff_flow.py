"""One attempt's P -> D handoff (the Orchestrator's HandoffFlow part), in three round trips
before D's first decode step:
  1. D.admit: the policy picks the decode worker D by the prefix it holds against its load
     (the router hashed the request); D reserves blocks decode-first and plans the transfer
     (or prefills it itself when what it lacks is short, or when there are no prefill
     workers: colocated mode);
  2. P.prefill: the policy picks the prefill worker P (prefix locality vs load); P prefills and
     stages exactly the plan's pages;
  3. D.land: D pulls (for RDT this process routes P's tensor to D), verifies and lands the
     pages; its tokens come back on D's delta stream (router/streams.py); P's ack goes out
     after the first token.
A prefill or transfer that fails is retried on another prefill worker (D keeps its
reservation); only when none is left does D prefill it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import ray

from protocol.errors import (
    RequestAborted,
    RequestError,
    RoutingRejected,
    StepFailed,
    TransferFailed,
    TransferRejected,
)
from protocol.ledger import ABORTED, FALLBACK_LOCAL, FILLED, RESERVED, STAGED, TRANSFER_FAILED
from protocol.messages import Admission, AdmittedRequest, PrefillResult, RequestDelta
from router.flight import AttemptClock, Flight, MoveSignal
from router.local_prefill import NO_LIMIT, local_prefill_limit
from router.migration import unwrap
from router.policies import Locality, RoutingDecision, RoutingRequest, cached_tokens
from router.streams import WorkerGone
from router.worker_view import note_prefill

MOVED = object()            # a request's item stream: its decode moved to another worker
LOCAL = object()            # the prefill choice: the decode worker prefills it itself


class ReservationLost(TransferFailed):
    """The decode worker's reservation vanished under a live attempt: the worker restarted
    (a death the attempt did not see as a RayActorError). Retried as a worker death; past
    max_retries it ends as TransferFailed's 503."""


async def next_delta(inbox: asyncio.Queue, timeout: float) -> RequestDelta | MoveSignal:
    """The next delta of a request's inbox (or a move asked of it); a dead worker's as Ray's
    RayActorError (the attempt fails and runs again elsewhere), a failed step's as
    StepFailed, none in time as Ray's GetTimeoutError."""
    try:
        item = inbox.get_nowait() if not inbox.empty() else \
            await asyncio.wait_for(inbox.get(), timeout)
    except TimeoutError:
        raise ray.exceptions.GetTimeoutError(
            f"no token from the decode worker in {timeout:.0f} s") from None
    if isinstance(item, MoveSignal):
        return item
    if isinstance(item, WorkerGone):
        raise ray.exceptions.RayActorError(error_msg=f"the decode worker's stream broke: "
                                                     f"{item.reason}")
    if item.error is not None:
        raise StepFailed(item.error)
    return item


def aborted(flight: Flight) -> RequestAborted:
    return RequestAborted(f"request {flight.request_id} was aborted")


class HandoffFlow:
    """The Orchestrator's handoff of one attempt (a mixin: it uses the orchestrator's fleet,
    policy, ledger, streams, releases, traces and counters)."""

    def _routing_request(self, request: AdmittedRequest, decode_cached_blocks: int = 0,
                         decode_worker: str = "") -> RoutingRequest:
        """What the policy sees of a request: its block hashes (the router hashed them, so
        D is picked by the prefix it holds too), its size, tenant and adapter."""
        return RoutingRequest(request.request_id, list(request.block_hashes),
                              request.num_tokens, request.block_size, tenant=request.tenant,
                              output_tokens=request.sampling.max_tokens,
                              decode_cached_blocks=decode_cached_blocks,
                              lora=request.lora_id, decode_worker=decode_worker)

    async def _admit(self, flight: Flight, request: AdmittedRequest,
               clock: AttemptClock) -> Admission:
        """Decode-first: the first decode worker with room reserves blocks and plans the
        transfer. Round trip 1 (more only while decode workers are full)."""
        local_max = self.cfg.local_prefill_max_tokens if self.fleet.live("prefill") else NO_LIMIT
        deadline = min(time.monotonic() + self.cfg.admit_timeout_s,
                       time.monotonic() + request.deadline - time.time())
        while True:
            live = self.fleet.live("decode")
            try:
                first = self._decide("decode", self._routing_request(request))
                self.traces.routed(flight.request_id, self.fleet.worker_id(first, "?"))  # trace hook
                order = [first] + [d for d in live if d is not first]
            except RoutingRejected:
                order = live                 # the view may be stale: ask them all
            for d in order:
                did = self.fleet.worker_id(d)
                # its tokens may come as soon as it is admitted (a local prefill): the inbox
                # is open before
                inbox = self.streams.open(d, did, flight.attempt_id)
                try:
                    adm: Admission = await unwrap(clock.get(d.admit.remote(request,
                                                                            local_max)))
                except ray.exceptions.RayActorError:
                    self.streams.close(did, flight.attempt_id)
                    continue                 # died or restarting: the reporter will notice
                except BaseException:
                    self.streams.close(did, flight.attempt_id)
                    raise
                self._block_size = request.block_size
                if not adm.admitted:
                    self.streams.close(did, flight.attempt_id)
                else:
                    flight.decode, flight.inbox = d, inbox
                    self.traces.admitted(flight.request_id, self.fleet.worker_id(d, "?"), adm.local)  # trace hook
                    if not adm.local:
                        self.ledger.hold(adm.decode_worker, RESERVED,
                                         request.worker_request_id, adm.reserved_blocks,
                                         max(0.0, request.deadline - time.time()))
                    if flight.aborted:       # aborted while being admitted
                        await self.releases.release(flight)
                        raise aborted(flight)
                    return adm
            if flight.aborted:
                raise aborted(flight)
            if time.monotonic() > deadline:
                raise RoutingRejected("no_decode_capacity", "no decode worker has room for "
                                      f"this request (waited {self.cfg.admit_timeout_s:.0f} s)",
                                      retry_after_s=5)
            await clock.sleep(0.02)

    def _local_prefill_limit(self, decode_id: str) -> int:
        """Under fleet.lock: the most uncached tokens decode worker `decode_id` prefills itself
        now instead of a prefill worker (router/local_prefill.py)."""
        return local_prefill_limit(self.fleet.states("prefill"), self.fleet.state[decode_id],
                                   self.cfg.local_prefill_max_tokens,
                                   self.cfg.local_prefill_when_backlogged, time.monotonic())

    def _decide_prefill(self, flight: Flight, admission: Admission, tried: set[str]) -> Any:
        """The prefill worker for an admitted request, or LOCAL: its decode worker prefills
        it (the prefill pool's backlog is longer than that takes; asked on a first try only,
        decided with the pool's state held, so the requests right behind see the choice)."""
        req = self._routing_request(admission.request, admission.decode_cached_blocks,
                                    admission.decode_worker)
        with self.fleet.lock:
            if not tried and self.cfg.local_prefill_when_backlogged:
                did = admission.decode_worker
                lacks = req.num_tokens - cached_tokens(req, admission.decode_cached_blocks)
                if did in self.fleet.state and lacks <= self._local_prefill_limit(did):
                    note_prefill(self.fleet.state[did], req,
                                 RoutingDecision(did, "local_backlog", None,
                                                 admission.decode_cached_blocks),
                                 Locality.pooled_fit(self.fleet.states("prefill")),
                                 time.monotonic())
                    self.decisions["local:backlog"] = self.decisions.get("local:backlog", 0) + 1
                    return LOCAL
            return self._decide("prefill", req, frozenset(tried), flight)

    async def _prefill_and_stream(self, flight: Flight, admission: Admission,
                                  clock: AttemptClock):
        """Round trips 2 and 3: P prefills and stages the plan, D pulls, verifies, lands and
        starts streaming. A prefill worker that fails (dies, errs, stages pages D rejects) is
        excluded and the next one is tried with the same reservation; with none left, D
        prefills it itself. Returns D's stream, its first item already received."""
        admitted, plan, d = admission.request, admission.plan, flight.decode
        rid, did = admitted.worker_request_id, admission.decode_worker
        tried: set[str] = set()
        last_error: Exception | None = None
        while True:
            if flight.aborted:
                await self.releases.release(flight)
                raise aborted(flight)
            try:
                p = self._decide_prefill(flight, admission, tried)
            except RoutingRejected as e:
                if e.reason != "no_workers":
                    await self.releases.release(flight)
                    raise
                p = None
            if p is None or p is LOCAL:      # no prefill worker left, or the pool's backlog
                # is longer than D takes: D prefills it itself
                if self.cfg.failure_policy == "fail" and last_error is not None:
                    await self.releases.release(flight)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {last_error}") from last_error
                if await clock.get(d.fallback_local.remote(rid)):
                    self.ledger.release(did, RESERVED, rid, FALLBACK_LOCAL)
                    self.traces.prefilled_locally(flight.request_id)  # trace hook
                    return await self._open_stream(flight, None, clock)
                await self.releases.release(flight)
                # (not aborted, checked above: the decode worker restarted meanwhile, so this
                # attempt died with it and the request runs again elsewhere)
                raise ReservationLost(f"request {flight.request_id}: its decode worker was "
                                       "to prefill it, but its reservation is gone (the "
                                       "worker restarted)") from last_error
            pid = self.fleet.worker_id(p, "?")
            tried.add(pid)
            flight.prefill = p
            try:
                result: PrefillResult = await unwrap(clock.get(
                    p.prefill.remote(admitted, plan)))
            except (ray.exceptions.RayError, RequestError) as e:
                if flight.aborted:
                    continue
                last_error = e
                with self._lock:
                    self.prefill_retries += 1
                continue                     # the next prefill worker
            self.traces.prefilled(flight.request_id, pid, result.timing)  # trace hook
            self.observe_prefill_hit(flight.predicted_hit_tokens, result.cached_tokens)
            flight.transfer_id = result.handle.transfer_id if result.handle else None
            if result.handle is not None:
                self.ledger.hold(pid, STAGED, rid, plan.num_blocks, result.lease_s)
            try:
                return await self._open_stream(flight, result, clock)
            except ray.exceptions.RayActorError:
                await self.releases.release_staged(flight, ABORTED)
                raise
            except ray.exceptions.GetTimeoutError as e:   # D's pull hangs: give up
                await self.releases.release(flight)
                raise TransferFailed(f"KV transfer for request {flight.request_id} did not "
                                     "finish before its deadline") from e
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                reason = cause.reason if isinstance(cause, TransferRejected) else "error"
                with self._lock:
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
                    self.recent_rejections.append((reason, pid, rid))
                    self.prefill_retries += 1
                await self.releases.release_staged(flight, TRANSFER_FAILED)
                last_error = e
                if flight.aborted:
                    continue
                if reason == "unknown":     # D no longer holds the reservation
                    await self.releases.release(flight)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {cause}") from e
                if self.cfg.failure_policy == "fail":
                    await self.releases.release(flight)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {cause or e}") from e

    async def _open_stream(self, flight: Flight, result: PrefillResult | None,
                           clock: AttemptClock):
        """Land `result`'s pages on D (round trip 3; none when D prefills it itself), then
        return an iterator over the request's TokenDeltas and its RequestDone from D's delta
        stream (router/streams.py), its first item already arrived."""
        d, rid = flight.decode, flight.attempt_id
        timeout = max(1.0, self._deadline_left(flight))
        if result is not None:
            await self._land(flight.prefill, d, flight.request_id, flight.epoch, result, clock,
                       timeout)
            did = self.fleet.worker_id(d)
            self.traces.transferred(flight.request_id, did)  # trace hook: D landed the pages
            self.ledger.release(did, RESERVED, rid, FILLED)
            if result.handle is not None:    # off the critical path: settled at the end
                flight.ack = flight.prefill.ack.remote(result.handle.transfer_id)
        waited = time.perf_counter()
        first = await next_delta(flight.inbox, timeout)
        clock.waited_s += time.perf_counter() - waited

        async def items():
            delta = first
            while True:
                if isinstance(delta, MoveSignal):
                    if await self._move(flight, delta):
                        yield MOVED
                else:
                    if delta.token_ids:
                        yield delta.token_ids
                    if delta.done is not None:
                        yield delta.done
                        return
                delta = await next_delta(flight.inbox, max(1.0, self._deadline_left(flight)))
        return items()

    async def _land(self, source: Any, d: Any, request_id: str, epoch: int,
                    result: PrefillResult, clock: AttemptClock, timeout: float) -> None:
        """D pulls, verifies and lands `result`'s pages, staged by `source` (a prefill worker,
        or the decode worker a running request moves from)."""
        async with contextlib.AsyncExitStack() as stack:
            if result.handle is not None and self.cfg.transport == "rdt":
                await stack.enter_async_context(self._rdt_exclusive(source, d))
                send = source.kv_send.options(tensor_transport=self.cfg.rdt_backend)
                pages = send.remote(result.handle.transfer_id)
                landed = d.land.remote(request_id, epoch, result, pages, sent_at=time.time())
            else:
                landed = d.land.remote(request_id, epoch, result)
            await unwrap(clock.get(landed, timeout=timeout))

    def _close_inbox(self, flight: Flight) -> None:
        if flight.inbox is not None:
            self.streams.close(self.fleet.worker_id(flight.decode), flight.attempt_id)
            flight.inbox = None

    def _deadline_left(self, flight: Flight) -> float:
        return self.cfg.request_timeout_s if flight.deadline is None else \
            flight.deadline - time.time()

    @contextlib.asynccontextmanager
    async def _rdt_exclusive(self, *actors: Any):
        """Hold the RDT locks of these actors (taken in one global order: no deadlock)."""
        locks = [self._rdt_locks.setdefault(k, asyncio.Lock())
                 for k in sorted({a._actor_id.hex() for a in actors})]
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await stack.enter_async_context(lock)
            yield
