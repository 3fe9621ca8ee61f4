"""OpenAI-compatible HTTP ingress (FastAPI) over any backend with PDCluster's request methods.

    app = build_app(cluster, "smollm2", api_key=None, max_inflight=256)

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text); operations: GET /api/stats (per-actor state, router
counters, the last finished requests' timelines), GET /dashboard (a self-contained page charting
/api/stats), GET /admin/status and POST /admin/scale (bearer token when set). Request bodies and
errors (OpenAI's shape) live in openai_protocol.py, metrics and /api/stats rows in
ingress_stats.py; this module runs requests and streams their answers.

The backend is duck-typed (this module never imports cluster/ or workers/, so no torch):
  run_request(prompt, sampling, *, chat, tenant, lora_id, request_id, on_delta) -> dict
      blocking; {"text", "token_ids", "lifecycle"}; on_delta({"token_ids", "text"}) per chunk
  abort(request_id) -> bool       releases the request's blocks on every worker
  stats() -> list[dict]           per-worker engine + block-pool counters (health, metrics)
and, used by the operations routes when present (PDCluster has them): `workers` (actor handles,
asked one by one so a dead or removed worker costs only its own row), `info`, `orchestrator`
(policy, decisions, draining, unhealthy, retries, in_flight()), `scale(prefill, decode, wait)`.
Each sub-request (one prompt x one of `n`) runs `run_request` in a worker thread; its deltas
reach the event loop through `call_soon_threadsafe` into an asyncio.Queue. A client that goes
away (disconnect, or the stream being cancelled) aborts every unfinished sub-request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcache.sampling import RequestError, SamplingParams
from router.ingress_stats import (
    STATS_TIMEOUT_S,
    IngressMetrics,
    actor_order,
    actor_row,
    config_of,
    summarize,
    worker_stats,
)
from router.openai_protocol import (
    CHAT_MAX_TOKENS,
    COMPLETION_MAX_TOKENS,
    APIError,
    ChatBody,
    CompletionBody,
    error_body,
    error_for,
    message_dict,
    parse_body,
    penalties,
    refuse_unsupported,
    sampling_params,
)
from router.trace_routes import add_trace_routes  # trace hook

DISCONNECT_POLL_S = 0.25
HEALTH_TIMEOUT_S = 10.0
RECENT_REQUESTS = 200          # finished requests kept for /api/stats and the dashboard timeline
DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")


# ---- running sub-requests ----------------------------------------------------------------------
@dataclass
class _Sub:
    """One backend request: one prompt, one of the `n` choices."""

    index: int                   # the choice index in the answer
    prompt: Any
    sampling: SamplingParams
    request_id: str
    first_of_prompt: bool        # counts the prompt's tokens in `usage`
    done: bool = False
    cancelled: bool = False      # the client went away (or another sub-request failed)
    abort_sent: bool = False     # the backend acknowledged the abort
    result: dict | None = None
    ttft_s: float | None = None


@dataclass
class _Event:
    index: int
    kind: str                    # delta | done | error
    payload: Any = None


@dataclass
class _Job:
    """The sub-requests of one HTTP request, running in the ingress's threads."""

    ingress: _Ingress
    subs: list[_Sub]
    chat: bool
    tenant: str
    lora: str
    return_token_ids: bool = False   # add token ids and the lifecycle record to each choice
    started: float = field(default_factory=time.perf_counter)
    arrival: float = field(default_factory=time.time)          # wall clock, for the timeline
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _getter: asyncio.Task | None = None
    _checked: float = field(default_factory=time.monotonic)   # last disconnect check

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sub in self.subs:
            self.ingress.executor.submit(self._run, sub, loop)

    def _run(self, sub: _Sub, loop: asyncio.AbstractEventLoop) -> None:
        def put(ev: _Event) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, ev)
            except RuntimeError:        # the loop is gone (server stopped)
                pass

        def on_delta(delta: dict) -> None:
            if sub.ttft_s is None:
                sub.ttft_s = time.perf_counter() - self.started
            if sub.cancelled and not sub.abort_sent:   # the abort raced its registration
                sub.abort_sent = True
                self.ingress.backend.abort(sub.request_id)
            put(_Event(sub.index, "delta", delta))

        status, result, error = 500, None, None
        try:
            if sub.cancelled:
                raise RequestError(f"request {sub.request_id} was aborted")
            # A chat prompt is a list of message dicts, which the worker recognises (and
            # templates) by itself: chat=True would also be applied again to the token ids
            # the orchestrator passes on after tokenizing, which fails.
            result = self.ingress.backend.run_request(
                sub.prompt, sub.sampling, chat=False, tenant=self.tenant,
                lora_id=self.lora, request_id=sub.request_id, on_delta=on_delta)
            n_out = len(result.get("token_ids") or ())
            self.ingress.metrics.observe(result.get("lifecycle") or {}, sub.ttft_s,
                                         time.perf_counter() - self.started, n_out)
            status = 200
            put(_Event(sub.index, "done", result))
        except BaseException as e:      # noqa: BLE001 - every failure goes to the client
            status = 499 if sub.cancelled else error_for(e).status
            error = f"{type(e).__name__}: {e}"
            put(_Event(sub.index, "error", e))
        finally:
            try:
                self.ingress.record(self, sub, status, result, error)
            finally:
                self.ingress.release(1)

    @property
    def pending(self) -> int:
        return sum(not s.done for s in self.subs)

    async def next(self, request: Request | None = None) -> _Event | None:
        """The next event; None if the client went away meanwhile (checked while waiting)."""
        while True:
            if request is not None and time.monotonic() - self._checked > DISCONNECT_POLL_S:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=DISCONNECT_POLL_S)
            if done:
                ev = self._getter.result()
                self._getter = None
                if ev.kind != "delta":
                    sub = self.subs_by_index[ev.index]
                    sub.done = True
                    if ev.kind == "done":
                        sub.result = ev.payload
                return ev

    @property
    def subs_by_index(self) -> dict[int, _Sub]:
        return {s.index: s for s in self.subs}

    def abort(self) -> None:
        """Abort every unfinished sub-request (client gone, or another one failed)."""
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
        for s in self.subs:
            if not s.done and not s.cancelled:
                s.cancelled = True
                try:
                    s.abort_sent = bool(self.ingress.backend.abort(s.request_id))
                except Exception:
                    pass

    def usage(self) -> dict:
        prompt = cached = completion = 0
        for s in self.subs:
            lc = (s.result or {}).get("lifecycle") or {}
            completion += len((s.result or {}).get("token_ids") or ())
            if s.first_of_prompt:
                prompt += lc.get("prompt_tokens") or 0
                cached += lc.get("cached_tokens") or 0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(result: dict) -> str:
    return (result.get("lifecycle") or {}).get("finish_reason") or "stop"


