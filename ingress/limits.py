"""The transport limits of the ingress (config `server.limits`): body size, JSON shape, how long
a client may take, stream buffering, connections, admin counts. What one request may ask is
`ingress.request_checks.RequestLimits` (config `server.request_limits`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _limit(default: Any, **rules: Any) -> Any:
    return field(default=default, metadata=rules)


@dataclass(frozen=True)
class IngressLimits:
    max_body_bytes: int = _limit(1 << 20, min=1)          # larger body -> 413
    max_json_depth: int = _limit(32, min=2)               # deeper nesting -> 400
    max_number_digits: int = _limit(32, min=1)            # longer JSON number -> 400
    header_timeout_s: float = _limit(10.0, gt=0)          # request line + headers, or closed
    body_timeout_s: float = _limit(30.0, gt=0)            # the whole body, or 408
    write_timeout_s: float = _limit(30.0, gt=0)           # a stream client not reading: cut off
    stream_queue_events: int = _limit(4096, min=1)        # events buffered per stream, then cut
    max_connections: int = _limit(512, min=1)             # more at once -> 503
    max_scale_workers: int = _limit(16, min=1)            # /admin/scale: at most this per role
