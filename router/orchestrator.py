"""Request orchestration P -> D over worker actor handles: route, admit, prefill, transfer, stream.

Torch-free: it holds Ray actor handles (through its Fleet, router/fleet.py) and the typed
messages of protocol/messages.py. For each request, three round trips before D's first decode
step:
  1. D.admit: the policy picks the decode worker D; D tokenizes, validates and hashes the
     request once, reserves blocks decode-first and plans the transfer (or prefills it itself
     when what it lacks is short, or when there are no prefill workers: colocated mode);
  2. P.prefill: the policy picks the prefill worker P (prefix locality vs load); P prefills and
     stages exactly the plan's pages;
  3. D.land: D pulls (for RDT this process routes P's tensor to D), verifies and lands the
     pages; its tokens come back on D's delta stream (router/streams.py: one message per
     engine step for all of D's requests); P's ack goes out after the first token.
A prefill or transfer that fails is retried on another prefill worker (D keeps its
reservation); only when none is left does D prefill it itself. A dead decode worker fails the
attempt: both sides are released and the request runs again under a new epoch. Every block held
for the handoff is in `self.ledger` (both sides) until a worker confirms its release
(router/flight.py). The router measures KV transfer GB/s per (P, D) pair from the transfers it
sees end, and compares its predicted prefix hit of each prefill with the hit P reports (the
hash drift alarm, router/drift.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import ray

from frontend.admit import Frontend
from frontend.output_text import OutputText
from protocol.errors import (
    RaypdError,
    RequestAborted,
    RequestError,
    RoutingRejected,
    StepFailed,
    TransferFailed,
    TransferRejected,
    WorkerFailed,
    http_status,
)
from protocol.ledger import (
    ABORTED,
    FALLBACK_LOCAL,
    FILLED,
    RESERVED,
    STAGED,
    TRANSFER_FAILED,
    HandoffLedger,
)
from protocol.messages import (
    Admission,
    AdmittedRequest,
    PrefillResult,
    RequestDelta,
    RequestDone,
    RequestInput,
    RequestResult,
    TokenDelta,
)
from protocol.sampling import SamplingParams
from router.drift import HashDriftAlarm
from router.event_loop import RouterLoop
from router.fleet import Fleet
from router.flight import (
    CLEANUP_WAIT_S,
    AttemptClock,
    DeliveredTokens,
    Flight,
    HandoffReleases,
    MoveSignal,
    wait_ref,
)
from router.flow_config import FAILURE_POLICIES, FlowConfig  # noqa: F401  (re-exported)
from router.local_prefill import NO_LIMIT, local_prefill_limit
from router.migration import LiveMigration, MoveFailed, unwrap
from router.policies import (
    Locality,
    RoutingDecision,
    RoutingRequest,
    cached_tokens,
    make_policy,
)
from router.prefix_index import ApproxPrefixIndex
from router.request_traces import TraceStore  # trace hook
from router.streams import DeltaStreams, WorkerGone
from router.transfer_rates import TransferRates
from router.worker_view import note_decode, note_prefill

MOVED = object()            # a request's item stream: its decode moved to another worker
LOCAL = object()            # the prefill choice: the decode worker prefills it itself
MAX_MOVE_FALLBACKS = 8      # re-prefills after failed moves, per request
TEXT_THREADS = 2            # the router's tokenizing threads (a prompt's encode is off the loop)


class _ReservationLost(TransferFailed):
    """The decode worker's reservation vanished under a live attempt: the worker restarted
    (a death the attempt did not see as a RayActorError). Retried as a worker death; past
    max_retries it ends as TransferFailed's 503."""

