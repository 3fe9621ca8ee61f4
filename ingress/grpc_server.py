"""gRPC ingress (ingress/raypd.proto): `Generate` streams one request's tokens, `SubmitTrace` runs a
stream of requests concurrently and streams their results back as they finish.

Shares the HTTP ingress's core: the same checks and defaults (ingress.request_checks), keys
(metadata `authorization: Bearer KEY`, scope inference) and tenants, server-assigned request ids
(a client's `request_id` is only echoed as a label, scoped to its key), capacity, and the one
error map (ingress.errors: its `grpc_code`; RESOURCE_EXHAUSTED carries trailing metadata
`retry-after`). A client that cancels (or disconnects) aborts its requests: blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from ingress import raypd_pb2 as pb
from ingress import raypd_pb2_grpc as pb_grpc
from ingress.auth import Principal
from ingress.backend import Backend
from ingress.core import GenerationRequest, IngressCore, IngressSettings, SubRequest
from ingress.errors import IngressError, classify
from ingress.request_checks import (
    check_label,
    check_messages,
    check_prompts,
    make_sampling,
)
from protocol.errors import RequestError
from protocol.lifecycle import RequestLifecycle
from protocol.messages import RequestResult
from router.event_loop import RouterLoop


def parse_request(req: pb.GenerateRequest, core: IngressCore) -> GenerationRequest:
    """Validate a GenerateRequest with the HTTP ingress's rules; raises IngressError."""
    core.check_model(req.model or None)
    given = [n for n, v in (("prompt", req.prompt), ("prompt_token_ids", req.prompt_token_ids),
                            ("messages", req.messages)) if len(v)]
    if len(given) != 1:
        raise IngressError(400, "give exactly one of prompt, prompt_token_ids, messages"
                           + (f" (got {', '.join(given)})" if given else ""))
    lim, model = core.settings.request_limits, core.settings.model
    chat = bool(req.messages)
    s = req.sampling
    try:
        if chat:
            prompt: Any = check_messages([{"role": m.role, "content": m.content}
                                          for m in req.messages], lim)
        else:
            prompt = req.prompt if req.prompt else list(req.prompt_token_ids)
            check_prompts([prompt], lim, model)
        sampling = make_sampling(
            chat=chat, limits=lim, model=model, max_tokens=s.max_tokens or None,
            temperature=s.temperature if s.HasField("temperature") else None,
            top_p=s.top_p if s.HasField("top_p") else None, top_k=s.top_k or None,
            seed=s.seed if s.HasField("seed") else None, stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens)
        tenant = check_label("tenant", req.tenant, lim)
        lora = check_label("lora_id", req.lora_id, lim)
        client_id = check_label("request_id", req.request_id, lim)
    except RequestError as e:
        raise IngressError(400, str(e).replace("invalid sampling parameter ", "")) from None
    return GenerationRequest([prompt], sampling, chat, tenant=tenant,
                             lora=core.lora_of(req.model or None, lora),
                             client_request_id=client_id, model=req.model)


def lifecycle_pb(lc: RequestLifecycle | None) -> pb.Lifecycle:
    fields = pb.Lifecycle.DESCRIPTOR.fields_by_name
    items = lc.to_dict().items() if lc is not None else ()
    return pb.Lifecycle(**{k: v for k, v in items if k in fields and v is not None})


def usage_pb(result: RequestResult) -> pb.Usage:
    lc = result.lifecycle or RequestLifecycle()
    return pb.Usage(prompt_tokens=lc.prompt_tokens, completion_tokens=len(result.token_ids),
                    cached_tokens=lc.cached_tokens)


