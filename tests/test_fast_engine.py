"""The fast engine path (compact model, prepacked linears, native decode attention) computes what
stock transformers computes: greedy tokens identical to `generate()` in float32 for Llama-,
Qwen2- and Mistral-shaped checkpoints (one with a sliding window shorter than the prompt), on
the stock fallback too; bf16 logits within a stated tolerance; native kernel == torch path."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import hf_greedy, make_engine, random_prompt, save_random_checkpoint
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvcache.manager import cdiv
from workers import kernels
from workers.attention import DecodeGroup, LayerKV, _decode_attention_torch
from workers.kernels import build
from workers.model_loader import load_model
from workers.request import SamplingParams
from workers.scheduler_output import ModelRunnerOutput

BF16 = torch.bfloat16
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
WINDOW = 24   # the Mistral-shaped model's sliding window: shorter than most prompts below


def _save_checkpoint(path, config_cls, tokenizer, seed: int, dtype=torch.float32, **extra):
    return save_random_checkpoint(path, config_cls, tokenizer, seed, dtype, SHAPE, **extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: folder} of random-weight checkpoints raypd loads through `--model PATH`."""
    _, tokenizer, _ = load_model("tiny")
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": _save_checkpoint(root / "llama", LlamaConfig, tokenizer, 1),
        "qwen2": _save_checkpoint(root / "qwen2", Qwen2Config, tokenizer, 2),   # q/k/v biases
        "mistral_sliding": _save_checkpoint(root / "mistral", MistralConfig, tokenizer, 3,
                                            sliding_window=WINDOW),
        "llama_gelu": _save_checkpoint(root / "gelu", LlamaConfig, tokenizer, 4,
                                       hidden_act="gelu"),
        # bf16 checkpoints (as SmolLM2's), served in float32 on a CPU without native bf16
        "llama_bf16": _save_checkpoint(root / "llama_bf16", LlamaConfig, tokenizer, 5, BF16),
        "qwen2_bf16": _save_checkpoint(root / "qwen2_bf16", Qwen2Config, tokenizer, 6, BF16),
    }


def _reference(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")


def _drained(engine) -> None:
    engine.check_invariants()
    assert engine.kv.pool.counts()["referenced"] == 0


PROMPT_LENS = [3, 17, 23, 25, 40, 61, 90, 9]   # around and beyond the window and block size


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_sliding"])
@pytest.mark.parametrize("model_impl", ["compact", "stock"])
def test_greedy_matches_generate_for_each_family(checkpoints, family, model_impl):
    path = checkpoints[family]
    loaded = load_model(str(path), "float32")
    engine = make_engine(loaded, model_impl=model_impl)
    assert engine.get_stats()["model_impl"] == model_impl
    prompts = [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENS)]
    reqs = engine.generate(prompts, GREEDY)
    reference = _reference(path)
    for r in reqs:
        assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 20), \
            f"{family}/{model_impl}: {len(r.prompt_token_ids)}-token prompt"
    _drained(engine)


@pytest.mark.parametrize("family", ["llama_bf16", "qwen2_bf16"])
def test_float32_model_of_a_bf16_checkpoint_matches_generate(checkpoints, family):
    """A bf16 checkpoint in float32: decode steps' linears read the weights as bf16 (exact)
    through workers/kernels/csrc/linear_w16.cpp where the CPU has AVX2 + FMA; greedy tokens are
    still generate()'s in float32, at batch 8 (8 rows) and alone (1 row)."""
    path = checkpoints[family]
    engine = make_engine(load_model(str(path), "float32"))
    w16 = kernels.linear_w16_rows(torch.zeros(1, 1)) > 0
    assert ("bf16-weights" in engine.get_stats()["linear_kernel"]) == w16
    prompts = [random_prompt(n, seed=200 + i) for i, n in enumerate(PROMPT_LENS)]
    reference = _reference(path)
    for reqs in (engine.generate(prompts, GREEDY), engine.generate(prompts[:1], GREEDY)):
        for r in reqs:
            assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 20), \
                f"{family}: {len(r.prompt_token_ids)}-token prompt"
    _drained(engine)


