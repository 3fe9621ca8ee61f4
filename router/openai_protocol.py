"""The OpenAI wire format of the HTTP ingress: request bodies (pydantic), their validation into
SamplingParams, and errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}.

Bad request 400 (the message names the field), bad or missing bearer token 401, unknown model
404, over capacity or SLO unmeetable 429 with Retry-After, KV transfer or worker failure 503.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import ray
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kvcache.sampling import RequestError, SamplingParams
from router.orchestrator import TransferFailed
from router.policies import RoutingRejected

COMPLETION_MAX_TOKENS = 16     # OpenAI's and vLLM's default for /v1/completions
CHAT_MAX_TOKENS = 256          # ours for chat (OpenAI: up to the context)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 501: "not_implemented_error",
               503: "service_unavailable"}


class APIError(Exception):
    """An error answer: status code plus OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": code}}


def error_for(exc: BaseException) -> APIError:
    """Map a backend exception to its HTTP answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        exc = exc.cause             # the worker's own exception, without Ray's traceback
    if isinstance(exc, RoutingRejected):
        retry = max(1, math.ceil(exc.retry_after_s))
        return APIError(429, str(exc), code=exc.reason, headers={"Retry-After": str(retry)})
    if isinstance(exc, RequestError):
        return APIError(400, str(exc))
    if isinstance(exc, TransferFailed):
        return APIError(503, str(exc), code="transfer_failed")
    if isinstance(exc, ray.exceptions.RayError):
        return APIError(503, f"a worker failed: {type(exc).__name__}: {exc}",
                        code="worker_failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


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
    content: str | list[ContentPart] | None = None
    name: str | None = None


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
        raise APIError(400, f"{where}: {why}", param=top or None) from None


def refuse_unsupported(body: _Body, checks: dict[str, bool]) -> None:
    for name, bad in checks.items():
        if bad:
            raise APIError(400, f"{name}: not supported by this server", param=name)


def sampling_params(body: _Body, max_tokens: int) -> SamplingParams:
    stop = body.stop if body.stop is not None else ()
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        seed=body.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens or 0)
    try:
        sp.validate()
    except RequestError as e:
        raise APIError(400, str(e).replace("invalid sampling parameter ", "")) from None
    return sp


def message_dict(m: Message, i: int) -> dict:
    if m.content is None or isinstance(m.content, str):
        text = m.content or ""
    else:
        parts = []
        for p in m.content:
            if p.type != "text" or p.text is None:
                raise APIError(400, f"messages.{i}.content: only text parts are supported, "
                               f"got type {p.type!r}", param="messages")
            parts.append(p.text)
        text = "\n".join(parts)
    return {"role": "system" if m.role == "developer" else m.role, "content": text}


def penalties(body: _Body) -> dict[str, bool]:
    return {"presence_penalty": bool(body.presence_penalty),
            "frequency_penalty": bool(body.frequency_penalty),
            "repetition_penalty": body.repetition_penalty not in (None, 1, 1.0),
            "logit_bias": bool(body.logit_bias)}
