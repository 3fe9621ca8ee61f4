"""uvicorn for the HTTP app, on uvloop and httptools, with the transport limits of
`server.limits`: a connection that has not sent its request line and headers within
`header_timeout_s` is closed (slow-loris), more than `max_connections` connections or requests at
once get 503, and an answer that closes the connection before the request's body has arrived
(413, 408: ingress/body.py) closes it lingeringly, as nginx does, so the client reads it.

Lingering close: the answer is written, the write side shut (the client sees the end of the
answer), and the rest of the body read and dropped until the client closes, or `LINGER_BYTES`
more arrived, or `LINGER_S` passed; then the connection closes. Closing at once with unread
bytes in the socket makes the kernel send a reset, and a client still sending its body (urllib,
http.client) then sees "connection reset" instead of the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ingress.limits import IngressLimits

try:
    import uvloop
except ImportError:          # pragma: no cover - a declared dependency; asyncio's loop then
    uvloop = None

LINGER_BYTES = 32 << 20      # body bytes read and dropped after a closing answer, at most
LINGER_S = 10.0              # ... and for at most this long


class _CycleTransport:
    """The transport as one request/response cycle sees it: its close() is the connection's
    lingering close; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, close: Any) -> None:
        self._transport = transport
        self._close = close

    def close(self) -> None:
        self._close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def header_timeout_protocol(timeout_s: float, linger_bytes: int = LINGER_BYTES,
                            linger_s: float = LINGER_S) -> type[asyncio.Protocol]:
    """HttpToolsProtocol that closes a connection whose request head takes longer than
    timeout_s (armed at connect and again whenever a new request starts arriving), and closes
    lingeringly (at most linger_bytes, linger_s) when an answer closes the connection while its
    request's body is still arriving."""

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _lingering = False        # answered and closing: incoming bytes are dropped, unparsed
        _linger_left = 0
        _body_done = True         # the parser's latest request has been read to its end

        # ---- slow-loris: the request head within timeout_s ----
        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                self._linger_left -= len(data)
                if self._linger_left < 0:
                    self.transport.close()
                return
            if self._idle():
                self._arm()
            super().data_received(data)
            if not self._idle():
                self._disarm()

        # ---- the request's body: read to its end, or not yet ----
        def on_message_begin(self) -> None:
            self._body_done = False
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._body_done = True
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            if self.cycle is not None:
                self.cycle.transport = _CycleTransport(self.transport, self._close_lingering)

        # ---- lingering close ----
        def _close_lingering(self) -> None:
            """Close now when the request was read to its end; else shut the write side and
            drop what still arrives, within linger_bytes and linger_s."""
            if self._body_done or self._lingering or self.transport.is_closing():
                self.transport.close()
                return
            self._lingering = True
            self._linger_left = linger_bytes
            self._disarm()
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._linger_timer = self.loop.call_later(linger_s, self.transport.close)

        def on_response_complete(self) -> None:
            if self._lingering:       # no keep-alive, no pipelined request: the close is under way
                self.server_state.total_requests += 1
                return
            super().on_response_complete()      # keep-alive timer guards the idle time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


def uvicorn_config(app: Any, host: str, port: int, limits: IngressLimits,
                   log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          loop="uvloop" if uvloop is not None else "asyncio",
                          timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(limits.header_timeout_s),
                          limit_concurrency=limits.max_connections, timeout_keep_alive=5)
