"""DecodeHost, the decode worker actor: admits a request decode-first (tokenizes, validates and
hashes it once, reserves blocks for the whole prompt taking its own prefix hit, plans the
transfer), pulls P's staged pages into a private buffer, lands them only if its reservation
still owns the blocks and every checksum matches, then decodes with continuous batching and
streams tokens back. Short uncached prompts (or no prefill workers) it prefills itself.
"""

from __future__ import annotations

from dataclasses import asdict

import ray

from kvtransfer.endpoint import KVConsumer
from protocol.errors import RequestError
from protocol.ledger import ABORTED
from protocol.messages import (
    Admission,
    AdmittedRequest,
    PrefillResult,
    RequestDone,
    RequestInput,
    TokenDelta,
    worker_request_id,
)
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import StepOutput
from workers.host import DONE, EngineHost
from workers.kv_handoff import DecodeHandoff, Reservation


class DecodeHost(EngineHost):
    role = "decode"

    def __init__(self, *args, **kw) -> None:
        self._finished: dict[str, RequestDone] = {}  # request_id -> result, until streamed
        self._stops: dict[str, tuple[str, ...]] = {}  # request_id -> stop strings (streaming)
        super().__init__(*args, **kw)
        self.consumer = KVConsumer(self.transport_name, **self._transport_cfg)
        self.handoff = DecodeHandoff(self.engine, self.worker_id, self.ledger)
        self._start_loop()

    def _num_reserved(self) -> int:
        return len(self.handoff.reservations)

    def _housekeeping(self) -> None:
        self.handoff.expire()

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.consumer.stats()).items()})
        d["transfer_failures"] = self._transfer_failures
        with self._lock:
            d.update({f"rejected_{k}": v for k, v in self.handoff.rejected.items()})
        d.update({f"ledger_{k}": v for k, v in self.ledger.counters().items()})
        return d

    def admit(self, request: RequestInput | AdmittedRequest,
              local_prefill_max_tokens: int = 0) -> Admission:
        """Decode-first admission: reserve blocks for the whole prompt and plan its transfer,
        or say it can't now. A RequestInput is tokenized, validated and hashed here, once;
        the Admission carries the AdmittedRequest on (a retry elsewhere re-admits that).

        If what this worker's prefix cache lacks is at most `local_prefill_max_tokens`, the
        request is prefilled right here instead (conditional disaggregation)."""
        with self._call_lock():
            if isinstance(request, RequestInput):
                req = self.engine.make_request(request.prompt, request.sampling,
                                               request_id=request.worker_request_id,
                                               chat=request.chat, tenant=request.tenant,
                                               lora_id=request.lora_id)
                admitted = AdmittedRequest(request.request_id, request.epoch,
                                           tuple(req.prompt_token_ids), tuple(req.block_hashes),
                                           req.block_size, req.namespace_root, request.sampling,
                                           request.deadline, request.tenant, request.lora_id)
            else:
                admitted = request
                req = self.engine.admitted_request(admitted)
            hits = self.engine.match_prefix(req)     # matched once per admission
            uncached = req.num_tokens - len(hits) * self.engine.cfg.block_size
            if uncached <= local_prefill_max_tokens:
                self._stops[req.request_id] = req.sampling.stop
                self._open_queue(req.request_id)
                req.lifecycle.decode_worker = self.worker_id
                self.engine.add_request(request=req, prompt=None)
                self._work.set()
                return Admission(admitted, self.worker_id, True, local=True,
                                 decode_cached_blocks=len(hits))
            plan = self.handoff.reserve(req, admitted, hits)
            if plan is None:
                return Admission(admitted, self.worker_id, False,
                                 free_blocks=self.engine.num_free_blocks)
            self._stops[req.request_id] = req.sampling.stop
            self._open_queue(req.request_id)
            return Admission(admitted, self.worker_id, True, decode_cached_blocks=plan.first_block,
                             plan=plan, free_blocks=self.engine.num_free_blocks,
                             reserved_blocks=len(self.engine.block_table(req.request_id)))

    def _fill(self, result: PrefillResult, pages=None, sent_at: float | None = None) -> None:
        """Pull the staged pages into a private buffer, verify them, and land them in the
        reserved blocks if the reservation still owns them (else TransferRejected: nothing
        written). `pages`: delivered by RDT as an argument instead of pulled."""
        with self._lock:
            res = self.handoff.begin_pull(result)
        handle = result.handle
        try:
            self._before_pull()
            transfer = None
            if handle is not None and pages is None:
                pages, transfer = self.consumer.pull(handle)
            elif handle is not None:
                transfer = self.consumer.accept(handle, pages, sent_at=sent_at)
        except Exception:
            self._transfer_failures += 1
            with self._lock:
                self.handoff.pull_failed(res)
            raise
        with self._call_lock():
            try:
                out = self._land(res, result, pages)
            except Exception:
                self._transfer_failures += 1
                raise
            if transfer is not None:
                lc = out.request.lifecycle
                lc.transfer_bytes, lc.transfer_s = transfer.nbytes, transfer.seconds
        self._deliver(out)
        self._work.set()

    def _before_pull(self) -> None:
        """Before a pull starts, outside the lock (a hook: workers/faults.py delays or fails
        pulls here)."""

    def _land(self, res: Reservation, result: PrefillResult, pages) -> StepOutput:
        """Under the lock: verify and land pulled pages (a hook: workers/faults.py audits which
        transfers reached verification here)."""
        return self.handoff.land(res, result, pages)

    def fallback_local(self, request_id: str) -> bool:
        """No transfer will come (no prefill worker left): prefill the reserved request here."""
        with self._lock:
            done = self.handoff.fallback(request_id)
        self._work.set()
        return done

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if self.handoff.cancel(request_id, ABORTED):
                q = self._queues.get(request_id)
                if q is not None:
                    q.put(DONE)
                return True
        return super().abort(request_id)

    def stream(self, request_id: str, epoch: int = 0, prefill: PrefillResult | None = None,
               pages=None, sent_at: float | None = None, timeout: float = 600.0):
        """With `prefill`: land its pages first (raises TransferRejected / TransferError before
        the first item; the reservation then waits for another transfer). Then yield
        TokenDelta items as tokens are produced and a final RequestDone (whose lifecycle is
        None when the request was aborted)."""
        rid = worker_request_id(request_id, epoch)
        if prefill is not None:
            self._fill(prefill, pages, sent_at)
        q = self._queues.get(rid)
        if q is None:
            raise RequestError(f"unknown request {rid} on {self.worker_id}")
        detok = IncrementalDetokenizer(self.engine.tokenizer, self._stops.pop(rid, ()))
        try:
            while (item := self._next(q, timeout)) is not DONE:
                yield TokenDelta(tuple(item), detok.add(item))
        finally:
            self._queues.pop(rid, None)
        result = self._finished.pop(rid, RequestDone())
        if result.lifecycle is not None and (rest := detok.finish(result.text)):
            yield TokenDelta((), rest)
        yield result

    def _deliver(self, out: StepOutput) -> None:
        if out.finished:
            r = out.request
            self._finished[r.request_id] = RequestDone(r.output_text, tuple(r.output_token_ids),
                                                       r.lifecycle)
        super()._deliver(out)




def decode_actor_class(host: type = DecodeHost, **options):
    """The Ray actor class of a decode worker (`host`: DecodeHost, or a subclass of it)."""
    return ray.remote(enable_tensor_transport=True, **options)(host)
