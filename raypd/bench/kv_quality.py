"""`raypd bench kv-quality`: how far a quantized KV pool (int8 / fp8) moves the model from a
full-precision pool, judged against the noise floor of an accepted change (a bf16 pool against a
float32 one) measured over several texts, and the gate `raypd serve` enforces
(workers/kv_gate.py).

Figures, teacher-forced on windows of real English texts (the OS's license texts, one window of
`text_tokens` from each of `texts` texts, in turn: a second window of a text only once every text
gave one) prefilled through the paged pool, every position seeing the same reference prefix
(workers/kv_gate.py Deviation); each is the mean over the texts, with each text's own in `texts`:
  teacher_forced_agreement, mean_kl, p99_kl, ppl_delta_pct
        the quantized pool against the reference pool, same weights. Reference: the pool in the
        weights' own dtype (it stores K and V exactly as computed: float32 for float32 weights)
  noise_floor
        the same four for a bf16 pool against a float32 pool on float32 weights (the checkpoint
        loaded in float32 when the gated weights are bf16: with bf16 weights K and V are bf16
        already, a bf16 pool loses nothing, and that floor would be zero and say nothing), on
        the same texts: per text (`noise_floor.texts`), mean, spread and the upper confidence
        bound the gate reads (kv_gate.NoiseFloor)
  gate_passed, policy_table
        every deviation within the policy's multiple of the floor's upper bound, perplexity up
        < 1%; the verdicts at 6x, 8x and 10x beside the chosen multiple (a policy)
  numerics_version
        the kernel sources' hash the gate was measured under (a changed one asks for a re-run)
Information, not gated: greedy_agreement (free-running greedy continuations: the fraction of
each before its first divergence from the reference's; for the floor too), decode speed and
capacity ratios.

Each window is prefilled one token first, then in `chunk`-token pieces, and every piece reads its
own keys back from the pool: so every query attends to K/V as stored, as a decode step does
(except the first token's attention to itself in a float pool). Within a piece, a quantized
block's scale is the one after the whole piece was written (a decode step sees it grow token by
token: a difference of at most one extra rounding).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kvcache.manager import cdiv
from router.percentiles import percentile
from workers.kv_gate import (
    MIN_FLOOR_TEXTS,
    Deviation,
    GateThresholds,
    NoiseFloor,
    mean_deviation,
    numerics_version,
    record_gate,
)

TEXT_CANDIDATES = tuple(f"/usr/share/common-licenses/{name}" for name in (
    "GPL-3", "GPL-2", "Apache-2.0", "GFDL-1.3", "MPL-2.0", "LGPL-2.1"))
FLOOR_KV_DTYPE, FLOOR_REF_KV_DTYPE = "bfloat16", "float32"   # the accepted change


class TextWindow(NamedTuple):
    """`len(ids)` tokens of the text at `path`, from token `start`."""
    path: str
    start: int
    ids: list[int]


def english_text() -> tuple[str, str]:
    """(path, text) of a real English text that ships with the OS (Debian's license texts)."""
    for path in TEXT_CANDIDATES:
        p = Path(path)
        if p.is_file():
            return path, p.read_text()
    raise ValueError(f"no English text found (looked for {', '.join(TEXT_CANDIDATES)})")


def text_windows(encode, texts: int, tokens: int) -> list[TextWindow]:
    """`texts` windows of `tokens` tokens (`encode`: text -> ids) from TEXT_CANDIDATES: the first
    window of every text, then the second of those long enough, and so on. Raises ValueError
    when the texts on this machine hold fewer."""
    ids = {p: encode(Path(p).read_text()) for p in TEXT_CANDIDATES if Path(p).is_file()}
    out: list[TextWindow] = []
    for k in range(max((len(v) // tokens for v in ids.values()), default=0)):
        out += [TextWindow(p, k * tokens, v[k * tokens:(k + 1) * tokens])
                for p, v in ids.items() if len(v) >= (k + 1) * tokens]
    if len(out) < texts:
        raise ValueError(f"the texts found hold {len(out)} windows of {tokens} tokens, "
                         f"{texts} wanted (looked for {', '.join(TEXT_CANDIDATES)})")
    return out[:texts]


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


class TeacherForced(NamedTuple):
    """One pool against the reference on each window, and its perplexity over all of them."""
    per_text: list[Deviation]
    ppl: float


def teacher_forced(ref, engines: list, windows: list[TextWindow],
                   chunk: int) -> tuple[float, list[TeacherForced]]:
    """The reference pool's perplexity over all the windows' positions, and each of `engines`
    against `ref` (window by window: two windows' log-probabilities are never held at once)."""
    def nll(lp: torch.Tensor, targets: torch.Tensor) -> float:
        return -lp.gather(1, targets.view(-1, 1)).sum().item()

    nll_ref, nlls, per_text, n = 0.0, [0.0] * len(engines), [[] for _ in engines], 0
    for w in windows:
        targets = torch.tensor(w.ids[1:])
        lp_ref = _text_logprobs(ref, w.ids, chunk)
        nll_ref += nll(lp_ref, targets)
        for i, e in enumerate(engines):
            lp = _text_logprobs(e, w.ids, chunk)
            per_text[i].append(deviation(lp_ref, lp, targets))
            nlls[i] += nll(lp, targets)
        n += len(targets)
    return math.exp(nll_ref / n), [TeacherForced(d, math.exp(x / n))
                                   for d, x in zip(per_text, nlls, strict=True)]


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


def _per_text(windows: list[TextWindow], devs: list[Deviation]) -> list[dict]:
    return [{"text": w.path, "start": w.start, "tokens": len(w.ids), **d.to_dict()}
            for w, d in zip(windows, devs, strict=True)]


def run_kv_quality(model: str = "smollm2", kv_dtype: str = "int8", dtype: str = "auto",
                   text_tokens: int = 2048, texts: int = MIN_FLOOR_TEXTS, chunk: int = 256,
                   prompts: int = 32, prompt_tokens: int = 64, max_tokens: int = 64,
                   block_size: int = 16, thresholds: GateThresholds | None = None,
                   threads: int | None = None, record: bool = True) -> dict:
    """Measure `kv_dtype` (any KV dtype the engine takes; the gate concerns the quantized ones)
    and the noise floor on `model` with `dtype` weights over `texts` (>= MIN_FLOOR_TEXTS) text
    windows, judge it, and record it (`record`)."""
    from raypd.replay.report import evidence_from_devices
    from workers.device import cpu_model_name
    from workers.engine import EngineConfig, LLMEngine
    if texts < MIN_FLOOR_TEXTS:
        raise ValueError(f"the noise floor is measured over at least {MIN_FLOOR_TEXTS} texts, "
                         f"got {texts}")
    thresholds = thresholds or GateThresholds()
    if threads:
        torch.set_num_threads(threads)
    loaded = _load(model, dtype)
    info, tokenizer = loaded[2], loaded[1]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    window = min(text_tokens, info.max_position_embeddings - 1)   # engine: n < context
    windows = text_windows(encode, texts, window)
    ids = encode(english_text()[1])      # the greedy prompts: spread over the first text
    stride = max(1, (len(ids) - prompt_tokens) // prompts)
    prompt_ids = [ids[i * stride:i * stride + prompt_tokens] for i in range(prompts)]
    need = max(cdiv(window, block_size), prompts * cdiv(prompt_tokens + max_tokens, block_size))

    def engine(kv: str, weights=loaded) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, dtype=weights[2].dtype, kv_dtype=kv,
                                      block_size=block_size, num_blocks=need + 8,
                                      max_num_seqs=prompts, enable_prefix_caching=False),
                         loaded=weights)

    # the noise floor: bf16 KV against float32 KV, float32 weights; and the format against the
    # pool in the weights' own dtype, same weights (the floor's reference, for float32 weights)
    f32 = loaded if info.dtype == "float32" else _load(model, "float32")
    floor_ref, floor_kv, quant = engine(FLOOR_REF_KV_DTYPE, f32), engine(FLOOR_KV_DTYPE, f32), \
        engine(kv_dtype)
    if f32 is loaded:
        ref = floor_ref
        ppl_ref, (floor_tf, quant_tf) = teacher_forced(ref, [floor_kv, quant], windows, chunk)
    else:
        _, (floor_tf,) = teacher_forced(floor_ref, [floor_kv], windows, chunk)
        ref = engine(info.dtype)
        ppl_ref, (quant_tf,) = teacher_forced(ref, [quant], windows, chunk)
    floor = NoiseFloor(tuple(floor_tf.per_text))
    if floor.mean.mean_kl <= 0:
        raise ValueError(f"the noise floor is zero on {model}: a bf16 KV pool gave the float32 "
                         "pool's distributions exactly, so there is nothing to judge against")
    out_floor_ref, _ = _greedy(floor_ref, prompt_ids, max_tokens)
    out_floor, _ = _greedy(floor_kv, prompt_ids, max_tokens)
    del floor_kv
    out_ref, tps_ref = _greedy(ref, prompt_ids, max_tokens)
    assert ref is not floor_ref or out_ref == out_floor_ref, "the reference's greedy is not stable"
    out_q, tps_q = _greedy(quant, prompt_ids, max_tokens)
    dev = mean_deviation(quant_tf.per_text)
    failures = thresholds.failures(dev, floor)
    result = {
        "model": model, "revision": info.revision, "dtype": info.dtype, "kv_dtype": kv_dtype,
        "kv_dtype_ref": info.dtype, "text_tokens": window, "chunk": chunk,
        **dev.to_dict(),
        "texts": _per_text(windows, quant_tf.per_text),
        "noise_floor": dict(floor.to_dict(), texts=_per_text(windows, floor.texts),
                            kv_dtype=FLOOR_KV_DTYPE, kv_dtype_ref=FLOOR_REF_KV_DTYPE,
                            dtype="float32",
                            greedy_agreement=greedy_agreement(out_floor, out_floor_ref)),
        "noise_floor_multiple": thresholds.noise_floor_multiple,
        "noise_floor_multiple_is": "a policy (workers/kv_gate.py NOISE_FLOOR_MULTIPLE)",
        "kl_multiple": thresholds.noise_floor_multiple ** 2,
        "limits": thresholds.limits(floor),
        "gate_failures": failures,
        "gate_passed": not failures,
        "policy_table": thresholds.policy_table(dev, floor),
        "thresholds": {"max_ppl_delta_pct": thresholds.max_ppl_delta_pct,
                       "noise_floor_multiple": thresholds.noise_floor_multiple},
        "numerics_version": numerics_version(),
        "ppl_ref": ppl_ref, "ppl_quant": quant_tf.ppl,
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
        "cpu_model": cpu_model_name(),
    }
    if record:
        record_gate(result)
    return result


def summary_text(r: dict) -> str:
    """The gate table of a result: the format against the floor's mean, spread and upper bound,
    each figure as a multiple of the floor's logit error (KL: the square root of its ratio), and
    the verdicts at 6x, 8x and 10x beside the chosen policy."""
    fl, ub, kv = r["noise_floor"], r["noise_floor"]["upper_bound"], r["kv_dtype"]
    lines = [f"kv-quality {r['model']}: {kv} KV against {r['kv_dtype_ref']} ({r['dtype']} "
             f"weights), {len(r['texts'])} texts x {r['text_tokens']} tokens on {r['device_name']} "
             f"(cpu {r['cpu_model']}); numerics version {r['numerics_version']}",
             f"noise floor: {fl['kv_dtype']} KV against {fl['kv_dtype_ref']} ({fl['dtype']} "
             f"weights); upper bound: {fl['bound']}",
             f"{'figure':<14}{kv:>11}{'floor mean':>12}{'floor sd':>11}{'floor min':>11}"
             f"{'floor max':>11}{'floor ub':>11}{'x floor ub':>11}"]
    for name in ("disagreement", "mean_kl", "p99_kl"):
        got = 1 - r["teacher_forced_agreement"] if name == "disagreement" else r[name]
        mean = 1 - fl["teacher_forced_agreement"] if name == "disagreement" else fl[name]
        sp = fl["spread"][name]
        ratio = got / ub[name] if name == "disagreement" else math.sqrt(got / ub[name])
        lines.append(f"{name:<14}{got:>11.3g}{mean:>12.3g}{sp['sd']:>11.3g}{sp['min']:>11.3g}"
                     f"{sp['max']:>11.3g}{ub[name]:>11.3g}{ratio:>10.1f}x")
    lines.append(f"{'ppl_delta_pct':<14}{r['ppl_delta_pct']:>+10.2f}%  (limit "
                 f"< {r['thresholds']['max_ppl_delta_pct']:g}%)")
    lines.append("x floor ub: as a multiple of the floor's logit error (KL: sqrt of its ratio, "
                 "KL grows as the error squared)")
    lines.append("verdict by noise-floor multiple (a policy, not a derivation):")
    for label, v in r["policy_table"].items():
        why = "; ".join(v["failures"])
        lines.append(f"  {label:>5} {'PASS' if v['passed'] else 'FAIL'}"
                     f"{'  <- chosen policy' if v['chosen'] else ''}{'  ' + why if why else ''}")
    return "\n".join(lines)
