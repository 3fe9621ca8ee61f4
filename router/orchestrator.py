"""Request orchestration P -> D over worker actor handles: route, admit, prefill, transfer, stream.

Torch-free: it holds Ray actor handles and plain data only. For each request:
  1. a worker tokenizes and hashes it (`prepare`), the prefix index says which workers hold
     its leading blocks, the policy picks the decode worker D;
  2. D admits it decode-first (reserves blocks; or prefills it itself when what it lacks is
     short, or when there are no prefill workers: colocated mode);
  3. the policy picks the prefill worker P; P prefills and stages the pages D lacks;
  4. D pulls them (or, for RDT, this process routes P's tensor to D), P is acked;
  5. D streams tokens back.
A reporter thread polls every worker's `load_report` (KV events + load) to keep the index and
the policies' view of the workers current; between reports each decision is added locally.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import ray

from kvcache.sampling import RequestError, SamplingParams
from router.policies import RoutingRejected, RoutingRequest, WorkerState, make_policy
from router.prefix_index import ApproxPrefixIndex, PrefixIndex
from router.request_traces import TraceStore  # trace hook

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
    report_interval_s: float = 0.1
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
    attempt_id: str = ""       # the id workers know this attempt by
    decode: Any = None
    prefill: Any = None
    transfer_id: str | None = None
    aborted: bool = False


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
        self.decisions: dict[str, int] = {}     # "policy:reason" -> count
        self.draining: set[str] = set()          # worker ids: no new requests (scale-in)
        self.unhealthy: set[str] = set()         # worker ids that failed their last report
        self.retries = 0                         # request re-runs after a worker failure
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
        with self._lock:
            workers = list(self._id)
        refs = {w.load_report.remote(): w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.cfg.health_timeout_s)
        reports, failed = [], [w for r, w in refs.items() if r not in ready]
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
                wid = rep.pop("worker_id")
                events = rep.pop("events")
                busy_for = rep.pop("busy_for_s", 0.0)
                if wid not in self.state:       # removed meanwhile
                    continue
                if isinstance(self.index, PrefixIndex):
                    self.index.apply(wid, events)
                if busy_for > self.cfg.hang_timeout_s:   # alive, but its engine is stuck
                    self.unhealthy.add(wid)
                    self.state[wid].draining = True
                    continue
                self.unhealthy.discard(wid)
                st = self.state[wid]
                for k, v in rep.items():
                    setattr(st, k, v)
                st.draining = wid in self.draining or wid in self.unhealthy

    def _report_loop(self) -> None:
        while not self._stop.wait(self.cfg.report_interval_s):
            self.refresh()

    def _matches(self, hashes: list[int]) -> dict[str, int]:
        with self._lock:
            return self.index.match(hashes)

    def _decide(self, role: str, req: RoutingRequest) -> Any:
        with self._lock:
            workers = self.decode if role == "decode" else self.prefill
            states = []
            for w in workers:
                st = self.state[self._id[w]]
                st.draining = st.worker_id in self.draining or st.worker_id in self.unhealthy
                states.append(st)
        matches = self._matches(list(req.block_hashes))
        with self._lock:
            if role == "decode":
                d = self.policy.choose_decode(req, states, matches)
                st = self.state[d.worker_id]       # count it until the next report
                st.running_tokens += req.num_tokens
                st.free_blocks -= max(0, req.num_blocks - d.matched_blocks)
            else:
                d = self.policy.choose_prefill(req, states, matches)
                st = self.state[d.worker_id]       # count it until the next report
                st.queued_tokens += req.num_tokens - d.matched_blocks * req.block_size
                if isinstance(self.index, ApproxPrefixIndex):
                    self.index.record(d.worker_id, list(req.block_hashes))
            key = f"{self.policy.name}:{d.reason}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.metrics.record_decision(self.policy.name, d.reason, role)
            return self._by_id[d.worker_id]

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
                    on_delta: Callable[[dict], None] | None = None) -> dict:
        """Run one request through P and D; returns {text, token_ids, lifecycle}.
        `on_delta({"token_ids": [...], "text": "..."})` is called as tokens stream in.
        Raises RequestError (bad request, aborted), RoutingRejected (no capacity / SLO)."""
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
            result = self._run_with_retries(flight, prompt, sampling, chat, tenant, lora_id,
                                            on_delta)
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

    def _run_with_retries(self, flight, prompt, sampling, chat, tenant, lora_id, on_delta):
        """A worker that dies (or is restarting) fails only the attempt: what the other side
        holds is released and the request runs again elsewhere (prefill and decode again).
        Tokens the client already got are not sent twice (the re-run yields the same ones
        for greedy or seeded sampling). After max_retries the request ends with an error."""
        spec = {"sampling": asdict(sampling), "chat": chat, "tenant": tenant,
                "lora_id": lora_id}
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            spec["prompt_token_ids"] = prompt
        else:
            spec["prompt"] = prompt
        sent = _Delivered(on_delta)
        for attempt in range(self.cfg.max_retries + 1):
            # each attempt has its own worker-side id: a surviving worker may still be
            # releasing the previous attempt's state
            flight.attempt_id = flight.request_id if attempt == 0 else \
                f"{flight.request_id}~{attempt}"
            try:
                result = self._run(flight, dict(spec, request_id=flight.attempt_id),
                                   sampling, tenant, sent.new_attempt())
                result["lifecycle"]["retries"] = attempt
                return result
            except ray.exceptions.RayActorError as e:
                self._release(flight)
                if flight.aborted:
                    raise RequestError(f"request {flight.request_id} was aborted") from None
                with self._lock:
                    self.retries += 1
                self.traces.retried(flight.request_id)  # trace hook
                if attempt == self.cfg.max_retries:
                    raise WorkerFailed(f"request {flight.request_id} failed: its workers died "
                                       f"{attempt + 1} times (last: {type(e).__name__})") from e
                flight.decode = flight.prefill = flight.transfer_id = None
                self.refresh()     # see who is gone before routing again
        raise AssertionError("unreachable")

    def _run(self, flight, spec, sampling, tenant, on_delta) -> dict:
        rid = spec["request_id"]
        probe = self.live("decode") or self.decode
        probe = probe[next(self._rr) % len(probe)]
        prepared = _unwrap(lambda: ray.get(probe.prepare.remote(spec)))
        spec["prompt_token_ids"] = prepared["prompt_token_ids"]
        spec["chat"] = False                 # tokenized now (chat template applied)
        req = RoutingRequest(rid, prepared["block_hashes"], len(prepared["prompt_token_ids"]),
                             prepared["block_size"], tenant=tenant,
                             output_tokens=sampling.max_tokens)
        admitted = self._admit(flight, spec, req)
        if not admitted["local"]:
            req = RoutingRequest(rid, req.block_hashes, req.num_tokens, req.block_size,
                                 tenant=tenant, output_tokens=sampling.max_tokens,
                                 decode_cached_blocks=admitted["skip_blocks"])
            self._prefill_and_transfer(flight, spec, admitted, req)
        result: dict = {}
        for ref in flight.decode.stream.remote(rid, self.cfg.request_timeout_s):
            item = ray.get(ref)
            if item.get("done"):
                result = item
            else:
                self.traces.tokens(flight.request_id, len(item["token_ids"]))  # trace hook
                on_delta(item)
        if flight.aborted or len(result) <= 1:
            raise RequestError(f"request {flight.request_id} was aborted")
        return result

    def _admit(self, flight: _Flight, spec: dict, req: RoutingRequest) -> dict:
        local_max = self.cfg.local_prefill_max_tokens if self.live("prefill") else 1 << 62
        deadline = time.monotonic() + self.cfg.admit_timeout_s
        while True:
            live = self.live("decode")
            try:
                first = self._decide("decode", req)
                self.traces.routed(flight.request_id, self._id.get(first, "?"))  # trace hook
                order = [first] + [d for d in live if d is not first]
            except RoutingRejected:
                order = live                 # the view may be stale: ask them all
            for d in order:
                try:
                    res = _unwrap(lambda d=d: ray.get(d.admit.remote(spec, local_max)))
                except ray.exceptions.RayActorError:
                    continue                 # died or restarting: the reporter will notice
                if res["admitted"]:
                    flight.decode = d
                    self.traces.admitted(flight.request_id, self._id.get(d, "?"), res["local"])  # trace hook
                    if flight.aborted:       # aborted while being admitted
                        d.abort.remote(spec["request_id"])
                        raise RequestError(f"request {flight.request_id} was aborted")
                    return res
            if flight.aborted:
                raise RequestError(f"request {flight.request_id} was aborted")
            if time.monotonic() > deadline:
                raise RoutingRejected("no_decode_capacity", "no decode worker has room for "
                                      f"this request (waited {self.cfg.admit_timeout_s:.0f} s)",
                                      retry_after_s=5)
            time.sleep(0.02)

    def _prefill_and_transfer(self, flight: _Flight, spec: dict, admitted: dict,
                              req: RoutingRequest) -> None:
        rid = spec["request_id"]
        try:
            flight.prefill = p = self._decide("prefill", req)
        except RoutingRejected as e:
            if e.reason == "no_workers" and ray.get(flight.decode.fallback_local.remote(rid)):
                return                       # no live prefill worker: D prefills it itself
            flight.decode.abort.remote(rid)
            raise
        try:
            pre = ray.get(p.prefill.remote({**spec, "skip_blocks": admitted["skip_blocks"]}))
        except BaseException:
            flight.decode.abort.remote(rid)
            raise
        self.traces.prefilled(flight.request_id, self._id.get(p, "?"), pre.get("timing"))  # trace hook
        handle = pre["handle"]
        flight.transfer_id = handle.transfer_id if handle else None
        if flight.aborted:
            self._release(flight)
            raise RequestError(f"request {rid} was aborted")
        try:
            if handle is not None and self.cfg.transport == "rdt":
                with self._rdt_exclusive(p, flight.decode):
                    send = p.kv_send.options(tensor_transport=self.cfg.rdt_backend)
                    pages = send.remote(handle.transfer_id)
                    got = ray.get(flight.decode.kv_recv.remote(handle, pages, rid, pre["first_token"],
                                                               pre, sent_at=time.time()))
            else:
                got = ray.get(flight.decode.receive.remote(rid, handle, pre["first_token"], pre))
            self.traces.transferred(flight.request_id, self._id.get(flight.decode, "?"), got)  # trace hook
        except Exception as e:
            released = [p.abort_transfer.remote(handle.transfer_id)] if handle is not None else []
            if flight.aborted:
                raise RequestError(f"request {rid} was aborted") from None
            if self.cfg.failure_policy == "recompute" and \
                    ray.get(flight.decode.fallback_local.remote(rid)):
                return
            # the error reaches the client only once both sides have let the blocks go
            _settle([*released, flight.decode.abort.remote(rid)], CLEANUP_WAIT_S)
            raise TransferFailed(f"KV transfer for request {rid} failed: {e}") from e
        if handle is not None:
            ray.get(p.ack.remote(handle.transfer_id))

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

    def _release(self, flight: _Flight) -> None:
        """Release the attempt's state on both sides (calls to a dead worker just fail)."""
        rid = flight.attempt_id or flight.request_id
        if flight.prefill is not None:
            flight.prefill.abort.remote(rid)
            if flight.transfer_id:
                flight.prefill.abort_transfer.remote(flight.transfer_id)
        if flight.decode is not None:
            flight.decode.abort.remote(rid)

    def abort(self, request_id: str) -> bool:
        """Client abort at any stage: every block on both sides is released."""
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        self._release(flight)
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
