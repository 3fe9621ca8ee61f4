"""The native CPU linears of few rows (decode steps): bf16 on VNNI-packed weights by AMX
(csrc/linear_amx.cpp) or AVX512-BF16 (csrc/linear_small_m.cpp), float32 on bf16-held weights
by AVX2 + FMA (csrc/linear_w16.cpp); each `*_rows` says how many rows its kernel takes for a
weight (0: it does not apply, PyTorch's matmul runs)."""

from __future__ import annotations

import torch

from kvcache.manager import cdiv
from workers.kernels import bindings, isa


# ---- linears of few rows (decode steps) on VNNI-packed weights, bf16 on CPUs with AVX512-BF16
# (linear_small_m.cpp) ----
def linear_small_m_rows(weight: torch.Tensor) -> int:
    """The most rows of x the small-M linear takes for this weight (0: it does not apply: not a
    bf16 CPU weight, K odd, no AVX512-BF16, or the portable switch)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or weight.shape[1] % 2 or not isa.linear_small_m():
        return 0
    return bindings.library().small_m_max


def linear_small_m(x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias [n]) for at most linear_small_m_rows(W) rows of x, bf16,
    from W's pack_vnni copy; float32 sums rounded once."""
    lib = bindings.library()
    return _linear_vnni(lib.linear_small_m, lib.small_m_max, x, packed, n, bias)


def _linear_vnni(kernel, max_rows: int, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias) by `kernel` (linear_small_m or linear_amx's C call) on
    W's pack_vnni copy, for 1 <= rows <= max_rows."""
    k = packed.shape[1] * 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    assert x.dtype == packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed.shape == (cdiv(n, 16), k // 2, 16, 2) and x.shape[-1] == k, packed.shape
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
            or not isa.linear_w16():
        return 0
    if not torch.equal(weight.to(torch.bfloat16).float(), weight):
        return 0      # a float32 checkpoint's own values: stored as bf16 they would change
    return bindings.library().w16_max


W16_ROWS, W16_COLS = 4, 8   # linear_w16.cpp's tile: 4 rows x 8 columns, 64 bytes


def pack_w16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (float32 whose values are all bf16, linear_w16_rows > 0) as bf16 in the
    layout linear_w16 reads: [ceil(N / 4), ceil(K / 8), 4, 8], wp[t, c, r, i] = weight[4 t + r,
    8 c + i], zero past N and K (each tile of 4 rows one sequential stream)."""
    n, k = weight.shape
    n4, k8 = cdiv(n, W16_ROWS) * W16_ROWS, cdiv(k, W16_COLS) * W16_COLS
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
    lib = bindings.library()
    assert x.dtype == torch.float32 and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed.shape == (cdiv(n, W16_ROWS), cdiv(k, W16_COLS), W16_ROWS, W16_COLS), \
        (packed.shape, n, k)
    assert 1 <= m <= lib.w16_max, (x.shape, m)
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == torch.float32 and bias.is_contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib.linear_w16(out.data_ptr(), x2.data_ptr(), packed.data_ptr(),
                   0 if bias is None else bias.data_ptr(), m, n, k, torch.get_num_threads())
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
        bindings.library().linear_w16(out.data_ptr(), x.data_ptr(), *self._args, m, self.n, k,
                                      torch.get_num_threads())
        return out


# ---- linears of 1-16 rows on VNNI-packed weights, bf16 on CPUs with AMX-BF16 (linear_amx.cpp) ---
def linear_amx_rows(weight: torch.Tensor) -> int:
    """The most rows of x the AMX linear takes for this weight (0: it does not apply: not a bf16
    CPU weight, K not a multiple of 32, no AMX-BF16, or the portable switch)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or weight.shape[1] % 32 or not isa.linear_amx():
        return 0
    return bindings.library().amx_max


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the layout linear_amx and linear_small_m read: [ceil(N / 16), K / 2, 16,
    2], wp[nb, kp, n, i] = weight[16 nb + n, 2 kp + i], rows past N zero."""
    n, k = weight.shape
    assert k % 2 == 0, k
    padded = torch.zeros(cdiv(n, 16) * 16, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_amx(x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W [n, K]^T (+ bias [n]) for at most linear_amx_rows(W) rows of x, bf16, from
    W's pack_vnni copy; float32 sums rounded once."""
    lib = bindings.library()
    return _linear_vnni(lib.linear_amx, lib.amx_max, x, packed, n, bias)
