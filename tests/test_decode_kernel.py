"""The native paged decode attention (workers/kernels/csrc/paged_decode.cpp) against a plain
float64 PyTorch reference: GQA ratios 1, 3, 4, 8; head_dim 64 and 128; context lengths around a
block's edges and a few thousand; block tables that are not contiguous; sliding windows; one thread and two
(a long context is split between them); the widest path the CPU has (AMX scores for bf16
pools where the CPU has AMX-BF16), the AVX512-BF16, AVX2 and portable ones forced."""

from __future__ import annotations

import pytest
import torch

from kvcache.manager import cdiv
from workers import kernels
from workers.kernels import isa as kisa

BS = 16
LENS = [1, BS - 1, BS, BS + 1, 3000]

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason="the native kernel could not be built (no C++ compiler)")


def reference(q, k_cache, v_cache, tables, lens, scale, window):
    """Each row attends to its own tokens (its block table's first lens[b]), in float64."""
    b, h, d = q.shape
    bs = k_cache.shape[1]
    n_kv = k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = torch.arange(n)
        blocks = tables[i][slots // bs]
        k = k_cache[blocks, slots % bs].double()              # [n, Hkv, D]
        v = v_cache[blocks, slots % bs].double()
        first = max(0, n - window) if window else 0
        k, v = k[first:], v[first:]
        qi = q[i].double().view(n_kv, h // n_kv, d)            # [Hkv, G, D]
        scores = torch.einsum("kgd,tkd->kgt", qi, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("kgt,tkd->kgd", probs, v).reshape(h, d)
    return out


def case(n_kv, group, head_dim, dtype, seed=0, bs=BS, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    width = cdiv(max(lens), bs)
    num_blocks = len(lens) * width + 7
    k_cache = torch.randn(num_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lens)
    # a shuffled pool: each row's blocks are scattered, not contiguous
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), n_kv * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens


def has_avx2() -> bool:
    return bool(kernels.library().paths(64, 0) >> kisa.AVX2 & 1)


def has_avx512_bf16() -> bool:
    return bool(kernels.library().paths(64, 1) >> kisa.AVX512_BF16 & 1)


def has_amx() -> bool:
    return bool(kernels.library().paths(64, 1) >> kisa.AMX & 1)


@pytest.mark.parametrize("isa", ["fast", "avx512bf16", "avx2", "portable"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n_kv, group", [(4, 1), (3, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_reference(monkeypatch, dtype, n_kv, group, head_dim, window,
                                            threads, isa):
    if isa == "avx2" and not has_avx2():
        pytest.skip("no AVX2 + FMA on this CPU")
    if isa == "avx512bf16" and (dtype == torch.float32 or not has_amx()):
        pytest.skip("the same path as fast here (float32 pools, or no AMX on this CPU)")
    if isa != "fast":   # fast: the widest path the CPU has (AMX scores for bf16, or AVX2)
        monkeypatch.setenv("RAYPD_KERNEL_ISA", isa)
    q, k_cache, v_cache, tables, lens = case(n_kv, group, head_dim, dtype)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale, window)
    finally:
        torch.set_num_threads(before)
    want = reference(q, k_cache, v_cache, tables, lens, scale, window)
    # float32: summation order only; bf16: the output's own rounding (2^-8 relative) on top
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_kv, group, head_dim", [(1, 12, 64), (2, 5, 96), (1, 16, 32),
                                                   (2, 2, 256)])
def test_uncommon_shapes_match_the_reference(n_kv, group, head_dim, threads):
    """The AVX512-BF16 path compiles G <= 8 with head_dim 64 or 128 as constants; other shapes
    (more query heads a KV head, other head sizes) take its general instance, as do the AVX2
    and portable paths' float32 runs."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k_cache, v_cache, tables, lens = case(n_kv, group, head_dim, dtype, seed=3)
        scale = head_dim ** -0.5
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale, 40)
            full = kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale, None)
        finally:
            torch.set_num_threads(before)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens,
                                                           scale, 40), atol=tol, rtol=tol)
        torch.testing.assert_close(full.double(), reference(q, k_cache, v_cache, tables, lens,
                                                            scale, None), atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ["fast", "avx512bf16"])
@pytest.mark.parametrize("bs", [8, 32])
def test_other_block_sizes_match_the_reference(monkeypatch, bs, isa):
    """Blocks of 8 tokens (every 16-token tile of the AMX scores is short and copied out) and of
    32 (two full tiles a block), bf16, GQA 4, a window that starts inside a block."""
    if isa != "fast":
        monkeypatch.setenv("RAYPD_KERNEL_ISA", isa)
    lens = [1, bs - 1, bs, bs + 1, 2 * bs + 3, 700]
    q, k_cache, v_cache, tables, lens_t = case(2, 4, 64, torch.bfloat16, seed=5, bs=bs,
                                               lens=lens)
    for window in (None, 37):
        out = kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, 0.125, window)
        torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens_t,
                                                           0.125, window), atol=1e-2, rtol=1e-2)


def test_the_kernel_names_the_path_it_takes(monkeypatch):
    cpu = torch.device("cpu")
    avx2 = "native-cpu-avx2" if has_avx2() else "native-cpu"
    avx512 = "native-cpu-avx512bf16" if has_avx512_bf16() else avx2
    assert kernels.decode_kernel_name(cpu, torch.bfloat16) == \
        ("native-cpu-amx" if has_amx() else avx512)
    assert kernels.decode_kernel_name(cpu, torch.float32) == avx2
    assert kernels.decode_kernel_name(cpu, torch.float32, head_dim=60) == "native-cpu"  # D % 8
    assert kernels.decode_kernel_name(cpu, torch.bfloat16, head_dim=48) != "native-cpu-amx"
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx512bf16")
    assert kernels.decode_kernel_name(cpu, torch.bfloat16) == avx512
    assert kernels.decode_kernel_name(cpu, torch.float32) == avx2
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "avx2")
    assert kernels.decode_kernel_name(cpu, torch.bfloat16) == avx2
    monkeypatch.setenv("RAYPD_KERNEL_ISA", "portable")
    assert kernels.decode_kernel_name(cpu, torch.bfloat16) == "native-cpu"
    assert kernels.decode_kernel_name(cpu, torch.float32) == "native-cpu"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fast_avx2_and_portable_paths_give_the_same_tokens(monkeypatch, dtype):
    """The whole engine, greedy: the widest path (AMX scores for bf16 where the CPU has it),
    the AVX512-BF16, AVX2 and portable ones agree token for token."""
    from conftest import make_engine, random_prompt

    from workers.model_loader import load_model
    from workers.request import SamplingParams
    loaded = load_model("tiny", dtype)
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 40, 90)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = {}
    for isa in ("", "avx512bf16", "avx2", "portable"):
        monkeypatch.setenv("RAYPD_KERNEL_ISA", isa)
        tokens[isa] = [r.output_token_ids for r in make_engine(loaded).generate(prompts, greedy)]
    assert tokens[""] == tokens["avx512bf16"] == tokens["avx2"] == tokens["portable"]


OLD_RULE_CAPS = {"portable": 0, "avx2": 1, "avx512bf16": 2, "": 3}


@pytest.mark.parametrize("env", sorted(OLD_RULE_CAPS))
def test_isa_picks_the_path_the_kernel_picked_itself_before(monkeypatch, env):
    """isa.decode_attention gives, on this CPU, what paged_decode.cpp's raypd_decode_path(D,
    dtype, cap) gave when the kernel decided itself (the rule kept here, from the CPU checks
    the library reports: AMX-BF16 usable, AVX512-BF16, AVX2 + FMA)."""
    lib = kernels.library()
    monkeypatch.setenv("RAYPD_KERNEL_ISA", env)
    cap = OLD_RULE_CAPS[env]
    for d in (16, 48, 60, 64, 96, 128, 256, 512, 520, 544):
        for dtype in (0, 1):
            bf16_ok = dtype == 1 and d % 32 == 0 and d <= 512
            want = 3 if cap >= 3 and bf16_ok and lib.amx_max > 0 else \
                2 if cap >= 2 and bf16_ok and lib.small_m_max > 0 else \
                1 if cap >= 1 and d % 8 == 0 and d <= 512 and lib.w16_max > 0 else 0
            assert kisa.decode_attention(d, dtype) == want, (d, dtype)


def test_the_kernel_refuses_a_path_this_cpu_or_shape_lacks():
    """raypd_paged_decode runs the path it is given, and only one raypd_decode_paths allows
    (returns 2, nothing computed): a wrong path is a refused call, not an illegal instruction."""
    lib = kernels.library()
    q, k_cache, v_cache, tables, lens = case(2, 2, 64, torch.bfloat16, bs=16, lens=[5])
    for path in (*range(4), 4, -1):
        out = torch.empty_like(q)
        rc = lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              tables.data_ptr(), lens.data_ptr(), out.data_ptr(), 1, q.shape[1],
                              64, 16, k_cache.shape[2], tables.shape[1], k_cache.shape[0], 0.1, 0,
                              1, 1, path)
        assert rc == (0 if 0 <= path < 4 and lib.paths(64, 1) >> path & 1 else 2), path
    assert lib.paths(60, 1) >> kisa.AVX512_BF16 & 1 == 0      # D % 32: no bf16 path
