"""`raypd status` and `raypd scale` against an in-process server (tiny model, 1P + 1D): the
status table has a row per actor; scaling 1+1 -> 2+2 -> 1+1 while requests run loses none of
them (each gets the same greedy answer as before scaling), a drained decode worker's running
request moves to the other, the router shows the drained workers draining and then removes
them; `raypd migrate` moves a streaming request; errors (no server, wrong key) exit 2."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import uuid

import pytest
import requests

from cluster.config import load_config
from cluster.serve import start_server
from raypd.cli.ops import add_ops_parsers

KEY = "ops-key"
CONFIG = {"model.name": "tiny", "engine.num_blocks": 256, "engine.max_num_batched_tokens": 512,
          "transfer.transport": "shm"}
PROMPTS = [" ".join(uuid.uuid4().hex[:6] for _ in range(20 + 3 * i)) for i in range(3)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(ray_session):
    cfg = load_config("configs/local.yaml", CONFIG)
    handle = start_server(cfg, "127.0.0.1", 0, api_key=KEY)
    yield handle
    handle.stop()


def raypd(*argv: str) -> int:
    """Run `raypd <argv>` through the parsers `add_ops_parsers` registers."""
    parser = argparse.ArgumentParser(prog="raypd")
    add_ops_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def status_table(server, capsys) -> dict[str, list[str]]:
    """worker id -> its row's columns, from `raypd status`."""
    assert raypd("status", "--url", server.url, "--api-key", KEY) == 0   # /api/stats: admin
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["WORKER", "ROLE", "NODE", "STATE"]
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cols = line.split()
        rows[cols[0]] = cols
    assert "router: policy locality" in out
    return rows


def complete(server, prompt: str) -> str:
    r = requests.post(server.url + "/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    return body["choices"][0]["text"]


def test_status_prints_a_row_per_actor(server, capsys):
    rows = status_table(server, capsys)
    assert set(rows) == {"prefill-0", "decode-0"}
    for wid, cols in rows.items():
        # WORKER ROLE NODE STATE QUEUE KV (pct) HIT
        assert cols[1] == wid.split("-")[0] and cols[3] == "active"
        assert cols[4] == "0/0" and cols[5] == "0/256" and cols[7].endswith("%")
    assert raypd("status", "--url", server.url, "--api-key", KEY, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a["worker_id"] for a in doc["actors"]] == ["prefill-0", "decode-0"]


def test_scale_up_and_down_while_requests_run_loses_none(server, capsys):
    expected = {p: complete(server, p) for p in PROMPTS}      # greedy answers at 1+1
    results: list[tuple[str, str]] = []
    errors: list[str] = []
    stop, go = threading.Event(), threading.Event()
    go.set()

    def traffic(i: int) -> None:
        n = 0
        while not stop.is_set():
            go.wait()
            p = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            try:
                results.append((p, complete(server, p)))
            except Exception as e:      # noqa: BLE001 - a lost request fails the test below
                errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(3)]
    long_streams: list = []
    key = ("--api-key", KEY)
    for t in threads:
        t.start()
    try:
        assert raypd("scale", "--url", server.url, *key, "--prefill", "2", "--decode", "2") == 0
        assert "live: 2 prefill + 2 decode" in capsys.readouterr().out
        rows = status_table(server, capsys)
        assert set(rows) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert {cols[3] for cols in rows.values()} == {"active"}

        # keep decode-1 busy with a long request, so that it drains visibly (the traffic
        # pauses meanwhile, so that what runs on decode-1 is a long request)
        go.clear()
        ingress = server.app.state.ingress
        while ingress.inflight > len(long_streams) or \
                actor(server, "decode-1")["running"] == 0:
            if ingress.inflight == len(long_streams):
                assert len(long_streams) < 8, "no long request went to decode-1"
                long_streams.append(long_stream(server))
            time.sleep(0.02)
        go.set()
        assert raypd("scale", "--url", server.url, *key, "--prefill", "1", "--decode", "1") == 0
        drained_at = time.time()
        out = capsys.readouterr().out
        assert "live: 1 prefill + 1 decode" in out and "draining" in out and "decode-1" in out
        rows = status_table(server, capsys)
        assert rows["decode-0"][3] == "active"
        # decode-1's running long request moves to decode-0 with its KV (live migration), so
        # decode-1 may already be gone
        assert "decode-1" not in rows or rows["decode-1"][3] == "draining"
        # traffic meanwhile goes to the active workers only: checked once three requests that
        # arrived after the drain were served (however slow the machine)
        later: list[dict] = []
        deadline = time.monotonic() + 60
        while len(later) < 3:
            assert time.monotonic() < deadline, ("no request served after the drain", errors[:3])
            time.sleep(0.05)
            later = [q for q in _requests(server) if q["arrival"] > drained_at]
        assert {q["decode_worker"] for q in later} == {"decode-0"}
        assert {q["prefill_worker"] for q in later} <= {"prefill-0"}

        assert server.backend.orchestrator.migrations["moved"] >= 1   # not aborted: moved
        for r in long_streams:           # the long requests end (client gone: aborted)
            r.close()
        long_streams.clear()
        deadline = time.monotonic() + 60
        while set(rows) != {"prefill-0", "decode-0"}:   # then the drained workers go
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
            rows = status_table(server, capsys)
        assert {cols[3] for cols in rows.values()} == {"active"}
        served = len(results)                              # traffic at 1+1 again: 3 more
        deadline = time.monotonic() + 60
        while len(results) < served + 3:
            assert time.monotonic() < deadline, ("no traffic served at 1+1", errors[:3])
            time.sleep(0.02)
    finally:
        stop.set()
        go.set()
        for r in long_streams:
            r.close()
        for t in threads:
            t.join(timeout=120)
    assert errors == []
    assert len(results) >= 10
    assert all(text == expected[p] for p, text in results)  # none lost, none garbled
    assert raypd("scale", "--url", server.url, *key, "--prefill", "1", "--decode", "1",
                 "--wait") == 0
    assert "no worker left draining" in capsys.readouterr().out
    for counts in server.backend.check_invariants():
        assert counts["referenced"] == 0, counts


