"""Mooncake-format traces (one JSON object a line: timestamp ms, input_length, output_length,
hash_ids), validated in full before anything is replayed; errors name the file and line."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from kvcache.hashing import BlockHash, CacheNamespace, hash_block
from kvcache.manager import cdiv

TRACE_BLOCK_TOKENS = 512  # the block size the trace's hash_ids were made with
TRACE_MODEL_ID = "mooncake-trace"


class WorkloadError(ValueError):
    """A malformed workload line (a Mooncake trace's or a raypd JSONL's); the message starts
    with `path:line:`, so the CLI's error names the file and the line."""

    def __init__(self, path: str | os.PathLike, line: int, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}")
        self.path = str(path)
        self.line = line


class WorkloadRequest(NamedTuple):
    """One line of a Mooncake-format trace: a request to replay (not a trace of one: that is
    protocol/request_trace.py's RequestTrace)."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int  # 1-based line in the file


def shared_dir() -> Path:
    """The shared folder beside the repository (overridable by RAYPD_SHARED_DIR)."""
    env = os.environ.get("RAYPD_SHARED_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared"


def default_trace_path() -> Path:
    return shared_dir() / "traces" / "mooncake_synthetic_trace.jsonl"


def _int_field(obj: dict, key: str, minimum: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key!r} must be an integer, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {v}")
    return v


def parse_line(obj: object, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple:
    """(timestamp_s, input_length, output_length, hash_ids) of one decoded line, or ValueError."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise ValueError(f"missing key {key!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a finite number >= 0 (ms), got {ts!r}")
    input_length = _int_field(obj, "input_length", 1)
    output_length = _int_field(obj, "output_length", 0)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"'hash_ids' must be a list, got {type(ids).__name__}")
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"'hash_ids' must hold integers >= 0, got {x!r}")
    want = math.ceil(input_length / trace_block_tokens)
    if len(ids) != want:
        raise ValueError(f"len(hash_ids) = {len(ids)}, expected ceil(input_length / "
                         f"{trace_block_tokens}) = {want}")
    return ts / 1000.0, input_length, output_length, tuple(ids)


def load_trace(path: str | os.PathLike, limit: int | None = None,
               trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> list[WorkloadRequest]:
    """Every request of the trace (the first `limit` if given), sorted by arrival (stable).

    Blank lines are skipped. The whole file (or the first `limit` requests) is validated before
    returning, so a bad line means no replay at all.
    """
    out: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise WorkloadError(path, lineno, f"invalid JSON: {e.msg}") from None
            try:
                ts, n_in, n_out, ids = parse_line(obj, trace_block_tokens)
            except ValueError as e:
                raise WorkloadError(path, lineno, str(e)) from None
            out.append(WorkloadRequest(ts, n_in, n_out, ids, lineno))
    out.sort(key=lambda r: r.timestamp_s)
    return out


def namespace_root(tenant: str = "") -> BlockHash:
    return CacheNamespace(TRACE_MODEL_ID, tenant=tenant).root_hash()


def chained_hashes(hash_ids: Sequence[int], root: BlockHash) -> list[BlockHash]:
    """The trace's per-block ids as the 64-bit chained hashes a worker would publish: block i
    hashes (block i-1's hash, [hash_id i]) from the namespace root."""
    out: list[BlockHash] = []
    parent = root
    for x in hash_ids:
        parent = hash_block(parent, (x,))
        out.append(parent)
    return out


def scaled_tokens(input_length: int, block_tokens: int,
                  trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
    """A prompt length when each trace block stands for `block_tokens` tokens (rounded up, so
    the request keeps the same number of blocks)."""
    return cdiv(input_length * block_tokens, trace_block_tokens)
