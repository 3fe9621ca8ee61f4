"""The door answers every bad request readably, to each of three HTTP clients (urllib, httpx,
requests) against the real server on 127.0.0.1 with a stand-in backend that is never reached: a
body over the size limit (a 12 MB prompt, a stop list of 100,000 strings; declared or chunked)
gets its 413, `"model": ""` a 404 naming the served model, a non-assistant message with
`"content": null` a 400. And the parser takes vLLM's `include_stop_str_in_output` and
`skip_special_tokens` into the sampling parameters, refusing what is not a bool."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
import requests

from cluster.config import load_config
from cluster.serve import start_server
from ingress import body as ingress_body
from ingress import http_app
from ingress.errors import IngressError
from ingress.openai_protocol import chat_request, completion_request
from ingress.request_checks import ModelLimits, RequestLimits

HEADERS = {"Content-Type": "application/json"}


class Unreachable:
    """A backend that no refused request may reach: it notes each call and fails it."""

    def __init__(self) -> None:
        self.info = [{"worker_id": "fake-0", "vocab_size": 1000, "max_model_len": 512}]
        self.calls = 0

    async def run_request_async(self, *args, **kwargs):
        self.calls += 1
        raise RuntimeError("the door let a bad request through")

    def abort(self, request_id):
        return False

    def stats(self):
        return []


@pytest.fixture(scope="module")
def backend() -> Unreachable:
    return Unreachable()


@pytest.fixture(scope="module")
def server(backend):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(http_app, "read_body", ingress_body.read_body)
        cfg = load_config(None, {"model.name": "tiny"})
        with start_server(cfg, "127.0.0.1", 0, api_key="", backend=backend) as srv:
            yield srv
    assert backend.calls == 0


def chunks(data: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


# ---- the three clients: (status, JSON answer) --------------------------------------------------
def via_urllib(url: str, data: bytes, chunked: bool) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=chunks(data) if chunked else data, headers=HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def via_httpx(url: str, data: bytes, chunked: bool) -> tuple[int, dict]:
    r = httpx.post(url, content=chunks(data) if chunked else data, headers=HEADERS, timeout=60)
    return r.status_code, r.json()


def via_requests(url: str, data: bytes, chunked: bool) -> tuple[int, dict]:
    r = requests.post(url, data=chunks(data) if chunked else data, headers=HEADERS, timeout=60)
    return r.status_code, r.json()


CLIENTS = {"urllib": via_urllib, "httpx": via_httpx, "requests": via_requests}


def post(client: str, server, path: str, body: dict | bytes, chunked: bool = False
         ) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return CLIENTS[client](server.url + path, data, chunked)


# ---- a body over the size limit ----------------------------------------------------------------
PROMPT_12MB = {"model": "tiny", "prompt": "x" * 12_000_000, "max_tokens": 1}
STOP_100K = {"model": "tiny", "prompt": "x", "max_tokens": 1,
             "stop": [f"stop-{i:06d}" for i in range(100_000)]}
OVERSIZED = {"prompt_12mb": (PROMPT_12MB, False), "stop_list_100k": (STOP_100K, False),
             "prompt_12mb_chunked": (PROMPT_12MB, True)}


@pytest.mark.parametrize("case", OVERSIZED)
@pytest.mark.parametrize("client", CLIENTS)
def test_a_body_over_the_size_limit_gets_its_413(server, client, case):
    body, chunked = OVERSIZED[case]
    data = json.dumps(body).encode()
    assert len(data) > server.app.state.ingress.settings.limits.max_body_bytes
    status, answer = post(client, server, "/v1/completions", data, chunked)
    assert status == 413, answer
    assert answer["error"]["code"] == "body_too_large"
    assert "server.limits.max_body_bytes" in answer["error"]["message"]


# ---- "model": "" -------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "", "prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("client", CLIENTS)
def test_an_empty_model_name_is_404_naming_the_served_model(server, client, path, body):
    status, answer = post(client, server, path, body)
    assert status == 404, answer
    err = answer["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "'tiny'" in err["message"]


# ---- "content": null ---------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("client", CLIENTS)
def test_a_message_with_null_content_is_400(server, client, role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
    status, answer = post(client, server, "/v1/chat/completions",
                          {"model": "tiny", "messages": messages})
    assert status == 400, answer
    assert answer["error"]["message"].startswith("messages.1.content: is required")


def parse_chat(messages: list[dict], **extra):
    return chat_request({"messages": messages, **extra}, RequestLimits(), ModelLimits())


def test_null_content_stays_valid_for_an_assistant_message_with_tool_calls():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    _, req = parse_chat([{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "42", "tool_call_id": "call_1"}])
    assert [m["content"] for m in req.prompts[0]] == ["hi", "", "42"]
    with pytest.raises(IngressError) as e:          # without tool calls it is refused
        parse_chat([{"role": "assistant", "content": None}])
    assert e.value.status == 400


# ---- vLLM's text extras ------------------------------------------------------------------------
def parse_completion(**extra):
    return completion_request({"prompt": "hi", **extra}, RequestLimits(), ModelLimits())[1]


def test_include_stop_str_in_output_and_skip_special_tokens_reach_the_sampling():
    sp = parse_completion().sampling
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens) == (False, True)
    sp = parse_completion(include_stop_str_in_output=True, skip_special_tokens=False).sampling
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens) == (True, False)
    sp = parse_chat([{"role": "user", "content": "hi"}], include_stop_str_in_output=True,
                    skip_special_tokens=False)[1].sampling
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens) == (True, False)


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
@pytest.mark.parametrize("value", [1, "true", [True]])
def test_text_extras_that_are_not_bools_are_400(field, value):
    with pytest.raises(IngressError) as e:
        parse_completion(**{field: value})
    assert e.value.status == 400 and e.value.message.startswith(field)
