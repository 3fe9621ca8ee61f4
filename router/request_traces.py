"""The router's per-request handoff traces: a bounded store of the last N `RequestTrace`s, the
hooks the orchestrator calls as a request goes (one line each), and the stage breakdown
(p50/p99 of each stage over many traces) for reports and the dashboard.

    traces = TraceStore(capacity=1000)
    traces.start(rid); traces.routed(rid, "decode-0"); ...; traces.finish(rid, 200)
    traces.get(rid) -> RequestTrace | None;  stage_breakdown(traces.recent()) -> {stage: {...}}

Every hook is a no-op for an id the store does not know (evicted, or never started), and never
raises into the request path: tracing cannot fail a request. Torch-free, Ray-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from protocol.request_trace import ROUTER, STAGES, PrefillTiming, RequestTrace
from router.percentiles import percentiles

DEFAULT_CAPACITY = 1000
log = logging.getLogger(__name__)


class TraceStore:
    """The last `capacity` requests' traces, by request id (oldest evicted first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock=time.time,
                 on_finish: Callable[[RequestTrace], None] | None = None) -> None:
        """`on_finish(trace)` runs once per finished request, outside the lock (the router's
        metrics: stage histograms, per-pair transfer); its errors are logged, never raised."""
        assert capacity >= 1
        self.capacity = capacity
        self.clock = clock
        self.on_finish = on_finish
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._open: dict[str, dict[str, float]] = {}    # rid -> stage -> start (in flight)
        self._lock = threading.Lock()

    # ---- hooks (orchestrator) -----------------------------------------------------------------
    def start(self, rid: str) -> None:
        with self._lock:
            self._traces[rid] = RequestTrace(rid, arrival=self.clock())
            self._traces.move_to_end(rid)
            self._open[rid] = {}
            while len(self._traces) > self.capacity:
                old, _ = self._traces.popitem(last=False)
                self._open.pop(old, None)

    def routed(self, rid: str, decode_worker: str) -> None:
        """The policy chose D: the route stage ends, admission starts."""
        now = self.clock()
        with self._lock:
            if (t := self._traces.get(rid)) is None:
                return
            if t.routed_at is None:
                t.routed_at = now
                t.span("route", ROUTER, t.arrival, now)
            self._open[rid].setdefault("admit", now)

    def admitted(self, rid: str, decode_worker: str, local: bool) -> None:
        now = self.clock()
        with self._lock:
            if (t := self._traces.get(rid)) is None:
                return
            start = self._open.get(rid, {}).pop("admit", t.routed_at or t.arrival)
            t.admitted_at, t.decode_worker, t.local_prefill = now, decode_worker, local
            t.span("admit", decode_worker, start, now)

    def prefilled_locally(self, rid: str) -> None:
        """Its decode worker prefills it (no prefill worker left, or the pool's backlog)."""
        with self._lock:
            if (t := self._traces.get(rid)) is not None:
                t.local_prefill = True

    def prefilled(self, rid: str, prefill_worker: str, timing: PrefillTiming | None) -> None:
        """P answered; `timing` is what it measured (None from a worker that does not say)."""
        now = self.clock()
        with self._lock:
            if (t := self._traces.get(rid)) is None:
                return
            t.prefill_worker = prefill_worker
            if timing is not None:
                t.add_prefill(prefill_worker, timing, sent=t.admitted_at or now, answered=now)
            self._open.setdefault(rid, {})["transfer"] = now

    def transferred(self, rid: str, decode_worker: str, result: Any = None) -> None:
        """D has the pages (`result`: D's receive answer, for the byte count)."""
        now = self.clock()
        with self._lock:
            if (t := self._traces.get(rid)) is None:
                return
            start = self._open.get(rid, {}).pop("transfer", now)
            t.span("transfer", decode_worker, start, now)
            if isinstance(result, dict):
                t.transfer_bytes += int(result.get("transfer_bytes") or 0)

    def add_transfer_bytes(self, rid: str, n: int) -> None:
        with self._lock:
            if (t := self._traces.get(rid)) is not None:
                t.transfer_bytes += int(n)

    def tokens(self, rid: str, n: int) -> None:
        now = self.clock()
        with self._lock:
            if (t := self._traces.get(rid)) is not None and n > 0:
                t.add_tokens(n, now)

    def retried(self, rid: str) -> None:
        with self._lock:
            if (t := self._traces.get(rid)) is not None:
                t.attempts += 1

    def finish(self, rid: str, status: int) -> None:
        now = self.clock()
        with self._lock:
            self._open.pop(rid, None)
            if (t := self._traces.get(rid)) is None or t.finished_at is not None:
                return
            t.finish(status, now)
        if self.on_finish is not None:
            try:
                self.on_finish(t)
            except Exception:   # noqa: BLE001 - tracing never fails a request
                log.exception("trace on_finish failed for %s", rid)

    # ---- read ---------------------------------------------------------------------------------
    def get(self, rid: str) -> RequestTrace | None:
        with self._lock:
            return self._traces.get(rid)

    def recent(self, n: int | None = None) -> list[RequestTrace]:
        """Finished traces, oldest first (the last `n` when given)."""
        with self._lock:
            done = [t for t in self._traces.values() if t.finished_at is not None]
        return done[-n:] if n else done

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)


def stage_breakdown(traces: Iterable[RequestTrace], ok_only: bool = True) -> dict[str, dict]:
    """Per stage (in STAGES order, only those that occurred): p50/p90/p99/mean seconds and the
    number of requests that had it; plus `ttft` and `e2e` over the same requests."""
    rows = [t for t in traces if not ok_only or t.status == 200]
    per: dict[str, list[float]] = {s: [] for s in STAGES}
    for t in rows:
        for stage, secs in t.stage_seconds().items():
            per[stage].append(secs)
    out = {s: percentiles(v) for s, v in per.items() if v}
    out["ttft"] = percentiles([t.ttft_s for t in rows])
    out["e2e"] = percentiles([t.e2e_s for t in rows])
    return out
