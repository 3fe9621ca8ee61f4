"""The engine's one native kernel: CPU decode attention that reads the paged KV pool in place
(workers/paged_decode.cpp), built once per machine into raypd's cache and loaded with ctypes.

The source is plain C++ with a C ABI and no torch headers, so a build takes a second or two
with the system compiler (a torch C++ extension took about a minute: torch's headers), and it
does not depend on torch's version or the Python environment. The build folder is keyed by the
source, the flags, the compiler's version and the CPU's features (-march=native: a cache on a
home shared by different machines must not hand one the other's build). A build writes a
temporary file and renames it into place, so concurrent builds (workers starting together)
cannot leave a half-written library. Where it cannot be built (no compiler) or does not apply
(a GPU tensor, q and cache of different dtypes), the attention falls back to its pure-PyTorch
path; `RAYPD_NATIVE_KERNELS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_decode.cpp")
# -ffast-math: reassociated (vectorized) sums and glibc's vector expf; the kernel holds no
# infinities or NaNs (masked keys are outside its loops), so finite-math is safe
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20", "-fPIC", "-shared"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
            ctypes.c_double, _i64, ctypes.c_int]


def _cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    want = ("model name", "flags", "Features")
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.split(":")[0].strip() in want))


def _compiler() -> tuple[list[str], str] | None:
    """(command, version line) of the C++ compiler ($CXX, which may hold a wrapper such as
    "ccache g++", else c++ or g++), or None."""
    cxx = shlex.split(os.environ.get("CXX", "")) or [
        c for c in (shutil.which("c++") or shutil.which("g++"),) if c]
    if not cxx:
        return None
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (cxx, out.stdout.splitlines()[0]) if out.returncode == 0 and out.stdout else None


def build(cache: Path) -> Path:
    """The kernel's shared library under `cache` (built now unless a build for this source,
    compiler and CPU is there). Raises RuntimeError when it cannot be built."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C++ compiler (c++ or g++, or $CXX)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(CFLAGS).encode(), cc[1].encode(),
                                     _cpu_features().encode()])).hexdigest()[:16]
    lib = cache / "native" / f"raypd_paged_decode_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=lib.parent)
    os.close(fd)
    try:
        out = subprocess.run([*cc[0], *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True,
                             text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cc[0])} failed: {out.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)      # atomic: a concurrent build's rename wins, both are whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _module():
    """The loaded kernel function (ctypes), or None where it is off or cannot be built."""
    if os.environ.get("RAYPD_NATIVE_KERNELS", "1") == "0":
        return None
    from workers.model_loader import cache_dir
    try:
        fn = ctypes.CDLL(str(build(cache_dir()))).raypd_paged_decode
    except (OSError, RuntimeError, ValueError, AttributeError,
            subprocess.SubprocessError) as e:   # ValueError: $CXX unparsable
        log.warning("raypd: native decode attention unavailable (%s); using PyTorch ops", e)
        return None
    fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
    return fn


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 window: int | None) -> torch.Tensor | None:
    """[B, H, D] decode attention over the pool, or None where the kernel does not apply."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu" \
            or q.dtype != k_cache.dtype or q.dtype not in DTYPE_CODES:
        return None
    fn = _module()
    if fn is None:
        return None
    # checked on every call, not asserted: the kernel reads raw memory where these point (it
    # checks the context lengths and block ids itself, beside its reads)
    B, H, D = q.shape if q.dim() == 3 else (0, 0, 0)
    tables = block_tables.to("cpu", torch.int64).contiguous()
    lens = context_lens.to("cpu", torch.int64).contiguous()
    if not (q.dim() == 3 and k_cache.dim() == 4 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape and k_cache.shape[3] == D and 0 < D <= 512
            and k_cache.shape[2] > 0 and H % k_cache.shape[2] == 0 and tables.dim() == 2 and tables.shape[0] == B
            and lens.shape == (B,)):
        raise ValueError(f"paged_decode: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (contiguous, same dtype), block_tables "
                         f"{tuple(tables.shape)}, context_lens {tuple(lens.shape)}")
    num_blocks, bs, h_kv = k_cache.shape[:3]
    q = q.contiguous()
    out = torch.empty_like(q)
    if fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
          lens.data_ptr(), out.data_ptr(), B, H, D, bs, h_kv, tables.shape[1], num_blocks,
          float(scale), int(window or 0), DTYPE_CODES[q.dtype]):
        raise ValueError("paged_decode: a context length outside its block table, or a block "
                         "outside the pool")
    return out


def decode_kernel_name(device: torch.device) -> str:
    return "native-cpu" if device.type == "cpu" and _module() is not None else "torch"
