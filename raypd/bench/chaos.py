"""`raypd bench chaos`: replay requests on 2 prefill + 2 decode workers while injecting faults;
count what completed, what failed with an explicit error, what was lost, and leaked blocks.

Fault kinds (each injected `kills` times, spread over the replay by progress; each counts once
it was applied, and one asked for that never was fails the run):
  kill      a prefill worker mid-prefill (its next step stalls, then it dies) or a decode
            worker mid-pull (its next pull stalls, then it dies); Ray restarts it
  corrupt   a prefill worker flips bytes of its next staged copy after checksumming it (armed
            again until a corrupted copy reaches a decode worker)
  delay     a decode worker's next pull starts after the lease has ended
  drop_ack  a prefill worker ignores its next ack (the lease has to free the pages)
  abort     the client hangs up on a request that is streaming

Every request has a deadline; one that has not ended by then, or ended with an error that is
not one of the documented explicit ones, is lost. Leaked blocks come from the router's
ledger (which answers for workers that died) and from every live worker's pool. Greedy
outputs of completed requests are checked against stock transformers generate() on an
independently loaded copy of the model.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import ray

from cluster.pd import LeakCount, PDCluster, PDConfig
from protocol.errors import RequestError, RoutingRejected, TransferFailed, WorkerFailed
from router.orchestrator import FlowConfig
from router.percentiles import percentiles
from workers.request import SamplingParams

FAULT_KINDS = ("kill", "corrupt", "delay", "drop_ack", "abort")
EXPLICIT_ERRORS = (RequestError, RoutingRejected, TransferFailed, WorkerFailed)
_TALLY = threading.Lock()   # the injector threads' counts


def _workload(n: int, seed: int, vocab: int) -> list[list[int]]:
    """Requests in a few shared-prefix groups (so prefix caches and transfers both matter)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.choice((32, 48, 64)))]
                for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))]
            for _ in range(n)]


def references(model: str, prompts: list[list[int]], max_tokens: int,
               ignore_eos: bool = False) -> list[list[int]]:
    """Stock transformers generate(), greedy, one prompt at a time, own copy of the model
    (`ignore_eos`: exactly max_tokens each, as SamplingParams.ignore_eos decodes)."""
    import torch

    from workers.model_loader import load_model
    hf, _, info = load_model(model)
    eos = None if ignore_eos else list(info.eos_token_ids) or None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=0)
            toks = gen[0, len(p):].tolist()
            if eos:   # generate() pads after eos in a batch of one? trim at the first eos
                for i, t in enumerate(toks):
                    if t in eos:
                        toks = toks[:i + 1]
                        break
            out.append(toks)
    return out


