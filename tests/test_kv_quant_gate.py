"""The quantized engine against stock transformers, on the perplexity criterion of the kv-quality
gate (workers/kv_gate.py: perplexity up < 1%; the gate's other criteria are judged against a
bf16 noise floor by `raypd bench kv-quality`, tests/test_kv_gate.py).

This checks the int8 engine against transformers itself (not against raypd's float engine): its
perplexity on real English text is within the gate's 1 % of what stock transformers computes,
and its greedy continuations start as transformers' do (free-running greedy diverges early under
any KV rounding, bf16 included, so only the start is asserted).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from raypd.bench.kv_quality import _text_logprobs, english_text
from workers.kv_gate import GateThresholds
from workers.request import SamplingParams


@pytest.mark.realmodel
def test_int8_smollm2_perplexity_is_within_the_gate_of_transformers():
    from workers.engine import EngineConfig, LLMEngine
    from workers.model_loader import load_model
    loaded = load_model("smollm2", "float32")
    reference = load_model("smollm2", "float32")[0]
    _, text = english_text()
    # the gate's window (bench kv-quality --text-tokens 2048): shorter ones are noisier
    ids = loaded[1].encode(text, add_special_tokens=False)[:2048]
    engine = LLMEngine(EngineConfig(model="smollm2", dtype="float32", kv_dtype="int8",
                                    num_blocks=136, enable_prefix_caching=False), loaded=loaded)
    lp_quant = _text_logprobs(engine, ids, 256)
    with torch.inference_mode():
        logits = reference(torch.tensor([ids])).logits[0].float()
    lp_ref = torch.log_softmax(logits, dim=-1)[:-1]
    targets = torch.tensor(ids[1:]).view(-1, 1)
    ppl_ref = math.exp(-lp_ref.gather(1, targets).mean().item())
    ppl_quant = math.exp(-lp_quant.gather(1, targets).mean().item())
    delta_pct = 100 * (ppl_quant - ppl_ref) / ppl_ref
    assert abs(delta_pct) <= GateThresholds().max_ppl_delta_pct, (ppl_ref, ppl_quant)
    # greedy: free-running continuations diverge under any KV rounding; the start must agree
    prompts = [ids[i:i + 32] for i in (0, 64, 128)]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids[:2] == hf_greedy(reference, p, 8)[:2]
    engine.check_invariants()
