"""The small-M linear (workers/kernels/csrc/linear_small_m.cpp: decode steps' linears, bf16, AVX512-BF16)
against a float32 reference, and the Linear layer's choice between it and oneDNN."""

from __future__ import annotations

import pytest
import torch

from workers import kernels
from workers.layers import Linear

BF16 = torch.bfloat16
ROWS = kernels.linear_small_m_rows(torch.empty(1, 2, dtype=BF16))
pytestmark = pytest.mark.skipif(ROWS == 0, reason="needs the native kernels and AVX512-BF16")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


# rows: 1-9 (one slice of x and the first split into two), around 16, 24 and 32, the most
ROW_CASES = sorted({m for m in (*range(1, 10), 15, 16, 17, 24, 31, 33, ROWS - 1, ROWS)
                    if 1 <= m <= ROWS})


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (4099, 64), (7, 46), (13, 100),
                                 (1, 30), (5, 34), (50, 2)])
@pytest.mark.parametrize("m", ROW_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_is_the_matmul_rounded_once(n, k, m, with_bias):
    """Shapes with K below, at and past a 64-pair chunk, N not a multiple of the 16-column
    block nor of the 3-block tile (and below one block), the row counts where x's slices
    change: float32 sums rounded once to bf16 (1 ulp: 2^-8 of the value, plus the summation
    order's error, far below it at these K)."""
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = torch.randn(n, k, generator=g).to(BF16)
    x = torch.randn(m, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if with_bias else None
    want = reference(x, w, b)
    got = kernels.linear_small_m(x, kernels.pack_vnni(w), n, b)
    assert got.dtype == BF16 and got.shape == (m, n)
    tol = 2 ** -8 * want.abs() + 1e-4 * k ** 0.5
    assert ((got.float() - want).abs() <= tol).all()


def test_small_m_linear_keeps_leading_dims_and_reads_strided_x():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(BF16)
    x = torch.randn(2, 1, 128, generator=g).to(BF16)[..., ::2]     # not contiguous
    got = kernels.linear_small_m(x, kernels.pack_vnni(w), 96, None)
    assert got.shape == (2, 1, 96)
    torch.testing.assert_close(got.float(), reference(x.reshape(2, 64), w, None).view(2, 1, 96),
                               atol=3e-2, rtol=2 ** -8)


def test_linear_takes_the_small_m_path_up_to_its_rows_and_onednn_past_them(monkeypatch):
    """Up to `small_m` rows the layer calls the small-M kernel; past them the packed oneDNN
    GEMM; both give the same values (to bf16 rounding)."""
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx512bf16")   # where the CPU has AMX too
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(640, 576, generator=g).to(BF16))
    assert lin.small_m == ROWS and lin.packed is not None and "small-m" in lin.kernel
    assert lin.weight is None and lin.vnni is not None   # (the two packed copies replace it)
    calls = []
    real = kernels.linear_small_m
    monkeypatch.setattr(kernels, "linear_small_m",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    for m in (1, ROWS, ROWS + 1, 2 * ROWS):
        x = torch.randn(m, 576, generator=g).to(BF16)
        want = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
        torch.testing.assert_close(lin(x).float(), want.float(), atol=3e-2, rtol=2 ** -7)
    assert calls == [(1, 576), (ROWS, 576)]


def test_portable_switch_turns_the_small_m_linear_off(monkeypatch):
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "portable")
    lin = Linear(torch.randn(64, 64).to(BF16))
    assert lin.small_m == lin.amx_m == 0 and lin.weight is None and lin.vnni is None
    assert lin.kernel == "onednn-packed"


def test_an_odd_k_leaves_the_small_m_linear_to_onednn():
    """Its k-pairs need K even; an odd K takes the packed oneDNN GEMM at any rows."""
    w = torch.randn(32, 45).to(BF16)
    assert kernels.linear_small_m_rows(w) == 0
    lin = Linear(w)
    assert lin.small_m == 0 and lin.vnni is None and lin.kernel == "onednn-packed"
    x = torch.randn(3, 45).to(BF16)
    torch.testing.assert_close(lin(x).float(), reference(x, w, None), atol=3e-2, rtol=2 ** -7)