# ---- the app -----------------------------------------------------------------------------------
class _Ingress:
    def __init__(self, backend: Any, model_name: str, api_key: str | None, max_inflight: int,
                 metrics: IngressMetrics | None, max_model_len: int | None) -> None:
        self.backend = backend
        self.model_name = model_name
        self.api_key = api_key
        self.max_inflight = max_inflight
        self.max_model_len = max_model_len
        self.metrics = metrics or IngressMetrics(backend)
        self.executor = ThreadPoolExecutor(max_workers=max_inflight,
                                           thread_name_prefix="raypd-http-req")
        self.aux = ThreadPoolExecutor(max_workers=4, thread_name_prefix="raypd-http-aux")
        self._inflight = 0
        self.peak_inflight = 0          # the most sub-requests ever in flight at once
        self._lock = threading.Lock()
        self.created = int(time.time())
        self.recent: deque[dict] = deque(maxlen=RECENT_REQUESTS)   # finished sub-requests
        self.http_counts: dict[str, dict[str, int]] = {}           # endpoint -> status -> n

    # ---- capacity ----
    def acquire(self, n: int) -> None:
        if n > self.max_inflight:
            raise APIError(400, f"this request needs {n} concurrent sequences (prompts x n); "
                           f"the server runs at most {self.max_inflight}", param="n")
        with self._lock:
            if self._inflight + n > self.max_inflight:
                raise APIError(429, f"server over capacity: {self._inflight} requests in "
                               f"flight (max {self.max_inflight}); retry later",
                               code="over_capacity", headers={"Retry-After": "1"})
            self._inflight += n
            self.peak_inflight = max(self.peak_inflight, self._inflight)
            self.metrics.inflight.set(self._inflight)

    def release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
            self.metrics.inflight.set(self._inflight)

    @property
    def inflight(self) -> int:
        return self._inflight

    # ---- checks ----
    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing bearer token: send 'Authorization: Bearer <api key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    async def read_json(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
        return body

    def cap(self, max_tokens: int) -> int:
        return min(max_tokens, self.max_model_len) if self.max_model_len else max_tokens

    # ---- endpoints ----
    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        raw = await self.read_json(request)
        body: CompletionBody = parse_body(CompletionBody, raw)
        self.check_model(body.model)
        refuse_unsupported(body, {"echo": bool(body.echo), "logprobs": body.logprobs is not None,
                            "best_of": (body.best_of or 1) > 1, "suffix": bool(body.suffix),
                            **penalties(body)})
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: is empty", param="prompt")
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        sampling = sampling_params(body, self.cap(max_tokens) if max_tokens > 0 else max_tokens)
        return await self._serve(request, body, prompts, sampling, chat=False,
                                 rid_prefix="cmpl")

    async def chat(self, request: Request) -> Response:
        self.check_auth(request)
        raw = await self.read_json(request)
        body: ChatBody = parse_body(ChatBody, raw)
        self.check_model(body.model)
        rf = (body.response_format or {}).get("type", "text")
        refuse_unsupported(body, {"logprobs": bool(body.logprobs) or body.top_logprobs is not None,
                            "tools": bool(body.tools), "response_format": rf != "text",
                            **penalties(body)})
        if not body.messages:
            raise APIError(400, "messages: must hold at least one message", param="messages")
        messages = [message_dict(m, i) for i, m in enumerate(body.messages)]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        max_tokens = self.cap(CHAT_MAX_TOKENS) if max_tokens is None else max_tokens
        sampling = sampling_params(body, self.cap(max_tokens) if max_tokens > 0 else max_tokens)
        return await self._serve(request, body, [messages], sampling, chat=True,
                                 rid_prefix="chatcmpl")

    async def _serve(self, request: Request, body: CompletionBody | ChatBody, prompts: list, sampling: SamplingParams,
                     *, chat: bool, rid_prefix: str) -> Response:
        n = 1 if body.n is None else body.n
        if n < 1:
            raise APIError(400, f"n: must be an integer >= 1, got {n}", param="n")
        base = f"{rid_prefix}-{uuid.uuid4().hex[:24]}"
        subs = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                sp = sampling
                if sp.seed is not None and j:
                    sp = SamplingParams(**{**sp.__dict__, "seed": sp.seed + j})
                k = i * n + j
                rid = base if len(prompts) * n == 1 else f"{base}-{k}"
                subs.append(_Sub(k, prompt, sp, rid, first_of_prompt=(j == 0)))
        self.acquire(len(subs))
        job = _Job(self, subs, chat, body.tenant or "", body.lora or "",
                   return_token_ids=bool(body.return_token_ids))
        try:
            job.start()
        except BaseException:
            self.release(len(subs))
            raise
        meta = {"id": base, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(request, job, meta, chat, include_usage)
        return await self._collect(request, job, meta, chat)

    @staticmethod
    async def _next_or_abort(request: Request, job: _Job) -> _Event | None:
        """The job's next event; None when the client is gone. An error event raises its HTTP
        error; whatever is raised here aborts the job first."""
        try:
            ev = await job.next(request)
            if ev is None:                           # client gone: nobody to answer
                job.abort()
            elif ev.kind == "error":
                raise error_for(ev.payload)
            return ev
        except BaseException:
            job.abort()
            raise

    async def _collect(self, request: Request, job: _Job, meta: dict, chat: bool) -> Response:
        while job.pending:
            if await self._next_or_abort(request, job) is None:
                return Response(status_code=499)
        choices = []
        for s in sorted(job.subs, key=lambda s: s.index):
            text, reason = s.result.get("text", ""), _finish_reason(s.result)
            if chat:
                c = {"index": s.index, "logprobs": None, "finish_reason": reason,
                     "message": {"role": "assistant", "content": text}}
            else:
                c = {"index": s.index, "text": text, "logprobs": None, "finish_reason": reason}
            if job.return_token_ids:
                c["token_ids"] = list(s.result.get("token_ids", []))
                c["raypd_lifecycle"] = s.result.get("lifecycle")
            choices.append(c)
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**meta, "object": obj, "choices": choices, "usage": job.usage()},
                            headers={"X-Request-Id": meta["id"]})

    async def _stream(self, request: Request, job: _Job, meta: dict, chat: bool,
                      include_usage: bool) -> Response:
        # Wait for the first event before answering, so that a request refused before any
        # token (bad prompt, over context, no capacity) gets its real status code.
        first = await self._next_or_abort(request, job)
        if first is None:
            return Response(status_code=499)
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(choices: list) -> str:
            return "data: " + json.dumps({**meta, "object": obj, "choices": choices,
                                          **extra}) + "\n\n"

        def choice(index: int, text: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                return {"index": index, "delta": delta, "logprobs": None,
                        "finish_reason": reason}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    for s in job.subs:
                        yield chunk([choice(s.index, "", None, role=True)])
                ev: _Event | None = first
                while ev is not None:
                    if ev.kind == "delta":
                        ids = ev.payload.get("token_ids") or []
                        if ev.payload.get("text") or (job.return_token_ids and ids):
                            c = choice(ev.index, ev.payload.get("text", ""), None)
                            if job.return_token_ids:
                                c["token_ids"] = list(ids)
                            yield chunk([c])
                    elif ev.kind == "done":
                        c = choice(ev.index, None if chat else "", _finish_reason(ev.payload))
                        if job.return_token_ids:
                            c["token_ids"] = []
                            c["raypd_lifecycle"] = ev.payload.get("lifecycle")
                        yield chunk([c])
                    else:
                        err = error_for(ev.payload)
                        job.abort()
                        yield "data: " + json.dumps(error_body(err.status, err.message,
                                                               err.param, err.code)) + "\n\n"
                        break
                    ev = await job.next() if job.pending else None
                else:
                    if include_usage:
                        yield "data: " + json.dumps({**meta, "object": obj, "choices": [],
                                                     "usage": job.usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.abort()          # no-op when everything finished

        return _SSEResponse(events(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                     "X-Request-Id": meta["id"]})

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "raypd", "root": self.model_name, "parent": None}
        if self.max_model_len:
            card["max_model_len"] = self.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self) -> Response:
        loop = asyncio.get_running_loop()
        try:
            stats = await asyncio.wait_for(loop.run_in_executor(self.aux, self.backend.stats),
                                           HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"},
                                status_code=503)
        broken = [s.get("worker_id") for s in stats if s.get("loop_error")]
        if broken:
            return JSONResponse({"status": "unhealthy", "failed_workers": broken},
                                status_code=503)
        return JSONResponse({"status": "ok", "workers": len(stats),
                             "in_flight": self.inflight})

    async def render_metrics(self) -> Response:
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self.aux, self.metrics.render)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    # ---- operations: request timelines, /api/stats, /admin/scale ----
    def record(self, job: _Job, sub: _Sub, status: int, result: dict | None,
               error: str | None) -> None:
        """Keep one finished sub-request's lifecycle timeline (the last RECENT_REQUESTS)."""
        finish = time.time()
        lc = (result or {}).get("lifecycle") or {}
        n_out = len((result or {}).get("token_ids") or ())
        first = job.arrival + sub.ttft_s if sub.ttft_s is not None else None
        reason = lc.get("finish_reason") or ("abort" if status == 499 else
                                             "error" if status != 200 else "stop")
        rec = {"request_id": sub.request_id, "status": status, "finish_reason": reason,
               "arrival": job.arrival, "first_token": first, "finish": finish,
               "ttft_s": sub.ttft_s, "e2e_s": finish - job.arrival,
               "tpot_s": (finish - first) / (n_out - 1) if first is not None and n_out > 1
               else None,
               "prompt_tokens": lc.get("prompt_tokens") or 0,
               "cached_tokens": lc.get("cached_tokens") or 0, "output_tokens": n_out,
               "transfer_bytes": lc.get("transfer_bytes") or 0,
               "transfer_s": lc.get("transfer_s") or 0.0,
               "prefill_worker": lc.get("prefill_worker"),
               "decode_worker": lc.get("decode_worker"), "retries": lc.get("retries") or 0,
               "error": error[:300] if error else None}
        with self._lock:
            self.recent.append(rec)

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            by = self.http_counts.setdefault(endpoint, {})
            by[str(status)] = by.get(str(status), 0) + 1

    def snapshot(self, max_requests: int = RECENT_REQUESTS) -> dict:
        """The /api/stats document (blocking: asks every worker; run it off the event loop)."""
        b = self.backend
        orch = getattr(b, "orchestrator", None)
        info = {i["worker_id"]: i for i in list(getattr(b, "info", None) or [])}
        stats, stats_error = worker_stats(b)
        with self._lock:
            recent = list(self.recent)
            http = {k: dict(v) for k, v in self.http_counts.items()}
            in_flight, peak = self._inflight, self.peak_inflight
        draining = set(getattr(orch, "draining", ()) or ())
        unhealthy = set(getattr(orch, "unhealthy", ()) or ())
        rows = {s["worker_id"]: actor_row(s, info.get(s["worker_id"], {}))
                for s in stats if "worker_id" in s}
        info_now = {i["worker_id"] for i in list(getattr(b, "info", None) or [])}
        for wid in (info.keys() & info_now) - rows.keys():     # no answer: hung, dead, restarting
            rows[wid] = actor_row({"worker_id": wid, "role": info[wid].get("role")}, info[wid])
            unhealthy.add(wid)
        for wid, row in rows.items():
            row["state"] = "unhealthy" if wid in unhealthy or row.get("loop_error") else \
                "draining" if wid in draining else "active"
            served = [r for r in recent if wid in (r["prefill_worker"], r["decode_worker"])]
            row["requests_served"] = len(served)
            row["ttft"] = summarize([r["ttft_s"] for r in served])
            row["tpot"] = summarize([r["tpot_s"] for r in served])
        actors = sorted(rows.values(), key=actor_order)
        api = {}
        for ep in ("completions", "chat"):
            for code, n in http.get(ep, {}).items():
                api[code] = api.get(code, 0) + n
        ok = [r for r in recent if r["status"] == 200]
        router = {"policy": getattr(getattr(orch, "policy", None), "name", None),
                  "decisions": dict(getattr(orch, "decisions", {}) or {}),
                  "in_flight": in_flight, "max_inflight": self.max_inflight,
                  "peak_in_flight": peak,
                  "backend_in_flight": len(orch.in_flight()) if orch is not None else None,
                  "retries": getattr(orch, "retries", 0),
                  "live": {role: sum(a["role"] == role and a["state"] == "active"
                                     for a in actors) for role in ("prefill", "decode")},
                  "draining": sorted(draining & rows.keys()),
                  "unhealthy": sorted(unhealthy & rows.keys()),
                  "requests": api, "http": http,
                  "ttft": summarize([r["ttft_s"] for r in ok]),
                  "tpot": summarize([r["tpot_s"] for r in ok]),
                  "e2e": summarize([r["e2e_s"] for r in ok])}
        return {"now": time.time(), "model": self.model_name, "config": config_of(b),
                "actors": actors,
                "router": router, "requests": recent[-max_requests:] if max_requests else [],
                "stats_error": stats_error}

    async def api_stats(self, request: Request) -> Response:
        try:
            n = int(request.query_params.get("requests", RECENT_REQUESTS))
        except ValueError:
            raise APIError(400, "requests: must be an integer", param="requests") from None
        loop = asyncio.get_running_loop()
        doc = await asyncio.wait_for(
            loop.run_in_executor(self.aux, self.snapshot, max(0, min(n, RECENT_REQUESTS))),
            STATS_TIMEOUT_S + HEALTH_TIMEOUT_S)
        return JSONResponse(doc, headers={"Cache-Control": "no-store"})

    async def admin_status(self, request: Request) -> Response:
        self.check_auth(request)
        return await self.api_stats(request)

    async def admin_scale(self, request: Request) -> Response:
        """{"prefill": N, "decode": M, "wait": false} -> the backend's scale(); answers the
        live counts and the workers draining (removed once their requests finish)."""
        self.check_auth(request)
        body = await self.read_json(request)
        scale = getattr(self.backend, "scale", None)
        if scale is None:
            raise APIError(501, "this backend cannot scale", code="not_supported")
        unknown = sorted(set(body) - {"prefill", "decode", "wait"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown field (expected prefill, decode, wait)",
                           param=unknown[0])
        want = {}
        for role in ("prefill", "decode"):
            v = body.get(role)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise APIError(400, f"{role}: must be an integer >= 0, got {json.dumps(v)}",
                               param=role)
            want[role] = v
        if not want:
            raise APIError(400, "give prefill and/or decode: the wanted worker counts")
        wait = body.get("wait", False)
        if not isinstance(wait, bool):
            raise APIError(400, "wait: must be true or false", param="wait")
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:    # launching workers blocks (model load), and so does waiting for drains
            live = await loop.run_in_executor(None, lambda: scale(**want, wait=wait))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        orch = getattr(self.backend, "orchestrator", None)
        return JSONResponse({"live": dict(live), "requested": want,
                             "draining": sorted(getattr(orch, "draining", ()) or ()),
                             "seconds": round(time.monotonic() - t0, 3)})

    async def dashboard(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD_HTML.read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-store"})

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.aux.shutdown(wait=False, cancel_futures=True)


class _SSEResponse(StreamingResponse):
    """A stream whose generator is always closed (its `finally` aborts the request), also when
    the send fails because the client went away."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def build_app(backend: Any, model_name: str, *, api_key: str | None = None,
              max_inflight: int = 256, metrics: IngressMetrics | None = None,
              max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app serving `backend` under `model_name`. `app.state.ingress` holds the
    ingress (its `inflight` count, `metrics`, `close()`)."""
    ing = _Ingress(backend, model_name, api_key, max_inflight, metrics, max_model_len)
    app = FastAPI(title="raypd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ingress = ing

    def route(endpoint: str, handler: Callable) -> Callable:
        async def wrapped(request: Request) -> Response:
            try:
                resp = await handler(request)
            except APIError as e:
                resp = e.response()
            except Exception as e:   # noqa: BLE001 - answer in OpenAI's shape, never a bare 500
                resp = error_for(e).response()
            ing.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
            ing.count(endpoint, resp.status_code)
            return resp
        return wrapped

    app.add_api_route("/v1/completions", route("completions", ing.completions),
                      methods=["POST"])
    app.add_api_route("/v1/chat/completions", route("chat", ing.chat), methods=["POST"])
    app.add_api_route("/v1/models", route("models", ing.models), methods=["GET"])
    app.add_api_route("/health", route("health", lambda request: ing.health()),
                      methods=["GET"])
    app.add_api_route("/metrics", ing.render_metrics, methods=["GET"])
    app.add_api_route("/api/stats", route("stats", ing.api_stats), methods=["GET"])
    app.add_api_route("/dashboard", ing.dashboard, methods=["GET"])
    app.add_api_route("/admin/status", route("admin_status", ing.admin_status), methods=["GET"])
    app.add_api_route("/admin/scale", route("admin_scale", ing.admin_scale), methods=["POST"])
    add_trace_routes(app, route, ing.check_auth,  # trace hook: /v1/requests/{id}/trace, /api/traces
                     lambda: getattr(getattr(backend, "orchestrator", None), "traces", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return APIError(400, f"invalid request: {exc.errors()}").response()

    return app
