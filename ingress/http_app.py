"""The OpenAI-compatible HTTP app (FastAPI) over any backend with PDCluster's request methods.

    app = build_app(cluster, IngressSettings(model_name="smollm2"))

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), GET /v1/models
(scope inference); GET /api/stats, GET /api/kv_timeline, GET /admin/status, POST /admin/scale,
POST /admin/migrate
(scope admin: a JSON body, bounded counts), GET /metrics (admin when `protect_metrics`),
GET /health, GET /dashboard. The body is read here within `server.limits` (413 / 408 / 400), parsed by
openai_protocol.py, run by http_jobs.py and answered by http_answers.py.

The backend is typed by ingress/backend.py (`Backend`: run_request, abort, stats; the
operations routes use `OperatedBackend`'s router_view, scale, report_params, request_traces,
kv_timeline); this package never imports cluster/ or workers/, so no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ingress import http_answers
from ingress.auth import Principal
from ingress.backend import Backend, OperatedBackend
from ingress.body import read_body
from ingress.core import GenerationRequest, IngressCore, IngressSettings
from ingress.errors import IngressError
from ingress.http_answers import error_response
from ingress.http_jobs import RequestJob, SubState
from ingress.jsonbody import parse_json_object
from ingress.openai_protocol import chat_request, completion_request
from ingress.operations import Operations
from ingress.stats import IngressMetrics
from ingress.trace_routes import add_trace_routes


class HttpIngress:
    """The app's state: the shared core, metrics, operations. A request is a task on the
    serving loop, never a thread."""

    def __init__(self, backend: Backend, settings: IngressSettings,
                 metrics: IngressMetrics | None, core: IngressCore | None = None) -> None:
        self.core = core or IngressCore(backend, settings)
        self.settings = settings
        self.metrics = metrics or IngressMetrics(backend)
        self.core.on_inflight = self.metrics.inflight.set
        self.ops = Operations(self.core, self.metrics)
        self.created = int(time.time())

    @property
    def inflight(self) -> int:
        return self.core.inflight

    @property
    def peak_inflight(self) -> int:
        return self.core.peak_inflight

    def authorize(self, request: Request, scope: str) -> Principal:
        return self.core.authorize(request.headers.get("authorization"), scope,
                                   request.client.host if request.client else None)

    async def read_json(self, request: Request) -> dict:
        lim = self.settings.limits
        raw = await read_body(request, lim.max_body_bytes, lim.body_timeout_s)
        return parse_json_object(raw, lim)

    # ---- inference ----
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request, "cmpl", chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat_request, "chatcmpl", chat=True)

    async def _generate(self, request: Request, parse: Callable, prefix: str, *,
                        chat: bool) -> Response:
        principal = self.authorize(request, "inference")
        raw = await self.read_json(request)
        body, req = parse(raw, self.settings.request_limits, self.settings.model)
        self.core.check_model(body.model)
        req.lora = self.core.lora_of(body.model, req.lora)
        req.model = body.model or ""
        req.tenant = self.core.tenant(principal, req.tenant)
        client_id = request.headers.get("x-request-id", "")[:128]
        req.client_request_id = f"{principal.key_id}/{client_id}" if client_id else ""
        return await self._serve(request, req, prefix, chat)

    async def _serve(self, request: Request, req: GenerationRequest, prefix: str,
                     chat: bool) -> Response:
        base, subs = self.core.sub_requests(req, prefix)
        self.core.acquire(len(subs))

        def on_finish(job: RequestJob, st: SubState, status: int, result: dict | None,
                      error: str | None) -> None:
            try:
                self.ops.record(job, st, status, result, error)
            finally:
                self.core.release(1)

        job = RequestJob(self.core, [SubState(s) for s in subs], req.tenant,
                         req.lora, self.settings.limits.stream_queue_events, on_finish,
                         return_token_ids=req.return_token_ids,
                         client_request_id=req.client_request_id)
        try:
            job.start()
        except BaseException:
            self.core.release(len(subs))
            raise
        meta = {"id": base, "created": int(time.time()), "model": req.model or self.core.model_name}
        if req.stream:
            return await http_answers.stream(request, job, meta, chat, req.include_usage,
                                             self.settings.limits.write_timeout_s)
        return await http_answers.collect(request, job, meta, chat)

    async def models(self, request: Request) -> Response:
        self.authorize(request, "inference")
        name = self.core.model_name
        card = {"id": name, "object": "model", "created": self.created,
                "owned_by": "raypd", "root": name, "parent": None}
        if self.settings.model.max_model_len:
            card["max_model_len"] = self.settings.model.max_model_len
        adapters = [{**card, "id": lora, "root": lora, "parent": name}
                    for lora in self.settings.lora_names]   # vLLM's --lora-modules cards
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    # ---- operations ----
    async def api_stats(self, request: Request) -> Response:
        self.authorize(request, "admin")
        return await self.ops.api_stats(dict(request.query_params))

    async def api_kv_timeline(self, request: Request) -> Response:
        self.authorize(request, "admin")
        return await self.ops.api_kv_timeline(dict(request.query_params))

    async def admin_body(self, request: Request) -> dict:
        """An admin route's JSON body (admin scope, application/json)."""
        self.authorize(request, "admin")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise IngressError(415, f"Content-Type: must be application/json, got "
                               f"{ctype or 'none'}", code="unsupported_media_type")
        return await self.read_json(request)

    async def admin_scale(self, request: Request) -> Response:
        return await self.ops.admin_scale(await self.admin_body(request),
                                          self.settings.limits.max_scale_workers)

    async def admin_migrate(self, request: Request) -> Response:
        return await self.ops.admin_migrate(await self.admin_body(request))

    async def render_metrics(self, request: Request) -> Response:
        if self.settings.protect_metrics:
            self.authorize(request, "admin")
        return await self.ops.render_metrics()

    def close(self) -> None:
        self.ops.close()


