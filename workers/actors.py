"""PrefillWorker and DecodeWorker: Ray actors hosting one engine each, stepped by a loop thread.

Actor methods run in Ray's thread pool (max_concurrency > 1); they touch the engine only under
`self._lock`, and the loop thread steps the engine under the same lock. A request's progress
reaches its caller through a per-request queue (decode tokens are streamed by a generator).

The P/D flow for one request (driven by router/orchestrator.py; the messages are the typed ones
of kvcache/handoff.py, the state machine is workers/handoff.py):
  D.admit        decode-first: D tokenizes, validates and hashes the request once, reserves
                 blocks for the prompt (taking its own prefix hit) and computes the TransferPlan
  P.prefill      P computes what its prefix cache lacks, samples the first token, and stages
                 exactly the plan's pages under a lease (with a checksum per page)
  D.stream       D pulls the pages into a private buffer, verifies them and lands them in its
                 reserved blocks only if it still owns them, then streams tokens
  P.ack          (after D's first token, off the critical path) P drops the staged copy
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import asdict, replace
from typing import Any

import ray

from kvcache import ledger as L
from kvcache.handoff import (
    REJECT_CORRUPT,
    Admission,
    AdmittedRequest,
    HoldRelease,
    LoadReport,
    PrefillResult,
    RequestDone,
    RequestInput,
    TokenDelta,
    TransferPlan,
    TransferRejected,
)
from kvcache.ledger import HandoffLedger, Hold
from kvcache.request_trace import PrefillTiming  # trace hook
from kvcache.sampling import StepFailed
from kvcache.step_rates import StepRates
from kvtransfer import rdt
from kvtransfer.base import TransferError
from kvtransfer.endpoint import KVConsumer, KVProducer
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import EngineConfig, LLMEngine, RequestError, StepOutput
from workers.handoff import DecodeHandoff, stage_plan
from workers.metrics import WorkerMetrics

_DONE = object()


class _EngineHost:
    """The engine, its lock, its loop thread and the per-request output queues."""

    role = "worker"

    def __init__(self, worker_id: str, engine_cfg: dict, transport: str = "object_store",
                 transport_cfg: dict | None = None, lease_s: float = 30.0) -> None:
        cfg = EngineConfig(**engine_cfg)
        self.worker_id = worker_id
        self.engine = LLMEngine(cfg)
        self.transport_name = transport
        self._transport_cfg = {"worker_id": worker_id, **(transport_cfg or {})}
        self._lock = threading.RLock()
        # callers waiting for the engine lock (`_call_lock`): the loop lets them in before its
        # next step (the lock is not fair: the loop would win it back, and a prompt that
        # arrived during a step could miss the next one while a later one made it)
        self._callers = 0
        self._callers_cv = threading.Condition()
        self._doorway_s = 0.05          # the loop waits at most this long for them
        self._work = threading.Event()
        self._queues: dict[str, queue.Queue] = {}
        self._stop = False
        self._loop_error: str | None = None
        self.metrics = WorkerMetrics(self.role, worker_id)
        self._transfer_failures = 0
        self._report_lock = threading.Lock()          # guards the two fields below only
        self._events_out: list = []                   # KV events not yet reported
        self._released_out: list[HoldRelease] = []    # ledger releases not yet reported
        self._snapshot = LoadReport(worker_id)        # load as of the last step
        self.incarnation = uuid.uuid4().hex[:8]       # a restarted actor has a new one
        self.ledger = HandoffLedger(on_release=self._note_release)
        self._step_started: float | None = None       # monotonic start of the running step
        self._stall_s = 0.0                            # injected: stall the next step (tests)
        self._step_errors = 0                          # injected: fail the next steps (tests)
        self._crash_loop = False                       # injected: break the loop (tests)
        self._step_failures = 0                        # steps that raised (their requests failed)
        self.rates = StepRates()                       # measured prefill / decode speed

    def _start_loop(self) -> None:
        """Called last by each subclass constructor, once every field the loop reads exists."""
        with self._lock:
            self._publish()
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-loop",
                                        daemon=True)
        self._thread.start()

    # ---- loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Step the engine while there is work. A step that raises fails its own requests
        (`_fail_step`) and the loop goes on; if the loop itself breaks, the process exits so
        that Ray restarts the actor and the router retries its requests elsewhere."""
        try:
            while not self._stop:
                self._work.wait(timeout=0.1)
                with self._callers_cv:     # callers who waited through the last step go first
                    self._callers_cv.wait_for(lambda: self._callers == 0,
                                              timeout=self._doorway_s)
                with self._lock:
                    if self._crash_loop:               # injected (fault-tolerance tests)
                        raise RuntimeError("injected engine loop failure")
                    self._housekeeping()
                    self.metrics.maybe_update(self.stats)
                    self._publish()
                    if not self.engine.has_unfinished():
                        self._work.clear()
                        continue
                    self._step_started = time.monotonic()
                    before = _step_snapshot(self.engine)
                    try:
                        if self._stall_s:          # injected hang (fault-tolerance tests)
                            time.sleep(self._stall_s)
                            self._stall_s = 0.0
                        if self._step_errors:      # injected step failure (tests)
                            self._step_errors -= 1
                            raise RuntimeError("injected engine step failure")
                        loading_s = self.engine.lora_load_s_total()
                        outputs = self.engine.step()
                        loading_s = self.engine.lora_load_s_total() - loading_s
                        # adapter loads are reported on their own (lora_load_s), not as
                        # prefill or decode speed
                        _observe_step(self.rates, before,
                                      time.monotonic() - self._step_started - loading_s)
                    except Exception as e:   # noqa: BLE001 - only this step's requests fail
                        outputs = self._fail_step(e)
                    finally:
                        self._step_started = None
                    if self.engine.scheduler.stalled:   # blocks held by reservations / leases:
                        self._work.clear()              # wait for new work, or 0.1 s
                    self._after_step(outputs)
                    self._publish()
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:   # noqa: BLE001 - the loop is gone: let Ray restart us
            self._loop_error = f"{type(e).__name__}: {e}"
            print(f"{self.worker_id}: engine loop failed ({self._loop_error}); exiting so "
                  f"that the actor restarts", file=sys.stderr, flush=True)
            os._exit(70)

    @contextlib.contextmanager
    def _call_lock(self):
        """The engine lock for an actor call that adds work (a prompt, an admission, landed
        pages): counted while it waits, so that the loop lets it in before its next step."""
        with self._callers_cv:
            self._callers += 1
            self._callers_cv.notify_all()
        try:
            with self._lock:
                yield
        finally:
            with self._callers_cv:
                self._callers -= 1
                self._callers_cv.notify_all()

    def _fail_step(self, error: Exception) -> list[StepOutput]:
        """Under the lock, after engine.step() raised: the requests of that step (the running
        batch) end with StepFailed and their blocks are freed; nothing else is touched."""
        msg = (f"{self.worker_id}: engine step failed ({type(error).__name__}: {error}); "
               f"the requests of this step were ended")
        print(msg, file=sys.stderr, flush=True)
        self._step_failures += 1
        for req in list(self.engine.scheduler.running):
            try:
                self.engine.abort(req.request_id)
            except Exception:   # noqa: BLE001 - free what can be freed, fail every caller
                pass
        # the step's requests, and any it finished before raising (their output is lost);
        # a caller that already has its end stops there and never reads this
        for rid, q in list(self._queues.items()):
            if rid not in self.engine.requests:
                q.put(StepFailed(msg))
        return []

    def _housekeeping(self) -> None:
        """Periodic work under the lock (lease expiry on prefill workers)."""

    def _after_step(self, outputs: list[StepOutput]) -> None:
        """Under the lock, in the loop thread, right after a step and before the next one
        (prefill workers stage finished prefills here)."""

    def _deliver(self, out: StepOutput) -> None:
        if out.finished:
            self.metrics.observe_finished(out.request.lifecycle)
        q = self._queues.get(out.request.request_id)
        if q is None:
            return
        if out.new_token_ids:
            q.put(list(out.new_token_ids))
        if out.finished:
            q.put(_DONE)

    def _open_queue(self, request_id: str) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        self._queues[request_id] = q
        return q

    def _next(self, q: queue.Queue, timeout: float) -> Any:
        item = q.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    # ---- common methods ----------------------------------------------------------------------
    def info(self) -> dict:
        e = self.engine
        return {"worker_id": self.worker_id, "role": self.role,
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "num_blocks": e.kv.pool.num_blocks, "block_size": e.cfg.block_size,
                "kv_bytes_per_token": e.kv_bytes_per_token, "model_id": e.info.model_id,
                "vocab_size": e.info.vocab_size, "max_model_len": e.max_model_len,
                "namespace": asdict(e.namespace), "transport": self.transport_name,
                "device": e.device.type}

    def tokenize(self, prompt: Any, chat: bool = False) -> list[int]:
        return self.engine.tokenize(prompt, chat)

    def stats(self) -> dict:
        with self._lock:
            d = self.engine.get_stats()
            d.update(self.engine.kv.pool.counts())
            d.update(worker_id=self.worker_id, role=self.role, loop_error=self._loop_error,
                     step_failures=self._step_failures)
            return d

    def check_invariants(self) -> dict:
        """Assert the block ledger and return its counts."""
        with self._lock:
            self.engine.check_invariants()
            return self.engine.kv.pool.counts()

    def block_holders(self) -> dict[str, str]:
        """Requests that reference blocks now: request id -> "<blocks> blocks, <state>"
        (what a leak report names)."""
        with self._lock:
            sched = self.engine.scheduler
            state = {r.request_id: "waiting" for r in sched.waiting}
            state.update({r.request_id: "running" for r in sched.running})
            return {rid: f"{len(blocks)} blocks, {state.get(rid, 'not scheduled')}"
                    for rid, blocks in self.engine.kv.req_blocks.items() if blocks}

    def _note_release(self, hold: Hold) -> None:
        with self._report_lock:
            self._released_out.append(HoldRelease(hold.worker_id, hold.kind, hold.request_id,
                                                  hold.released or ""))

    def ledger_holds(self) -> list[Hold]:
        """This worker's open handoff holds."""
        return self.ledger.open_holds()

    def _publish(self) -> None:
        """Under the engine lock: move KV events and a load snapshot to where `load_report`
        reads them, so a report never waits for an engine step (steps can take seconds)."""
        e = self.engine
        events = e.take_kv_events()
        sched, pool = e.scheduler, e.kv.pool
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        if self.role == "decode":
            running = sum(r.num_tokens for r in sched.running)
        else:
            running = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        pfit, dfit = self.rates.prefill_fit(), self.rates.decode_fit()
        queued_s = None
        if pfit is not None:   # the worker's own estimate of its prefill work, by its own fit
            queued_s = pfit.backlog_s([(r.num_tokens, r.num_computed_tokens)
                                       for r in (*sched.waiting, *sched.running)
                                       if _prefilling(r)], e.cfg.max_num_batched_tokens)
        decoding = [r for r in sched.running if not _prefilling(r)]
        step_s = dfit.step_s(len(decoding), sum(r.num_tokens for r in decoding)) \
            if dfit is not None and decoding else 0.0
        snap = LoadReport(self.worker_id, queued_tokens=queued, running_tokens=running,
                          num_requests=len(sched.waiting) + len(sched.running)
                          + self._num_reserved(),
                          active_blocks=pool.num_used_blocks, cached_blocks=pool.num_cached_blocks,
                          free_blocks=pool.num_free_blocks, total_blocks=pool.num_blocks,
                          queued_s=queued_s, prefill_fit=pfit, decode_fit=dfit,
                          decode_batch=len(decoding), decode_step_s=step_s,
                          kv_bytes_per_token=int(e.kv_bytes_per_token),
                          incarnation=self.incarnation, reported_at=time.monotonic(),
                          lora_slots=e.cfg.max_loras if e.cfg.lora_adapters else 0,
                          **e.lora_load_report())
        with self._report_lock:
            self._events_out.extend(events)
            self._snapshot = snap

    def _num_reserved(self) -> int:
        return 0

    def load_report(self) -> LoadReport:
        """KV events and ledger releases since the last report plus the load the router's
        policies look at, as of the last step; `busy_for_s` says how long the current step has
        run (a hung loop shows here, since this call never waits for the engine)."""
        with self._report_lock:
            events, self._events_out = self._events_out, []
            released, self._released_out = self._released_out, []
            snap = self._snapshot
        started, now = self._step_started, time.monotonic()
        return replace(snap, events=tuple(events), released=tuple(released),
                       busy_for_s=now - started if started is not None else 0.0,
                       age_s=max(0.0, now - snap.reported_at))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            done = self.engine.abort(request_id)
        q = self._queues.get(request_id)
        if q is not None:
            q.put(_DONE)
        return done

    def stall_next_step(self, seconds: float) -> None:
        """Make the next engine step hang for `seconds` (to test hung-worker detection)."""
        self._stall_s = seconds

    def fail_next_steps(self, n: int = 1) -> None:
        """Make the next `n` engine steps raise (to test that only their requests fail)."""
        self._step_errors = n

    def crash_loop(self) -> None:
        """Break the engine loop (to test that the actor restarts)."""
        self._crash_loop = True
        self._work.set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay); publishes an AllBlocksCleared event."""
        with self._lock:
            self.engine.kv.pool.reset_prefix_cache()

    def ping(self) -> str:
        return self.worker_id

    def shutdown(self) -> None:
        self._stop = True
        self._work.set()


class PrefillHost(_EngineHost):
    role = "prefill"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.producer = KVProducer(self.transport_name, kw.get("lease_s", 30.0),
                                   **self._transport_cfg)
        self._faults = {"corrupt": 0, "drop_ack": 0}   # injected (chaos): next n stagings / acks
        self.corrupt_injected = 0
        self._corrupt_armed: list[int] = []      # chaos: ids of armed corruptions, in order
        self._corrupt_applied: dict[int, tuple[str, str]] = {}   # chaos: id -> (P, transfer)
        self._plans: dict[str, TransferPlan] = {}   # worker request id -> plan to stage
        self._ack_lock = threading.Lock()            # guards _faults["drop_ack"]
        self._start_loop()

    def _housekeeping(self) -> None:
        self.producer.expire()

    def inject_fault(self, kind: str, n: int = 1) -> None:
        """Chaos: `corrupt` flips bytes of the next n staged copies (after their checksums were
        taken); `drop_ack` ignores the next n acks (the lease has to expire)."""
        assert kind in self._faults, kind
        self._faults[kind] = max(0, self._faults[kind] + n)

    def arm_corruption(self) -> int:
        """Chaos: the next staged copy gets corrupted; returns an id for `corruption_applied`."""
        with self._lock:
            fid = len(self._corrupt_applied) + len(self._corrupt_armed) + self.corrupt_injected
            fid = max([fid, *self._corrupt_armed, *self._corrupt_applied]) + 1
            self._corrupt_armed.append(fid)
            return fid

    def corruption_applied(self, fid: int, disarm: bool = False) -> tuple[str, str] | None:
        """The transfer (this worker's id, the worker request id) that armed corruption hit,
        or None if it hit no staged copy yet; `disarm`: cancel it if not."""
        with self._lock:
            if disarm and fid in self._corrupt_armed:
                self._corrupt_armed.remove(fid)
            return self._corrupt_applied.get(fid)

    def prefill(self, admitted: AdmittedRequest, plan: TransferPlan) -> PrefillResult:
        """Compute the prompt's KV (reusing this worker's prefix cache), sample the first token,
        and stage exactly the plan's blocks under a lease.

        The loop thread stages the plan right after the step that finished the prefill
        (`_after_step`), before its next step: staging here would wait for the engine lock
        until that next step ended, so a short prompt's TTFT would include the whole of the
        next prompt's prefill step."""
        assert plan.request_id == admitted.request_id and plan.epoch == admitted.epoch
        with self._call_lock():
            req = self.engine.admitted_request(admitted, max_tokens=1)
            req.hold_kv = True
            q = self._open_queue(req.request_id)
            self._plans[req.request_id] = plan
            self.engine.add_request(request=req, prompt=None)
        self._work.set()
        result: PrefillResult | None = None
        try:
            while (item := self._next(q, max(0.0, admitted.deadline - time.time()))) \
                    is not _DONE:
                if isinstance(item, PrefillResult):
                    result = item
        except queue.Empty:
            self._drop(req.request_id, q)
            raise RequestError(f"request {admitted.request_id} passed its deadline in "
                               "prefill") from None
        except BaseException:     # a failed step (or anything else): nothing stays held
            self._drop(req.request_id, q)
            raise
        finally:   # (no lock: the loop may be in its next step; a dict pop is atomic)
            self._queues.pop(req.request_id, None)
            self._plans.pop(req.request_id, None)
        if result is None:        # aborted before the loop staged it
            with self._lock:
                self.engine.release(req.request_id)
            raise RequestError(f"request {req.request_id} was aborted during prefill")
        timing = PrefillTiming.measure(req.arrival_time, req.first_scheduled_time,  # trace hook
                                       req.first_token_time, time.perf_counter())
        return replace(result, timing=timing)

    def _after_step(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = out.request
            plan = self._plans.pop(req.request_id, None) if out.finished else None
            q = self._queues.get(req.request_id)
            if plan is None or q is None:
                continue
            if req.lifecycle.finish_reason == "abort" or not req.output_token_ids:
                continue          # prefill() sees no result and releases
            try:
                q.put(self._stage(req, plan))
            except Exception as e:   # noqa: BLE001 - this request's caller gets the error
                q.put(e)

    def _stage(self, req: Any, plan: TransferPlan) -> PrefillResult:
        """Under the lock: stage `plan` of the finished prefill `req` (chaos corruption
        applied here when armed)."""
        corrupt = self._faults["corrupt"] > 0 or bool(self._corrupt_armed)
        fid = None
        if self._faults["corrupt"] > 0:
            self._faults["corrupt"] -= 1
        elif corrupt:
            fid = self._corrupt_armed.pop(0)
        try:
            result = stage_plan(self.engine, self.producer, self.ledger, self.worker_id, req,
                                plan, req.output_token_ids[0], corrupt=corrupt)
        except BaseException:
            if fid is not None:
                self._corrupt_armed.insert(0, fid)     # the next staging takes it
            raise
        corrupt = corrupt and result.handle is not None   # nothing staged: nothing corrupted
        self.corrupt_injected += corrupt
        if fid is not None:
            if corrupt:
                self._corrupt_applied[fid] = (self.worker_id, result.worker_request_id)
            else:
                self._corrupt_armed.insert(0, fid)     # the next staging takes it
        return result

    def _drop(self, request_id: str, q: queue.Queue | None = None) -> None:
        """A prefill given up: end it if it still runs, free its blocks even when it had
        finished meanwhile (a `hold_kv` request keeps its blocks until released), and end a
        staging the loop made that nobody will hand on (its result still in `q`)."""
        with self._lock:
            self._plans.pop(request_id, None)     # the loop stages nothing for it from now
            self.engine.abort(request_id)
            self.engine.release(request_id)
            while q is not None and not q.empty():
                item = q.get_nowait()
                if isinstance(item, PrefillResult) and item.handle is not None:
                    self.producer.abort(item.handle.transfer_id)

    def kv_send(self, transfer_id: str):
        """RDT producer method (called with .options(tensor_transport=...))."""
        return rdt.send_pages(self.producer, transfer_id)

    def ack(self, transfer_id: str) -> str:
        """D has the pages: drop the staged copy. Returns the ledger reason the staging ended
        with ("acked", or "expired" / "aborted" when the lease had ended already), or
        "dropped" when a chaos fault swallowed the ack. The staged copy is not the engine's:
        no engine lock (it is held through every step; the request's end waits for this)."""
        with self._ack_lock:
            if self._faults["drop_ack"] > 0:
                self._faults["drop_ack"] -= 1
                return "dropped"
        if self.producer.ack(transfer_id):
            return L.ACKED
        return "ended"

    def abort_transfer(self, transfer_id: str) -> bool:
        return self.producer.abort(transfer_id)     # the lease table has its own lock

    def expire_leases(self) -> list[str]:
        return self.producer.expire()

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.producer.stats()).items()})
        d.update({f"ledger_{k}": v for k, v in self.ledger.counters().items()})
        d["corrupt_injected"] = self.corrupt_injected
        return d


