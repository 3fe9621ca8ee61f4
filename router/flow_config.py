"""FlowConfig: how requests flow through the workers (policy, transport, conditional
disaggregation, timeouts, retries). The Orchestrator (router/orchestrator.py) runs by it.

Torch- and Ray-free, so the config loader (cluster/config.py) reads its defaults without either:
they are the `router.*` / `transfer.*` defaults of the YAML config, stated here only.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.policies import make_policy
from router.worker_view import REPORT_INTERVAL_S

FAILURE_POLICIES = ("recompute", "fail")
INDEX_MODES = ("precise", "approx")


@dataclass
class FlowConfig:
    """How requests flow through the workers (the config's router.* and transfer.* keys)."""

    policy: str = "locality"
    policy_cfg: dict | None = None
    index_mode: str = "precise"            # precise (KV events) | approx (own decisions + TTL)
    local_prefill_max_tokens: int = 0      # D prefills itself when it lacks <= this many tokens
    local_prefill_when_backlogged: bool = True    # ... or when the prefill pool's wait is
                                           # longer than it takes on D, (1 + D's decode batch)
                                           # times over (router/local_prefill.py)
    failure_policy: str = "recompute"      # on a failed transfer: recompute on D, or fail
    transport: str = "shm"                 # kvtransfer.base.TRANSPORT_NAMES; shm: same node
    rdt_backend: str = "gloo"
    admit_timeout_s: float = 120.0         # wait for decode capacity, then 429
    request_timeout_s: float = 600.0
    report_interval_s: float = REPORT_INTERVAL_S
    health_timeout_s: float = 10.0         # a worker whose report takes this long is unhealthy
    hang_timeout_s: float = 300.0          # one engine step running this long: the worker hangs
    max_retries: int = 2                   # re-runs of a request whose worker died
    migrate_on_kv_pressure: bool = False   # move a running decode off a full D (no preemption)

    def validate(self) -> None:
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.failure_policy!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.index_mode not in INDEX_MODES:
            raise ValueError(f"index_mode must be precise or approx, got {self.index_mode!r}")
        make_policy(self.policy, **(self.policy_cfg or {}))   # unknown name -> ValueError
