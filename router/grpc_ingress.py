"""gRPC ingress (router/raypd.proto): `Generate` streams one request's tokens, `SubmitTrace` runs a
stream of requests concurrently and streams their results back as they finish.

Torch-free: the backend (a PDCluster, or anything with `run_request(prompt, sampling, *, chat,
tenant, lora_id, request_id, on_delta)` and `abort(request_id)`) is passed in. Status codes:
invalid request -> INVALID_ARGUMENT, unknown model -> NOT_FOUND, no capacity / SLO ->
RESOURCE_EXHAUSTED (trailing metadata `retry-after`), failed KV transfer -> UNAVAILABLE.
A client that cancels (or disconnects) aborts its requests: their blocks are released.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent import futures
from typing import Any, NamedTuple

import grpc

from kvcache.sampling import RequestError, SamplingParams
from router import raypd_pb2 as pb
from router import raypd_pb2_grpc as pb_grpc
from router.orchestrator import TransferFailed
from router.policies import RoutingRejected

CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 64


class Rejected(Exception):
    """A request ended with a gRPC status (code, message, retry_after_s)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class Parsed(NamedTuple):
    prompt: Any                  # str | list[int] | list[dict] (chat messages)
    sampling: SamplingParams
    chat: bool
    tenant: str
    lora_id: str
    request_id: str


def parse_request(req: pb.GenerateRequest, model_name: str) -> Parsed:
    """Validate a GenerateRequest the way the HTTP ingress does; raises Rejected."""
    if req.model and req.model != model_name:
        raise Rejected(grpc.StatusCode.NOT_FOUND,
                       f"model {req.model!r} is not served here (serving {model_name!r})")
    given = [n for n, v in (("prompt", req.prompt), ("prompt_token_ids", req.prompt_token_ids),
                            ("messages", req.messages)) if len(v)]
    if len(given) != 1:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       "give exactly one of prompt, prompt_token_ids, messages"
                       + (f" (got {', '.join(given)})" if given else ""))
    chat = bool(req.messages)
    if req.prompt:
        prompt: Any = req.prompt
    elif req.prompt_token_ids:
        prompt = list(req.prompt_token_ids)
    else:
        prompt = []
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                               f"got {m.role!r}")
            prompt.append({"role": m.role, "content": m.content})
    s = req.sampling
    sampling = SamplingParams(
        max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens)
    try:
        sampling.validate()
    except ValueError as e:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    return Parsed(prompt, sampling, chat, req.tenant, req.lora_id,
                  req.request_id or f"grpc-{uuid.uuid4().hex[:12]}")


