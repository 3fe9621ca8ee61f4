"""The HTTP server under the app (ingress/http_server.py), on a bare ASGI app and raw sockets: it
runs on uvloop and httptools; a request head slower than `header_timeout_s` is closed
(slow-loris); an answer that closes the connection before the body has arrived closes it
lingeringly, so the client that is still sending reads the answer, and the lingering is bounded
in bytes and in time."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ingress.http_server import header_timeout_protocol, uvicorn_config
from ingress.limits import IngressLimits
from router.event_loop import new_event_loop

MIB = 1 << 20


async def refuse_unread(scope: dict, receive, send) -> None:
    """Answers 413 from the headers alone, never reading the body (as ingress/body.py does);
    the answer names the event loop it ran on."""
    if scope["type"] != "http":
        return
    body = json.dumps({"loop": type(asyncio.get_running_loop()).__module__}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(limits: IngressLimits | None = None, **linger) -> Iterator[uvicorn.Server]:
    """uvicorn_config's server for `refuse_unread` on 127.0.0.1 (linger: the protocol's
    lingering bounds, else its defaults), in a thread."""
    limits = limits or IngressLimits()
    config = uvicorn_config(refuse_unread, "127.0.0.1", 0, limits)
    if linger:
        config.http = header_timeout_protocol(limits.header_timeout_s, **linger)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(15)


def port_of(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


def head(content_length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(content_length).encode() + b"\r\n\r\n")


def read_answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes its side."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_new_event_loop_is_uvloops():
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_the_server_runs_on_uvloop_and_httptools():
    config = uvicorn_config(refuse_unread, "127.0.0.1", 0, IngressLimits())
    assert config.loop == "uvloop" and issubclass(config.http, HttpToolsProtocol)
    with serving() as server, socket.create_connection(("127.0.0.1", port_of(server))) as s:
        s.sendall(head(0))
        answer = read_answer(s)
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"loop": "uvloop"}


def test_a_request_head_slower_than_the_header_timeout_is_closed():
    with serving(IngressLimits(header_timeout_s=0.5)) as server:
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")     # ... and stall
            t0 = time.monotonic()
            assert s.recv(4096) == b""
            assert 0.3 < time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as s:
            s.sendall(head(0))                                                # in time
            assert read_answer(s).startswith(b"HTTP/1.1 413 ")


def test_a_client_still_sending_its_body_reads_the_early_answer():
    """12 MB sent after a 413 given from the headers: every byte is taken (no reset), then the
    answer is read whole and the connection ends."""
    body = b"x" * (12 * MIB)
    with serving() as server:
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
            s.sendall(head(len(body)))
            time.sleep(0.2)                       # the answer is out before the body is sent
            s.sendall(body)
            answer = read_answer(s)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"connection: close" in answer.lower()
        assert wait_for(lambda: not server.server_state.connections, 5)


def test_lingering_ends_after_its_byte_bound():
    """A client that never stops sending is cut off once linger_bytes more have arrived."""
    with serving(linger_bytes=MIB, linger_s=30.0) as server:
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
            s.sendall(head(1 << 40))
            sent, chunk = 0, b"x" * 65536
            with pytest.raises(OSError):          # reset or broken pipe, once the server closes
                while sent < 256 * MIB:
                    s.sendall(chunk)
                    sent += len(chunk)
            assert sent < 64 * MIB
        assert wait_for(lambda: not server.server_state.connections, 5)


def test_lingering_ends_after_its_time_bound():
    """A client that reads its answer and then neither sends nor closes is closed after
    linger_s."""
    with serving(linger_bytes=MIB, linger_s=1.0) as server:
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
            s.sendall(head(1000) + b"x" * 10)
            assert read_answer(s).startswith(b"HTTP/1.1 413 ")   # the write side shut
            assert len(server.server_state.connections) == 1     # still lingering
            assert wait_for(lambda: not server.server_state.connections, 5)
