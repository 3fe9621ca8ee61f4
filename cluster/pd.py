"""PDCluster: N prefill + M decode Ray actors, and the P -> D flow for each request.

`generate()` runs a list of requests concurrently (one driver thread each); each request goes
decode-first: admit on D (reserve blocks), prefill on P (first token + staged pages), transfer
(pull by D, or routed by this process for RDT), ack to P, then D streams tokens back.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from kvtransfer.base import TRANSPORT_NAMES, TransferError
from workers.engine import RequestError
from workers.request import SamplingParams

FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class PDConfig:
    engine: dict = field(default_factory=dict)   # EngineConfig fields for every worker
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "object_store"
    transport_cfg: dict = field(default_factory=dict)
    lease_s: float = 30.0
    local_prefill_max_tokens: int = 0     # decode prefills itself when it lacks <= this many
    failure_policy: str = "recompute"     # on a failed transfer: recompute on D, or fail
    threads_per_actor: int = 1            # torch threads in each worker
    prefill_resources: dict = field(default_factory=dict)   # e.g. {"prefill": 1}
    decode_resources: dict = field(default_factory=dict)    # e.g. {"decode": 1}
    num_gpus_per_worker: float = 0.0
    admit_timeout_s: float = 120.0
    request_timeout_s: float = 600.0

    def validate(self) -> None:
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"unknown KV transport {self.transport!r}; valid names: "
                             f"{', '.join(TRANSPORT_NAMES)}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.failure_policy!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode worker")


@dataclass
class _Flight:
    """Where one request is, so an abort can release it everywhere."""

    request_id: str
    decode: Any = None
    prefill: Any = None
    transfer_id: str | None = None
    aborted: bool = False


class PDCluster:
    def __init__(self, cfg: PDConfig) -> None:
        from workers.actors import decode_actor_class, prefill_actor_class
        cfg.validate()
        self.cfg = cfg
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        engine = {**cfg.engine, "num_threads": cfg.threads_per_actor}
        common = dict(num_cpus=0, max_concurrency=256, num_gpus=cfg.num_gpus_per_worker)
        args = dict(engine_cfg=engine, transport=cfg.transport,
                    transport_cfg=cfg.transport_cfg, lease_s=cfg.lease_s)
        P = prefill_actor_class(**common, resources=cfg.prefill_resources or None)
        D = decode_actor_class(**common, resources=cfg.decode_resources or None)
        self.prefill = [P.remote(f"prefill-{i}", **args) for i in range(cfg.num_prefill)]
        self.decode = [D.remote(f"decode-{i}", **args) for i in range(cfg.num_decode)]
        self.workers = self.prefill + self.decode
        self.info = ray.get([w.info.remote() for w in self.workers])
        if cfg.transport == "rdt":
            from kvtransfer import rdt
            self._rdt_backend = "nccl" if cfg.num_gpus_per_worker else "gloo"
            rdt.ensure_group(self.workers, backend=self._rdt_backend)
        self._rr_p = itertools.cycle(range(len(self.prefill)))
        self._rr_d = itertools.cycle(range(len(self.decode)))
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()

    # ---- one request -------------------------------------------------------------------------
    def run_request(self, prompt: Any, sampling: SamplingParams | None = None, *,
                    chat: bool = False, tenant: str = "", lora_id: str = "",
                    request_id: str | None = None,
                    on_tokens: Callable[[list[int]], None] | None = None) -> dict:
        """Run one request through P and D; returns {text, token_ids, lifecycle}."""
        sampling = sampling or SamplingParams()
        rid = request_id or uuid.uuid4().hex[:12]
        flight = _Flight(rid)
        with self._lock:
            self._flights[rid] = flight
        try:
            return self._run(flight, prompt, sampling, chat, tenant, lora_id, on_tokens)
        finally:
            with self._lock:
                self._flights.pop(rid, None)

    def _run(self, flight, prompt, sampling, chat, tenant, lora_id, on_tokens) -> dict:
        rid = flight.request_id
        spec = {"request_id": rid, "sampling": asdict(sampling), "chat": chat,
                "tenant": tenant, "lora_id": lora_id}
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            spec["prompt_token_ids"] = prompt
        else:
            spec["prompt"] = prompt
        admitted = self._admit(flight, spec)
        if not admitted["local"]:
            self._prefill_and_transfer(flight, spec, admitted)
        result: dict = {}
        for ref in flight.decode.stream.remote(rid, self.cfg.request_timeout_s):
            item = ray.get(ref)
            if isinstance(item, dict):
                result = item
            elif on_tokens is not None:
                on_tokens(item)
        if flight.aborted or not result:
            raise RequestError(f"request {rid} was aborted")
        return result

    def _admit(self, flight: _Flight, spec: dict) -> dict:
        deadline = time.monotonic() + self.cfg.admit_timeout_s
        while True:
            for _ in range(len(self.decode)):
                d = self.decode[next(self._rr_d)]
                res = ray.get(d.admit.remote(spec, self.cfg.local_prefill_max_tokens))
                if res["admitted"]:
                    flight.decode = d
                    return res
            if flight.aborted:
                raise RequestError(f"request {flight.request_id} was aborted")
            if time.monotonic() > deadline:
                raise RequestError("no decode worker has room for this request "
                                   f"(waited {self.cfg.admit_timeout_s:.0f} s)")
            time.sleep(0.02)

    def _prefill_and_transfer(self, flight: _Flight, spec: dict, admitted: dict) -> None:
        rid = flight.request_id
        flight.prefill = p = self.prefill[next(self._rr_p)]
        pspec = {**spec, "prompt_token_ids": admitted["prompt_token_ids"],
                 "skip_blocks": admitted["skip_blocks"]}
        try:
            pre = ray.get(p.prefill.remote(pspec))
        except Exception:
            flight.decode.abort.remote(rid)
            raise
        handle = pre["handle"]
        flight.transfer_id = handle.transfer_id if handle else None
        if flight.aborted:
            self._release(flight)
            raise RequestError(f"request {rid} was aborted")
        try:
            if handle is not None and self.cfg.transport == "rdt":
                from kvtransfer import rdt
                ref = rdt.route(p, flight.decode, handle, rid, pre["first_token"], pre,
                                backend=self._rdt_backend)
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
            raise TransferError(f"KV transfer for request {rid} failed: {e}") from e
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

    # ---- many requests -----------------------------------------------------------------------
    def generate(self, prompts: list, sampling: SamplingParams | None = None,
                 **kw) -> list[dict]:
        """Run requests concurrently; results in input order (an error becomes {"error": ...})."""
        def one(p):
            try:
                return self.run_request(p, sampling, **kw)
            except (RequestError, TransferError, ray.exceptions.RayError) as e:
                return {"error": str(e)}
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(one, prompts))

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> list[dict]:
        return ray.get([w.stats.remote() for w in self.workers])

    def check_invariants(self) -> list[dict]:
        """Ledger counts of every worker (each asserts free + cached + referenced == total)."""
        return ray.get([w.check_invariants.remote() for w in self.workers])

    def expire_leases(self) -> list[list[str]]:
        return ray.get([p.expire_leases.remote() for p in self.prefill])

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers, self.prefill, self.decode = [], [], []
