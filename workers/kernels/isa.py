"""Which instructions each native kernel family runs on: the one place that decides, from
`RAYPD_KERNEL_ISA` and what the library reports the CPU (and the kernel, for a shape) can do.

`RAYPD_KERNEL_ISA` caps the paths (tests compare them on one CPU): `portable` (plain loops),
`avx2` (AVX2 + FMA, no AVX512 or AMX path even where the CPU has them), `avx512bf16` (no AMX
path); unset, anything the CPU has. Each family takes the widest path the cap and the CPU allow:

- decode attention (paged_decode.cpp): 3 AMX scores + AVX512-BF16 values, 2 AVX512-BF16 (bf16
  pools), 1 AVX2 + FMA, 0 portable; the library says which a head_dim and dtype can take here
  (raypd_decode_paths), `decode_attention` picks one, and raypd_paged_decode and
  raypd_decode_layers_* run the path they are given (refusing one the CPU lacks);
- prefill attention, bf16 (attention_bf16.cpp): AMX (no sliding window) or AVX512-BF16, passed
  as its `amx` argument; float32 (attention_f32.cpp): AVX2 + FMA or none (PyTorch's SDPA);
- linears of few rows: AMX (linear_amx.cpp), AVX512-BF16 (linear_small_m.cpp) for bf16, AVX2 +
  FMA (linear_w16.cpp) for float32; where none applies PyTorch's matmul runs. decode_layers
  takes the linear its model's layers hold (their `amx_m`, from `linear_amx`);
- fused ops (fused_ops.cpp): no cap applies; its bf16 SiLU-and-mul uses AVX512 wherever the CPU
  has it, decided in fused_ops.cpp itself (raypd_silu_mul, by cpu_has_avx512_bf16): the same
  answer as `fused_silu_avx512` here, which only reports it.
"""

from __future__ import annotations

import os

from workers.kernels import bindings

PORTABLE, AVX2, AVX512_BF16, AMX = 0, 1, 2, 3      # the paths, narrowest first
CAPS = {"portable": PORTABLE, "avx2": AVX2, "avx512bf16": AVX512_BF16}
DECODE_PATH_NAMES = {AMX: "native-cpu-amx", AVX512_BF16: "native-cpu-avx512bf16",
                     AVX2: "native-cpu-avx2", PORTABLE: "native-cpu"}


def cap() -> int:
    """The widest path the native kernels may take, by `RAYPD_KERNEL_ISA` (read on every call:
    tests set it): PORTABLE, AVX2, AVX512_BF16, or AMX (unset: anything the CPU has)."""
    return CAPS.get(os.environ.get("RAYPD_KERNEL_ISA", ""), AMX)


def _rows(limit: str) -> int:
    """A linear's row limit as the library reports it (`amx_max`: AMX-BF16 usable, `small_m_max`:
    AVX512-BF16, `w16_max`: AVX2 + FMA; 0 where the CPU lacks them or there is no library)."""
    lib = bindings.library()
    return 0 if lib is None else getattr(lib, limit)


def decode_attention(head_dim: int, dtype_code: int) -> int:
    """The decode attention's path for a pool of this head_dim and dtype (0 float32, 1 bf16):
    the widest the cap allows of those the library can take here (raypd_decode_paths)."""
    lib = bindings.library()
    paths = lib.paths(head_dim, dtype_code) if lib is not None else 1
    return (paths & ((2 << cap()) - 1)).bit_length() - 1     # the highest bit <= cap (0: always)


def linear_amx() -> bool:
    """Whether bf16 linears of few rows take AMX (linear_amx.cpp)."""
    return cap() >= AMX and _rows("amx_max") > 0


def linear_small_m() -> bool:
    """Whether bf16 linears of few rows may take AVX512-BF16 (linear_small_m.cpp)."""
    return cap() >= AVX512_BF16 and _rows("small_m_max") > 0


def linear_w16() -> bool:
    """Whether float32 linears of few rows may take AVX2 + FMA on bf16-held weights
    (linear_w16.cpp)."""
    return cap() >= AVX2 and _rows("w16_max") > 0


def prefill_bf16(window: int | None) -> int | None:
    """The bf16 prefill attention's path (attention_bf16.cpp): AMX (not for a sliding window),
    AVX512_BF16, or None (it does not run: SDPA or the blocked PyTorch path)."""
    if cap() < AVX512_BF16:
        return None
    if linear_amx() and window is None:
        return AMX
    return AVX512_BF16 if _rows("small_m_max") > 0 else None


def prefill_f32(head_dim: int) -> bool:
    """Whether the float32 prefill attention (attention_f32.cpp: AVX2 + FMA) runs for this
    head_dim."""
    lib = bindings.library()
    return cap() >= AVX2 and lib is not None and bool(lib.prefill_attention_f32_ok(head_dim))


def fused_silu_avx512() -> bool:
    """Whether fused_ops.cpp's bf16 SiLU-and-mul takes its AVX512 loop (it decides itself, the
    CPU's answer whatever the cap; reported here, not passed)."""
    return _rows("small_m_max") > 0
