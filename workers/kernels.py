"""The engine's one native kernel: CPU decode attention that reads the paged KV pool in place
(workers/paged_decode.cpp), built once per machine into raypd's cache and loaded with ctypes.

The source is plain C++ with a C ABI and no torch headers, so a build takes a second or two
with the system compiler (a torch C++ extension took about a minute: torch's headers), and it
does not depend on torch's version or the Python environment. The build folder is keyed by the
source, the flags, the compiler's version and the CPU's features (-march=native: a cache on a
home shared by different machines must not hand one the other's build). A build holds a
lock file beside the library (workers starting together compile it once; the others wait for
it) and writes a temporary file that it renames into place, so no reader sees a half-written
library. Where it cannot be built (no compiler) or does not apply
(a GPU tensor, q and cache of different dtypes), the attention falls back to its pure-PyTorch
path; `RAYPD_NATIVE_KERNELS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import fcntl
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
SOURCES = (SOURCE, Path(__file__).with_name("fused_ops.cpp"),
           Path(__file__).with_name("linear_small_m.cpp"),
           Path(__file__).with_name("linear_amx.cpp"),
           Path(__file__).with_name("linear_w16.cpp"),
           Path(__file__).with_name("attention_bf16.cpp"),
           Path(__file__).with_name("attention_f32.cpp"),
           Path(__file__).with_name("decode_layers.cpp"))          # one library
HEADERS = (Path(__file__).with_name("bf16.h"),                    # part of its build key
           Path(__file__).with_name("exp_avx512.h"), Path(__file__).with_name("exp_avx2.h"),
           Path(__file__).with_name("amx.h"))
# -ffast-math: reassociated (vectorized) sums and glibc's vector expf; the kernel holds no
# infinities or NaNs (masked keys are outside its loops), so finite-math is safe
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20", "-fPIC", "-shared", "-fopenmp"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
            ctypes.c_double, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
MAX_GROUP = 16   # query heads per KV head the kernel takes
MAX_KV_HEADS = 256


def isa_cap() -> int:
    """The widest instructions the native kernels may use, by `RAYPD_KERNEL_ISA` (tests compare
    the paths on one CPU): 0 `portable` (plain loops), 1 `avx2` (AVX2 + FMA: no AVX512 or AMX
    path even where the CPU has them), 2 `avx512bf16` (no AMX path), 3 anything the CPU has
    (unset)."""
    return {"portable": 0, "avx2": 1, "avx512bf16": 2}.get(os.environ.get("RAYPD_KERNEL_ISA", ""), 3)


def force_no_amx() -> bool:
    """`RAYPD_KERNEL_ISA=avx512bf16` (or `avx2`, `portable`): no AMX path even where the CPU has
    it (decode linears take the AVX512-BF16 small-M kernel, decode attention its vdpbf16ps
    scores; tests cover both)."""
    return isa_cap() < 3


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
    src = b"\0".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([src, " ".join(CFLAGS).encode(), cc[1].encode(),
                                     _cpu_features().encode()])).hexdigest()[:16]
    lib = cache / "native" / f"raypd_paged_decode_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # one build at a time per key: workers starting together on a new machine wait for the
    # first one's library instead of each compiling it (four compiles at once on 2 cores)
    with open(lib.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=lib.parent)
        os.close(fd)
        try:
            out = subprocess.run([*cc[0], *CFLAGS, "-o", tmp, *map(str, SOURCES)],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(cc[0])} failed: {out.stderr.strip()[-2000:]}")
            os.replace(tmp, lib)  # atomic: a reader never sees a half-written library
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
        lib = ctypes.CDLL(str(build(cache_dir())))
        fn = lib.raypd_paged_decode
        path = lib.raypd_decode_path
    except (OSError, RuntimeError, ValueError, AttributeError,
            subprocess.SubprocessError) as e:   # ValueError: $CXX unparsable
        log.warning("raypd: native decode attention unavailable (%s); using PyTorch ops", e)
        return None
    fn.argtypes, fn.restype = ARGTYPES, ctypes.c_int
    path.argtypes, path.restype = [_i64, ctypes.c_int, ctypes.c_int], ctypes.c_int
    fn.path = path
    fn.add_rms_norm, fn.rope_and_cache, fn.silu_mul = {}, {}, {}
    for dtype, suffix in ((torch.bfloat16, ""), (torch.float32, "_f32")):   # by dtype
        f = fn.add_rms_norm[dtype] = getattr(lib, "raypd_add_rms_norm" + suffix)
        f.argtypes, f.restype = [_ptr] * 4 + [_i64, _i64, ctypes.c_double, ctypes.c_int], None
        f = fn.rope_and_cache[dtype] = getattr(lib, "raypd_rope_and_cache" + suffix)
        f.argtypes, f.restype = [_ptr] * 6 + [_i64] * 5 + [ctypes.c_int], ctypes.c_int
        f = fn.silu_mul[dtype] = getattr(lib, "raypd_silu_mul" + suffix)
        f.argtypes, f.restype = [_ptr, _ptr, _i64, _i64, ctypes.c_int], None
    fn.linear_small_m = lib.raypd_linear_small_m
    fn.linear_small_m.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int]
    lib.raypd_linear_small_m_max.restype = ctypes.c_int64
    fn.small_m_max = int(lib.raypd_linear_small_m_max())   # 0: no AVX512-BF16
    fn.linear_amx = lib.raypd_linear_amx
    fn.linear_amx.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int]
    lib.raypd_linear_amx_max.restype = ctypes.c_int64
    fn.amx_max = int(lib.raypd_linear_amx_max())           # 0: no AMX-BF16
    fn.linear_w16 = lib.raypd_linear_w16
    fn.linear_w16.argtypes = [_ptr] * 4 + [_i64] * 3 + [ctypes.c_int]
    lib.raypd_linear_w16_max.restype = ctypes.c_int64
    fn.w16_max = int(lib.raypd_linear_w16_max())           # 0: no AVX2 + FMA
    layers_args = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_double, ctypes.c_double,
                   _ptr, _ptr, _ptr, ctypes.c_int, ctypes.c_int]
    fn.decode_layers_f32 = lib.raypd_decode_layers_f32
    fn.decode_layers_f32.argtypes, fn.decode_layers_f32.restype = layers_args, ctypes.c_int
    fn.decode_layers_bf16 = lib.raypd_decode_layers_bf16     # (+ amx: which bf16 linear)
    fn.decode_layers_bf16.argtypes = [*layers_args, ctypes.c_int]
    fn.decode_layers_bf16.restype = ctypes.c_int
    fn.prefill_attention_bf16 = lib.raypd_prefill_attention_bf16
    fn.prefill_attention_bf16.argtypes = [_ptr] * 4 + [_i64] * 8 + [ctypes.c_double, _i64,
                                                                    ctypes.c_int, ctypes.c_int,
                                                                    _ptr, _i64]
    fn.prefill_attention_f32 = lib.raypd_prefill_attention_f32
    fn.prefill_attention_f32.argtypes = [_ptr] * 4 + [_i64] * 8 + [ctypes.c_double, _i64,
                                                                   ctypes.c_int]
    fn.prefill_attention_f32_ok = lib.raypd_prefill_attention_f32_ok
    fn.prefill_attention_f32_ok.argtypes, fn.prefill_attention_f32_ok.restype = [_i64], ctypes.c_int
    for f in (fn.linear_small_m, fn.linear_amx, fn.linear_w16, fn.prefill_attention_bf16,
              fn.prefill_attention_f32):
        f.restype = None
    return fn


def paged_decode_heads_fit(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether paged_decode.cpp holds these heads (its per-KV-head arrays are sized for at
    most MAX_GROUP query heads, MAX_KV_HEADS KV heads and head_dim 512)."""
    return 0 < head_dim <= 512 and 0 < num_kv_heads <= MAX_KV_HEADS \
        and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP


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
            and v_cache.shape == k_cache.shape and k_cache.shape[3] == D
            and paged_decode_heads_fit(H, k_cache.shape[2], D)
            and tables.dim() == 2 and tables.shape[0] == B and lens.shape == (B,)):
        raise ValueError(f"paged_decode: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (contiguous, same dtype), block_tables "
                         f"{tuple(tables.shape)}, context_lens {tuple(lens.shape)}")
    num_blocks, bs, h_kv = k_cache.shape[:3]
    q = q.contiguous()
    out = torch.empty_like(q)
    if fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
          lens.data_ptr(), out.data_ptr(), B, H, D, bs, h_kv, tables.shape[1], num_blocks,
          float(scale), int(window or 0), DTYPE_CODES[q.dtype], torch.get_num_threads(),
          isa_cap()):
        raise ValueError("paged_decode: a context length outside its block table, or a block "
                         "outside the pool")
    return out


