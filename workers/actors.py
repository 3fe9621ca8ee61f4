"""PrefillWorker and DecodeWorker: Ray actors hosting one engine each, stepped by a loop thread.

Actor methods run in Ray's thread pool (max_concurrency > 1); they touch the engine only under
`self._lock`, and the loop thread steps the engine under the same lock. A request's progress
reaches its caller through a per-request queue (decode tokens are streamed by a generator).

The P/D flow for one request (driven by cluster/pd.py):
  D.admit        decode-first: D reserves blocks for the prompt (taking its own prefix hit)
  P.prefill      P computes what its prefix cache lacks, samples the first token, and stages
                 the pages D lacks under a lease (its blocks stay pinned until ack/expiry)
  D.receive      D pulls the pages into its reserved blocks and starts decoding
  P.ack          P unpins; the blocks stay in P's prefix cache
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

import ray

from kvcache.request_trace import PrefillTiming  # trace hook
from kvcache.sampling import StepFailed
from kvtransfer import rdt
from kvtransfer.base import TransferError, TransferHandle
from kvtransfer.endpoint import KVConsumer, KVProducer
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import EngineConfig, LLMEngine, RequestError, StepOutput
from workers.metrics import WorkerMetrics
from workers.request import RequestStatus, SamplingParams

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
        self._work = threading.Event()
        self._queues: dict[str, queue.Queue] = {}
        self._stop = False
        self._loop_error: str | None = None
        self.metrics = WorkerMetrics(self.role, worker_id)
        self._transfer_failures = 0
        self._report_lock = threading.Lock()          # guards the two fields below only
        self._events_out: list[dict] = []             # KV events not yet reported
        self._snapshot: dict = {"worker_id": worker_id}  # load as of the last step
        self._step_started: float | None = None       # monotonic start of the running step
        self._stall_s = 0.0                            # injected: stall the next step (tests)
        self._step_errors = 0                          # injected: fail the next steps (tests)
        self._crash_loop = False                       # injected: break the loop (tests)
        self._step_failures = 0                        # steps that raised (their requests failed)

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
                    try:
                        if self._stall_s:          # injected hang (fault-tolerance tests)
                            time.sleep(self._stall_s)
                            self._stall_s = 0.0
                        if self._step_errors:      # injected step failure (tests)
                            self._step_errors -= 1
                            raise RuntimeError("injected engine step failure")
                        outputs = self.engine.step()
                    except Exception as e:   # noqa: BLE001 - only this step's requests fail
                        outputs = self._fail_step(e)
                    finally:
                        self._step_started = None
                    if self.engine.scheduler.stalled:   # blocks held by reservations / leases:
                        self._work.clear()              # wait for new work, or 0.1 s
                    self._publish()
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:   # noqa: BLE001 - the loop is gone: let Ray restart us
            self._loop_error = f"{type(e).__name__}: {e}"
            print(f"{self.worker_id}: engine loop failed ({self._loop_error}); exiting so "
                  f"that the actor restarts", file=sys.stderr, flush=True)
            os._exit(70)

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
                "namespace": asdict(e.namespace), "transport": self.transport_name}

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

    def prepare(self, spec: dict) -> dict:
        """Tokenize and hash a request (router side needs its block hashes to route it)."""
        req = self.engine.make_request(spec.get("prompt_token_ids") or spec.get("prompt"),
                                       None, request_id="prepare-probe",
                                       chat=spec.get("chat", False),
                                       tenant=spec.get("tenant", ""),
                                       lora_id=spec.get("lora_id", ""))
        return {"prompt_token_ids": req.prompt_token_ids, "block_hashes": req.block_hashes,
                "block_size": req.block_size}

    def _publish(self) -> None:
        """Under the engine lock: move KV events and a load snapshot to where `load_report`
        reads them, so a report never waits for an engine step (steps can take seconds)."""
        from kvcache.events import event_to_dict
        e = self.engine
        events = [event_to_dict(ev) for ev in e.take_kv_events()]
        sched, pool = e.scheduler, e.kv.pool
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        if self.role == "decode":
            running = sum(r.num_tokens for r in sched.running)
        else:
            running = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        snap = {"worker_id": self.worker_id, "queued_tokens": queued, "running_tokens": running,
                "num_requests": len(sched.waiting) + len(sched.running)
                + len(getattr(self, "_reserved", ())),
                "active_blocks": pool.num_used_blocks, "cached_blocks": pool.num_cached_blocks,
                "free_blocks": pool.num_free_blocks, "total_blocks": pool.num_blocks,
                "prefill_tok_s": e.stats.prefill_tok_s()}
        with self._report_lock:
            self._events_out.extend(events)
            self._snapshot = snap

    def load_report(self) -> dict:
        """KV events since the last report plus the load the router's policies look at, as of
        the last step; `busy_for_s` says how long the current step has run (a hung loop shows
        here, since this call never waits for the engine)."""
        with self._report_lock:
            events, self._events_out = self._events_out, []
            snap = dict(self._snapshot)
        started = self._step_started
        return {**snap, "events": events,
                "busy_for_s": time.monotonic() - started if started is not None else 0.0}

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
        self._held: dict[str, str] = {}   # transfer_id -> request_id whose blocks are pinned
        self._start_loop()

    def _housekeeping(self) -> None:
        self.producer.expire()

    def prefill(self, spec: dict, timeout: float = 600.0) -> dict:
        """Compute the prompt's KV (reusing this worker's prefix cache), sample the first token,
        and stage blocks [skip_blocks:] for the decode worker under a lease."""
        asked = spec.get("sampling", {})
        sampling = SamplingParams(**{**asked, "max_tokens": 1,
                                     "min_tokens": min(asked.get("min_tokens", 0), 1)})
        with self._lock:
            req = self.engine.make_request(spec["prompt_token_ids"], sampling,
                                           request_id=spec["request_id"],
                                           tenant=spec.get("tenant", ""),
                                           lora_id=spec.get("lora_id", ""))
            req.hold_kv = True
            q = self._open_queue(req.request_id)
            self.engine.add_request(request=req, prompt=None)
        self._work.set()
        try:
            tokens: list[int] = []
            while (item := self._next(q, timeout)) is not _DONE:
                tokens.extend(item)
        finally:
            self._queues.pop(req.request_id, None)
        if req.lifecycle.finish_reason == "abort" or not tokens:
            raise RequestError(f"request {req.request_id} was aborted during prefill")
        skip = int(spec.get("skip_blocks", 0))
        with self._lock:
            block_ids = self.engine.kv.block_table(req.request_id)
            n_prompt_blocks = -(-len(req.prompt_token_ids) // self.engine.cfg.block_size)
            send_ids = block_ids[skip:n_prompt_blocks]
            hashes = list(req.block_hashes[skip:n_prompt_blocks])
            hashes += [0] * (len(send_ids) - len(hashes))   # the trailing partial block
            handle = None
            if send_ids:
                handle = self.producer.offer_blocks(
                    req.request_id, self.engine.runner.kv_cache, send_ids, hashes,
                    on_release=lambda tid, reason, rid=req.request_id: self._unpin(rid))
                self._held[handle.transfer_id] = req.request_id
            else:
                self.engine.release_held(req.request_id)
        lc = req.lifecycle
        timing = PrefillTiming.measure(req.arrival_time, req.first_scheduled_time,  # trace hook
                                       req.first_token_time, time.perf_counter())
        return {"first_token": tokens[0], "handle": handle, "prefill_worker": self.worker_id,
                "timing": timing,
                "prefill_cached_tokens": lc.cached_tokens, "prefill_computed_tokens":
                lc.computed_tokens, "prefill_ttft_s": lc.ttft_s, "blocks_sent": len(send_ids)}

    def _unpin(self, request_id: str) -> None:
        with self._lock:
            self.engine.release_held(request_id)

    def kv_send(self, transfer_id: str):
        """RDT producer method (called with .options(tensor_transport=...))."""
        return rdt.send_pages(self.producer, transfer_id)

    def ack(self, transfer_id: str) -> bool:
        with self._lock:
            self._held.pop(transfer_id, None)
            return self.producer.ack(transfer_id)

    def abort_transfer(self, transfer_id: str) -> bool:
        with self._lock:
            self._held.pop(transfer_id, None)
            return self.producer.abort(transfer_id)

    def expire_leases(self) -> list[str]:
        with self._lock:
            return self.producer.expire()

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.producer.stats()).items()})
        return d


class DecodeHost(_EngineHost):
    role = "decode"

    def __init__(self, *args, **kw) -> None:
        self._finished: dict[str, dict] = {}  # request_id -> result, until its stream ends
        self._stops: dict[str, tuple[str, ...]] = {}  # request_id -> stop strings (streaming)
        super().__init__(*args, **kw)
        self.consumer = KVConsumer(self.transport_name, **self._transport_cfg)
        self._reserved: dict[str, Any] = {}   # request_id -> Request awaiting its pages
        self._faults_left = 0                  # injected transfer failures (chaos tests)
        self._start_loop()

    def inject_transfer_faults(self, n: int) -> None:
        """Make the next `n` transfers into this worker fail (for failure-policy tests)."""
        self._faults_left = n

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.consumer.stats()).items()})
        d["transfer_failures"] = self._transfer_failures
        return d

    def admit(self, spec: dict, local_prefill_max_tokens: int = 0) -> dict:
        """Decode-first admission: reserve blocks for the whole prompt, or say it can't now.

        If what this worker's prefix cache lacks is at most `local_prefill_max_tokens`, the
        request is prefilled right here instead (conditional disaggregation)."""
        sampling = SamplingParams(**spec.get("sampling", {}))
        with self._lock:
            req = self.engine.make_request(spec.get("prompt_token_ids") or spec.get("prompt"),
                                           sampling, request_id=spec.get("request_id"),
                                           chat=spec.get("chat", False),
                                           tenant=spec.get("tenant", ""),
                                           lora_id=spec.get("lora_id", ""))
            hits = self.engine.kv.match_prefix(req.namespace_root, req.block_hashes,
                                               req.all_token_ids, req.num_tokens - 1)
            uncached = req.num_tokens - len(hits) * self.engine.cfg.block_size
            self._stops[req.request_id] = req.sampling.stop
            common = {"request_id": req.request_id, "prompt_token_ids": req.prompt_token_ids,
                      "decode_worker": self.worker_id}
            if uncached <= local_prefill_max_tokens:
                self._open_queue(req.request_id)
                self.engine.add_request(request=req, prompt=None)
                self._work.set()
                return {**common, "admitted": True, "local": True,
                        "skip_blocks": len(hits)}
            d_hit = self.engine.reserve(req)
            if d_hit is None:
                return {**common, "admitted": False, "local": False,
                        "free_blocks": self.engine.kv.pool.num_free_blocks}
            self._reserved[req.request_id] = req
            self._open_queue(req.request_id)
            return {**common, "admitted": True, "local": False, "skip_blocks": d_hit}

    def receive(self, request_id: str, handle: TransferHandle | None, first_token: int,
                prefill_info: dict | None = None) -> dict:
        """Pull the staged pages into the reserved blocks and start decoding."""
        return self._fill(request_id, handle, first_token, prefill_info, pages=None)

    def kv_recv(self, handle: TransferHandle, pages, request_id: str, first_token: int,
                prefill_info: dict | None = None, sent_at: float | None = None) -> dict:
        """RDT consumer method: the pages arrive as an argument."""
        return self._fill(request_id, handle, first_token, prefill_info, pages=pages,
                          sent_at=sent_at)

    def _fill(self, request_id, handle, first_token, prefill_info, pages, sent_at=None) -> dict:
        with self._lock:
            req = self._reserved.get(request_id)
            if req is None:
                raise TransferError(f"request {request_id} has no reservation on "
                                    f"{self.worker_id} (aborted or unknown)")
            bs = self.engine.cfg.block_size
            blocks = self.engine.kv.block_table(request_id)
            skip = req.lifecycle.cached_tokens // bs
            dest = blocks[skip:-(-len(req.prompt_token_ids) // bs)]
        result = None
        try:
            if self._faults_left > 0:
                self._faults_left -= 1
                raise TransferError(f"injected transfer fault on {self.worker_id}")
            if handle is not None:
                assert len(dest) == handle.num_blocks, (len(dest), handle.num_blocks)
                kv_cache = self.engine.runner.kv_cache
                if pages is None:
                    result = self.consumer.pull_into(handle, kv_cache, dest)
                else:
                    result = rdt.receive_pages(self.consumer, handle, pages, kv_cache, dest,
                                               sent_at=sent_at)
        except Exception:
            self._transfer_failures += 1
            raise
        with self._lock:
            if self._reserved.pop(request_id, None) is None:
                raise TransferError(f"request {request_id} was aborted during its transfer")
            lc = req.lifecycle
            lc.decode_worker = self.worker_id
            lc.skipped_blocks = skip
            if result is not None:
                lc.transfer_bytes, lc.transfer_s = result.nbytes, result.seconds
                lc.transferred_blocks = handle.num_blocks
            if prefill_info:
                lc.prefill_worker = prefill_info.get("prefill_worker")
                lc.cached_tokens = max(lc.cached_tokens,
                                       prefill_info.get("prefill_cached_tokens", 0))
                lc.computed_tokens += prefill_info.get("prefill_computed_tokens", 0)
            out = self.engine.activate(req, first_token)
        self._deliver(out)
        self._work.set()
        return {"transfer_bytes": lc.transfer_bytes, "transfer_s": lc.transfer_s,
                "transferred_blocks": lc.transferred_blocks, "skipped_blocks": skip}

    def fallback_local(self, request_id: str) -> bool:
        """Transfer failed with policy `recompute`: prefill the reserved request here."""
        with self._lock:
            req = self._reserved.pop(request_id, None)
            if req is None:
                return False
            self.engine.kv.free(request_id)
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            self.engine.add_request(request=req, prompt=None)
        self._work.set()
        return True

    def abort(self, request_id: str) -> bool:
        with self._lock:
            req = self._reserved.pop(request_id, None)
            if req is not None:
                self.engine.requests[request_id] = req
        return super().abort(request_id)

    def stream(self, request_id: str, timeout: float = 600.0):
        """Yield {"token_ids", "text"} deltas as tokens are produced, then the final result
        {"done": True, "text", "token_ids", "lifecycle"} (no result: the request was aborted)."""
        q = self._queues.get(request_id)
        if q is None:
            raise RequestError(f"unknown request {request_id} on {self.worker_id}")
        detok = IncrementalDetokenizer(self.engine.tokenizer,
                                       self._stops.pop(request_id, ()))
        try:
            while (item := self._next(q, timeout)) is not _DONE:
                yield {"token_ids": item, "text": detok.add(item)}
        finally:
            self._queues.pop(request_id, None)
        result = self._finished.pop(request_id, {})
        if result and (rest := detok.finish(result["text"])):
            yield {"token_ids": [], "text": rest}
        yield {"done": True, **result}

    def _deliver(self, out: StepOutput) -> None:
        if out.finished:
            r = out.request
            self._finished[r.request_id] = {
                "text": r.output_text, "token_ids": list(r.output_token_ids),
                "lifecycle": r.lifecycle.to_dict()}
        super()._deliver(out)



def prefill_actor_class(**options):
    return ray.remote(enable_tensor_transport=True, **options)(PrefillHost)


def decode_actor_class(**options):
    return ray.remote(enable_tensor_transport=True, **options)(DecodeHost)
