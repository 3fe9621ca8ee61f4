"""`raypd submit`: replay a trace through a raypd (OpenAI-compatible) server over HTTP, timing
every request client-side from its SSE stream, then write the report.

Arrivals: `--rate R` (Poisson, R requests/s), `--timestamps` (the trace's own), or neither (as
fast as `--concurrency` allows); `--concurrency` always caps the requests in flight. Every
request ends as ok or failed (HTTP status and message kept), so ok + failed == sent.
Cluster-wide KV figures come from the server: `GET /api/stats` (JSON per-worker stats) when it
has one, else the per-worker gauges of `GET /metrics`.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from raypd.replay.trace_views import fetch_traces
from raypd.replay.workload import (
    WorkItem,
    repeated_prefix_shares,
)

DEFAULT_CONCURRENCY = 16
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.25


@dataclass
class SubmitOptions:
    url: str
    rate: float | None = None          # Poisson arrivals; None with timestamps=False: no pacing
    timestamps: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    model: str | None = None           # None: the server's first model
    timeout_s: float = 600.0
    seed: int = 0
    api_key: str | None = None
    progress: bool = True

    def validate(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.rate is not None and self.timestamps:
            raise ValueError("give --rate or --timestamps, not both")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")


@dataclass
class RequestRecord:
    """One replayed request; times are seconds from the start of the replay."""

    id: str
    ok: bool = False
    status: int = 0                    # HTTP status; 0: no answer (connection error, timeout)
    error: str = ""
    request_id: str = ""               # the server's id for it
    scheduled_s: float = 0.0           # when the trace says it arrives
    sent_s: float = 0.0                # when it was sent (later under the concurrency cap)
    first_token_s: float | None = None
    end_s: float = 0.0
    in_flight_at_send: int = 0         # requests in flight when it was sent, itself included
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] | None = None
    lifecycle: dict | None = None
    tenant: str = ""
    session: str = ""
    repeated_prefix: float = 0.0       # share of its prompt some earlier request had

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    model: str
    wall_s: float
    started_at: float                 # unix time of the replay's start


# ---- one request ---------------------------------------------------------------------------
def request_body(item: WorkItem, model: str) -> tuple[str, dict]:
    """(path, JSON body) of one work item: greedy, streamed, usage included, the trace's
    output length (ignore_eos), and raypd's extras (tenant; token ids and lifecycle when the
    server offers them)."""
    body: dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": item.ignore_eos, "return_token_ids": True}
    if item.tenant:
        body["tenant"] = item.tenant
    if item.messages is not None:
        return "/v1/chat/completions", {**body, "messages": item.messages}
    return "/v1/completions", {**body, "prompt": item.prompt}


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


async def send_one(session: aiohttp.ClientSession, url: str, item: WorkItem, model: str,
                   rec: RequestRecord, t0: float, headers: dict) -> None:
    """Send `item`, reading its SSE stream into `rec` (never raises for a failed request)."""
    path, body = request_body(item, model)
    rec.sent_s = time.perf_counter() - t0
    last = None
    token_ids: list[int] = []
    finished = False
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = _error_message(await resp.read())
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {_error_message(data)}"
                    return
                rec.request_id = rec.request_id or obj.get("id", "")
                _read_usage(obj.get("usage"), rec)
                if obj.get("raypd_lifecycle"):
                    rec.lifecycle = obj["raypd_lifecycle"]
                for choice in obj.get("choices") or ():
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    ids = choice.get("token_ids") or []
                    if text or ids:
                        now = time.perf_counter() - t0
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.text += text or ""
                        token_ids.extend(ids)
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                    if choice.get("raypd_lifecycle"):
                        rec.lifecycle = choice["raypd_lifecycle"]
            rec.ok = finished
            if not finished:
                rec.error = "the stream ended before [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        rec.ok = False
    finally:
        rec.end_s = time.perf_counter() - t0
        if token_ids:
            rec.token_ids = token_ids
        if rec.lifecycle:
            rec.cached_tokens = rec.cached_tokens or rec.lifecycle.get("cached_tokens", 0)
            rec.prompt_tokens = rec.prompt_tokens or rec.lifecycle.get("prompt_tokens", 0)
        if rec.ok and not rec.output_tokens:
            rec.output_tokens = len(token_ids) or len(rec.itl_s) + 1


def _read_usage(usage: dict | None, rec: RequestRecord) -> None:
    if not usage:
        return
    rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
    rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens") or rec.cached_tokens


# ---- the replay ----------------------------------------------------------------------------
def arrival_offsets(items: Sequence[WorkItem], rate: float | None, timestamps: bool,
                    seed: int = 0) -> list[float]:
    """Seconds from the replay's start at which each item is due."""
    if timestamps and items:
        t0 = items[0].timestamp_s
        return [it.timestamp_s - t0 for it in items]
    if rate:
        rng, t, out = random.Random(seed), 0.0, []
        for _ in items:
            out.append(t)
            t += rng.expovariate(rate)
        return out
    return [0.0] * len(items)