def decode_kernel_name(device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int = 64) -> str:
    """Which decode attention runs: native-cpu-amx (bf16 pools on a CPU with AMX-BF16: scores
    on AMX, values on AVX512-BF16), native-cpu-avx512bf16 (bf16 pools on a CPU with
    AVX512-BF16), native-cpu-avx2 (AVX2 + FMA: float32 pools, bf16 pools elsewhere),
    native-cpu (the kernel's portable loops), or torch."""
    fn = _module() if device.type == "cpu" else None
    if fn is None:
        return "torch"
    code = DTYPE_CODES.get(dtype if dtype is not None else torch.float32)
    path = fn.path(head_dim, code, isa_cap()) if code is not None else 0
    return {3: "native-cpu-amx", 2: "native-cpu-avx512bf16",
            1: "native-cpu-avx2"}.get(path, "native-cpu")


# ---- fused small operations of the compact model (bf16, float32 on the CPU; fused_ops.cpp) ----
FUSED_DTYPES = (torch.bfloat16, torch.float32)


def fused_ops_apply(dtype: torch.dtype, device: torch.device, hidden: int) -> bool:
    """Whether the compact model's fused ops run for weights of `dtype` on `device`
    (`RAYPD_FUSED_OPS=0` turns them off: torch's own ops, transformers' bit for bit in
    float32)."""
    return device.type == "cpu" and dtype in FUSED_DTYPES and hidden <= 8192 \
        and os.environ.get("RAYPD_FUSED_OPS", "1") != "0" and _module() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight: [T, D] bf16 or float32,
    contiguous."""
    assert h.is_contiguous() and h.dtype in FUSED_DTYPES and weight.is_contiguous()
    assert weight.dtype == h.dtype
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == h.shape and delta.dtype == h.dtype
    x = torch.empty_like(h)
    _module().add_rms_norm[h.dtype](x.data_ptr(), h.data_ptr(),
                                    0 if delta is None else delta.data_ptr(),
                                    weight.data_ptr(), h.shape[0], h.shape[1], float(eps),
                                    torch.get_num_threads())
    return x


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int, num_kv_heads: int) -> None:
    """Rotate qkv's q and k heads in place ([T, H + 2 Hkv, D] bf16 or float32) by cos/sin
    ([T, 1, D]) and write each token's k and v into the pool (of the same dtype) at its slot."""
    t, heads, d = qkv.shape
    assert heads == num_heads + 2 * num_kv_heads and qkv.is_contiguous()
    assert qkv.dtype in FUSED_DTYPES
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype == cos.dtype == sin.dtype
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    slots = slots.to(torch.int64).contiguous()
    assert slots.numel() == t
    if _module().rope_and_cache[qkv.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t,
                                num_heads, num_kv_heads, d,
                                k_cache.numel() // (num_kv_heads * d), torch.get_num_threads()):
        raise ValueError("rope_and_cache: a slot outside the pool")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate, up) -> silu(gate) * up, bf16 or float32."""
    gate_up = gate_up.contiguous()
    assert gate_up.dtype in FUSED_DTYPES
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    _module().silu_mul[gate_up.dtype](out.data_ptr(), gate_up.data_ptr(), t, two_i // 2,
                       torch.get_num_threads())
    return out


# ---- linears of few rows (decode steps) on VNNI-packed weights, bf16 on CPUs with AVX512-BF16
# (linear_small_m.cpp) ----
def linear_small_m_rows(weight: torch.Tensor) -> int:
    """The most rows of x the small-M linear takes for this weight (0: it does not apply: not a
    bf16 CPU weight, K odd, no AVX512-BF16, or the portable switch)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or weight.shape[1] % 2 or isa_cap() < 2:
        return 0
    return _small_m_max()


