"""Ingress limits with a stand-in backend (no Ray): a client that stops reading a stream is cut
off and its request aborted; without API keys the admin routes answer loopback clients only;
HTTP and gRPC share one capacity; keys bind tenants."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from cluster.config import load_config
from cluster.serve import start_server
from ingress.auth import KeyRing, Principal, tenant_of
from ingress.core import IngressCore, IngressSettings
from ingress.errors import IngressError
from protocol.messages import TokenDelta


class FloodingBackend:
    """Streams big deltas as fast as it can until aborted."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.info = [{"worker_id": "fake-0", "vocab_size": 1000, "max_model_len": 512}]

    async def run_request_async(self, prompt, sampling, *, on_delta=None, **kw):
        while not self.aborted.is_set():
            on_delta(TokenDelta((1,), "x" * 16384))
            await asyncio.sleep(0)
        raise RuntimeError("aborted")

    def abort(self, request_id):
        self.aborted.set()
        return True

    def stats(self):
        return []


def test_a_client_that_does_not_read_its_stream_is_cut_off_and_aborted():
    cfg = load_config(None, {"model.name": "tiny", "server.limits.stream_queue_events": 8,
                             "server.limits.write_timeout_s": 1.0})
    fake = FloodingBackend()
    with start_server(cfg, "127.0.0.1", 0, api_key="", backend=fake) as srv:
        body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 100}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        try:                                    # ... and never read
            assert fake.aborted.wait(30), "the flooded request was not aborted"
            deadline = time.monotonic() + 30
            while srv.app.state.ingress.inflight:
                assert time.monotonic() < deadline, "its capacity was not released"
                time.sleep(0.05)
        finally:
            s.close()


def test_without_keys_admin_routes_answer_loopback_clients_only():
    core = IngressCore(None, IngressSettings())
    assert core.authorize(None, "admin", "127.0.0.1").key_id == "anonymous"
    assert core.authorize(None, "admin", "::1").key_id == "anonymous"
    with pytest.raises(IngressError) as e:
        core.authorize(None, "admin", "192.168.1.20")
    assert e.value.status == 403 and "local clients" in e.value.message
    assert core.authorize(None, "inference", "192.168.1.20").key_id == "anonymous"


def test_capacity_is_one_count_for_every_ingress():
    core = IngressCore(None, IngressSettings(max_inflight=3))
    core.acquire(2)               # e.g. HTTP
    core.acquire(1)               # e.g. gRPC
    with pytest.raises(IngressError) as e:
        core.acquire(1)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    core.release(3)
    assert core.inflight == 0


def test_a_key_runs_in_its_tenant_and_cannot_claim_another(tmp_path):
    (tmp_path / "k.yaml").write_text("keys: [{key: acme-123456, tenant: acme}]\n")
    ring = KeyRing.load(tmp_path / "k.yaml")
    p = ring.find("acme-123456")
    assert p is not None and ring.find("acme-12345") is None
    assert tenant_of(p, "") == "acme" and tenant_of(p, "acme") == "acme"
    with pytest.raises(IngressError) as e:
        tenant_of(p, "globex")
    assert e.value.status == 403 and e.value.code == "tenant_mismatch"
    assert tenant_of(Principal("legacy", None, frozenset({"inference"})), "any") == "any"


def test_connections_beyond_the_cap_get_503():
    cfg = load_config(None, {"model.name": "tiny", "server.limits.max_connections": 2})
    with start_server(cfg, "127.0.0.1", 0, api_key="", backend=FloodingBackend()) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        try:
            deadline = time.monotonic() + 30     # until the server has accepted both
            while len(srv.server.server_state.connections) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).split(b"\r\n")[0].split()[1] == b"503"
            s.close()
        finally:
            for c in idle:
                c.close()
