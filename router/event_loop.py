"""The router's one event loop: every request's flow runs on it (Ray refs awaited, no thread
per request), and the ingresses serve on it too (cluster/serve.py), so a token costs no thread
hop between the router and the client's stream. uvloop's loop when it is installed.

    loop = RouterLoop()            # its thread runs the loop until close()
    loop.run(coro)                 # from any other thread: block for the coroutine's result
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class RouterLoop:
    """An event loop running in its own daemon thread ("raypd-router-loop")."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_forever()
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True, name="raypd-router-loop")
        self.thread.start()
        started.wait()

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self.thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (never from the loop's own thread:
        that would wait forever)."""
        if self.on_loop():
            coro.close()
            raise RuntimeError("RouterLoop.run called on the router loop: await it instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn, *args) -> None:
        """Run `fn(*args)` on the loop, from any thread (a no-op once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def close(self, wait_s: float | None = 5.0) -> None:
        """Stop the loop (tasks still pending are dropped) and wait for its thread."""
        if self.loop.is_closed():
            return
        self.call_soon(self.loop.stop)
        if not self.on_loop():
            self.thread.join(wait_s)
