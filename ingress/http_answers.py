"""How an HTTP request's answer leaves: one JSON document (collect) or an SSE stream, OpenAI's
shapes for completions and chat. A stream whose client stops reading for
`server.limits.write_timeout_s` is cut off (and its request aborted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ingress.errors import classify
from ingress.http_jobs import JobEvent, RequestJob, finish_reason
from protocol.messages import TokenDelta


def error_response(exc: BaseException) -> JSONResponse:
    err = classify(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def next_or_abort(request: Request, job: RequestJob) -> JobEvent | None:
    """The job's next event; None when the client is gone. An error event raises its error;
    whatever is raised here aborts the job first."""
    try:
        ev = await job.next(request)
        if ev is None:                           # client gone: nobody to answer
            job.abort()
        elif ev.kind == "error":
            raise classify(ev.payload)
        return ev
    except BaseException:
        job.abort()
        raise


async def collect(request: Request, job: RequestJob, meta: dict, chat: bool) -> Response:
    while job.pending:
        if await next_or_abort(request, job) is None:
            return Response(status_code=499)
    choices = []
    for s in sorted(job.states, key=lambda s: s.sub.index):
        text, reason = s.result.text, finish_reason(s.result)
        if chat:
            c = {"index": s.sub.index, "logprobs": None, "finish_reason": reason,
                 "message": {"role": "assistant", "content": text}}
        else:
            c = {"index": s.sub.index, "text": text, "logprobs": None, "finish_reason": reason}
        if job.return_token_ids:
            c["token_ids"] = list(s.result.token_ids)
            c["raypd_lifecycle"] = s.result.lifecycle.to_dict()
        choices.append(c)
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": choices, "usage": job.usage()},
                        headers={"X-Request-Id": meta["id"]})


class ChunkEncoder:
    """SSE events of one answer, as bytes. A text delta (the hot path: one per event a token)
    fills a chunk template prebuilt for the answer, so only the text is JSON-encoded (orjson);
    every other event is encoded whole."""

    def __init__(self, meta: dict, chat: bool, include_usage: bool) -> None:
        self.chat = chat
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = {**meta, "object": self.obj}
        self.extra = {"usage": None} if include_usage else {}
        whole = orjson.dumps({**self.head, "choices": [0], **self.extra})
        before, after = whole.split(b"[0]", 1)
        self._pre = b"data: " + before + b'[{"index":'
        self._mid = b',"delta":{"content":' if chat else b',"text":'
        self._post = (b'},"logprobs":null,"finish_reason":null}]' if chat else
                      b',"logprobs":null,"finish_reason":null}]') + after + b"\n\n"

    def text(self, index: int, text: str) -> bytes:
        return b"".join((self._pre, str(index).encode(), self._mid, orjson.dumps(text),
                         self._post))

    def chunk(self, choices: list, **fields) -> bytes:
        return b"data: " + orjson.dumps({**self.head, "choices": choices, **self.extra,
                                         **fields}) + b"\n\n"

    def choice(self, index: int, text: str | None, reason: str | None,
               role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}


def coalesce(ev: JobEvent, job: RequestJob) -> JobEvent:
    """`ev` with the same choice's deltas already queued behind it folded in: a client that
    reads slower than tokens come gets one event for all its pending tokens."""
    if ev.kind != "delta":
        return ev
    texts, ids = [ev.payload.text], list(ev.payload.token_ids)
    while (nxt := job.peek()) is not None and nxt.kind == "delta" and nxt.index == ev.index:
        job.take()
        texts.append(nxt.payload.text)
        ids.extend(nxt.payload.token_ids)
    if len(texts) == 1:
        return ev
    return JobEvent(ev.index, "delta", TokenDelta(tuple(ids), "".join(texts)))


async def stream(request: Request, job: RequestJob, meta: dict, chat: bool,
                 include_usage: bool, write_timeout_s: float) -> Response:
    # Wait for the first event before answering, so that a request refused before any token
    # (bad prompt, over context, no capacity) gets its real status code.
    first = await next_or_abort(request, job)
    if first is None:
        return Response(status_code=499)
    enc = ChunkEncoder(meta, chat, include_usage)

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                for s in job.states:
                    yield enc.chunk([enc.choice(s.sub.index, "", None, role=True)])
            ev: JobEvent | None = first
            while ev is not None:
                ev = coalesce(ev, job)
                if ev.kind == "delta":
                    ids, text = ev.payload.token_ids, ev.payload.text
                    if job.return_token_ids and ids:
                        c = enc.choice(ev.index, text, None)
                        c["token_ids"] = list(ids)
                        yield enc.chunk([c])
                    elif text:
                        yield enc.text(ev.index, text)
                elif ev.kind == "done":
                    c = enc.choice(ev.index, None if chat else "", finish_reason(ev.payload))
                    if job.return_token_ids:
                        c["token_ids"] = []
                        c["raypd_lifecycle"] = ev.payload.lifecycle.to_dict()
                    yield enc.chunk([c])
                else:
                    job.abort()
                    yield b"data: " + orjson.dumps(classify(ev.payload).body()) + b"\n\n"
                    break
                ev = await job.next() if job.pending else None
            else:
                if include_usage:
                    yield enc.chunk([], usage=job.usage())
            yield b"data: [DONE]\n\n"
        finally:
            job.abort()          # no-op when everything finished

    return SSEResponse(events(), write_timeout_s, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                "X-Request-Id": meta["id"]})


class SSEResponse(StreamingResponse):
    """A stream whose generator is always closed (its `finally` aborts the request), also when
    the send fails because the client went away or stopped reading."""

    def __init__(self, content, write_timeout_s: float, **kw) -> None:
        super().__init__(content, **kw)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            await asyncio.wait_for(send(message), self.write_timeout_s)
        try:
            await super().stream_response(timed_send)
        finally:
            await self.body_iterator.aclose()
