"""A worker actor's Ray metrics (`ray.util.metrics`), fed from its plain stats dict (names and
help texts: protocol/metric_names.py). Each Ray node's metrics agent serves them as Prometheus
text on its metrics export port (`ray start --metrics-export-port`; the agent runs with or without
the dashboard). Counters are fed as deltas of the engine's cumulative counters, so calling
`update` more or less often never double counts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from protocol.metric_names import (
    LEASE_RELEASE_KEYS,
    LEASE_RELEASES,
    WORKER_ADAPTER_COUNTERS,
    WORKER_COUNTERS,
    WORKER_GAUGES,
    WORKER_HISTOGRAMS,
    WORKER_REASON_COUNTERS,
    WORKER_REQUEST_COUNTERS,
    WORKER_TAGS,
)

# stats-dict key -> gauge (a snapshot; the first key present wins)
# stats-dict key(s) -> counter fed with the increase of a cumulative value
# stats-dict key holding {adapter name: cumulative value} -> counter tagged with the adapter
# counter with a `reason` tag, fed with the increase of one cumulative stats key per reason
# from finished requests' lifecycle records



class WorkerMetrics:
    """One worker actor's metrics, tagged role / worker_id / node.

    `update(stats)` sets the gauges and advances the counters from the actor's `stats()` dict;
    `observe_finished(lifecycle)` records one finished request. Thread-safe."""

    def __init__(self, role: str, worker_id: str, node_id: str | None = None,
                 interval_s: float = 0.5) -> None:
        if node_id is None:
            import ray
            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.tags = {"role": role, "worker_id": worker_id, "node": node_id or ""}
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._next_update = 0.0
        self.gauges = {n: Gauge(n, d, tag_keys=WORKER_TAGS).set_default_tags(self.tags)
                       for n, (_, d) in WORKER_GAUGES.items()}
        self.counters = {n: Counter(n, d, tag_keys=WORKER_TAGS).set_default_tags(self.tags)
                         for n, (_, d) in WORKER_COUNTERS.items()}
        self.adapter_counters = {
            n: Counter(n, d, tag_keys=(*WORKER_TAGS, "adapter")).set_default_tags(self.tags)
            for n, (_, d) in WORKER_ADAPTER_COUNTERS.items()}
        self.finished = Counter("raypd_requests_finished",
                                WORKER_REQUEST_COUNTERS["raypd_requests_finished"],
                                tag_keys=(*WORKER_TAGS, "finish_reason")
                                ).set_default_tags(self.tags)
        self.lease_releases = Counter(LEASE_RELEASES, WORKER_REASON_COUNTERS[LEASE_RELEASES],
                                      tag_keys=(*WORKER_TAGS, "reason")
                                      ).set_default_tags(self.tags)
        self.reused = Counter("raypd_reused_tokens", WORKER_REQUEST_COUNTERS["raypd_reused_tokens"],
                              tag_keys=WORKER_TAGS).set_default_tags(self.tags)
        self.histograms = {n: (key, Histogram(n, d, boundaries=b, tag_keys=WORKER_TAGS)
                               .set_default_tags(self.tags))
                           for n, (key, b, d) in WORKER_HISTOGRAMS.items()}

    def update(self, stats: Mapping[str, Any]) -> None:
        """Gauges := the snapshot; counters += increase of each cumulative value since the
        last call (the first call counts everything so far)."""
        with self._lock:
            for name, (keys, _) in WORKER_GAUGES.items():
                v = _first(stats, keys)
                if v is not None:
                    self.gauges[name].set(float(v))
            for name, (keys, _) in WORKER_COUNTERS.items():
                v = _first(stats, keys)
                if v is None:
                    continue
                delta = float(v) - self._last.get(name, 0.0)
                self._last[name] = float(v)
                if delta > 0:   # a reset (smaller value) restarts the baseline
                    self.counters[name].inc(delta)
            for name, (key, _) in WORKER_ADAPTER_COUNTERS.items():
                for adapter, v in (stats.get(key) or {}).items():
                    last_key = f"{name}/{adapter}"
                    delta = float(v) - self._last.get(last_key, 0.0)
                    self._last[last_key] = float(v)
                    if delta > 0:
                        self.adapter_counters[name].inc(delta, tags={"adapter": adapter})
            for reason, key in LEASE_RELEASE_KEYS.items():
                v = _first(stats, (key,))
                if v is None:
                    continue
                delta = float(v) - self._last.get(key, 0.0)
                self._last[key] = float(v)
                if delta > 0:
                    self.lease_releases.inc(delta, tags={"reason": reason})

    def maybe_update(self, get_stats: Callable[[], Mapping[str, Any]],
                     now: float | None = None) -> bool:
        """`update(get_stats())` if `interval_s` has passed since the last one (cheap to call
        every engine-loop iteration). Returns whether it updated."""
        now = time.monotonic() if now is None else now
        if now < self._next_update:
            return False
        self._next_update = now + self.interval_s
        self.update(get_stats())
        return True

    def observe_finished(self, lifecycle: Any) -> None:
        """One finished request: its RequestLifecycle (or `to_dict()` of it)."""
        lc = asdict(lifecycle) if is_dataclass(lifecycle) else lifecycle
        self.finished.inc(1, tags={"finish_reason": str(lc.get("finish_reason") or "unknown")})
        if lc.get("cached_tokens"):
            self.reused.inc(float(lc["cached_tokens"]))
        for key, hist in self.histograms.values():
            v = lc.get(key)
            if v is not None:
                hist.observe(float(v))

    def observe_many(self, lifecycles: Iterable[Any]) -> None:
        for lc in lifecycles:
            self.observe_finished(lc)


def _first(stats: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = stats.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None
