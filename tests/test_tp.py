"""Tensor-parallel engines (issue 61): greedy output equal to one rank and to transformers'
generate() at every TP size the heads allow, KV heads split or replicated; whole pages read and
written across ranks; a refused TP size names its rule; a dead rank fails the step, not hangs."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import hf_greedy

from workers.engine import LLMEngine
from workers.engine_config import EngineConfig
from workers.random_model import build_random
from workers.request import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 30, 31, 32, 33, 34, 35, 36, 37, 38],
           [100, 101, 102], list(range(40, 90))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model: str, tp: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", tp=tp, num_blocks=64,
                                  num_threads=1, **kw))


def _greedy(engine: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    reqs = engine.generate(prompts, GREEDY)
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def reference_outputs():
    """model -> TP=1 greedy outputs, checked once against transformers' generate()."""
    out = {}
    for model in ("random:llama-test-kv8", "random:llama-test"):
        engine = _engine(model, 1)
        got = _greedy(engine)
        stock = build_random(model, "float32", torch.device("cpu"))[0]   # the engine's own
        for prompt, tokens in zip(PROMPTS, got, strict=True):              # is released
            assert tokens == hf_greedy(stock, prompt, GREEDY.max_tokens)
        out[model] = got
        engine.close()
    return out


@pytest.mark.parametrize("model,tp", [("random:llama-test-kv8", 2),
                                      ("random:llama-test-kv8", 4),
                                      ("random:llama-test", 4)],   # 2 KV heads: replicated
                         ids=["kv8-tp2", "kv8-tp4", "kv2-tp4-replicated"])
def test_tp_greedy_equals_one_rank_and_generate(reference_outputs, model, tp):
    engine = _engine(model, tp)
    try:
        assert engine.tp_group is not None and engine.tp_group.tp == tp
        assert _greedy(engine) == reference_outputs[model]
        assert engine.tp_group.steps_sent == engine.stats.steps   # one message a step
        engine.check_invariants()
    finally:
        engine.close()


def test_tp_over_gloo_gives_the_same_tokens(reference_outputs):
    engine = _engine("random:llama-test-kv8", 2, tp_allreduce="gloo")
    try:
        assert type(engine.tp_group.comm).__name__ == "GlooComm"
        assert _greedy(engine) == reference_outputs["random:llama-test-kv8"]
    finally:
        engine.close()


def test_tp_vocab_split_lm_head_gives_the_same_tokens(reference_outputs):
    engine = LLMEngine(EngineConfig(model="random:llama-test-kv8", dtype="float32", tp=2,
                                    num_blocks=64, num_threads=1), tp_lm_head="vocab")
    try:
        assert engine.runner.tp.lm_head == "vocab"
        assert _greedy(engine) == reference_outputs["random:llama-test-kv8"]
    finally:
        engine.close()


def test_tp_pages_read_whole_and_written_back_to_every_rank():
    one = _engine("random:llama-test", 1)
    tp = _engine("random:llama-test", 4)     # each KV head on two ranks
    try:
        prompt = list(range(3, 3 + 40))
        _greedy(one, [prompt])
        _greedy(tp, [prompt])
        ids = [0, 1, 2]
        whole = tp.runner.read_pages(ids)
        assert whole.shape == one.runner.read_pages(ids).shape
        torch.testing.assert_close(whole, one.runner.read_pages(ids), rtol=1e-5, atol=1e-5)
        # written to other blocks, read back the same from every rank's heads
        tp.runner.write_pages([10, 11, 12], whole)
        assert torch.equal(tp.runner.read_pages([10, 11, 12]), whole)
    finally:
        one.close()
        tp.close()


def test_tp_size_that_does_not_divide_the_heads_is_refused_with_its_rule():
    with pytest.raises(ValueError, match="does not divide the model's 8 query heads"):
        _engine("random:llama-test-kv8", 3)
    with pytest.raises(ValueError, match="tp must be between 1 and 8"):
        EngineConfig(model="random:llama-test", tp=9).validate()


def test_a_killed_rank_fails_the_step_instead_of_hanging():
    from workers.kernels.tp_comm import CommError
    engine = _engine("random:llama-test-kv8", 2)
    try:
        _greedy(engine, PROMPTS[:1])
        os.kill(engine.tp_group.ranks[0].pid, signal.SIGKILL)
        engine.tp_group.ranks[0].join(5)
        with pytest.raises(CommError):
            _greedy(engine, PROMPTS[1:2])
    finally:
        engine.close()


@pytest.mark.realmodel
def test_smollm2_tp3_greedy_equals_tp1_and_generate():
    """SmolLM2-135M: 9 query heads over 3 KV heads, one KV head a rank."""
    from workers.model_loader import load_model
    one = _engine("smollm2", 1)
    ids = one.tokenizer("The capital of France is").input_ids
    try:
        ref = _greedy(one, [ids])[0]
    finally:
        one.close()
    assert ref == hf_greedy(load_model("smollm2", "float32")[0], ids, GREEDY.max_tokens)
    tp = _engine("smollm2", 3)
    try:
        assert _greedy(tp, [ids])[0] == ref
    finally:
        tp.close()