@pytest.mark.parametrize("family", ["llama", "mistral_sliding"])
def test_prefix_hit_and_chunked_prefill_match_generate(checkpoints, family):
    path = checkpoints[family]
    engine = make_engine(load_model(str(path), "float32"), max_num_batched_tokens=8)
    shared = random_prompt(48, seed=7)
    first, second = (engine.generate([shared + random_prompt(n, seed=8 + n)], GREEDY)[0]
                     for n in (5, 13))
    assert second.lifecycle.cached_tokens == 48
    reference = _reference(path)
    for r in (first, second):
        assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 20)
    _drained(engine)


def test_unsupported_config_falls_back_to_stock_and_says_so(checkpoints):
    path = checkpoints["llama_gelu"]
    engine = make_engine(load_model(str(path), "float32"))
    stats = engine.get_stats()
    assert stats["model_impl"] == "stock" and "hidden_act" in stats["model_fallback"]
    [req] = engine.generate([random_prompt(30, seed=5)], GREEDY)
    assert req.output_token_ids == hf_greedy(_reference(path), req.prompt_token_ids, 20)
    with pytest.raises(ValueError, match="hidden_act"):
        make_engine(load_model(str(path), "float32"), model_impl="compact")


BF16_LOGIT_TOL = 0.06   # max |engine - stock| over the vocabulary, relative to max |stock logit|


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_sliding"])
def test_bf16_logits_close_to_stock_bf16(checkpoints, family):
    """bf16 weights + bf16 KV: next-token logits of a prefill and of decodes stay within
    BF16_LOGIT_TOL of stock transformers run in bf16 (summation order differs, so tokens may
    flip on near-ties; float32 is where token equality is required)."""
    path = checkpoints[family]
    engine = make_engine(load_model(str(path), "bfloat16"))
    assert engine.kv_dtype == "bfloat16"
    reference = _reference(path, torch.bfloat16)
    prompt = random_prompt(50, seed=11)
    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = list(prompt)
    for _ in range(4):
        sched = engine.scheduler.schedule()
        logits, rows = engine.runner.execute(sched)
        with torch.inference_mode():
            ref = reference(torch.tensor([tokens])).logits[0, -1].float()
        err = (logits[0] - ref).abs().max().item() / ref.abs().max().item()
        assert err <= BF16_LOGIT_TOL, f"{family}: relative logit error {err:.4f}"
        # continue the engine by hand with the stock model's greedy token
        tok = int(ref.argmax())
        req, = engine.scheduler.update_from_output(sched, ModelRunnerOutput(rows, [tok]), 0.0)
        tokens.append(tok)
    engine.abort(req.request_id)
    _drained(engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_native_decode_kernel_agrees_with_torch_path(dtype, window):
    if kernels.library() is None:
        pytest.skip("the native kernel could not be built here (no C++ compiler)")
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, n_kv, head_dim, heads = 64, 16, 2, 32, 6
    k_cache = torch.randn(num_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 70, 130])
    width = int(cdiv(lens.max(), bs))
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    group = DecodeGroup(0, len(lens), tables, lens, int(lens.max()))
    native = kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window)
    torch_out = _decode_attention_torch(q, LayerKV(k_cache, v_cache), group, head_dim ** -0.5,
                                        window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), torch_out.float(), atol=tol, rtol=tol)


def test_native_kernel_refuses_inputs_it_would_read_past():
    if kernels.library() is None:
        pytest.skip("the native kernel could not be built here (no C++ compiler)")
    cache = torch.randn(4, 16, 2, 8)
    q, tables = torch.randn(2, 4, 8), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.paged_decode(q, cache, cache, tables, torch.tensor([3, 17]), 0.3, None)
    with pytest.raises(ValueError, match="paged_decode"):       # head_dim differs
        kernels.paged_decode(torch.randn(2, 4, 4), cache, cache, tables, torch.tensor([3, 5]),
                             0.3, None)
    nc = torch.randn(4, 2, 16, 8).transpose(1, 2)               # same shape, not contiguous
    with pytest.raises(ValueError, match="paged_decode"):
        kernels.paged_decode(q, nc, nc, tables, torch.tensor([3, 5]), 0.3, None)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.paged_decode(q, cache, cache, torch.tensor([[0], [4]]), torch.tensor([3, 5]),
                             0.3, None)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.paged_decode(q, cache, cache, tables, torch.tensor([3, -1]), 0.3, None)