def as_rejected(e: BaseException) -> Rejected:
    """The gRPC status for an exception out of `backend.run_request`."""
    if isinstance(e, Rejected):
        return e
    if isinstance(e, RequestError):
        return Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, RoutingRejected):
        return Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                        float(getattr(e, "retry_after_s", 0) or 0))
    if isinstance(e, TransferFailed):
        return Rejected(grpc.StatusCode.UNAVAILABLE, str(e))
    return Rejected(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def lifecycle_pb(lc: dict | None) -> pb.Lifecycle:
    fields = pb.Lifecycle.DESCRIPTOR.fields_by_name
    return pb.Lifecycle(**{k: v for k, v in (lc or {}).items() if k in fields and v is not None})


def usage_pb(result: dict) -> pb.Usage:
    lc = result.get("lifecycle") or {}
    return pb.Usage(prompt_tokens=lc.get("prompt_tokens", 0),
                    completion_tokens=len(result.get("token_ids", ())),
                    cached_tokens=lc.get("cached_tokens", 0))


class RaypdServicer(pb_grpc.RaypdServicer):
    def __init__(self, backend: Any, model_name: str, max_in_flight: int = 256) -> None:
        self.backend, self.model_name = backend, model_name
        self._pool = futures.ThreadPoolExecutor(max_workers=max_in_flight,
                                                thread_name_prefix="raypd-grpc-req")

    def _run(self, p: Parsed, on_delta=None) -> dict:
        return self.backend.run_request(p.prompt, p.sampling, chat=p.chat, tenant=p.tenant,
                                        lora_id=p.lora_id, request_id=p.request_id,
                                        on_delta=on_delta)

    def _abort(self, request_id: str) -> None:
        try:
            self.backend.abort(request_id)
        except Exception:   # the request already ended, or the backend is going away
            pass

    @staticmethod
    def _fail(context: grpc.ServicerContext, r: Rejected) -> None:
        if r.retry_after_s:
            context.set_trailing_metadata((("retry-after", f"{r.retry_after_s:g}"),))
        context.abort(r.code, r.message)

    def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            p = parse_request(request, self.model_name)
        except Rejected as r:
            self._fail(context, r)
        deltas: queue.Queue = queue.Queue()
        done = object()

        def work() -> None:
            try:
                deltas.put((done, self._run(p, on_delta=deltas.put)))
            except BaseException as e:  # noqa: BLE001 - handed to the stream below
                deltas.put((done, e))

        context.add_callback(lambda: self._abort(p.request_id))  # no-op once finished
        self._pool.submit(work)
        while True:
            item = deltas.get()
            if isinstance(item, tuple) and item[0] is done:
                outcome = item[1]
                if isinstance(outcome, BaseException):
                    self._fail(context, as_rejected(outcome))
                lc = outcome.get("lifecycle") or {}
                yield pb.GenerateChunk(finish_reason=lc.get("finish_reason") or "",
                                       usage=usage_pb(outcome), lifecycle=lifecycle_pb(lc),
                                       request_id=p.request_id)
                return
            if item.get("token_ids") or item.get("text"):
                yield pb.GenerateChunk(token_ids=item.get("token_ids", ()),
                                       text=item.get("text", ""), request_id=p.request_id)

    def SubmitTrace(self, request_iterator, context):  # noqa: N802
        results: queue.Queue = queue.Queue()
        in_flight: set[str] = set()
        lock = threading.Lock()
        eof = object()

        def run_one(tr: pb.TraceRequest, t0: float) -> None:
            rid = None
            try:
                p = parse_request(tr.request, self.model_name)
                rid = p.request_id
                with lock:
                    in_flight.add(rid)
                res = self._run(p)
                lc = res.get("lifecycle") or {}
                out = pb.TraceResult(id=tr.id, ok=True, token_ids=res.get("token_ids", ()),
                                     text=res.get("text", ""),
                                     finish_reason=lc.get("finish_reason") or "",
                                     usage=usage_pb(res), lifecycle=lifecycle_pb(lc))
            except BaseException as e:  # noqa: BLE001 - every request ends as one result
                r = as_rejected(e)
                out = pb.TraceResult(id=tr.id, ok=False, error_code=r.code.name,
                                     error=r.message, retry_after_s=r.retry_after_s)
            finally:
                if rid is not None:
                    with lock:
                        in_flight.discard(rid)
            out.server_e2e_s = time.monotonic() - t0
            results.put(out)

        def read() -> None:
            n = 0
            try:
                for tr in request_iterator:
                    self._pool.submit(run_one, tr, time.monotonic())
                    n += 1
            except Exception:   # the client went away; the callback below aborts the rest
                pass
            results.put((eof, n))

        def abort_all() -> None:
            with lock:
                ids = list(in_flight)
            for rid in ids:
                self._abort(rid)

        context.add_callback(abort_all)
        threading.Thread(target=read, daemon=True, name="raypd-grpc-trace-reader").start()
        sent, total = 0, None
        while total is None or sent < total:
            item = results.get()
            if isinstance(item, tuple) and item[0] is eof:
                total = item[1]
                continue
            sent += 1
            yield item

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrpcServer:
    """A started ingress server: `.port`, `.address`, `.stop()`."""

    def __init__(self, server: grpc.Server, servicer: RaypdServicer, host: str, port: int):
        self.server, self.servicer, self.host, self.port = server, servicer, host, port
        self.address = f"{host}:{port}"

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        self.servicer.close()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_grpc_server(backend: Any, host: str = "127.0.0.1", port: int = 0,
                      model_name: str = "raypd", max_in_flight: int = 256) -> GrpcServer:
    """Serve `backend` on host:port (0: any free port) in background threads."""
    servicer = RaypdServicer(backend, model_name, max_in_flight)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64,
                                                    thread_name_prefix="raypd-grpc"),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_RaypdServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind the gRPC ingress to {host}:{port}")
    server.start()
    return GrpcServer(server, servicer, host, bound)
