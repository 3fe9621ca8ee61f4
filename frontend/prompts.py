"""A prompt (text, chat messages or token ids) to token ids, and the checks token ids pass
before any engine sees them (empty, vocabulary, the model's context, max_tokens)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcache.manager import cdiv
from protocol.errors import RequestError, UnknownLoRAError
from protocol.sampling import SamplingParams


def is_chat(prompt: Any, chat: bool = False) -> bool:
    """Chat messages (a list of dicts), or text asked to go through the chat template."""
    if isinstance(prompt, list | tuple) and prompt and isinstance(prompt[0], dict):
        return True
    return chat and isinstance(prompt, str)


def tokenize_prompt(tokenizer: Any, prompt: str | list | tuple, chat: bool = False) -> list[int]:
    """Token ids of a prompt: chat messages (or `chat` text) through the chat template, text as
    is (no special tokens added), token ids unchanged (already templated, if at all)."""
    if is_chat(prompt, chat):
        messages = list(prompt) if not isinstance(prompt, str) else \
            [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    return list(prompt)


def check_prompt(prompt: Any, token_ids: list[int], sampling: SamplingParams, vocab_size: int,
                 max_model_len: int, chat: bool = False) -> None:
    """RequestError (400) unless the prompt's token ids can run: not empty, ids in the
    vocabulary, room for output in the model's context (and for all of max_tokens when it was
    asked for: `strict_max_tokens`, as vLLM and OpenAI answer)."""
    if (isinstance(prompt, str) and not prompt.strip() and not chat) or not token_ids:
        raise RequestError("prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
           for t in token_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    n, where = len(token_ids), "messages" if chat else "prompt"
    if n >= max_model_len:
        raise RequestError(f"prompt has {n} tokens; the model's context is {max_model_len} "
                           f"tokens (prompt must leave room for output)", param=where)
    if sampling.strict_max_tokens and n + sampling.max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + sampling.max_tokens} tokens ({n} in the {where}, "
            f"{sampling.max_tokens} in the completion). Please reduce the length of the prompt "
            "or of the completion (max_tokens).", param="max_tokens")


def check_fits(num_tokens: int, block_size: int, num_blocks: int, what: str = "prompt") -> None:
    """RequestError unless `num_tokens` fit a whole pool of `num_blocks` blocks."""
    need = cdiv(num_tokens, block_size)
    if need > num_blocks:
        raise RequestError(f"{what} needs {need} KV blocks; the whole pool has {num_blocks}")


def unknown_lora(name: str, served: Iterable[str]) -> UnknownLoRAError:
    """The error for an adapter name that is not served (404)."""
    known = ", ".join(sorted(served)) or "none"
    return UnknownLoRAError(f"the LoRA adapter {name!r} does not exist; this server serves: "
                            f"{known}")