class DecodeHost(_EngineHost):
    role = "decode"

    def __init__(self, *args, **kw) -> None:
        self._finished: dict[str, RequestDone] = {}  # request_id -> result, until streamed
        self._stops: dict[str, tuple[str, ...]] = {}  # request_id -> stop strings (streaming)
        super().__init__(*args, **kw)
        self.consumer = KVConsumer(self.transport_name, **self._transport_cfg)
        self.handoff = DecodeHandoff(self.engine, self.worker_id, self.ledger)
        self._faults_left = 0                  # injected transfer failures (tests)
        self._pull_delay = (0.0, 0)            # injected: (seconds, pulls) to delay (chaos)
        self.pull_delays_applied = 0
        # chaos audit, (prefill worker, worker request id): transfers whose pages reached
        # verification here, and of those the ones refused as corrupt
        self.pages_received: set[tuple[str, str]] = set()
        self.corrupt_rejected: set[tuple[str, str]] = set()
        self._start_loop()

    def transfers_seen(self, transfers: list[tuple[str, str]]
                       ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Chaos audit: which of these transfers (prefill worker, worker request id)
        delivered pages here, and which of those this worker refused as corrupt."""
        with self._lock:
            got = [t for t in map(tuple, transfers) if t in self.pages_received]
            return got, [t for t in got if t in self.corrupt_rejected]

    def _num_reserved(self) -> int:
        return len(self.handoff.reservations)

    def _housekeeping(self) -> None:
        self.handoff.expire()

    def inject_transfer_faults(self, n: int) -> None:
        """Make the next `n` transfers into this worker fail (for failure-policy tests)."""
        self._faults_left = n

    def inject_pull_delay(self, seconds: float, n: int = 1) -> None:
        """Chaos: `n` more pulls start late, by the longest delay asked for so far (a pull
        slower than the lease)."""
        with self._lock:
            delay, left = self._pull_delay
            self._pull_delay = (max(delay, seconds) if left else seconds, left + n)

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.consumer.stats()).items()})
        d["transfer_failures"] = self._transfer_failures
        d["pull_delays_applied"] = self.pull_delays_applied
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
            hits = self.engine.kv.match_prefix(req.namespace_root, req.block_hashes,
                                               req.all_token_ids, req.num_tokens - 1)
            uncached = req.num_tokens - len(hits) * self.engine.cfg.block_size
            if uncached <= local_prefill_max_tokens:
                self._stops[req.request_id] = req.sampling.stop
                self._open_queue(req.request_id)
                req.lifecycle.decode_worker = self.worker_id
                self.engine.add_request(request=req, prompt=None)
                self._work.set()
                return Admission(admitted, self.worker_id, True, local=True,
                                 decode_cached_blocks=len(hits))
            plan = self.handoff.reserve(req, admitted)
            if plan is None:
                return Admission(admitted, self.worker_id, False,
                                 free_blocks=self.engine.kv.pool.num_free_blocks)
            self._stops[req.request_id] = req.sampling.stop
            self._open_queue(req.request_id)
            return Admission(admitted, self.worker_id, True, decode_cached_blocks=plan.first_block,
                             plan=plan, free_blocks=self.engine.kv.pool.num_free_blocks,
                             reserved_blocks=len(self.engine.kv.block_table(req.request_id)))

    def _fill(self, result: PrefillResult, pages=None, sent_at: float | None = None) -> None:
        """Pull the staged pages into a private buffer, verify them, and land them in the
        reserved blocks if the reservation still owns them (else TransferRejected: nothing
        written). `pages`: delivered by RDT as an argument instead of pulled."""
        with self._lock:
            res = self.handoff.begin_pull(result)
        handle = result.handle
        try:
            with self._lock:
                delay, n = self._pull_delay
                self._pull_delay = (delay, max(0, n - 1))
                self.pull_delays_applied += n > 0
            if n > 0:
                time.sleep(delay)
            if self._faults_left > 0:
                self._faults_left -= 1
                raise TransferError(f"injected transfer fault on {self.worker_id}")
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
            key = (result.prefill_worker, result.worker_request_id)
            if pages is not None:
                self.pages_received.add(key)
            try:
                out = self.handoff.land(res, result, pages)
            except Exception as e:
                self._transfer_failures += 1
                if isinstance(e, TransferRejected) and e.reason == REJECT_CORRUPT:
                    self.corrupt_rejected.add(key)
                raise
            if transfer is not None:
                lc = out.request.lifecycle
                lc.transfer_bytes, lc.transfer_s = transfer.nbytes, transfer.seconds
        self._deliver(out)
        self._work.set()

    def fallback_local(self, request_id: str) -> bool:
        """No transfer will come (no prefill worker left): prefill the reserved request here."""
        with self._lock:
            done = self.handoff.fallback(request_id)
        self._work.set()
        return done

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if self.handoff.cancel(request_id, L.ABORTED):
                q = self._queues.get(request_id)
                if q is not None:
                    q.put(_DONE)
                return True
        return super().abort(request_id)

    def stream(self, request_id: str, epoch: int = 0, prefill: PrefillResult | None = None,
               pages=None, sent_at: float | None = None, timeout: float = 600.0):
        """With `prefill`: land its pages first (raises TransferRejected / TransferError before
        the first item; the reservation then waits for another transfer). Then yield
        TokenDelta items as tokens are produced and a final RequestDone (whose lifecycle is
        None when the request was aborted)."""
        from kvcache.handoff import worker_request_id
        rid = worker_request_id(request_id, epoch)
        if prefill is not None:
            self._fill(prefill, pages, sent_at)
        q = self._queues.get(rid)
        if q is None:
            raise RequestError(f"unknown request {rid} on {self.worker_id}")
        detok = IncrementalDetokenizer(self.engine.tokenizer, self._stops.pop(rid, ()))
        try:
            while (item := self._next(q, timeout)) is not _DONE:
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


def _prefilling(req: Any) -> bool:
    """Computing prompt tokens (a full prefix hit still computes its last prompt token)."""
    return req.is_prefill or not req.output_token_ids


def _step_snapshot(engine: LLMEngine) -> list[tuple[Any, int, bool]]:
    """Before a step: (request, num_computed_tokens, is_prefill) of every scheduled request."""
    sched = engine.scheduler
    return [(r, r.num_computed_tokens, _prefilling(r)) for r in (*sched.running, *sched.waiting)]


def _observe_step(rates: StepRates, before: list[tuple[Any, int, bool]], seconds: float) -> None:
    """Feed one step to the worker's rate fits: a prefill-only step to the prefill fit, a
    decode-only step to the decode fit; a step mixing both is left out of both."""
    prefill, decode_ctx, decode_n = [], 0, 0
    for req, computed, was_prefill in before:
        new = req.num_computed_tokens - computed
        if new <= 0:            # not scheduled this step (or preempted)
            continue
        if was_prefill:
            prefill.append((new, computed))
        else:
            decode_n += 1
            decode_ctx += req.num_computed_tokens
    if prefill and not decode_n:
        rates.observe_prefill(seconds, prefill)
    elif decode_n and not prefill:
        rates.observe_decode(seconds, decode_n, decode_ctx)


def prefill_actor_class(**options):
    return ray.remote(enable_tensor_transport=True, **options)(PrefillHost)


def decode_actor_class(**options):
    return ray.remote(enable_tensor_transport=True, **options)(DecodeHost)
