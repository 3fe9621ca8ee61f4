"""Overload: clients keep ten times the server's capacity in flight for a bounded time (the tiny
model, 1P + 1D, max_inflight 4, a small KV pool). The ingress holds at most max_inflight
requests, refuses the rest at once with 429 + Retry-After, every accepted request completes
with all its tokens, the memory of the router process and of every worker stays flat, and
afterwards no KV block is left referenced."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import aiohttp
import psutil
import pytest
import requests

from cluster.config import load_config
from cluster.serve import start_server

CAPACITY = 4                  # router.max_inflight
CLIENTS = 10 * CAPACITY       # requests kept in flight by the clients
MAX_TOKENS = 6
WARMUP_S, LOAD_S = 3.0, 10.0
MAX_ROUNDS = 400              # per client: bounds the load if the server is unusually fast
RSS_GROWTH_LIMIT = 200 << 20
CONFIG = {"model.name": "tiny", "engine.num_blocks": 96, "engine.max_num_seqs": 8,
          "engine.max_num_batched_tokens": 256, "transfer.transport": "shm",
          "router.admit_timeout_s": 30}


@pytest.fixture(scope="module")
def server(ray_session):
    cfg = load_config("configs/local.yaml", CONFIG)
    handle = start_server(cfg, "127.0.0.1", 0, api_key="", max_inflight=CAPACITY)
    yield handle
    handle.stop()


def rss_bytes(pids: list[int]) -> dict[int, int]:
    return {pid: psutil.Process(pid).memory_info().rss for pid in pids}


class Tally:
    """What the clients saw."""

    def __init__(self) -> None:
        self.ok = self.rejected = 0
        self.bad: list[str] = []        # anything else: a lost or broken request

    def check_ok(self, text: str, stream: bool) -> None:
        if stream:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            usage = chunks[-1]["usage"]
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            body = json.loads(text)
            usage, reason = body["usage"], body["choices"][0]["finish_reason"]
        if usage["completion_tokens"] != MAX_TOKENS or reason != "length":
            self.bad.append(f"incomplete answer: {usage} {reason}")
        else:
            self.ok += 1


async def client(http: aiohttp.ClientSession, url: str, i: int, deadline: float,
                 tally: Tally) -> None:
    for n in range(MAX_ROUNDS):
        if time.monotonic() > deadline:
            return
        stream = (i + n) % 3 == 0
        words = " ".join(uuid.uuid4().hex[:5] for _ in range(8 + (i * 7 + n) % 40))
        body = {"model": "tiny", "prompt": words, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        try:
            async with http.post(url + "/v1/completions", json=body) as r:
                status, text, retry = r.status, await r.text(), r.headers.get("Retry-After")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally.bad.append(f"{type(e).__name__}: {e}")
            continue
        if status == 200:
            tally.check_ok(text, stream)
        elif status == 429 and int(retry or 0) >= 1 and \
                json.loads(text)["error"]["code"] == "over_capacity":
            tally.rejected += 1
            await asyncio.sleep(0.01)    # an impatient client: ignores Retry-After
        else:
            tally.bad.append(f"{status}: {text[:200]}")


def load(url: str, seconds: float) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds

    async def run() -> None:
        connector = aiohttp.TCPConnector(limit=CLIENTS)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=60)) as http:
            await asyncio.gather(*(client(http, url, i, deadline, tally)
                                   for i in range(CLIENTS)))
    asyncio.run(run())
    return tally


def test_ten_times_capacity_gives_429s_bounded_queue_and_flat_memory(server):
    ingress, backend = server.app.state.ingress, server.backend
    peak = {"ingress": 0, "backend": 0}
    stop = threading.Event()

    def watch() -> None:                 # what is in flight, sampled all along
        while not stop.wait(0.005):
            peak["ingress"] = max(peak["ingress"], ingress.inflight)
            peak["backend"] = max(peak["backend"], len(backend.orchestrator.in_flight()))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    pids = [psutil.Process().pid] + [i["pid"] for i in backend.info]
    try:
        warm = load(server.url, WARMUP_S)
        before = rss_bytes(pids)
        t0 = time.monotonic()
        tally = load(server.url, LOAD_S)
        elapsed = time.monotonic() - t0
        after = rss_bytes(pids)
    finally:
        stop.set()
        watcher.join()

    assert warm.bad == [] and tally.bad == [], (warm.bad + tally.bad)[:5]
    assert tally.ok >= 10 and tally.rejected >= 5 * tally.ok, (tally.ok, tally.rejected)
    assert elapsed < LOAD_S + 30                   # accepted requests finish promptly
    assert peak["ingress"] <= CAPACITY and ingress.peak_inflight <= CAPACITY
    assert peak["backend"] <= CAPACITY
    growth = {pid: after[pid] - before[pid] for pid in pids}
    print(f"overload: {tally.ok} accepted, {tally.rejected} refused (429) in {elapsed:.1f} s; "
          f"peak in flight {peak}; RSS growth MiB "
          f"{ {pid: round(g / 2**20, 1) for pid, g in growth.items()} }")
    assert all(g < RSS_GROWTH_LIMIT for g in growth.values()), \
        {pid: f"{g / 2**20:.0f} MiB" for pid, g in growth.items()}

    # the server's own view agrees: every request it accepted completed
    deadline = time.monotonic() + 30
    while ingress.inflight or backend.orchestrator.in_flight():
        assert time.monotonic() < deadline, "requests still in flight after the load"
        time.sleep(0.05)
    stats = requests.get(server.url + "/api/stats", timeout=30).json()
    by_status = stats["router"]["requests"]
    assert set(by_status) == {"200", "429"}, by_status
    assert by_status["200"] == warm.ok + tally.ok
    assert by_status["429"] == warm.rejected + tally.rejected
    assert all(q["status"] == 200 and q["output_tokens"] == MAX_TOKENS
               for q in stats["requests"])
    assert len(stats["requests"]) <= 200                           # the timeline ring is bounded
    for counts in backend.check_invariants():
        assert counts["referenced"] == 0, counts
    r = requests.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200, r.text
