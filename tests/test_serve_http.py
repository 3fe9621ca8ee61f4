"""The OpenAI-compatible HTTP ingress, served in-process over the tiny model on local Ray: the
official `openai` client gets the single engine's answers, cached tokens show on a repeated
prompt, every bad input gets its status and message (and the server keeps serving), and a
client that goes away frees its blocks."""

from __future__ import annotations

import json
import threading
import time
import uuid

import openai
import pytest
import requests
from conftest import make_engine

from cluster.config import load_config
from cluster.pd import PDCluster
from cluster.serve import start_server
from protocol.errors import RequestError, RoutingRejected, SLOUnmeetable, TransferFailed
from workers.request import SamplingParams

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIG = {"model.name": "tiny", "engine.num_blocks": 256, "engine.max_num_batched_tokens": 512,
          "transfer.transport": "shm"}


class Recorder:
    """The PDCluster, with every abort it is asked for written down."""

    def __init__(self, cluster: PDCluster) -> None:
        self.cluster = cluster
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.cluster.abort(request_id)

    def __getattr__(self, name: str):
        return getattr(self.cluster, name)


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/local.yaml", CONFIG)


@pytest.fixture(scope="module")
def backend(ray_session, cfg):
    cluster = PDCluster(cfg.to_pd_config())
    yield Recorder(cluster)
    cluster.shutdown()


@pytest.fixture(scope="module")
def server(cfg, backend):
    handle = start_server(cfg, "127.0.0.1", 0, api_key=KEY, backend=backend)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    """The single engine, in this process: the reference answers."""
    return make_engine(tiny_loaded, num_blocks=256)


def reference_text(engine, prompt, max_tokens: int) -> str:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], sp)[0].output_text


def post(server, path: str, body, headers=AUTH, **kw) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("timeout", 60)
    return requests.post(server.url + path, data=data,
                         headers={"Content-Type": "application/json", **headers}, **kw)


