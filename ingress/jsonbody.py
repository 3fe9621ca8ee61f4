"""Parse a JSON request body within limits: malformed JSON, non-finite or over-long numbers,
deep nesting and strings that are not Unicode text (lone UTF-16 surrogates such as "\ud800") are
400s that name the problem (never a 500, never a 4,300-digit int parse)."""

from __future__ import annotations

import json
import re
from typing import Any

from ingress.errors import IngressError
from ingress.limits import IngressLimits


class _Refused(ValueError):
    pass


# a \u escape of a UTF-16 surrogate (D800-DFFF): only then can a decoded string hold one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _surrogate_path(value: Any, path: str = "body") -> str | None:
    """Where in the decoded JSON a string holds a lone surrogate (None: nowhere). A pair that
    JSON escapes as two \\u's decodes to one character and is fine."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _surrogate_path(k, f"{path} key") or _surrogate_path(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_path(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _depth(raw: str, limit: int) -> int:
    """Bracket nesting depth outside strings (stops counting past `limit`)."""
    depth = deepest = 0
    in_str = esc = False
    for ch in raw:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json_object(raw: bytes, limits: IngressLimits) -> dict:
    """The body as a dict, or IngressError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IngressError(400, f"malformed JSON body: not UTF-8 ({e.reason} at byte "
                           f"{e.start})") from None
    few = text.count("[") + text.count("{") <= limits.max_json_depth   # cannot be too deep
    if not few and _depth(text, limits.max_json_depth) > limits.max_json_depth:
        raise IngressError(400, f"JSON body nested deeper than {limits.max_json_depth} levels")

    def number(s: str, kind: type) -> Any:
        if len(s) > limits.max_number_digits:
            raise _Refused(f"JSON number with {len(s)} characters; at most "
                           f"{limits.max_number_digits}")
        v = kind(s)
        if kind is float and v in (float("inf"), float("-inf")):
            raise _Refused(f"JSON number {s} is out of range")
        return v

    def constant(s: str) -> Any:
        raise _Refused(f"{s} is not valid JSON")

    try:
        body = json.loads(text, parse_int=lambda s: number(s, int),
                          parse_float=lambda s: number(s, float), parse_constant=constant)
    except _Refused as e:
        raise IngressError(400, f"malformed JSON body: {e}") from None
    except json.JSONDecodeError as e:
        raise IngressError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise IngressError(400, "JSON body nested too deeply") from None
    if not isinstance(body, dict):
        raise IngressError(400, f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    if _SURROGATE_ESCAPE.search(text) and (where := _surrogate_path(body)):
        raise IngressError(400, f"malformed JSON body: {where} holds a lone UTF-16 surrogate "
                           "(\\ud800-\\udfff without its pair), which is not Unicode text")
    return body
