"""engine.max_step_ms: a step with decodes takes only the prefill tokens that keep it under the
target (workers/step_budget.py), measured on the engine's own steps; off, today's behaviour."""

from __future__ import annotations

import pytest
from conftest import make_engine, random_prompt

from cluster.config import ConfigError, load_config
from workers.request import SamplingParams
from workers.step_budget import StepBudget

# a step costs 2 ms + 1 ms per decode + 0.1 ms per prefill token (no context cost)
COST = (0.002, 0.001, 0.0001, 0.0)   # base, per decode, per prefill token, per context token


def _fed(target_ms: float | None, full: int = 2048, min_chunk: int = 16) -> StepBudget:
    b = StepBudget(target_ms, full, min_chunk)
    for decodes, prefill in [(1, 0), (4, 0), (0, 512), (2, 256), (8, 0), (0, 1024), (3, 64),
                             (1, 900), (6, 100)]:
        b.observe(decodes, 100 * decodes, prefill,
                  COST[0] + COST[1] * decodes + COST[2] * prefill)
    return b


def test_budget_fills_the_target_from_the_measured_cost():
    b = _fed(50.0)
    # 50 ms - 2 ms - 4 decodes x 1 ms = 44 ms of prefill at 0.1 ms a token
    assert b.prefill_tokens(4, 400) == pytest.approx(440, abs=1)
    assert b.capped_steps == 1


def test_budget_never_starves_prefill_and_never_exceeds_the_full_budget():
    b = _fed(3.0)                        # the decodes alone overrun the target
    assert b.prefill_tokens(8, 800) == 16
    assert _fed(10_000.0).prefill_tokens(1, 100) == 2048
    assert _fed(50.0, full=8).prefill_tokens(1, 100) == 8   # min_chunk above the full budget


def test_no_cap_without_decodes_before_the_fit_or_when_off():
    assert _fed(5.0).prefill_tokens(0, 0) == 2048            # no TPOT to protect
    assert StepBudget(5.0, 2048, 16).prefill_tokens(4, 400) == 2048   # no fit yet
    off = _fed(None)
    assert off.prefill_tokens(4, 400) == 2048 and not off.samples


def _mixed_step_chunks(engine, long_prompt: list[int]) -> dict[str, int]:
    """One request decoding, then a long prompt arrives: the next step's chunk sizes."""
    engine.add_request(random_prompt(20, seed=1), SamplingParams(max_tokens=40, ignore_eos=True),
                       request_id="short")
    for _ in range(3):
        engine.step()
    engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id="long")
    chunks = engine.scheduler.schedule().chunks
    return {ch.request.request_id: ch.num_new_tokens for ch in chunks}


def test_mixed_step_prefill_is_capped_under_the_target(tiny_loaded):
    long_prompt = random_prompt(1500, seed=2)
    capped = make_engine(tiny_loaded, num_blocks=256, max_step_ms=50.0,
                         max_num_batched_tokens=2048)
    capped.step_budget.coef = list(COST)            # the cost above, fixed for the test
    capped.step_budget.observe = lambda *a: None
    sizes = _mixed_step_chunks(capped, long_prompt)
    assert sizes["short"] == 1
    assert sizes["long"] == pytest.approx(470, abs=1)   # 50 - 2 - 1 = 47 ms at 0.1 ms a token
    off = make_engine(tiny_loaded, num_blocks=256, max_num_batched_tokens=2048)
    assert _mixed_step_chunks(off, long_prompt) == {"short": 1, "long": 1500}


def test_capped_steps_give_the_same_tokens(tiny_loaded):
    prompts = [random_prompt(n, seed=n) for n in (30, 700, 1200, 900, 90)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [r.output_token_ids for r in make_engine(tiny_loaded).generate(prompts, sp)]
    capped = make_engine(tiny_loaded, max_step_ms=4.0)     # 16 to 20-token chunks beside decodes
    capped.step_budget.coef = list(COST)
    capped.step_budget.observe = lambda *a: None
    got = [r.output_token_ids for r in capped.generate(prompts, sp)]
    assert got == ref
    assert capped.get_stats()["step_budget_capped_steps"] > 0


def test_config_key_reaches_the_engine_and_is_validated():
    cfg = load_config(None, {"engine.max_step_ms": 40})
    assert cfg.to_pd_config().engine["max_step_ms"] == 40
    assert load_config(None).to_pd_config().engine["max_step_ms"] is None
    with pytest.raises(ConfigError, match="max_step_ms"):
        load_config(None, {"engine.max_step_ms": 0})
