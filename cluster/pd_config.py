"""PDConfig: what a PDCluster (cluster/pd.py) launches and how requests flow through it.

Torch- and Ray-free, so the config loader (cluster/config.py) reads its defaults without either:
they are the `workers.*`, `engine.threads_per_worker` / `share_idle_threads` and
`transfer.lease_s` / `options` defaults of the YAML config, stated here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.autoscale_decision import AutoscaleConfig
from router.flow_config import FlowConfig

MAX_TP = 8   # tensor-parallel ranks of one worker at most (one 8-GPU node)


@dataclass
class PDConfig:
    """What a PDCluster launches (workers, placement, transport options) and, in `flow`, how
    requests flow through them (policy, transport, timeouts, retries: the router's FlowConfig,
    held here, never copied)."""

    engine: dict = field(default_factory=dict)   # EngineConfig fields for every worker
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1                   # tensor-parallel ranks of each prefill worker (t
    decode_tp: int = 1                    # GPUs, or a share of the cores each) and decode worker
    transport_cfg: dict = field(default_factory=dict)   # the transport's keyword arguments
    lease_s: float = 30.0                 # a staged transfer not pulled by then is released
    threads_per_actor: int = 1            # torch threads in each worker
    share_idle_threads: bool = True       # ... plus those of idle workers on the same machine
    prefill_resources: dict = field(default_factory=dict)   # e.g. {"prefill": 1}
    decode_resources: dict = field(default_factory=dict)    # e.g. {"decode": 1}
    num_gpus_per_worker: float = 0.0
    max_restarts: int = 3                 # Ray restarts a dead worker actor this many times
    fault_injection: bool = False         # workers/faults.py hosts (chaos bench, tests)
    flow: FlowConfig = field(default_factory=FlowConfig)
    autoscale: AutoscaleConfig | None = None   # enabled: the live autoscaler sizes the pools

    def validate(self) -> None:
        from kvtransfer.base import TRANSPORT_NAMES  # (imports torch)
        if self.flow.transport not in TRANSPORT_NAMES:
            raise ValueError(f"unknown KV transport {self.flow.transport!r}; valid names: "
                             f"{', '.join(TRANSPORT_NAMES)}")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("need at least one decode worker and no negative prefill count")
        if not (1 <= self.prefill_tp <= MAX_TP and 1 <= self.decode_tp <= MAX_TP):
            raise ValueError(f"prefill_tp and decode_tp must be between 1 and {MAX_TP}, got "
                             f"{self.prefill_tp} and {self.decode_tp}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        self.flow.validate()
        if self.autoscale is not None:
            self.autoscale.validate()
