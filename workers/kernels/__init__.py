"""The engine's kernels: native CPU kernels (C++ in csrc/, built by build.py, bound by
bindings.py, their instruction sets chosen by isa.py, wrapped by attention.py, linears.py and
fused.py, all re-exported here) and the CUDA ones in Triton (triton_decode.py, triton_ops.py);
and the tensor-parallel ranks' channel (tp_comm.py: ShmComm on csrc/shm_comm.cpp, GlooComm).

`from workers import kernels; kernels.paged_decode(...)`: every native wrapper is here. A
wrapper returns None (or its `*_rows` / `*_apply` says 0 / False) where its kernel does not
apply: a GPU tensor, another dtype, no C++ compiler, or `RAYPD_NATIVE_KERNELS=0`; the caller
then takes its PyTorch path.
"""

from workers.kernels.attention import (
    DTYPE_CODES,
    MAX_GROUP,
    MAX_KV_HEADS,
    decode_kernel_name,
    paged_decode,
    paged_decode_heads_fit,
    prefill_attention_bf16,
    prefill_attention_f32,
)
from workers.kernels.bindings import library
from workers.kernels.fused import (
    FUSED_DTYPES,
    GROUP_WORDS,
    LAYER_WORDS,
    add_rms_norm,
    decode_layers,
    fused_ops_apply,
    rope_and_cache,
    silu_mul,
)
from workers.kernels.linears import (
    W16_COLS,
    W16_ROWS,
    W16Weight,
    linear_amx,
    linear_amx_rows,
    linear_small_m,
    linear_small_m_rows,
    linear_w16,
    linear_w16_rows,
    pack_vnni,
    pack_w16,
)
from workers.kernels.tp_comm import CommError, GlooComm, ShmComm

__all__ = [
    "DTYPE_CODES", "FUSED_DTYPES", "GROUP_WORDS", "LAYER_WORDS", "MAX_GROUP", "MAX_KV_HEADS",
    "W16_COLS", "W16_ROWS", "W16Weight", "add_rms_norm", "decode_kernel_name", "decode_layers",
    "fused_ops_apply", "library", "linear_amx", "linear_amx_rows", "linear_small_m",
    "linear_small_m_rows", "linear_w16", "linear_w16_rows", "pack_vnni", "pack_w16",
    "paged_decode", "paged_decode_heads_fit", "prefill_attention_bf16", "prefill_attention_f32",
    "rope_and_cache", "silu_mul",
    "CommError", "GlooComm", "ShmComm",
]
