"""The OpenAI wire format of the HTTP ingress: request bodies (pydantic: the shape), turned into
the core's GenerationRequest by the shared checks of ingress.request_checks (the ranges).
Errors leave in OpenAI's shape (ingress.errors)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ingress.core import GenerationRequest
from ingress.errors import IngressError
from ingress.request_checks import (
    ModelLimits,
    RequestLimits,
    check_label,
    check_messages,
    check_n,
    check_prompts,
    make_sampling,
)
from protocol.errors import RequestError


# ---- request bodies ----------------------------------------------------------------------------
class _Body(BaseModel):
    """Fields shared by both endpoints; null means "the default". Unknown fields are ignored
    (as vLLM does); fields that would change the answer and are not supported are refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None             # vLLM extra; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tenant: str | None = None            # ours: cache namespace
    lora: str | None = None              # ours: LoRA adapter id (a cache-namespace key)
    return_token_ids: bool | None = None  # vLLM's: token ids per choice (+ ours: raypd_lifecycle)
    include_stop_str_in_output: bool | None = None   # vLLM extra: the stop string ends the text
    skip_special_tokens: bool | None = None          # vLLM extra: special tokens leave no text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None     # null: an assistant's with tool_calls only
    name: str | None = None
    tool_calls: list[Any] | None = None


class ChatBody(_Body):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


_Body.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()

FIELD_HELP = {
    "prompt": "must be a string, a list of token ids, or a list of strings or token-id lists",
    "messages": "must be a list of {role, content} messages (role: system, developer, user, "
                "assistant or tool; content: a string or a list of text parts)",
    "stop": "must be a string or a list of strings",
    "stream_options": "must be an object like {\"include_usage\": true}",
}


def parse_body(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        top = str(err["loc"][0]) if err["loc"] else ""
        if top in FIELD_HELP:
            where, why = top, FIELD_HELP[top]
        else:
            where = ".".join(str(x) for x in err["loc"])
            why = err["msg"][0].lower() + err["msg"][1:]
            if "input" in err and err["type"] != "missing":
                why += f", got {json.dumps(err['input'])[:80]}"
        if err["type"] == "missing":
            why = "is required"
        raise IngressError(400, f"{where}: {why}", param=top or None) from None


def refuse_unsupported(checks: dict[str, bool]) -> None:
    for name, bad in checks.items():
        if bad:
            raise IngressError(400, f"{name}: not supported by this server", param=name)


def penalties(body: _Body) -> dict[str, bool]:
    return {"presence_penalty": bool(body.presence_penalty),
            "frequency_penalty": bool(body.frequency_penalty),
            "repetition_penalty": body.repetition_penalty not in (None, 1, 1.0),
            "logit_bias": bool(body.logit_bias)}


def _request(body: _Body, prompts: list, *, chat: bool, limits: RequestLimits,
             model: ModelLimits, max_tokens: Any, best_of: Any = None) -> GenerationRequest:
    try:
        n = check_n(body.n, len(prompts), limits, best_of)
        sampling = make_sampling(
            chat=chat, limits=limits, model=model, max_tokens=max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens)
        tenant = check_label("tenant", body.tenant, limits)
        lora = check_label("lora", body.lora, limits)
        check_label("user", body.user, limits)
    except RequestError as e:
        raise _as_400(e) from None
    return GenerationRequest(prompts, sampling, chat, n=n, tenant=tenant, lora=lora,
                             stream=bool(body.stream),
                             include_usage=bool(body.stream_options
                                                and body.stream_options.include_usage),
                             return_token_ids=bool(body.return_token_ids))


def _as_400(e: RequestError) -> IngressError:
    msg = str(e).replace("invalid sampling parameter ", "")
    param = msg.split(":", 1)[0].split(".", 1)[0] if ":" in msg else None
    return IngressError(400, msg, param=param)


def completion_request(raw: dict, limits: RequestLimits, model: ModelLimits
                       ) -> tuple[CompletionBody, GenerationRequest]:
    body: CompletionBody = parse_body(CompletionBody, raw)
    refuse_unsupported({"echo": bool(body.echo), "logprobs": body.logprobs is not None,
                        "best_of": (body.best_of or 1) > 1, "suffix": bool(body.suffix),
                        **penalties(body)})
    p = body.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    try:
        check_prompts(prompts, limits, model)
    except RequestError as e:
        raise _as_400(e) from None
    return body, _request(body, prompts, chat=False, limits=limits, model=model,
                          max_tokens=body.max_tokens, best_of=body.best_of)


def chat_request(raw: dict, limits: RequestLimits, model: ModelLimits
                 ) -> tuple[ChatBody, GenerationRequest]:
    body: ChatBody = parse_body(ChatBody, raw)
    rf = (body.response_format or {}).get("type", "text")
    refuse_unsupported({"logprobs": bool(body.logprobs) or body.top_logprobs is not None,
                        "tools": bool(body.tools), "response_format": rf != "text",
                        **penalties(body)})
    try:
        messages = check_messages([_message_dict(m, i) for i, m in enumerate(body.messages)],
                                  limits)
    except RequestError as e:
        raise _as_400(e) from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    return body, _request(body, [messages], chat=True, limits=limits, model=model,
                          max_tokens=max_tokens)


def _message_dict(m: Message, i: int) -> dict:
    """{role, content: str}; content null only for an assistant message with tool calls (as the
    OpenAI API has it), else 400."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise IngressError(400, f"messages.{i}.content: is required for a {m.role} message "
                           f"(null only for an assistant message with tool_calls)",
                           param="messages")
    if m.content is None or isinstance(m.content, str):
        text = m.content or ""
    else:
        parts = []
        for p in m.content:
            if p.type != "text" or p.text is None:
                raise IngressError(400, f"messages.{i}.content: only text parts are "
                                   f"supported, got type {p.type!r}", param="messages")
            parts.append(p.text)
        text = "\n".join(parts)
    return {"role": m.role, "content": text}
