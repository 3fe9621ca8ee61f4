"""`raypd bench kv-quality`: how far a quantized KV pool (int8 / fp8) moves the model from a
full-precision pool, judged against the noise floor of an accepted change (a bf16 pool against a
float32 one), and the gate `raypd serve` enforces (workers/kv_gate.py).

Figures, teacher-forced on a real English text (the OS's license texts) prefilled through the
paged pool, every position seeing the same reference prefix (workers/kv_gate.py Deviation):
  teacher_forced_agreement, mean_kl, p99_kl, ppl_delta_pct
        the quantized pool against the reference pool, same weights. Reference: the pool in the
        weights' own dtype (it stores K and V exactly as computed: float32 for float32 weights)
  noise_floor
        the same four for a bf16 pool against a float32 pool on float32 weights (the checkpoint
        loaded in float32 when the gated weights are bf16: with bf16 weights K and V are bf16
        already, a bf16 pool loses nothing, and that floor would be zero and say nothing)
  gate_passed
        every deviation within the stated multiple of the floor, perplexity up < 1%
Information, not gated: greedy_agreement (free-running greedy continuations: the fraction of
each before its first divergence from the reference's; for the floor too), decode speed and
capacity ratios.

The text is prefilled one token first, then in `chunk`-token pieces, and every piece reads its
own keys back from the pool: so every query attends to K/V as stored, as a decode step does
(except the first token's attention to itself in a float pool). Within a piece, a quantized
block's scale is the one after the whole piece was written (a decode step sees it grow token by
token: a difference of at most one extra rounding).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from kvcache.manager import cdiv
from router.percentiles import percentile
from workers.kv_gate import Deviation, GateThresholds, record_gate

TEXT_CANDIDATES = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2",
                   "/usr/share/common-licenses/Apache-2.0")
FLOOR_KV_DTYPE, FLOOR_REF_KV_DTYPE = "bfloat16", "float32"   # the accepted change


def english_text() -> tuple[str, str]:
    """(path, text) of a real English text that ships with the OS (Debian's license texts)."""
    for path in TEXT_CANDIDATES:
        p = Path(path)
        if p.is_file():
            return path, p.read_text()
    raise ValueError(f"no English text found (looked for {', '.join(TEXT_CANDIDATES)})")


def common_prefix_fraction(a: list[int], b: list[int]) -> float:
    """Fraction of `b` (the reference) that `a` reproduces before the first divergence."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / len(b) if b else 1.0


def _text_logprobs(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """[len(ids) - 1, vocab] float32 log-probabilities of each next token, the text prefilled
    through the engine's paged pool (blocks 0.. of a fresh engine): one token, then `chunk`-token
    pieces, each attending to its own keys as the pool stored them."""
    from workers.scheduler_output import ScheduledChunk, SchedulerOutput
    runner = engine.runner
    req = engine.inputs.make_request(ids, request_id=f"ppl-{len(ids)}")
    table = list(range(cdiv(len(ids), engine.cfg.block_size)))
    assert len(table) <= engine.kv.pool.num_blocks, "the text window must fit the pool"
    out = []
    starts = [0, *range(1, len(ids), chunk)]
    with torch.inference_mode():
        for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
            n = end - start
            req.num_computed_tokens = start
            input_ids, positions, meta, _, _ = runner.prepare(SchedulerOutput([ScheduledChunk(req, n, table)]))
            logits = runner._forward(input_ids, positions, meta, list(range(n)))
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    return torch.cat(out)[:-1]


def deviation(lp_ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> Deviation:
    """The teacher-forced figures of log-probabilities `lp` against `lp_ref` ([N, vocab] each)
    with the text's next tokens `targets` [N]."""
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    agree = (lp_ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
    ppl_ref, ppl = perplexity(lp_ref, targets), perplexity(lp, targets)
    return Deviation(teacher_forced_agreement=agree, mean_kl=kl.mean().item(),
                     p99_kl=percentile(kl.tolist(), 99),
                     ppl_delta_pct=100 * (ppl - ppl_ref) / ppl_ref, positions=len(targets))


def perplexity(lp: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean negative log-probability of `targets` [N] under `lp` [N, vocab]."""
    return math.exp(-lp.gather(1, targets.view(-1, 1)).mean().item())


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from workers.request import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return [r.output_token_ids for r in reqs], sum(len(r.output_token_ids) for r in reqs) / dt


def greedy_agreement(outs: list[list[int]], refs: list[list[int]]) -> float:
    """Mean fraction of each free-running continuation before its first divergence."""
    return sum(common_prefix_fraction(a, b) for a, b in zip(outs, refs, strict=True)) / len(refs)


def _load(model: str, dtype: str):
    from workers.model_loader import load_model
    return load_model(model, dtype)


def run_kv_quality(model: str = "smollm2", kv_dtype: str = "int8", dtype: str = "auto",
                   text_tokens: int = 2048, chunk: int = 256, prompts: int = 32,
                   prompt_tokens: int = 64, max_tokens: int = 64, block_size: int = 16,
                   thresholds: GateThresholds | None = None, threads: int | None = None,
                   record: bool = True) -> dict:
    """Measure `kv_dtype` (any KV dtype the engine takes; the gate concerns the quantized ones)
    and the noise floor on `model` with `dtype` weights, judge it, and record it (`record`)."""
    from raypd.replay.report import evidence_from_devices
    from workers.engine import EngineConfig, LLMEngine
    thresholds = thresholds or GateThresholds()
    if threads:
        torch.set_num_threads(threads)
    loaded = _load(model, dtype)
    info = loaded[2]
    text_path, text = english_text()
    ids = loaded[1].encode(text, add_special_tokens=False)
    window = min(text_tokens, info.max_position_embeddings - 1, len(ids))   # engine: n < context
    text_ids = ids[:window]
    targets = torch.tensor(text_ids[1:])
    stride = max(1, (len(ids) - prompt_tokens) // prompts)
    prompt_ids = [ids[i * stride:i * stride + prompt_tokens] for i in range(prompts)]
    need = max(cdiv(window, block_size), prompts * cdiv(prompt_tokens + max_tokens, block_size))

    def engine(kv: str, weights=loaded) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, dtype=weights[2].dtype, kv_dtype=kv,
                                      block_size=block_size, num_blocks=need + 8,
                                      max_num_seqs=prompts, enable_prefix_caching=False),
                         loaded=weights)

    # the noise floor: bf16 KV against float32 KV, float32 weights
    f32 = loaded if info.dtype == "float32" else _load(model, "float32")
    floor_ref, floor_kv = engine(FLOOR_REF_KV_DTYPE, f32), engine(FLOOR_KV_DTYPE, f32)
    lp_floor_ref = _text_logprobs(floor_ref, text_ids, chunk)
    floor = deviation(lp_floor_ref, _text_logprobs(floor_kv, text_ids, chunk), targets)
    if floor.mean_kl <= 0:
        raise ValueError(f"the noise floor is zero on {model}: a bf16 KV pool gave the float32 "
                         "pool's distributions exactly, so there is nothing to judge against")
    out_floor_ref, _ = _greedy(floor_ref, prompt_ids, max_tokens)
    out_floor, _ = _greedy(floor_kv, prompt_ids, max_tokens)
    del floor_kv
    # the format against the pool in the weights' own dtype, same weights
    if f32 is loaded:
        ref, lp_ref, out_ref_done = floor_ref, lp_floor_ref, out_floor_ref
    else:
        del floor_ref, lp_floor_ref
        ref, out_ref_done = engine(info.dtype), None
        lp_ref = _text_logprobs(ref, text_ids, chunk)
    quant = engine(kv_dtype)
    lp_q = _text_logprobs(quant, text_ids, chunk)
    dev = deviation(lp_ref, lp_q, targets)
    ppl_ref, ppl_q = perplexity(lp_ref, targets), perplexity(lp_q, targets)
    del lp_ref, lp_q
    out_ref, tps_ref = _greedy(ref, prompt_ids, max_tokens)
    assert out_ref_done is None or out_ref == out_ref_done, "the reference's greedy is not stable"
    out_q, tps_q = _greedy(quant, prompt_ids, max_tokens)
    failures = thresholds.failures(dev, floor)
    result = {
        "model": model, "revision": info.revision, "dtype": info.dtype, "kv_dtype": kv_dtype,
        "kv_dtype_ref": info.dtype, "text": text_path, "text_tokens": window, "chunk": chunk,
        **dev.to_dict(),
        "noise_floor": dict(floor.to_dict(), kv_dtype=FLOOR_KV_DTYPE,
                            kv_dtype_ref=FLOOR_REF_KV_DTYPE, dtype="float32",
                            greedy_agreement=greedy_agreement(out_floor, out_floor_ref)),
        "noise_floor_multiple": thresholds.noise_floor_multiple,
        "kl_multiple": thresholds.noise_floor_multiple ** 2,
        "limits": thresholds.limits(floor),
        "gate_failures": failures,
        "gate_passed": not failures,
        "thresholds": {"max_ppl_delta_pct": thresholds.max_ppl_delta_pct,
                       "noise_floor_multiple": thresholds.noise_floor_multiple},
        "ppl_ref": ppl_ref, "ppl_quant": ppl_q,
        "greedy_agreement": greedy_agreement(out_q, out_ref),
        "greedy_prompts": prompts, "greedy_tokens": max_tokens,
        "exact_greedy_matches": sum(a == b for a, b in zip(out_q, out_ref, strict=True)),
        "bytes_per_token_ref": ref.kv_bytes_per_token,
        "bytes_per_token_quant": quant.kv_bytes_per_token,
        "capacity_ratio": ref.kv_bytes_per_token / quant.kv_bytes_per_token,
        "decode_tok_s_ref": tps_ref, "decode_tok_s_quant": tps_q,
        "decode_tok_s_ratio": tps_q / tps_ref,
        "attention_kernel_quant": quant.runner.attention_kernel,
        "attention_kernel_ref": ref.runner.attention_kernel,
        "evidence": evidence_from_devices([ref.device.type, quant.device.type]),
        "device": quant.device.type, "device_name": quant.get_stats()["device_name"],
    }
    if record:
        record_gate(result)
    return result