def test_native_kernel_builds_once_into_the_cache_and_reuses_it(tmp_path):
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    lib = build.build(tmp_path)
    assert lib.parent == tmp_path / "native" and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert build.build(tmp_path) == lib and lib.stat().st_mtime_ns == mtime   # not rebuilt
    # no temporary file left (the lock file stays: it is only ever locked, never rewritten)
    assert {p.name for p in lib.parent.iterdir()} == {lib.name, lib.stem + ".lock"}


def test_workers_starting_together_compile_the_kernel_once(tmp_path, monkeypatch):
    """Builds that start together wait for one compile (each compiled on its own before: four
    actors starting on a new 2-core machine ran four compiles at once)."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text("#!/bin/sh\n"
                   'if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi\n'
                   f'echo compile >> "{calls}"\n'
                   'while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
                   'sleep 0.5\n'                      # long enough for the others to arrive
                   'echo lib > "$out"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with ThreadPoolExecutor(4) as pool:
        libs = list(pool.map(lambda _: build.build(tmp_path), range(4)))
    assert len(set(libs)) == 1 and libs[0].read_text() == "lib\n"
    # one build: each source compiled once, then one link
    assert calls.read_text().splitlines() == ["compile"] * (len(build.SOURCES) + 1)


def test_without_a_compiler_the_kernel_is_off_and_attention_takes_the_torch_path(
        tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAYPD_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setenv("RAYPD_CACHE_DIR", str(tmp_path))
    kernels.library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
            build.build(tmp_path)
        q = torch.randn(2, 4, 8)
        cache = torch.randn(4, 16, 2, 8)
        assert kernels.paged_decode(q, cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                    torch.tensor([3, 5]), 0.3, None) is None
        assert kernels.decode_kernel_name(torch.device("cpu")) == "torch"
        assert "native CPU kernels unavailable" in caplog.text
    finally:
        kernels.library.cache_clear()    # the next test builds (or finds) the real one again


def test_native_kernel_off_gives_the_same_tokens(checkpoints, monkeypatch):
    path = checkpoints["mistral_sliding"]
    prompts = [random_prompt(n, seed=200 + n) for n in (20, 45, 70)]
    on = make_engine(load_model(str(path), "float32")).generate(prompts, GREEDY)
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: None)
    off = make_engine(load_model(str(path), "float32")).generate(prompts, GREEDY)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]


@pytest.mark.parametrize("family", ["llama", "mistral_sliding"])
def test_blocked_prefill_attention_gives_the_same_tokens(checkpoints, family, monkeypatch):
    """The CPU's blocked causal prefill (long chunks) against generate(), exercised on short
    prompts by lowering its thresholds; with a prefix hit and chunking too."""
    from workers import attention
    monkeypatch.setattr(attention, "BLOCKED_MIN_QUERIES", 8)
    monkeypatch.setattr(attention, "BLOCK_QUERIES", 16)
    path = checkpoints[family]
    engine = make_engine(load_model(str(path), "float32"), max_num_batched_tokens=40)
    shared = random_prompt(48, seed=21)
    prompts = [random_prompt(n, seed=300 + n) for n in (30, 75)] + [shared, shared + [5, 6, 7]]
    reqs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert reqs[-1].lifecycle.cached_tokens == 48
    reference = _reference(path)
    for r in reqs:
        assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 20)
    _drained(engine)


def _streamed_bytes(hf, halved: bool) -> int:
    """What a decode step streams, counted on the stock checkpoint: every parameter but the
    norms and an untied input embedding, the linears' weights at 2 bytes a value where the
    engine holds them as bf16."""
    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    untied = 0 if emb.data_ptr() == head.data_ptr() else emb.numel() * 4
    norms = sum(p.numel() * 4 for n, p in hf.named_parameters() if "norm" in n)
    linear = sum(p.numel() for n, p in hf.named_parameters()
                 if n.endswith("proj.weight") or p is head)
    return sum(p.numel() * 4 for p in hf.parameters()) - untied - norms \
        - (2 * linear if halved else 0)


def test_decode_bound_counts_the_weight_bytes_the_linears_read(checkpoints):
    """`raypd bench engine`'s decode bound is taken on the bytes a step streams: a float32 model
    of a bf16 checkpoint reads its linears' weights as bf16 (where the CPU has AVX2 + FMA), so
    they count 2 bytes a value, not 4; a float32 checkpoint's count 4. An engine that loads
    its own copy frees the stock weights its compact model fuses, and the count is the same
    (it counted only what the stock model kept: 6.9 of Llama-3-8B's 16 GB on the H200)."""
    from raypd.bench.engine import _decode_weight_bytes
    for family, halved in (("llama_bf16", kernels.linear_w16_rows(torch.zeros(1, 1)) > 0),
                           ("llama", False)):
        hf, _, _ = loaded = load_model(str(checkpoints[family]), "float32")
        expected = _streamed_bytes(hf, halved)
        assert _decode_weight_bytes(make_engine(loaded)) == expected
        own = make_engine(None, model=str(checkpoints[family]), dtype="float32")
        assert own.runner.stock_bytes_released > 0
        assert _decode_weight_bytes(own) == expected


def test_decode_bound_of_a_random_shape_counts_its_whole_weights():
    """`bench engine --model random:<shape>` takes its bound on every weight a step streams:
    SmolLM2-135M's 134.5M parameters (tied embedding) at 4 bytes, not the part of them the
    stock model keeps once the compact model has fused the rest."""
    from raypd.bench.engine import _decode_weight_bytes
    from raypd.sim.cost_model import MODELS
    engine = make_engine(None, model="random:smollm2-135m", dtype="float32", num_blocks=16)
    assert _decode_weight_bytes(engine) == pytest.approx(MODELS["smollm2-135m"].params * 4,
                                                         rel=1e-3)


@pytest.mark.skipif(kernels.linear_small_m_rows(torch.empty(1, 32, dtype=BF16)) == 0,
                    reason="needs the native kernels and AVX512-BF16")
@pytest.mark.parametrize("window", [None, WINDOW])
def test_bf16_chunks_read_their_prefix_in_place_with_the_same_tokens(tmp_path, monkeypatch,
                                                                    window):
    """bf16 chunked prefill and prefix hits (head_dim 64: the native bf16 prefill attention):
    each later chunk reads its cached prefix from the pool through the block table; the
    tokens equal those of the gathered-copy path it replaced."""
    from workers import attention
    _, tokenizer, _ = load_model("tiny")
    path = save_random_checkpoint(tmp_path / "ckpt", MistralConfig, tokenizer, 7, BF16,
                                  {**SHAPE, "hidden_size": 128, "num_attention_heads": 2,
                                   "num_key_value_heads": 1}, sliding_window=window)
    shared = random_prompt(48, seed=41)
    prompts = [random_prompt(n, seed=500 + n) for n in (30, 75)] + [shared, shared + [5, 6, 7]]
    real = attention.native.prefill_attention_bf16
    in_place = []

    def counted(q, k, v, scale, window=None, block_table=None, context_len=None):
        if block_table is not None:
            in_place.append(context_len)
        return real(q, k, v, scale, window, block_table, context_len)

    def gathered(q, k, v, scale, window=None, block_table=None, context_len=None):
        return None if block_table is not None else real(q, k, v, scale, window)

    runs = []
    for impl in (counted, gathered):
        monkeypatch.setattr(attention.native, "prefill_attention_bf16", impl)
        engine = make_engine(load_model(str(path), "bfloat16"), max_num_batched_tokens=16)
        runs.append([engine.generate([p], GREEDY)[0] for p in prompts])
        assert runs[-1][-1].lifecycle.cached_tokens == 48
        _drained(engine)
    assert in_place and max(in_place) > 16       # later chunks, over a prefix, took it
    assert [r.output_token_ids for r in runs[0]] == [r.output_token_ids for r in runs[1]]
