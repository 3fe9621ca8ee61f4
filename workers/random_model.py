"""Random-weight Llama models of a named real shape (`random:llama3-8b`), for benchmarks that need
a model's size and layout but not its answers: built directly on the engine's device (no
checkpoint, no download), over the tiny model's byte-level tokenizer (benchmarks send token
ids). Same name, seed and device: the same weights, so a prefill and a decode worker agree.
"""

from __future__ import annotations

import torch

PREFIX = "random:"
SHAPES = {
    # Meta-Llama-3-8B's config.json
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
    # HuggingFaceTB/SmolLM2-135M's config.json: 30 thin layers, GQA 9:3, input and output
    # embeddings tied (the real SmolLM2 cannot travel to a machine without network; its shape can)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # issue 61's tensor-parallel shape: ~0.4B parameters, 16 query heads over 8 KV heads
    "llama-0.4b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5),
    # small shapes for CPU tests of tensor parallelism: 8 KV heads (split up to TP 8)
    "llama-test-kv8": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
                           max_position_embeddings=4096, rope_theta=500000.0,
                           rms_norm_eps=1e-5),
    # the same layout, small enough for a CPU test of the path (2 KV heads: replicated at TP 4)
    "llama-test": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                       max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5),
}


def is_random(model: str) -> bool:
    return model.startswith(PREFIX)


def build_random(model: str, dtype: str, device: torch.device, seed: int = 0):
    """(model, tokenizer, ModelInfo) of `random:<shape>` in `dtype` ("auto": bfloat16 on cuda,
    float32 elsewhere), initialised on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.device import DTYPES
    from workers.model_loader import ModelLoadError, _model_info, _tiny_tokenizer
    shape = model.removeprefix(PREFIX)
    if shape not in SHAPES:
        raise ModelLoadError(f"unknown random model shape {shape!r}; known: "
                             f"{', '.join(sorted(SHAPES))}")
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    fields = {"tie_word_embeddings": False, **SHAPES[shape]}
    config = LlamaConfig(**fields, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), device:
            torch.manual_seed(seed)
            hf_model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    hf_model.eval().requires_grad_(False)
    tokenizer = _tiny_tokenizer()
    revision = f"{shape}-seed{seed}-{dtype}"
    return hf_model, tokenizer, _model_info(model, revision, hf_model, tokenizer)
