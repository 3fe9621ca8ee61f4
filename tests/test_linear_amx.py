"""The AMX linear (workers/kernels/csrc/linear_amx.cpp: decode steps' linears of 1-16 rows, bf16, on a
VNNI-packed weight) against a float32 reference, and the Linear layer's choice between it,
the small-M kernel and oneDNN."""

from __future__ import annotations

import pytest
import torch

from workers import kernels
from workers.layers import Linear

BF16 = torch.bfloat16
ROWS = kernels.linear_amx_rows(torch.empty(1, 32, dtype=BF16))
pytestmark = pytest.mark.skipif(ROWS == 0, reason="needs the native kernels and AMX-BF16")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


def test_pack_vnni_layout():
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64).to(BF16)
    p = kernels.pack_vnni(w)
    assert p.shape == (3, 32, 16, 2) and p.is_contiguous()
    for nb, kp, n, i in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 3, 1), (2, 31, 7, 0)]:
        assert p[nb, kp, n, i] == w[16 * nb + n, 2 * kp + i]
    assert (p[2, :, 8:] == 0).all()          # rows past N


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (4099, 64), (7, 32), (17, 96),
                                 (1, 32), (33, 128)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_the_matmul_rounded_once(n, k, m, with_bias):
    """N below, at and past 16-column blocks and odd numbers of blocks (the last pair has one),
    K from one 32-element step up, the one-row path and the tile path: float32 sums rounded
    once to bf16 (1 ulp: 2^-8 of the value, plus the summation order's error)."""
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + m)
    w = torch.randn(n, k, generator=g).to(BF16)
    x = torch.randn(m, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if with_bias else None
    want = reference(x, w, b)
    got = kernels.linear_amx(x, kernels.pack_vnni(w), n, b)
    assert got.dtype == BF16 and got.shape == (m, n)
    tol = 2 ** -8 * want.abs() + 1e-4 * k ** 0.5
    assert ((got.float() - want).abs() <= tol).all()


def test_strided_input_with_leading_dims():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=g).to(BF16)
    x = torch.randn(2, 3, 128, generator=g).to(BF16)[..., ::2]    # not contiguous
    got = kernels.linear_amx(x, kernels.pack_vnni(w), 100, None)
    assert got.shape == (2, 3, 100)
    want = reference(x.reshape(6, 64), w, None).view(2, 3, 100)
    assert ((got.float() - want).abs() <= 2 ** -8 * want.abs() + 1e-3).all()


def test_linear_takes_the_amx_path_up_to_16_rows_and_onednn_past_them(monkeypatch):
    """Up to `amx_m` rows the layer calls the AMX kernel (and not the small-M one, whose plain
    weight it does not keep); past them the packed oneDNN GEMM, which still runs right after
    AMX calls released their tiles; both give the same values (to bf16 rounding)."""
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(640, 576, generator=g).to(BF16),
                 torch.randn(640, generator=g).to(BF16))
    assert lin.amx_m == ROWS == 16 and lin.small_m == 0 and lin.weight is None
    assert lin.packed is not None and lin.kernel == "onednn-packed+amx-bf16"
    calls = []
    real = kernels.linear_amx
    monkeypatch.setattr(kernels, "linear_amx", lambda *a: calls.append(a[0].shape) or real(*a))
    for m in (1, 2, 9, ROWS, ROWS + 1, 64, 3):
        x = torch.randn(m, 576, generator=g).to(BF16)
        want = torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
        torch.testing.assert_close(lin(x).float(), want.float(), atol=3e-2, rtol=2 ** -7)
    assert calls == [(1, 576), (2, 576), (9, 576), (ROWS, 576), (3, 576)]


def test_k_not_a_multiple_of_32_keeps_the_other_paths():
    """K = 48: no AMX linear; the small-M kernel (AVX512-BF16, which every AMX CPU has) takes
    the layer's few-row steps on its VNNI copy, and they are still the matmul."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 48, generator=g).to(BF16)
    lin = Linear(w)
    assert lin.amx_m == 0
    assert lin.small_m == kernels.linear_small_m_rows(w) > 0 and lin.vnni is not None
    assert lin.kernel == "onednn-packed+small-m-avx512bf16"
    x = torch.randn(3, 48, generator=g).to(BF16)
    want = reference(x, w, None)
    assert ((lin(x).float() - want).abs() <= 2 ** -8 * want.abs() + 1e-3).all()


@pytest.mark.parametrize("isa", ["avx512bf16", "portable"])
def test_isa_switch_turns_the_amx_linear_off(monkeypatch, isa):
    monkeypatch.setenv("RAYPD_KERNEL_ISA", isa)
    lin = Linear(torch.randn(64, 64).to(BF16))
    assert lin.amx_m == 0
    assert lin.small_m == kernels.linear_small_m_rows(torch.empty(1, 2, dtype=BF16))
    assert (lin.small_m == 0) == (isa == "portable")
    assert (lin.vnni is None) == (isa == "portable")    # only the small-M kernel reads it
