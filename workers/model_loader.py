"""Loads a worker's model, tokenizer and ModelInfo: SmolLM2 (converted once from its GGUF), a
seeded tiny Llama, or a local checkpoint.

`load_model` gives the stock transformers model (the reference tests compare with, the stock
fallback, LoRA on the stock model); `load_for_engine` gives what an engine that loads its own
model needs: where workers/light_model.py applies, the weights without transformers' model and
config code (~3-4 s less a worker process to import), else `load_model`'s. transformers is
imported only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.device import DTYPES, auto_dtype
from workers.light_model import (
    LightConfig,
    LightLlama,
    checkpoint_files,
    light_unsupported,
    load_light_dir,
    read_json,
    tiny_state_dict,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
BUILTIN_MODELS = ("smollm2", "tiny")

META_FILE = "raypd_meta.json"  # written by workers/smollm2_convert.py beside a converted model

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# the tiny model: a 2-layer GQA Llama (std 0.1, so greedy output varies) over a byte-level
# tokenizer (ids 0-2 the ChatML specials, id 3+b byte b); its weights: light_model.tiny_state_dict
TINY_CONFIG: dict[str, Any] = dict(
    model_type="llama", vocab_size=len(TINY_SPECIAL_TOKENS) + 256, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048, initializer_range=0.1, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32")


class ModelLoadError(ValueError):
    """A model could not be resolved or loaded; the message names what is wrong."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of raypd needs to know about a loaded model; revision and
    tokenizer_fingerprint are content hashes, equal across loads of the same files."""

    model_id: str
    revision: str
    tokenizer_fingerprint: str
    dtype: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_bytes_per_token: int


def cache_dir() -> Path:
    """raypd's user cache: $RAYPD_CACHE_DIR, else $XDG_CACHE_HOME/raypd, else ~/.cache/raypd."""
    if os.environ.get("RAYPD_CACHE_DIR"):
        return Path(os.environ["RAYPD_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "raypd"


def load_model(
    model: str = "smollm2", dtype: str = "auto", *, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo]:  # the stock model
    """Load `model` ("smollm2", "tiny" or a checkpoint path) in eval mode without grads.

    `dtype` is "auto" (see workers/device.py: bfloat16 on hardware with native bf16, float32 on
    other CPUs; float32 for tiny), "float32" or "bfloat16";
    `seed` only affects "tiny".
    """
    _check_dtype(dtype)
    if model == "tiny":
        hf_model, tokenizer = _build_tiny(seed)
        if dtype == "bfloat16":
            hf_model = hf_model.to(torch.bfloat16)
        revision, model_id = _tiny_revision(seed), "tiny"
    else:
        path = resolve_model_dir(model)
        hf_model, tokenizer = _load_dir(path, dtype)
        revision = _checkpoint_revision(path)
        model_id = "smollm2" if model == "smollm2" else str(path)
    hf_model.eval().requires_grad_(False)
    return hf_model, tokenizer, _model_info(model_id, revision, hf_model, tokenizer)


def _check_dtype(dtype: str) -> None:
    if dtype != "auto" and dtype not in DTYPES:
        raise ModelLoadError(
            f"dtype {dtype!r} is not supported; choose 'auto', 'float32' or 'bfloat16'"
        )


def _tiny_revision(seed: int) -> str:
    blob = json.dumps(TINY_CONFIG, sort_keys=True).encode()
    return f"tiny-seed{seed}-{_sha256(blob)[:16]}"


def load_for_engine(model: str, dtype: str = "auto", *, seed: int = 0,
                    stock_needed: bool = False) -> tuple[Any, Any, ModelInfo]:
    """What an engine that loads its own model runs: (LightLlama, tokenizer, ModelInfo) where
    workers/light_model.py applies and the caller needs no stock model (`stock_needed`:
    model_impl stock, LoRA adapters), else `load_model`'s. Both give the same ModelInfo and
    weights for the same model, dtype and seed."""
    _check_dtype(dtype)
    if not stock_needed:
        if model == "tiny":
            weights = tiny_state_dict(TINY_CONFIG, seed)
            light = LightLlama(LightConfig.from_dict(TINY_CONFIG),
                               {k: v.to(DTYPES[dtype]) if dtype == "bfloat16" else v
                                for k, v in weights.items()})
            tokenizer = _tiny_tokenizer()
            return light, tokenizer, _model_info("tiny", _tiny_revision(seed), light, tokenizer)
        path = resolve_model_dir(model)
        config = read_json(path / "config.json")
        if light_unsupported(config, read_json(path / "tokenizer_config.json")) is None \
                and checkpoint_files(path) and (path / "tokenizer.json").is_file():
            if dtype == "auto":
                saved = config.get("dtype") or config.get("torch_dtype") or "float32"
                dtype = auto_dtype(str(saved).removeprefix("torch."), torch.device("cpu"))
            try:
                from transformers import PreTrainedTokenizerFast
                light = load_light_dir(path, config, DTYPES[dtype])
                tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
            except Exception as e:  # noqa: BLE001 - OSError, a bad safetensors file, a missing
                # tensor (KeyError): one clear error naming the folder
                raise ModelLoadError(f"cannot load the checkpoint in {path}: "
                                     f"{type(e).__name__}: {e}") from e
            model_id = "smollm2" if model == "smollm2" else str(path)
            return light, tokenizer, _model_info(model_id, _checkpoint_revision(path), light,
                                                 tokenizer)
    return load_model(model, dtype, seed=seed)


def base_config(model: str):
    """The transformers config of `model` without loading its weights (tiny: built)."""
    if model == "tiny":
        return _build_tiny(0)[0].config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(resolve_model_dir(model))


def resolve_model_dir(model: str) -> Path:
    """The HF-format folder for `model`: the converted SmolLM2 cache (made on first use) or a
    validated local checkpoint path."""
    if model == "smollm2":
        from workers.smollm2_convert import ensure_smollm2  # gguf and GgufConfig: only here

        return ensure_smollm2(cache_dir())
    if model == "tiny":
        raise ModelLoadError("model 'tiny' is built in memory and has no directory")
    path = Path(model).expanduser()
    if not path.exists():
        if os.sep in model or model.startswith((".", "~")):
            raise ModelLoadError(f"model path {model} does not exist")
        raise ModelLoadError(
            f"unknown model {model!r}: choose one of {', '.join(BUILTIN_MODELS)} or a local checkpoint path"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model path {path} has no config.json")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture model_type={model_type!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return path.resolve()


def _load_dir(path: Path, dtype: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    try:
        if dtype == "auto":
            saved = AutoConfig.from_pretrained(path).dtype
            saved = str(saved).removeprefix("torch.") if saved is not None else "float32"
            dtype = auto_dtype(saved, torch.device("cpu"))
        hf_model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the checkpoint in {path}: {e}") from e
    return hf_model, tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny model's byte-level tokenizer: ids 0-2 are the ChatML specials, id 3+b is byte
    b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({byte_chars[b]: len(TINY_SPECIAL_TOKENS) + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=list(TINY_SPECIAL_TOKENS),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    assert len(tokenizer) == TINY_CONFIG["vocab_size"]
    return tokenizer


def _build_tiny(seed: int):
    """The stock tiny model (TINY_CONFIG, weights `tiny_state_dict(TINY_CONFIG, seed)`) and its
    tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        hf_model = LlamaForCausalLM(config)
    hf_model.load_state_dict(tiny_state_dict(TINY_CONFIG, seed))
    return hf_model, tokenizer


def _checkpoint_revision(path: Path) -> str:
    """sha256 of config.json plus the weights' content: for our converted SmolLM2 the GGUF's
    recorded sha256, otherwise every weight file's bytes (so it is stable across copies)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    meta = path / META_FILE
    if meta.is_file():
        h.update(json.loads(meta.read_text())["gguf_sha256"].encode())
    else:
        for f in sorted([*path.glob("*.safetensors"), *path.glob("*.bin")]):
            h.update(f"{f.name}:{file_sha256(f)}".encode())
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over vocab, merges, pre/post-processing and added tokens (the fast tokenizer's
    JSON without its padding/truncation settings), special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None)
        spec.pop("truncation", None)
    else:
        spec = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = {
        "tokenizer": spec,
        "special_tokens": tokenizer.special_tokens_map,
        "chat_template": tokenizer.chat_template,
    }
    return _sha256(json.dumps(blob, sort_keys=True, ensure_ascii=False).encode())


def _model_info(
    model_id: str, revision: str, hf_model: PreTrainedModel | LightLlama,
    tokenizer: PreTrainedTokenizerBase
) -> ModelInfo:
    config = hf_model.config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    dtype = str(hf_model.dtype).removeprefix("torch.")
    eos: list[int] = []
    for source in (
        hf_model.generation_config.eos_token_id,
        config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if token_id is not None and token_id not in eos:
                eos.append(int(token_id))
    return ModelInfo(
        model_id=model_id,
        revision=revision,
        tokenizer_fingerprint=_tokenizer_fingerprint(tokenizer),
        dtype=dtype,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        eos_token_ids=tuple(eos),
        kv_bytes_per_token=2
        * config.num_hidden_layers
        * num_kv_heads
        * head_dim
        * torch.finfo(hf_model.dtype).bits
        // 8,
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
