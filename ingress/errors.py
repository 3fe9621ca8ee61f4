"""The one error map: any exception out of parsing or `backend.run_request` becomes an
IngressError (HTTP status, OpenAI error object, gRPC status code, Retry-After).

    400 bad request (the message names the field)     gRPC INVALID_ARGUMENT
    401 missing or unknown API key                     UNAUTHENTICATED
    403 key lacks the scope, or claims another tenant  PERMISSION_DENIED
    404 unknown model / route                          NOT_FOUND
    408 body not read in time                          DEADLINE_EXCEEDED
    413 body too large                                 RESOURCE_EXHAUSTED
    415 admin route without a JSON body                INVALID_ARGUMENT
    429 over capacity, SLO unmeetable, rate limited    RESOURCE_EXHAUSTED (+ retry-after)
    499 the client went away                           CANCELLED
    500 engine step failed, internal error             INTERNAL
    503 KV transfer or worker failed                   UNAVAILABLE
"""

from __future__ import annotations

import math

import ray

from kvcache.sampling import RequestError, StepFailed, UnknownLoRAError
from router.orchestrator import TransferFailed, WorkerFailed
from router.policies import RoutingRejected

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
               500: "internal_error", 501: "not_implemented_error", 503: "service_unavailable"}

GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
              404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED",
              413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
              499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE"}


class IngressError(Exception):
    """An error answer: status, a message for the client, OpenAI's `param` / `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: float = 0.0,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        if retry_after_s:
            self.headers.setdefault("Retry-After", str(max(1, math.ceil(retry_after_s))))

    @property
    def grpc_code(self) -> str:
        """The grpc.StatusCode name for this error."""
        return GRPC_CODES.get(self.status, "UNKNOWN")

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def classify(exc: BaseException) -> IngressError:
    """Map an exception (ours, or out of the backend) to its answer."""
    if isinstance(exc, IngressError):
        return exc
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        exc = exc.cause             # the worker's own exception, without Ray's traceback
    if isinstance(exc, RoutingRejected):
        return IngressError(429, str(exc), code=exc.reason,
                            retry_after_s=max(1.0, float(exc.retry_after_s or 0)))
    if isinstance(exc, StepFailed):
        return IngressError(500, str(exc), code="engine_step_failed")
    if isinstance(exc, UnknownLoRAError):
        return IngressError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, RequestError):
        return IngressError(400, str(exc))
    if isinstance(exc, TransferFailed):
        return IngressError(503, str(exc), code="transfer_failed")
    if isinstance(exc, WorkerFailed):
        return IngressError(503, str(exc), code="worker_failed")
    if isinstance(exc, ray.exceptions.RayError):
        return IngressError(503, f"a worker failed: {type(exc).__name__}: {exc}",
                            code="worker_failed")
    return IngressError(500, f"internal error: {type(exc).__name__}: {exc}")
