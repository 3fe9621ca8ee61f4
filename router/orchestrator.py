"""Request orchestration P -> D over worker actor handles: route, admit, prefill, transfer, stream.

Torch-free: it holds Ray actor handles and the typed messages of kvcache/handoff.py. For each
request, three round trips before D's first decode step:
  1. D.admit: the policy picks the decode worker D; D tokenizes, validates and hashes the
     request once, reserves blocks decode-first and plans the transfer (or prefills it itself
     when what it lacks is short, or when there are no prefill workers: colocated mode);
  2. P.prefill: the policy picks the prefill worker P (prefix locality vs load); P prefills and
     stages exactly the plan's pages;
  3. D.stream: D pulls (for RDT this process routes P's tensor to D), verifies and lands the
     pages, and streams tokens back; P's ack goes out after the first token.
A prefill or transfer that fails is retried on another prefill worker (D keeps its
reservation); only when none is left does D prefill it itself. A dead decode worker fails the
attempt: both sides are released and the request runs again under a new epoch. Every block held
for the handoff is in `self.ledger` (both sides) until a worker confirms its release.
A reporter thread polls every worker's `load_report` (KV events, load, ledger releases) to keep
the index and the policies' view of the workers current; between reports each decision is
added locally. The router measures KV transfer GB/s per (P, D) pair from the transfers it sees
end, and compares its predicted prefix hit of each prefill with the hit P reports (the hash
drift alarm, router/drift.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from kvcache import ledger as L
from kvcache.handoff import (
    Admission,
    AdmittedRequest,
    LoadReport,
    PrefillResult,
    RequestDone,
    RequestInput,
    TransferRejected,
)
from kvcache.ledger import HandoffLedger
from kvcache.sampling import RequestError, SamplingParams
from router.drift import HashDriftAlarm
from router.policies import Locality, RoutingRejected, RoutingRequest, WorkerState, make_policy
from router.prefix_index import ApproxPrefixIndex, PrefixIndex
from router.request_traces import TraceStore  # trace hook
from router.transfer_rates import TransferRates
from router.worker_view import REPORT_INTERVAL_S, apply_load_report, note_decode, note_prefill

FAILURE_POLICIES = ("recompute", "fail")
CLEANUP_WAIT_S = 10.0   # how long a request thread waits for workers to confirm a release


@dataclass
class FlowConfig:
    policy: str = "locality"
    policy_cfg: dict | None = None
    index_mode: str = "precise"            # precise (KV events) | approx (own decisions + TTL)
    local_prefill_max_tokens: int = 0      # D prefills itself when it lacks <= this many tokens
    failure_policy: str = "recompute"      # on a failed transfer: recompute on D, or fail
    transport: str = "object_store"
    rdt_backend: str = "gloo"
    admit_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    report_interval_s: float = REPORT_INTERVAL_S
    health_timeout_s: float = 10.0         # a worker whose report takes this long is unhealthy
    hang_timeout_s: float = 300.0          # one engine step running this long: the worker hangs
    max_retries: int = 2                   # re-runs of a request whose worker died

    def validate(self) -> None:
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.failure_policy!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.index_mode not in ("precise", "approx"):
            raise ValueError(f"index_mode must be precise or approx, got {self.index_mode!r}")
        make_policy(self.policy, **(self.policy_cfg or {}))   # unknown name -> ValueError


@dataclass
class _Flight:
    """Where one request is, so an abort can release it everywhere."""

    request_id: str
    epoch: int = 0
    attempt_id: str = ""       # the id workers know this attempt by (request id + epoch)
    decode: Any = None
    prefill: Any = None
    transfer_id: str | None = None
    aborted: bool = False
    deadline: float | None = None   # wall clock
    ack: Any = None                 # P's ack in flight (settled when the request ends)
    predicted_hit_tokens: int = 0   # the router's predicted prefix hit on the chosen P
    clock: Any = None               # the attempt's _Clock (cleanup waits count as waiting)


@dataclass
class _Clock:
    """One attempt's handoff cost: actor round trips awaited, and the time spent waiting in
    them, until D's first token (the rest of the time is the router's own overhead)."""

    started: float = field(default_factory=time.perf_counter)
    round_trips: int = 0
    waited_s: float = 0.0

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        self.round_trips += 1
        try:
            return ray.get(ref, timeout=timeout)
        finally:
            self.waited_s += time.perf_counter() - t0

    def first(self, gen: Any, timeout: float | None = None) -> Any:
        """The first item of an actor's stream (waiting for it to be produced, then for it)."""
        t0 = time.perf_counter()
        try:
            ref = next(gen)
        finally:
            self.waited_s += time.perf_counter() - t0
        return self.get(ref, timeout)

    def sleep(self, seconds: float) -> None:
        """Waiting for capacity is queueing, not the router's own work."""
        time.sleep(seconds)
        self.waited_s += seconds

    def overhead_ms(self) -> float:
        return max(0.0, time.perf_counter() - self.started - self.waited_s) * 1e3


