"""What one client request may ask, checked once at the edge: shared by the HTTP and gRPC
ingresses and by `raypd submit` (before it sends a trace). Torch-free; every refusal is a
RequestError whose message starts with the field (`max_tokens: ...`).

Defaults (both ingresses): temperature 1.0, max_tokens 16 for a completion and 256 for chat,
both capped by the context and `max_tokens`; 0 < temperature < `min_temperature` is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import RequestError
from protocol.sampling import INT64_MAX, INT64_MIN, SamplingParams

DEFAULT_TEMPERATURE = 1.0
COMPLETION_MAX_TOKENS = 16     # OpenAI's and vLLM's default for /v1/completions
CHAT_MAX_TOKENS = 256          # ours for chat (OpenAI: up to the context)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")   # developer = system
INT32_MAX = (1 << 31) - 1


def _limit(default: Any, **rules: Any) -> Any:
    return field(default=default, metadata=rules)


@dataclass(frozen=True)
class RequestLimits:
    """Config `server.request_limits`."""

    max_n: int = _limit(16, min=1)                     # choices per prompt
    max_prompts: int = _limit(64, min=1)               # prompts in one batched completion
    max_prompt_chars: int = _limit(500_000, min=1)     # a text prompt / all chat content
    max_messages: int = _limit(256, min=1)
    max_stop: int = _limit(8, min=0)                   # stop strings
    max_stop_chars: int = _limit(128, min=1)           # each
    max_stop_token_ids: int = _limit(64, min=0)
    max_tokens: int = _limit(32768, min=1)             # cap beside the context
    min_temperature: float = _limit(1e-3, min=0)       # 0 < temperature below this: greedy
    max_temperature: float = _limit(100.0, gt=0)
    max_label_chars: int = _limit(128, min=1)          # tenant, lora, user, client request id


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts (None: unknown, not checked)."""

    vocab_size: int | None = None
    max_model_len: int | None = None


