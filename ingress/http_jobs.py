"""The sub-requests of one HTTP request, each an asyncio task on the serving loop (no thread).

Each sub-request awaits `backend.run_request_async`; its deltas go straight into a bounded
asyncio.Queue (the backend calls `on_delta` on this loop). A client that goes away, or one
that reads a stream so slowly that the queue fills (`server.limits.stream_queue_events`), aborts
every unfinished sub-request: their blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ingress.core import IngressCore, SubRequest
from ingress.errors import IngressError, classify
from protocol.errors import RequestAborted
from protocol.messages import RequestResult, TokenDelta

DISCONNECT_POLL_S = 0.25


@dataclass
class SubState:
    """A sub-request and what became of it."""

    sub: SubRequest
    done: bool = False
    cancelled: bool = False      # the client went away (or another sub-request failed)
    abort_sent: bool = False     # the backend acknowledged the abort
    result: RequestResult | None = None
    ttft_s: float | None = None


@dataclass
class JobEvent:
    index: int                   # the choice index
    kind: str                    # delta | done | error
    payload: Any = None


@dataclass
class RequestJob:
    """One HTTP request's sub-requests. `on_finish(job, state, status, result, error)` runs
    on the loop once per sub-request (timeline, metrics, capacity release)."""

    core: IngressCore
    states: list[SubState]
    tenant: str
    lora: str
    queue_events: int
    on_finish: Callable[..., None]
    return_token_ids: bool = False   # add token ids and the lifecycle record to each choice
    client_request_id: str = ""
    started: float = field(default_factory=time.perf_counter)
    arrival: float = field(default_factory=time.time)          # wall clock, for the timeline
    overflowed: bool = False
    _events: deque[JobEvent] = field(default_factory=deque)   # at most queue_events
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)  # one per sub-request
    _checked: float = field(default_factory=time.monotonic)   # last disconnect check

    def __post_init__(self) -> None:
        self.by_index = {s.sub.index: s for s in self.states}

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._run(st)) for st in self.states]

    def _enqueue(self, ev: JobEvent) -> None:
        """On the event loop: queue the event; a full queue cuts the client off."""
        if self.overflowed:
            return
        if len(self._events) >= self.queue_events:
            self.overflowed = True
            self.abort()
            return
        self._events.append(ev)
        self._ready.set()

    async def _run(self, st: SubState) -> None:
        sub = st.sub
        put = self._enqueue

        def on_delta(delta: TokenDelta) -> None:
            if st.ttft_s is None:
                st.ttft_s = time.perf_counter() - self.started
            if st.cancelled and not st.abort_sent:   # the abort raced its registration
                st.abort_sent = True
                self.core.abort(sub.request_id)
            put(JobEvent(sub.index, "delta", delta))

        status, result, error = 500, None, None
        try:
            if st.cancelled:
                raise RequestAborted(f"request {sub.request_id} was aborted")
            result = await self.core.run(sub, self.tenant, self.lora, on_delta)
            status = 200
            put(JobEvent(sub.index, "done", result))
        except BaseException as e:      # noqa: BLE001 - every failure goes to the client
            status = 499 if st.cancelled else classify(e).status
            error = f"{type(e).__name__}: {e}"
            put(JobEvent(sub.index, "error", e))
        finally:
            self.on_finish(self, st, status, result, error)

    @property
    def pending(self) -> int:
        return sum(not s.done for s in self.states)

    async def next(self, request: Request | None = None) -> JobEvent | None:
        """The next event; None if the client went away meanwhile (checked while waiting)."""
        while True:
            if self.overflowed:
                return JobEvent(-1, "error", IngressError(
                    503, f"stream cut off: the client did not read {self.queue_events} "
                    f"pending events", code="slow_client"))
            if request is not None and time.monotonic() - self._checked > DISCONNECT_POLL_S:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            if self._events:
                return self.take()
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                pass

    def peek(self) -> JobEvent | None:
        """The next event already queued, left in place (None: none yet)."""
        return self._events[0] if self._events else None

    def take(self) -> JobEvent:
        """The next queued event, taken (there must be one); a sub-request's end marks it."""
        ev = self._events.popleft()
        if ev.kind != "delta":
            st = self.by_index[ev.index]
            st.done = True
            if ev.kind == "done":
                st.result = ev.payload
        return ev

    def abort(self) -> None:
        """Abort every unfinished sub-request (client gone, or another one failed)."""
        for s in self.states:
            if not s.done and not s.cancelled:
                s.cancelled = True
                s.abort_sent = self.core.abort(s.sub.request_id)

    def usage(self) -> dict:
        prompt = cached = completion = 0
        for s in self.states:
            if s.result is None:
                continue
            lc = s.result.lifecycle
            completion += len(s.result.token_ids)
            if s.sub.first_of_prompt and lc is not None:
                prompt += lc.prompt_tokens
                cached += lc.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(result: RequestResult) -> str:
    return (result.lifecycle.finish_reason if result.lifecycle else None) or "stop"
