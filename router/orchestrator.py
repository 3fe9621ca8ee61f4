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

FAILURE_POLICIES = ("recompute", "fail")


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

    def validate(self) -> None:
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.failure_policy!r}")
        if self.index_mode not in ("precise", "approx"):
            raise ValueError(f"index_mode must be precise or approx, got {self.index_mode!r}")
        make_policy(self.policy, **(self.policy_cfg or {}))   # unknown name -> ValueError


@dataclass
class _Flight:
    """Where one request is, so an abort can release it everywhere."""

    request_id: str
    decode: Any = None
    prefill: Any = None
    transfer_id: str | None = None
    aborted: bool = False


class Orchestrator:
    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any], cfg: FlowConfig,
                 worker_ids: dict[Any, str] | None = None) -> None:
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
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()
        self._stop = threading.Event()
        self.refresh()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True,
                                          name="raypd-router-reports")
        self._reporter.start()

    # ---- worker view -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pull every worker's KV events and load once."""
        workers = list(self._id)
        try:
            reports = ray.get([w.load_report.remote() for w in workers], timeout=30)
        except Exception:   # a dead worker: keep the last view (fault handling is upstream)
            return
        with self._lock:
            for rep in reports:
                wid = rep.pop("worker_id")
                events = rep.pop("events")
                if isinstance(self.index, PrefixIndex):
                    self.index.apply(wid, events)
                st = self.state[wid]
                for k, v in rep.items():
                    setattr(st, k, v)

    def _report_loop(self) -> None:
        while not self._stop.wait(self.cfg.report_interval_s):
            self.refresh()

    def _matches(self, hashes: list[int]) -> dict[str, int]:
        with self._lock:
            return self.index.match(hashes)

    def _decide(self, role: str, req: RoutingRequest, workers: list[Any]) -> Any:
        states = [self.state[self._id[w]] for w in workers]
        matches = self._matches(list(req.block_hashes))
        with self._lock:
            if role == "decode":
                d = self.policy.choose_decode(req, states, matches)
            else:
                d = self.policy.choose_prefill(req, states, matches)
                st = self.state[d.worker_id]       # count it until the next report
                st.queued_tokens += req.num_tokens - d.matched_blocks * req.block_size
                if isinstance(self.index, ApproxPrefixIndex):
                    self.index.record(d.worker_id, list(req.block_hashes))
            key = f"{self.policy.name}:{d.reason}"
            self.decisions[key] = self.decisions.get(key, 0) + 1
        return self._by_id[d.worker_id]

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
        try:
            return self._run(flight, prompt, sampling, chat, tenant, lora_id, on_delta)
        finally:
            with self._lock:
                self._flights.pop(rid, None)

    def _run(self, flight, prompt, sampling, chat, tenant, lora_id, on_delta) -> dict:
        rid = flight.request_id
        spec = {"request_id": rid, "sampling": asdict(sampling), "chat": chat,
                "tenant": tenant, "lora_id": lora_id}
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            spec["prompt_token_ids"] = prompt
        else:
            spec["prompt"] = prompt
        probe = self.decode[next(self._rr) % len(self.decode)]
        prepared = _unwrap(lambda: ray.get(probe.prepare.remote(spec)))
        spec["prompt_token_ids"] = prepared["prompt_token_ids"]
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
            elif on_delta is not None:
                on_delta(item)
        if flight.aborted or len(result) <= 1:
            raise RequestError(f"request {rid} was aborted")
        return result

    def _admit(self, flight: _Flight, spec: dict, req: RoutingRequest) -> dict:
        local_max = self.cfg.local_prefill_max_tokens if self.prefill else 1 << 62
        deadline = time.monotonic() + self.cfg.admit_timeout_s
        while True:
            try:
                first = self._decide("decode", req, self.decode)
                order = [first] + [d for d in self.decode if d is not first]
            except RoutingRejected:
                order = list(self.decode)   # the view may be stale: ask them all
            for d in order:
                res = _unwrap(lambda d=d: ray.get(d.admit.remote(spec, local_max)))
                if res["admitted"]:
                    flight.decode = d
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
        rid = flight.request_id
        try:
            flight.prefill = p = self._decide("prefill", req, self.prefill)
            pre = ray.get(p.prefill.remote({**spec, "skip_blocks": admitted["skip_blocks"]}))
        except BaseException:
            flight.decode.abort.remote(rid)
            raise
        handle = pre["handle"]
        flight.transfer_id = handle.transfer_id if handle else None
        if flight.aborted:
            self._release(flight)
            raise RequestError(f"request {rid} was aborted")
        try:
            if handle is not None and self.cfg.transport == "rdt":
                send = p.kv_send.options(tensor_transport=self.cfg.rdt_backend)
                pages = send.remote(handle.transfer_id)
                ref = flight.decode.kv_recv.remote(handle, pages, rid, pre["first_token"], pre,
                                                   sent_at=time.time())
            else:
                ref = flight.decode.receive.remote(rid, handle, pre["first_token"], pre)
            ray.get(ref)
        except Exception as e:
            if handle is not None:
                p.abort_transfer.remote(handle.transfer_id)
            if flight.aborted:
                raise RequestError(f"request {rid} was aborted") from None
            if self.cfg.failure_policy == "recompute" and \
                    ray.get(flight.decode.fallback_local.remote(rid)):
                return
            flight.decode.abort.remote(rid)
            raise TransferFailed(f"KV transfer for request {rid} failed: {e}") from e
        if handle is not None:
            ray.get(p.ack.remote(handle.transfer_id))

    def _release(self, flight: _Flight) -> None:
        if flight.prefill is not None:
            flight.prefill.abort.remote(flight.request_id)
            if flight.transfer_id:
                flight.prefill.abort_transfer.remote(flight.transfer_id)
        if flight.decode is not None:
            flight.decode.abort.remote(flight.request_id)

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
            except (RequestError, RoutingRejected, TransferFailed, ray.exceptions.RayError) as e:
                return {"error": str(e)}
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(one, prompts))

    def close(self) -> None:
        self._stop.set()


class TransferFailed(RuntimeError):
    """A KV transfer failed and the failure policy is `fail`."""


def _unwrap(call: Callable[[], Any]) -> Any:
    """Run a ray.get; a RequestError raised inside the worker comes out as itself."""
    try:
        return call()
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RequestError):
            raise RequestError(str(e.cause)) from None
        raise
