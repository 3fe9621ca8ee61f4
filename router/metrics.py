"""The router's Ray metrics (`ray.util.metrics`): requests by the status the client got, routing
decisions, requests in flight, handoff stage seconds, KV bytes per P -> D pair, the hash drift
alarm. Names and help texts: protocol/metric_names.py."""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from protocol.metric_names import E2E_BUCKETS, ROUTER_METRICS, ROUTER_TAGS, STAGE_BUCKETS


class RouterMetrics:
    """The router's metrics: requests by status, routing decisions, in-flight requests."""

    def __init__(self, router_id: str = "router") -> None:
        tags = {"router": router_id}
        self.requests = Counter("raypd_router_requests", ROUTER_METRICS["raypd_router_requests"],
                                tag_keys=(*ROUTER_TAGS, "status")).set_default_tags(tags)
        self.latency = Histogram("raypd_router_request_seconds",
                                 ROUTER_METRICS["raypd_router_request_seconds"],
                                 boundaries=E2E_BUCKETS, tag_keys=(*ROUTER_TAGS, "status")
                                 ).set_default_tags(tags)
        self.decisions = Counter("raypd_router_decisions",
                                 ROUTER_METRICS["raypd_router_decisions"],
                                 tag_keys=(*ROUTER_TAGS, "policy", "reason", "target")
                                 ).set_default_tags(tags)
        self.in_flight = Gauge("raypd_router_in_flight", ROUTER_METRICS["raypd_router_in_flight"],
                               tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.stages = Histogram("raypd_router_stage_seconds",
                                ROUTER_METRICS["raypd_router_stage_seconds"],
                                boundaries=STAGE_BUCKETS, tag_keys=(*ROUTER_TAGS, "stage")
                                ).set_default_tags(tags)
        pair = (*ROUTER_TAGS, "prefill", "decode")
        self.pair_bytes = Counter("raypd_router_pair_transfer_bytes",
                                  ROUTER_METRICS["raypd_router_pair_transfer_bytes"],
                                  tag_keys=pair).set_default_tags(tags)
        self.pair_seconds = Counter("raypd_router_pair_transfer_seconds",
                                    ROUTER_METRICS["raypd_router_pair_transfer_seconds"],
                                    tag_keys=pair).set_default_tags(tags)

        self.hash_drift = Gauge("raypd_router_hash_drift",
                                ROUTER_METRICS["raypd_router_hash_drift"],
                                tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.hash_drift_alarms = Counter("raypd_router_hash_drift_alarms",
                                         ROUTER_METRICS["raypd_router_hash_drift_alarms"],
                                         tag_keys=ROUTER_TAGS).set_default_tags(tags)

        self.migrations = Counter("raypd_router_migrations",
                                  ROUTER_METRICS["raypd_router_migrations"],
                                  tag_keys=(*ROUTER_TAGS, "outcome", "cause")
                                  ).set_default_tags(tags)

        self.autoscale_workers = Gauge("raypd_autoscale_workers",
                                       ROUTER_METRICS["raypd_autoscale_workers"],
                                       tag_keys=(*ROUTER_TAGS, "role", "kind")
                                       ).set_default_tags(tags)
        self.autoscale_decisions = Counter("raypd_autoscale_decisions",
                                           ROUTER_METRICS["raypd_autoscale_decisions"],
                                           tag_keys=(*ROUTER_TAGS, "role", "direction")
                                           ).set_default_tags(tags)

    def record_autoscale(self, decision: Any) -> None:
        """One autoscaler evaluation (router/autoscale_decision.py Decision): each pool's live,
        starting, draining and target sizes, and the direction it took per role."""
        obs = decision.observation
        for r in decision.roles:
            for kind in ("workers", "starting", "draining"):
                self.autoscale_workers.set(float(getattr(obs, f"{r.role}_{kind}")),
                                           tags={"role": r.role,
                                                 "kind": "live" if kind == "workers" else kind})
            self.autoscale_workers.set(float(r.target), tags={"role": r.role, "kind": "target"})
            direction = "hold" if not r.changed else "up" if r.target > r.current else "down"
            self.autoscale_decisions.inc(1, tags={"role": r.role, "direction": direction})

    def record_migration(self, outcome: str, cause: str) -> None:
        """One live move of a running decode ended with `outcome` (moved, fallback, unplaced)."""
        self.migrations.inc(1, tags={"outcome": outcome, "cause": cause})

    def record_hash_drift(self, alarm: bool, went_on: bool) -> None:
        """The hash drift alarm's state after a request (router/drift.py)."""
        self.hash_drift.set(1.0 if alarm else 0.0)
        if went_on:
            self.hash_drift_alarms.inc(1)

    def record_request(self, status: int | str, seconds: float | None = None) -> None:
        """One request ended with `status` (an HTTP code: 200, 400, 429, 499, 500, ...)."""
        tags = {"status": str(status)}
        self.requests.inc(1, tags=tags)
        if seconds is not None:
            self.latency.observe(float(seconds), tags=tags)

    def record_decision(self, policy: str, reason: str, target: str = "") -> None:
        """One routing decision; `target` is the role chosen for (prefill / decode)."""
        self.decisions.inc(1, tags={"policy": policy, "reason": reason, "target": target})

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(float(n))

    def record_trace(self, trace: Any) -> None:
        """One finished request's handoff trace (protocol.request_trace.RequestTrace): each
        stage's seconds, and its transfer under its P -> D pair."""
        if trace.status != 200:
            return
        secs = trace.stage_seconds()
        for stage, s in secs.items():
            self.stages.observe(s, tags={"stage": stage})
        if trace.transfer_bytes and trace.prefill_worker and trace.decode_worker:
            pair = {"prefill": trace.prefill_worker, "decode": trace.decode_worker}
            self.pair_bytes.inc(float(trace.transfer_bytes), tags=pair)
            if secs.get("transfer", 0.0) > 0:
                self.pair_seconds.inc(secs["transfer"], tags=pair)

