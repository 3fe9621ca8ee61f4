"""The live autoscaler: every `interval_s`, the router's own view -> router/autoscale_decision.py's
Controller (the code `raypd simulate --autoscale` runs) -> the cluster's scale().

What it observes is only what the router has: the fleet's WorkerStates (built from the load
reports), the RequestWindow the orchestrator feeds with every arrival and end it sees (TTFT and
TPOT as the client saw them), and the workers it launched that do not report yet. A decision
is applied by `PDCluster.scale` on one applier thread (launching actors takes seconds; the next
evaluation counts them as starting): scale-up takes back a draining worker of the role before
it launches one; scale-down drains a worker, whose running decodes move to the others with
their KV (live migration) and whose prefills finish, before it is removed. With `rebalance`,
each evaluation also moves running decodes from the busiest decode worker to the idlest when
their batches are far apart (a worker that joined takes its share at once, not only new
requests: Orchestrator.rebalance_decodes). Every decision is
logged with its inputs (router/autoscale_decision.py), kept for `raypd status`, and exported as metrics.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from router.autoscale_decision import AutoscaleConfig, Controller, Decision, RequestWindow, observe

log = logging.getLogger(__name__)


class LiveAutoscaler:
    """Runs the controller against a PDCluster (`cluster`: its orchestrator's fleet and
    `scale`). Invariant: at most one scale() runs at a time; while it runs, the workers it
    launches count as starting in every Observation."""

    def __init__(self, cluster: Any, cfg: AutoscaleConfig, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cfg.validate()
        self.cluster, self.cfg, self._clock = cluster, cfg, clock
        self.controller = Controller(cfg)
        self.window = RequestWindow.for_config(cfg)
        self.metrics = metrics
        self.starting = {"prefill": 0, "decode": 0}    # launched, not reporting yet
        self.errors = 0                               # scale() calls that raised
        self.rebalanced = 0                           # moves asked to even the decode batches
        self.applied: list[dict] = []                 # each scale(): sizes, launched, seconds
        self.last_error: str | None = None
        self._want: tuple[int, int] | None = None     # the latest target not applied yet
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("raypd-autoscale", self._loop), ("raypd-autoscale-apply",
                                                                  self._apply_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self, wait_s: float | None = None) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if wait_s is not None:
            for t in self._threads:
                t.join(wait_s)

    # ---- evaluate --------------------------------------------------------------------------------
    def evaluate(self, now: float | None = None) -> Decision:
        """One evaluation: observe, decide, hand a change to the applier."""
        now = self._clock() if now is None else now
        fleet = self.cluster.orchestrator.fleet
        with fleet.lock:     # copies: the reporter goes on updating the live states
            p = [copy.copy(s) for s in fleet.states("prefill")]
            d = [copy.copy(s) for s in fleet.states("decode")]
            starting = dict(self.starting)
        obs = observe(p, d, self.window, now, starting["prefill"], starting["decode"])
        decision = self.controller.decide(obs, now)
        if self.cfg.rebalance:      # a decode worker that joined takes its share at once
            self.rebalanced += self.cluster.orchestrator.rebalance_decodes()
        if decision.changed:
            with self._cv:
                self._want = (decision.prefill, decision.decode)
                self._cv.notify_all()
        if self.metrics is not None:
            self.metrics.record_autoscale(decision)
        return decision

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.cfg.interval_s / 4)):
            if not self.controller.due(self._clock()):
                continue
            try:
                self.evaluate()
            except Exception as e:   # noqa: BLE001 - a worker left mid-read: next interval
                log.warning("autoscale evaluation failed: %s: %s", type(e).__name__, e)

    # ---- apply -----------------------------------------------------------------------------------
    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(lambda: self._want is not None or self._stop.is_set())
                if self._stop.is_set():
                    return
                want, self._want = self._want, None
            self._apply(*want)

    def _apply(self, prefill: int, decode: int) -> None:
        """scale() to these sizes; the workers it will launch count as starting meanwhile."""
        fleet = self.cluster.orchestrator.fleet
        launching = {}
        for role, want in (("prefill", prefill), ("decode", decode)):
            live = len(fleet.live(role))
            back = len([w for w in fleet.workers(role) if fleet.worker_id(w) in fleet.draining])
            launching[role] = max(0, want - live - back)
        with fleet.lock:
            for role, n in launching.items():
                self.starting[role] += n
        t0 = self._clock()
        try:
            self.cluster.scale(prefill=prefill, decode=decode)
            self.applied.append({"at": t0, "prefill": prefill, "decode": decode,
                                 "launched": dict(launching), "seconds": self._clock() - t0})
        except Exception as e:   # noqa: BLE001 - kept for status; the next interval decides again
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("autoscale: scale(prefill=%d, decode=%d) failed: %s", prefill, decode,
                        self.last_error)
        finally:
            with fleet.lock:
                for role, n in launching.items():
                    self.starting[role] -= n

    def to_dict(self) -> dict:
        """For `raypd status` (/api/stats): the controller's config, counts and last decisions,
        the workers starting, and the scale() errors."""
        d = self.controller.to_dict()
        d["history"] = d["history"][-20:]
        d.update(enabled=True, starting=dict(self.starting), errors=self.errors,
                 last_error=self.last_error, rebalance_moves_asked=self.rebalanced,
                 applied=self.applied[-20:])
        return d
