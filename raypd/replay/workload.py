"""Workloads to replay: Mooncake traces (hash ids expanded into token ids), raypd JSONL (prompt or
chat messages per line), and the `raypd trace synth` generator (shared system prompts,
multi-turn sessions, Poisson arrivals). Every file is validated in full before anything is
replayed; a bad line raises raypd.replay.mooncake.WorkloadError naming the file and line.

raypd JSONL, one object a line (only `prompt` or `messages` is required):
    {"id": "s3-t2", "timestamp": 1.25, "messages": [{"role": "system", "content": "..."}, ...],
     "max_tokens": 24, "tenant": "", "session": "s3", "ignore_eos": true}
`timestamp` is seconds from the start of the trace; `prompt` is a string or a list of token ids.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from ingress.request_checks import (
    ModelLimits,
    RequestLimits,
    check_label,
    check_messages,
    check_prompt,
)
from kvcache.manager import cdiv
from raypd.replay.mooncake import WorkloadError, load_trace, scaled_tokens

DEFAULT_VOCAB_SIZE = 49152      # SmolLM2
MIN_TOKEN_ID = 100              # expanded ids stay clear of the special tokens at the bottom
DEFAULT_MAX_TOKENS = 64
SUBMIT_LIMITS = RequestLimits()     # the server's defaults (server.request_limits)
RAYPD_KEYS = ("id", "timestamp", "prompt", "messages", "max_tokens", "tenant", "session",
              "ignore_eos")
REUSE_CHARS = 64                # text prompts: characters per unit when measuring repeated prefixes


@dataclass(frozen=True)
class WorkItem:
    """One request to replay. Exactly one of `prompt` / `messages` is set."""

    id: str
    timestamp_s: float
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tenant: str = ""
    session: str = ""
    ignore_eos: bool = True      # a replay follows the trace's output lengths
    line: int = 0
    reuse_units: tuple[int, ...] = field(default=(), repr=False)   # chained prefix-unit hashes


# ---- Mooncake ------------------------------------------------------------------------------
@lru_cache(maxsize=1 << 16)
def block_tokens_of(hash_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """The token ids a trace block stands for: pseudo-random, seeded by the id only."""
    rng = random.Random(hash_id)
    return tuple(rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(block_tokens))


def expand_hash_ids(hash_ids: Sequence[int], num_tokens: int, block_tokens: int,
                    vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """`num_tokens` prompt ids: block i is `block_tokens_of(hash_ids[i])`, the last one cut."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    out: list[int] = []
    for h in hash_ids:
        out.extend(block_tokens_of(h, block_tokens, vocab_size))
    return out[:num_tokens]


