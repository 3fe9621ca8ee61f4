"""Ways to look at handoff traces: a text timeline of one request, Chrome trace / Perfetto JSON
of many (one track per actor), and `raypd trace-request ID --url URL`.

    raypd trace-request cmpl-1f3c... --url http://127.0.0.1:8000 [--json] [--perfetto out.json]

The Chrome trace format (https://ui.perfetto.dev and chrome://tracing open it): one process
"raypd", one thread (track) per actor (router, prefill-0, decode-0, ...), each stage a complete
event ("X", microseconds) named after the stage with the request id in its args, each streamed
token an instant event on the decode worker's track.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

from protocol.request_trace import ROUTER, RequestTrace

API_KEY_ENV = "RAYPD_API_KEY"
PID = 1


# ---- text timeline -------------------------------------------------------------------------------
def timeline_lines(t: RequestTrace, width: int = 40) -> list[str]:
    """One line per stage: offset from arrival, duration, actor and a bar on a shared scale."""
    end = t.finished_at if t.finished_at is not None else max(
        [s.end for s in t.spans] + t.token_times + [t.arrival])
    total = max(end - t.arrival, 1e-9)
    ttft = f"{t.ttft_s * 1e3:.1f} ms" if t.ttft_s is not None else "-"
    e2e = f"{t.e2e_s * 1e3:.1f} ms" if t.e2e_s is not None else "-"
    lines = [f"request {t.request_id}  status {t.status}  attempts {t.attempts}  "
             f"{t.prefill_worker or '-'} -> {t.decode_worker or '-'}"
             f"{'  (prefilled on decode)' if t.local_prefill else ''}",
             f"ttft {ttft}  e2e {e2e}  tokens {len(t.token_times)}  "
             f"transfer {t.transfer_bytes:,} bytes",
             f"{'stage':<16}{'start ms':>10}{'dur ms':>10}  {'actor':<12}timeline"]
    for s in sorted(t.spans, key=lambda s: (s.start, s.end)):
        a = int((s.start - t.arrival) / total * width)
        b = max(a + 1, int(round((s.end - t.arrival) / total * width)))
        bar = " " * a + "#" * (b - a)
        lines.append(f"{s.stage:<16}{(s.start - t.arrival) * 1e3:>10.2f}"
                     f"{s.seconds * 1e3:>10.2f}  {s.actor:<12}|{bar:<{width}}|")
    if t.token_times:
        marks = [" "] * width
        for x in t.token_times:
            marks[min(width - 1, int((x - t.arrival) / total * width))] = "."
        lines.append(f"{'tokens':<16}{(t.token_times[0] - t.arrival) * 1e3:>10.2f}"
                     f"{(t.token_times[-1] - t.token_times[0]) * 1e3:>10.2f}  "
                     f"{(t.decode_worker or ROUTER):<12}|{''.join(marks)}|")
    if t.finished_at is not None:
        lines.append(f"{'finish':<16}{(t.finished_at - t.arrival) * 1e3:>10.2f}")
    return lines


# ---- Chrome trace / Perfetto -------------------------------------------------------------------
def _actor_order(actor: str) -> tuple:
    role = 0 if actor == ROUTER else 1 if actor.startswith("prefill") else 2
    return role, actor


def chrome_trace(traces: Iterable[RequestTrace]) -> dict:
    """The Chrome trace JSON object of these requests: one track per actor."""
    traces = list(traces)
    actors = {ROUTER}
    for t in traces:
        actors.update(s.actor for s in t.spans)
        if t.decode_worker:
            actors.add(t.decode_worker)
    tid = {a: i + 1 for i, a in enumerate(sorted(actors, key=_actor_order))}
    events: list[dict] = [{"ph": "M", "pid": PID, "name": "process_name",
                           "args": {"name": "raypd"}}]
    for a, i in tid.items():
        events.append({"ph": "M", "pid": PID, "tid": i, "name": "thread_name",
                       "args": {"name": a}})
        events.append({"ph": "M", "pid": PID, "tid": i, "name": "thread_sort_index",
                       "args": {"sort_index": i}})
    for t in traces:
        args = {"request_id": t.request_id, "status": t.status}
        events.append({"ph": "X", "pid": PID, "tid": tid[ROUTER], "name": "request",
                       "cat": "request", "ts": t.arrival * 1e6,
                       "dur": ((t.finished_at or t.arrival) - t.arrival) * 1e6, "args": args})
        for s in t.spans:
            events.append({"ph": "X", "pid": PID, "tid": tid[s.actor], "name": s.stage,
                           "cat": "stage", "ts": s.start * 1e6, "dur": s.seconds * 1e6,
                           "args": args})
        for k, x in enumerate(t.token_times):
            events.append({"ph": "i", "s": "t", "pid": PID,
                           "tid": tid[t.decode_worker or ROUTER], "name": "token",
                           "cat": "token", "ts": x * 1e6,
                           "args": {"request_id": t.request_id, "index": k}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(traces: Iterable[RequestTrace], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace(traces)) + "\n")
    return p


# ---- fetching --------------------------------------------------------------------------------------
class TraceNotFound(LookupError):
    """The server keeps no trace of that request (unknown, or older than the last N)."""


def fetch_trace(url: str, request_id: str, api_key: str | None = None,
                timeout: float = 10.0) -> RequestTrace:
    """GET /v1/requests/{id}/trace. Raises TraceNotFound (404), PermissionError (401),
    OSError (unreachable)."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    target = f"{url.rstrip('/')}/v1/requests/{urllib.parse.quote(request_id, safe='')}/trace"
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers),
                                    timeout=timeout) as r:
            return RequestTrace.from_dict(json.load(r))
    except urllib.error.HTTPError as e:
        msg = _message(e.read())
        if e.code == 404:
            raise TraceNotFound(msg) from None
        if e.code == 401:
            raise PermissionError(f"{msg} (give --api-key or set ${API_KEY_ENV})") from None
        raise OSError(f"{target}: HTTP {e.code}: {msg}") from None


def fetch_traces(url: str, request_ids: Sequence[str], api_key: str | None = None) -> list:
    """The traces the server still has of these requests (missing ones are skipped)."""
    out = []
    for rid in request_ids:
        try:
            out.append(fetch_trace(url, rid, api_key))
        except TraceNotFound:
            continue
    return out


def _message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:300]


# ---- CLI ---------------------------------------------------------------------------------------------