def long_stream(server) -> requests.Response:
    """A streaming request that runs for seconds (answered at its first token)."""
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": uuid.uuid4().hex, "max_tokens": 1900,
                            "ignore_eos": True, "stream": True})
    assert r.status_code == 200, r.text
    return r


def actor(server, worker_id: str) -> dict:
    doc = requests.get(server.url + "/api/stats", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).json()
    return next(a for a in doc["actors"] if a["worker_id"] == worker_id)


def _requests(server) -> list[dict]:
    return requests.get(server.url + "/api/stats", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).json()["requests"]


def test_scale_with_a_wrong_key_is_refused(server, capsys):
    assert raypd("scale", "--url", server.url, "--api-key", "nope", "--decode", "3") == 2
    err = capsys.readouterr().err
    assert "401" in err and "incorrect API key" in err
    assert raypd("scale", "--url", server.url, "--api-key", KEY) == 2       # no counts
    assert "--prefill" in capsys.readouterr().err


def test_no_server_is_a_clear_error_and_exit_2(capsys):
    with socket.socket() as s:               # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for argv in (["status"], ["scale", "--decode", "2"]):
        assert raypd(*argv, "--url", f"http://127.0.0.1:{port}") == 2
        err = capsys.readouterr().err
        assert "cannot connect" in err and "raypd serve" in err, err


def test_migrate_moves_a_streaming_request_and_refuses_what_it_cannot_move(server, capsys):
    """`raypd migrate ID --to W` moves a streaming request's decode to W with its KV: the
    client's stream goes on with generate()'s greedy tokens, none lost or repeated; an id not
    in flight is 404, a worker that is not a live decode worker 400."""
    key = ("--api-key", KEY)
    assert raypd("scale", "--url", server.url, *key, "--decode", "2") == 0
    capsys.readouterr()
    # 400 tokens: still decoding when the move is asked (at its first token; the count of
    # moves below says it moved)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    whole = requests.post(server.url + "/v1/completions", timeout=120,
                          json={**body, "return_token_ids": True},
                          headers={"Authorization": f"Bearer {KEY}"}).json()
    # token ids with every event (vLLM's return_token_ids): the first event comes with the
    # first token (tiny's random text is held back until it decodes)
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=120,
                      json={**body, "stream": True, "return_token_ids": True},
                      headers={"Authorization": f"Bearer {KEY}"})
    rid = r.headers["X-Request-Id"]
    flights = server.backend.orchestrator
    lines = r.iter_lines(chunk_size=1)      # each event as it comes
    text, ids = [], []

    def take(line: bytes) -> None:
        c = json.loads(line[6:])["choices"][0]
        text.append(c["text"] or "")
        ids.extend(c.get("token_ids") or [])
    for line in lines:                       # the first token: it decodes now
        if line.startswith(b"data: {"):
            take(line)
            if ids:
                break
    here = flights.fleet.worker_id(flights._flights[rid].decode)
    fleet = flights.fleet
    there = next(fleet.worker_id(w) for w in fleet.live("decode") if fleet.worker_id(w) != here)
    moved_before = flights.migrations["moved"]
    assert raypd("migrate", rid, "--to", there, "--url", server.url, *key) == 0
    for line in lines:
        if line.startswith(b"data: {"):
            take(line)
    assert "".join(text) == whole["choices"][0]["text"]
    assert ids == whole["choices"][0]["token_ids"]    # every token once, in order
    assert flights.migrations["moved"] == moved_before + 1
    assert raypd("migrate", "no-such-request", "--url", server.url, *key) == 2
    assert "404" in capsys.readouterr().err
    r2 = requests.post(server.url + "/v1/completions", stream=True, timeout=120,
                       json={**body, "max_tokens": 1500, "stream": True},   # in flight still
                       headers={"Authorization": f"Bearer {KEY}"})
    assert raypd("migrate", r2.headers["X-Request-Id"], "--to", "prefill-0", "--url",
                 server.url, *key) == 2
    assert "400" in capsys.readouterr().err
    r2.close()
    assert raypd("scale", "--url", server.url, *key, "--decode", "1", "--wait") == 0