class _Replay:
    """The requests' threads and outcomes; a request never blocks the bench past its deadline."""

    def __init__(self, cluster: PDCluster, prompts: list, sampling: SamplingParams,
                 deadline_s: float, concurrency: int) -> None:
        self.cluster, self.prompts, self.sampling = cluster, prompts, sampling
        self.deadline_s = deadline_s
        self.results: list[dict | None] = [None] * len(prompts)
        self.ended_at: list[float | None] = [None] * len(prompts)
        self.started_at: list[float | None] = [None] * len(prompts)
        self.streaming: set[int] = set()          # requests with a token delivered, not ended
        self.cond = threading.Condition()
        self.finished = 0
        self.allowed = len(prompts)   # requests the feeder may start so far (fault pacing)
        self._slots = threading.Semaphore(concurrency)

    def rid(self, i: int) -> str:
        return f"chaos-{i}"

    def start(self) -> None:
        threading.Thread(target=self._feed, daemon=True, name="chaos-feed").start()

    def allow(self, n: int) -> None:
        with self.cond:
            self.allowed = min(len(self.prompts), max(self.allowed, n))
            self.cond.notify_all()

    def more(self) -> None:
        """A fault that waits for traffic it has not met yet (a staging to corrupt, a pull to
        delay, an ack to drop): one more request may start."""
        self.allow(self.allowed + 1)

    def _feed(self) -> None:
        for i in range(len(self.prompts)):
            with self.cond:
                self.cond.wait_for(lambda i=i: i < self.allowed)
            self._slots.acquire()
            threading.Thread(target=self._one, args=(i,), daemon=True).start()

    def _one(self, i: int) -> None:
        self.started_at[i] = time.monotonic()

        def on_delta(_delta) -> None:
            with self.cond:
                if self.ended_at[i] is None:
                    self.streaming.add(i)
        try:
            r = {"result": self.cluster.run_request(self.prompts[i], self.sampling,
                                                    request_id=self.rid(i), on_delta=on_delta,
                                                    timeout_s=self.deadline_s)}
        except EXPLICIT_ERRORS as e:
            r = {"error": f"{type(e).__name__}: {e}", "explicit": True}
        except Exception as e:     # not a documented error: the client got no clear answer
            r = {"error": f"{type(e).__name__}: {e}", "explicit": False}
        with self.cond:
            self.results[i] = r
            self.ended_at[i] = time.monotonic()
            self.streaming.discard(i)
            self.finished += 1
            self.cond.notify_all()
        self._slots.release()

    def wait_progress(self, n: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.finished >= n, timeout)

    def wait_all(self, until: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.finished >= len(self.prompts),
                               max(0.0, until - time.monotonic()))


class _Nudge:
    """One waiting fault's pacing: each call past NUDGE_S since the last one lets one more
    request start (`_Replay.more`)."""

    def __init__(self, replay: _Replay) -> None:
        self.replay, self.at = replay, time.monotonic() + NUDGE_S

    def __call__(self) -> None:
        if time.monotonic() > self.at:
            self.replay.more()
            self.at = time.monotonic() + NUDGE_S


def _counts(actor) -> dict[str, int] | None:
    try:
        return ray.get(actor.fault_counts.remote(), timeout=10)
    except Exception:
        return None      # down (killed, restarting): what it had applied died with it


def _wait_applied(armed: list[tuple[Any, int]], key: str, replay: _Replay,
                  timeout_s: float) -> None:
    """Wait until the fault count `key` of any of the `armed` (actor, count before arming)
    rose (the fault was applied), `timeout_s` passed or every request ended. An actor that
    came back as a new process (its counts start again: what was armed died with it) is
    dropped; with none left the wait ends. The caller reads the counts again after
    disarming (one may land meanwhile)."""
    deadline = time.monotonic() + timeout_s
    nudge = _Nudge(replay)
    armed = list(armed)
    while armed and time.monotonic() < deadline:
        for a, before in list(armed):
            c = _counts(a)
            if c is not None and c.get(key, 0) > before:
                return
            if c is not None and c.get(key, 0) < before:
                armed.remove((a, before))
        if replay.finished >= len(replay.prompts):
            return
        nudge()                           # no traffic has met it yet: let a request in
        time.sleep(0.05)


NUDGE_S = 2.0   # a fault that has met no traffic this long lets one more request start