def load_mooncake(path: str | os.PathLike, *, limit: int | None = None, block_tokens: int = 16,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[WorkItem]:
    """A Mooncake trace with each 512-token block scaled to `block_tokens` token ids."""
    if block_tokens < 1:
        raise ValueError(f"--block-tokens must be >= 1, got {block_tokens}")
    items = []
    for r in load_trace(path, limit=limit):
        n = scaled_tokens(r.input_length, block_tokens)
        ids = expand_hash_ids(r.hash_ids, n, block_tokens, vocab_size)
        items.append(WorkItem(f"line-{r.line}", r.timestamp_s, max(1, r.output_length),
                              prompt=ids, line=r.line, reuse_units=_chain(r.hash_ids)))
    return items


# ---- raypd JSONL ---------------------------------------------------------------------------
def parse_raypd_line(obj: object, lineno: int) -> WorkItem:
    """One decoded raypd JSONL line, or ValueError naming the key."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(RAYPD_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (valid: {', '.join(RAYPD_KEYS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    # the ingress's own checks (ingress.request_checks): a line the server would refuse is
    # refused here, before anything is sent
    if "prompt" in obj:
        check_prompt(prompt, SUBMIT_LIMITS, ModelLimits())
        prompt = prompt if isinstance(prompt, str) else list(prompt)
    else:
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        check_messages(messages, SUBMIT_LIMITS)
    ts = obj.get("timestamp", 0.0)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a finite number >= 0 (seconds), got {ts!r}")
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    for key in ("id", "tenant", "session"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f"{key!r} must be a string, got {type(obj[key]).__name__}")
    check_label("tenant", obj.get("tenant"), SUBMIT_LIMITS)
    ignore_eos = obj.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    return WorkItem(obj.get("id") or f"line-{lineno}", float(ts), max_tokens, prompt=prompt,
                    messages=messages, tenant=obj.get("tenant", ""),
                    session=obj.get("session", ""), ignore_eos=ignore_eos, line=lineno,
                    reuse_units=_text_units(prompt, messages, obj.get("tenant", "")))


def load_raypd(path: str | os.PathLike, *, limit: int | None = None) -> list[WorkItem]:
    items: list[WorkItem] = []
    seen: dict[str, int] = {}
    for lineno, obj in _json_lines(path):
        if limit is not None and len(items) >= limit:
            break
        try:
            item = parse_raypd_line(obj, lineno)
        except ValueError as e:
            raise WorkloadError(path, lineno, str(e)) from None
        if item.id in seen:
            raise WorkloadError(path, lineno, f"duplicate id {item.id!r} (first on line "
                                           f"{seen[item.id]})")
        seen[item.id] = lineno
        items.append(item)
    items.sort(key=lambda it: it.timestamp_s)
    return items


def _json_lines(path: str | os.PathLike) -> Iterable[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                raise WorkloadError(path, lineno, f"invalid JSON: {e.msg}") from None


def detect_format(path: str | os.PathLike) -> str:
    """"mooncake" when the first non-blank line has `hash_ids`, else "raypd"."""
    for _, obj in _json_lines(path):
        return "mooncake" if isinstance(obj, dict) and "hash_ids" in obj else "raypd"
    raise WorkloadError(path, 1, "the trace is empty")


def load_workload(path: str | os.PathLike, *, limit: int | None = None, block_tokens: int = 16,
                  vocab_size: int = DEFAULT_VOCAB_SIZE,
                  max_output_tokens: int | None = None) -> list[WorkItem]:
    """Any supported trace, validated in full (the first `limit` requests), sorted by arrival;
    `max_output_tokens` caps each request's output length (to fit a small machine)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"--max-output-tokens must be >= 1, got {max_output_tokens}")
    if detect_format(path) == "mooncake":
        items = load_mooncake(path, limit=limit, block_tokens=block_tokens,
                              vocab_size=vocab_size)
    else:
        items = load_raypd(path, limit=limit)
    if max_output_tokens is not None:
        items = [replace(it, max_tokens=min(it.max_tokens, max_output_tokens)) for it in items]
    return items


# ---- repeated prefixes (what reuse the trace offers) ---------------------------------------
def _chain(units: Iterable[Any]) -> tuple[int, ...]:
    out, parent = [], b""
    for u in units:
        parent = hashlib.blake2b(parent + repr(u).encode(), digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)


def _text_units(prompt, messages, tenant: str) -> tuple[int, ...]:
    """Chained hashes of a prompt's fixed-size pieces (chars of the rendered messages, or
    16-token blocks), under the tenant: equal leading hashes mean a shared prefix."""
    if isinstance(prompt, list):
        pieces = [tuple(prompt[i:i + 16]) for i in range(0, len(prompt), 16)]
    else:
        text = prompt if isinstance(prompt, str) else "".join(
            f"<{m['role']}>{m['content']}" for m in messages)
        pieces = [text[i:i + REUSE_CHARS] for i in range(0, len(text), REUSE_CHARS)]
    return _chain([tenant, *pieces])[1:]


def repeated_prefix_shares(items: Sequence[WorkItem]) -> list[float]:
    """Per request (in arrival order): the share of its prompt units whose whole prefix some
    earlier request already had (what an unbounded prefix cache could reuse)."""
    seen: set[int] = set()
    out = []
    for it in sorted(items, key=lambda i: i.timestamp_s):
        units = it.reuse_units
        hit = 0
        while hit < len(units) and units[hit] in seen:
            hit += 1
        out.append(hit / len(units) if units else 0.0)
        seen.update(units)
    return out


# ---- `raypd trace synth` -------------------------------------------------------------------
_WORDS = (
    "the a system model request cache block token prefix decode prefill worker transfer "
    "answer question please explain how why what when which short long clear simple detail "
    "data table chart report network memory latency throughput batch queue schedule policy "
    "user session history context window summary translate write code review test bug fix "
    "build deploy service cluster node page lease event index route balance load reuse hit "
    "miss evict store fetch send receive stream first last next before after always never "
    "careful polite formal friendly concise precise correct helpful expert assistant support "
    "customer order invoice refund travel hotel flight weather city country history science "
    "math physics music movie book recipe garden health sport game plan budget meeting email"
).split()
_DOMAINS = ("customer support", "travel booking", "code review", "cooking", "science tutoring",
            "personal finance", "technical writing", "travel insurance")


@dataclass
class SynthConfig:
    requests: int = 100
    system_prompts: int = 4
    turns: int = 3                  # turns per session (later turns repeat the conversation)
    rate: float = 4.0               # Poisson arrivals, requests / s
    seed: int = 0
    system_words: int = 160         # about 200 tokens of shared system prompt
    user_words: tuple[int, int] = (8, 24)
    reply_words: tuple[int, int] = (10, 30)
    max_tokens: tuple[int, int] = (16, 32)
    tenant: str = ""

    def validate(self) -> None:
        for name in ("requests", "system_prompts", "turns", "system_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        for name in ("user_words", "reply_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def synth_trace(cfg: SynthConfig | None = None) -> list[dict]:
    """raypd JSONL rows: sessions of `turns` chat turns, each session opening with one of
    `system_prompts` shared system prompts; turn k repeats the session's k-1 earlier exchanges
    (with synthetic assistant replies, so the trace is fixed in advance). Arrivals are Poisson
    at `rate`; a session's turns arrive in order, interleaved with other sessions."""
    cfg = cfg or SynthConfig()
    cfg.validate()
    rng = random.Random(cfg.seed)
    systems = []
    for k in range(cfg.system_prompts):
        domain = _DOMAINS[k % len(_DOMAINS)]
        body = " ".join(_sentence(rng, 8, 16) for _ in range(cfg.system_words // 12 + 1))
        words = body.split()[:cfg.system_words]
        systems.append(f"You are assistant #{k} for {domain}. " + " ".join(words))
    num_sessions = cdiv(cfg.requests, cfg.turns)
    order = [s for s in range(num_sessions) for _ in range(cfg.turns)]
    rng.shuffle(order)
    order = order[:cfg.requests]
    session_system = [rng.randrange(cfg.system_prompts) for _ in range(num_sessions)]
    history: dict[int, list[dict]] = {}
    t = 0.0
    rows = []
    for s in order:
        t += rng.expovariate(cfg.rate)
        conv = history.setdefault(s, [{"role": "system", "content": systems[session_system[s]]}])
        if len(conv) > 1:   # the previous turn's reply joins the history
            conv.append({"role": "assistant", "content": " ".join(
                _sentence(rng, *cfg.reply_words) for _ in range(1))})
        conv.append({"role": "user", "content": _sentence(rng, *cfg.user_words)})
        turn = (len(conv) - 1) // 2
        rows.append({"id": f"s{s}-t{turn}", "timestamp": round(t, 3),
                     "messages": [dict(m) for m in conv],
                     "max_tokens": rng.randint(*cfg.max_tokens), "tenant": cfg.tenant,
                     "session": f"s{s}", "ignore_eos": True})
    return rows


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ---- CLI -----------------------------------------------------------------------------------


