"""HTTP routes of the handoff traces, added to the ingress app by one call:

    add_trace_routes(app, route, authorize, lambda: backend.request_traces())

GET /v1/requests/{request_id}/trace   one request's RequestTrace (scope inference, like the
                                      request itself; 404 when the router no longer keeps it:
                                      the last N only)
GET /api/traces?requests=K            the stage breakdown (p50/p99 per stage) over the finished
                                      requests kept, and the last K traces' summaries (scope
                                      admin, like /api/stats: the dashboard sends its key)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ingress.errors import IngressError
from router.request_traces import TraceStore, stage_breakdown

MAX_RECENT = 200


def add_trace_routes(app: FastAPI, route: Callable[[str, Callable], Callable],
                     authorize: Callable[[Request, str], Any],
                     get_store: Callable[[], TraceStore | None]) -> None:
    """`route(endpoint, handler)` is the ingress's wrapper (error shape, request counting)."""

    def store() -> TraceStore:
        s = get_store()
        if s is None:
            raise IngressError(404, "this backend keeps no request traces")
        return s

    async def request_trace(request: Request) -> Response:
        authorize(request, "inference")
        rid = request.path_params["request_id"]
        t = store().get(rid)
        if t is None:
            raise IngressError(404, f"no trace of request {rid!r}: unknown, or older than the "
                           f"last {store().capacity} requests", param="request_id")
        return JSONResponse(t.to_dict(), headers={"Cache-Control": "no-store"})

    async def traces(request: Request) -> Response:
        authorize(request, "admin")
        try:
            k = int(request.query_params.get("requests", 20))
        except ValueError:
            raise IngressError(400, "requests: must be an integer", param="requests") from None
        s = store()
        done = s.recent()
        recent = [_summary(t) for t in done[-max(0, min(k, MAX_RECENT)):]] if k > 0 else []
        return JSONResponse({"requests": len(done), "capacity": s.capacity,
                             "breakdown": stage_breakdown(done), "recent": recent},
                            headers={"Cache-Control": "no-store"})

    app.add_api_route("/v1/requests/{request_id}/trace", route("trace", request_trace),
                      methods=["GET"])
    app.add_api_route("/api/traces", route("traces", traces), methods=["GET"])


def _summary(t: Any) -> dict:
    return {"request_id": t.request_id, "status": t.status, "arrival": t.arrival,
            "ttft_s": t.ttft_s, "e2e_s": t.e2e_s, "prefill_worker": t.prefill_worker,
            "decode_worker": t.decode_worker, "stage_seconds": t.stage_seconds()}
