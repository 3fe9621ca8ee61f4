"""uvicorn for the HTTP app, with the transport limits of `server.limits`: a connection that has
not sent its request line and headers within `header_timeout_s` is closed (slow-loris), and
more than `max_connections` connections or requests at once get 503."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ingress.limits import IngressLimits


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """H11Protocol that closes a connection whose request head takes longer than timeout_s
    (armed at connect and again whenever a new request starts arriving)."""

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

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
            if self._idle():
                self._arm()
            super().data_received(data)
            if not self._idle():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()      # keep-alive timer guards the idle time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


def uvicorn_config(app: Any, host: str, port: int, limits: IngressLimits,
                   log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(limits.header_timeout_s),
                          limit_concurrency=limits.max_connections, timeout_keep_alive=5)