async def replay_async(items: Sequence[WorkItem], opts: SubmitOptions, model: str,
                       on_record: Callable[[RequestRecord], None] | None = None
                       ) -> list[RequestRecord]:
    from tqdm import tqdm
    offsets = arrival_offsets(items, opts.rate, opts.timestamps, opts.seed)
    shares = repeated_prefix_shares(items)
    sem = asyncio.Semaphore(opts.concurrency)
    in_flight = 0
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    url = opts.url.rstrip("/")
    bar = tqdm(total=len(items), desc="replay", unit="req", file=sys.stderr,
               disable=not opts.progress, dynamic_ncols=True)
    ok = 0
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    connector = aiohttp.TCPConnector(limit=opts.concurrency)
    t0 = time.perf_counter()

    async def one(item: WorkItem, due: float, share: float) -> RequestRecord:
        nonlocal in_flight, ok
        rec = RequestRecord(item.id, scheduled_s=due, tenant=item.tenant,
                            session=item.session, repeated_prefix=share)
        delay = due - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            in_flight += 1
            rec.in_flight_at_send = in_flight
            try:
                await send_one(session, url, item, model, rec, t0, headers)
            finally:
                in_flight -= 1
        ok += rec.ok
        bar.set_postfix(ok=ok, failed=bar.n + 1 - ok, refresh=False)
        bar.update(1)
        if on_record is not None:
            on_record(rec)
        return rec

    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         read_bufsize=1 << 22) as session:
            return list(await asyncio.gather(*(one(it, d, s) for it, d, s
                                               in zip(items, offsets, shares, strict=True))))
    finally:
        bar.close()


def replay(items: Sequence[WorkItem], opts: SubmitOptions, model: str | None = None,
           on_record: Callable[[RequestRecord], None] | None = None) -> ReplayResult:
    """Replay `items` against opts.url (blocking); one record per item, in trace order."""
    opts.validate()
    model = model or opts.model or server_model(opts.url, opts.api_key)
    started_at = time.time()
    t = time.perf_counter()
    records = asyncio.run(replay_async(items, opts, model, on_record))
    return ReplayResult(records, model, time.perf_counter() - t, started_at)


