"""The router is the frontend, served end to end on the tiny model: a stop string the router
sees ends the request on its decode worker within a step (P/D and colocated), the streamed text
equal to the final text and no block held after; a multi-turn conversation over two decode
workers lands each turn on the D that holds its prefix; the serve process holds no more
threads with 256 streams open than with one."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from conftest import wait_until

from cluster.config import load_config
from cluster.pd import PDCluster, PDConfig
from cluster.serve import start_server
from protocol.messages import RequestInput
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

ENGINE = dict(model="tiny", num_blocks=256, block_size=16)
PROMPT = "tell me a long story about rivers and stones"

pytestmark = pytest.mark.usefixtures("ray_session")


def _decode_steps(cluster: PDCluster) -> int:
    return sum(s.get("steps", 0) for s in cluster.stats() if s.get("role") == "decode")


@pytest.mark.parametrize("num_prefill", [0, 1], ids=["colocated", "pd"])
def test_a_stop_string_ends_the_request_on_its_worker_within_a_step(num_prefill):
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=num_prefill, num_decode=1))
    try:
        free = cluster.run_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
        text = free.text
        start = next(i for i in range(6, len(text) - 4)
                     if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip()
                     and text.find(text[i:i + 3]) == i)
        stop = text[start:start + 3]
        streamed: list[str] = []
        steps = _decode_steps(cluster)
        r = cluster.run_request(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True,
                                                       stop=(stop,)),
                                on_delta=lambda d: streamed.append(d.text))
        assert r.lifecycle.finish_reason == "stop"
        assert "".join(streamed) == r.text == text[:start]
        assert r.token_ids == free.token_ids[:len(r.token_ids)]
        assert r.lifecycle.output_tokens == len(r.token_ids) < 40
        # the worker stopped soon after the hit, not at max_tokens (400): within a step of the
        # router's stop (tests/test_stream_stop.py), which trails the worker's steps by the
        # stream's delay (a few steps on a busy machine)
        assert _decode_steps(cluster) - steps <= len(r.token_ids) + 20
        wait_until(lambda: cluster.leaked_blocks() == 0, timeout=15)
        for counts in cluster.check_invariants():
            assert counts["referenced"] == 0, counts
    finally:
        cluster.shutdown()


def test_each_turn_of_a_conversation_lands_on_the_decode_worker_holding_its_prefix():
    """Two decode workers, one prefill worker: the router hashes each turn's prompt and picks
    D by the prefix it holds (it used to pick D by an estimate before D tokenized). The turns
    come a user's moment apart: D's load report after a turn has come in (the router counts a
    request on its D until the next report, so back-to-back turns would see D loaded)."""
    flow = FlowConfig(local_prefill_when_backlogged=False)
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=1, num_decode=2, flow=flow))
    try:
        for conv in range(3):
            messages = [{"role": "system", "content": f"conversation {conv}: " + "x" * 60},
                        {"role": "user", "content": "hello there, how are the rivers?"}]
            landed, hits = [], []
            for turn in range(3):
                r = cluster.run_request(messages, SamplingParams(max_tokens=8, ignore_eos=True))
                landed.append(r.lifecycle.decode_worker)
                hits.append(r.lifecycle.skipped_blocks)
                messages = messages + [{"role": "assistant", "content": r.text},
                                       {"role": "user", "content": f"and turn {turn}?"}]
                time.sleep(4 * flow.report_interval_s)
            assert len(set(landed)) == 1, landed
            assert all(h > 0 for h in hits[1:]), hits
            # the next turn's prefix, as the router hashes it before any worker sees it, is
            # matched on the decode worker that holds it
            o = cluster.orchestrator
            frontend = o.loop.run(o.frontend())
            nxt = frontend.admit(RequestInput("probe", messages, SamplingParams(),
                                              time.time() + 60))
            with o.fleet.lock:
                matched = o.fleet.index.match(list(nxt.block_hashes))
            assert matched.get(landed[-1], 0) > 0, matched
    finally:
        cluster.shutdown()


def _threads(pid: int | None = None) -> int:
    import os
    return len(os.listdir(f"/proc/{pid or os.getpid()}/task"))


def test_the_serve_process_holds_as_many_threads_with_256_streams_open_as_with_one():
    cfg = load_config("configs/local.yaml", {"model.name": "tiny", "workers.prefill.count": 0,
                                              "engine.num_blocks": 4096, "engine.max_num_seqs": 256})
    with start_server(cfg, "127.0.0.1", 0, api_key="") as srv:
        url = srv.url + "/v1/completions"
        # a burst first: the router's small fixed pools (its tokenizing threads) start their
        # threads on first use; they are the same size with 1 stream or 256
        burst = [threading.Thread(target=lambda: requests.post(
            url, json={"prompt": "warm", "max_tokens": 2}, timeout=60).raise_for_status())
            for _ in range(8)]
        for b in burst:
            b.start()
        for b in burst:
            b.join()

        def open_streams(n: int) -> tuple[int, list]:
            started = threading.Semaphore(0)
            stop = threading.Event()

            def one() -> None:
                body = {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
                with requests.post(url, json=body, stream=True, timeout=120) as resp:
                    resp.raise_for_status()
                    lines = resp.iter_lines()
                    for line in lines:
                        if line.startswith(b"data: {"):
                            json.loads(line[6:])
                            started.release()
                            break
                    stop.wait(120)
            clients = [threading.Thread(target=one, daemon=True) for _ in range(n)]
            for c in clients:
                c.start()
            for _ in range(n):
                assert started.acquire(timeout=120), "a stream never started"
            time.sleep(0.5)
            count = _threads() - n - 1          # this process holds the clients too
            stop.set()
            return count, clients

        one_open, clients = open_streams(1)
        for c in clients:
            c.join(30)
        wait_until(lambda: srv.app.state.ingress.inflight == 0, timeout=30)
        many_open, clients = open_streams(256)
        for c in clients:
            c.join(60)
    assert many_open <= one_open, (one_open, many_open)


def test_n_choices_stream_exactly_their_final_texts_with_a_stop_string():
    """n = 2 seeded choices with a stop string and include_stop_str_in_output, streamed over
    SSE: each choice's streamed text is its text in the same request unstreamed."""
    cfg = load_config("configs/local.yaml", {"model.name": "tiny", "workers.prefill.count": 0})
    with start_server(cfg, "127.0.0.1", 0, api_key="") as srv:
        url = srv.url + "/v1/completions"
        base = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "n": 2,
                "temperature": 0.9, "seed": 7}
        free = requests.post(url, json=base, timeout=60).json()["choices"]
        stop = next(c["text"][5:7] for c in free if "\ufffd" not in c["text"][5:7]
                    and c["text"][5:7].strip())
        for include in (False, True):
            body = {**base, "stop": [stop], "include_stop_str_in_output": include}
            whole = {c["index"]: c for c in requests.post(url, json=body, timeout=60)
                     .json()["choices"]}
            streamed = {0: "", 1: ""}
            with requests.post(url, json={**body, "stream": True}, stream=True,
                               timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith(b"data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            streamed[c["index"]] += c["text"]
            for i in (0, 1):
                assert streamed[i] == whole[i]["text"], (i, include, streamed, whole)
                t = free[i]["text"]
                if stop in t:
                    cut = t.find(stop) + (len(stop) if include else 0)
                    assert whole[i]["text"] == t[:cut] and whole[i]["finish_reason"] == "stop"
