"""The CUDA paged decode attention in Triton (workers/kernels/triton_decode.py) computes what the torch
gather path computes, reading the pool in place through random block tables (GPU tests, skipped
without cuda and Triton); where Triton is missing the selection falls back to the torch path
cleanly and says so (CPU tests)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvcache.manager import cdiv
from workers import attention
from workers import kernels as native
from workers.attention import DecodeGroup, LayerKV, _decode_attention_torch
from workers.kernels import triton_decode


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and _has_triton()),
                         reason="needs cuda and Triton")


@pytest.fixture
def fresh_selection():
    """Forget what the module decided about this machine, before and after the test."""
    triton_decode._kernels.cache_clear()
    triton_decode._cuda.cache_clear()
    yield
    triton_decode._kernels.cache_clear()
    triton_decode._cuda.cache_clear()


# ---- CPU: selection and fallback ------------------------------------------------------------
def test_without_triton_cuda_decode_falls_back_to_the_torch_path(fresh_selection, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)          # `import triton` raises
    monkeypatch.setitem(sys.modules, "workers.kernels.triton_decode_kernels", None)
    monkeypatch.setattr(triton_decode, "_cuda", lambda: True)  # as if a GPU were here
    monkeypatch.delenv("RAYPD_TRITON_DECODE", raising=False)
    assert not triton_decode.available()
    assert triton_decode.unavailable_reason() == "triton not importable"
    cuda = torch.device("cuda")
    assert attention.decode_kernel_name(cuda, torch.bfloat16, 128) == "torch"
    assert triton_decode.kernel_name(cuda, torch.bfloat16, 128) is None


def test_with_triton_cuda_decode_is_reported_as_triton_unless_switched_off(
        fresh_selection, monkeypatch):
    monkeypatch.setattr(triton_decode, "_kernels", lambda: object())   # "importable"
    monkeypatch.setattr(triton_decode, "_cuda", lambda: True)
    monkeypatch.delenv("RAYPD_TRITON_DECODE", raising=False)
    cuda = torch.device("cuda")
    assert attention.decode_kernel_name(cuda, torch.bfloat16, 128) == "triton-cuda"
    assert attention.decode_kernel_name(cuda, torch.float32, 64) == "triton-cuda"
    assert attention.decode_kernel_name(cuda, torch.float64, 128) == "torch"   # not a KV dtype
    assert attention.decode_kernel_name(cuda, torch.bfloat16, 512) == "torch"  # head too wide
    monkeypatch.setenv("RAYPD_TRITON_DECODE", "0")
    assert attention.decode_kernel_name(cuda, torch.bfloat16, 128) == "torch"
    assert triton_decode.unavailable_reason() == "RAYPD_TRITON_DECODE=0"


def test_the_cpu_keeps_its_own_decode_kernel(fresh_selection):
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert attention.decode_kernel_name(cpu, dtype, 64) == \
            native.decode_kernel_name(cpu, dtype, 64)
    q = torch.randn(2, 4, 16)
    assert not triton_decode.applies(q, torch.randn(8, 16, 2, 16))   # a CPU tensor: never


def _case(batch: int, group: int, lens: list[int], bs: int = 16, kv_heads: int = 2,
          head_dim: int = 64, dtype: torch.dtype = torch.float32, q_dtype=None,
          device: str = "cpu", seed: int = 0):
    """q, a 3-layer pool (the kernel reads layer 1: a view at an offset), block tables of
    distinct random blocks, padded with block 0, and the rows' context lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, bs) for n in lens]
    num_blocks = sum(need) + 3
    pool = torch.randn(3, 2, num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need)
    tables = torch.zeros(batch, width, dtype=torch.long)
    used = 0
    for r, nb in enumerate(need):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(q_dtype or dtype)
    dev = torch.device(device)
    k, v = pool.to(dev)[1]
    return (q.to(dev), k, v, tables.to(dev), torch.tensor(lens, dtype=torch.long, device=dev))


def test_split_plan_covers_the_context_in_whole_tiles():
    for batch, kv_heads, n in [(1, 8, 4096), (1, 8, 100), (16, 8, 1024), (64, 8, 4096),
                               (1, 1, 131072), (3, 4, 1)]:
        splits, part = triton_decode.split_plan(batch, kv_heads, n, 64, 132)
        assert 1 <= splits <= triton_decode.MAX_SPLITS and part % 64 == 0
        assert splits * part >= n and (splits - 1) * part < n     # no split wholly past the end
    assert triton_decode.split_plan(64, 8, 4096, 64, 132)[0] == 1     # the GPU is full already
    assert triton_decode.split_plan(1, 8, 4096, 64, 132) == (16, 256)