def assert_serves(server) -> None:
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "still there?",
                                         "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def clean(backend, timeout_s: float = 20.0) -> list[dict]:
    """Wait until nothing is in flight and no worker holds a referenced block."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = backend.check_invariants()
        if not backend.orchestrator.in_flight() and all(c["referenced"] == 0 for c in counts):
            return counts
        assert time.monotonic() < deadline, (backend.orchestrator.in_flight(), counts)
        time.sleep(0.1)


def unique(n: int) -> str:
    """A prompt of exactly n tokens for the tiny byte-level tokenizer, never sent before."""
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


# ---- the openai client -------------------------------------------------------------------------
def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_equals_the_single_engine(client, engine):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == reference_text(engine, prompt, 8)
    assert choice.finish_reason == "length" and out.object == "text_completion"
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == len(prompt) + 8


def test_chat_equals_the_single_engine(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference_text(engine, messages, 6)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


def test_streaming_chat_equals_non_streaming_and_ends_with_usage(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "stream " + unique(20)}],
              max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model="tiny", prompt=unique(30), max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(getattr(c, "usage", None) is None for c in chunks)   # no include_usage


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = unique(100)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (100 - 1) // 16 * 16          # every full block but the last token's


def test_tenants_do_not_share_cached_prefixes(client):
    prompt = unique(64)
    for tenant, expect_hit in [("a", False), ("a", True), ("b", False)]:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                        extra_body={"tenant": tenant})
        assert (out.usage.prompt_tokens_details.cached_tokens > 0) == expect_hit, tenant


def test_n_choices_and_batched_prompts(client):
    out = client.completions.create(model="tiny", prompt=["ab", "cd"], n=2, max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text      # greedy: n copies agree
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 4


def test_vllm_sampling_extras_are_accepted(client):
    kw = dict(model="tiny", prompt=unique(10), max_tokens=5, temperature=0.8, seed=3,
              extra_body={"top_k": 5, "min_tokens": 1, "stop_token_ids": [2], "top_p": 0.9})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text        # seeded sampling repeats
    assert a.usage.completion_tokens >= 1


# ---- bad inputs --------------------------------------------------------------------------------
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [  # name, path, body, headers, status, words in the message
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', AUTH, 400,
     "malformed JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, "JSON object"),
    ("max_tokens a word", "/v1/completions", {**GOOD, "max_tokens": "ten"}, AUTH, 400,
     "max_tokens"),
    ("temperature a word", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, AUTH, 400,
     "temperature"),
    ("prompt a number", "/v1/completions", {**GOOD, "prompt": 5}, AUTH, 400, "prompt"),
    ("prompt missing", "/v1/completions", {"model": "tiny"}, AUTH, 400, "prompt: is required"),
    ("messages a string", "/v1/chat/completions", {**CHAT, "messages": "hi"}, AUTH, 400,
     "messages"),
    ("unknown role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400, "role"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -5}, AUTH, 400,
     "max_tokens"),
    ("zero max_completion_tokens", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 0}, AUTH, 400, "max_tokens"),
    ("top_p above 1", "/v1/completions", {**GOOD, "top_p": 2}, AUTH, 400, "top_p"),
    ("min_tokens above max", "/v1/completions", {**GOOD, "min_tokens": 9}, AUTH, 400,
     "min_tokens"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, AUTH, 400, "empty"),
    ("token id outside the vocabulary", "/v1/completions", {**GOOD, "prompt": [5, 99999]},
     AUTH, 400, "token ids"),
    ("prompt over the context", "/v1/completions", {**GOOD, "prompt": "a" * 3000}, AUTH, 400,
     "context"),
    ("prompt over the context, streaming", "/v1/chat/completions",
     {**CHAT, "stream": True, "messages": [{"role": "user", "content": "a" * 3000}]}, AUTH,
     400, "context"),
    ("n = 0", "/v1/completions", {**GOOD, "n": 0}, AUTH, 400, "n"),
    ("logprobs", "/v1/completions", {**GOOD, "logprobs": 1}, AUTH, 400, "not supported"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, AUTH, 400,
     "not supported"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, AUTH, 404, "gpt-9"),
    ("missing auth", "/v1/completions", GOOD, {}, 401, "bearer"),
    ("wrong key", "/v1/chat/completions", CHAT, {"Authorization": "Bearer nope"}, 401,
     "incorrect"),
    ("unknown route", "/v1/embeddings", GOOD, AUTH, 404, "Not Found"),
]


@pytest.mark.parametrize("name,path,body,headers,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_the_server_keeps_serving(server, name, path, body,
                                                                  headers, status, words):
    r = post(server, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err
    if status == 404 and "model" in name:
        assert err["code"] == "model_not_found" and err["param"] == "model"
    if status == 401:
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert_serves(server)


def test_wrong_method_is_405_in_openai_error_shape(server):
    r = requests.get(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and "message" in r.json()["error"]


def test_openai_client_raises_the_matching_errors(server):
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        good.completions.create(model="tiny", prompt="x", max_tokens=-1)


# ---- capacity, disconnects, health, metrics ----------------------------------------------------
def test_over_capacity_is_429_with_retry_after(cfg, backend):
    with start_server(cfg, "127.0.0.1", 0, api_key="", backend=backend, max_inflight=1) as small:
        body = {"model": "tiny", "prompt": unique(20), "max_tokens": 1900, "ignore_eos": True,
                "stream": True}
        long = post(small, "/v1/completions", body, headers={}, stream=True)
        assert long.status_code == 200                # answered at its first token
        assert small.app.state.ingress.inflight == 1
        r = post(small, "/v1/completions", GOOD, headers={})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "over_capacity"
        long.close()
        clean(backend)
        assert_serves(small)


def test_client_disconnect_while_streaming_aborts_and_frees_blocks(server, backend):
    body = {"model": "tiny", "prompt": unique(100), "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    r = post(server, "/v1/completions", body, stream=True)
    assert r.status_code == 200                       # answered at its first token
    rid = r.headers["X-Request-Id"]
    r.close()
    counts = clean(backend)
    assert rid in backend.aborted
    assert all(c["free"] + c["cached"] == c["total"] for c in counts)
    assert_serves(server)


def test_client_disconnect_while_waiting_aborts_and_frees_blocks(server, backend):
    body = {"model": "tiny", "prompt": unique(40), "max_tokens": 1900, "ignore_eos": True}
    before = len(backend.aborted)
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(server, "/v1/completions", body, timeout=1.0)
    clean(backend)
    assert len(backend.aborted) > before
    assert_serves(server)


def test_health_and_metrics(server):
    assert_serves(server)                                          # one 200 and one 400 of its own
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": 7}).status_code == 400
    h = requests.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["workers"] == 2
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'raypd_kv_blocks_total{role="decode",worker="decode-0"} 256.0' in text
    assert 'raypd_kv_blocks_total{role="prefill",worker="prefill-0"} 256.0' in text
    assert 'raypd_http_requests_total{endpoint="completions",status="200"}' in text
    assert 'raypd_http_requests_total{endpoint="completions",status="400"}' in text
    for name in ("raypd_ttft_seconds_count", "raypd_tpot_seconds_count",
                 "raypd_e2e_seconds_count", "raypd_prefix_cache_hit_rate",
                 "raypd_prefix_reused_tokens_total", "raypd_kv_evictions_total",
                 "raypd_preemptions_total", "raypd_backend_up 1.0"):
        assert name in text, name


# ---- backend failures, with a stand-in backend (no Ray) -----------------------------------------
class FailingBackend:
    """Raises the exception it is given from run_request_async."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None

    async def run_request_async(self, prompt, sampling, **kw):
        raise self.exc

    def abort(self, request_id):
        return False

    def stats(self):
        raise RuntimeError("no workers")


