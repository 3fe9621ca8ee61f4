"""The one place that decides where an engine runs and in which dtype its weights compute.

`--dtype auto` takes the checkpoint's own dtype, except that a float32 checkpoint computes in
bfloat16 where the hardware multiplies bfloat16 natively (CPUs with AVX512-BF16 or AMX, GPUs
from Ampere on): there bf16 matmuls run 3-5x faster and read half the bytes, as vLLM does by
default. The built-in `tiny` test model stays float32 (its reference comparisons are exact).
"""

from __future__ import annotations

import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}   # names accepted for weights/KV


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def auto_dtype(checkpoint_dtype: str, device: torch.device) -> str:
    """The compute dtype for `--dtype auto` of a checkpoint saved in `checkpoint_dtype`."""
    if checkpoint_dtype in ("float32", "float16", "bfloat16") and has_native_bf16(device):
        return "bfloat16"
    return checkpoint_dtype if checkpoint_dtype in ("float32", "bfloat16") else "float32"
