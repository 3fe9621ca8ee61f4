"""A request's body, read within `server.limits`: 413 past `max_body_bytes` (declared or sent),
408 past `body_timeout_s`, 400 for a Content-Length that is not a number of bytes.

Each refusal is made before the whole body has arrived, so it closes the connection
(`Connection: close`): the rest of the body cannot be told from a next request, and the server
closes lingeringly (ingress/http_server.py), reading and dropping a bounded amount of what still
arrives, so that a client still sending (urllib, http.client) reads the answer, not a reset.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from ingress.errors import IngressError

CLOSE = {"Connection": "close"}    # the headers of an answer given before the body was read


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body: 413 past `max_bytes` (declared or sent), 408 past `timeout_s`, 400 for a
    Content-Length that is not a number; each refusal closes the connection (lingeringly)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise IngressError(400, "Content-Length: must be a number of bytes", headers=CLOSE)
        if int(declared) > max_bytes:
            raise IngressError(413, f"request body of {declared} bytes; at most {max_bytes} "
                               f"(server.limits.max_body_bytes)", code="body_too_large",
                               headers=CLOSE)
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise IngressError(413, f"request body over {max_bytes} bytes "
                                   f"(server.limits.max_body_bytes)", code="body_too_large",
                                   headers=CLOSE)
            chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise IngressError(408, f"request body not received within {timeout_s:g} s "
                           f"(server.limits.body_timeout_s)", code="body_timeout",
                           headers=CLOSE) from None
    return b"".join(chunks)
