"""One error map: each error class names its HTTP status (and through it the OpenAI type and the
gRPC code); the ingress answers it, and the router's metrics record the status the client got.
Two answers that were wrong: max_tokens past the context (silently capped with a 200) and a
JSON string with a lone UTF-16 surrogate (a 500)."""

from __future__ import annotations

import pickle

import pytest
import ray

from ingress.errors import classify
from ingress.jsonbody import parse_json_object
from ingress.limits import IngressLimits
from ingress.request_checks import ModelLimits, RequestLimits, make_sampling
from protocol.errors import (
    ANSWERS,
    RequestAborted,
    RequestError,
    RoutingRejected,
    SLOUnmeetable,
    StepFailed,
    TransferFailed,
    TransferRejected,
    UnknownLoRAError,
    WorkerFailed,
    http_status,
)
from router.flight import Flight
from router.orchestrator import _client_error

CASES = [
    (RequestError("bad field", param="top_p"), 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (UnknownLoRAError("no adapter x"), 404, "not_found_error", "NOT_FOUND"),
    (RoutingRejected("no_workers", "none"), 429, "rate_limit_error", "RESOURCE_EXHAUSTED"),
    (SLOUnmeetable(7.5, 2.0), 429, "rate_limit_error", "RESOURCE_EXHAUSTED"),
    (RequestAborted("request x was aborted"), 499, "cancelled", "CANCELLED"),
    (StepFailed("step raised"), 500, "internal_error", "INTERNAL"),
    (TransferFailed("KV transfer failed"), 503, "service_unavailable", "UNAVAILABLE"),
    (WorkerFailed("workers died"), 503, "service_unavailable", "UNAVAILABLE"),
]


@pytest.mark.parametrize("exc, status, kind, code", CASES)
def test_each_error_class_has_one_status_type_and_grpc_code(exc, status, kind, code):
    err = classify(exc)
    assert (http_status(exc), err.status, err.body()["error"]["type"], err.grpc_code) == \
        (status, status, kind, code)
    assert ANSWERS[status] == (kind, code)


@pytest.mark.parametrize("exc", [c[0] for c in CASES]
                         + [TransferRejected("corrupt", "page 3")])
def test_errors_keep_their_fields_across_pickling(exc):
    """They cross Ray actor calls: status, param, reason and Retry-After must survive."""
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert (back.http_status, back.param, back.code, back.retry_after_s) == \
        (exc.http_status, exc.param, exc.code, exc.retry_after_s)


def test_the_router_records_the_status_the_client_gets():
    """The router's metrics took TransferFailed as 502 and a dead worker as 500, while the
    client got 503; a Ray error never leaves the router as itself."""
    flight = Flight("r1")
    for exc in (TransferFailed("x"), WorkerFailed("y"), RoutingRejected("no_workers", "z")):
        assert _client_error(exc, flight) is exc
        assert http_status(_client_error(exc, flight)) == classify(exc).status
    dead = ray.exceptions.RayActorError()
    err = _client_error(dead, flight)
    assert isinstance(err, WorkerFailed) and http_status(err) == classify(err).status == 503
    flight.aborted = True
    err = _client_error(RequestError("request r1 was aborted"), flight)
    assert isinstance(err, RequestAborted) and http_status(err) == 499


def test_max_tokens_past_what_the_server_allows_is_a_400_naming_the_limit():
    model = ModelLimits(vocab_size=100, max_model_len=128)
    with pytest.raises(RequestError, match=r"max_tokens: must be at most 128 \(the model's "
                                           r"context is 128 tokens\), got 1000") as e:
        make_sampling(chat=False, limits=RequestLimits(), model=model, max_tokens=1000)
    assert e.value.param == "max_tokens" and classify(e.value).status == 400
    asked = make_sampling(chat=False, limits=RequestLimits(), model=model, max_tokens=100)
    default = make_sampling(chat=False, limits=RequestLimits(), model=model)
    assert (asked.max_tokens, asked.strict_max_tokens) == (100, True)
    assert not default.strict_max_tokens        # a default stops at the context's end


def test_max_tokens_that_the_prompt_leaves_no_room_for_is_a_400(tiny_loaded):
    """The prompt's length is known where it is tokenized (D's admission): what a client asked
    for must fit beside it, as vLLM and OpenAI answer; a default may stop at the context."""
    from conftest import make_engine

    from protocol.sampling import SamplingParams
    engine = make_engine(tiny_loaded, max_model_len=64)
    with pytest.raises(RequestError, match="maximum context length is 64 tokens. However, you "
                                           r"requested 70 tokens \(20 in the prompt, 50") as e:
        engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=50,
                                                              strict_max_tokens=True))
    assert e.value.param == "max_tokens"
    req = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=50, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert req.lifecycle.finish_reason == "length" and len(req.output_token_ids) == 64 - 20


@pytest.mark.parametrize("raw, where", [
    (rb'{"prompt": "\ud800"}', "body.prompt"),
    (rb'{"messages": [{"role": "user", "content": "a\udfffb"}]}', "body.messages[0].content"),
    (rb'{"\udc00": 1}', "body key"),
])
def test_a_lone_surrogate_is_a_400_naming_where(raw, where):
    with pytest.raises(Exception) as e:
        parse_json_object(raw, IngressLimits())
    err = classify(e.value)
    assert err.status == 400 and where in err.message and "surrogate" in err.message


def test_a_surrogate_pair_is_text():
    assert parse_json_object(rb'{"prompt": "\ud83d\ude00"}', IngressLimits()) == \
        {"prompt": "\U0001F600"}
