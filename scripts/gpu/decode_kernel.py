"""First-contact step (d), before the engine bench: the Triton paged decode attention
(workers/kernels/triton_decode.py, reading the pool in place) against the torch gather path
(workers/attention.py `_decode_attention_torch`, what cuda ran before) on one Llama-3-8B-shaped
layer: 32 query heads over 8 KV heads, head_dim 128, bfloat16 pool of 16-token blocks, random
block tables, rows of slightly different lengths (none a multiple of the block size but the
longest). For batch 1/16/64 at context 1k/4k: each path's time (CUDA events, median of
REPEATS after warm-up), the KV bytes each row set holds per second of it, and each path's max
abs error against the gather path computed in float32 on the same stored values.

    python scripts/gpu/decode_kernel.py OUT.json   (RAYPD_GPU_DEVICE=cpu: the dry run's
                                                    stand-in: a small shape, torch path only)

ok is False when Triton does not run on cuda (the reason is in the JSON) or its error is over
TOLERANCE; the times are reported, not judged."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from step_io import device, dry_run, run_step  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16     # Llama-3-8B's attention
BATCHES, CONTEXTS = (1, 16, 64), (1024, 4096)
REPEATS, WARMUP = 20, 3
TOLERANCE = 2e-2                                      # bfloat16 output against float32


def timed_ms(fn, dev: torch.device) -> float:
    """Median milliseconds of `fn` (CUDA events around each call; wall clock on the CPU)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> dict:
    from workers.attention import DecodeGroup, LayerKV, _decode_attention_torch
    from workers.kernels import triton_decode
    dev = torch.device(device())
    heads, kv_heads, head_dim = (HEADS, KV_HEADS, HEAD_DIM) if not dry_run() else (8, 2, 64)
    batches, contexts = (BATCHES, CONTEXTS) if not dry_run() else ((1, 4), (64, 200))
    reason = triton_decode.unavailable_reason() if dev.type == "cuda" else "dry run: no cuda"
    use_triton = reason == ""
    g = torch.Generator(device=dev).manual_seed(0)
    num_blocks = max(batches) * -(-max(contexts) // BLOCK) + 1   # every row its own blocks
    k = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g, device=dev,
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv, kv32 = LayerKV(k, v), LayerKV(k.float(), v.float())
    scale = head_dim ** -0.5
    cases, worst = [], 0.0
    for ctx in contexts:
        for b in batches:
            width = -(-ctx // BLOCK)
            tables = torch.randperm(num_blocks, generator=g, device=dev)[:b * width].view(b, width)
            lens = torch.tensor([ctx - (r % 7) for r in range(b)], device=dev)
            group = DecodeGroup(0, b, tables, lens, ctx)
            q = torch.randn(b, heads, head_dim, generator=g, device=dev, dtype=torch.bfloat16)
            ref = _decode_attention_torch(q.float(), kv32, group, scale, None)
            gather_out = _decode_attention_torch(q, kv, group, scale, None)
            kv_bytes = int(lens.sum()) * kv_heads * head_dim * 2 * k.element_size()
            case = {"batch": b, "context": ctx,
                    "gather_max_abs_err": (gather_out.float() - ref).abs().max().item(),
                    "gather_ms": round(timed_ms(
                        lambda q=q, group=group: _decode_attention_torch(q, kv, group, scale,
                                                                         None), dev), 4)}
            case["gather_kv_gb_s"] = round(kv_bytes / case["gather_ms"] / 1e6, 1)
            if use_triton:
                def run(q=q, tables=tables, lens=lens, ctx=ctx):
                    return triton_decode.paged_decode(q, k, v, tables, lens, scale, None, ctx)
                t = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                worst = max(worst, err)
                case.update(triton_first_call_s=round(time.perf_counter() - t, 3),
                            triton_max_abs_err=err,
                            triton_ms=round(timed_ms(run, dev), 4),
                            splits=triton_decode.split_plan(
                                b, kv_heads, ctx, 64,
                                torch.cuda.get_device_properties(dev).multi_processor_count)[0])
                case["triton_kv_gb_s"] = round(kv_bytes / case["triton_ms"] / 1e6, 1)
                case["speedup"] = round(case["gather_ms"] / case["triton_ms"], 2)
            cases.append(case)
    ok = (use_triton and worst <= TOLERANCE) if not dry_run() else True
    return {"ok": ok, "triton": "runs" if use_triton else f"not run: {reason}",
            "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                      "block_size": BLOCK, "dtype": "bfloat16"},
            "tolerance": TOLERANCE, "triton_max_abs_err": worst if use_triton else None,
            "cases": cases}


if __name__ == "__main__":
    sys.exit(run_step(main))