class Orchestrator(LiveMigration):
    """Runs requests through the fleet's workers: routing decisions, the P -> D flow, retries,
    aborts, and the router's own bookkeeping of them (ledger, decisions, rejections)."""

    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any], cfg: FlowConfig,
                 worker_ids: dict[Any, str] | None = None, metrics: Any = None) -> None:
        """`metrics`: an object with record_request / record_decision / set_in_flight (the
        cluster layer passes Ray-exported RouterMetrics); None records nothing."""
        cfg.validate()
        self.cfg = cfg
        self.policy = make_policy(cfg.policy, **(cfg.policy_cfg or {}))
        self.transfer_rates = TransferRates()    # measured GB/s per (P, D) pair
        self.drift = HashDriftAlarm()            # predicted vs engine-reported prefix hits
        self.decisions: dict[str, int] = {}     # "policy:reason" -> count
        self.retries = 0                         # request re-runs after a worker failure
        self.prefill_retries = 0                 # prefills re-run on another prefill worker
        self._init_migration()                   # live moves of running decodes
        self.rejected: dict[str, int] = {}       # TransferRejected reason -> count (router view)
        # the latest rejections, (reason, prefill worker, worker request id): an audit trail
        # that outlives a decode worker's restart (chaos checks corruption against it)
        self.recent_rejections: deque[tuple[str, str, str]] = deque(maxlen=4096)
        self.ledger = HandoffLedger()            # both sides' handoff holds, router's view
        self.request_window = None               # the autoscaler's RequestWindow (None: off)
        self._block_size = 16                    # learned from the first admission
        self.metrics = metrics or _NoMetrics()
        self._flights: dict[str, Flight] = {}
        self._frontend: Frontend | None = None
        self._frontend_lock = asyncio.Lock()
        self._text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="raypd-text")
        self.loop = RouterLoop()                 # every request's flow runs on it
        self.traces = TraceStore(on_finish=getattr(self.metrics, "record_trace", None))  # trace hook
        self._lock = threading.Lock()
        # RDT: one transfer at a time per actor. Ray matches sends to receives by order only
        # (no tags) and does not promise threaded actors run tasks in submission order, so two
        # transfers in flight at one actor could pair A's send with B's receive.
        self._rdt_locks: dict[str, asyncio.Lock] = {}
        self._rr = itertools.count()
        self.fleet = Fleet(prefill, decode, worker_ids=worker_ids, index_mode=cfg.index_mode,
                           report_interval_s=cfg.report_interval_s,
                           health_timeout_s=cfg.health_timeout_s,
                           hang_timeout_s=cfg.hang_timeout_s,
                           on_released=self._worker_released,
                           on_restarted=self._worker_restarted)
        self.releases = HandoffReleases(self.ledger, self.fleet.worker_id)
        self.streams = DeltaStreams(lambda wid: wid in self.fleet.state,   # tokens from D,
                                    on_report=self.fleet.apply_pushed,    # and its load
                                    report_every_s=cfg.report_interval_s,
                                    on_lost=self.fleet.stream_lost)
        self.fleet.start()
        self._stop = threading.Event()
        if cfg.migrate_on_kv_pressure:
            threading.Thread(target=self._pressure_loop, daemon=True,
                             name="raypd-kv-pressure").start()

    async def frontend(self) -> Frontend:
        """The router's text work for the served model (frontend/admit.py), from a decode
        worker's FrontendSpec (asked once; every decode worker serves the same namespace, and
        one that does not refuses what this router hashed)."""
        async with self._frontend_lock:
            if self._frontend is None:
                live = self.fleet.live("decode")
                if not live:
                    raise RoutingRejected("no_workers", "no decode worker is up",
                                          retry_after_s=5)
                spec = await unwrap(wait_ref(live[0].frontend_spec.remote(),
                                             CLEANUP_WAIT_S * 6))
                self._frontend = Frontend(spec)
            return self._frontend

    def _stop_on_worker(self, flight: Flight) -> None:
        """A stop string ended the request's text: its decode worker ends it (within a step;
        the tokens it makes meanwhile are dropped)."""
        if flight.decode is not None and flight.attempt_id:
            flight.decode.stop.remote(flight.attempt_id)

    def _worker_released(self, worker_id: str, released) -> None:
        self.releases.worker_released(worker_id, released)

    def _worker_restarted(self, worker_id: str) -> None:
        self.releases.worker_restarted(worker_id, {f.attempt_id for f in self.in_flight_flights()})

    @property
    def acks_lost(self) -> int:
        """Acks P did not confirm (the lease frees their pages)."""
        return self.releases.acks_lost

    def in_flight_flights(self) -> list[Flight]:
        with self._lock:
            return list(self._flights.values())

    def busy(self, worker_id: str) -> bool:
        """Whether any request in flight uses the worker."""
        w = self.fleet.handle(worker_id)
        return any(w is f.decode or w is f.prefill for f in self.in_flight_flights())

    # ---- routing -----------------------------------------------------------------------------
    def _decide(self, role: str, req: RoutingRequest, exclude: frozenset = frozenset(),
                flight: Flight | None = None) -> Any:
        """The policy's pick; `exclude`: worker ids this request already failed on. A prefill
        pick records its predicted hit on `flight` (for the drift alarm)."""
        fleet = self.fleet
        with fleet.lock:
            states = fleet.states(role, exclude)
            if role == "prefill":
                for st in states:
                    st.transfer_gbps_to = self.transfer_rates.from_worker(st.worker_id)
            matches = fleet.index.match(list(req.block_hashes))
        with fleet.lock:
            if role == "decode":
                d = self.policy.choose_decode(req, states, matches)
                note_decode(fleet.state[d.worker_id], req, d)   # counted until the next report
            else:
                d = self.policy.choose_prefill(req, states, matches)
                note_prefill(fleet.state[d.worker_id], req, d, Locality.pooled_fit(states),
                             time.monotonic())
                if flight is not None:
                    flight.predicted_hit_tokens = min(d.matched_blocks * req.block_size,
                                                      req.num_tokens)
                if isinstance(fleet.index, ApproxPrefixIndex):
                    fleet.index.record(d.worker_id, list(req.block_hashes))
            key = f"{self.policy.name}:{d.reason}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.metrics.record_decision(self.policy.name, d.reason, role)
            return fleet.handle(d.worker_id)

    def observe_prefill_hit(self, predicted_tokens: int, real_tokens: int) -> None:
        """The drift alarm's input: the router's predicted prefix hit vs P's reported hit."""
        with self._lock:
            was = self.drift.alarm
            on = self.drift.observe(predicted_tokens, real_tokens)
        record = getattr(self.metrics, "record_hash_drift", None)
        if record is not None:
            record(on, on and not was)

    def run_request(self, prompt: Any, sampling: SamplingParams | None = None,
                    **kw: Any) -> RequestResult:
        """`run_request_async` from a thread other than the router loop's, blocking until the
        request ends (`on_delta` then runs on the router loop: it must not block)."""
        return self.loop.run(self.run_request_async(prompt, sampling, **kw))

    async def run_request_async(self, prompt: Any, sampling: SamplingParams | None = None, *,
                                chat: bool = False, tenant: str = "", lora_id: str = "",
                                request_id: str | None = None,
                                on_delta: Callable[[TokenDelta], None] | None = None,
                                timeout_s: float | None = None) -> RequestResult:
        """Run one request through P and D. `on_delta(TokenDelta)` is called as tokens stream
        in, on the caller's loop. The request must end within `timeout_s` (default:
        request_timeout_s); the workers drop what they hold for it by then on their own.
        Raises the errors of protocol/errors.py only: RequestError (bad request), RequestAborted,
        RoutingRejected (no capacity / SLO), TransferFailed, WorkerFailed (a Ray failure that
        is not one of these becomes WorkerFailed here, at the router's edge)."""
        kw = dict(chat=chat, tenant=tenant, lora_id=lora_id, request_id=request_id,
                  timeout_s=timeout_s)
        if not self.loop.on_loop():          # another loop (a test client's): run it on
            caller, fwd = asyncio.get_running_loop(), None     # ours, its deltas sent back
            if on_delta is not None:
                def fwd(d: TokenDelta) -> None:
                    caller.call_soon_threadsafe(on_delta, d)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self._run_request(prompt, sampling, on_delta=fwd, **kw), self.loop.loop))
        return await self._run_request(prompt, sampling, on_delta=on_delta, **kw)

    async def _run_request(self, prompt: Any, sampling: SamplingParams | None, *, chat: bool,
                           tenant: str, lora_id: str, request_id: str | None,
                           on_delta: Callable[[TokenDelta], None] | None,
                           timeout_s: float | None) -> RequestResult:
        sampling = sampling or SamplingParams()
        rid = request_id or uuid.uuid4().hex[:12]
        flight = Flight(rid)
        with self._lock:
            if rid in self._flights:
                raise RequestError(f"request id {rid!r} is already in flight")
            self._flights[rid] = flight
            self.metrics.set_in_flight(len(self._flights))
        self.traces.start(rid)  # trace hook
        t0, status, result = time.monotonic(), 500, None
        window, first_at = self.request_window, []
        if window is not None:        # the autoscaler's view: TTFT as the client sees it
            window.arrive(t0, _prompt_tokens(prompt), sampling.max_tokens)
            client_delta = on_delta

            def on_delta(d: TokenDelta) -> None:
                if not first_at:
                    first_at.append(time.monotonic())
                if client_delta is not None:
                    client_delta(d)
        try:
            deadline = time.time() + (timeout_s or self.cfg.request_timeout_s)
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                prompt = tuple(prompt)
            request = RequestInput(rid, prompt, sampling, deadline, chat=chat, tenant=tenant,
                                   lora_id=lora_id)
            flight.deadline = deadline
            frontend = await self.frontend()   # tokenized and hashed here, once, off the loop
            flight.admitted = await asyncio.get_running_loop().run_in_executor(
                self._text_pool, frontend.admit, request)
            result = await self._run_with_retries(flight, frontend.output(flight.admitted),
                                                  on_delta)
            status = 200
            return result
        except BaseException as e:
            err = _client_error(e, flight)
            status = http_status(err)
            if err is e:
                raise
            raise err from e
        finally:
            with self._lock:
                self._flights.pop(rid, None)
                self.metrics.set_in_flight(len(self._flights))
            self.metrics.record_request(status, time.monotonic() - t0)
            self.traces.finish(rid, status)  # trace hook
            if window is not None:
                _window_end(window, t0, first_at, result, status == 200)

    async def _run_with_retries(self, flight: Flight, output: OutputText,
                                on_delta: Callable[[TokenDelta], None] | None) -> RequestResult:
        """A worker that dies (or is restarting) fails only the attempt: what the other side
        holds is released and the request runs again elsewhere under the next epoch (prefill
        and decode again; the admitted request is not tokenized again). Tokens the client
        already got are not sent twice (the re-run yields the same ones for greedy or seeded
        sampling). After max_retries the request ends with an error."""
        sent = flight.sent = DeliveredTokens(output, on_delta, lambda: self._stop_on_worker(flight))
        epoch = failures = fallbacks = 0
        deadline = flight.admitted.deadline
        while True:
            current = replace(flight.admitted, epoch=epoch)
            flight.new_attempt(epoch, current.worker_request_id)
            try:
                result = await self._run(flight, current, sent)
                result.lifecycle.retries = failures
                result.lifecycle.migration_fallbacks = fallbacks
                return result
            except MoveFailed as e:       # its KV did not move: re-prefill elsewhere
                await self.releases.release(flight)
                if flight.aborted:
                    raise _aborted(flight) from None
                fallbacks += 1
                if fallbacks > MAX_MOVE_FALLBACKS:
                    raise WorkerFailed(f"request {flight.request_id}: {fallbacks} live moves "
                                       f"failed (last: {e})") from e
            except (ray.exceptions.RayActorError, _ReservationLost) as e:
                await self.releases.release(flight)
                if flight.aborted:
                    raise _aborted(flight) from None
                with self._lock:
                    self.retries += 1
                self.traces.retried(flight.request_id)  # trace hook
                failures += 1
                if failures > self.cfg.max_retries:
                    raise WorkerFailed(f"request {flight.request_id} failed: its workers died "
                                       f"{failures} times (last: {type(e).__name__})") from e
                await asyncio.get_running_loop().run_in_executor(   # who is gone, before
                    None, self.fleet.refresh)                        # routing again
            # past any epoch a move used, the failed ones too: a failed move's cleanup on its
            # target (an abort of that epoch's id) must not meet this attempt there
            epoch = max(flight.epoch, flight.last_epoch) + 1
            if time.time() > deadline:
                break
        raise WorkerFailed(f"request {flight.request_id} passed its deadline while its "
                           "workers kept failing")

    async def _run(self, flight: Flight, request: AdmittedRequest,
                   sent: DeliveredTokens) -> RequestResult:
        on_delta = sent.new_attempt()
        clock = flight.clock = AttemptClock()
        try:
            admission = await self._admit(flight, request, clock)
            if admission.local:
                items = await self._open_stream(flight, None, clock)
            else:
                items = await self._prefill_and_stream(flight, admission, clock)
            overhead_ms, round_trips = clock.overhead_ms(), clock.round_trips
            done = RequestDone()
            try:
                async for item in items:
                    if item is MOVED:        # the new decode worker replays the output
                        on_delta = sent.new_attempt()
                    elif isinstance(item, RequestDone):
                        done = item
                    else:
                        self.traces.tokens(flight.request_id, len(item))  # trace hook
                        on_delta(item)
            finally:
                await self.releases.settle_ack(flight)
        finally:
            self._close_inbox(flight)
        if flight.aborted or done.lifecycle is None:
            raise _aborted(flight)
        sent.finish(done.token_ids)
        output = sent.output
        lc = replace(done.lifecycle, handoff_round_trips=round_trips,
                     router_overhead_ms=overhead_ms)
        if output.stopped:                   # the router's stop string, not the worker's rule
            lc = replace(lc, finish_reason="stop", output_tokens=len(output.token_ids))
        if lc.prefill_worker and lc.decode_worker and not lc.migrations:
            with self._lock:
                self.transfer_rates.observe(lc.prefill_worker, lc.decode_worker,
                                            lc.transfer_bytes, lc.transfer_s)
        self.traces.add_transfer_bytes(flight.request_id, lc.transfer_bytes)  # trace hook
        return RequestResult(output.text, list(output.token_ids), lc)

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
                        raise _aborted(flight)
                    return adm
            if flight.aborted:
                raise _aborted(flight)
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
                raise _aborted(flight)
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
                raise _ReservationLost(f"request {flight.request_id}: its decode worker was "
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
        first = await _next_delta(flight.inbox, timeout)
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
                delta = await _next_delta(flight.inbox, max(1.0, self._deadline_left(flight)))
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

    def abort(self, request_id: str) -> bool:
        """Client abort at any stage: every block on both sides is released."""
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        rid = flight.attempt_id or flight.request_id
        if flight.prefill is not None:
            flight.prefill.abort.remote(rid)
        if flight.decode is not None:        # the request's coroutine confirms, closes holds
            flight.decode.abort.remote(rid)
        return True

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._flights)

    # ---- many requests -----------------------------------------------------------------------
    def generate(self, prompts: list, sampling: SamplingParams | None = None,
                 **kw) -> list[RequestResult]:
        """Run requests concurrently (blocking; not from the router loop); results in input
        order (a request that failed has its error's message in `error`)."""
        async def one(p):
            try:
                return await self.run_request_async(p, sampling, **kw)
            except RaypdError as e:
                return RequestResult(error=str(e))

        async def every():
            return await asyncio.gather(*(one(p) for p in prompts))
        return self.loop.run(every())

    def close(self, wait_s: float | None = None) -> None:
        """Stop the load reporter, the stream readers and the router loop. With `wait_s`,
        also wait (that long at most) until the reporter has made its last Ray call: a Ray
        call after ray.shutdown() would start a new local Ray."""
        self._stop.set()
        self.fleet.close(wait_s)
        self.streams.close_all(self.loop.loop)
        self.loop.close(wait_s if wait_s is not None else 5.0)
        self._text_pool.shutdown(wait=False, cancel_futures=True)


