"""EngineHost: what a prefill and a decode worker actor share: one engine, its lock, the loop
thread that steps it, the per-request output queues, and the load report the router polls.

Actor methods run in Ray's thread pool (max_concurrency > 1); they touch the engine only under
`self._lock`, and the loop thread steps the engine under the same lock. A request's progress
reaches its caller through a per-request queue. The roles: workers/prefill_host.py (P: prefill
and stage the plan's pages) and workers/decode_host.py (D: admit, land the pages, decode and
stream). The P/D flow is driven by router/orchestrator.py; its messages are protocol/messages.py's
and the handoff's state machine is workers/kv_handoff.py. Fault injection (chaos, tests) wraps
these hosts from workers/faults.py; it is not in them.
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
import torch

from kvtransfer.rdt import pool_device
from protocol.errors import StepFailed
from protocol.ledger import HandoffLedger, Hold
from protocol.messages import HoldRelease, KVCounters, LoadReport
from protocol.step_rates import REFIT_INTERVAL_S, StepRates
from workers.device import serial_openmp_here
from workers.engine import EngineConfig, LLMEngine, StepOutput
from workers.kernels.tp_comm import CommError
from workers.metrics import WorkerMetrics
from workers.thread_share import ThreadShare

DONE = object()   # the last item of a request's output queue


def actor_options(options: dict) -> dict:
    """A worker actor's Ray options with the engine's environment (workers.HUGE_PAGES_ENV) added
    to its runtime environment (the caller's own env_vars win): set in the actor's process
    before it allocates a tensor, on whichever node it lands."""
    from workers import HUGE_PAGES_ENV
    env = dict(options.get("runtime_env") or {})
    env["env_vars"] = {**HUGE_PAGES_ENV, **env.get("env_vars", {})}
    return {**options, "runtime_env": env}


class EngineLock:
    """The engine lock (reentrant). A thread other than the engine loop that takes it runs its
    torch work on one OpenMP thread (workers/device.py serial_openmp_here): only the loop's
    team is ever in parallel regions, so libgomp keeps spinning between them.
    `caller_entries` counts the times such a thread took it (the loop's load report is rebuilt
    before a step only when it moved: only the loop changes the engine otherwise)."""

    def __init__(self, serial_callers: bool = True) -> None:
        self._lock = threading.RLock()
        self._serial_callers = serial_callers
        self.loop_thread: threading.Thread | None = None
        self.caller_entries = 0

    def __enter__(self) -> EngineLock:
        if threading.current_thread() is self.loop_thread:
            self._lock.acquire()
            return self
        if self._serial_callers:
            serial_openmp_here()
        self._lock.acquire()
        self.caller_entries += 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class EngineHost:
    """The engine, its lock, its loop thread and the per-request output queues."""

    role = "worker"

    def __init__(self, worker_id: str, engine_cfg: dict, transport: str = "object_store",
                 transport_cfg: dict | None = None, lease_s: float = 30.0) -> None:
        # in a worker process, torch threads are the loop thread's alone (workers/device.py
        # serial_openmp_here): this thread builds the engine on one. A host built in a test's
        # own process leaves that process's threads alone.
        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        if in_actor:
            serial_openmp_here()
        # in an actor the loop thread sets the torch threads (its own team); elsewhere as given
        self._loop_threads = engine_cfg.get("num_threads") if in_actor else None
        engine_cfg = dict(engine_cfg)
        share = engine_cfg.pop("share_idle_threads", False)
        tp_placement = engine_cfg.pop("tp_placement", None)   # a TP worker's placement group
        cfg = EngineConfig(**({**engine_cfg, "num_threads": None} if in_actor else engine_cfg))
        self.worker_id = worker_id
        # in an actor: the threads of idle raypd workers on this machine too (thread_share.py)
        self._threads = ThreadShare(worker_id, self._loop_threads) \
            if share and self._loop_threads else None
        self.step_threads: int | None = None    # the torch threads of the last step (sharing)
        # a TP worker: this actor is rank 0; the other ranks are Ray actors in its placement
        # group (workers/tp_actors.py), with this worker's threads each
        self.engine = LLMEngine(cfg, tp_launcher="ray" if in_actor else None,
                                tp_placement=tp_placement, tp_rank_threads=self._loop_threads) \
            if cfg.tp > 1 else LLMEngine(cfg)
        self.transport_name = transport
        self._transport_cfg = {"worker_id": worker_id, **(transport_cfg or {})}
        # `_lock` is what every caller takes (a test may wrap it); the loop reads the counts
        # of the EngineLock itself
        self._engine_lock = EngineLock(serial_callers=in_actor)
        self._lock = self._engine_lock
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
        self._report_seq = 0                          # reports made (orders them)
        self.incarnation = uuid.uuid4().hex[:8]       # a restarted actor has a new one
        self.ledger = HandoffLedger(on_release=self._note_release)
        self._step_started: float | None = None       # monotonic start of the running step
        self._step_failures = 0                        # steps that raised (their requests failed)
        # measured prefill / decode speed, refitted on a clock (the report reads it each step)
        self.rates = StepRates(refit_interval_s=REFIT_INTERVAL_S)
        self._reported_key: tuple | None = None       # `_load_key()` at the last report
        self._reported_entries = -1                    # caller_entries at the last report

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
        self._engine_lock.loop_thread = threading.current_thread()
        if self._loop_threads:
            torch.set_num_threads(self._loop_threads)   # this thread's team: the only one
        try:
            while not self._stop:
                self._work.wait(timeout=0.1)
                with self._callers_cv:     # callers who waited through the last step go first
                    self._callers_cv.wait_for(lambda: self._callers == 0,
                                              timeout=self._doorway_s)
                with self._lock:
                    self._before_step()
                    self._housekeeping()
                    self.metrics.maybe_update(self.stats)
                    idle = not self.engine.has_unfinished()
                    if idle or self._changed_since_report():
                        self._publish()
                    if idle:
                        self._work.clear()
                        if self._threads is not None:
                            self._threads.set_busy(False)
                        continue
                    if self._threads is not None:
                        self._threads.set_busy(True)
                        if (n := self._threads.threads()) != self.step_threads:
                            torch.set_num_threads(n)
                            self.step_threads = n
                    self._step_started = time.monotonic()
                    before = step_snapshot(self.engine)
                    try:
                        loading_s = self.engine.view.lora_load_s_total()
                        outputs = self._run_step()
                        loading_s = self.engine.view.lora_load_s_total() - loading_s
                        # adapter loads are reported on their own (lora_load_s), not as
                        # prefill or decode speed
                        observe_step(self.rates, before,
                                      time.monotonic() - self._step_started - loading_s)
                    except CommError:   # a rank of this TP worker is gone: so is the worker
                        raise
                    except Exception as e:   # noqa: BLE001 - only this step's requests fail
                        outputs = self._fail_step(e)
                    finally:
                        self._step_started = None
                    if self.engine.view.stalled:   # blocks held by reservations / leases:
                        self._work.clear()              # wait for new work, or 0.1 s
                    self._after_step(outputs)
                    self._publish()
                for out in outputs:
                    self._deliver(out)
            if self._threads is not None:
                self._threads.close()
        except BaseException as e:   # noqa: BLE001 - the loop is gone: let Ray restart us
            self._loop_error = f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                self.engine.close()   # a TP worker's other ranks stop with it
            print(f"{self.worker_id}: engine loop failed ({self._loop_error}); exiting so "
                  f"that the actor restarts", file=sys.stderr, flush=True)
            os._exit(70)

    def _before_step(self) -> None:
        """Under the lock, in the loop, before each engine step (a hook: workers/faults.py
        breaks the loop here)."""

    def _run_step(self) -> list[StepOutput]:
        """One engine step (a hook: workers/faults.py stalls or fails it)."""
        return self.engine.step()

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
        self.engine.abort_running()
        self._fail_requests(msg)
        return []

    def _fail_requests(self, msg: str) -> None:
        """After a failed step: the step's requests, and any it finished before raising (their
        output is lost), end with StepFailed; a caller that already has its end stops there
        and never reads this."""
        for rid, q in list(self._queues.items()):
            if rid not in self.engine.requests:
                q.put(StepFailed(msg))

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
            q.put(DONE)

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
                "num_blocks": e.view.pool_counts()["total"], "block_size": e.cfg.block_size,
                "kv_bytes_per_token": e.kv_bytes_per_token, "model_id": e.info.model_id,
                "vocab_size": e.info.vocab_size, "max_model_len": e.max_model_len,
                "namespace": asdict(e.namespace), "transport": self.transport_name,
                "device": e.device.type, "gpu": pool_device(e.device).gpu}

    def tokenize(self, prompt: Any, chat: bool = False) -> list[int]:
        return self.engine.inputs.tokenize(prompt, chat)

    def stats(self) -> dict:
        with self._lock:
            d = self.engine.get_stats()
            d.update(self.engine.view.pool_counts())
            d.update(worker_id=self.worker_id, role=self.role, loop_error=self._loop_error,
                     step_failures=self._step_failures)
            return d

    def check_invariants(self) -> dict:
        """Assert the block ledger and return its counts."""
        with self._lock:
            self.engine.check_invariants()
            return self.engine.view.pool_counts()

    def block_holders(self) -> dict[str, str]:
        """Requests that reference blocks now: request id -> "<blocks> blocks, <state>"
        (what a leak report names)."""
        with self._lock:
            return self.engine.view.block_holders()

    def _note_release(self, hold: Hold) -> None:
        with self._report_lock:
            self._released_out.append(HoldRelease(hold.worker_id, hold.kind, hold.request_id,
                                                  hold.released or ""))

    def ledger_holds(self) -> list[Hold]:
        """This worker's open handoff holds."""
        return self.ledger.open_holds()

    def _load_key(self) -> tuple[int, ...]:
        """O(1) figures that anything ending work or freeing blocks between steps moves (the
        housekeeping's expiries, aborts and lease releases): pool usage, requests, reservations."""
        e = self.engine
        return (e.kv.pool.num_free_blocks, e.kv.pool.num_cached_blocks, len(e.requests),
                self._num_reserved())

    def _changed_since_report(self) -> bool:
        """Under the engine lock, in the loop: did anything but the loop's own steps change the
        engine since the last report (an actor call took the lock, or housekeeping freed
        blocks or ended work)? After a step the loop always reports, so in steady decoding
        the report is built once a step."""
        return self._engine_lock.caller_entries != self._reported_entries \
            or self._load_key() != self._reported_key

    def _publish(self) -> None:
        """Under the engine lock: move KV events and a load snapshot to where `load_report`
        reads them, so a report never waits for an engine step (steps can take seconds)."""
        e = self.engine
        self._reported_entries = self._engine_lock.caller_entries
        self._reported_key = self._load_key()
        events = e.view.take_kv_events()
        waiting, running_reqs = e.view.waiting_requests(), e.view.running_requests()
        used, cached, free, total = e.view.pool_usage()
        queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        if self.role == "decode":
            running = sum(r.num_tokens for r in running_reqs)
        else:
            running = sum(r.num_tokens - r.num_computed_tokens for r in running_reqs)
        pfit, dfit = self.rates.prefill_fit(), self.rates.decode_fit()
        queued_s = None
        to_prefill = [(r.num_tokens, r.num_computed_tokens)
                      for r in (*waiting, *running_reqs) if prefilling(r)]
        if pfit is not None:   # the worker's own estimate of its prefill work, by its own fit
            queued_s = pfit.backlog_s(to_prefill, e.max_num_batched_tokens)
        decoding = [r for r in running_reqs if not prefilling(r)]
        step_s = dfit.step_s(len(decoding), sum(r.num_tokens for r in decoding)) \
            if dfit is not None and decoding else 0.0
        snap = LoadReport(self.worker_id, queued_tokens=queued, running_tokens=running,
                          num_requests=len(waiting) + len(running_reqs) + self._num_reserved(),
                          active_blocks=used, cached_blocks=cached, free_blocks=free,
                          evictable_blocks=e.kv.pool.num_evictable_blocks,
                          total_blocks=total, block_size=e.cfg.block_size,
                          queued_s=queued_s, prefill_fit=pfit, decode_fit=dfit,
                          prefill_tokens=sum(n - c for n, c in to_prefill),
                          decode_batch=len(decoding), decode_step_s=step_s,
                          kv_bytes_per_token=int(e.kv_bytes_per_token), kv=self._kv_counters(),
                          incarnation=self.incarnation, reported_at=time.monotonic(),
                          lora_slots=e.cfg.max_loras if e.cfg.lora_adapters else 0,
                          **e.view.lora_load_report())
        with self._report_lock:
            self._events_out.extend(events)
            self._snapshot = snap

    def _num_reserved(self) -> int:
        return 0

    def _kv_counters(self) -> KVCounters:
        """Under the engine lock: the cumulative KV-lifecycle counters a load report carries."""
        e = self.engine
        t2 = e.kv.pool.tier2_stats
        transfers, rejected = self._transfer_counts()
        return KVCounters(prompt_tokens=e.stats.prompt_tokens, reused_tokens=e.stats.reused_tokens,
                          evictions=e.kv.pool.evictions, preemptions=e.stats.preemptions,
                          tier2_demotions=t2.tier2_demotions, tier2_reloads=t2.tier2_hits,
                          transfers=transfers, transfers_rejected=rejected)

    def _transfer_counts(self) -> tuple[int, int]:
        """(KV transfers this worker took part in, transfers it refused); none here."""
        return 0, 0

    def load_report(self) -> LoadReport:
        """KV events and ledger releases since the last report plus the load the router's
        policies look at, as of the last step; `busy_for_s` says how long the current step has
        run (a hung loop shows here, since this call never waits for the engine)."""
        with self._report_lock:
            events, self._events_out = self._events_out, []
            released, self._released_out = self._released_out, []
            snap = self._snapshot
            self._report_seq += 1
            seq = self._report_seq
        started, now = self._step_started, time.monotonic()
        return replace(snap, events=tuple(events), released=tuple(released), seq=seq,
                       busy_for_s=now - started if started is not None else 0.0,
                       age_s=max(0.0, now - snap.reported_at))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            done = self.engine.abort(request_id)
        q = self._queues.get(request_id)
        if q is not None:
            q.put(DONE)
        return done

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use stay); publishes an AllBlocksCleared event."""
        with self._lock:
            self.engine.reset_prefix_cache()

    def ping(self) -> str:
        return self.worker_id

    def tp_rank_pids(self) -> list[int]:
        """The pids of this TP worker's ranks 1..t-1 (none for one rank)."""
        group = self.engine.tp_group
        return [] if group is None else group.pids()[1:]

    def shutdown(self) -> None:
        self._stop = True
        self._work.set()


def prefilling(req: Any) -> bool:
    """Computing prompt tokens (a full prefix hit still computes its last prompt token)."""
    return req.is_prefill or not req.output_token_ids


def step_snapshot(engine: LLMEngine) -> list[tuple[Any, int, bool]]:
    """Before a step: (request, num_computed_tokens, is_prefill) of every scheduled request."""
    return [(r, r.num_computed_tokens, prefilling(r))
            for r in (*engine.view.running_requests(), *engine.view.waiting_requests())]


def observe_step(rates: StepRates, before: list[tuple[Any, int, bool]], seconds: float) -> None:
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


