"""`raypd bench kv-quality`: what a quantized KV pool (int8 / fp8) costs in quality against the
full-precision pool, on real English text, and the gate that `raypd serve` enforces.

Both engines share the same loaded weights; only the pool differs. Figures:
  ppl_ref / ppl_quant   perplexity of the text, prefilled in chunks through the paged pool (each
                        chunk attends to the earlier ones as the pool stores them)
  mean_kl               mean KL(ref || quant) of the next-token distributions at every position
  greedy_agreement      over N prompts (slices of the text) x T greedy tokens: the mean fraction
                        of each continuation that equals the reference before the first divergence
  decode_tok_s_ratio    quant / ref tokens per second of that greedy batch (after a warm-up)
  capacity_ratio        bytes_per_token_ref / bytes_per_token_quant
The gate passes when ppl_delta_pct <= max_ppl_delta_pct and greedy_agreement >=
min_greedy_agreement; every run is recorded (raypd's cache, kv_gates.json) under the model's
revision and the KV dtype (the latest run wins; it names the weights' dtype it ran with), and `raypd serve` refuses a quantized KV dtype whose recorded gate
fails under its configured thresholds.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from workers.kv_gate import GateThresholds, record_gate

TEXT_CANDIDATES = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2",
                   "/usr/share/common-licenses/Apache-2.0")


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
    """[len(ids) - 1, vocab] float32 log-probabilities of each next token, the text prefilled in
    `chunk`-token pieces through the engine's paged pool (blocks 0.. of a fresh engine)."""
    from workers.model_runner import ScheduledChunk
    runner = engine.runner
    req = engine.make_request(ids, request_id=f"ppl-{len(ids)}")
    table = list(range(-(-len(ids) // engine.cfg.block_size)))
    assert len(table) <= engine.kv.pool.num_blocks, "the text window must fit the pool"
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            req.num_computed_tokens = start
            input_ids, positions, meta, _, _ = runner.prepare([ScheduledChunk(req, n, table)])
            logits = runner._forward(input_ids, positions, meta, list(range(n)))
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return torch.cat(out)[:-1]


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from workers.request import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return [r.output_token_ids for r in reqs], sum(len(r.output_token_ids) for r in reqs) / dt


def run_kv_quality(model: str = "smollm2", kv_dtype: str = "int8", dtype: str = "auto",
                   text_tokens: int = 2048, chunk: int = 256, prompts: int = 32,
                   prompt_tokens: int = 64, max_tokens: int = 64, block_size: int = 16,
                   thresholds: GateThresholds | None = None, threads: int | None = None,
                   record: bool = True) -> dict:
    from raypd.replay.report import evidence_from_devices
    thresholds = thresholds or GateThresholds()
    from workers.engine import EngineConfig, LLMEngine
    from workers.kv_quant import is_quantized
    from workers.model_loader import load_model
    if not is_quantized(kv_dtype):
        raise ValueError(f"--kv-dtype must be a quantized dtype (int8, fp8), got {kv_dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, dtype)
    info = loaded[2]
    text_path, text = english_text()
    ids = loaded[1].encode(text, add_special_tokens=False)
    window = min(text_tokens, info.max_position_embeddings - 1, len(ids))   # engine: n < context
    text_ids = ids[:window]
    stride = max(1, (len(ids) - prompt_tokens) // prompts)
    prompt_ids = [ids[i * stride:i * stride + prompt_tokens] for i in range(prompts)]
    need = max(-(-window // block_size), prompts * -(-(prompt_tokens + max_tokens) // block_size))

    def engine(kv: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, dtype=dtype, kv_dtype=kv, block_size=block_size,
                                      num_blocks=need + 8, max_num_seqs=prompts,
                                      enable_prefix_caching=False), loaded=loaded)

    ref, quant = engine(info.dtype), engine(kv_dtype)
    lp_ref, lp_q = _text_logprobs(ref, text_ids, chunk), _text_logprobs(quant, text_ids, chunk)
    targets = torch.tensor(text_ids[1:])
    nll_ref = -lp_ref.gather(1, targets.view(-1, 1)).mean().item()
    nll_q = -lp_q.gather(1, targets.view(-1, 1)).mean().item()
    kl = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).mean().item()
    del lp_ref, lp_q
    out_ref, tps_ref = _greedy(ref, prompt_ids, max_tokens)
    out_q, tps_q = _greedy(quant, prompt_ids, max_tokens)
    agreement = sum(common_prefix_fraction(a, b) for a, b in zip(out_q, out_ref, strict=True)) \
        / len(out_ref)
    ppl_ref, ppl_q = math.exp(nll_ref), math.exp(nll_q)
    delta = 100 * (ppl_q - ppl_ref) / ppl_ref
    result = {
        "model": model, "revision": info.revision, "dtype": info.dtype, "kv_dtype": kv_dtype,
        "kv_dtype_ref": info.dtype, "text": text_path, "text_tokens": window, "chunk": chunk,
        "ppl_ref": ppl_ref, "ppl_quant": ppl_q, "ppl_delta_pct": delta,
        "greedy_agreement": agreement, "greedy_prompts": prompts, "greedy_tokens": max_tokens,
        "exact_greedy_matches": sum(a == b for a, b in zip(out_q, out_ref, strict=True)),
        "mean_kl": kl, "bytes_per_token_ref": ref.kv_bytes_per_token,
        "bytes_per_token_quant": quant.kv_bytes_per_token,
        "capacity_ratio": ref.kv_bytes_per_token / quant.kv_bytes_per_token,
        "decode_tok_s_ref": tps_ref, "decode_tok_s_quant": tps_q,
        "decode_tok_s_ratio": tps_q / tps_ref,
        "attention_kernel_quant": quant.runner.attention_kernel,
        "attention_kernel_ref": ref.runner.attention_kernel,
        "evidence": evidence_from_devices([ref.device.type, quant.device.type]),
        "device": quant.device.type, "device_name": quant.get_stats()["device_name"],
        "thresholds": asdict(thresholds),
        "gate_passed": thresholds.passes(delta, agreement),
    }
    if record:
        record_gate(result)
    return result


