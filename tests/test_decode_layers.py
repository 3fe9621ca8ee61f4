"""The compact model's decode layers in one native call (workers/decode_layers.cpp): a pure
decode step of a float32 model whose linears are held as bf16 gives the logits of the one call
per operation path, bit for bit (Llama, Qwen2 with q/k/v biases, Mistral with a sliding window
shorter than the context; one decode group and several; batch 1 and 8), takes that path where it
does not apply (more rows than the linears' kernel takes, a float32 checkpoint's own values), and
refuses a slot outside the pool."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, random_prompt, save_random_checkpoint
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from workers import kernels
from workers.model_loader import load_model
from workers.request import SamplingParams

pytestmark = pytest.mark.skipif(
    kernels._module() is None or kernels.linear_w16_rows(torch.zeros(1, 1)) == 0,
    reason="needs the native kernels and AVX2 + FMA (the bf16-held linears)")

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


def _engine(path, one_call: bool, one_group: bool = True):
    engine = make_engine(load_model(str(path), "float32"), num_blocks=512)
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_sliding"])
@pytest.mark.parametrize("batch", [1, 8])
def test_one_call_decode_gives_the_per_op_logits_bit_for_bit(checkpoints, family, batch):
    prompts = [random_prompt(n, seed=n) for n in (70, 5, 130, 33, 16, 17, 90, 250)[:batch]]
    got, calls = _run(_engine(checkpoints[family], one_call=True), prompts)
    want, none = _run(_engine(checkpoints[family], one_call=False), prompts)
    assert calls > 0 and none == 0
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_several_decode_groups_give_the_same_logits(checkpoints):
    """Groups by context length (the torch path's grouping): each group's rows attend apart."""
    prompts = [random_prompt(n, seed=n) for n in (3, 20, 70, 300)]
    engine = _engine(checkpoints["llama"], one_call=True, one_group=False)
    got, calls = _run(engine, prompts)
    want, _ = _run(_engine(checkpoints["llama"], one_call=False, one_group=False), prompts)
    assert calls > 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_more_rows_than_the_linears_take_run_one_call_per_op(checkpoints):
    engine = _engine(checkpoints["llama"], one_call=True)
    rows = engine.runner.compact.one_call_rows
    prompts = [random_prompt(10 + i, seed=i) for i in range(rows + 1)]
    got, calls = _run(engine, prompts, max_tokens=4)
    want, _ = _run(_engine(checkpoints["llama"], one_call=False), prompts, max_tokens=4)
    assert calls == 0      # every decode step had rows + 1 decodes
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_float32_checkpoints_own_values_never_take_it(checkpoints):
    engine = make_engine(load_model(str(checkpoints["llama_f32"]), "float32"))
    assert engine.runner.compact.one_call_rows == 0
    assert not engine.runner.compact.one_call_decode


def test_more_query_heads_per_kv_head_than_the_kernel_holds_never_take_it(tmp_path):
    """17 query heads on one KV head: past the decode kernel's per-KV-head registers."""
    _, tokenizer, _ = load_model("tiny")
    path = _checkpoint(tmp_path / "wide", LlamaConfig, tokenizer, 5,
                       **{**SHAPE, "hidden_size": 136, "num_attention_heads": 17,
                          "num_key_value_heads": 1})
    engine = make_engine(load_model(str(path), "float32"))
    assert kernels.MAX_GROUP < 17 and engine.runner.compact.one_call_rows == 0


def test_a_slot_outside_the_pool_is_refused(checkpoints):
    engine = _engine(checkpoints["llama"], one_call=True)
    compact = engine.runner.compact
    kv = engine.runner.kv_cache
    before = kv.clone()
    first = compact.layers[0]
    h = torch.randn(1, SHAPE["hidden_size"])
    cos = torch.ones(1, first.head_dim)
    dims = (1, SHAPE["hidden_size"], first.num_heads, first.num_kv_heads, first.head_dim,
            SHAPE["intermediate_size"], kv.shape[3], kv.shape[2])
    groups = [(0, torch.tensor([[0]]), torch.tensor([1]))]
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.decode_layers_f32(compact.decode_words(kv), groups, h, dims, first.eps,
                                  first.scale, cos, cos, torch.tensor([kv.shape[2] * kv.shape[3]]))
    assert torch.equal(kv, before)