def _bad(name: str, why: str) -> RequestError:
    return RequestError(f"{name}: {why}", param=name)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def make_sampling(*, chat: bool, limits: RequestLimits, model: ModelLimits,
                  max_tokens: Any = None, temperature: Any = None, top_p: Any = None,
                  top_k: Any = None, seed: Any = None, stop: Any = None,
                  stop_token_ids: Any = None, ignore_eos: Any = None,
                  min_tokens: Any = None, include_stop_str_in_output: Any = None,
                  skip_special_tokens: Any = None) -> SamplingParams:
    """SamplingParams from what a client sent (None: the default), every field range-checked
    against the limits and the model."""
    cap = limits.max_tokens if model.max_model_len is None \
        else min(limits.max_tokens, model.max_model_len)
    strict = max_tokens is not None      # asked for: refused, not capped, when it cannot fit
    if max_tokens is None:
        max_tokens = min(cap, CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    elif max_tokens > cap:
        why = f"the model's context is {model.max_model_len} tokens" \
            if cap != limits.max_tokens else "server.request_limits.max_tokens"
        raise _bad("max_tokens", f"must be at most {cap} ({why}), got {max_tokens}")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    if not _is_number(temperature) or not math.isfinite(temperature) or \
            not 0 <= temperature <= limits.max_temperature:
        raise _bad("temperature", f"must be a number in [0, {limits.max_temperature:g}], "
                   f"got {temperature!r}")
    if temperature < limits.min_temperature:
        temperature = 0.0                      # a tiny temperature is greedy
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise _bad("top_p", f"must be a number in (0, 1], got {top_p!r}")
    if top_k is None or top_k == -1:
        top_k = 0
    if not _is_int(top_k) or not 0 <= top_k <= INT32_MAX:
        raise _bad("top_k", f"must be -1, 0 (off) or a positive integer, got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not INT64_MIN <= seed <= INT64_MAX):
        raise _bad("seed", f"must be a 64-bit signed integer, got {_short(seed)}")
    stops = _stops(stop, limits)
    ids = _stop_token_ids(stop_token_ids, limits, model)
    for name, flag in (("ignore_eos", ignore_eos),
                       ("include_stop_str_in_output", include_stop_str_in_output),
                       ("skip_special_tokens", skip_special_tokens)):
        if flag is not None and not isinstance(flag, bool):
            raise _bad(name, f"must be true or false, got {_short(flag)}")
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise _bad("min_tokens", f"must be an integer in [0, max_tokens = {max_tokens}], "
                   f"got {_short(min_tokens)}")
    sp = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                        top_p=float(top_p), top_k=top_k, seed=seed, stop=stops,
                        stop_token_ids=ids, ignore_eos=bool(ignore_eos), min_tokens=min_tokens,
                        strict_max_tokens=strict,
                        include_stop_str_in_output=bool(include_stop_str_in_output),
                        skip_special_tokens=skip_special_tokens is not False)
    return sp


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _stops(stop: Any, limits: RequestLimits) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or a list of strings")
    if len(stops) > limits.max_stop:
        raise _bad("stop", f"at most {limits.max_stop} stop strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > limits.max_stop_chars:
            raise _bad("stop", f"each stop string must have 1 to {limits.max_stop_chars} "
                       f"characters, got {len(s)}")
    return tuple(stops)


def _stop_token_ids(ids: Any, limits: RequestLimits, model: ModelLimits) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple) or not all(_is_int(t) for t in ids):
        raise _bad("stop_token_ids", "must be a list of token ids")
    if len(ids) > limits.max_stop_token_ids:
        raise _bad("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(ids)}")
    _check_ids("stop_token_ids", ids, model)
    return tuple(ids)


def _check_ids(name: str, ids: Any, model: ModelLimits) -> None:
    hi = model.vocab_size if model.vocab_size is not None else INT32_MAX + 1
    for t in ids:
        if not _is_int(t) or not 0 <= t < hi:
            raise _bad(name, f"token ids must be integers in [0, {hi}), got {_short(t)}")


def check_prompt(prompt: Any, limits: RequestLimits, model: ModelLimits,
                 name: str = "prompt") -> None:
    """A text prompt or a list of token ids (each inside the vocabulary, fewer than the
    context)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _bad(name, "is empty")
        if len(prompt) > limits.max_prompt_chars:
            raise _bad(name, f"has {len(prompt)} characters; at most {limits.max_prompt_chars}")
        return
    if not isinstance(prompt, list | tuple) or not prompt:
        raise _bad(name, "must be a non-empty string or list of token ids")
    _check_ids(name, prompt, model)
    if model.max_model_len is not None and len(prompt) >= model.max_model_len:
        raise _bad(name, f"has {len(prompt)} tokens; the model's context is "
                   f"{model.max_model_len} tokens (the prompt must leave room for output)")


def check_prompts(prompts: list, limits: RequestLimits, model: ModelLimits) -> None:
    if not prompts:
        raise _bad("prompt", "is empty")
    if len(prompts) > limits.max_prompts:
        raise _bad("prompt", f"at most {limits.max_prompts} prompts in one request, "
                   f"got {len(prompts)}")
    for i, p in enumerate(prompts):
        check_prompt(p, limits, model, "prompt" if len(prompts) == 1 else f"prompt.{i}")


def check_messages(messages: list[dict], limits: RequestLimits) -> list[dict]:
    """Chat messages [{role, content: str}] -> the same with `developer` as `system`."""
    if not messages:
        raise _bad("messages", "must hold at least one message")
    if len(messages) > limits.max_messages:
        raise _bad("messages", f"at most {limits.max_messages} messages, got {len(messages)}")
    out, chars = [], 0
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise _bad(f"messages.{i}.role", f"must be one of {', '.join(CHAT_ROLES)}, "
                       f"got {_short(role)}")
        if not isinstance(content, str):
            raise _bad(f"messages.{i}.content", "must be a string")
        chars += len(content)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if chars > limits.max_prompt_chars:
        raise _bad("messages", f"have {chars} characters of content; at most "
                   f"{limits.max_prompt_chars}")
    return out


def check_n(n: Any, num_prompts: int, limits: RequestLimits, best_of: Any = None) -> int:
    """n (None: 1), bounded before any sub-request exists."""
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= limits.max_n:
        raise _bad("n", f"must be an integer in [1, {limits.max_n}], got {_short(n)}")
    if best_of is not None and (not _is_int(best_of) or not n <= best_of <= limits.max_n):
        raise _bad("best_of", f"must be an integer in [n, {limits.max_n}], got {_short(best_of)}")
    return n


def check_label(name: str, value: Any, limits: RequestLimits) -> str:
    """tenant, lora, user, a client request id: a short printable string ('' when absent)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(name, f"must be a string, got {_short(value)}")
    if len(value) > limits.max_label_chars or not value.isprintable():
        raise _bad(name, f"must be at most {limits.max_label_chars} printable characters")
    return value