def _inject(kind: str, cluster: PDCluster, replay: _Replay, rng: random.Random, n: int,
            lease_s: float, log: dict) -> None:
    """One fault of `kind`; it counts in `log` only once it was applied (a kill once the
    worker came back as a new process, a delay once a pull was delayed, a dropped ack once an
    ack was dropped, a corruption once a corrupted copy reached a decode worker); one that
    never was goes to log["not_injected"]."""
    prefill, decode = list(cluster.prefill), list(cluster.decode)
    landed = False
    if kind == "kill":
        role = "prefill" if n % 2 == 0 else "decode"
        victim = rng.choice(prefill if role == "prefill" else decode)
        wid = cluster.orchestrator.fleet.worker_id(victim)
        try:
            pid = ray.get(victim.info.remote(), timeout=10)["pid"]
            if role == "prefill":      # make the kill land mid-prefill / mid-pull
                ray.get(victim.stall_next_step.remote(1.0), timeout=5)
            else:
                ray.get(victim.inject_pull_delay.remote(1.0, 1, "kill"), timeout=5)
        except Exception:
            pid = None
        time.sleep(0.3)
        ray.kill(victim, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not landed:   # back as a new process (model
            try:                                            # loaded); the old one may still
                landed = ray.get(victim.info.remote(), timeout=5)["pid"] != pid  # answer first
            except Exception:
                pass
            if not landed:
                time.sleep(0.2)
        if landed and pid is not None:
            with _TALLY:
                log["killed"].append(wid)
    elif kind == "corrupt":
        landed = _corrupt_until_pulled(cluster, replay, lease_s, log)
    elif kind == "delay":
        n_applied = _arm_until_applied(
            decode, lambda d: d.inject_pull_delay.remote(lease_s + 0.5, 1, "delay"),
            lambda d: d.cancel_pull_delays.remote("delay"), "pull_delays_delay", replay)
        landed = n_applied > 0
        with _TALLY:
            log["delays_applied"] += n_applied
    elif kind == "drop_ack":
        n_applied = _arm_until_applied(
            prefill, lambda p: p.inject_fault.remote("drop_ack", 1),
            lambda p: p.disarm_fault.remote("drop_ack"), "acks_dropped", replay)
        landed = n_applied > 0
        with _TALLY:
            log["acks_dropped"] += n_applied
    elif kind == "abort":
        deadline = time.monotonic() + 10
        nudge = _Nudge(replay)
        while time.monotonic() < deadline and not landed:
            with replay.cond:
                streaming = sorted(replay.streaming)
            if streaming:
                i = rng.choice(streaming)
                landed = cluster.abort(replay.rid(i))
            else:
                nudge()                        # nothing streams: let a request in
                time.sleep(0.02)
        if landed:
            with _TALLY:
                log["client_aborts"] += 1
    if not landed:
        with _TALLY:
            log["not_injected"].append(kind)


def _arm_until_applied(actors: list, arm, disarm, key: str, replay: _Replay,
                       timeout_s: float = 60.0, each_s: float = 10.0) -> int:
    """Arm a fault on every one of `actors` (`arm(actor)` / `disarm(actor)` return the call's
    ref), since the router, not the bench, picks which one the next request meets, until its
    count `key` shows it applied on one; then disarm the rest. Armed again when the workers
    restarted (what they had armed died with them) or nothing met it within `each_s`.
    Returns how many were applied (a second one may land before the rest are disarmed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and replay.finished < len(replay.prompts):
        armed = []
        for a in actors:
            c = _counts(a)
            try:
                ray.get(arm(a), timeout=10)
            except Exception:
                c = None            # down: the others are armed
            if c is not None:
                armed.append((a, c.get(key, 0)))
        if not armed:
            time.sleep(0.2)
            continue
        _wait_applied(armed, key, replay, min(each_s, max(0.0, deadline - time.monotonic())))
        applied = 0
        for a, before in armed:
            try:
                ray.get(disarm(a), timeout=10)
            except Exception:
                pass                # down: what it had armed died with it
            c = _counts(a)
            applied += max(0, (c or {}).get(key, 0) - before)
        if applied:
            return applied
    return 0


def _corrupt_until_pulled(cluster: PDCluster, replay: _Replay, lease_s: float, log: dict,
                          timeout_s: float = 90.0) -> bool:
    """Arm a corruption on every prefill worker (the next staging anywhere takes it) until a
    corrupted copy reached a decode worker: a corrupted staging that nothing pulled (its
    request aborted, its P killed, its lease ran out) is no transfer, so it is armed again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and replay.finished < len(replay.prompts):
        armed = []
        for p in list(cluster.prefill):
            try:
                armed.append((p, ray.get(p.arm_corruption.remote(), timeout=10)))
            except Exception:
                pass   # that P is down: the others are armed
        hit: list = []
        nudge = _Nudge(replay)
        while (armed and not hit and time.monotonic() < deadline
               and replay.finished < len(replay.prompts)):
            nudge()                           # no staging has met it yet: let a request in
            for p, fid in armed:
                try:
                    if (tid := ray.get(p.corruption_applied.remote(fid), timeout=10)):
                        hit.append(tuple(tid))
                except Exception:
                    pass   # P died meanwhile: whatever it staged died with it
            time.sleep(0.05)
        for p, fid in armed:     # disarm the rest; one that landed meanwhile counts too
            try:
                tid = ray.get(p.corruption_applied.remote(fid, disarm=True), timeout=10)
                if tid and tuple(tid) not in hit:
                    hit.append(tuple(tid))
            except Exception:
                pass
        with _TALLY:
            log["corrupt_staged"].extend(hit)
        # the staged copy is pulled within its lease, or never (then its pages are freed)
        until = time.monotonic() + lease_s + 5.0
        while hit and time.monotonic() < until:
            pulled, _ = _corrupt_audit(cluster, hit)
            if pulled:
                return True
            time.sleep(0.1)
    return False


def run_chaos_bench(kills: int = 5, faults: tuple[str, ...] = ("kill",), model: str = "tiny",
                    requests: int = 100, max_tokens: int = 32, seed: int = 0,
                    deadline_s: float = 120.0, transport: str = "object_store",
                    lease_s: float = 2.0, concurrency: int = 12,
                    engine: dict | None = None) -> dict:
    """`engine`: EngineConfig fields (the config chain's; `model` and the pool are this
    bench's). Transfers always go to the prefill pool (no backlog rule), as recorded."""
    unknown = set(faults) - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; valid: {', '.join(FAULT_KINDS)}")
    from workers.model_loader import load_model
    vocab = min(load_model(model)[2].vocab_size, 30000)
    prompts = _workload(requests, seed, vocab)
    sampling = SamplingParams(max_tokens=max_tokens)
    reference = references(model, prompts, max_tokens)

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    cluster = PDCluster(PDConfig(engine={**(engine or {}), "model": model, "num_blocks": 512},
                                 num_prefill=2, num_decode=2, lease_s=lease_s,
                                 max_restarts=kills + 2, fault_injection=True,
                                 flow=FlowConfig(transport=transport, max_retries=3,
                                                 request_timeout_s=deadline_s,
                                                 local_prefill_when_backlogged=False)))
    rng = random.Random(seed + 1)
    events = [k for k in faults for _ in range(kills)]
    rng.shuffle(events)
    log: dict = {"killed": [], "corrupt_staged": [], "delays_applied": 0,
                 "acks_dropped": 0, "client_aborts": 0, "not_injected": []}
    replay = _Replay(cluster, prompts, sampling, deadline_s, concurrency)

    # the feeder keeps requests coming only up to a little past the next fault, so that every
    # fault meets requests in flight however long the previous one took (a restart, say), and
    # holds the last `tail` back until every fault landed: a fault that waits for traffic (a
    # staging, a pull, an ack) lets them in one at a time (`more`)
    tail = min(max(concurrency, len(prompts) // 4), len(prompts) // 2)

    def threshold(j: int) -> int:     # fault j fires once this many requests have finished
        return (j + 1) * (len(prompts) - tail) // (len(events) + 1)

    def allow(n: int) -> None:
        replay.allow(min(n, len(prompts) - tail))
    replay.allowed = min(threshold(0) + 2 * concurrency, len(prompts) - tail)
    t0 = time.monotonic()
    replay.start()
    kill_no = 0
    injectors: list[threading.Thread] = []
    stalled_at = None
    for j, kind in enumerate(events):   # each fault once another slice of requests finished
        if not replay.wait_progress(threshold(j), deadline_s):
            stalled_at = replay.finished       # no progress: the rest are never injected
            log["not_injected"].extend(events[j:])
            break
        args = (kind, cluster, replay, random.Random(rng.random()), kill_no, lease_s, log)
        if kind == "kill":    # one worker down at a time: the next fault waits for its restart
            _inject(*args)
            kill_no += 1
            allow(threshold(j + 1) + 2 * concurrency)
            continue
        # in its own thread: a fault that waits to land (a corrupt staging, a streaming
        # request to abort) does not hold back the next one
        t = threading.Thread(target=_inject, args=args, daemon=True)
        t.start()
        injectors.append(t)
        allow(threshold(j + 1) + 2 * concurrency)
    for t in injectors:                          # every fault landed (or gave up) first
        t.join(deadline_s)
    replay.allow(len(prompts))
    replay.wait_all(t0 + deadline_s * 2 + 30)    # the last request starts late: own deadline
    for t in injectors:
        t.join(30)
    wall = time.monotonic() - t0

    ok, explicit, lost = [], [], []
    for i, r in enumerate(replay.results):
        start, end = replay.started_at[i], replay.ended_at[i]
        in_time = end is not None and start is not None and end - start <= deadline_s + 5
        if r is None or not in_time:
            lost.append(i)
            if r is None:
                cluster.abort(replay.rid(i))
        elif "error" not in r:
            ok.append(i)
        elif r["explicit"]:
            explicit.append(i)
        else:
            lost.append(i)
    mismatches = sum(replay.results[i]["result"].token_ids != reference[i] for i in ok)

    count = _drain(cluster, lease_s)
    leaked = count.leaked
    orch = cluster.orchestrator
    pulled, detected = _corrupt_audit(cluster, log["corrupt_staged"])
    failures = verdict(faults, len(prompts), len(ok), len(lost), leaked, mismatches,
                       len(pulled), len(detected), log["not_injected"], stalled_at)
    lcs = [replay.results[i]["result"].lifecycle for i in ok]
    overhead = percentiles([lc.router_overhead_ms for lc in lcs])
    trips = percentiles([lc.handoff_round_trips for lc in lcs])
    out = {"model": model, "transport": transport, "kills": kills, "faults": list(faults),
           "requests_total": len(prompts), "requests_ok": len(ok),
           "requests_failed_explicit": len(explicit), "requests_lost": len(lost),
           "corrupt_transfers_injected": len(pulled),
           "corrupt_transfers_detected": len(detected),
           "corrupt_stagings": len(log["corrupt_staged"]),
           "corrupt_not_pulled": len(log["corrupt_staged"]) - len(pulled),
           "leaked_blocks": leaked, "leak_unknown": count.unknown,
           "leak_holders": _holders(cluster) if leaked else {},
           "greedy_mismatches": mismatches,
           "killed": log["killed"], "delays_applied": log["delays_applied"],
           "acks_dropped": log["acks_dropped"], "acks_lost_seen": orch.acks_lost, "client_aborts": log["client_aborts"],
           "transfers_rejected": dict(orch.rejected), "retries": orch.retries,
           "prefill_retries": orch.prefill_retries, "ledger": orch.ledger.counters(),
           "handoff_round_trips_p50": trips["p50"], "handoff_round_trips_max":
           max((lc.handoff_round_trips for lc in lcs), default=None),
           "router_overhead_ms_p50": overhead["p50"], "router_overhead_ms_p99": overhead["p99"],
           "wall_s": wall,
           "faults_not_injected": sorted(log["not_injected"]),
           "stalled_after_requests": stalled_at,
           "passed": not failures, "failures": failures,
           "errors": sorted({replay.results[i]["error"].split(":")[0] for i in explicit}),
           "lost_errors": sorted({(replay.results[i] or {}).get("error", "no end")[:120]
                                  for i in lost})}
    cluster.shutdown()
    if started_ray:
        ray.shutdown()
    return out


def verdict(faults: tuple[str, ...], total: int, ok: int, lost: int, leaked: int | None,
            mismatches: int, corrupt_pulled: int, corrupt_detected: int,
            not_injected: list[str], stalled_at: int | None) -> list[str]:
    """Why the run failed (empty: it passed). A fault that was asked for and never applied
    fails it: a run that exercised nothing has shown nothing."""
    out = []
    if stalled_at is not None:
        out.append(f"progress stalled after {stalled_at} of {total} requests")
    if not_injected:
        out.append("faults not injected: " + ", ".join(sorted(not_injected)))
    if "corrupt" in faults and corrupt_pulled == 0:
        out.append("no corrupt transfer was exercised (no corrupted copy reached a decode "
                   "worker)")
    if corrupt_detected < corrupt_pulled:
        out.append(f"corrupt transfers not detected: {corrupt_pulled - corrupt_detected} of "
                   f"{corrupt_pulled}")
    if lost:
        out.append(f"requests lost: {lost}")
    if leaked is None:
        out.append("leaked blocks: unknown (a worker could not be counted: leak_unknown)")
    elif leaked:
        out.append(f"leaked blocks: {leaked}")
    if mismatches:
        out.append(f"greedy mismatches: {mismatches}")
    if ok < 0.9 * total:
        out.append(f"only {ok} of {total} requests completed (< 90%)")
    return out


def _corrupt_audit(cluster: PDCluster, staged: list[tuple[str, str]]
                   ) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Of the staged copies P corrupted, (prefill worker, worker request id), the ones whose
    pages reached a decode worker (a corrupt *transfer*), and of those the ones refused as
    corrupt. Sources: each live decode worker's own record of the pages it verified, and the
    router's trail of the rejections it was told of (which outlives a decode worker that died
    after refusing). A corrupted staging that nothing pulled (its request was aborted, its P
    killed, its lease ran out first) is no transfer: it counts under `corrupt_not_pulled`."""
    wanted = set(staged)
    pulled: set[tuple[str, str]] = set()
    detected: set[tuple[str, str]] = set()
    for d in cluster.decode:
        try:
            got, bad = ray.get(d.transfers_seen.remote(sorted(wanted)), timeout=30)
        except Exception:
            continue
        pulled.update(map(tuple, got))
        detected.update(map(tuple, bad))
    for reason, pid, rid in list(cluster.orchestrator.recent_rejections):
        if reason == "corrupt" and (pid, rid) in wanted:
            pulled.add((pid, rid))
            detected.add((pid, rid))
    return pulled, detected


def _holders(cluster: PDCluster) -> dict[str, dict[str, str]]:
    """Per live worker, the requests still referencing blocks (and the router's open holds)."""
    out: dict[str, dict[str, str]] = {}
    for w in list(cluster.workers):
        try:
            held = ray.get(w.block_holders.remote(), timeout=10)
        except Exception:
            continue
        if held:
            out[cluster.orchestrator.fleet.worker_id(w)] = held
    for h in cluster.orchestrator.ledger.open_holds():
        out.setdefault(h.worker_id, {})[h.request_id] = f"ledger {h.kind} hold, {h.num_blocks}"
    return out


def _drain(cluster: PDCluster, lease_s: float, timeout_s: float = 60.0) -> LeakCount:
    """Wait for leases to run out and reports to close the ledger; then count what is held.
    An unknown worker is waited for too (a killed one answers once Ray restarted it); one
    still unknown at the deadline stays unknown, and the run fails on it."""
    deadline = time.time() + max(timeout_s, 4 * lease_s)
    while True:
        try:
            cluster.expire_leases()
        except Exception:
            pass
        cluster.orchestrator.fleet.refresh()
        count = cluster.leak_count()
        if count.leaked == 0 or time.time() >= deadline:
            return count
        time.sleep(0.5)
