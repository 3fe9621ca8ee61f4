"""Kernel vs SDPA: raypd's native prefill attention against torch's SDPA on the same causal prefill.

One prompt of `tokens` tokens attends to itself (no cached prefix), a model's heads (q [T, H, D],
k and v [T, Hkv, D], random, seeded), in one dtype, on this process's threads. The kernel is the
one the engine's prefill takes for that dtype (workers/attention.py `_prefill_attention`: bf16
-> csrc/attention_bf16.cpp, float32 -> csrc/attention_f32.cpp), called as the engine calls it.
The baseline, `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, is tuned as
much: each side gets its inputs in its own best layout, made before the clock starts (SDPA:
contiguous [1, H, T, D]), and SDPA runs two ways, `enable_gqa=True` and with K/V expanded to
every query head beforehand, the faster of the two (by median) being the baseline. Timing:
one warm-up call each, then `repeats` samples of each side interleaved (kernel, SDPA, SDPA
expanded, kernel, ...: a drift of the machine hits all three), a sample being `calls` calls on
the same tensors (warm caches for every side alike), reported per call, best and median.
The kernel's output is checked against SDPA's in float32 (`max_abs_diff`); a kernel that
disagrees beyond `TOLERANCE[dtype]` gets no speed-up (`agrees: false`, speedups None): a fast
wrong answer is no figure. Where the kernel does not apply (another CPU, a GPU, no compiler,
`RAYPD_NATIVE_KERNELS=0`) the entry says so and its speed-ups are None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers import kernels

# max |kernel - SDPA in float32| allowed: bf16 outputs carry ~3 significant digits
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


@dataclass(frozen=True)
class AttentionShape:
    """The heads of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA: query heads a multiple of KV heads"


def _kernel(dtype: torch.dtype) -> tuple[str, Callable | None]:
    """(name, call) of the native prefill kernel the engine takes for `dtype` on this machine."""
    if dtype == torch.bfloat16:
        return "attention_bf16", kernels.prefill_attention_bf16
    if dtype == torch.float32:
        return "attention_f32", kernels.prefill_attention_f32
    return "none", None


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                enable_gqa: bool) -> torch.Tensor:
    """SDPA on [1, H, T, D] queries and [1, Hkv or H, T, D] keys/values, causal."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=enable_gqa)


def _per_call_s(f: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls


def _summary(samples: list[float]) -> dict:
    return {"best_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples),
            "samples_ms": [1e3 * s for s in samples]}


def bench_one(shape: AttentionShape, tokens: int, dtype: torch.dtype, repeats: int,
              calls: int = 8, seed: int = 0) -> dict:
    """Kernel and SDPA on one prompt of `tokens` tokens (see the module doc)."""
    assert repeats >= 1 and calls >= 1
    g = torch.Generator().manual_seed(seed)
    h, h_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q, k, v = (torch.randn(tokens, n, d, generator=g).to(dtype) for n in (h, h_kv, h_kv))
    scale = d ** -0.5
    # SDPA's layout, made before any clock: [1, H, T, D] contiguous, and K/V expanded
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    ke, ve = (t.repeat_interleave(h // h_kv, dim=1) for t in (ks, vs))
    sides: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa_gqa": lambda: sdpa_causal(qs, ks, vs, scale, enable_gqa=True),
        "sdpa_expanded": lambda: sdpa_causal(qs, ke, ve, scale, enable_gqa=False)}
    name, call = _kernel(dtype)
    out: dict = {"tokens": tokens, "kernel": name}
    with torch.inference_mode():
        reference = sdpa_causal(*(t.float() for t in (qs, ks, vs)), scale, enable_gqa=True)
        reference = reference[0].transpose(0, 1)                     # [T, H, D]
        got = call(q, k, v, scale) if call is not None else None
        if got is None:
            out.update(kernel_applies=False, agrees=None, max_abs_diff=None)
        else:
            diff = float((got.float() - reference).abs().max())
            out.update(kernel_applies=True, max_abs_diff=diff, agrees=diff <= TOLERANCE[dtype])
            sides = {"kernel": lambda: call(q, k, v, scale), **sides}
        for f in sides.values():     # warm-up
            f()
        samples: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(repeats):
            for s, f in sides.items():
                samples[s].append(_per_call_s(f, calls))
    for s, xs in samples.items():
        out[s] = _summary(xs)
    baseline = min(("sdpa_gqa", "sdpa_expanded"), key=lambda s: out[s]["median_ms"])
    out["sdpa_baseline"] = baseline
    ok = out["agrees"] is True
    out["speedup_median"] = out[baseline]["median_ms"] / out["kernel"]["median_ms"] \
        if ok else None
    out["speedup_best"] = out[baseline]["best_ms"] / out["kernel"]["best_ms"] if ok else None
    return out


def run_prefill_attention_bench(shape: AttentionShape, dtypes: tuple[torch.dtype, ...],
                                lengths: tuple[int, ...] = (512, 2048), repeats: int = 5,
                                calls: int = 8) -> dict:
    """Every (dtype, length): `bench_one`. Keyed by dtype name, then by length."""
    result: dict = {"shape": {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
                              "head_dim": shape.head_dim},
                    "threads": torch.get_num_threads(), "repeats": repeats,
                    "calls_per_sample": calls}
    for dtype in dtypes:
        result[str(dtype).removeprefix("torch.")] = {
            str(n): bench_one(shape, n, dtype, repeats, calls) for n in lengths}
    return result
