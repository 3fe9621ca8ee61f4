"""The router's end of the decode workers' delta streams: one reader thread per decode worker
consumes its `deltas` stream (one Ray item per message, each carrying every request's new
tokens of a step) and hands each request's deltas to that request's inbox, a local queue its
request thread waits on. So a token costs no Ray call of its own, and a request thread never
waits on Ray for its tokens.

A worker that dies ends every inbox it feeds with `WorkerGone` (the request's attempt fails and
is retried elsewhere); the reader subscribes again once the worker is back (Ray restarts it), or
stops when the worker left the fleet. The stream also carries the worker's load report (at
most one per report interval), which the fleet takes instead of calling the worker for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import ray

from protocol.messages import LoadReport, RequestDelta

RESUBSCRIBE_S = 0.5     # between tries to read a restarting worker's stream again
log = logging.getLogger(__name__)


class WorkerGone:
    """An inbox item: the worker feeding it died (or its stream broke)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DeltaStreams:
    def __init__(self, is_member: Callable[[str], bool],
                 on_report: Callable[[LoadReport], None] | None = None,
                 report_every_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        """With `on_report`, each stream carries its worker's load report at most every
        `report_every_s` (DecodeHost.deltas), handed to `on_report` by the reader thread;
        `on_lost(worker_id)` runs when a stream breaks, before its requests hear of it."""
        self._is_member = is_member               # worker id -> still in the fleet
        self._on_report = on_report
        self._on_lost = on_lost or (lambda worker_id: None)
        self._report_every_s = report_every_s if on_report is not None else None
        self._lock = threading.Lock()
        self._inboxes: dict[tuple[str, str], queue.SimpleQueue] = {}
        self._readers: dict[str, threading.Thread] = {}
        self._stop = threading.Event()

    def open(self, worker: Any, worker_id: str, worker_request_id: str) -> queue.SimpleQueue:
        """The inbox of one request attempt on `worker` (open it before the request can
        produce tokens there: before its admission)."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._inboxes[(worker_id, worker_request_id)] = inbox
            reader = self._readers.get(worker_id)
            if reader is None or not reader.is_alive():
                reader = threading.Thread(target=self._read, args=(worker, worker_id),
                                          daemon=True, name=f"raypd-deltas-{worker_id}")
                self._readers[worker_id] = reader
                reader.start()
        return inbox

    def close(self, worker_id: str, worker_request_id: str) -> None:
        with self._lock:
            self._inboxes.pop((worker_id, worker_request_id), None)

    def _read(self, worker: Any, worker_id: str) -> None:
        while not self._stop.is_set() and self._is_member(worker_id):
            try:
                for ref in worker.deltas.remote(report_every_s=self._report_every_s):
                    if self._stop.is_set():
                        return
                    batch = ray.get(ref)
                    if batch.report is not None:
                        self._report(batch.report)
                    with self._lock:
                        for d in batch.deltas:
                            inbox = self._inboxes.get((worker_id, d.worker_request_id))
                            if inbox is not None:
                                inbox.put(d)
            except Exception as e:   # noqa: BLE001 - the worker died, restarts or was removed
                self._on_lost(worker_id)     # its reports come by polls again: a retry that
                # refreshes the fleet then sees it gone
                self._fail_all(worker_id, f"{type(e).__name__}: {e}"[:300])
            if self._stop.wait(RESUBSCRIBE_S):
                return

    def _report(self, report: LoadReport) -> None:
        try:
            self._on_report(report)
        except Exception:   # noqa: BLE001 - a report the fleet cannot take: the tokens go on
            log.exception("load report pushed by %s not applied", report.worker_id)

    def _fail_all(self, worker_id: str, reason: str) -> None:
        with self._lock:
            inboxes = [q for (wid, _), q in self._inboxes.items() if wid == worker_id]
        for q in inboxes:
            q.put(WorkerGone(reason))

    def close_all(self, wait_s: float | None = None) -> None:
        """Stop the readers (a Ray call after ray.shutdown() would start a new local Ray)."""
        self._stop.set()
        if wait_s is not None:
            for t in list(self._readers.values()):
                if t is not threading.current_thread():
                    t.join(wait_s)


InboxItem = RequestDelta | WorkerGone