def test_decode_attention_takes_the_triton_kernel_where_it_applies(monkeypatch):
    """The dispatch, seen on the CPU: with the kernel applying, `_decode_attention` hands it the
    group (with the host's max_context_len); a quantized pool never reaches it."""
    q, k, v, tables, lens = _case(3, 2, [5, 17, 33])
    group = DecodeGroup(0, 3, tables, lens, 33)
    calls = []

    def fake(q_, k_, v_, t_, l_, scale, window, max_len):
        calls.append(max_len)
        return _decode_attention_torch(q_, LayerKV(k_, v_), group, scale, window)

    monkeypatch.setattr(triton_decode, "applies", lambda q_, k_: True)
    monkeypatch.setattr(triton_decode, "paged_decode", fake)
    out = attention._decode_attention(q, LayerKV(k, v), group, 0.125, None)
    assert calls == [33]
    torch.testing.assert_close(out, _decode_attention_torch(q, LayerKV(k, v), group, 0.125, None))


# ---- GPU: the kernel against the gather path --------------------------------------------------
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _check(q, k, v, tables, lens, window=None, scale=None):
    """The kernel against the torch gather path run in float32 on the same stored values."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    max_len = int(lens.max())
    group = DecodeGroup(0, q.shape[0], tables, lens, max_len)
    assert triton_decode.applies(q, k)
    out = triton_decode.paged_decode(q, k, v, tables, lens, scale, window, max_len)
    ref = _decode_attention_torch(q.float(), LayerKV(k.float(), v.float()), group, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[q.dtype], f"max abs error {err}"
    return err


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_triton_decode_equals_the_gather_path(dtype, group):
    g = torch.Generator().manual_seed(group)
    for batch in (1, 7, 33):
        # lengths that are no multiple of the block size, a 1, and one long enough to split
        lens = torch.randint(1, 1500, (batch,), generator=g).tolist()
        lens[0] = 1 if batch > 1 else 2999
        lens[-1] = max(lens[-1], 17)
        _check(*_case(batch, group, lens, dtype=dtype, device="cuda", seed=batch))


@gpu
@pytest.mark.parametrize("bs", [1, 8, 32])
def test_triton_decode_reads_any_block_size(bs):
    _check(*_case(5, 4, [1, 31, 33, 250, 1029], bs=bs, dtype=torch.bfloat16, device="cuda"))


@gpu
def test_triton_decode_llama3_8b_shape_long_context_splits():
    q, k, v, tables, lens = _case(2, 4, [4097, 3000], kv_heads=8, head_dim=128,
                                  dtype=torch.bfloat16, device="cuda")
    assert triton_decode.split_plan(2, 8, 4097, 64, 132)[0] > 1
    _check(q, k, v, tables, lens)


@gpu
def test_triton_decode_sliding_window_and_mixed_dtypes():
    case = _case(4, 3, [5, 100, 700, 2100], dtype=torch.float32, q_dtype=torch.bfloat16,
                 device="cuda")
    _check(*case, window=64)
    _check(*case, window=1)
    _check(*case, window=5000)


@gpu
def test_triton_decode_reads_a_strided_query():
    q, k, v, tables, lens = _case(3, 4, [9, 90, 900], dtype=torch.bfloat16, device="cuda")
    wide = torch.randn(3, q.shape[1] + 5, q.shape[2], dtype=q.dtype, device="cuda")
    wide[:, 2:2 + q.shape[1]] = q
    _check(wide[:, 2:2 + q.shape[1]], k, v, tables, lens)


@gpu
def test_triton_decode_replays_in_a_cuda_graph():
    q, k, v, tables, lens = _case(4, 4, [10, 300, 1200, 2500], dtype=torch.bfloat16,
                                  device="cuda")
    max_len = 4096   # the graph's fixed ceiling: its split count comes from here
    for _ in range(2):
        triton_decode.paged_decode(q, k, v, tables, lens, 0.125, None, max_len)   # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.paged_decode(q, k, v, tables, lens, 0.125, None, max_len)
    lens.copy_(torch.tensor([1, 17, 1000, 2500]))   # each within its row of the table
    tables.copy_(tables.flip(1))
    q.copy_(torch.randn_like(q))
    graph.replay()
    group = DecodeGroup(0, 4, tables, lens, int(lens.max()))
    ref = _decode_attention_torch(q.float(), LayerKV(k.float(), v.float()), group, 0.125, None)
    assert (out.float() - ref).abs().max().item() <= TOL[torch.bfloat16]