class RaypdServicer(pb_grpc.RaypdServicer):
    """The servicer, on grpc.aio: every call is a coroutine on the serving loop (the router's
    when the backend has one), a request a task, never a thread."""

    def __init__(self, core: IngressCore) -> None:
        self.core = core

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        return self.core.authorize(md.get("authorization"), "inference")

    def _admit(self, req: pb.GenerateRequest, principal: Principal) -> tuple[GenerationRequest,
                                                                             SubRequest]:
        g = parse_request(req, self.core)
        g.tenant = self.core.tenant(principal, g.tenant)
        if g.client_request_id:          # a label only, scoped to the key
            g.client_request_id = f"{principal.key_id}/{g.client_request_id}"
        _, (sub,) = self.core.sub_requests(g, "grpc")
        self.core.acquire(1)
        return g, sub

    async def _run(self, g: GenerationRequest, sub: SubRequest, on_delta=None) -> RequestResult:
        try:
            return await self.core.run(sub, g.tenant, g.lora, on_delta)
        finally:
            self.core.release(1)

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, e: IngressError) -> None:
        if e.retry_after_s:
            context.set_trailing_metadata((("retry-after", f"{e.retry_after_s:g}"),))
        await context.abort(grpc.StatusCode[e.grpc_code], e.message)

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            g, sub = self._admit(request, self._principal(context))
        except Exception as e:   # noqa: BLE001 - every refusal leaves as a status
            await self._fail(context, classify(e))
        deltas: asyncio.Queue = asyncio.Queue()
        done = object()

        async def work() -> None:
            try:
                deltas.put_nowait((done, await self._run(g, sub, on_delta=deltas.put_nowait)))
            except BaseException as e:  # noqa: BLE001 - handed to the stream below
                deltas.put_nowait((done, e))

        task = asyncio.ensure_future(work())
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, tuple) and item[0] is done:
                    outcome = item[1]
                    if isinstance(outcome, BaseException):
                        await self._fail(context, classify(outcome))
                    lc = outcome.lifecycle
                    yield pb.GenerateChunk(finish_reason=(lc.finish_reason if lc else None) or "",
                                           usage=usage_pb(outcome), lifecycle=lifecycle_pb(lc),
                                           request_id=sub.request_id)
                    return
                if item.token_ids or item.text:
                    yield pb.GenerateChunk(token_ids=item.token_ids, text=item.text,
                                           request_id=sub.request_id)
        finally:
            if not task.done():          # the client cancelled or went away: blocks freed
                self.core.abort(sub.request_id)

    async def SubmitTrace(self, request_iterator, context):  # noqa: N802
        try:
            principal = self._principal(context)
        except IngressError as e:
            await self._fail(context, e)
        results: asyncio.Queue = asyncio.Queue()
        in_flight: set[str] = set()
        eof = object()

        async def run_one(tr: pb.TraceRequest, t0: float) -> None:
            rid = None
            try:
                g, sub = self._admit(tr.request, principal)
                rid = sub.request_id
                in_flight.add(rid)
                res = await self._run(g, sub)
                lc = res.lifecycle
                out = pb.TraceResult(id=tr.id, ok=True, token_ids=res.token_ids, text=res.text,
                                     finish_reason=(lc.finish_reason if lc else None) or "",
                                     usage=usage_pb(res), lifecycle=lifecycle_pb(lc))
            except BaseException as e:  # noqa: BLE001 - every request ends as one result
                err = classify(e)
                out = pb.TraceResult(id=tr.id, ok=False, error_code=err.grpc_code,
                                     error=err.message, retry_after_s=err.retry_after_s)
            finally:
                if rid is not None:
                    in_flight.discard(rid)
            out.server_e2e_s = time.monotonic() - t0
            results.put_nowait(out)

        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            n = 0
            try:
                async for tr in request_iterator:
                    t = asyncio.ensure_future(run_one(tr, time.monotonic()))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    n += 1
            except Exception:   # noqa: BLE001 - the client went away; the rest are aborted
                pass
            results.put_nowait((eof, n))

        reader = asyncio.ensure_future(read())
        sent, total = 0, None
        try:
            while total is None or sent < total:
                item = await results.get()
                if isinstance(item, tuple) and item[0] is eof:
                    total = item[1]
                    continue
                sent += 1
                yield item
        finally:
            reader.cancel()
            for rid in list(in_flight):      # the client cancelled: free what is left
                self.core.abort(rid)


class GrpcServer:
    """A started ingress server: `.port`, `.address`, `.stop()`."""

    def __init__(self, server: grpc.aio.Server, servicer: RaypdServicer, loop: RouterLoop,
                 owns_loop: bool, host: str, port: int):
        self.server, self.servicer, self.host, self.port = server, servicer, host, port
        self._loop, self._owns_loop = loop, owns_loop
        self.address = f"{host}:{port}"

    def stop(self, grace: float | None = 1.0) -> None:
        self._loop.run(self.server.stop(grace))
        if self._owns_loop:
            self._loop.close()

    def wait(self) -> None:
        self._loop.run(self.server.wait_for_termination())


def start_grpc_server(backend: Backend, host: str = "127.0.0.1", port: int = 0,
                      settings: IngressSettings | None = None,
                      core: IngressCore | None = None) -> GrpcServer:
    """Serve `backend` on host:port (0: any free port) on the backend's loop (a loop of its
    own for a backend without one); `core` shares capacity with the HTTP app."""
    core = core or IngressCore(backend, settings or IngressSettings())
    lim = core.settings.limits
    servicer = RaypdServicer(core)
    loop = getattr(backend, "loop", None)
    owns_loop = not isinstance(loop, RouterLoop)
    if owns_loop:
        loop = RouterLoop()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(
            maximum_concurrent_rpcs=lim.max_connections,
            options=[("grpc.max_receive_message_length", lim.max_body_bytes),
                     ("grpc.max_send_message_length", 64 << 20)])
        pb_grpc.add_RaypdServicer_to_server(servicer, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise OSError(f"cannot bind the gRPC ingress to {host}:{port}")
        await server.start()
        return server, bound
    try:
        server, bound = loop.run(start())
    except BaseException:
        if owns_loop:
            loop.close()
        raise
    return GrpcServer(server, servicer, loop, owns_loop, host, bound)
