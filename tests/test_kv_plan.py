"""The KV representation planner: known models' published KV sizes, attention kinds, sliding
windows, and for every model raypd loads, bytes per token equal to what the pool allocates."""

from __future__ import annotations

import json

import pytest

from kvcache.kv_sizing import KNOWN_CONFIGS, LINKS_BPS, kv_layout, read_config, size_kv
from raypd.cli import main

KIB = 1024


@pytest.mark.parametrize("model, kind, kib_per_token", [
    ("llama-3-8b", "GQA", 128), ("llama-3-70b", "GQA", 320), ("qwen2.5-7b", "GQA", 56),
    ("deepseek-v3", "MLA", 61 * (512 + 64) * 2 / KIB)])
def test_known_models_bf16_bytes_per_token(model, kind, kib_per_token):
    p = size_kv(KNOWN_CONFIGS[model], "bfloat16", block_size=16)
    assert p.attention_kind == kind
    assert p.bytes_per_token == kib_per_token * KIB
    assert p.bytes_per_block == 16 * kib_per_token * KIB


def test_deepseek_v3_is_about_68_6_kib_per_token():
    assert round(size_kv(KNOWN_CONFIGS["deepseek-v3"]).bytes_per_token / KIB, 1) == 68.6


def test_mha_and_mqa_are_told_apart():
    base = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
            "hidden_size": 512}
    mha = size_kv({**base, "num_key_value_heads": 8}, "float32")
    mqa = size_kv({**base, "num_key_value_heads": 1}, "float32")
    assert (mha.attention_kind, mqa.attention_kind) == ("MHA", "MQA")
    assert mha.bytes_per_token == 2 * 4 * 8 * 64 * 4 and mqa.bytes_per_token == 2 * 4 * 64 * 4


def test_quantized_dtypes_add_one_scale_per_block_layer_kv_head():
    p = size_kv(KNOWN_CONFIGS["llama-3-8b"], "int8", block_size=16)
    assert p.bytes_per_block == 32 * (16 * 2 * 8 * 128 + 2 * 8 * 4)
    assert size_kv(KNOWN_CONFIGS["llama-3-8b"], "fp8").bytes_per_block == p.bytes_per_block
    mla = size_kv(KNOWN_CONFIGS["deepseek-v3"], "int8", block_size=16)
    assert mla.bytes_per_block == 61 * (16 * 576 + 4)


def test_budget_and_link_figures():
    p = size_kv(KNOWN_CONFIGS["llama-3-8b"], "bfloat16", block_size=16, budget_gb=1.0, link="ib400")
    assert p.tokens_in_budget == 2**30 // (16 * 128 * KIB) * 16 == 8192
    assert p.transfer_s_4k == pytest.approx(4096 * 128 * KIB / LINKS_BPS["ib400"])
    assert set(p.transfer_s_4k_by_link) == set(LINKS_BPS)


def test_sliding_window_layers_hold_only_their_window():
    cfg = {**KNOWN_CONFIGS["mistral-7b-v0.1"], "sliding_window": 1024}
    p = size_kv(cfg, "bfloat16", block_size=16)
    assert p.bytes_per_token == 128 * KIB           # the pool keeps every layer's blocks
    assert p.windowed_bytes_per_token_4k == pytest.approx(128 * KIB * (1024 // 16 + 1) / 256)
    # Qwen2.5 publishes a window but does not use it
    assert kv_layout(KNOWN_CONFIGS["qwen2.5-7b"]).windows == (None,) * 28


def test_bad_config_file_error_names_file_and_line(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"num_hidden_layers": 2,\n "oops"}')
    with pytest.raises(ValueError, match=rf"{f}:2"):
        read_config(f)


def test_cli_writes_the_issue_keys(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["kv-plan", "--model", "qwen2.5-7b", "--link", "nvlink", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    for key in ("attention_kind", "bytes_per_token", "bytes_per_block", "tokens_in_budget",
                "transfer_s_4k"):
        assert key in d
    assert d["bytes_per_token"] == 56 * KIB and "qwen2.5-7b" in capsys.readouterr().out
    assert main(["kv-plan", "--model", "no-such-model"]) == 2


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_planner_equals_the_pool_tiny(tiny_loaded, kv_dtype):
    from conftest import make_engine
    engine = make_engine(tiny_loaded, kv_dtype=kv_dtype, num_blocks=8)
    p = size_kv(tiny_loaded[0].config, kv_dtype, block_size=16)
    assert engine.runner.kv_cache.nbytes == 8 * p.bytes_per_block
    assert engine.kv_bytes_per_token == p.bytes_per_token


@pytest.mark.realmodel
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_planner_equals_the_pool_smollm2(kv_dtype):
    from workers.engine import EngineConfig, LLMEngine
    from workers.model_loader import resolve_model_dir
    engine = LLMEngine(EngineConfig(model="smollm2", kv_dtype=kv_dtype, num_blocks=4))
    p = size_kv(read_config(resolve_model_dir("smollm2")), kv_dtype, block_size=16)
    assert engine.runner.kv_cache.nbytes == 4 * p.bytes_per_block
