"""The compact model's decode layers in one native call (workers/kernels/csrc/decode_layers.cpp): a pure
decode step gives the logits of the one call per operation path, bit for bit, for a float32
model whose linears are held as bf16 and for a bf16 model on VNNI-packed linears (Llama, Qwen2
with q/k/v biases, Mistral with a sliding window shorter than the context; one decode group and
several; batch 1 and 8), takes that path where it does not apply (more rows than the linears'
kernel takes, a float32 checkpoint's own values), and refuses a slot outside the pool."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, random_prompt, save_random_checkpoint
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from workers import kernels
from workers.model_loader import load_model
from workers.request import SamplingParams

# the dtypes whose linears the native kernels run here: float32 on bf16-held weights (AVX2 +
# FMA), bf16 on VNNI-packed ones (AVX512-BF16 or AMX)
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(not ok, reason=why)) for d, ok, why in (
    ("float32", kernels.library() is not None
     and kernels.linear_w16_rows(torch.zeros(1, 1)) > 0,
     "needs the native kernels and AVX2 + FMA (the bf16-held linears)"),
    ("bfloat16", kernels.library() is not None
     and (kernels.linear_small_m_rows(torch.zeros(1, 32, dtype=torch.bfloat16)) > 0
          or kernels.linear_amx_rows(torch.zeros(1, 32, dtype=torch.bfloat16)) > 0),
     "needs the native kernels and AVX512-BF16"))]

SHAPE = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
WINDOW = 40


def _checkpoint(path, config_cls, tokenizer, seed: int, dtype=torch.bfloat16, **extra):
    return save_random_checkpoint(path, config_cls, tokenizer, seed, dtype, SHAPE, **extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    _, tokenizer, _ = load_model("tiny")
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": _checkpoint(root / "llama", LlamaConfig, tokenizer, 1),
        "qwen2": _checkpoint(root / "qwen2", Qwen2Config, tokenizer, 2),
        "mistral_sliding": _checkpoint(root / "mistral", MistralConfig, tokenizer, 3,
                                       sliding_window=WINDOW),
        "llama_f32": _checkpoint(root / "llama_f32", LlamaConfig, tokenizer, 4, torch.float32),
    }


def _engine(path, one_call: bool, one_group: bool = True, dtype: str = "float32",
            **config):
    engine = make_engine(load_model(str(path), dtype), **{"num_blocks": 512, **config})
    engine.runner.compact.one_call_decode = one_call and engine.runner.compact.one_call_rows > 0
    engine.runner.one_decode_group = one_group
    return engine


def _run(engine, prompts, max_tokens: int = 12) -> tuple[list[torch.Tensor], int]:
    """Every step's logits, and how many steps ran as one native call."""
    logits, calls = [], [0]
    execute, one_call = engine.runner.execute, engine.runner.compact._decode_one_call

    def recorded(chunks):
        out, rows = execute(chunks)
        logits.append(out.clone())
        return out, rows

    def counted(*a):
        calls[0] += 1
        return one_call(*a)
    engine.runner.execute = recorded
    engine.runner.compact._decode_one_call = counted
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.check_invariants()
    return logits, calls[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_sliding"])
@pytest.mark.parametrize("batch", [1, 8])
def test_one_call_decode_gives_the_per_op_logits_bit_for_bit(checkpoints, family, batch, dtype):
    prompts = [random_prompt(n, seed=n) for n in (70, 5, 130, 33, 16, 17, 90, 250)[:batch]]
    got, calls = _run(_engine(checkpoints[family], one_call=True, dtype=dtype), prompts)
    want, none = _run(_engine(checkpoints[family], one_call=False, dtype=dtype), prompts)
    assert calls > 0 and none == 0
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_decode_groups_give_the_same_logits(checkpoints, dtype):
    """Groups by context length (the torch path's grouping): each group's rows attend apart."""
    prompts = [random_prompt(n, seed=n) for n in (3, 20, 70, 300)]
    engine = _engine(checkpoints["llama"], one_call=True, one_group=False, dtype=dtype)
    got, calls = _run(engine, prompts)
    want, _ = _run(_engine(checkpoints["llama"], one_call=False, one_group=False, dtype=dtype),
                   prompts)
    assert calls > 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_rows_than_the_linears_take_run_one_call_per_op(checkpoints, dtype):
    rows = _engine(checkpoints["llama"], one_call=True, dtype=dtype).runner.compact.one_call_rows
    assert rows > 0
    # every prompt prefilled in the first step, so all decode together to the end
    config = dict(max_num_seqs=rows + 1, max_num_batched_tokens=8192)
    engine = _engine(checkpoints["llama"], one_call=True, dtype=dtype, **config)
    prompts = [random_prompt(10 + i, seed=i) for i in range(rows + 1)]
    got, calls = _run(engine, prompts, max_tokens=4)
    want, _ = _run(_engine(checkpoints["llama"], one_call=False, dtype=dtype, **config), prompts,
                   max_tokens=4)
    assert calls == 0      # every decode step had rows + 1 decodes
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES[:1])   # (where a bf16 checkpoint's float32 model would)
def test_a_float32_checkpoints_own_values_never_take_it(checkpoints, dtype):
    engine = make_engine(load_model(str(checkpoints["llama_f32"]), dtype))
    assert engine.runner.compact.one_call_rows == 0
    assert not engine.runner.compact.one_call_decode


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_query_heads_per_kv_head_than_the_kernel_holds_never_take_it(tmp_path, dtype):
    """17 query heads on one KV head: past the decode kernel's per-KV-head registers."""
    _, tokenizer, _ = load_model("tiny")
    path = _checkpoint(tmp_path / "wide", LlamaConfig, tokenizer, 5,
                       **{**SHAPE, "hidden_size": 136, "num_attention_heads": 17,
                          "num_key_value_heads": 1})
    engine = make_engine(load_model(str(path), dtype))
    assert kernels.MAX_GROUP < 17 and engine.runner.compact.one_call_rows == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slot_outside_the_pool_is_refused(checkpoints, dtype):
    engine = _engine(checkpoints["llama"], one_call=True, dtype=dtype)
    compact = engine.runner.compact
    kv = engine.runner.kv_cache
    before = kv.clone()
    first = compact.layers[0]
    h = torch.randn(1, SHAPE["hidden_size"]).to(kv.dtype)
    cos = torch.ones(1, first.head_dim, dtype=kv.dtype)
    dims = (1, SHAPE["hidden_size"], first.num_heads, first.num_kv_heads, first.head_dim,
            SHAPE["intermediate_size"], kv.shape[3], kv.shape[2])
    groups = [(0, torch.tensor([[0]]), torch.tensor([1]))]
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.decode_layers(compact.decode_words(kv), groups, h, dims, first.eps, first.scale,
                              cos, cos, torch.tensor([kv.shape[2] * kv.shape[3]]),
                              compact.one_call_amx)
    assert torch.equal(kv, before)
