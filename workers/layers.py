"""Building blocks of the compact model: prepacked linear, RMSNorm, rotary embedding, SiLU-and-mul.

Each computes what its transformers counterpart computes, in the same dtype and order (RMSNorm in
float32, rotary tables in float32 then cast), so float32 outputs match stock transformers up to
the matmul kernels' summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers import kernels


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). On the CPU the weight is reordered once into oneDNN's blocked
    layout (what torch.compile's freezing does for CPU linears): 2-4x faster than `F.linear` at
    decode batch sizes, same results. A bf16 step of few rows (decode) streams the weights
    from a second copy near the memory's rate, where oneDNN reaches about 60% of it:
    - on a CPU with AMX-BF16 (and K a multiple of 32), up to `amx_m` (16) rows run
      workers/kernels/csrc/linear_amx.cpp on a VNNI-packed copy (`vnni`);
    - else on a CPU with AVX512-BF16 (and K even), up to `small_m` (64) rows run
      workers/kernels/csrc/linear_small_m.cpp on the same VNNI-packed copy.
    A float32 step of few rows whose weights are all bf16 values (a float32 model of a bf16
    checkpoint, as on a CPU without native bf16) streams them as bf16 through
    workers/kernels/csrc/linear_w16.cpp (AVX2 + FMA): exact, half the bytes, up to `w16_m` (16) rows.
    Elsewhere (cuda) it is `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight.detach().contiguous()
        self.amx_m = kernels.linear_amx_rows(self.weight) if prepack else 0
        self.small_m = kernels.linear_small_m_rows(self.weight) \
            if prepack and not self.amx_m else 0
        self.vnni = kernels.pack_vnni(self.weight) if self.amx_m or self.small_m else None
        self.w16_m = kernels.linear_w16_rows(self.weight) if prepack else 0
        # (bias: float32 too)
        self.w16 = kernels.W16Weight(self.weight, self.bias) if self.w16_m else None
        if prepack and _can_prepack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
                self.weight = None   # the packed copies replace it
            except RuntimeError:
                self.packed = None

    @property
    def kernel(self) -> str:
        name = "onednn-packed" if self.packed is not None else "torch"
        if self.amx_m:
            return f"{name}+amx-bf16"
        if self.w16_m:
            return f"{name}+small-m-bf16-weights-avx2"
        return f"{name}+small-m-avx512bf16" if self.small_m else name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and 0 < x.numel():
            if self.amx_m and x.numel() <= self.amx_m * self.in_features:
                return kernels.linear_amx(x, self.vnni, self.out_features, self.bias)
            if self.small_m and x.numel() <= self.small_m * self.in_features:
                return kernels.linear_small_m(x, self.vnni, self.out_features, self.bias)
        elif self.w16_m and x.dtype == torch.float32 \
                and 0 < x.numel() <= self.w16_m * self.in_features:
            if x.dim() == 2 and x.is_contiguous():    # the compact model's activations
                return self.w16(x)
            return kernels.linear_w16(x, self.w16.packed, self.out_features, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, by torch's own kernel: the same in float32; in bfloat16 it
    rounds once where transformers rounds twice (normalized value, then the scaled one)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, from transformers' own rope
    initialisation for the config (so every rope_type it knows is supported)."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64)
                                       .to(device=device, dtype=torch.float) / dim))
            scaling = 1.0
        else:   # (transformers' own initialisation, for a stock model's config)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype)    # [max_positions, head_dim]
        self.sin = (emb.sin() * scaling).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, head_dim] of a step's positions: looked up once, used by every
        layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by each token's position."""
        cos, sin = cos_sin
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate, up) -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
