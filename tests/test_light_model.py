"""An engine that loads its own model (every worker actor) reads a Llama checkpoint without
transformers' model and config code (workers/light_model.py): the same ModelInfo (revision,
tokenizer fingerprint, eos ids: the cache key) and the same weights as the stock load, greedy
tokens equal to `generate()`, and a worker process that imports neither transformers' model
code nor torch._dynamo. What it cannot read falls back to the stock load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, hf_greedy, random_prompt, save_random_checkpoint
from transformers import LlamaConfig, Qwen2Config

from workers.light_model import LightLlama, light_unsupported
from workers.model_loader import load_for_engine, load_model
from workers.request import SamplingParams

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    _, tokenizer, _ = load_model("tiny")
    root = tmp_path_factory.mktemp("light")
    return {
        "llama": save_random_checkpoint(root / "llama", LlamaConfig, tokenizer, 1,
                                        torch.float32, SHAPE, tie_word_embeddings=False),
        "llama_tied_bf16": save_random_checkpoint(root / "tied", LlamaConfig, tokenizer, 2,
                                                  torch.bfloat16, SHAPE,
                                                  tie_word_embeddings=True),
        "qwen2": save_random_checkpoint(root / "qwen2", Qwen2Config, tokenizer, 3,
                                        torch.float32, SHAPE),
        "llama_rope_scaled": save_random_checkpoint(
            root / "scaled", LlamaConfig, tokenizer, 4, torch.float32, SHAPE,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    }


def _weights(model) -> dict[str, torch.Tensor]:
    """name -> tensor of the weights the compact model reads, from either kind of model."""
    inner = model.model
    out = {"embed": inner.embed_tokens.weight, "norm": inner.norm.weight,
           "lm_head": model.lm_head.weight}
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                          ("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj)):
            out[f"{i}.{name}"] = lin.weight
        out[f"{i}.ln1"] = layer.input_layernorm.weight
        out[f"{i}.ln2"] = layer.post_attention_layernorm.weight
    return out


def _same_model(light, stock) -> None:
    lw, sw = _weights(light), _weights(stock)
    assert lw.keys() == sw.keys()
    for name in lw:
        assert torch.equal(lw[name], sw[name]), name
    assert light.dtype == stock.dtype


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_tiny_light_load_is_the_stock_tiny_model(dtype):
    light, _, info = load_for_engine("tiny", dtype)
    stock, _, stock_info = load_model("tiny", dtype)
    assert isinstance(light, LightLlama)
    assert info == stock_info
    _same_model(light, stock)
    assert load_for_engine("tiny", seed=1)[2].revision != info.revision   # the seed is in it


@pytest.mark.parametrize("family", ["llama", "llama_tied_bf16"])
def test_a_llama_folder_loads_light_with_the_stock_info_and_weights(folders, family):
    light, tokenizer, info = load_for_engine(str(folders[family]), "float32")
    stock, stock_tokenizer, stock_info = load_model(str(folders[family]), "float32")
    assert isinstance(light, LightLlama)
    assert info == stock_info
    _same_model(light, stock)
    assert (light.lm_head.weight is light.model.embed_tokens.weight) == \
        (family == "llama_tied_bf16")
    text = "Hello <|im_start|>wörld"
    assert tokenizer.encode(text) == stock_tokenizer.encode(text)


def test_an_engine_on_a_light_load_gives_generates_tokens(folders):
    from workers.engine import EngineConfig, LLMEngine
    path = str(folders["llama"])
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_blocks=128,
                                    block_size=16, device="cpu"))
    assert isinstance(engine.model, LightLlama)
    reference = load_model(path, "float32")[0]
    prompts = [random_prompt(n, seed=10 + n) for n in (3, 17, 40)]
    for r in engine.generate(prompts, GREEDY):
        assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, 16)


@pytest.mark.parametrize("family", ["qwen2", "llama_rope_scaled"])
def test_what_the_light_load_cannot_read_gets_the_stock_load(folders, family):
    model, _, info = load_for_engine(str(folders[family]), "float32")
    assert not isinstance(model, LightLlama)
    assert info == load_model(str(folders[family]), "float32")[2]


def test_the_stock_model_and_lora_need_the_stock_load():
    from workers.engine import EngineConfig, LLMEngine
    assert not isinstance(load_for_engine("tiny", stock_needed=True)[0], LightLlama)
    engine = LLMEngine(EngineConfig(model="tiny", model_impl="stock", num_blocks=16,
                                    device="cpu"))
    assert engine.get_stats()["model_impl"] == "stock"


def test_light_unsupported_names_the_reason():
    llama = {"model_type": "llama"}
    assert light_unsupported(llama) is None
    assert light_unsupported({"model_type": "qwen2"}) == "model_type 'qwen2'"
    assert light_unsupported({**llama, "rope_scaling": {"rope_type": "llama3"}}) \
        == "a rope scaling"
    assert light_unsupported({**llama, "mlp_bias": True}) == "mlp_bias"
    assert light_unsupported(llama, {"tokenizer_class": "LlamaTokenizer"}) \
        == "tokenizer_class 'LlamaTokenizer'"


def test_a_worker_process_imports_no_transformers_model_code():
    """What a worker actor imports to serve tiny: its host modules and an engine that loads
    the model itself."""
    code = (
        "import sys, json\n"
        "import workers.decode_host, workers.prefill_host\n"
        "from workers.engine import EngineConfig, LLMEngine\n"
        "e = LLMEngine(EngineConfig(model='tiny', num_blocks=16, device='cpu'))\n"
        "e.generate([[5, 6, 7]], __import__('workers.request').request.SamplingParams("
        "max_tokens=2))\n"
        "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    mods = set(json.loads(out.stdout.strip().splitlines()[-1]))
    heavy = {m for m in mods if m.startswith(("transformers.models", "transformers.modeling_utils",
                                              "transformers.configuration_utils",
                                              "torch._dynamo", "sympy"))}
    assert not heavy, sorted(heavy)[:10]
    assert "workers.light_model" in mods


@pytest.mark.realmodel
def test_smollm2_loads_light_with_the_stock_cache_key():
    light, tokenizer, info = load_for_engine("smollm2", "float32")
    stock, stock_tokenizer, stock_info = load_model("smollm2", "float32")
    assert isinstance(light, LightLlama)
    assert info == stock_info          # revision, tokenizer fingerprint, eos ids: the cache key
    _same_model(light, stock)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        stock_tokenizer.apply_chat_template(chat, add_generation_prompt=True)


def test_a_corrupt_weights_file_is_a_load_error_naming_the_folder(folders, tmp_path):
    import shutil

    from workers.model_loader import ModelLoadError
    bad = tmp_path / "bad"
    shutil.copytree(folders["llama"], bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=str(bad)):
        load_for_engine(str(bad), "float32")
