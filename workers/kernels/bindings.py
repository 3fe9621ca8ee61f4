"""The C entry points of the native CPU kernels, each one's ctypes signature declared once in
SIGNATURES, and `library()`: the built library loaded with every one of them typed.

A signature here that disagrees with csrc/ corrupts memory silently; tests/test_kernel_bindings.py
checks every entry against the `extern "C"` declarations in csrc/*.cpp.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

from workers.kernels import build

log = logging.getLogger(__name__)

_p, _i64, _int, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
# out, x, packed W, bias (or null); M, N, K; threads
_LINEAR = ([_p] * 4 + [_i64] * 3 + [_int], None)
# layer words, L, group words, groups, h, delta, dims, eps, scale, cos, sin, slots, threads,
# decode attention path (isa.decode_attention)
_LAYERS = [_p, _i64, _p, _i64, _p, _p, _p, _f64, _f64, _p, _p, _p, _int, _int]

# name (the C function's less its `raypd_` prefix) -> (argtypes, restype); pointers are
# c_void_p (tensors' data_ptr()), int64_t c_int64, int c_int, double c_double
SIGNATURES: dict[str, tuple[list, type | None]] = {
    # paged_decode.cpp: the paths a head_dim and dtype can take here (bit p: path p); the
    # decode attention (q, k pool, v pool, tables, lens, out; B, H, D, block size, Hkv, table
    # width, pool blocks; scale, window, dtype, threads, path)
    "decode_paths": ([_i64, _int], _int),
    "paged_decode": ([_p] * 6 + [_i64] * 7 + [_f64, _i64, _int, _int, _int], _int),
    # fused_ops.cpp, bf16 and (_f32) float32: x, h, delta, weight; T, D; eps; threads
    "add_rms_norm": ([_p] * 4 + [_i64, _i64, _f64, _int], None),
    "add_rms_norm_f32": ([_p] * 4 + [_i64, _i64, _f64, _int], None),
    # qkv, cos, sin, k pool, v pool, slots; T, H, Hkv, D, pool slots; threads
    "rope_and_cache": ([_p] * 6 + [_i64] * 5 + [_int], _int),
    "rope_and_cache_f32": ([_p] * 6 + [_i64] * 5 + [_int], _int),
    # out, gate_up; T, I; threads
    "silu_mul": ([_p, _p, _i64, _i64, _int], None),
    "silu_mul_f32": ([_p, _p, _i64, _i64, _int], None),
    # linear_small_m.cpp, linear_amx.cpp, linear_w16.cpp: each one's most rows (0: the CPU
    # lacks its instructions) and the linear
    "linear_small_m_max": ([], _i64),
    "linear_small_m": _LINEAR,
    "linear_amx_max": ([], _i64),
    "linear_amx": _LINEAR,
    "linear_w16_max": ([], _i64),
    "linear_w16": _LINEAR,
    # attention_bf16.cpp: out, q, k, v; Tq, S, H, Hkv, D, q row, k row, v row; scale, window,
    # threads, amx, block table (or null), block size
    "prefill_attention_bf16": ([_p] * 4 + [_i64] * 8 + [_f64, _i64, _int, _int, _p, _i64], None),
    # attention_f32.cpp: whether it takes this head_dim here; out, q, k, v; Tq, S, H, Hkv, D,
    # q row, k row, v row; scale, window, threads
    "prefill_attention_f32_ok": ([_i64], _int),
    "prefill_attention_f32": ([_p] * 4 + [_i64] * 8 + [_f64, _i64, _int], None),
    # decode_layers.cpp (bf16: + amx, which linear)
    "decode_layers_f32": (_LAYERS, _int),
    "decode_layers_bf16": ([*_LAYERS, _int], _int),
    # shm_comm.cpp (tp_comm.ShmComm), on a segment at base: its bytes (world, slot bytes,
    # broadcast bytes); init (base, world, slot bytes, broadcast bytes); join (base, rank, world,
    # slot bytes); the broadcast area's bytes; abort; then the collectives (base, rank, ...,
    # timeout in seconds, negative: none), 0 (broadcast: the bytes) or an error code
    "shm_comm_bytes": ([_int, _i64, _i64], _i64),
    "shm_comm_init": ([_p, _int, _i64, _i64], _int),
    "shm_comm_join": ([_p, _int, _int, _i64], _int),
    "shm_comm_bcast_bytes": ([_p], _i64),
    "shm_comm_abort": ([_p], None),
    # data, n, dtype (0 float32, 1 bf16), algorithm (0 auto, 1 all-read, 2 reduce-scatter)
    "shm_all_reduce": ([_p, _int, _p, _i64, _int, _int, _f64], _int),
    # buffer, bytes (rank 0: to send; the others: room)
    "shm_broadcast": ([_p, _int, _p, _i64, _f64], _i64),
    # src, bytes, dst (rank 0: [world][bytes])
    "shm_gather": ([_p, _int, _p, _i64, _p, _f64], _int),
    "shm_barrier": ([_p, _int, _f64], _int),
}


class Library:
    """The loaded library: each entry point of SIGNATURES as an attribute of its name, typed,
    and the linears' row limits (0: the CPU lacks the kernel's instructions), read once."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        for name, (argtypes, restype) in SIGNATURES.items():
            f = getattr(cdll, "raypd_" + name)
            f.argtypes, f.restype = argtypes, restype
            setattr(self, name, f)
        self.small_m_max = int(self.linear_small_m_max())   # 0: no AVX512-BF16
        self.amx_max = int(self.linear_amx_max())           # 0: no usable AMX-BF16
        self.w16_max = int(self.linear_w16_max())           # 0: no AVX2 + FMA
        self._paths: dict[tuple[int, int], int] = {}

    def paths(self, head_dim: int, dtype_code: int) -> int:
        """decode_paths(head_dim, dtype_code), asked once each (a decode step asks per layer)."""
        key = (head_dim, dtype_code)
        if key not in self._paths:
            self._paths[key] = int(self.decode_paths(head_dim, dtype_code))
        return self._paths[key]


@functools.cache
def library() -> Library | None:
    """The native kernels, or None where they are off (`RAYPD_NATIVE_KERNELS=0`) or cannot be
    built (then every caller takes its PyTorch path). Callers look it up per call
    (`bindings.library()`): `raypd bench engine` swaps it to time the calls."""
    if os.environ.get("RAYPD_NATIVE_KERNELS", "1") == "0":
        return None
    from workers.model_loader import cache_dir
    try:
        return Library(ctypes.CDLL(str(build.build(cache_dir()))))
    except (OSError, RuntimeError, ValueError, AttributeError,
            subprocess.SubprocessError) as e:   # ValueError: $CXX unparsable
        log.warning("raypd: native CPU kernels unavailable (%s); using PyTorch ops", e)
        return None