class Orchestrator:
    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any], cfg: FlowConfig,
                 worker_ids: dict[Any, str] | None = None, metrics: Any = None) -> None:
        """`metrics`: an object with record_request / record_decision / set_in_flight (the
        cluster layer passes Ray-exported RouterMetrics); None records nothing."""
        cfg.validate()
        self.cfg = cfg
        self.prefill, self.decode = list(prefill), list(decode)
        ids = worker_ids or {}
        self._id = {w: ids.get(w) or ray.get(w.ping.remote()) for w in self.prefill + self.decode}
        self._by_id = {v: k for k, v in self._id.items()}
        self.policy = make_policy(cfg.policy, **(cfg.policy_cfg or {}))
        self.index = PrefixIndex() if cfg.index_mode == "precise" else ApproxPrefixIndex()
        self.state: dict[str, WorkerState] = {wid: WorkerState(wid) for wid in self._by_id}
        self.transfer_rates = TransferRates()    # measured GB/s per (P, D) pair
        self.drift = HashDriftAlarm()            # predicted vs engine-reported prefix hits
        self.decisions: dict[str, int] = {}     # "policy:reason" -> count
        self.draining: set[str] = set()          # worker ids: no new requests (scale-in)
        self.unhealthy: set[str] = set()         # worker ids that failed their last report
        self.retries = 0                         # request re-runs after a worker failure
        self.prefill_retries = 0                 # prefills re-run on another prefill worker
        self.acks_lost = 0                       # acks P did not confirm (lease frees it)
        self.rejected: dict[str, int] = {}       # TransferRejected reason -> count (router view)
        # the latest rejections, (reason, prefill worker, worker request id): an audit trail
        # that outlives a decode worker's restart (chaos checks corruption against it)
        self.recent_rejections: deque[tuple[str, str, str]] = deque(maxlen=4096)
        self.ledger = HandoffLedger()            # both sides' handoff holds, router's view
        self._incarnation: dict[str, str] = {}   # worker id -> incarnation last reported
        self._refresh_lock = threading.Lock()    # one refresh at a time (the report loop's,
        self._report_refs: dict[Any, Any] = {}   # a drain's): worker -> report still on its way
        self._lease_pending: set[tuple] = set()  # ledger keys left to a lease (ack lost)
        self._block_size = 16                    # learned from the first admission
        self.metrics = metrics or _NoMetrics()
        self._flights: dict[str, _Flight] = {}
        self.traces = TraceStore(on_finish=getattr(self.metrics, "record_trace", None))  # trace hook
        self._lock = threading.Lock()
        # RDT: one transfer at a time per actor. Ray matches sends to receives by order only
        # (no tags) and does not promise threaded actors run tasks in submission order, so two
        # transfers in flight at one actor could pair A's send with B's receive.
        self._rdt_locks: dict[str, threading.Lock] = {}
        self._rr = itertools.count()
        self._stop = threading.Event()
        self.refresh()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True,
                                          name="raypd-router-reports")
        self._reporter.start()

    # ---- worker view -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pull every worker's KV events and load once; mark silent or dead workers unhealthy.

        An unhealthy worker gets no new requests and its prefix-index entries are dropped
        (a restarted actor comes back with an empty cache); it is healthy again once it
        answers."""
        with self._refresh_lock:
            self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            workers = list(self._id)
        # a report that did not come back in time is still on its way, carrying KV events
        # and hold releases the worker has handed over: wait for that one, never drop it
        pending = self._report_refs
        refs = {pending[w] if w in pending else w.load_report.remote(): w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.cfg.health_timeout_s)
        reports, failed = [], [w for r, w in refs.items() if r not in ready]
        self._report_refs = {w: r for r, w in refs.items() if r not in ready}
        for r in ready:
            try:
                reports.append(ray.get(r))
            except Exception:
                failed.append(refs[r])
        with self._lock:
            for w in failed:
                wid = self._id.get(w)
                if wid is not None and wid not in self.unhealthy:
                    self.unhealthy.add(wid)
                    self.index.remove_worker(wid)
            for rep in reports:
                self._apply_report(rep)

    def _apply_report(self, rep: LoadReport) -> None:
        """Under the lock: one worker's report into the index, its state and the ledger."""
        wid = rep.worker_id
        for rel in rep.released:          # holds the worker let go on its own (lease expiry)
            self.ledger.release(wid, rel.kind, rel.request_id, rel.reason)
            self._lease_pending.discard((wid, rel.kind, rel.request_id))
        if self._incarnation.setdefault(wid, rep.incarnation) != rep.incarnation:
            self._incarnation[wid] = rep.incarnation      # restarted: its memory is gone
            self._worker_restarted(wid)
        if wid not in self.state:         # removed meanwhile
            return
        if isinstance(self.index, PrefixIndex):
            self.index.apply(wid, rep.events)
        if rep.busy_for_s > self.cfg.hang_timeout_s:   # alive, but its engine is stuck
            self.unhealthy.add(wid)
            self.state[wid].draining = True
            return
        self.unhealthy.discard(wid)
        st = self.state[wid]
        apply_load_report(st, rep, time.monotonic())
        st.draining = wid in self.draining or wid in self.unhealthy

    def _worker_restarted(self, wid: str) -> None:
        """Under the lock: close the holds a restarted worker can no longer hold, for
        requests still in flight or left to a lease. A hold of a request that ended without
        closing it stays open: a leak, even though the worker died."""
        live = {f.attempt_id for f in self._flights.values()}
        for h in self.ledger.open_holds(wid):
            key = (wid, h.kind, h.request_id)
            if h.request_id in live or key in self._lease_pending:
                self.ledger.release(wid, h.kind, h.request_id, L.WORKER_DIED)
                self._lease_pending.discard(key)

    def _report_loop(self) -> None:
        while not self._stop.wait(self.cfg.report_interval_s):
            self.refresh()

    def _matches(self, hashes: list[int]) -> dict[str, int]:
        with self._lock:
            return self.index.match(hashes)

    def _decide(self, role: str, req: RoutingRequest, exclude: frozenset = frozenset(),
                flight: _Flight | None = None) -> Any:
        """The policy's pick; `exclude`: worker ids this request already failed on. A prefill
        pick records its predicted hit on `flight` (for the drift alarm)."""
        with self._lock:
            workers = self.decode if role == "decode" else self.prefill
            states = []
            for w in workers:
                st = self.state[self._id[w]]
                st.draining = st.worker_id in self.draining or st.worker_id in self.unhealthy \
                    or st.worker_id in exclude
                if role == "prefill":
                    st.transfer_gbps_to = self.transfer_rates.from_worker(st.worker_id)
                states.append(st)
        matches = self._matches(list(req.block_hashes))
        with self._lock:
            if role == "decode":
                d = self.policy.choose_decode(req, states, matches)
                note_decode(self.state[d.worker_id], req, d)   # counted until the next report
            else:
                d = self.policy.choose_prefill(req, states, matches)
                note_prefill(self.state[d.worker_id], req, d, Locality.pooled_fit(states),
                             time.monotonic())
                if flight is not None:
                    flight.predicted_hit_tokens = min(d.matched_blocks * req.block_size,
                                                      req.num_tokens)
                if isinstance(self.index, ApproxPrefixIndex):
                    self.index.record(d.worker_id, list(req.block_hashes))
            key = f"{self.policy.name}:{d.reason}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.metrics.record_decision(self.policy.name, d.reason, role)
            return self._by_id[d.worker_id]

    def observe_prefill_hit(self, predicted_tokens: int, real_tokens: int) -> None:
        """The drift alarm's input: the router's predicted prefix hit vs P's reported hit."""
        with self._lock:
            was = self.drift.alarm
            on = self.drift.observe(predicted_tokens, real_tokens)
        record = getattr(self.metrics, "record_hash_drift", None)
        if record is not None:
            record(on, on and not was)

    def live(self, role: str) -> list[Any]:
        """Workers of a role that take new requests (not draining, not unhealthy)."""
        with self._lock:
            workers = self.decode if role == "decode" else self.prefill
            return [w for w in workers if self._id[w] not in self.draining
                    and self._id[w] not in self.unhealthy]

    # ---- membership (live scaling) -------------------------------------------------------------
    def add_worker(self, role: str, worker: Any, worker_id: str) -> None:
        with self._lock:
            (self.decode if role == "decode" else self.prefill).append(worker)
            self._id[worker], self._by_id[worker_id] = worker_id, worker
            self.state[worker_id] = WorkerState(worker_id)

    def drain(self, worker_id: str) -> None:
        """Stop routing new requests to a worker; its requests in flight finish."""
        with self._lock:
            self.draining.add(worker_id)
            if worker_id in self.state:
                self.state[worker_id].draining = True

    def busy(self, worker_id: str) -> bool:
        """Whether any request in flight uses the worker."""
        with self._lock:
            w = self._by_id.get(worker_id)
            return any(w is f.decode or w is f.prefill for f in self._flights.values())

    def remove_worker(self, worker_id: str) -> Any:
        with self._lock:
            w = self._by_id.pop(worker_id)
            del self._id[w]
            for group in (self.prefill, self.decode):
                if w in group:
                    group.remove(w)
            self.state.pop(worker_id, None)
            self.draining.discard(worker_id)
            self.unhealthy.discard(worker_id)
            self.index.remove_worker(worker_id)
            return w

    # ---- one request -------------------------------------------------------------------------
    def run_request(self, prompt: Any, sampling: SamplingParams | None = None, *,
                    chat: bool = False, tenant: str = "", lora_id: str = "",
                    request_id: str | None = None,
                    on_delta: Callable[[dict], None] | None = None,
                    timeout_s: float | None = None) -> dict:
        """Run one request through P and D; returns {text, token_ids, lifecycle}.
        `on_delta({"token_ids": [...], "text": "..."})` is called as tokens stream in.
        The request must end within `timeout_s` (default: request_timeout_s); the workers
        drop what they hold for it by then on their own.
        Raises RequestError (bad request, aborted), RoutingRejected (no capacity / SLO),
        TransferFailed, WorkerFailed."""
        sampling = sampling or SamplingParams()
        sampling.validate()
        rid = request_id or uuid.uuid4().hex[:12]
        flight = _Flight(rid)
        with self._lock:
            if rid in self._flights:
                raise RequestError(f"request id {rid!r} is already in flight")
            self._flights[rid] = flight
            self.metrics.set_in_flight(len(self._flights))
        self.traces.start(rid)  # trace hook
        t0, status = time.monotonic(), 500
        try:
            deadline = time.time() + (timeout_s or self.cfg.request_timeout_s)
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                prompt = tuple(prompt)
            request = RequestInput(rid, prompt, sampling, deadline, chat=chat, tenant=tenant,
                                   lora_id=lora_id)
            flight.deadline = deadline
            result = self._run_with_retries(flight, request, on_delta)
            status = 200
            return result
        except RequestError:
            status = 499 if flight.aborted else 400
            raise
        except RoutingRejected:
            status = 429
            raise
        except TransferFailed:
            status = 502
            raise
        finally:
            with self._lock:
                self._flights.pop(rid, None)
                self.metrics.set_in_flight(len(self._flights))
            self.metrics.record_request(status, time.monotonic() - t0)
            self.traces.finish(rid, status)  # trace hook

    def _run_with_retries(self, flight: _Flight, request: RequestInput,
                          on_delta: Callable[[dict], None] | None) -> dict:
        """A worker that dies (or is restarting) fails only the attempt: what the other side
        holds is released and the request runs again elsewhere under the next epoch (prefill
        and decode again; the admitted request is not tokenized again). Tokens the client
        already got are not sent twice (the re-run yields the same ones for greedy or seeded
        sampling). After max_retries the request ends with an error."""
        sent = _Delivered(on_delta)
        current: RequestInput | AdmittedRequest = request
        for epoch in range(self.cfg.max_retries + 1):
            flight.epoch = epoch
            flight.attempt_id = request.worker_request_id if epoch == 0 else \
                replace(request, epoch=epoch).worker_request_id
            current = replace(current, epoch=epoch)
            try:
                result = self._run(flight, current, sent.new_attempt())
                result["lifecycle"]["retries"] = epoch
                return result
            except ray.exceptions.RayActorError as e:
                self._release(flight, L.WORKER_DIED)
                if flight.aborted:
                    raise RequestError(f"request {flight.request_id} was aborted") from None
                with self._lock:
                    self.retries += 1
                self.traces.retried(flight.request_id)  # trace hook
                if attempt_admitted := getattr(e, "_raypd_admitted", None):
                    current = attempt_admitted
                if epoch == self.cfg.max_retries:
                    raise WorkerFailed(f"request {flight.request_id} failed: its workers died "
                                       f"{epoch + 1} times (last: {type(e).__name__})") from e
                flight.decode = flight.prefill = flight.transfer_id = None
                self.refresh()     # see who is gone before routing again
            if time.time() > request.deadline:
                break
        raise WorkerFailed(f"request {flight.request_id} passed its deadline while its "
                           "workers kept failing")

    def _run(self, flight: _Flight, request: RequestInput | AdmittedRequest,
             on_delta: Callable[[dict], None]) -> dict:
        clock = flight.clock = _Clock()
        admission = self._admit(flight, request, clock)
        admitted = admission.request
        try:
            if admission.local:
                items = self._open_stream(flight, None, clock)
            else:
                items = self._prefill_and_stream(flight, admission, clock)
        except ray.exceptions.RayActorError as e:
            e._raypd_admitted = admitted     # the retry re-admits it without tokenizing again
            raise
        overhead_ms, round_trips = clock.overhead_ms(), clock.round_trips
        done = RequestDone()
        try:
            for item in items:
                if isinstance(item, RequestDone):
                    done = item
                else:
                    self.traces.tokens(flight.request_id, len(item.token_ids))  # trace hook
                    on_delta({"token_ids": list(item.token_ids), "text": item.text})
        except ray.exceptions.RayActorError as e:
            e._raypd_admitted = admitted
            raise
        finally:
            self._settle_ack(flight)
        if flight.aborted or done.lifecycle is None:
            raise RequestError(f"request {flight.request_id} was aborted")
        lc = done.lifecycle.to_dict()
        if lc.get("prefill_worker") and lc.get("decode_worker"):
            with self._lock:
                self.transfer_rates.observe(lc["prefill_worker"], lc["decode_worker"],
                                            lc.get("transfer_bytes") or 0,
                                            lc.get("transfer_s") or 0.0)
        self.traces.add_transfer_bytes(flight.request_id, lc.get("transfer_bytes") or 0)  # trace hook
        lc["handoff_round_trips"] = round_trips
        lc["router_overhead_ms"] = overhead_ms
        return {"text": done.text, "token_ids": list(done.token_ids), "lifecycle": lc}

    def _routing_request(self, request: RequestInput | AdmittedRequest,
                         decode_cached_blocks: int = 0, decode_worker: str = "") -> RoutingRequest:
        if isinstance(request, AdmittedRequest):
            return RoutingRequest(request.request_id, list(request.block_hashes),
                                  request.num_tokens, request.block_size,
                                  tenant=request.tenant,
                                  output_tokens=request.sampling.max_tokens,
                                  decode_cached_blocks=decode_cached_blocks,
                                  lora=request.lora_id, decode_worker=decode_worker)
        p = request.prompt   # not tokenized yet: capacity by an estimate, no prefix match
        n = len(p) if isinstance(p, tuple) else max(1, len(str(p)) // 3)
        return RoutingRequest(request.request_id, [], n, self._block_size,
                              tenant=request.tenant, output_tokens=request.sampling.max_tokens,
                              lora=request.lora_id)

    def _admit(self, flight: _Flight, request: RequestInput | AdmittedRequest,
               clock: _Clock) -> Admission:
        """Decode-first: the first decode worker with room reserves blocks and plans the
        transfer. Round trip 1 (more only while decode workers are full)."""
        local_max = self.cfg.local_prefill_max_tokens if self.live("prefill") else 1 << 62
        deadline = min(time.monotonic() + self.cfg.admit_timeout_s,
                       time.monotonic() + request.deadline - time.time())
        while True:
            live = self.live("decode")
            try:
                first = self._decide("decode", self._routing_request(request))
                self.traces.routed(flight.request_id, self._id.get(first, "?"))  # trace hook
                order = [first] + [d for d in live if d is not first]
            except RoutingRejected:
                order = live                 # the view may be stale: ask them all
            for d in order:
                try:
                    adm: Admission = _unwrap(lambda d=d, r=request: clock.get(
                        d.admit.remote(r, local_max)))
                except ray.exceptions.RayActorError:
                    continue                 # died or restarting: the reporter will notice
                request = adm.request        # tokenized once: later tries pass this on
                self._block_size = request.block_size
                if adm.admitted:
                    flight.decode = d
                    self.traces.admitted(flight.request_id, self._id.get(d, "?"), adm.local)  # trace hook
                    if not adm.local:
                        self.ledger.hold(adm.decode_worker, L.RESERVED,
                                         request.worker_request_id, adm.reserved_blocks,
                                         max(0.0, request.deadline - time.time()))
                    if flight.aborted:       # aborted while being admitted
                        self._release(flight, L.ABORTED)
                        raise RequestError(f"request {flight.request_id} was aborted")
                    return adm
            if flight.aborted:
                raise RequestError(f"request {flight.request_id} was aborted")
            if time.monotonic() > deadline:
                raise RoutingRejected("no_decode_capacity", "no decode worker has room for "
                                      f"this request (waited {self.cfg.admit_timeout_s:.0f} s)",
                                      retry_after_s=5)
            clock.sleep(0.02)

    def _prefill_and_stream(self, flight: _Flight, admission: Admission, clock: _Clock):
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
                self._release(flight, L.ABORTED)
                raise RequestError(f"request {flight.request_id} was aborted")
            try:
                p = self._decide("prefill", self._routing_request(
                    admitted, admission.decode_cached_blocks, admission.decode_worker),
                    frozenset(tried), flight)
            except RoutingRejected as e:
                if e.reason != "no_workers":
                    self._release(flight, L.ABORTED)
                    raise
                p = None
            if p is None:                    # no prefill worker left: D prefills it itself
                if self.cfg.failure_policy == "fail" and last_error is not None:
                    self._release(flight, L.TRANSFER_FAILED)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {last_error}") from last_error
                if clock.get(d.fallback_local.remote(rid)):
                    self.ledger.release(did, L.RESERVED, rid, L.FALLBACK_LOCAL)
                    return self._open_stream(flight, None, clock)
                self._release(flight, L.ABORTED)
                raise TransferFailed(f"request {flight.request_id}: no prefill worker left "
                                     "and its reservation is gone") from last_error
            pid = self._id.get(p, "?")
            tried.add(pid)
            flight.prefill = p
            try:
                result: PrefillResult = _unwrap(lambda p=p: clock.get(
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
                self.ledger.hold(pid, L.STAGED, rid, plan.num_blocks, result.lease_s)
            try:
                return self._open_stream(flight, result, clock)
            except ray.exceptions.RayActorError:
                self._release_staged(flight, L.ABORTED)
                raise
            except ray.exceptions.GetTimeoutError as e:   # D's pull hangs: give up
                self._release(flight, L.TRANSFER_FAILED)
                raise TransferFailed(f"KV transfer for request {flight.request_id} did not "
                                     "finish before its deadline") from e
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                reason = cause.reason if isinstance(cause, TransferRejected) else "error"
                with self._lock:
                    self.rejected[reason] = self.rejected.get(reason, 0) + 1
                    self.recent_rejections.append((reason, pid, rid))
                    self.prefill_retries += 1
                self._release_staged(flight, L.TRANSFER_FAILED)
                last_error = e
                if flight.aborted:
                    continue
                if reason == "unknown":     # D no longer holds the reservation
                    self._release(flight, L.TRANSFER_FAILED)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {cause}") from e
                if self.cfg.failure_policy == "fail":
                    self._release(flight, L.TRANSFER_FAILED)
                    raise TransferFailed(f"KV transfer for request {flight.request_id} "
                                         f"failed: {cause or e}") from e

    def _open_stream(self, flight: _Flight, result: PrefillResult | None, clock: _Clock):
        """Start D's stream (landing `result`'s pages first); returns an iterator over its
        items whose first item has arrived."""
        d, rid = flight.decode, flight.attempt_id
        timeout = max(1.0, self._deadline_left(flight))
        with contextlib.ExitStack() as stack:
            if result is not None and result.handle is not None and self.cfg.transport == "rdt":
                stack.enter_context(self._rdt_exclusive(flight.prefill, d))
                send = flight.prefill.kv_send.options(tensor_transport=self.cfg.rdt_backend)
                pages = send.remote(result.handle.transfer_id)
                gen = d.stream.remote(flight.request_id, flight.epoch, result, pages,
                                      sent_at=time.time(), timeout=timeout)
            else:
                gen = d.stream.remote(flight.request_id, flight.epoch, result, timeout=timeout)
            first = _unwrap(lambda: clock.first(gen, timeout=timeout))
        if result is not None:
            did = self._id.get(d, "?")
            self.traces.transferred(flight.request_id, did)  # trace hook: D landed the pages
            self.ledger.release(did, L.RESERVED, rid, L.FILLED)
            if result.handle is not None:    # off the critical path: settled at the end
                flight.ack = flight.prefill.ack.remote(result.handle.transfer_id)

        def items():
            yield first
            for ref in gen:
                yield ray.get(ref)
        return items()

    def _deadline_left(self, flight: _Flight) -> float:
        return self.cfg.request_timeout_s if flight.deadline is None else \
            flight.deadline - time.time()

    def _settle_ack(self, flight: _Flight) -> None:
        """Close P's staged hold by the ack's answer (sent after D's first token)."""
        ack = getattr(flight, "ack", None)
        if ack is None:
            return
        flight.ack = None
        pid = self._id.get(flight.prefill, "?")
        key = (pid, L.STAGED, flight.attempt_id)
        try:
            reason = ray.get(ack, timeout=CLEANUP_WAIT_S)
        except ray.exceptions.RayActorError:
            self.ledger.release(*key, L.WORKER_DIED)
            return
        except Exception:
            reason = "lost"
        if reason == L.ACKED:
            self.ledger.release(*key, L.ACKED)
        else:                                # ack lost: the lease frees it; P reports that
            with self._lock:
                self.acks_lost += 1
                if self.ledger.is_open(*key):
                    self._lease_pending.add(key)
        flight.transfer_id = None

    @contextlib.contextmanager
    def _rdt_exclusive(self, *actors: Any):
        """Hold the RDT locks of these actors (taken in one global order: no deadlock)."""
        with self._lock:
            locks = [self._rdt_locks.setdefault(k, threading.Lock())
                     for k in sorted({a._actor_id.hex() for a in actors})]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def _release_staged(self, flight: _Flight, reason: str) -> None:
        """Drop P's staged copy of this attempt and wait until P confirms."""
        if flight.prefill is None or not flight.transfer_id:
            return
        pid = self._id.get(flight.prefill, "?")
        ref = flight.prefill.abort_transfer.remote(flight.transfer_id)
        flight.transfer_id = None
        self._confirm(ref, pid, L.STAGED, flight.attempt_id, reason, flight.clock)

    def _confirm(self, ref: Any, wid: str, kind: str, rid: str, reason: str,
                 flight_clock: _Clock | None = None) -> None:
        """Close a ledger hold once the worker answered the release (a dead worker: died)."""
        try:
            (flight_clock or _Clock()).get(ref, timeout=CLEANUP_WAIT_S)
        except ray.exceptions.RayActorError:
            self.ledger.release(wid, kind, rid, L.WORKER_DIED)
            return
        except Exception:
            return                           # no answer: the hold stays open (lease / deadline)
        self.ledger.release(wid, kind, rid, reason)

    def _release(self, flight: _Flight, reason: str) -> None:
        """Release the attempt's state on both sides and wait for the workers to confirm
        (calls to a dead worker just fail: its holds close as worker_died)."""
        rid = flight.attempt_id or flight.request_id
        self._settle_ack(flight)
        if flight.prefill is not None:
            flight.prefill.abort.remote(rid)
            self._release_staged(flight, L.ABORTED)
        if flight.decode is not None:
            did = self._id.get(flight.decode, "?")
            self._confirm(flight.decode.abort.remote(rid), did, L.RESERVED, rid, L.ABORTED,
                          flight.clock)

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
        if flight.decode is not None:        # the request thread confirms and closes holds
            flight.decode.abort.remote(rid)
        return True

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._flights)

    # ---- many requests -----------------------------------------------------------------------
    def generate(self, prompts: list, sampling: SamplingParams | None = None,
                 **kw) -> list[dict]:
        """Run requests concurrently; results in input order (an error becomes {"error": ...})."""
        def one(p):
            try:
                return self.run_request(p, sampling, **kw)
            except (RequestError, RoutingRejected, TransferFailed, WorkerFailed,
                    ray.exceptions.RayError) as e:
                return {"error": str(e)}
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(one, prompts))

    def close(self, wait_s: float | None = None) -> None:
        """Stop the load reporter. With `wait_s`, also wait (that long at most) until it has
        made its last Ray call: a Ray call after ray.shutdown() would start a new local Ray."""
        self._stop.set()
        if wait_s is not None and self._reporter is not threading.current_thread():
            self._reporter.join(wait_s)


class TransferFailed(RuntimeError):
    """A KV transfer failed and the failure policy is `fail`."""


class _NoMetrics:
    def record_request(self, status: int, seconds: float | None = None) -> None: ...
    def record_decision(self, policy: str, reason: str, target: str = "") -> None: ...
    def set_in_flight(self, n: int) -> None: ...


class WorkerFailed(RuntimeError):
    """The request's workers kept dying; it ends with this explicit error (never lost)."""


class _Delivered:
    """Forwards streamed deltas to the client once: a re-run after a worker failure replays
    the tokens the client already has, and only what lies beyond them is forwarded."""

    def __init__(self, on_delta: Callable[[dict], None] | None) -> None:
        self.on_delta = on_delta
        self.tokens = 0   # token ids the client has
        self.chars = 0    # characters of text the client has

    def new_attempt(self) -> Callable[[dict], None]:
        cum_tokens, cum_text = [0], [""]

        def forward(delta: dict) -> None:
            start_tok, start_chr = cum_tokens[0], len(cum_text[0])
            cum_tokens[0] += len(delta["token_ids"])
            cum_text[0] += delta["text"]
            if self.on_delta is None:
                return
            toks = delta["token_ids"][max(0, self.tokens - start_tok):]
            text = delta["text"][max(0, self.chars - start_chr):]
            self.tokens = max(self.tokens, cum_tokens[0])
            self.chars = max(self.chars, len(cum_text[0]))
            if toks or text:
                self.on_delta({"token_ids": toks, "text": text})
        return forward


def _settle(refs: list, timeout_s: float) -> None:
    """Wait until these cleanup calls have run (or failed: a dead worker holds nothing)."""
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def _unwrap(call: Callable[[], Any]) -> Any:
    """Run a ray.get; a RequestError raised inside the worker comes out as itself."""
    try:
        return call()
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RequestError):
            raise RequestError(str(e.cause)) from None
        raise
