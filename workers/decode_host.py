"""DecodeHost, the decode worker actor: admits a request decode-first (tokenizes, validates and
hashes it once, reserves blocks for the whole prompt taking its own prefix hit, plans the
transfer), pulls P's staged pages into a private buffer, verifies each page's checksum once
(outside the engine lock), lands them only if its reservation still owns the blocks and every
page was whole, then decodes with continuous batching. Short
uncached prompts (or no prefill workers) it prefills itself.

Live migration: a running decode moves to another decode worker with its KV (freeze ->
the other's admit_migration -> stage_migration here -> the other's land): this worker is then
the source, staging the plan's pages under a lease as a prefill worker does (its producer is
made on the first move); the destination replays the output so far on its stream.

Tokens leave through one stream per worker (`deltas`, a Ray streaming generator the router
reads once): each message carries the new token ids of every request that got some since the
last one (one engine step's, or a few), so a token costs no Ray call of its own. No text work
happens here: the router tokenizes, detokenizes and checks stop strings (frontend/); a stop
string it sees ends the request here through `stop`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, replace

import ray

from frontend.admit import FrontendSpec
from kvtransfer import rdt
from kvtransfer.endpoint import KVConsumer, KVProducer
from protocol.errors import RequestError
from protocol.ledger import ABORTED, ACKED
from protocol.messages import (
    Admission,
    AdmittedRequest,
    FrozenDecode,
    MigratedRequest,
    PrefillResult,
    RequestDelta,
    RequestDone,
    RequestInput,
    StepDeltas,
    TransferPlan,
)
from workers.engine import StepOutput
from workers.host import EngineHost, actor_options
from workers.kv_handoff import (
    DecodeHandoff,
    PulledPages,
    Reservation,
    stage_plan,
    verify_pages,
)

FROZEN_LIMIT_S = 60.0     # a request frozen this long (its move never came) is ended


class DecodeHost(EngineHost):
    role = "decode"

    def __init__(self, *args, **kw) -> None:
        self._finished: dict[str, RequestDone] = {}  # request_id -> result, until streamed
        # the delta stream: (worker request id, new token ids, ended, error) in order, and the
        # requests whose stream is open (from admission to their end)
        self._outbox: deque[tuple[str, tuple[int, ...], bool, str | None]] = deque()
        self._outbox_cv = threading.Condition()
        self._open: set[str] = set()
        self._replay: set[str] = set()     # moved-in requests: their first post is the output
        self._frozen_at: dict[str, float] = {}   # frozen request -> monotonic freeze time
        super().__init__(*args, **kw)
        self._lease_s = kw.get("lease_s", 30.0)
        # a move is staged within seconds of its freeze; this long frozen, it never will be
        self._frozen_limit_s = max(FROZEN_LIMIT_S, 2 * self._lease_s)
        self._producer: KVProducer | None = None   # made on the first move away (migration)
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
        if self._producer is not None:
            self._producer.expire()
        # a frozen request whose move never came (the router died mid-move) ends here
        now = time.monotonic()
        for rid in [r for r, t in self._frozen_at.items() if now - t > self._frozen_limit_s]:
            self._frozen_at.pop(rid, None)
            if self.engine.abort(rid):
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
                req = self.engine.inputs.make_request(request.prompt, request.sampling,
                                               request_id=request.worker_request_id,
                                               chat=request.chat, tenant=request.tenant,
                                               lora_id=request.lora_id)
                admitted = AdmittedRequest(request.request_id, request.epoch,
                                           tuple(req.prompt_token_ids), tuple(req.block_hashes),
                                           req.block_size, req.namespace_root, request.sampling,
                                           request.deadline, request.tenant, request.lora_id)
            else:
                admitted = request
                req = self.engine.handoff.admitted_request(admitted)
            hits = self.engine.handoff.match_prefix(req)     # matched once per admission
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
                                 free_blocks=self.engine.view.num_free_blocks)
            self._open_stream(req)
            return Admission(admitted, self.worker_id, True, decode_cached_blocks=plan.first_block,
                             plan=plan, free_blocks=self.engine.view.num_free_blocks,
                             reserved_blocks=len(self.engine.handoff.block_table(req.request_id)))

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
        """No transfer will come (no prefill worker left, or the prefill pool's backlog is
        longer than this worker takes: router/local_prefill.py): prefill the reserved request
        here."""
        with self._lock:
            done = self.handoff.fallback(request_id)
        self._work.set()
        return done

    def abort(self, request_id: str) -> bool:
        self._replay.discard(request_id)
        with self._lock:
            if self.handoff.cancel(request_id, ABORTED):
                done = True
            else:
                done = self.engine.abort(request_id)
        self._post(request_id, (), True)          # its stream ends (lifecycle None: aborted)
        return done

    def stop(self, request_id: str) -> bool:
        """The router saw a stop string in the request's text: end it as a stop (its blocks
        freed, its RequestDone with its lifecycle on the stream), within a step of the hit.
        False when it is not running here (ended, frozen for a move, unknown)."""
        with self._lock:
            req = self.engine.requests.get(request_id)
            if req is None or request_id in self.engine.frozen:
                return False
            self.engine.finish_request(req, "stop", time.perf_counter())
        self._deliver(StepOutput(req, [], True))
        return True

    def frontend_spec(self) -> FrontendSpec:
        """What the router needs to tokenize, hash and detokenize for this worker's model."""
        e = self.engine
        inputs = e.inputs
        return FrontendSpec(e.tokenizer, inputs.namespace, inputs.block_size, inputs.vocab_size,
                            inputs.max_model_len, inputs.num_blocks,
                            {name: spec.content_hash for name, spec in inputs.loras.items()})

    def land(self, request_id: str, epoch: int, prefill: PrefillResult, pages=None,
             sent_at: float | None = None) -> None:
        """Land `prefill`'s pages into the request's reservation (raises TransferRejected /
        TransferError, and the reservation then waits for another transfer). Its first token
        and the rest go out on the delta stream."""
        assert prefill.epoch == epoch and prefill.request_id == request_id
        self._fill(prefill, pages, sent_at)

    # ---- live migration ----------------------------------------------------------------------
    def freeze(self, request_id: str) -> FrozenDecode | None:
        """Source side: stop decoding a running request between two steps so that it can move
        (its blocks stay held; its stream stays open until it is staged). None when it is not a
        running decode here (queued, prefilling, finished, unknown): nothing changed."""
        with self._call_lock():
            req = self.engine.handoff.freeze(request_id)
            if req is None:
                return None
            self._frozen_at[request_id] = time.monotonic()
            now = time.perf_counter()
            return FrozenDecode(request_id, tuple(req.output_token_ids),
                                replace(req.lifecycle), now - req.arrival_time,
                                now - (req.first_token_time or now), time.time())

    def unfreeze(self, request_id: str) -> bool:
        """Source side: the move did not happen; the request decodes here again."""
        with self._call_lock():
            self._frozen_at.pop(request_id, None)
            done = self.engine.handoff.unfreeze(request_id)
        self._work.set()
        return done

    def stage_migration(self, request_id: str, plan: TransferPlan) -> PrefillResult:
        """Source side: stage exactly the destination's plan of the frozen request's blocks under
        a lease (checksums per page, the sampler state, the last sampled token as the "first
        token") and let the blocks go here (they stay in this worker's prefix cache). Its
        stream here ends without an end: the destination's stream goes on."""
        with self._call_lock():
            if request_id not in self.engine.frozen:
                raise RequestError(f"request {request_id} is not frozen on {self.worker_id}")
            req = self.engine.requests[request_id]
            self._frozen_at.pop(request_id, None)
            self._open.discard(request_id)
            return stage_plan(self.engine, self._source(), self.ledger, self.worker_id, req,
                              plan, req.output_token_ids[-1])

    def admit_migration(self, moved: MigratedRequest) -> Admission:
        """Destination side: reserve blocks for the moved decode's computed tokens (taking this
        worker's own prefix hit) and plan the transfer of the rest from the source; or say no
        room now. Its stream opens here: the first post replays the output so far."""
        with self._call_lock():
            req = self.engine.handoff.resumed_request(moved)
            plan = self.handoff.reserve_migration(req, moved)
            if plan is None:
                return Admission(moved.admitted, self.worker_id, False,
                                 free_blocks=self.engine.view.num_free_blocks)
            self._open_stream(req)
            self._replay.add(req.request_id)
            return Admission(moved.admitted, self.worker_id, True,
                             decode_cached_blocks=plan.first_block, plan=plan,
                             free_blocks=self.engine.view.num_free_blocks,
                             reserved_blocks=len(self.engine.handoff.block_table(req.request_id)))

    def _source(self) -> KVProducer:
        """Under the lock: this worker's producer for moves away (made once)."""
        if self._producer is None:
            self._producer = KVProducer(self.transport_name, self._lease_s,
                                        **{"checksum": False, **self._transport_cfg})
        return self._producer

    def kv_send(self, transfer_id: str):
        """RDT producer method of a move away (called with .options(tensor_transport=...))."""
        return rdt.send_pages(self._source(), transfer_id)

    def ack(self, transfer_id: str) -> str:
        """The destination has a moved request's pages: drop the staged copy (see
        PrefillHost.ack)."""
        if self._producer is not None and self._producer.ack(transfer_id):
            return ACKED
        return "ended"

    def abort_transfer(self, transfer_id: str) -> bool:
        return self._producer is not None and self._producer.abort(transfer_id)

    # ---- the delta stream --------------------------------------------------------------------
    def _open_stream(self, req) -> None:
        """Under the lock, at admission: the request's tokens will go out on the stream."""
        self._open.add(req.request_id)
        with self._outbox_cv:     # wakes the stream: new work, whose reports are owed
            self._outbox_cv.notify()

    def _post(self, rid: str, token_ids: tuple[int, ...], ended: bool,
              error: str | None = None) -> None:
        with self._outbox_cv:
            self._outbox.append((rid, token_ids, ended, error))
            self._outbox_cv.notify()

    def _deliver(self, out: StepOutput) -> None:
        r = out.request
        if out.finished:
            self.metrics.observe_finished(r.lifecycle)
            self._finished[r.request_id] = RequestDone(tuple(r.output_token_ids), r.lifecycle)
        tokens = tuple(out.new_token_ids)
        if r.request_id in self._replay:     # moved in: the stream starts with all its output
            self._replay.discard(r.request_id)
            tokens = tuple(r.output_token_ids)
        if tokens or out.finished:
            self._post(r.request_id, tokens, out.finished)

    def _fail_requests(self, msg: str) -> None:
        for rid in list(self._open):
            if rid not in self.engine.requests:
                self._post(rid, (), True, msg)

    def take_deltas(self, timeout: float) -> StepDeltas:
        """Every request's deltas posted since the last call (waiting up to `timeout` for
        one), a request's merged in order; empty when none came."""
        with self._outbox_cv:
            if not self._outbox:
                self._outbox_cv.wait(timeout)
            items, self._outbox = list(self._outbox), deque()
        merged: dict[str, list] = {}
        for rid, tokens, ended, error in items:
            m = merged.setdefault(rid, [[], False, None])
            m[0].extend(tokens)
            m[1] = m[1] or ended
            m[2] = m[2] or error
        out = []
        for rid, (tokens, ended, error) in merged.items():
            if rid not in self._open:             # ended already (an abort after its end)
                continue
            done = None
            if ended:
                self._open.discard(rid)
                done = self._finished.pop(rid, RequestDone())
            out.append(RequestDelta(rid, tuple(tokens), done, error))
        return StepDeltas(self.worker_id, tuple(out))

    def deltas(self, wait_s: float = 1.0, report_every_s: float | None = None):
        """The worker's delta stream (a Ray streaming generator, read by the router): a
        StepDeltas whenever requests got tokens, an empty one at least every `wait_s` (so the
        reader learns the worker is alive). With `report_every_s`, a message also carries the
        worker's `load_report()` when the last one it carried is that old: the router reads
        a streaming worker's load from here instead of calling it (router/fleet.py). While
        the engine has work (tokens or not: a long prompt's prefill chunks bring none), and
        once after, a report is pushed every `report_every_s`; idle, with the heartbeat. The
        first message carries one at once."""
        assert report_every_s is None or report_every_s > 0
        pushed, owed = -math.inf, True      # owed: the state may have moved since the push
        while not self._stop:
            if report_every_s is None:
                yield self.take_deltas(wait_s)
                continue
            owed = owed or self._work.is_set()    # steps to come: their state is owed too
            wait = wait_s if not owed else \
                min(wait_s, max(0.0, pushed + report_every_s - time.monotonic()))
            batch = self.take_deltas(wait)
            if time.monotonic() - pushed >= report_every_s:   # at most one per interval,
                pushed, owed = time.monotonic(), False          # never one owed longer
                batch = replace(batch, report=self.load_report())
            else:
                owed = owed or bool(batch.deltas)
            yield batch


def decode_actor_class(host: type = DecodeHost, **options):
    """The Ray actor class of a decode worker (`host`: DecodeHost, or a subclass of it)."""
    return ray.remote(enable_tensor_transport=True, **actor_options(options))(host)
