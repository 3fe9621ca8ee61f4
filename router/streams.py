"""The router's end of the decode workers' delta streams: one reader thread per decode worker
consumes its `deltas` stream (one Ray item per message, each carrying every request's new
tokens of a step) and hands each request's deltas to that request's inbox, a local queue its
request thread waits on. So a token costs no Ray call of its own, and a request thread never
waits on Ray for its tokens.

A worker that dies ends every inbox it feeds with `WorkerGone` (the request's attempt fails and
is retried elsewhere); the reader subscribes again once the worker is back (Ray restarts it), or
stops when the worker left the fleet.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import ray

from protocol.messages import RequestDelta

RESUBSCRIBE_S = 0.5     # between tries to read a restarting worker's stream again


class WorkerGone:
    """An inbox item: the worker feeding it died (or its stream broke)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DeltaStreams:
    def __init__(self, is_member: Callable[[str], bool]) -> None:
        self._is_member = is_member               # worker id -> still in the fleet
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
                for ref in worker.deltas.remote():
                    if self._stop.is_set():
                        return
                    batch = ray.get(ref)
                    with self._lock:
                        for d in batch.deltas:
                            inbox = self._inboxes.get((worker_id, d.worker_request_id))
                            if inbox is not None:
                                inbox.put(d)
            except Exception as e:   # noqa: BLE001 - the worker died, restarts or was removed
                self._fail_all(worker_id, f"{type(e).__name__}: {e}"[:300])
            if self._stop.wait(RESUBSCRIBE_S):
                return

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
