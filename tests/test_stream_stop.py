"""A stop string cuts the final text: the engine's own cut (an engine used on its own) holds when
the stop string starts the output; a served request's stop strings are the router's
(tests/test_frontend_text.py), and its stop ends the request on the decode worker within a step
(no Ray: the host is built in this process)."""

from __future__ import annotations

import time

from conftest import make_engine

from protocol.messages import RequestInput
from workers.decode_host import DecodeHost
from workers.request import SamplingParams

FREE = SamplingParams(max_tokens=16, ignore_eos=True)


def _free_text(engine, prompt: list[int]) -> str:
    return engine.generate([prompt], FREE)[0].output_text


def test_a_stop_string_at_the_start_of_the_output_leaves_an_empty_text(tiny_loaded):
    engine = make_engine(tiny_loaded)
    prompt = engine.tokenizer.encode("stream me please", add_special_tokens=False)
    free = _free_text(engine, prompt)
    stop = free[:2]
    assert stop.strip(), free
    [r] = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True,
                                                   stop=(stop,)))
    assert r.lifecycle.finish_reason == "stop"
    assert r.output_text == ""


def test_a_decode_worker_streams_token_ids_and_a_stop_ends_its_request_within_a_step(
        tiny_loaded):
    """No text leaves a decode worker (the router detokenizes); the router's stop (a stop
    string it saw) ends the request as a stop within a step, its blocks freed."""
    engine = make_engine(tiny_loaded)
    host = DecodeHost("decode-stop", dict(model="tiny", num_blocks=32, block_size=16,
                                          device="cpu"))
    try:
        free_before = host.engine.view.num_free_blocks
        prompt = engine.tokenizer.encode("stream me please", add_special_tokens=False)
        sp = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
        adm = host.admit(RequestInput("r1", prompt, sp, time.time() + 60),
                         local_prefill_max_tokens=10**6)
        assert adm.admitted and adm.local
        tokens, stopped_at, done = [], None, None
        deadline = time.monotonic() + 60
        while done is None and time.monotonic() < deadline:
            for d in host.take_deltas(1.0).deltas:
                assert not hasattr(d, "text")
                tokens.extend(d.token_ids)
                done = d.done or done
            if stopped_at is None and len(tokens) >= 3:
                stopped_at = len(tokens)
                assert host.stop("r1")
        assert done is not None and done.lifecycle.finish_reason == "stop"
        assert len(tokens) <= stopped_at + 2          # the step in flight, at most
        assert list(done.token_ids) == tokens
        assert not host.stop("r1")                    # ended: nothing to stop
        wait = time.monotonic() + 10
        while host.engine.view.num_free_blocks != free_before and time.monotonic() < wait:
            time.sleep(0.05)
        assert host.engine.view.num_free_blocks == free_before
    finally:
        host.shutdown()
