"""What the ingress calls on its backend (a PDCluster, or a stand-in in tests): typed, so the
ingress never reaches into a cluster's internals, and never imports cluster/ or workers/.

`Backend` is what every front door needs; `OperatedBackend` adds what the operations routes
(/api/stats, /admin/scale, /dashboard, request traces) ask of a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from protocol.messages import Prompt, RequestResult, TokenDelta
from protocol.sampling import SamplingParams


class Backend(Protocol):
    async def run_request_async(self, prompt: Prompt, sampling: SamplingParams | None = None,
                                *, chat: bool = False, tenant: str = "", lora_id: str = "",
                                request_id: str | None = None,
                                on_delta: Callable[[TokenDelta], None] | None = None,
                                timeout_s: float | None = None) -> RequestResult:
        """Run one request to its end, calling `on_delta` on the caller's loop as tokens
        stream in (text included: the backend detokenizes). Raises only the errors of
        protocol/errors.py. A backend with a `loop` (router/event_loop.RouterLoop) wants its
        servers on that loop (cluster/serve.py): then no thread lies between them."""

    def abort(self, request_id: str) -> bool:
        """Release the request's blocks on every worker; False when it is not in flight."""

    def stats(self, timeout_s: float = 10.0) -> list[dict]:
        """Every worker's engine and block-pool counters (a dead one: a row with `error`)."""


@dataclass(frozen=True)
class RouterView:
    """The router's state as the operations routes show it."""

    policy: str
    decisions: dict[str, int] = field(default_factory=dict)   # "policy:reason" -> count
    in_flight: int = 0                                         # requests in the router
    retries: int = 0                                           # re-runs after worker deaths
    draining: frozenset[str] = frozenset()                     # worker ids
    unhealthy: frozenset[str] = frozenset()                    # worker ids
    migrations: dict[str, int] = field(default_factory=dict)   # live moves by outcome
    autoscale: dict | None = None      # the autoscaler's state (None: off; cluster/autoscale_loop.py)


@runtime_checkable
class OperatedBackend(Backend, Protocol):
    workers: list[Any]               # the worker actor handles (each answers `stats`)
    info: list[dict]                 # each worker's info(): worker_id, role, node_id, ...

    def router_view(self) -> RouterView: ...

    def scale(self, prefill: int | None = None, decode: int | None = None,
              wait: bool = False, timeout_s: float = 600.0) -> dict[str, int]:
        """Add workers, or drain the newest ones; returns the live counts per role."""

    def migrate(self, request_id: str, to: str | None = None) -> bool:
        """Ask a request's running decode to move to decode worker `to` (None: the policy's
        pick) with its KV; False when it is not on a decode worker now or already moving
        (LookupError: not in flight; ValueError: `to` is not a live decode worker)."""

    def report_params(self) -> dict:
        """The fixed parameters a report records (model, dtypes, pool, counts, transport)."""

    def request_traces(self) -> Any:
        """The router's TraceStore of the last requests' handoff timelines."""

    def kv_timeline(self, since: float | None = None, max_points: int | None = None,
                    window_s: float = 10.0) -> dict:
        """The router's KV timeline as JSON (router/kv_timeline.KVTimeline.to_dict)."""
