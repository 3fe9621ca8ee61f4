"""A stop string cuts the final text, and what was streamed is exactly that text: the engine's cut
holds when the stop string starts the output, and a decode worker's deltas never run past the
cut when the step that completes the stop string brings text beyond it (no Ray: the host is
built in this process)."""

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


def _stream(host: DecodeHost, rid: str, prompt: list[int], sampling: SamplingParams):
    """(streamed text, final text) of one request prefilled and decoded on `host`."""
    adm = host.admit(RequestInput(rid, prompt, sampling, time.time() + 60),
                     local_prefill_max_tokens=10**6)
    assert adm.admitted and adm.local
    streamed, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        for d in host.take_deltas(1.0).deltas:
            streamed.append(d.text)
            if d.done is not None:
                return "".join(streamed), d.done.text
    raise AssertionError("the request never ended")


def test_streamed_deltas_stop_where_the_final_text_is_cut(tiny_loaded):
    engine = make_engine(tiny_loaded)
    host = DecodeHost("decode-stop", dict(model="tiny", num_blocks=32, block_size=16,
                                          device="cpu"))
    try:
        cases = 0
        for i, words in enumerate(("stream me please", "tell me a story", "hello there")):
            prompt = engine.tokenizer.encode(words, add_special_tokens=False)
            free = _free_text(engine, prompt)
            assert _stream(host, f"free-{i}", prompt, FREE) == (free, free)
            for start in (2, 4, 6):
                stop = free[start:start + 3]
                if len(stop) < 3 or not stop.strip():
                    continue
                cases += 1
                streamed, final = _stream(host, f"stop-{i}-{start}", prompt, SamplingParams(
                    max_tokens=16, ignore_eos=True, stop=(stop,)))
                assert final == free[:free.find(stop)]
                assert streamed == final, (free, stop)
        assert cases >= 3
    finally:
        host.shutdown()