class _NoMetrics:
    def record_request(self, status: int, seconds: float | None = None) -> None: ...
    def record_decision(self, policy: str, reason: str, target: str = "") -> None: ...
    def set_in_flight(self, n: int) -> None: ...


async def _next_delta(inbox: asyncio.Queue, timeout: float) -> RequestDelta | MoveSignal:
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


def _prompt_tokens(prompt: Any) -> int:
    """A prompt's length before tokenization: exact for token ids, ~3 characters a token
    for text (the router tokenizes nothing; the window's means are estimates for text)."""
    if isinstance(prompt, tuple) or isinstance(prompt, list) and prompt and \
            isinstance(prompt[0], int):
        return len(prompt)
    return max(1, len(str(prompt)) // 3)


def _window_end(window: Any, t0: float, first_at: list[float], result: RequestResult | None,
                ok: bool) -> None:
    """A request's end into the autoscaler's window: TTFT from its arrival at the router to
    its first token at the client, TPOT over the rest; a failed request counts as a miss."""
    now = time.monotonic()
    lc = result.lifecycle if result is not None else None
    n = len(result.token_ids) if result is not None else 0
    ttft = first_at[0] - t0 if first_at else None
    tpot = (now - first_at[0]) / (n - 1) if first_at and n > 1 else None
    window.record(now, lc.prompt_tokens if lc else 0, lc.cached_tokens if lc else 0, n, ttft,
                  tpot, ok and lc is not None)


def _aborted(flight: Flight) -> RequestAborted:
    return RequestAborted(f"request {flight.request_id} was aborted")


def _client_error(exc: BaseException, flight: Flight) -> BaseException:
    """What a request that raised `exc` ends with for its client: an error of
    protocol/errors.py (Ray's own exceptions never leave the router)."""
    if flight.aborted and isinstance(exc, RequestError):
        return exc if isinstance(exc, RequestAborted) else _aborted(flight)
    if isinstance(exc, RaypdError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, RaypdError):
        return exc.cause
    if isinstance(exc, ray.exceptions.RayError):
        return WorkerFailed(f"request {flight.request_id}: a worker failed: "
                            f"{type(exc).__name__}: {exc}")
    return exc
