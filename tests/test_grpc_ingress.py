"""gRPC ingress: Generate streams the same tokens as a direct run, SubmitTrace returns one result
per request sent (failures included), statuses follow the HTTP validation, cancel aborts."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import random_prompt

from cluster.pd import PDCluster, PDConfig
from ingress import raypd_pb2 as pb
from ingress import raypd_pb2_grpc as pb_grpc
from ingress.core import IngressSettings
from ingress.grpc_server import start_grpc_server
from ingress.request_checks import ModelLimits
from protocol.sampling import SamplingParams

ENGINE = dict(model="tiny", num_blocks=128, block_size=16)
PROMPTS = [random_prompt(21, seed=1), random_prompt(40, seed=2), random_prompt(7, seed=3)]


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = PDCluster(PDConfig(engine=ENGINE))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def stub(cluster):
    info = cluster.info[0]
    model = ModelLimits(vocab_size=info["vocab_size"], max_model_len=info["max_model_len"])
    server = start_grpc_server(cluster, "127.0.0.1", 0,
                               IngressSettings(model_name="tiny", model=model))
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.RaypdStub(channel)
    channel.close()
    server.stop()


def _req(prompt: list[int], max_tokens: int = 10, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt,
                              sampling=pb.Sampling(max_tokens=max_tokens, ignore_eos=True,
                                                   temperature=0.0), **kw)


def _direct(cluster, prompt, max_tokens=10) -> list[int]:
    return cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                      ignore_eos=True)).token_ids


def _drained(cluster) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not cluster.orchestrator.in_flight() and \
                all(c["referenced"] == 0 for c in cluster.check_invariants()):
            return
        time.sleep(0.1)
    raise AssertionError(cluster.check_invariants())


def test_generate_streams_the_direct_runs_tokens(cluster, stub):
    chunks = list(stub.Generate(_req(PROMPTS[0], model="tiny")))
    final = chunks[-1]
    streamed = [t for c in chunks[:-1] for t in c.token_ids]
    assert streamed == _direct(cluster, PROMPTS[0])
    assert len(chunks) > 2                       # tokens came in several chunks
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens == 21 and final.usage.completion_tokens == 10
    assert final.lifecycle.prompt_tokens == 21 and final.lifecycle.output_tokens == 10
    assert final.lifecycle.decode_worker == "decode-0"


def test_generate_chat_messages(stub):
    chunks = list(stub.Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="system", content="be brief"),
                  pb.ChatMessage(role="user", content="hi")],
        sampling=pb.Sampling(max_tokens=4, ignore_eos=True))))
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.text for c in chunks) != ""


@pytest.mark.parametrize("request_, code, words", [
    (_req(PROMPTS[0], model="other"), grpc.StatusCode.NOT_FOUND, "model 'other'"),
    (pb.GenerateRequest(prompt="x", prompt_token_ids=[5]), grpc.StatusCode.INVALID_ARGUMENT,
     "exactly one of"),
    (pb.GenerateRequest(prompt_token_ids=[5],
                        sampling=pb.Sampling(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.GenerateRequest(prompt_token_ids=[5, 100000]), grpc.StatusCode.INVALID_ARGUMENT,
     "token ids"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="x")]),
     grpc.StatusCode.INVALID_ARGUMENT, "role"),
])
def test_generate_rejects_like_http(stub, request_, code, words):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_))
    assert e.value.code() == code
    assert words in e.value.details()


def test_submit_trace_returns_one_result_per_request(cluster, stub):
    sent = [pb.TraceRequest(id=f"r{i}", request=_req(p, max_tokens=6))
            for i, p in enumerate(PROMPTS)]
    sent.append(pb.TraceRequest(id="bad", request=pb.GenerateRequest(prompt_token_ids=[1],
                                sampling=pb.Sampling(top_p=2))))
    results = {r.id: r for r in stub.SubmitTrace(iter(sent))}
    assert sorted(results) == sorted(t.id for t in sent)
    assert not results["bad"].ok and results["bad"].error_code == "INVALID_ARGUMENT"
    assert "top_p" in results["bad"].error
    for i, p in enumerate(PROMPTS):
        r = results[f"r{i}"]
        assert r.ok, r.error
        assert list(r.token_ids) == _direct(cluster, p, 6)
        assert r.usage.completion_tokens == 6 and r.lifecycle.prompt_tokens == len(p)
    _drained(cluster)


def test_cancelled_generate_aborts_and_releases_blocks(cluster, stub):
    call = stub.Generate(_req(random_prompt(50, seed=9), max_tokens=1500))
    first = next(call)
    assert first.token_ids
    call.cancel()
    _drained(cluster)
    stats = {s["worker_id"]: s for s in cluster.stats()}
    assert stats["decode-0"]["running"] == 0