def build_app(backend: Backend, settings: IngressSettings, *,
              metrics: IngressMetrics | None = None, core: IngressCore | None = None) -> FastAPI:
    """The FastAPI app serving `backend`. `app.state.ingress` holds the HttpIngress (its
    `inflight` count, `metrics`, `close()`); pass the gRPC server's `core` to share capacity."""
    ing = HttpIngress(backend, settings, metrics, core)
    app = FastAPI(title="raypd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ingress = ing

    def route(endpoint: str, handler: Callable) -> Callable:
        async def wrapped(request: Request) -> Response:
            try:
                resp = await handler(request)
            except Exception as e:   # noqa: BLE001 - answer in OpenAI's shape, never a bare 500
                resp = error_response(e)
            ing.ops.count(endpoint, resp.status_code)
            return resp
        return wrapped

    app.add_api_route("/v1/completions", route("completions", ing.completions),
                      methods=["POST"])
    app.add_api_route("/v1/chat/completions", route("chat", ing.chat), methods=["POST"])
    app.add_api_route("/v1/models", route("models", ing.models), methods=["GET"])
    app.add_api_route("/health", route("health", lambda request: ing.ops.health()),
                      methods=["GET"])
    app.add_api_route("/metrics", route("metrics", ing.render_metrics), methods=["GET"])
    app.add_api_route("/api/stats", route("stats", ing.api_stats), methods=["GET"])
    app.add_api_route("/api/kv_timeline", route("kv_timeline", ing.api_kv_timeline),
                      methods=["GET"])
    async def dashboard() -> Response:
        return await ing.ops.dashboard()

    app.add_api_route("/dashboard", dashboard, methods=["GET"])
    app.add_api_route("/admin/status", route("admin_status", ing.api_stats), methods=["GET"])
    app.add_api_route("/admin/scale", route("admin_scale", ing.admin_scale), methods=["POST"])
    app.add_api_route("/admin/migrate", route("admin_migrate", ing.admin_migrate),
                      methods=["POST"])
    add_trace_routes(app, route, ing.authorize,   # /v1/requests/{id}/trace, /api/traces
                     lambda: backend.request_traces()
                     if isinstance(backend, OperatedBackend) else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(IngressError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(IngressError(400, f"invalid request: {exc.errors()}"))

    return app
