"""DecodeHost, the decode worker actor: admits a request decode-first (tokenizes, validates and
hashes it once, reserves blocks for the whole prompt taking its own prefix hit, plans the
transfer), pulls P's staged pages into a private buffer, verifies each page's checksum once
(outside the engine lock), lands them only if its reservation still owns the blocks and every
page was whole, then decodes with continuous batching. Short
uncached prompts (or no prefill workers) it prefills itself.

Tokens leave through one stream per worker (`deltas`, a Ray streaming generator the router
reads once): each message carries the new tokens and text of every request that got some since
the last one (one engine step's, or a few), so a token costs no Ray call of its own.
Detokenization runs in that stream's thread, not in the engine loop.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict

import ray

from kvtransfer.endpoint import KVConsumer
from protocol.ledger import ABORTED
from protocol.messages import (
    Admission,
    AdmittedRequest,
    PrefillResult,
    RequestDelta,
    RequestDone,
    RequestInput,
    StepDeltas,
)
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import StepOutput
from workers.host import EngineHost
from workers.kv_handoff import DecodeHandoff, PulledPages, Reservation, verify_pages


class DecodeHost(EngineHost):
    role = "decode"

    def __init__(self, *args, **kw) -> None:
        self._finished: dict[str, RequestDone] = {}  # request_id -> result, until streamed
        # the delta stream: (worker request id, new token ids, ended, error) in order, and each
        # open request's detokenizer (made at admission, with its stop strings)
        self._outbox: deque[tuple[str, tuple[int, ...], bool, str | None]] = deque()
        self._outbox_cv = threading.Condition()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        super().__init__(*args, **kw)
        self.consumer = KVConsumer(self.transport_name, **self._transport_cfg)
        self.handoff = DecodeHandoff(self.engine, self.worker_id, self.ledger)
        self._start_loop()

    def _num_reserved(self) -> int:
        return len(self.handoff.reservations)

    def _transfer_counts(self) -> tuple[int, int]:
        return self.consumer.stats().transfers, sum(self.handoff.rejected.values())

    def _housekeeping(self) -> None:
        for rid in self.handoff.expire():     # the router gave up on them (or died)
            self._post(rid, (), True)

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
                self._open_stream(req)
                req.lifecycle.decode_worker = self.worker_id
                self.engine.add_request(request=req, prompt=None)
                self._work.set()
                return Admission(admitted, self.worker_id, True, local=True,
                                 decode_cached_blocks=len(hits))
            plan = self.handoff.reserve(req, admitted, hits)
            if plan is None:
                return Admission(admitted, self.worker_id, False,
                                 free_blocks=self.engine.num_free_blocks)
            self._open_stream(req)
            return Admission(admitted, self.worker_id, True, decode_cached_blocks=plan.first_block,
                             plan=plan, free_blocks=self.engine.num_free_blocks,
                             reserved_blocks=len(self.engine.block_table(req.request_id)))

    def _fill(self, result: PrefillResult, pages=None, sent_at: float | None = None) -> None:
        """Pull the staged pages into a private buffer, verify them (one checksum pass, outside
        the engine lock: other requests keep stepping meanwhile), and land them in the reserved
        blocks if the reservation still owns them (else TransferRejected: nothing written).
        `pages`: delivered by RDT as an argument instead of pulled."""
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
            pulled = verify_pages(result, pages)
        except Exception:
            self._transfer_failures += 1
            with self._lock:
                self.handoff.pull_failed(res)
            raise
        with self._call_lock():
            try:
                out = self._land(res, result, pulled)
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

    def _land(self, res: Reservation, result: PrefillResult,
              pulled: PulledPages | None) -> StepOutput:
        """Under the lock: land pages verified outside it (a hook: workers/faults.py audits
        which transfers reached verification here)."""
        return self.handoff.land(res, result, pulled)

    def fallback_local(self, request_id: str) -> bool:
        """No transfer will come (no prefill worker left): prefill the reserved request here."""
        with self._lock:
            done = self.handoff.fallback(request_id)
        self._work.set()
        return done

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if self.handoff.cancel(request_id, ABORTED):
                done = True
            else:
                done = self.engine.abort(request_id)
        self._post(request_id, (), True)          # its stream ends (lifecycle None: aborted)
        return done

    def land(self, request_id: str, epoch: int, prefill: PrefillResult, pages=None,
             sent_at: float | None = None) -> None:
        """Land `prefill`'s pages into the request's reservation (raises TransferRejected /
        TransferError, and the reservation then waits for another transfer). Its first token
        and the rest go out on the delta stream."""
        assert prefill.epoch == epoch and prefill.request_id == request_id
        self._fill(prefill, pages, sent_at)

    # ---- the delta stream --------------------------------------------------------------------
    def _open_stream(self, req) -> None:
        """Under the lock, at admission: the request's tokens will go out on the stream."""
        self._detok[req.request_id] = IncrementalDetokenizer(self.engine.tokenizer,
                                                             req.sampling.stop)

    def _post(self, rid: str, token_ids: tuple[int, ...], ended: bool,
              error: str | None = None) -> None:
        with self._outbox_cv:
            self._outbox.append((rid, token_ids, ended, error))
            self._outbox_cv.notify()

    def _deliver(self, out: StepOutput) -> None:
        r = out.request
        if out.finished:
            self.metrics.observe_finished(r.lifecycle)
            self._finished[r.request_id] = RequestDone(r.output_text, tuple(r.output_token_ids),
                                                       r.lifecycle)
        if out.new_token_ids or out.finished:
            self._post(r.request_id, tuple(out.new_token_ids), out.finished)

    def _fail_requests(self, msg: str) -> None:
        for rid in list(self._detok):
            if rid not in self.engine.requests:
                self._post(rid, (), True, msg)

    def take_deltas(self, timeout: float) -> StepDeltas:
        """Every request's deltas posted since the last call (waiting up to `timeout` for
        one), detokenized; empty when none came."""
        with self._outbox_cv:
            if not self._outbox:
                self._outbox_cv.wait(timeout)
            items, self._outbox = list(self._outbox), deque()
        merged: dict[str, list] = {}
        for rid, tokens, ended, error in items:     # a request's items, in order, merged
            m = merged.setdefault(rid, [[], False, None])
            m[0].extend(tokens)
            m[1] = m[1] or ended
            m[2] = m[2] or error
        out = []
        for rid, (tokens, ended, error) in merged.items():
            detok = self._detok.get(rid)
            if detok is None:                      # ended already (an abort after its end)
                continue
            text = detok.add(tokens) if tokens else ""
            done = None
            if ended:
                self._detok.pop(rid, None)
                done = self._finished.pop(rid, RequestDone())
                if done.lifecycle is not None:
                    text += detok.finish(done.text)
            out.append(RequestDelta(rid, tuple(tokens), text, done, error))
        return StepDeltas(self.worker_id, tuple(out))

    def deltas(self, wait_s: float = 1.0):
        """The worker's delta stream (a Ray streaming generator, read by the router): a
        StepDeltas whenever requests got tokens, an empty one at least every `wait_s` (so the
        reader learns the worker is alive)."""
        while not self._stop:
            yield self.take_deltas(wait_s)


def decode_actor_class(host: type = DecodeHost, **options):
    """The Ray actor class of a decode worker (`host`: DecodeHost, or a subclass of it)."""
    return ray.remote(enable_tensor_transport=True, **options)(host)