@pytest.mark.parametrize("exc,status,retry_after", [
    (RoutingRejected("no_decode_capacity", "no decode worker has room", retry_after_s=5),
     429, "5"),
    (SLOUnmeetable(best_ttft_s=7.5, slo_s=2.0), 429, "6"),
    (TransferFailed("KV transfer for request x failed"), 503, None),
    (RequestError("request x was aborted"), 400, None),
])
def test_backend_errors_map_to_status_codes(cfg, exc, status, retry_after):
    fake = FailingBackend()
    fake.exc = exc
    with start_server(cfg, "127.0.0.1", 0, api_key="", backend=fake) as srv:
        for stream in (False, True):
            r = post(srv, "/v1/completions", {**GOOD, "stream": stream}, headers={})
            assert r.status_code == status, r.text
            assert r.headers.get("Retry-After") == retry_after
            assert str(exc) in r.json()["error"]["message"]
        assert requests.get(srv.url + "/health", timeout=10).status_code == 503


def test_concurrent_requests_all_complete(client, backend):
    results: list = [None] * 6

    def one(i: int) -> None:
        results[i] = client.completions.create(model="tiny", prompt=unique(30 + i),
                                               max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.usage.completion_tokens for r in results] == [4] * 6
    clean(backend)


def test_return_token_ids_adds_ids_and_lifecycle(server, backend):
    body = {"model": "tiny", "prompt": "token ids please", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True}
    full = post(server, "/v1/completions", body).json()["choices"][0]
    assert len(full["token_ids"]) == 8
    assert full["raypd_lifecycle"]["output_tokens"] == 8
    r = post(server, "/v1/completions", {**body, "stream": True}, stream=True)
    ids, lifecycle = [], None
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            c = json.loads(line[6:])["choices"][0]
            ids += c.get("token_ids", [])
            lifecycle = c.get("raypd_lifecycle") or lifecycle
    assert ids == full["token_ids"] and lifecycle["finish_reason"] == "length"
    stats = requests.get(server.url + "/api/stats", headers=AUTH, timeout=30).json()
    assert stats["config"]["model"] == "tiny" and stats["config"]["decode"] == 1