def _small_m_max() -> int:
    fn = _module()
    return 0 if fn is None else fn.small_m_max


def linear_small_m(x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias [n]) for at most linear_small_m_rows(W) rows of x, bf16,
    from W's pack_vnni copy; float32 sums rounded once."""
    return _linear_vnni(_module().linear_small_m, _small_m_max(), x, packed, n, bias)


def _linear_vnni(kernel, max_rows: int, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias) by `kernel` (linear_small_m or linear_amx's C call) on
    W's pack_vnni copy, for 1 <= rows <= max_rows."""
    k = packed.shape[1] * 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    assert x.dtype == packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed.shape == (-(-n // 16), k // 2, 16, 2) and x.shape[-1] == k, packed.shape
    assert 1 <= m <= max_rows, m     # (the weight's dtype, device, K: the caller's *_rows)
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype and bias.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    kernel(out.data_ptr(), x2.data_ptr(), packed.data_ptr(),
           0 if bias is None else bias.data_ptr(), m, n, k, torch.get_num_threads())
    return out.view(*lead, n)


# ---- float32 linears of few rows whose weights are bf16 values, stored as bf16 (linear_w16.cpp) ----
def linear_w16_rows(weight: torch.Tensor) -> int:
    """The most rows of x the bf16-stored float32 linear takes for this weight (0: it does not
    apply: not a float32 CPU weight, a value bf16 does not hold exactly, no AVX2 + FMA, or
    RAYPD_KERNEL_ISA=portable)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 \
            or isa_cap() < 1:
        return 0
    fn = _module()
    if fn is None or fn.w16_max == 0:
        return 0
    if not torch.equal(weight.to(torch.bfloat16).float(), weight):
        return 0      # a float32 checkpoint's own values: stored as bf16 they would change
    return fn.w16_max


W16_ROWS, W16_COLS = 4, 8   # linear_w16.cpp's tile: 4 rows x 8 columns, 64 bytes


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (float32 whose values are all bf16, linear_w16_rows > 0) as bf16 in the
    layout linear_w16 reads: [ceil(N / 4), ceil(K / 8), 4, 8], wp[t, c, r, i] = weight[4 t + r,
    8 c + i], zero past N and K (each tile of 4 rows one sequential stream)."""
    n, k = weight.shape
    n4, k8 = -(-n // W16_ROWS) * W16_ROWS, -(-k // W16_COLS) * W16_COLS
    padded = torch.zeros(n4, k8, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(n4 // W16_ROWS, W16_ROWS, k8 // W16_COLS, W16_COLS) \
        .permute(0, 2, 1, 3).contiguous()


def linear_w16(x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ W [n, K]^T (+ bias [n]) for at most linear_w16_rows(W) rows of x,
    with W held as pack_w16(W) (bf16, exact): the float32 products and sums, in another order,
    reading half the bytes."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    assert x.dtype == torch.float32 and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed.shape == (-(-n // W16_ROWS), -(-k // W16_COLS), W16_ROWS, W16_COLS), \
        (packed.shape, n, k)
    assert 1 <= m <= _module().w16_max, (x.shape, m)
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == torch.float32 and bias.is_contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    _module().linear_w16(out.data_ptr(), x2.data_ptr(), packed.data_ptr(),
                         0 if bias is None else bias.data_ptr(), m, n, k,
                         torch.get_num_threads())
    return out.view(*lead, n)


class W16Weight:
    """A weight packed for linear_w16 (pack_w16) and bound to the kernel, its layout and bias
    checked once here: a decode step calls it ~120 times (SmolLM2), so each call checks only x
    (2-D, contiguous, float32, K columns, 1..max_rows rows) and allocates the output (~3 us
    against ~11 for linear_w16's general checks and reshapes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.n, self.k = weight.shape
        self.max_rows = linear_w16_rows(weight)
        assert self.max_rows > 0, "linear_w16 does not apply to this weight"
        if bias is not None:
            assert bias.shape == (self.n,) and bias.dtype == torch.float32 \
                and bias.is_contiguous()
        self.packed, self.bias = pack_w16(weight), bias      # held: the kernel reads them
        self._args = (self.packed.data_ptr(), 0 if bias is None else bias.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32, contiguous, 1 <= M <= max_rows -> x @ W^T (+ bias) [M, N]."""
        m, k = x.shape
        if k != self.k or not 1 <= m <= self.max_rows or x.dtype != torch.float32 \
                or not x.is_contiguous():
            raise ValueError(f"linear_w16: x {tuple(x.shape)} {x.dtype} against W [{self.n}, "
                             f"{self.k}] (contiguous float32, 1..{self.max_rows} rows)")
        out = torch.empty(m, self.n, dtype=torch.float32)
        # looked up per call: `raypd bench engine` times the library's calls by swapping it
        _module().linear_w16(out.data_ptr(), x.data_ptr(), *self._args, m, self.n, k,
                             torch.get_num_threads())
        return out


# ---- linears of 1-16 rows on VNNI-packed weights, bf16 on CPUs with AMX-BF16 (linear_amx.cpp) ---
def linear_amx_rows(weight: torch.Tensor) -> int:
    """The most rows of x the AMX linear takes for this weight (0: it does not apply: not a bf16
    CPU weight, K not a multiple of 32, no AMX-BF16, or the portable switch)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or weight.shape[1] % 32 or force_no_amx():
        return 0
    fn = _module()
    return 0 if fn is None else fn.amx_max


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the layout linear_amx and linear_small_m read: [ceil(N / 16), K / 2, 16,
    2], wp[nb, kp, n, i] = weight[16 nb + n, 2 kp + i], rows past N zero."""
    n, k = weight.shape
    assert k % 2 == 0, k
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_amx(x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias [n]) for at most linear_amx_rows(W) rows of x, bf16, from
    W's pack_vnni copy; float32 sums rounded once."""
    return _linear_vnni(_module().linear_amx, _module().amx_max, x, packed, n, bias)


# ---- prefill attention, bf16 on CPUs with AMX-BF16 or AVX512-BF16 (attention_bf16.cpp) ---------
def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           window: int | None = None, block_table: torch.Tensor | None = None,
                           context_len: int | None = None) -> torch.Tensor | None:
    """Causal attention of q [Tq, H, D] (the last Tq positions) over k, v [S, Hkv, D] (every
    position, the chunk's own last), each query seeing only the `window` newest keys of a
    sliding-window layer -> [Tq, H, D]; None where the kernel does not apply (not bf16 on the
    CPU, D not a multiple of 32 up to 128, neither AMX-BF16 (no window) nor AVX512-BF16, the
    portable switch). AMX where the CPU has it, unless RAYPD_KERNEL_ISA=avx512bf16.
    With `block_table` ([blocks] int64) and `context_len` (S), k and v are a layer's paged pool
    [num_blocks, block_size, Hkv, D] and the keys are the sequence's first S slots of its
    blocks, read in place (the chunk's own K/V already written there)."""
    tq, h, d = q.shape
    if block_table is not None:
        if k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous()) or context_len is None:
            return None
        num_blocks, bs, h_kv = k.shape[:3]
        s = context_len
    else:
        num_blocks, bs = 0, 0
        s, h_kv = k.shape[:2]
    if q.device.type != "cpu" or not q.dtype == k.dtype == v.dtype == torch.bfloat16 \
            or d % 32 or d > 128 or h % h_kv or k.shape != v.shape or k.shape[-1] != d \
            or not 1 <= tq <= s or isa_cap() < 2 or (window is not None and window < 1):
        return None
    fn = _module()
    if fn is None:
        return None
    amx = fn.amx_max > 0 and not force_no_amx() and window is None
    if not amx and not fn.small_m_max:      # (no AVX512-BF16)
        return None
    table_ptr = None
    if block_table is not None:
        # checked on every call, not asserted: the kernel reads where the table points
        table = block_table.to("cpu", torch.int64).contiguous()
        need = -(-s // bs)
        if table.dim() != 1 or table.numel() < need:
            raise ValueError(f"prefill_attention_bf16: a block table of {table.numel()} blocks "
                             f"for {s} tokens in blocks of {bs}")
        lo, hi = torch.aminmax(table[:need])
        if int(lo) < 0 or int(hi) >= num_blocks:
            raise ValueError("prefill_attention_bf16: a block outside the pool")
        table_ptr, kr = table.data_ptr(), h_kv * d     # rows of the pool
        vr = kr
    else:
        # each token's heads x D contiguous (slices of a fused QKV projection are): in place
        k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (k, v))
        kr, vr = k.stride(0), v.stride(0)
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    out = torch.empty(tq, h, d, dtype=q.dtype)
    fn.prefill_attention_bf16(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), tq, s,
                              h, h_kv, d, q.stride(0), kr, vr, scale, int(window or 0),
                              torch.get_num_threads(), int(amx), table_ptr, bs)
    return out


# ---- prefill attention, float32 on CPUs with AVX2 + FMA (attention_f32.cpp) -----------------------
def prefill_attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int | None = None) -> torch.Tensor | None:
    """Causal attention of q [Tq, H, D] (the last Tq positions) over k, v [S, Hkv, D] (every
    position, the chunk's own last), each query seeing only the `window` newest keys of a
    sliding-window layer -> [Tq, H, D]; None where the kernel does not apply (not float32 on the
    CPU, no AVX2 + FMA, D not a multiple of 16 up to 256, RAYPD_KERNEL_ISA=portable)."""
    tq, h, d = q.shape
    s, h_kv = k.shape[:2]
    if q.device.type != "cpu" or not q.dtype == k.dtype == v.dtype == torch.float32 \
            or h % h_kv or k.shape != v.shape or k.shape[2] != d or not 1 <= tq <= s \
            or isa_cap() < 1:
        return None
    fn = _module()
    if fn is None or not fn.prefill_attention_f32_ok(d):
        return None
    # each token's heads x D contiguous (slices of a fused QKV projection are): read in place
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (q, k, v))
    out = torch.empty(tq, h, d, dtype=q.dtype)
    fn.prefill_attention_f32(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), tq, s, h,
                             h_kv, d, q.stride(0), k.stride(0), v.stride(0), scale,
                             int(window or 0), torch.get_num_threads())
    return out


# ---- the compact model's decode layers in one call (decode_layers.cpp) ---------------------------
LAYER_WORDS = 11   # per layer: qkv, qkv bias, o, o bias, gate_up, down, ln1, ln2, k, v, window
GROUP_WORDS = 5    # per decode group: start, count, block tables, context lens, width


def decode_layers(layer_words: torch.Tensor, groups: list[tuple[int, torch.Tensor,
                                                                 torch.Tensor]],
                  h: torch.Tensor, dims: tuple[int, ...], eps: float, scale: float,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  amx: bool = False) -> torch.Tensor:
    """Every layer of a pure decode step, as llama._Layer.forward_fused computes them one call
    at a time: float32 activations and pool with bf16-held linears (linear_w16), or bf16
    activations and pool with VNNI-packed linears (linear_amx where `amx`, else
    linear_small_m). `layer_words` [L, LAYER_WORDS] int64 (the layers' operands,
    CompactLlama.decode_words); `groups` (start row, block tables [count, width], context lens
    [count]); h [T, hidden] the residual stream (updated in place); dims (T, hidden, H, Hkv, D,
    I, block_size, num_blocks); cos, sin [T, D] of h's dtype; slots [T].
    Returns the last layer's output, still to be added to h."""
    t, hidden = h.shape
    assert dims[0] == t and dims[1] == hidden and h.dtype in FUSED_DTYPES and h.is_contiguous()
    assert cos.dtype == sin.dtype == h.dtype and (not amx or h.dtype == torch.bfloat16)
    assert layer_words.dtype == torch.int64 and layer_words.is_contiguous() \
        and layer_words.shape[1] == LAYER_WORDS
    assert cos.shape == sin.shape == (t, dims[4]) and cos.is_contiguous() and sin.is_contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (t,) and slots.is_contiguous()
    words, held, rows = [], [], 0    # held: the converted tables the words point into
    for start, tables, lens in groups:       # the groups' rows partition [0, T), in order
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        count = tables.shape[0]
        assert start == rows and lens.shape == (count,) and count > 0
        rows += count
        held += [tables, lens]
        words += [start, count, tables.data_ptr(), lens.data_ptr(), tables.shape[1]]
    assert rows == t
    group_words = torch.tensor(words, dtype=torch.int64)
    dims_t = torch.tensor(dims, dtype=torch.int64)
    delta = torch.empty_like(h)
    args = (layer_words.data_ptr(), layer_words.shape[0], group_words.data_ptr(), len(groups),
            h.data_ptr(), delta.data_ptr(), dims_t.data_ptr(), float(eps), float(scale),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), torch.get_num_threads(), isa_cap())
    fn = _module()
    if fn.decode_layers_f32(*args) if h.dtype == torch.float32 \
            else fn.decode_layers_bf16(*args, int(amx)):
        raise ValueError("decode_layers: a slot or a block outside the pool")
    return delta