# ---- what the server says ------------------------------------------------------------------
def _get(url: str, api_key: str | None = None, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def server_model(url: str, api_key: str | None = None) -> str:
    """The first model the server lists (raises OSError when it can't be reached)."""
    try:
        data = json.loads(_get(url.rstrip("/") + "/v1/models", api_key))
        return data["data"][0]["id"]
    except (urllib.error.URLError, OSError) as e:
        raise OSError(f"cannot reach the server at {url}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise OSError(f"{url}/v1/models did not list a model") from None


# /metrics gauge or counter name -> the per-worker stats key it carries
METRIC_KEYS = {"raypd_kv_blocks_used": "blocks_used", "raypd_kv_blocks_cached": "blocks_cached",
               "raypd_kv_blocks_total": "num_blocks", "raypd_prefix_cache_hit_rate": "hit_rate",
               "raypd_worker_requests_running": "running",
               "raypd_worker_requests_waiting": "waiting",
               "raypd_prefix_reused_tokens": "reused_tokens", "raypd_kv_evictions": "evictions",
               "raypd_preemptions": "preemptions",
               "raypd_worker_computed_tokens": "computed_tokens",
               "raypd_kv_peak_blocks_used": "peak_blocks_used",
               "raypd_kv_block_utilization": "block_utilization",
               "raypd_prefix_prompt_tokens": "prompt_tokens",
               "raypd_worker_busy_seconds": "busy_s",
               "raypd_kv_transfer_bytes_staged": "transfer_bytes_staged"}


def parse_metrics(text: str) -> list[dict]:
    """Per-worker stats dicts from raypd's Prometheus text (worker/role labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    workers: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        key = METRIC_KEYS.get(fam.name) or METRIC_KEYS.get(fam.name.removesuffix("_total"))
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_created") or "worker" not in s.labels:
                continue
            w = workers.setdefault(s.labels["worker"], {"worker_id": s.labels["worker"],
                                                        "role": s.labels.get("role", "")})
            w[key] = int(s.value) if float(s.value).is_integer() else s.value
    return list(workers.values())


def server_stats(url: str, api_key: str | None = None) -> dict | None:
    """{"workers": [per-worker stats], "config": {...} (when given), "source": ...} from
    `/api/stats`, else `/metrics`; None when neither answers."""
    base = url.rstrip("/")
    try:
        data = json.loads(_get(base + "/api/stats", api_key))
        if isinstance(data, dict) and isinstance(data.get("workers"), list):
            return {**data, "source": "/api/stats"}
    except (OSError, ValueError):
        pass
    try:
        workers = parse_metrics(_get(base + "/metrics", api_key).decode())
    except (OSError, ValueError):
        return None
    return {"workers": workers, "source": "/metrics"} if workers else None


# ---- output files --------------------------------------------------------------------------
def server_kv_timeline(url: str, started_at: float, api_key: str | None = None,
                       lead_s: float = 2.0, max_points: int = 400) -> dict | None:
    """The server's KV timeline from `lead_s` before the replay's start, its times in seconds
    from that start; None when the server keeps none (an older raypd, another server)."""
    from raypd.replay.kv_story import rebase
    try:
        doc = json.loads(_get(f"{url.rstrip('/')}/api/kv_timeline?since={started_at - lead_s}"
                              f"&max_points={max_points}", api_key))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return rebase(doc, started_at) if isinstance(doc, dict) and "workers" in doc else None


def request_traces(url: str, records: Sequence[RequestRecord],
                   api_key: str | None = None) -> list:
    """The server's handoff traces of the replayed requests that succeeded (GET
    /v1/requests/{id}/trace each; empty when the server keeps none)."""
    ids = [r.request_id for r in records if r.ok and r.request_id]
    try:
        return fetch_traces(url, ids, api_key)
    except (OSError, PermissionError) as e:
        print(f"warning: no request traces from {url}: {e}", file=sys.stderr)
        return []


def write_outputs(records: Sequence[RequestRecord], path: str | Path) -> None:
    """One JSON line a request: id, ok, token ids, text, lifecycle (and error when failed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for r in records:
            row = {"id": r.id, "request_id": r.request_id, "ok": r.ok, "token_ids": r.token_ids,
                   "text": r.text, "lifecycle": r.lifecycle, "finish_reason": r.finish_reason,
                   "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens":
                             r.output_tokens, "cached_tokens": r.cached_tokens}}
            if not r.ok:
                row.update(status=r.status, error=r.error)
            f.write(json.dumps(row) + "\n")


def write_reports(report: dict, records: Sequence[RequestRecord], out: str | Path,
                  html: str | Path | None = None, outputs: str | Path | None = None) -> None:
    from raypd.replay.report_html import write_html
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2) + "\n")
    if html:
        write_html(report, records, html)
    if outputs:
        write_outputs(records, outputs)


# ---- CLI -----------------------------------------------------------------------------------
