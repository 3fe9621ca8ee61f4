"""The router's fleet: which worker actors there are (by role), which take new requests, and
what each last reported.

A reporter thread polls every worker's `load_report` (KV events, load, handoff holds released)
every `report_interval_s`: the events go into the prefix index, the load into the worker's
WorkerState (what the policies see), the releases to `on_released`. A decode worker whose delta
stream is read pushes the same report on it instead (`apply_pushed`; router/streams.py), at
most one per interval while it steps and one a second while idle, and is not polled while its
last push is under PUSHED_FRESH_S old: a poll costs a Ray call on both sides (~1 ms of CPU on a
2-core machine, every interval). Reports are ordered by `seq`: an older one that arrives after
a newer one (a poll crossing a push) gives its events and releases, not its load.

A worker whose report does not come back within `health_timeout_s`, or whose engine step has
run longer than `hang_timeout_s`, is unhealthy: it gets no new requests and its prefix-index
entries are dropped, until it answers again. A worker whose incarnation changed was restarted
by Ray: its memory is gone (`on_restarted`). Membership changes (scale out, drain, remove) are
here too.

Torch-free; thread-safe (one lock for membership and states, one refresh at a time).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from protocol.messages import HoldRelease, LoadReport
from router.kv_timeline import KVTimeline
from router.policies import WorkerState
from router.prefix_index import ApproxPrefixIndex, PrefixIndex
from router.worker_view import REPORT_INTERVAL_S, apply_load_report

ROLES = ("prefill", "decode")
PUSHED_FRESH_S = 1.5    # a worker that pushed a report this recently is not polled (its
#                         stream pushes at least once a second: DecodeHost.deltas' wait_s)


class Fleet:
    """Worker actor handles by role and id, their WorkerStates, the prefix index, health."""

    def __init__(self, prefill: Sequence[Any], decode: Sequence[Any], *,
                 worker_ids: dict[Any, str] | None = None, index_mode: str = "precise",
                 report_interval_s: float = REPORT_INTERVAL_S, health_timeout_s: float = 10.0,
                 hang_timeout_s: float = 300.0,
                 on_released: Callable[[str, Sequence[HoldRelease]], None] | None = None,
                 on_restarted: Callable[[str], None] | None = None) -> None:
        self.report_interval_s = report_interval_s
        self.health_timeout_s = health_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self._on_released = on_released or (lambda wid, released: None)
        self._on_restarted = on_restarted or (lambda wid: None)
        self._workers: dict[str, list[Any]] = {"prefill": list(prefill), "decode": list(decode)}
        ids = worker_ids or {}
        every = self._workers["prefill"] + self._workers["decode"]
        self._id = {w: ids.get(w) or ray.get(w.ping.remote()) for w in every}
        self._by_id = {wid: w for w, wid in self._id.items()}
        self.index = PrefixIndex() if index_mode == "precise" else ApproxPrefixIndex()
        self.state: dict[str, WorkerState] = {wid: WorkerState(wid) for wid in self._by_id}
        self.draining: set[str] = set()          # worker ids: no new requests (scale-in)
        self.unhealthy: set[str] = set()         # worker ids that failed their last report
        self._incarnation: dict[str, str] = {}   # worker id -> incarnation last reported
        self._seq: dict[str, int] = {}           # worker id -> seq of the newest report applied
        self._pushed_at: dict[str, float] = {}   # worker id -> monotonic time of its last push
        self.lock = threading.RLock()            # membership, states, index (reentrant: a
        # prefill choice holds it across the local-prefill check and the policy's pick)
        self._refresh_lock = threading.Lock()    # one refresh at a time (the loop's, a drain's)
        self._report_refs: dict[Any, Any] = {}   # worker -> report still on its way
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self.timeline = KVTimeline()              # every report's pool, for reports and /api

    def start(self) -> None:
        """One refresh now, then the reporter thread."""
        self.refresh()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True,
                                          name="raypd-router-reports")
        self._reporter.start()

    # ---- who is there ----------------------------------------------------------------------------
    def workers(self, role: str) -> list[Any]:
        """Every worker of a role (healthy or not, draining or not)."""
        with self.lock:
            return list(self._workers[role])

    def role_of(self, worker_id: str) -> str:
        """"prefill" or "decode" ("?": not a member)."""
        w = self._by_id.get(worker_id)
        return next((r for r in ROLES if w in self._workers[r]), "?")

    def worker_id(self, worker: Any, default: str = "?") -> str:
        """The id of a worker actor handle."""
        return self._id.get(worker, default)

    def handle(self, worker_id: str) -> Any:
        """The actor handle of a worker id (KeyError: not a member)."""
        return self._by_id[worker_id]

    def takes_requests(self, worker_id: str) -> bool:
        return worker_id not in self.draining and worker_id not in self.unhealthy

    def live(self, role: str) -> list[Any]:
        """Workers of a role that take new requests (not draining, not unhealthy)."""
        with self.lock:
            return [w for w in self._workers[role] if self.takes_requests(self._id[w])]

    def states(self, role: str, exclude: frozenset = frozenset()) -> list[WorkerState]:
        """Under `lock`: the WorkerStates a policy picks a `role` worker from; `exclude` are
        worker ids this request already failed on (shown as draining)."""
        out = []
        for w in self._workers[role]:
            st = self.state[self._id[w]]
            st.draining = not self.takes_requests(st.worker_id) or st.worker_id in exclude
            out.append(st)
        return out

    # ---- membership (live scaling) ---------------------------------------------------------------
    def add_worker(self, role: str, worker: Any, worker_id: str) -> None:
        with self.lock:
            self._workers[role].append(worker)
            self._id[worker], self._by_id[worker_id] = worker_id, worker
            self.state[worker_id] = WorkerState(worker_id)

    def drain(self, worker_id: str) -> None:
        """Stop routing new requests to a worker; its requests in flight finish."""
        with self.lock:
            self.draining.add(worker_id)
            if worker_id in self.state:
                self.state[worker_id].draining = True

    def undrain(self, worker_id: str) -> None:
        """A draining worker takes new requests again (a scale-down called off)."""
        with self.lock:
            self.draining.discard(worker_id)
            if worker_id in self.state:
                self.state[worker_id].draining = worker_id in self.unhealthy

    def remove_worker(self, worker_id: str) -> Any:
        """Forget a worker (drained, or dead); returns its handle."""
        with self.lock:
            w = self._by_id.pop(worker_id)
            del self._id[w]
            for group in self._workers.values():
                if w in group:
                    group.remove(w)
            self.state.pop(worker_id, None)
            self._seq.pop(worker_id, None)
            self._pushed_at.pop(worker_id, None)
            self.draining.discard(worker_id)
            self.unhealthy.discard(worker_id)
            self.index.remove_worker(worker_id)
            return w

    # ---- reports ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pull every worker's KV events and load once; mark silent or dead workers unhealthy.

        An unhealthy worker gets no new requests and its prefix-index entries are dropped
        (a restarted actor comes back with an empty cache); it is healthy again once it
        answers."""
        with self._refresh_lock:
            self._refresh()

    def _refresh(self) -> None:
        # a report that did not come back in time is still on its way, carrying KV events
        # and hold releases the worker has handed over: wait for that one, never drop it
        pending = self._report_refs
        now = time.monotonic()
        with self.lock:
            workers = [w for w, wid in self._id.items() if w in pending or
                       now - self._pushed_at.get(wid, -math.inf) >= PUSHED_FRESH_S]
        if not workers:
            return
        refs = {pending[w] if w in pending else w.load_report.remote(): w for w in workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.health_timeout_s)
        reports, failed = [], [w for r, w in refs.items() if r not in ready]
        self._report_refs = {w: r for r, w in refs.items() if r not in ready}
        for r in ready:
            try:
                reports.append(ray.get(r))
            except Exception:
                failed.append(refs[r])
        with self.lock:
            for w in failed:
                wid = self._id.get(w)
                if wid is not None and wid not in self.unhealthy:
                    self.unhealthy.add(wid)
                    self.index.remove_worker(wid)
            for rep in reports:
                self._apply_report(rep)

    def apply_pushed(self, rep: LoadReport) -> None:
        """A report a worker pushed on its delta stream (the reader thread calls this)."""
        with self.lock:
            if rep.worker_id not in self._by_id:     # removed meanwhile
                return
            self._pushed_at[rep.worker_id] = time.monotonic()
            self._apply_report(rep)

    def stream_lost(self, worker_id: str) -> None:
        """A worker's delta stream broke: poll it again from the next refresh on."""
        with self.lock:
            self._pushed_at.pop(worker_id, None)

    def _apply_report(self, rep: LoadReport) -> None:
        """Under the lock: one worker's report into the index, its state and the ledger."""
        wid = rep.worker_id
        if rep.released:                  # holds the worker let go on its own (lease expiry)
            self._on_released(wid, rep.released)
        if self._incarnation.setdefault(wid, rep.incarnation) != rep.incarnation:
            self._incarnation[wid] = rep.incarnation      # restarted: its memory is gone
            self._seq.pop(wid, None)                      # and its count starts again
            self._on_restarted(wid)
        stale = rep.seq < self._seq.get(wid, 0)   # a newer report was applied already
        if not stale:
            self._seq[wid] = rep.seq
        if wid not in self.state:         # removed meanwhile
            return
        if isinstance(self.index, PrefixIndex):
            self.index.apply(wid, rep.events)
        if stale:                         # its events count; its load is older than ours
            return
        self.timeline.record(self.role_of(wid), rep)
        if rep.busy_for_s > self.hang_timeout_s:   # alive, but its engine is stuck
            self.unhealthy.add(wid)
            self.state[wid].draining = True
            return
        self.unhealthy.discard(wid)
        st = self.state[wid]
        apply_load_report(st, rep, time.monotonic())
        st.draining = not self.takes_requests(wid)

    def _report_loop(self) -> None:
        while not self._stop.wait(self.report_interval_s):
            self.refresh()

    def close(self, wait_s: float | None = None) -> None:
        """Stop the reporter. With `wait_s`, also wait (that long at most) until it has made its
        last Ray call: a Ray call after ray.shutdown() would start a new local Ray."""
        self._stop.set()
        if wait_s is not None and self._reporter is not None \
                and self._reporter is not threading.current_thread():
            self._reporter.join(wait_s)
