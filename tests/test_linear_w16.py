"""The float32 linear with bf16-held weights (workers/kernels/csrc/linear_w16.cpp: decode steps' linears of a
float32 model whose weights are bf16 values, AVX2 + FMA) against a float64 reference, and the
Linear layer's choice between it and oneDNN."""

from __future__ import annotations

import pytest
import torch

from workers import kernels
from workers.layers import Linear

BF16 = torch.bfloat16
ROWS = kernels.linear_w16_rows(torch.zeros(1, 1))
pytestmark = pytest.mark.skipif(ROWS == 0, reason="needs the native kernels and AVX2 + FMA")


def bf16_valued(*shape: int, g: torch.Generator) -> torch.Tensor:
    """float32 values that bf16 holds exactly (a bf16 checkpoint loaded in float32)."""
    return torch.randn(*shape, generator=g).to(BF16).float()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (4099, 64), (7, 45), (13, 100),
                                 (1, 31), (5, 3)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w16_linear_is_the_float32_matmul(n, k, m, with_bias):
    """K below, at and past 8-element chunks (tails zero-padded in the packed copy and in x),
    N not a multiple of the 4-row tile, M across the 3-row x chunks up to the most it takes:
    the float32 product up to the summation order (float32 sums of k products: well under 1e-5
    relative at these K)."""
    assert ROWS >= 16
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = bf16_valued(n, k, g=g)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = kernels.linear_w16(x, kernels.pack_w16(w), n, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = reference(x, w, b)
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()


def test_w16_linear_keeps_leading_dims_and_reads_strided_x():
    g = torch.Generator().manual_seed(1)
    w = bf16_valued(96, 64, g=g)
    x = torch.randn(2, 1, 128, generator=g)[..., ::2]     # not contiguous
    got = kernels.linear_w16(x, kernels.pack_w16(w), 96, None)
    assert got.shape == (2, 1, 96)
    torch.testing.assert_close(got, (x.reshape(2, 64) @ w.T).view(2, 1, 96),
                               atol=1e-5, rtol=1e-5)


def test_linear_takes_the_w16_path_up_to_its_rows_and_onednn_past_them(monkeypatch):
    """Up to `w16_m` rows the layer calls the bf16-weights kernel; past them the packed oneDNN
    float32 GEMM; the float32 weight is not kept (packed copy + bf16 copy); same values."""
    g = torch.Generator().manual_seed(2)
    lin = Linear(bf16_valued(640, 576, g=g))
    assert lin.w16_m == ROWS and lin.packed is not None and lin.weight is None
    assert lin.w16.packed.dtype == BF16 and "bf16-weights" in lin.kernel
    assert lin.w16.packed.shape == (160, 72, 4, 8)     # tiles of 4 rows x 8 columns
    calls = []
    real = kernels.W16Weight.__call__
    monkeypatch.setattr(kernels.W16Weight, "__call__",
                        lambda self, x: calls.append(x.shape) or real(self, x))
    for m in (1, ROWS, ROWS + 1, 64):
        x = torch.randn(m, 576, generator=g)
        want = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
        torch.testing.assert_close(lin(x), want, atol=1e-4, rtol=1e-5)
    assert calls == [(1, 576), (ROWS, 576)]


def test_a_float32_weight_bf16_cannot_hold_keeps_the_float32_gemm():
    """A float32 checkpoint's own values would change if stored as bf16: not taken."""
    g = torch.Generator().manual_seed(3)
    w = bf16_valued(64, 64, g=g)
    w[5, 7] += 2 ** -12   # one value past bf16's 8 bits of mantissa
    lin = Linear(w)
    assert lin.w16_m == 0 and lin.w16 is None and "bf16-weights" not in lin.kernel
    assert kernels.linear_w16_rows(w.to(BF16)) == 0      # a bf16 model has its own kernels


def test_portable_switch_turns_the_w16_linear_off(monkeypatch):
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "portable")
    lin = Linear(bf16_valued(64, 64, g=torch.Generator().manual_seed(4)))
    assert lin.w16_m == 0 and lin.w16 is None and lin.kernel == "onednn-packed"


def test_the_packed_layout_is_tiles_of_four_rows_by_eight_columns():
    """pack_w16: wp[t, c, r, i] = W[4 t + r, 8 c + i], bf16 exactly, zero past N and K."""
    w = bf16_valued(6, 11, g=torch.Generator().manual_seed(6))
    wp = kernels.pack_w16(w)
    assert wp.shape == (2, 2, 4, 8) and wp.dtype == BF16
    for n in range(8):
        for k in range(16):
            want = w[n, k].item() if n < 6 and k < 11 else 0.0
            assert wp[n // 4, k // 8, n % 4, k % 8].item() == want


def test_a_strided_or_3d_input_takes_the_general_path_with_the_same_result():
    """The layer's bound weight takes 2-D contiguous x; anything else goes through
    kernels.linear_w16 (reshaped, made contiguous): the same values."""
    g = torch.Generator().manual_seed(7)
    lin = Linear(bf16_valued(40, 24, g=g), torch.randn(40, generator=g))
    x = torch.randn(3, 48, generator=g)
    want = lin(x[:, ::2].contiguous())
    assert torch.equal(lin(x[:, ::2]), want)
    assert torch.equal(lin(x[:, ::2].contiguous().view(3, 1, 24)), want.view(3, 1, 40))
    with pytest.raises(ValueError, match="contiguous float32"):
        lin.w16(torch.randn(2, 23))
