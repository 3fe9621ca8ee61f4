"""The one error map: every error a request can end with, and what the client gets for it.

Each class names its HTTP status; `ANSWERS` gives each status its OpenAI error type and gRPC
status code, so an error is mapped in this one place and the HTTP ingress, the gRPC ingress and
the router's metrics all report the same status for it (`http_status(exc)`).

    400 RequestError            a request the system refuses (the message names the field)
    404 UnknownLoRAError        a model / adapter this server does not serve
    429 RoutingRejected         no worker can take it now (capacity, SLO), with Retry-After
    499 RequestAborted          the client went away (or aborted it)
    500 StepFailed              the engine step that ran it raised
    503 TransferFailed          its KV transfer failed (failure policy `fail`, no reservation)
    503 WorkerFailed            its workers kept dying (or a worker call failed)
    TransferRejected            D refused a transfer (internal: the router retries another P)

Torch-free and Ray-free: the router turns Ray's own exceptions into these at its edge.
"""

from __future__ import annotations

import math

# status -> (OpenAI error type, gRPC status code name)
ANSWERS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "INVALID_ARGUMENT"),
    401: ("authentication_error", "UNAUTHENTICATED"),
    403: ("permission_error", "PERMISSION_DENIED"),
    404: ("not_found_error", "NOT_FOUND"),
    405: ("invalid_request_error", "UNIMPLEMENTED"),
    408: ("timeout_error", "DEADLINE_EXCEEDED"),
    413: ("invalid_request_error", "RESOURCE_EXHAUSTED"),
    415: ("invalid_request_error", "INVALID_ARGUMENT"),
    429: ("rate_limit_error", "RESOURCE_EXHAUSTED"),
    499: ("cancelled", "CANCELLED"),
    500: ("internal_error", "INTERNAL"),
    501: ("not_implemented_error", "UNIMPLEMENTED"),
    503: ("service_unavailable", "UNAVAILABLE"),
}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return ANSWERS.get(status, ("error", "UNKNOWN"))[0]


def grpc_code(status: int) -> str:
    """The grpc.StatusCode name for an HTTP status."""
    return ANSWERS.get(status, ("error", "UNKNOWN"))[1]


class RaypdError(Exception):
    """Base of the errors a request ends with. `http_status` says what the client gets; `code`
    is OpenAI's machine-readable `code` (None: none); `param` names the field at fault."""

    http_status = 500
    code: str | None = None
    param: str | None = None
    retry_after_s: float = 0.0


class RequestError(RaypdError, ValueError):
    """A request the system refuses, with a message fit for the client (HTTP 400); `param`
    names the field at fault when one is."""

    http_status = 400

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param

    def __reduce__(self):   # keeps `param` across Ray's pickling
        return (_rebuild, (type(self), str(self), self.param))


class UnknownLoRAError(RequestError):
    """A request names an adapter the engine does not serve (HTTP 404, never a silent fallback
    to the base model)."""

    http_status = 404
    code = "model_not_found"
    param = "model"


class RequestAborted(RequestError):
    """The request was aborted (the client went away, or asked): HTTP 499, nothing is left
    held for it."""

    http_status = 499


class StepFailed(RaypdError, RuntimeError):
    """An engine step raised; the requests of that step end with this (HTTP 500), the worker
    goes on serving the others."""

    http_status = 500
    code = "engine_step_failed"


class RoutingRejected(RaypdError, RuntimeError):
    """No worker can take the request now; the ingress answers 429 with Retry-After."""

    http_status = 429

    def __init__(self, reason: str, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = reason
        self.retry_after_s = retry_after_s

    def __reduce__(self):   # keeps `reason` and Retry-After across Ray's pickling
        return (RoutingRejected, (self.reason, str(self), self.retry_after_s))


class SLOUnmeetable(RoutingRejected):
    """Every worker's estimated TTFT exceeds the SLO (reason "slo_reject")."""

    def __init__(self, best_ttft_s: float, slo_s: float) -> None:
        super().__init__("slo_reject",
                         f"best estimated TTFT {best_ttft_s:.2f}s exceeds the SLO {slo_s:.2f}s",
                         retry_after_s=max(1.0, math.ceil(best_ttft_s - slo_s)))
        self.best_ttft_s = best_ttft_s
        self.slo_s = slo_s

    def __reduce__(self):
        return (SLOUnmeetable, (self.best_ttft_s, self.slo_s))


class TransferFailed(RaypdError, RuntimeError):
    """A KV transfer failed and the request cannot go on without it (HTTP 503)."""

    http_status = 503
    code = "transfer_failed"


class WorkerFailed(RaypdError, RuntimeError):
    """The request's workers kept dying, or a call to one failed; it ends with this explicit
    error (HTTP 503, never lost)."""

    http_status = 503
    code = "worker_failed"


# why D refused a transfer (counted per reason on D)
REJECT_UNKNOWN = "unknown"        # no reservation for this request (aborted, expired, never)
REJECT_STALE = "stale"            # another attempt epoch or plan digest than the reservation's
REJECT_DUPLICATE = "duplicate"    # a pull for this reservation is in flight or has landed
REJECT_LATE = "late"              # the lease ended, or the reservation went away mid-pull
REJECT_CORRUPT = "corrupt"        # a page's checksum does not match what P computed
REJECT_REASONS = (REJECT_UNKNOWN, REJECT_STALE, REJECT_DUPLICATE, REJECT_LATE, REJECT_CORRUPT)


class TransferRejected(RaypdError, RuntimeError):
    """D refused a transfer; nothing of it was written into any block. `reason` is one of
    REJECT_REASONS. Internal to the handoff: the router retries another prefill worker, and
    only what it then gives up with (TransferFailed) reaches a client."""

    http_status = 503
    code = "transfer_failed"

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason

    def __reduce__(self):   # keeps `reason` across Ray's pickling
        return (TransferRejected, (self.reason, str(self).split(": ", 1)[-1]))


def _rebuild(cls: type, message: str, param: str | None) -> RequestError:
    return cls(message, param=param)


def http_status(exc: BaseException) -> int:
    """The HTTP status a client gets for `exc` (500 for anything that is not ours)."""
    return exc.http_status if isinstance(exc, RaypdError) else 500
