"""The operations side of the HTTP ingress: /health, /metrics, /api/stats (per-actor state,
router counters, the last finished requests' timelines), /admin/scale, the dashboard page."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ingress.backend import OperatedBackend
from ingress.core import IngressCore
from ingress.errors import IngressError
from ingress.stats import (
    STATS_TIMEOUT_S,
    IngressMetrics,
    actor_order,
    actor_row,
    summarize,
    worker_stats,
)
from protocol.messages import RequestResult
from router.kv_timeline import HIT_WINDOW_S

HEALTH_TIMEOUT_S = 10.0
RECENT_REQUESTS = 200          # finished requests kept for /api/stats and the dashboard timeline
DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")


class Operations:
    def __init__(self, core: IngressCore, metrics: IngressMetrics) -> None:
        self.core = core
        self.backend = core.backend
        self.metrics = metrics
        self.aux = ThreadPoolExecutor(max_workers=4, thread_name_prefix="raypd-http-aux")
        self._lock = threading.Lock()
        self.recent: deque[dict] = deque(maxlen=RECENT_REQUESTS)   # finished sub-requests
        self.http_counts: dict[str, dict[str, int]] = {}           # endpoint -> status -> n

    # ---- what happened ----
    def record(self, job: Any, st: Any, status: int, result: RequestResult | None,
               error: str | None) -> None:
        """Keep one finished sub-request's lifecycle timeline (the last RECENT_REQUESTS)."""
        finish = time.time()
        lc = result.lifecycle.to_dict() if result is not None and result.lifecycle else {}
        n_out = len(result.token_ids) if result is not None else 0
        first = job.arrival + st.ttft_s if st.ttft_s is not None else None
        reason = lc.get("finish_reason") or ("abort" if status == 499 else
                                             "error" if status != 200 else "stop")
        rec = {"request_id": st.sub.request_id, "client_request_id": job.client_request_id
               or None, "status": status, "finish_reason": reason,
               "arrival": job.arrival, "first_token": first, "finish": finish,
               "ttft_s": st.ttft_s, "e2e_s": finish - job.arrival,
               "tpot_s": (finish - first) / (n_out - 1) if first is not None and n_out > 1
               else None,
               "prompt_tokens": lc.get("prompt_tokens") or 0,
               "cached_tokens": lc.get("cached_tokens") or 0, "output_tokens": n_out,
               "transfer_bytes": lc.get("transfer_bytes") or 0,
               "transfer_s": lc.get("transfer_s") or 0.0,
               "prefill_worker": lc.get("prefill_worker"),
               "decode_worker": lc.get("decode_worker"), "retries": lc.get("retries") or 0,
               "error": error[:300] if error else None}
        if status == 200:
            self.metrics.observe(lc, st.ttft_s, time.perf_counter() - job.started, n_out)
        with self._lock:
            self.recent.append(rec)

    def count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        with self._lock:
            by = self.http_counts.setdefault(endpoint, {})
            by[str(status)] = by.get(str(status), 0) + 1

    # ---- health and metrics ----
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
                             "in_flight": self.core.inflight})

    async def render_metrics(self) -> Response:
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self.aux, self.metrics.render)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    # ---- /api/stats ----
    def snapshot(self, max_requests: int = RECENT_REQUESTS) -> dict:
        """The /api/stats document (blocking: asks every worker; run it off the event loop)."""
        b = self.backend
        operated = isinstance(b, OperatedBackend)
        view = b.router_view() if operated else None
        info = {i["worker_id"]: i for i in list(b.info if operated else [])}
        stats, stats_error = worker_stats(b)
        with self._lock:
            recent = list(self.recent)
            http = {k: dict(v) for k, v in self.http_counts.items()}
        in_flight, peak = self.core.inflight, self.core.peak_inflight
        draining = set(view.draining if view else ())
        unhealthy = set(view.unhealthy if view else ())
        rows = {s["worker_id"]: actor_row(s, info.get(s["worker_id"], {}))
                for s in stats if "worker_id" in s}
        info_now = {i["worker_id"] for i in list(b.info if operated else [])}
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
        api: dict[str, int] = {}
        for ep in ("completions", "chat"):
            for code, n in http.get(ep, {}).items():
                api[code] = api.get(code, 0) + n
        ok = [r for r in recent if r["status"] == 200]
        router = {"policy": view.policy if view else None,
                  "decisions": dict(view.decisions) if view else {},
                  "in_flight": in_flight, "max_inflight": self.core.max_inflight,
                  "peak_in_flight": peak,
                  "backend_in_flight": view.in_flight if view else None,
                  "retries": view.retries if view else 0,
                  "migrations": dict(view.migrations) if view else {},
                  "autoscale": view.autoscale if view else None,
                  "live": {role: sum(a["role"] == role and a["state"] == "active"
                                     for a in actors) for role in ("prefill", "decode")},
                  "draining": sorted(draining & rows.keys()),
                  "unhealthy": sorted(unhealthy & rows.keys()),
                  "requests": api, "http": http,
                  "ttft": summarize([r["ttft_s"] for r in ok]),
                  "tpot": summarize([r["tpot_s"] for r in ok]),
                  "e2e": summarize([r["e2e_s"] for r in ok])}
        return {"now": time.time(), "model": self.core.model_name,
                "config": b.report_params() if operated else {},
                "actors": actors,
                "router": router, "requests": recent[-max_requests:] if max_requests else [],
                "stats_error": stats_error}

    async def api_stats(self, query: dict) -> Response:
        try:
            n = int(query.get("requests", RECENT_REQUESTS))
        except ValueError:
            raise IngressError(400, "requests: must be an integer", param="requests") from None
        loop = asyncio.get_running_loop()
        doc = await asyncio.wait_for(
            loop.run_in_executor(self.aux, self.snapshot, max(0, min(n, RECENT_REQUESTS))),
            STATS_TIMEOUT_S + HEALTH_TIMEOUT_S)
        return JSONResponse(doc, headers={"Cache-Control": "no-store"})

    # ---- /api/kv_timeline ----
    async def api_kv_timeline(self, query: dict) -> Response:
        """The router's KV timeline (router/kv_timeline.py): ?since=UNIX_S (samples from then),
        ?max_points=N (2..5000, default 600 per worker), ?window_s=S (the hit-rate window)."""
        if not isinstance(self.backend, OperatedBackend):
            raise IngressError(501, "this backend keeps no KV timeline", code="not_supported")
        unknown = sorted(set(query) - {"since", "max_points", "window_s"})
        if unknown:
            raise IngressError(400, f"{unknown[0]}: unknown parameter (expected since, "
                               "max_points, window_s)", param=unknown[0])
        since = _number(query, "since", float, None, 0.0, math.inf)
        max_points = _number(query, "max_points", int, TIMELINE_MAX_POINTS, 2, 5000)
        window_s = _number(query, "window_s", float, HIT_WINDOW_S, 1e-3, 86400.0)
        doc = self.backend.kv_timeline(since=since, max_points=max_points, window_s=window_s)
        return JSONResponse({"now": time.time(), **doc}, headers={"Cache-Control": "no-store"})

    # ---- /admin/scale ----
    async def admin_scale(self, body: dict, max_workers: int) -> Response:
        """{"prefill": N, "decode": M, "wait": false} -> the backend's scale(); answers the
        live counts and the workers draining (removed once their requests finish)."""
        if not isinstance(self.backend, OperatedBackend):
            raise IngressError(501, "this backend cannot scale", code="not_supported")
        scale = self.backend.scale
        unknown = sorted(set(body) - {"prefill", "decode", "wait"})
        if unknown:
            raise IngressError(400, f"{unknown[0]}: unknown field (expected prefill, decode, "
                               f"wait)", param=unknown[0])
        want = {}
        for role in ("prefill", "decode"):
            v = body.get(role)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= max_workers:
                raise IngressError(400, f"{role}: must be an integer in [0, {max_workers}] "
                                   f"(server.limits.max_scale_workers), got {json.dumps(v)}",
                                   param=role)
            want[role] = v
        if not want:
            raise IngressError(400, "give prefill and/or decode: the wanted worker counts")
        wait = body.get("wait", False)
        if not isinstance(wait, bool):
            raise IngressError(400, "wait: must be true or false", param="wait")
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:    # launching workers blocks (model load), and so does waiting for drains
            live = await loop.run_in_executor(None, lambda: scale(**want, wait=wait))
        except ValueError as e:
            raise IngressError(400, str(e)) from None
        return JSONResponse({"live": dict(live), "requested": want,
                             "draining": sorted(self.backend.router_view().draining),
                             "seconds": round(time.monotonic() - t0, 3)})

    # ---- /admin/migrate ----
    async def admin_migrate(self, body: dict) -> Response:
        """{"request_id": ID, "to": WORKER (optional)} -> the request's running decode moves
        to that decode worker (or the policy's pick) with its KV; 409 when it is not decoding
        now (queued, prefilling, ended) or already moving, 404 when not in flight."""
        if not isinstance(self.backend, OperatedBackend):
            raise IngressError(501, "this backend cannot migrate", code="not_supported")
        unknown = sorted(set(body) - {"request_id", "to"})
        if unknown:
            raise IngressError(400, f"{unknown[0]}: unknown field (expected request_id, to)",
                               param=unknown[0])
        rid, to = body.get("request_id"), body.get("to")
        if not isinstance(rid, str) or not rid:
            raise IngressError(400, "request_id: must be a request id string", param="request_id")
        if to is not None and not isinstance(to, str):
            raise IngressError(400, "to: must be a worker id string", param="to")
        loop = asyncio.get_running_loop()
        try:
            asked = await loop.run_in_executor(None, lambda: self.backend.migrate(rid, to))
        except LookupError as e:
            raise IngressError(404, str(e), param="request_id", code="not_found") from None
        except ValueError as e:
            raise IngressError(400, str(e), param="to") from None
        if not asked:
            raise IngressError(409, f"request {rid!r} is not on a decode worker now, or is "
                               "already moving", code="conflict")
        return JSONResponse({"request_id": rid, "to": to, "asked": True})

    async def dashboard(self) -> Response:
        return HTMLResponse(DASHBOARD_HTML.read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-store"})

    def close(self) -> None:
        self.aux.shutdown(wait=False, cancel_futures=True)


TIMELINE_MAX_POINTS = 600       # per worker, what the dashboard draws


def _number(query: dict, name: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    """Query parameter `name` as int or float in [lo, hi], else a 400 naming it."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        v = kind(raw)
    except ValueError:
        v = None
    if v is None or not (lo <= v <= hi):   # NaN fails both comparisons
        raise IngressError(400, f"{name}: must be a{'n integer' if kind is int else ' number'}"
                           f" in [{lo:g}, {hi:g}], got {raw!r}", param=name)
    return v
