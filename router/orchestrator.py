"""Request orchestration over worker actor handles, all on the router's one event loop
(router/event_loop.py): the frontend's text work (frontend/: tokenize, hash, detokenize, stop
strings), then each attempt's P -> D handoff (router/handoff_flow.py: route, admit, prefill,
transfer, stream), retries and aborts; live moves of running decodes in router/migration.py.

Torch-free: it holds Ray actor handles (through its Fleet, router/fleet.py) and the typed
messages of protocol/messages.py. A dead decode worker fails the attempt: both sides are
released and the request runs again under a new epoch. Every block held for the handoff is in
`self.ledger` (both sides) until a worker confirms its release (router/flight.py). The router
measures KV transfer GB/s per (P, D) pair from the transfers it sees end, and compares its
predicted prefix hit of each prefill with the hit P reports (the hash drift alarm,
router/drift.py).
"""

from __future__ import annotations

import asyncio
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
    WorkerFailed,
    http_status,
)
from protocol.ledger import (
    HandoffLedger,
)
from protocol.messages import (
    AdmittedRequest,
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
    wait_ref,
)
from router.flow_config import FAILURE_POLICIES, FlowConfig  # noqa: F401  (re-exported)
from router.handoff_flow import MOVED, HandoffFlow, ReservationLost, aborted
from router.migration import LiveMigration, MoveFailed, unwrap
from router.policies import (
    Locality,
    RoutingRequest,
    make_policy,
)
from router.prefix_index import ApproxPrefixIndex
from router.request_traces import TraceStore  # trace hook
from router.streams import DeltaStreams
from router.transfer_rates import TransferRates
from router.worker_view import note_decode, note_prefill

MAX_MOVE_FALLBACKS = 8      # re-prefills after failed moves, per request
TEXT_THREADS = 2            # the router's tokenizing threads (a prompt's encode is off the loop)


class Orchestrator(HandoffFlow, LiveMigration):
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
                    raise aborted(flight) from None
                fallbacks += 1
                if fallbacks > MAX_MOVE_FALLBACKS:
                    raise WorkerFailed(f"request {flight.request_id}: {fallbacks} live moves "
                                       f"failed (last: {e})") from e
            except (ray.exceptions.RayActorError, ReservationLost) as e:
                await self.releases.release(flight)
                if flight.aborted:
                    raise aborted(flight) from None
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
            raise aborted(flight)
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


def _client_error(exc: BaseException, flight: Flight) -> BaseException:
    """What a request that raised `exc` ends with for its client: an error of
    protocol/errors.py (Ray's own exceptions never leave the router)."""
    if flight.aborted and isinstance(exc, RequestError):
        return exc if isinstance(exc, RequestAborted) else aborted(flight)
    if isinstance(exc, RaypdError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, RaypdError):
        return exc.cause
    if isinstance(exc, ray.exceptions.RayError):
        return WorkerFailed(f"request {flight.request_id}: a worker failed: "
                            f"{type(exc).__name__}: {exc}")
    return exc
