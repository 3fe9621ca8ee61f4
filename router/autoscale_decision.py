"""The SLO-driven P:D autoscaler: what the router observed (load reports, a window of requests)
-> an Observation -> the planner's pool sizes -> the controller's decision (min/max, cooldowns,
one worker at a time down), the same code live and in the simulator (raypd/sim/autoscale_sim.py).

Inputs are only what a live router has: the WorkerStates its load reports built (fitted speeds,
queue seconds, KV blocks, batches; router/worker_view.py) and a RequestWindow fed with the
arrivals and completions it saw. Never a cost model, never a worker's true queue: `observe()`
takes nothing else, so two clusters whose reports are equal get equal decisions.

The planner (`plan`), per role, in worker-equivalents of load (1.0 = one worker busy all the
time; the pool is sized so the load sits at `target_utilisation` of it):

  prefill load = arrival rate x seconds one mean request takes on the pooled prefill fit (its
                 uncached part: the window's mean prompt less the mean prefix hit), or the
                 queued prefill seconds the reports show / the TTFT SLO when that is more
                 (a backlog one SLO long needs that many workers to clear it in time)
  decode load  = concurrent sequences needed / sequences one worker holds, where one worker
                 holds min(the largest batch whose fitted step meets the TPOT SLO, the
                 requests its KV pool holds: total blocks / the blocks a request reserves as
                 the reports show them), and the sequences needed are arrival rate x mean
                 output x the fitted step at that batch (Little's law); or the KV blocks the
                 decode pool holds now / one worker's blocks, when that is more
  SLO feedback, on the requests that ended in the last `recent_s` (2 intervals), at least
                `min_samples` of them, and only while no worker of the role is starting (the
                last push has not shown yet): when fewer than `percentile`% met the TTFT SLO
                among those whose uncached prompt alone fits it on the prefill fit (no worker
                fixes the others), prefill gets one more worker when its queues are long
                (mean wait >= `queue_share` x the SLO) and decode has KV free; else decode
                does (admission waits for decode KV, or the handoff to decode is slow);
                when fewer than that share of the requests that decoded met the TPOT SLO,
                decode gets one more (a shed request is no decode worker's miss).
  up:   ceil(load / target_utilisation) workers, when more than now (starting ones count).
  down: one worker, when load / (workers - 1) < `shrink_utilisation` (hysteresis: a pool
        never shrinks to where it would grow again at once), the role has no SLO push, and
        its cooldown has passed.
A role without a fit (no worker measured its speed yet) holds its size and says so.

Cooldowns (per role, from its last change): `up_cooldown_s` before another scale-up (shorter:
a burst must be met; workers still starting count in the size, so this does not overshoot),
`cooldown_s` before a scale-down (longer: a pool grown for a burst stays while it may return),
and a scale-down only when every plan of the last `cooldown_s` asked for fewer.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from protocol.step_rates import DecodeFit, PrefillFit
from router.percentiles import percentile as _percentile
from router.policies import Locality, WorkerState

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MAX_BATCH_PROBE = 4096        # the largest decode batch the planner considers


class AutoscaleConfigError(ValueError):
    """An AutoscaleConfig value is wrong; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class AutoscaleConfig:
    """`router.autoscale` in the config. Sizes count workers of a role, starting ones
    included; `max_total` caps both roles together (a GPU budget; 0: no cap)."""

    enabled: bool = False
    min_prefill: int = 0          # 0: colocated mode is allowed (decode prefills)
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_total: int = 0
    ttft_s: float = 2.0           # TTFT SLO, s
    tpot_s: float = 0.2           # TPOT SLO, s
    percentile: float = 90.0      # % of requests that must meet each SLO
    interval_s: float = 5.0       # evaluation interval
    cooldown_s: float = 30.0      # no scale-down of a role within this of its last change
    up_cooldown_s: float = 10.0   # no scale-up of a role within this of its last change
    window_s: float = 60.0        # observation window of the request figures
    target_utilisation: float = 0.7   # a pool is sized so its load is this share of it
    shrink_utilisation: float = 0.5   # shrink only if the load fits at this share in one less
    queue_share: float = 0.1      # TTFT misses push prefill when its mean wait >= this x SLO
    kv_free_share: float = 0.1    # ... decode when its KV free share is under this, or when
                                  # the prefill queues are shorter (the handoff, not the queue)
    min_samples: int = 10         # finished requests before the SLO feedback acts
    history: int = 256            # decisions kept for status
    rebalance: bool = True        # live: running decodes move from the busiest decode worker
                                  # to the idlest (a worker that joined takes its share)

    def validate(self) -> None:
        """Raises AutoscaleConfigError naming the first wrong field."""
        for name in ("min_prefill", "max_prefill", "max_total", "min_samples"):
            if getattr(self, name) < 0:
                raise AutoscaleConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("min_decode", "max_decode", "history"):
            if getattr(self, name) < 1:
                raise AutoscaleConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_prefill < self.min_prefill:
            raise AutoscaleConfigError("max_prefill", f"must be >= min_prefill "
                                       f"({self.min_prefill}), got {self.max_prefill}")
        if self.max_decode < self.min_decode:
            raise AutoscaleConfigError("max_decode", f"must be >= min_decode "
                                       f"({self.min_decode}), got {self.max_decode}")
        if self.max_total and self.max_total < self.min_prefill + self.min_decode:
            raise AutoscaleConfigError("max_total", "must be 0 (no cap) or >= min_prefill + "
                                       f"min_decode, got {self.max_total}")
        for name in ("ttft_s", "tpot_s", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise AutoscaleConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("cooldown_s", "up_cooldown_s"):
            if getattr(self, name) < 0:
                raise AutoscaleConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not 0 < self.percentile <= 100:
            raise AutoscaleConfigError("percentile", f"must be in (0, 100], got "
                                       f"{self.percentile}")
        if not 0 <= self.queue_share <= 1:
            raise AutoscaleConfigError("queue_share", f"must be in [0, 1], got "
                                       f"{self.queue_share}")
        if not 0 < self.target_utilisation <= 1:
            raise AutoscaleConfigError("target_utilisation", "must be in (0, 1], got "
                                       f"{self.target_utilisation}")
        if not 0 < self.shrink_utilisation <= self.target_utilisation:
            raise AutoscaleConfigError("shrink_utilisation", "must be in (0, "
                                       f"target_utilisation], got {self.shrink_utilisation}")
        if not 0 <= self.kv_free_share < 1:
            raise AutoscaleConfigError("kv_free_share", f"must be in [0, 1), got "
                                       f"{self.kv_free_share}")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else \
            (self.min_decode, self.max_decode)


# ---- what the router saw of its requests ------------------------------------------------------
@dataclass(frozen=True)
class WindowFigures:
    """The RequestWindow over its last `window_s` (rates per second of the window; means None
    without samples; attainment shares of finished requests, failed ones missed)."""

    arrivals: int = 0
    arrival_rate: float = 0.0          # over the window
    recent_arrival_rate: float = 0.0   # over its last `recent_s` (a burst shows here first)
    mean_prompt_tokens: float | None = None    # of arrivals
    mean_max_tokens: float | None = None       # of arrivals
    finished: int = 0
    failed: int = 0
    mean_uncached_tokens: float | None = None  # arrivals' mean prompt x finished share uncached
    mean_output_tokens: float | None = None    # of finished ok requests
    slo_attainment: float | None = None        # both SLOs met
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None
    ttft_p_s: float | None = None              # at the window's percentile, ok requests
    tpot_p_s: float | None = None
    # what the SLO feedback reads, over the last `recent_s` only (a change shows there first):
    recent_finished: int = 0
    recent_ttft_attainment: float | None = None  # of the requests whose prompt alone fits the
                                                 # TTFT SLO on the prefill fit (more workers
                                                 # cannot help the others); failed ones missed
    recent_tpot_attainment: float | None = None  # of the requests that decoded (a shed one
                                                 # is no decode worker's miss)


class RequestWindow:
    """The requests the router saw over the last `window_s`: each arrival (prompt length, the
    client's max_tokens) and each end (tokens, TTFT, TPOT, whether it ended well). Times are
    the caller's clock, non-decreasing per kind. Thread-safe: one lock around every access."""

    def __init__(self, window_s: float = 60.0, ttft_s: float = 2.0, tpot_s: float = 0.2,
                 percentile: float = 90.0, recent_s: float = 10.0) -> None:
        assert window_s > 0 and recent_s > 0, (window_s, recent_s)
        self.window_s, self.recent_s = window_s, min(recent_s, window_s)
        self.ttft_s, self.tpot_s, self.percentile = ttft_s, tpot_s, percentile
        self._lock = threading.Lock()
        self._arrivals: deque[tuple[float, int, int]] = deque()
        self._ends: deque[tuple[float, int, int, int, float | None, float | None, bool]] = \
            deque()
        self._start: float | None = None

    @classmethod
    def for_config(cls, cfg: AutoscaleConfig) -> RequestWindow:
        return cls(cfg.window_s, cfg.ttft_s, cfg.tpot_s, cfg.percentile, 2 * cfg.interval_s)

    def arrive(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        with self._lock:
            self._begin(now)
            self._arrivals.append((now, prompt_tokens, max_tokens))
            self._trim(now)

    def record(self, now: float, prompt_tokens: int, cached_tokens: int, output_tokens: int,
               ttft_s: float | None, tpot_s: float | None, ok: bool) -> None:
        """A request ended at `now`: `ok` False (failed, shed, timed out) counts as a miss."""
        with self._lock:
            self._begin(now)
            self._ends.append((now, prompt_tokens, cached_tokens, output_tokens, ttft_s,
                               tpot_s, ok))
            self._trim(now)

    def _begin(self, now: float) -> None:
        if self._start is None:
            self._start = now

    def _trim(self, now: float) -> None:
        cut = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < cut:
            self._arrivals.popleft()
        while self._ends and self._ends[0][0] < cut:
            self._ends.popleft()

    def figures(self, now: float, prefill_fit: PrefillFit | None = None) -> WindowFigures:
        """The window's figures at `now`; `prefill_fit` tells which requests could meet the
        TTFT SLO at all (their uncached prompt alone within it; all of them without a fit)."""
        with self._lock:
            self._trim(now)
            arrivals, ends = list(self._arrivals), list(self._ends)
            start = now if self._start is None else self._start
        # a window younger than window_s divides by its age (at least one second)
        span = max(1.0, min(self.window_s, now - start))
        recent_span = max(1.0, min(self.recent_s, now - start))
        recent_arrivals = sum(1 for t, *_ in arrivals if t >= now - self.recent_s)
        ok = [e for e in ends if e[6]]
        mean_prompt = _mean([a[1] for a in arrivals])
        uncached = None
        prompt_done = sum(e[1] for e in ok)
        if mean_prompt is not None:
            share = 1.0 - sum(e[2] for e in ok) / prompt_done if prompt_done else 1.0
            uncached = mean_prompt * share
        ttft_met = [self._ttft_met(e) for e in ends]
        tpot_met = [self._tpot_met(e) for e in ends]
        n = len(ends)
        cut = now - self.recent_s
        recent = [e for e in ends if e[0] >= cut]
        feasible = [e for e in recent if prefill_fit is None or
                    prefill_fit.seconds(e[1], e[2]) <= self.ttft_s]
        decoded = [e for e in recent if e[6]]
        return WindowFigures(
            arrivals=len(arrivals), arrival_rate=len(arrivals) / span,
            recent_arrival_rate=recent_arrivals / recent_span, mean_prompt_tokens=mean_prompt,
            mean_max_tokens=_mean([a[2] for a in arrivals]), finished=n,
            failed=n - len(ok), mean_uncached_tokens=uncached,
            mean_output_tokens=_mean([e[3] for e in ok]),
            slo_attainment=sum(a and b for a, b in zip(ttft_met, tpot_met, strict=True)) / n
            if n else None,
            ttft_attainment=sum(ttft_met) / n if n else None,
            tpot_attainment=sum(tpot_met) / n if n else None,
            ttft_p_s=_pct([e[4] for e in ok if e[4] is not None], self.percentile),
            tpot_p_s=_pct([e[5] for e in ok if e[5] is not None], self.percentile),
            recent_finished=len(recent),
            recent_ttft_attainment=sum(self._ttft_met(e) for e in feasible) / len(feasible)
            if feasible else None,
            recent_tpot_attainment=sum(self._tpot_met(e) for e in decoded) / len(decoded)
            if decoded else None)

    def _ttft_met(self, e: tuple) -> bool:
        return e[6] and e[4] is not None and e[4] <= self.ttft_s

    def _tpot_met(self, e: tuple) -> bool:
        return e[6] and e[5] is not None and e[5] <= self.tpot_s


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pct(xs: Sequence[float], q: float) -> float | None:
    return _percentile(xs, q) if xs else None


# ---- the observation ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """Everything the controller decides from, made by `observe()` from the router's
    WorkerStates and RequestWindow only. Worker counts: live (taking work), starting (launched,
    not yet reporting) and draining (no new work; not counted in the pool's size)."""

    now: float
    prefill_workers: int
    decode_workers: int
    prefill_starting: int
    decode_starting: int
    prefill_draining: int
    decode_draining: int
    prefill_fit: PrefillFit | None       # the median of the live prefill workers' fits
    decode_fit: DecodeFit | None         # the median of the live decode workers' fits
    prefill_wait_s: float                # queued prefill seconds, summed over live workers
    decode_requests: int                 # admitted to live decode workers (all states)
    decode_batch: int                    # decoding now, summed
    decode_active_blocks: int            # KV blocks held, summed over live decode workers
    decode_total_blocks: int
    decode_free_blocks: int
    window: WindowFigures

    def to_dict(self) -> dict:
        return asdict(self)


def observe(prefill_states: Sequence[WorkerState], decode_states: Sequence[WorkerState],
            window: RequestWindow, now: float, prefill_starting: int = 0,
            decode_starting: int = 0) -> Observation:
    """The Observation of the router's view at `now`: a function of the states' reported
    fields (WorkerState holds nothing else), the window's figures and the counts of workers
    the caller launched that do not report yet."""
    p_live = [s for s in prefill_states if not s.draining]
    d_live = [s for s in decode_states if not s.draining]
    pfit = Locality.pooled_fit(p_live)
    wait = 0.0
    for s in p_live:
        w = s.wait_s(s.prefill_fit or pfit, now)
        wait += w or 0.0
    return Observation(
        now=now, prefill_workers=len(p_live), decode_workers=len(d_live),
        prefill_starting=prefill_starting, decode_starting=decode_starting,
        prefill_draining=len(prefill_states) - len(p_live),
        decode_draining=len(decode_states) - len(d_live),
        prefill_fit=pfit, decode_fit=_median_decode_fit(d_live), prefill_wait_s=wait,
        decode_requests=sum(s.num_requests for s in d_live),
        decode_batch=sum(s.decode_batch for s in d_live),
        decode_active_blocks=sum(s.active_blocks for s in d_live),
        decode_total_blocks=sum(s.total_blocks for s in d_live),
        decode_free_blocks=sum(s.free_blocks for s in d_live),
        window=window.figures(now, pfit))


def _median_decode_fit(states: Sequence[WorkerState]) -> DecodeFit | None:
    """The median of the workers' decode fits, ranked by a step of 16 sequences of 2,048
    tokens (a reference point); None if none has one."""
    fits = sorted((s.decode_fit for s in states if s.decode_fit is not None),
                  key=lambda f: f.step_s(16, 16 * 2048))
    return fits[len(fits) // 2] if fits else None


# ---- the planner -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolePlan:
    """The planner's size for one role: `load` in worker-equivalents (None: no fit), the
    size it asks for (before min/max, cooldown and budget), why, and the figures used."""

    role: str
    current: int                 # live + starting
    load: float | None
    target: int
    reason: str
    inputs: dict = field(default_factory=dict)


def plan(obs: Observation, cfg: AutoscaleConfig) -> tuple[RolePlan, RolePlan]:
    """(prefill, decode) sizes from `obs` alone (module doc). Pure."""
    return _plan_prefill(obs, cfg), _plan_decode(obs, cfg)


def _slo_share(cfg: AutoscaleConfig) -> float:
    return cfg.percentile / 100.0


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _missed(att: float | None, obs: Observation, cfg: AutoscaleConfig,
            starting: int) -> bool:
    """Recent requests missed the SLO share (enough of them to tell), and no worker of the
    role is still starting (the last push has not shown its effect yet)."""
    return att is not None and obs.window.recent_finished >= cfg.min_samples and \
        att < _slo_share(cfg) and starting == 0


def _size(load: float, current: int, cfg: AutoscaleConfig, push: bool, why: str,
          floor: int) -> tuple[int, str]:
    """Up to ceil(load / target_utilisation); one down (never below `floor`) when the load
    fits one less at shrink_utilisation and nothing pushes; a push asks for one more."""
    up = math.ceil(load / cfg.target_utilisation - 1e-9)
    if push:
        return max(up, current + 1), f"{why}: one more"
    if up > current:
        return up, f"load {load:.2f} workers > {cfg.target_utilisation:.0%} of {current}"
    if current > floor and (current == 1 and load == 0.0 or current > 1
                            and load / (current - 1) < cfg.shrink_utilisation):
        return current - 1, f"load {load:.2f} workers < {cfg.shrink_utilisation:.0%} of " \
                            f"{current - 1}"
    return current, f"load {load:.2f} workers fits {current}"


def _plan_prefill(obs: Observation, cfg: AutoscaleConfig) -> RolePlan:
    cur = obs.prefill_workers + obs.prefill_starting
    w, fit = obs.window, obs.prefill_fit
    rate = max(w.arrival_rate, w.recent_arrival_rate)
    if cur == 0:     # colocated mode: decode prefills; requests bring a prefill worker back
        return RolePlan("prefill", 0, None, int(rate > 0), "no prefill worker: one for the "
                        "arriving requests" if rate > 0 else "no prefill worker, no requests")
    if fit is None:
        return RolePlan("prefill", cur, None, cur, "hold: no prefill fit yet (no live "
                        "prefill worker has measured its speed)")
    prompt = w.mean_prompt_tokens or 0.0
    uncached = w.mean_uncached_tokens if w.mean_uncached_tokens is not None else prompt
    per_req = fit.seconds(round(prompt), round(prompt - uncached)) if prompt >= 1 else 0.0
    flow = rate * per_req
    backlog = obs.prefill_wait_s / cfg.ttft_s
    load = max(flow, backlog)
    mean_wait = obs.prefill_wait_s / obs.prefill_workers if obs.prefill_workers else 0.0
    free_share = obs.decode_free_blocks / obs.decode_total_blocks if obs.decode_total_blocks \
        else 1.0
    queued = mean_wait >= cfg.queue_share * cfg.ttft_s
    push = _missed(w.recent_ttft_attainment, obs, cfg, obs.prefill_starting) and queued and \
        free_share >= cfg.kv_free_share       # else admission waits for decode KV: decode's
    target, reason = _size(load, cur, cfg, push, "recent TTFT attainment "
                           f"{_share(w.recent_ttft_attainment)} under {_slo_share(cfg):.0%} "
                           f"(prefill queues {mean_wait:.2f} s)", floor=0)
    return RolePlan("prefill", cur, load, target, reason, {
        "arrival_rate": rate, "mean_prompt_tokens": prompt, "mean_uncached_tokens": uncached,
        "request_prefill_s": per_req, "flow_load": flow, "backlog_load": backlog,
        "mean_wait_s": mean_wait, "ttft_push": push})


def _plan_decode(obs: Observation, cfg: AutoscaleConfig) -> RolePlan:
    cur = obs.decode_workers + obs.decode_starting
    w, fit = obs.window, obs.decode_fit
    if fit is None:
        return RolePlan("decode", cur, None, cur, "hold: no decode fit yet (no live decode "
                        "worker has measured its steps)")
    rate = max(w.arrival_rate, w.recent_arrival_rate)
    prompt = w.mean_prompt_tokens or 0.0
    out = w.mean_output_tokens if w.mean_output_tokens is not None else \
        (w.mean_max_tokens or 0.0)
    ctx = prompt + out / 2.0
    batch = 1     # the largest batch whose fitted step meets the TPOT SLO
    lo, hi = 1, MAX_BATCH_PROBE
    while lo <= hi:
        mid = (lo + hi) // 2
        if fit.step_s(mid, round(mid * ctx)) <= cfg.tpot_s:
            batch, lo = mid, mid + 1
        else:
            hi = mid - 1
    per_worker_blocks = obs.decode_total_blocks / obs.decode_workers if obs.decode_workers \
        else 0.0
    req_blocks = obs.decode_active_blocks / obs.decode_requests if obs.decode_requests \
        else None
    kv_seqs = per_worker_blocks / req_blocks if req_blocks else None
    seqs = max(1, min(batch, math.floor(kv_seqs))) if kv_seqs is not None else batch
    step = fit.step_s(seqs, round(seqs * ctx))
    needed = rate * out * step          # sequences in flight (Little's law)
    flow = needed / seqs
    held = obs.decode_active_blocks / per_worker_blocks if per_worker_blocks else 0.0
    load = max(flow, held)
    free_share = obs.decode_free_blocks / obs.decode_total_blocks if obs.decode_total_blocks \
        else 1.0
    mean_wait = obs.prefill_wait_s / obs.prefill_workers if obs.prefill_workers else 0.0
    kv_push = _missed(w.recent_ttft_attainment, obs, cfg, obs.decode_starting) and \
        (free_share < cfg.kv_free_share or mean_wait < cfg.queue_share * cfg.ttft_s)
    tpot_push = _missed(w.recent_tpot_attainment, obs, cfg, obs.decode_starting)
    why = f"recent TPOT attainment {_share(w.recent_tpot_attainment)} under " \
          f"{_slo_share(cfg):.0%}" if tpot_push else \
        f"recent TTFT misses with decode KV {free_share:.0%} free, prefill queues " \
        f"{mean_wait:.2f} s"
    target, reason = _size(load, cur, cfg, kv_push or tpot_push, why, floor=1)
    return RolePlan("decode", cur, load, target, reason, {
        "arrival_rate": rate, "mean_output_tokens": out, "mean_context_tokens": ctx,
        "tpot_batch": batch, "kv_seqs_per_worker": kv_seqs, "seqs_per_worker": seqs,
        "step_s": step, "seqs_needed": needed, "flow_load": flow, "kv_held_load": held,
        "kv_free_share": free_share, "kv_push": kv_push, "tpot_push": tpot_push})


# ---- the controller ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    target: int                 # what the controller asks for (min/max, cooldown, budget)
    planned: int                # what the planner asked for
    changed: bool
    reason: str
    inputs: dict


@dataclass(frozen=True)
class Decision:
    """One evaluation: the target sizes (live + starting, after the change), per role why,
    and the Observation it came from."""

    at: float
    prefill: int
    decode: int
    changed: bool
    roles: tuple[RoleDecision, RoleDecision]
    observation: Observation

    @property
    def prefill_reason(self) -> str:
        return self.roles[0].reason

    @property
    def decode_reason(self) -> str:
        return self.roles[1].reason

    def to_dict(self) -> dict:
        return {"at": self.at, "prefill": self.prefill, "decode": self.decode,
                "changed": self.changed,
                "roles": {r.role: asdict(r) for r in self.roles},
                "observation": self.observation.to_dict()}


class Controller:
    """Decides every `interval_s` (the caller's clock: `due(now)`, then `decide(obs, now)`).
    Invariants of every Decision: min <= size <= max per role (a size outside is brought
    back first, even without a fit), prefill + decode <= max_total when set, a scale-down
    is one worker, no role changes within its cooldown of its last change, and a pool
    shrinks only when every plan of the last `cooldown_s` asked for fewer workers (the
    stabilization window Kubernetes' autoscaler uses for scale-down: one low reading inside a
    burst does not drain a worker that the next reading wants back)."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.history: deque[Decision] = deque(maxlen=cfg.history)
        self.last_change: dict[str, float] = {}
        self.scale_ups = {r: 0 for r in ROLES}
        self.scale_downs = {r: 0 for r in ROLES}
        self._last_eval: float | None = None
        self._lock = threading.Lock()
        # per role, (time, planned size) of the evaluations of the last cooldown_s: a pool
        # shrinks only when every one of them asked for fewer (a dip inside a burst does not)
        self._planned: dict[str, deque[tuple[float, int]]] = {r: deque() for r in ROLES}

    def due(self, now: float) -> bool:
        return self._last_eval is None or now - self._last_eval >= self.cfg.interval_s - 1e-9

    def decide(self, obs: Observation, now: float) -> Decision:
        with self._lock:
            self._last_eval = now
            plans = plan(obs, self.cfg)
            roles = [self._role(p, now) for p in plans]
            roles = self._budget(roles)
            for r in roles:
                if r.changed:
                    self.last_change[r.role] = now
                    (self.scale_ups if r.target > r.current else self.scale_downs)[r.role] += 1
            d = Decision(now, roles[0].target, roles[1].target,
                         any(r.changed for r in roles), (roles[0], roles[1]), obs)
            self.history.append(d)
        level = logging.INFO if d.changed else logging.DEBUG
        log.log(level, "autoscale at %.1f: prefill %d -> %d (%s), decode %d -> %d (%s); "
                "inputs %s", now, roles[0].current, d.prefill, roles[0].reason,
                roles[1].current, d.decode, roles[1].reason,
                {r.role: r.inputs for r in roles})
        return d

    def _role(self, p: RolePlan, now: float) -> RoleDecision:
        lo, hi = self.cfg.bounds(p.role)
        cur, want, reason = p.current, p.target, p.reason
        since = now - self.last_change.get(p.role, -math.inf)
        planned = self._planned[p.role]
        planned.append((now, p.target))
        while planned and planned[0][0] < now - self.cfg.cooldown_s:
            planned.popleft()
        stable = max(t for _, t in planned)    # the most any plan of the window asked for
        if cur < lo:
            want, reason = lo, f"below min_{p.role} {lo}"
        elif cur > hi:
            want, reason = cur - 1, f"above max_{p.role} {hi}"
        else:
            want = min(max(want, lo), hi)
            if want < cur:
                want = cur - 1          # down one worker at a time
                if since < self.cfg.cooldown_s:
                    want, reason = cur, f"hold (cooldown {self.cfg.cooldown_s:g} s): {reason}"
                elif stable >= cur:
                    want, reason = cur, f"hold (a plan of the last {self.cfg.cooldown_s:g} s " \
                                        f"asked for {stable}): {reason}"
            elif want > cur and since < self.cfg.up_cooldown_s:
                want, reason = cur, f"hold (up cooldown {self.cfg.up_cooldown_s:g} s): " \
                                    f"{reason}"
            elif want == cur and p.target != cur:
                reason = f"hold at the {'max' if p.target > cur else 'min'}: {reason}"
        inputs = {"load": p.load, "planned": p.target, **p.inputs}
        return RoleDecision(p.role, cur, want, p.target, want != cur, reason, inputs)

    def _budget(self, roles: list[RoleDecision]) -> list[RoleDecision]:
        """Take back scale-ups (the larger first) that would pass max_total."""
        cap = self.cfg.max_total
        over = sum(r.target for r in roles) - cap if cap else 0
        if over <= 0:
            return roles
        targets = [r.target for r in roles]
        while over > 0:
            ups = [t - r.current for t, r in zip(targets, roles, strict=True)]
            i = max(range(len(roles)), key=lambda i: ups[i])
            if ups[i] <= 0:
                break
            targets[i] -= 1
            over -= 1
        out = []
        for r, t in zip(roles, targets, strict=True):
            if t != r.target:
                r = RoleDecision(r.role, r.current, t, r.planned, t != r.current,
                                 f"{r.reason} (capped by max_total {cap})", r.inputs)
            out.append(r)
        return out

    def to_dict(self) -> dict:
        """For a status endpoint and metrics: config, counts, the last decisions."""
        with self._lock:
            hist = list(self.history)
        return {"config": asdict(self.cfg), "scale_ups": dict(self.scale_ups),
                "scale_downs": dict(self.scale_downs), "last_change": dict(self.last_change),
                "last": hist[-1].to_dict() if hist else None,
                "history": [d.to_dict() for d in hist]}
