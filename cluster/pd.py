"""PDCluster: launch N prefill + M decode worker actors on Ray and run requests through them.

Placement: each worker asks Ray for `num_gpus_per_worker` GPUs and the role's custom resources
(e.g. {"prefill": 1}), so a cluster can dedicate nodes to a role. `num_prefill == 0` is the
colocated mode: every decode worker prefills its own requests.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.pd_config import PDConfig  # noqa: F401  (re-exported)
from ingress.backend import RouterView
from router.kv_timeline import HIT_WINDOW_S
from router.orchestrator import FlowConfig, Orchestrator  # noqa: F401  (FlowConfig: re-exported)


@dataclass(frozen=True)
class LeakCount:
    """Blocks held once nothing is in flight, on the workers that could be counted; `unknown`:
    worker id -> why it could not be (its invariant check raised, or it did not answer)."""

    blocks: int
    unknown: dict[str, str] = field(default_factory=dict)

    @property
    def leaked(self) -> int | None:
        """The count, or None when any worker is unknown (never read as 0)."""
        return None if self.unknown else self.blocks


class PDCluster:
    """The workers plus an Orchestrator; request methods are the orchestrator's."""

    def __init__(self, cfg: PDConfig) -> None:
        from workers.decode_host import DecodeHost, decode_actor_class
        from workers.prefill_host import PrefillHost, prefill_actor_class
        cfg.validate()
        self.cfg = cfg
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        engine = {**cfg.engine, "num_threads": cfg.threads_per_actor,
                  "share_idle_threads": cfg.share_idle_threads}
        common = dict(num_cpus=0, max_concurrency=256, num_gpus=cfg.num_gpus_per_worker,
                      max_restarts=cfg.max_restarts, max_task_retries=0)
        transport_cfg = dict(cfg.transport_cfg)
        if cfg.flow.transport == "grpc":     # the page server answers this cluster's actors only
            transport_cfg.setdefault("secret", secrets.token_hex(16))
        self._args = dict(engine_cfg=engine, transport=cfg.flow.transport,
                          transport_cfg=transport_cfg, lease_s=cfg.lease_s)
        prefill_host, decode_host = PrefillHost, DecodeHost
        if cfg.fault_injection:
            from workers.faults import FaultyDecodeHost, FaultyPrefillHost
            prefill_host, decode_host = FaultyPrefillHost, FaultyDecodeHost
        self._classes = {
            "prefill": prefill_actor_class(prefill_host, **common,
                                           resources=cfg.prefill_resources or None),
            "decode": decode_actor_class(decode_host, **common,
                                         resources=cfg.decode_resources or None)}
        self._next_index = {"prefill": 0, "decode": 0}
        self._lock = threading.Lock()         # the worker lists (short holds only)
        self._scale_lock = threading.Lock()   # one scale() at a time
        self._closed = threading.Event()      # shutdown(): reapers stop
        self._reapers: list[threading.Thread] = []
        self._born: dict[Any, float] = {}      # worker handle -> monotonic launch time
        self._placements: dict[Any, Any] = {}  # TP worker handle -> its placement group
        self._lived_s = 0.0                    # worker-seconds of the workers removed
        self.prefill = [self._launch("prefill") for _ in range(cfg.num_prefill)]
        self.decode = [self._launch("decode") for _ in range(cfg.num_decode)]
        self.workers = self.prefill + self.decode
        self.info = ray.get([w.info.remote() for w in self.workers])
        from dataclasses import replace

        from kvtransfer.rdt import PoolDevice, backend_for_devices
        # RDT's backend follows where the pools are (nccl for cuda tensors, gloo for CPU ones);
        # nccl with two workers on one GPU is refused here, naming cuda_ipc
        try:
            backend = backend_for_devices([PoolDevice.from_info(i) for i in self.info]) \
                if cfg.flow.transport == "rdt" else "gloo"
        except ValueError:
            for w in self.workers:      # refused: the workers launched for it go too
                ray.kill(w, no_restart=True)
            raise
        self.flow = replace(cfg.flow, rdt_backend=backend)
        self._ensure_rdt_group()
        ids = {w: i["worker_id"] for w, i in zip(self.workers, self.info, strict=True)}
        from router.metrics import RouterMetrics
        metrics = RouterMetrics()
        self.orchestrator = Orchestrator(self.prefill, self.decode, self.flow, ids,
                                         metrics=metrics)
        self.run_request = self.orchestrator.run_request
        self.run_request_async = self.orchestrator.run_request_async
        self.loop = self.orchestrator.loop     # the router's loop: serve the ingresses on it
        self.generate = self.orchestrator.generate
        self.abort = self.orchestrator.abort
        self.autoscaler = None
        if cfg.autoscale is not None and cfg.autoscale.enabled:
            from cluster.autoscale_loop import LiveAutoscaler
            self.autoscaler = LiveAutoscaler(self, cfg.autoscale, metrics=metrics)
            self.orchestrator.request_window = self.autoscaler.window
            self.autoscaler.start()

    def _launch(self, role: str):
        i = self._next_index[role]
        self._next_index[role] += 1
        tp = self.cfg.prefill_tp if role == "prefill" else self.cfg.decode_tp   # the role's TP
        engine = {**self._args["engine_cfg"], "tp": tp}
        cls, pg = self._classes[role], None
        if tp > 1:   # a gang: rank 0 (this actor) and its ranks in one STRICT_PACK group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from workers.tp_actors import worker_placement
            resources = self.cfg.prefill_resources if role == "prefill" \
                else self.cfg.decode_resources
            pg = worker_placement(tp, resources)
            ray.get(pg.ready(), timeout=120)
            cls = cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0), resources={})
            engine["tp_placement"] = pg
        w = cls.remote(f"{role}-{i}", **{**self._args, "engine_cfg": engine})
        self._born[w] = time.monotonic()
        if pg is not None:
            self._placements[w] = pg
        return w

    def _release_placement(self, w) -> None:
        """A removed TP worker's placement group goes with it (its ranks exit with rank 0)."""
        pg = self._placements.pop(w, None)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(pg)
            except Exception:   # noqa: BLE001 - Ray is shutting down
                pass

    def worker_seconds(self) -> float:
        """Seconds each worker actor lived, summed: from its launch (model load included) to
        its removal, or to now (draining ones included)."""
        now = time.monotonic()
        with self._lock:
            return self._lived_s + sum(now - t for t in self._born.values())

    def _ensure_rdt_group(self) -> None:
        if self.flow.transport == "rdt" and self.prefill:
            from kvtransfer import rdt
            rdt.ensure_group(self.workers, backend=self.flow.rdt_backend)

    # ---- live scaling --------------------------------------------------------------------------
    def scale(self, prefill: int | None = None, decode: int | None = None,
              wait: bool = False, timeout_s: float = 600.0) -> dict:
        """Add workers, or drain the newest ones: a draining worker gets no new requests and
        is removed (killed) once its requests in flight have finished."""
        for role, want, least in (("prefill", prefill, 0), ("decode", decode, 1)):
            if want is not None and want < least:
                raise ValueError(f"cannot scale {role} workers to {want} (at least {least})")
        with self._scale_lock:
            self._reapers = [t for t in self._reapers if t.is_alive()]
            for role, want in (("prefill", prefill), ("decode", decode)):
                if want is None:
                    continue
                group = self.prefill if role == "prefill" else self.decode
                fleet = self.orchestrator.fleet
                with self._lock:
                    live = [w for w in group if fleet.worker_id(w) not in fleet.draining]
                    back = [w for w in group if fleet.worker_id(w) in fleet.draining]
                # a draining worker is taken back before a new one is launched (its reaper
                # sees it is no longer draining and leaves it)
                for w in back[:max(0, want - len(live))]:
                    fleet.undrain(fleet.worker_id(w))
                    live.append(w)
                # new workers load their model in parallel, with no lock held: stats(),
                # routing and reaping go on meanwhile
                new = [self._launch(role) for _ in range(want - len(live))]
                infos = ray.get([w.info.remote() for w in new])
                with self._lock:
                    for w, info in zip(new, infos, strict=True):
                        self.info.append(info)
                        group.append(w)
                        self.workers.append(w)
                        fleet.add_worker(role, w, info["worker_id"])
                for wid in [fleet.worker_id(w) for w in live[max(want, 0):]][::-1]:
                    fleet.drain(wid)
                    t = threading.Thread(target=self._reap, args=(wid, timeout_s), daemon=True)
                    self._reapers.append(t)
                    t.start()
            with self._lock:
                self._ensure_rdt_group()
        if wait:
            for t in list(self._reapers):
                t.join(timeout_s)
        return {"prefill": len(self.orchestrator.fleet.live("prefill")),
                "decode": len(self.orchestrator.fleet.live("decode"))}

    def _reap(self, worker_id: str, timeout_s: float) -> None:
        """Wait until a draining worker has nothing in flight, then remove and kill it. A
        draining decode worker's running decodes move to the other decode workers with their
        KV (live migration); one that cannot move now is asked again, or finishes here."""
        deadline = time.monotonic() + timeout_s
        o = self.orchestrator
        w = o.fleet.handle(worker_id)
        decode = o.fleet.role_of(worker_id) == "decode"
        while time.monotonic() < deadline and not self._closed.is_set():
            if worker_id not in o.fleet.draining:     # taken back by a scale-up
                return
            if decode:
                o.move_off(worker_id, cause="drain")
            try:
                idle = not self.orchestrator.busy(worker_id) and \
                    ray.get(w.load_report.remote(), timeout=30).num_requests == 0
            except Exception:
                idle = True                  # dead already
            if idle:
                break
            time.sleep(0.1)
        self.orchestrator.fleet.remove_worker(worker_id)
        with self._lock:
            for group in (self.prefill, self.decode, self.workers):
                if w in group:
                    group.remove(w)
            self.info = [i for i in self.info if i["worker_id"] != worker_id]
            born = self._born.pop(w, None)
            if born is not None:
                self._lived_s += time.monotonic() - born
        try:
            ray.kill(w, no_restart=True)
        except Exception:
            pass
        self._release_placement(w)

    def migrate(self, request_id: str, to: str | None = None) -> bool:
        """Move a request's running decode to decode worker `to` (None: the policy's pick)
        with its KV, sampler state and stream position (rebalancing by hand); False when the
        request is not on a decode worker now or already moving (LookupError: not in flight;
        ValueError: `to` is not a live decode worker)."""
        fleet = self.orchestrator.fleet
        if request_id not in self.orchestrator.in_flight():
            raise LookupError(f"request_id: {request_id!r} is not in flight")
        if to is not None and (fleet.role_of(to) != "decode" or not fleet.takes_requests(to)):
            live = ", ".join(fleet.worker_id(w) for w in fleet.live("decode"))
            raise ValueError(f"to: {to!r} is not a live decode worker (live: {live})")
        return self.orchestrator.migrate(request_id, target=to, cause="rebalance")

    # ---- what the ingress's operations routes ask (ingress/backend.py) -------------------------
    def router_view(self) -> RouterView:
        o = self.orchestrator
        return RouterView(policy=o.policy.name, decisions=dict(o.decisions),
                          in_flight=len(o.in_flight()), retries=o.retries,
                          draining=frozenset(o.fleet.draining),
                          unhealthy=frozenset(o.fleet.unhealthy),
                          migrations=dict(o.migrations),
                          autoscale=self.autoscaler.to_dict() if self.autoscaler else None)

    def request_traces(self):
        return self.orchestrator.traces

    def kv_timeline(self, since: float | None = None, max_points: int | None = None,
                    window_s: float = HIT_WINDOW_S, t0: float | None = None) -> dict:
        """What every worker's KV pool held over time (router/kv_timeline.py)."""
        return self.orchestrator.fleet.timeline.to_dict(since=since, t0=t0, window_s=window_s,
                                                        max_points=max_points)

    def report_params(self) -> dict:
        """The fixed parameters a report records."""
        e, cfg = self.cfg.engine, self.cfg
        return {"model": e.get("model"), "dtype": e.get("dtype", "auto"),
                "kv_dtype": e.get("kv_dtype", "auto"), "block_size": e.get("block_size", 16),
                "num_blocks": e.get("num_blocks"), "kv_cache_gb": e.get("kv_cache_gb"),
                "prefill": cfg.num_prefill, "decode": cfg.num_decode,
                "transport": cfg.flow.transport, "policy": cfg.flow.policy,
                "num_gpus_per_worker": cfg.num_gpus_per_worker}

    def stats(self, timeout_s: float = 10.0) -> list[dict]:
        """Every worker's stats; a dead or silent worker gives a row with its `error`."""
        with self._lock:
            workers = list(self.workers)
        refs = [w.stats.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for w, ref in zip(workers, refs, strict=True):
            wid = self.orchestrator.fleet.worker_id(w)
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:.0f} s")
                out.append(ray.get(ref))
            except Exception as e:
                out.append({"worker_id": wid, "error": f"{type(e).__name__}: {e}"[:300]})
        return out

    def check_invariants(self) -> list[dict]:
        """Ledger counts of every worker (each asserts free + cached + referenced == total)."""
        return ray.get([w.check_invariants.remote() for w in self.workers])

    def leak_count(self, timeout_s: float = 10.0) -> LeakCount:
        """Blocks still held once nothing is in flight: per worker, the larger of the router
        ledger's open handoff holds (these count for workers that died too: nobody closed
        them) and the blocks the live worker still references. Fails closed: a live worker
        whose invariant check raises (a lost block, say) or that does not answer in
        `timeout_s` is `unknown`, with its error, never 0."""
        with self._lock:
            workers = list(self.workers)
        referenced: dict[str, int] = {}
        unknown: dict[str, str] = {}
        refs = [w.check_invariants.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for w, ref in zip(workers, refs, strict=True):
            wid = self.orchestrator.fleet.worker_id(w)
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:.0f} s")
                referenced[wid] = ray.get(ref)["referenced"]
            except Exception as e:   # noqa: BLE001 - whatever it is, the count is unknown
                cause = getattr(e, "cause", None) or e    # a RayTaskError: the worker's own
                unknown[wid] = f"{type(cause).__name__}: {cause}"[:500]
        ledger = self.orchestrator.ledger
        wids = (set(referenced) | {h.worker_id for h in ledger.open_holds()}) - set(unknown)
        return LeakCount(sum(max(ledger.held_blocks(wid), referenced.get(wid, 0))
                             for wid in wids), unknown)

    def leaked_blocks(self, timeout_s: float = 10.0) -> int | None:
        """`leak_count`'s blocks, or None (unknown) when any live worker could not be counted:
        a verdict `leaked == 0` then fails."""
        return self.leak_count(timeout_s).leaked

    def expire_leases(self) -> list[list[str]]:
        return ray.get([p.expire_leases.remote() for p in self.prefill])

    def shutdown(self) -> None:
        """Kill every worker; returns once no thread of this cluster calls Ray any more (a Ray
        call after ray.shutdown() would quietly start a new local Ray)."""
        self._closed.set()
        if self.autoscaler is not None:
            self.autoscaler.stop(wait_s=5)
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
            self._release_placement(w)
        # the reporter's calls to the killed workers fail fast now
        self.orchestrator.close(wait_s=self.flow.health_timeout_s + 5)
        for t in self._reapers:
            t.join(5)
        self.workers, self.prefill, self.decode = [], [], []
