"""How an HTTP request's answer leaves: one JSON document (collect) or an SSE stream, OpenAI's
shapes for completions and chat. A stream whose client stops reading for
`server.limits.write_timeout_s` is cut off (and its request aborted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ingress.errors import classify
from ingress.http_jobs import JobEvent, RequestJob, finish_reason


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


async def stream(request: Request, job: RequestJob, meta: dict, chat: bool,
                 include_usage: bool, write_timeout_s: float) -> Response:
    # Wait for the first event before answering, so that a request refused before any token
    # (bad prompt, over context, no capacity) gets its real status code.
    first = await next_or_abort(request, job)
    if first is None:
        return Response(status_code=499)
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list) -> str:
        return "data: " + json.dumps({**meta, "object": obj, "choices": choices,
                                      **extra}) + "\n\n"

    def choice(index: int, text: str | None, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}

    async def events() -> AsyncIterator[str]:
        try:
            if chat:
                for s in job.states:
                    yield chunk([choice(s.sub.index, "", None, role=True)])
            ev: JobEvent | None = first
            while ev is not None:
                if ev.kind == "delta":
                    ids = ev.payload.token_ids
                    if ev.payload.text or (job.return_token_ids and ids):
                        c = choice(ev.index, ev.payload.text, None)
                        if job.return_token_ids:
                            c["token_ids"] = list(ids)
                        yield chunk([c])
                elif ev.kind == "done":
                    c = choice(ev.index, None if chat else "", finish_reason(ev.payload))
                    if job.return_token_ids:
                        c["token_ids"] = []
                        c["raypd_lifecycle"] = ev.payload.lifecycle.to_dict()
                    yield chunk([c])
                else:
                    job.abort()
                    yield "data: " + json.dumps(classify(ev.payload).body()) + "\n\n"
                    break
                ev = await job.next() if job.pending else None
            else:
                if include_usage:
                    yield "data: " + json.dumps({**meta, "object": obj, "choices": [],
                                                 "usage": job.usage()}) + "\n\n"
            yield "data: [DONE]\n\n"
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
