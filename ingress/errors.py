"""An error answer (HTTP status, OpenAI error object, gRPC status code, Retry-After), and
`classify`: any exception out of parsing or the backend as the answer the client gets.

The statuses of the request's own errors are protocol/errors.py's (the one map); the ingress
adds the answers only a front door gives:

    401 missing or unknown API key                     UNAUTHENTICATED
    403 key lacks the scope, or claims another tenant  PERMISSION_DENIED
    408 body not read in time                          DEADLINE_EXCEEDED
    413 body too large                                 RESOURCE_EXHAUSTED
    415 admin route without a JSON body                INVALID_ARGUMENT
"""

from __future__ import annotations

import math

from protocol.errors import RaypdError, error_type, grpc_code


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
        return grpc_code(self.status)

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}


def classify(exc: BaseException) -> IngressError:
    """Map an exception (ours, or out of the backend) to its answer."""
    if isinstance(exc, IngressError):
        return exc
    if isinstance(exc, RaypdError):
        retry = max(1.0, float(exc.retry_after_s or 0)) if exc.http_status == 429 else 0.0
        return IngressError(exc.http_status, str(exc), param=exc.param, code=exc.code,
                            retry_after_s=retry)
    return IngressError(500, f"internal error: {type(exc).__name__}: {exc}")
