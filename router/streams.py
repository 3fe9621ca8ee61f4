"""The router's end of the decode workers' delta streams: one reader task per decode worker, on
the router's loop, consumes its `deltas` stream (one Ray item per message, each carrying every
request's new tokens of a step) and hands each request's deltas to that request's inbox, an
asyncio queue its request's coroutine awaits. So a token costs no Ray call of its own, no
thread, and one loop wake-up per message for all the requests it carries.

A worker that dies ends every inbox it feeds with `WorkerGone` (the request's attempt fails and
is retried elsewhere); the reader subscribes again once the worker is back (Ray restarts it), or
stops when the worker left the fleet. The stream also carries the worker's load report (at
most one per report interval), which the fleet takes instead of calling the worker for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from protocol.messages import LoadReport, RequestDelta

RESUBSCRIBE_S = 0.5     # between tries to read a restarting worker's stream again
log = logging.getLogger(__name__)


class WorkerGone:
    """An inbox item: the worker feeding it died (or its stream broke)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DeltaStreams:
    """Invariant: every method but `close_all` runs on the router's loop (no locks needed)."""

    def __init__(self, is_member: Callable[[str], bool],
                 on_report: Callable[[LoadReport], None] | None = None,
                 report_every_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        """With `on_report`, each stream carries its worker's load report at most every
        `report_every_s` (DecodeHost.deltas), handed to `on_report` by the reader;
        `on_lost(worker_id)` runs when a stream breaks, before its requests hear of it."""
        self._is_member = is_member               # worker id -> still in the fleet
        self._on_report = on_report
        self._on_lost = on_lost or (lambda worker_id: None)
        self._report_every_s = report_every_s if on_report is not None else None
        self._inboxes: dict[tuple[str, str], asyncio.Queue] = {}
        self._readers: dict[str, asyncio.Task] = {}
        self._stopped = False

    def open(self, worker: Any, worker_id: str, worker_request_id: str) -> asyncio.Queue:
        """The inbox of one request attempt on `worker` (open it before the request can
        produce tokens there: before its admission)."""
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[(worker_id, worker_request_id)] = inbox
        reader = self._readers.get(worker_id)
        if (reader is None or reader.done()) and not self._stopped:
            self._readers[worker_id] = asyncio.get_running_loop().create_task(
                self._read(worker, worker_id), name=f"raypd-deltas-{worker_id}")
        return inbox

    def close(self, worker_id: str, worker_request_id: str) -> None:
        self._inboxes.pop((worker_id, worker_request_id), None)

    async def _read(self, worker: Any, worker_id: str) -> None:
        while not self._stopped and self._is_member(worker_id):
            try:
                async for ref in worker.deltas.remote(report_every_s=self._report_every_s):
                    batch = await ref
                    if self._stopped:
                        return
                    if batch.report is not None:
                        self._report(batch.report)
                    for d in batch.deltas:
                        inbox = self._inboxes.get((worker_id, d.worker_request_id))
                        if inbox is not None:
                            inbox.put_nowait(d)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001 - the worker died, restarts or was removed
                self._on_lost(worker_id)     # its reports come by polls again: a retry that
                # refreshes the fleet then sees it gone
                self._fail_all(worker_id, f"{type(e).__name__}: {e}"[:300])
            await asyncio.sleep(RESUBSCRIBE_S)

    def _report(self, report: LoadReport) -> None:
        try:
            self._on_report(report)
        except Exception:   # noqa: BLE001 - a report the fleet cannot take: the tokens go on
            log.exception("load report pushed by %s not applied", report.worker_id)

    def _fail_all(self, worker_id: str, reason: str) -> None:
        for (wid, _), q in list(self._inboxes.items()):
            if wid == worker_id:
                q.put_nowait(WorkerGone(reason))

    def close_all(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Stop the readers (a Ray call after ray.shutdown() would start a new local Ray);
        from any thread, given the loop they run on."""
        self._stopped = True

        def cancel() -> None:
            for t in self._readers.values():
                t.cancel()
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(cancel)
        except RuntimeError:
            pass


InboxItem = RequestDelta | WorkerGone
