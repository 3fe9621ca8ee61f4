"""`raypd bench engine`: the paged engine and stock transformers `generate()`, side by side.

Both run the same weights in the same process, one after the other, on the same inputs.
"""

from __future__ import annotations

import copy
import random
import time

import torch

from workers.engine import EngineConfig, LLMEngine
from workers.request import SamplingParams


def _hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for `generate()` on a left-padded static batch, exactly `new_tokens` each."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def _engine_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
                ) -> tuple[float, float]:
    """(wall seconds, seconds from the last first-token to the end) for one batch."""
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, max_tokens, strict=True)]
    t_first = None
    while engine.has_unfinished():
        engine.step()
        if t_first is None and all(r.first_token_time for r in reqs):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    return t1 - t0, t1 - (t_first or t1)


def run_engine_bench(model: str = "smollm2", quick: bool = False,
                     threads: int | None = None) -> dict:
    from workers.model_loader import load_model
    if threads:
        torch.set_num_threads(threads)
    hf_model, tok, info = load_model(model)
    loaded = (copy.deepcopy(hf_model), tok, info)   # the engine swaps in its own attention
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rng = random.Random(0)
    vocab = min(info.vocab_size, 30000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    plen, new = (256, 32) if quick else (512, 64)
    n_mixed, (lo_p, hi_p), (lo_o, hi_o) = (16, (64, 512), (8, 64)) if quick \
        else (32, (64, 1024), (16, 128))
    prefix_len = 512 if quick else 1024
    total_tokens = 16 * (plen + new) + hi_p * 16 + 4096
    engine = LLMEngine(EngineConfig(model=model, num_blocks=-(-total_tokens // 16) + 64,
                                    max_num_batched_tokens=2048, max_num_seqs=64,
                                    enable_prefix_caching=False), loaded=loaded)
    out: dict = {"model": model, "quick": quick, "threads": torch.get_num_threads(),
                 "prompt_tokens": plen, "new_tokens": new}

    for b in (1, 16):
        batch = [prompt(plen) for _ in range(b)]
        t_full = _hf_generate(hf_model, batch, new, pad)
        t_pre = _hf_generate(hf_model, batch, 1, pad)
        out[f"hf_decode_tok_s_b{b}"] = b * (new - 1) / max(t_full - t_pre, 1e-9)
        _, t_dec = _engine_run(engine, batch, [new] * b)
        out[f"engine_decode_tok_s_b{b}"] = b * (new - 1) / max(t_dec, 1e-9)
    out["decode_ratio_b16"] = out["engine_decode_tok_s_b16"] / out["hf_decode_tok_s_b16"]

    mixed = [(prompt(rng.randint(lo_p, hi_p)), rng.randint(lo_o, hi_o)) for _ in range(n_mixed)]
    t_hf = 0.0
    for i in range(0, n_mixed, 16):
        group = mixed[i:i + 16]
        t_hf += _hf_generate(hf_model, [p for p, _ in group], max(o for _, o in group), pad)
    t_eng, _ = _engine_run(engine, [p for p, _ in mixed], [o for _, o in mixed])
    out.update(hf_mixed_s=t_hf, engine_mixed_s=t_eng, throughput_ratio_mixed=t_hf / t_eng)

    # prefix reuse: a fresh engine with prefix caching on, same weights
    engine.check_invariants()
    cached = LLMEngine(EngineConfig(model=model, num_blocks=(prefix_len + 256) // 16 * 4,
                                    enable_prefix_caching=True), loaded=loaded)
    shared = prompt(prefix_len)
    ttft = []
    for _ in range(2):
        r = cached.add_request(shared + prompt(64), SamplingParams(max_tokens=1))
        while cached.has_unfinished():
            cached.step()
        ttft.append(r.lifecycle.ttft_s)
    cached.check_invariants()
    out.update(ttft_cold_s=ttft[0], ttft_hit_s=ttft[1], prefix_ttft_ratio=ttft[1] / ttft[0],
               prefix_hit_tokens=r.lifecycle.cached_tokens)
    return out
