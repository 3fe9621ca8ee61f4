"""PrefillHost, the prefill worker actor: computes what its prefix cache lacks of a prompt,
samples the first token, and stages exactly the blocks of D's transfer plan under a lease (with
a checksum per page); D pulls them, and P's ack (after D's first token) drops the staged copy.
"""

from __future__ import annotations

import queue
import time
from dataclasses import asdict, replace
from typing import Any

import ray

from kvtransfer import rdt
from kvtransfer.endpoint import KVProducer
from protocol.errors import RequestError
from protocol.ledger import ACKED
from protocol.messages import AdmittedRequest, PrefillResult, TransferPlan
from protocol.request_trace import PrefillTiming  # trace hook
from workers.engine import StepOutput
from workers.host import DONE, EngineHost, actor_options
from workers.kv_handoff import stage_plan


class PrefillHost(EngineHost):
    role = "prefill"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        # the handoff's page checksums are end to end (P computes them, D verifies them once):
        # a transport checksum of the same bytes on top would be a second pass on each side
        self.producer = KVProducer(self.transport_name, kw.get("lease_s", 30.0),
                                   **{"checksum": False, **self._transport_cfg})
        self._plans: dict[str, TransferPlan] = {}   # worker request id -> plan to stage
        self._start_loop()

    def _housekeeping(self) -> None:
        self.producer.expire()

    def prefill(self, admitted: AdmittedRequest, plan: TransferPlan) -> PrefillResult:
        """Compute the prompt's KV (reusing this worker's prefix cache), sample the first token,
        and stage exactly the plan's blocks under a lease.

        The loop thread stages the plan right after the step that finished the prefill
        (`_after_step`), before its next step: staging here would wait for the engine lock
        until that next step ended, so a short prompt's TTFT would include the whole of the
        next prompt's prefill step."""
        assert plan.request_id == admitted.request_id and plan.epoch == admitted.epoch
        with self._call_lock():
            req = self.engine.handoff.admitted_request(admitted, max_tokens=1)
            req.hold_kv = True
            q = self._open_queue(req.request_id)
            self._plans[req.request_id] = plan
            self.engine.add_request(request=req, prompt=None)
        self._work.set()
        result: PrefillResult | None = None
        try:
            while (item := self._next(q, max(0.0, admitted.deadline - time.time()))) \
                    is not DONE:
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
                self.engine.handoff.release(req.request_id)
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

    def _stage(self, req: Any, plan: TransferPlan, corrupt: bool = False) -> PrefillResult:
        """Under the lock: stage `plan` of the finished prefill `req` (`corrupt`: workers/faults.py
        flips bytes of the staged copy after its checksums were taken)."""
        return stage_plan(self.engine, self.producer, self.ledger, self.worker_id, req, plan,
                          req.output_token_ids[0], corrupt=corrupt)

    def _drop(self, request_id: str, q: queue.Queue | None = None) -> None:
        """A prefill given up: end it if it still runs, free its blocks even when it had
        finished meanwhile (a `hold_kv` request keeps its blocks until released), and end a
        staging the loop made that nobody will hand on (its result still in `q`)."""
        with self._lock:
            self._plans.pop(request_id, None)     # the loop stages nothing for it from now
            self.engine.abort(request_id)
            self.engine.handoff.release(request_id)
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
        "ended" when it had ended on its own. The staged copy is not the engine's: no engine
        lock (it is held through every step; the request's end waits for this)."""
        if self.producer.ack(transfer_id):
            return ACKED
        return "ended"

    def abort_transfer(self, transfer_id: str) -> bool:
        return self.producer.abort(transfer_id)     # the lease table has its own lock

    def expire_leases(self) -> list[str]:
        return self.producer.expire()

    def _transfer_counts(self) -> tuple[int, int]:
        return self.producer.stats().offered, 0

    def stats(self) -> dict:
        d = super().stats()
        d.update({f"transfer_{k}": v for k, v in asdict(self.producer.stats()).items()})
        d.update({f"ledger_{k}": v for k, v in self.ledger.counters().items()})
        return d




def prefill_actor_class(host: type = PrefillHost, **options):
    """The Ray actor class of a prefill worker (`host`: PrefillHost, or a subclass of it)."""
    return ray.remote(enable_tensor_transport=True, **actor_options(options))(host)
