"""A prefill's last piece of at most budget / 8 tokens joins the chunk before it
(workers/scheduler.py TAIL_DIVISOR): no step is spent on a few prompt tokens; a larger rest
stays a chunk of its own, and under a step-time target the cap stays a cap."""

from __future__ import annotations

from conftest import hf_greedy, make_engine, random_prompt

from workers.request import SamplingParams
from workers.scheduler import TAIL_DIVISOR

BUDGET = 64                       # tail: 8 tokens
TAIL = BUDGET // TAIL_DIVISOR


def _chunks(engine) -> dict[str, int]:
    return {ch.request.request_id: ch.num_new_tokens for ch in engine.scheduler.schedule().chunks}


def _beside_a_decode(engine, prompt_len: int) -> dict[str, int]:
    """One request decoding, then a prompt arrives: the next step's chunk sizes."""
    engine.add_request(random_prompt(20, seed=1), SamplingParams(max_tokens=40, ignore_eos=True),
                       request_id="short")
    for _ in range(3):
        engine.step()
    engine.add_request(random_prompt(prompt_len, seed=2),
                       SamplingParams(max_tokens=4, ignore_eos=True), request_id="long")
    return _chunks(engine)


def test_a_small_rest_is_computed_with_the_chunk_before_it(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_batched_tokens=BUDGET)
    # the decode takes 1 token of the budget: 63 + a rest of TAIL -> all in this step
    assert _beside_a_decode(engine, BUDGET - 1 + TAIL) == {"short": 1, "long": BUDGET - 1 + TAIL}


def test_a_rest_above_the_tail_is_a_chunk_of_its_own(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_batched_tokens=BUDGET)
    assert _beside_a_decode(engine, BUDGET + TAIL) == {"short": 1, "long": BUDGET - 1}


def test_a_running_prefill_takes_its_tail_too(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_batched_tokens=BUDGET)
    engine.add_request(random_prompt(2 * BUDGET + TAIL, seed=3),
                       SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    engine.step()                         # its first chunk: BUDGET tokens
    assert _chunks(engine) == {"a": BUDGET + TAIL}


def test_no_tail_under_a_step_time_target(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_batched_tokens=BUDGET,
                         max_step_ms=10_000.0)
    assert _beside_a_decode(engine, BUDGET - 1 + TAIL) == {"short": 1, "long": BUDGET - 1}


def test_tails_give_the_reference_tokens(tiny_loaded, tiny_reference):
    engine = make_engine(tiny_loaded, max_num_batched_tokens=16)     # tail: 2 tokens
    prompts = [random_prompt(n, seed=50 + n) for n in (17, 18, 33, 34, 50, 5)]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for r in reqs:
        assert r.output_token_ids == hf_greedy(tiny_reference, r.prompt_token_ids, 12)
    assert engine.kv.pool.counts()["referenced"] == 0
