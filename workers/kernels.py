"""The engine's one native kernel: CPU decode attention that reads the paged KV pool in place
(workers/paged_decode.cpp), built once per machine with torch's C++ extension loader into
raypd's cache. Where it cannot be built (no compiler) or does not apply (a GPU tensor, q and
cache of different dtypes), the attention falls back to its pure-PyTorch path;
`RAYPD_NATIVE_KERNELS=0` turns it off. The build folder is keyed by the source, flags, torch
version and Python environment (torch's loader rebuilds when the environment's paths differ, so
checkouts sharing the cache would otherwise rebuild over each other); a build lock older than
STALE_LOCK_S (left by a build that was killed) is removed instead of waited on forever.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_decode.cpp")
# -ffast-math: reassociated (vectorized) sums and glibc's vector expf; the kernel holds no
# infinities or NaNs (masked keys are outside its loops), so finite-math is safe
CFLAGS = ["-O3", "-march=native", "-ffast-math"]
STALE_LOCK_S = 600.0   # a build takes about a minute; torch's own lock never expires


@functools.cache
def _module():
    if os.environ.get("RAYPD_NATIVE_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load_inline

    from workers.model_loader import cache_dir
    build = cache_dir() / "torch_extensions"
    build.mkdir(parents=True, exist_ok=True)
    src = SOURCE.read_text()
    import hashlib
    import sys
    import time
    key = src + " ".join(CFLAGS) + torch.__version__ + sys.prefix
    name = f"raypd_paged_decode_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    (build / name).mkdir(exist_ok=True)
    lock = build / name / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("raypd: removing the stale build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    try:
        return load_inline(name=name, cpp_sources=[src], functions=["paged_decode"],
                           extra_cflags=CFLAGS, build_directory=str(build / name), verbose=False)
    except Exception as e:   # no compiler, headers, ...: the torch path still works
        log.warning("raypd: native decode attention unavailable (%s); using PyTorch ops", e)
        return None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 window: int | None) -> torch.Tensor | None:
    """[B, H, D] decode attention over the pool, or None where the kernel does not apply."""
    if q.device.type != "cpu" or q.dtype != k_cache.dtype or q.dtype not in (
            torch.float32, torch.bfloat16):
        return None
    mod = _module()
    if mod is None:
        return None
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens, scale,
                            window or 0)


def decode_kernel_name(device: torch.device) -> str:
    return "native-cpu" if device.type == "cpu" and _module() is not None else "torch"
