"""Routing policies: which prefill worker computes a request and which decode worker takes it,
from the workers' load and the prefix index's per-worker match counts.

Policies by name (`make_policy`):
  round_robin   next worker in turn;
  least_loaded  fewest queued + running prefill tokens;
  cache_aware   SGLang router: if load is imbalanced (absolute and relative thresholds on
                in-flight requests) -> shortest queue; else the best match if its match ratio
                passes `cache_threshold`; else the worker with the smallest routing-history tree;
  kv_cost       Dynamo KV router: argmin of overlap_weight x potential prefill blocks (queued
                + this request's uncached) + potential active blocks;
  locality      ours (default): Mooncake-Conductor style estimated TTFT per worker = queue wait
                + prefill time of the uncached part + KV transfer time, from the workers' measured
                rates; argmin of that TTFT plus the recompute work it costs everyone queued
                behind; rejects early (SLOUnmeetable -> 429) when no worker can meet the SLO.
Every policy shares one decode choice (BasePolicy.choose_decode).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvcache.hashing import BlockHash
from kvcache.manager import cdiv
from protocol.errors import RoutingRejected, SLOUnmeetable
from protocol.messages import LoadReport
from protocol.step_rates import DecodeFit, PrefillFit
from router.prefix_index import ApproxPrefixIndex


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker at decision time: the fields of its last LoadReport
    (router/worker_view.py applies them), the work the router itself routed there since that
    report, and the transfer bandwidth the router measured from real transfers. Nothing else:
    slots, so a policy cannot find or leave anything more on it. Token counts are tokens still
    to compute, not prompt lengths."""

    worker_id: str
    queued_tokens: int = 0        # prefill tokens waiting in the worker's queue (uncached part)
    running_tokens: int = 0       # prefill tokens still to compute in running requests; for a
                                  # decode worker, the context tokens of its running sequences
    num_requests: int = 0         # requests in flight (queued + running): SGLang's "load"
    active_blocks: int = 0        # KV blocks held by in-flight requests: Dynamo's active blocks
    cached_blocks: int = 0        # prefix-cache blocks the index attributes to the worker
    free_blocks: int = 0          # blocks an allocation could take now (free + evictable)
    total_blocks: int = 0
    queued_s: float | None = None          # reported: seconds of queued + running prefill work
    prefill_tokens: int = 0                # reported: prompt tokens still to compute (queued +
                                           # running; a decode worker's own prefills too)
    prefill_fit: PrefillFit | None = None  # reported: measured prefill speed (None: no data)
    decode_fit: DecodeFit | None = None    # reported: measured decode step time
    decode_batch: int = 0                  # reported: sequences decoding
    decode_step_s: float = 0.0             # reported: decode step at the current batch
    kv_bytes_per_token: int = 0            # reported: of the loaded model
    reported_at: float | None = None       # router clock when the report's snapshot was taken
    routed_s: float = 0.0         # router: estimated seconds of work routed since the report
    routed: list[tuple[float, int, float, str]] = field(default_factory=list)  # router:
                                  # (router time, tokens, seconds, adapter) of each request
                                  # routed since then
    transfer_gbps_to: dict[str, float] = field(default_factory=dict)  # router: measured GB/s
                                  # of KV transfers from this worker to each decode worker
    loras_resident: tuple[str, ...] = ()   # LoRA adapters loaded on the worker now
    lora_load_s: float = 0.0          # measured mean time to load an adapter (0: none yet)
    lora_slots: int = 0               # reported: adapters resident at once (0: unknown/none)
    draining: bool = False

    @property
    def load_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens

    def take_report(self, rep: LoadReport) -> None:
        """The worker's own figures, as its report gives them (what the router added since
        the report is router/worker_view.py's)."""
        self.queued_tokens, self.running_tokens = rep.queued_tokens, rep.running_tokens
        self.num_requests, self.active_blocks = rep.num_requests, rep.active_blocks
        self.cached_blocks, self.free_blocks = rep.cached_blocks, rep.free_blocks
        self.total_blocks, self.queued_s = rep.total_blocks, rep.queued_s
        self.prefill_tokens = rep.prefill_tokens
        self.prefill_fit, self.decode_fit = rep.prefill_fit, rep.decode_fit
        self.decode_batch, self.decode_step_s = rep.decode_batch, rep.decode_step_s
        self.kv_bytes_per_token = rep.kv_bytes_per_token
        self.loras_resident, self.lora_load_s = rep.loras_resident, rep.lora_load_s
        self.lora_slots = rep.lora_slots

    def wait_s(self, fit: PrefillFit | None = None, now: float | None = None) -> float | None:
        """Seconds until this worker could start a new request: its own estimate plus what the
        router sent since; without one, its queued + running tokens at `fit`'s rate (None when
        there is nothing measured to convert tokens into seconds). With `now` (router clock)
        and the report's snapshot time, aged: the worker has worked off its backlog since the
        snapshot, one second a second while it had any, the router's requests joining it as
        they were sent."""
        if self.queued_s is not None:
            if now is None or self.reported_at is None:
                return self.queued_s + self.routed_s
            backlog, t = self.queued_s, self.reported_at
            for at, _, seconds, _ in self.routed:
                backlog = max(0.0, backlog - max(0.0, at - t)) + seconds
                t = max(t, at)
            return max(0.0, backlog - max(0.0, now - t))
        if fit is None:
            return None
        return self.load_tokens / fit.tok_s


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    block_hashes: Sequence[BlockHash]   # chained, under the request's cache namespace
    num_tokens: int                     # prompt tokens
    block_size: int
    tenant: str = ""                    # informational: the tenant is already in the hashes
    output_tokens: int = 0              # expected / max new tokens (decode capacity)
    decode_cached_blocks: int = 0       # leading blocks the chosen decode worker holds
    arrival_s: float | None = None      # router clock at arrival (None: time.monotonic())
    lora: str = ""                      # LoRA adapter name ("" = base; its hash is in the hashes)
    decode_worker: str = ""             # the decode worker already chosen (decode-first)
    ttft_slo_s: float | None = None     # this request's own TTFT SLO (over the policy's)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


class RoutingDecision(NamedTuple):
    worker_id: str
    reason: str                 # cache_hit | balance | least_loaded | round_robin | min_cost |
                                # min_ttft | smallest_tree | decode_fit
    est_ttft_s: float | None    # the policy's estimate, when it makes one
    matched_blocks: int         # leading blocks the chosen worker holds


def cached_tokens(req: RoutingRequest, matched_blocks: int) -> int:
    """Prompt tokens a worker holding `matched_blocks` leading blocks need not compute."""
    return min(matched_blocks * req.block_size, req.num_tokens)


class Policy(Protocol):
    name: str

    def choose_prefill(self, req: RoutingRequest, workers: Sequence[WorkerState],
                       matches: Mapping[str, int]) -> RoutingDecision: ...

    def choose_decode(self, req: RoutingRequest, decode_workers: Sequence[WorkerState],
                      matches: Mapping[str, int]) -> RoutingDecision: ...


def _available(workers: Sequence[WorkerState]) -> list[WorkerState]:
    out = [w for w in workers if not w.draining]
    if not out:
        raise RoutingRejected("no_workers", "no worker is available (all draining or none)")
    return out


class BasePolicy:
    """Shared decode choice; subclasses implement `choose_prefill`."""

    name = "base"

    def __init__(self, decode_transfer_weight: float = 1.0) -> None:
        self.decode_transfer_weight = decode_transfer_weight

    def choose_prefill(self, req: RoutingRequest, workers: Sequence[WorkerState],
                       matches: Mapping[str, int]) -> RoutingDecision:
        raise NotImplementedError

    def choose_decode(self, req: RoutingRequest, decode_workers: Sequence[WorkerState],
                      matches: Mapping[str, int]) -> RoutingDecision:
        """Among decode workers with room for the request, the lowest cost
        transfer_weight x blocks to pull (those it lacks) + (running + queued) tokens / block_size:
        a worker that already holds the prefix pulls less; ties go to the most free blocks."""
        out_blocks = cdiv(req.num_tokens + req.output_tokens, req.block_size)
        best: tuple[float, int] | None = None
        choice: RoutingDecision | None = None
        for w in _available(decode_workers):
            hit = min(matches.get(w.worker_id, 0), req.num_blocks)
            need = out_blocks - hit
            if need > w.free_blocks:
                continue
            cost = self.decode_transfer_weight * (req.num_blocks - hit) \
                + (w.running_tokens + w.queued_tokens) / req.block_size
            key = (cost, -w.free_blocks)
            if best is None or key < best:
                best, choice = key, RoutingDecision(w.worker_id, "decode_fit", None, hit)
        if choice is None:
            raise RoutingRejected("no_decode_capacity",
                                  f"no decode worker has {out_blocks} free blocks")
        return choice


class RoundRobin(BasePolicy):
    name = "round_robin"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._next = 0

    def choose_prefill(self, req, workers, matches):
        ws = _available(workers)
        w = ws[self._next % len(ws)]
        self._next += 1
        return RoutingDecision(w.worker_id, "round_robin", None, matches.get(w.worker_id, 0))


class LeastLoaded(BasePolicy):
    """Fewest queued + running prefill tokens (not requests); ties: fewer requests, then the
    least recently chosen (idle workers take turns)."""

    name = "least_loaded"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._decisions = 0
        self._last_chosen: dict[str, int] = {}

    def choose_prefill(self, req, workers, matches):
        last = self._last_chosen
        w = min(_available(workers),
                key=lambda w: (w.load_tokens, w.num_requests, last.get(w.worker_id, -1)))
        self._decisions += 1
        last[w.worker_id] = self._decisions
        return RoutingDecision(w.worker_id, "least_loaded", None, matches.get(w.worker_id, 0))


class CacheAware(BasePolicy):
    """SGLang router's cache_aware policy, on block hashes instead of characters.

    Load is the number of in-flight requests, as in SGLang. Imbalanced when
    max - min > balance_abs_threshold and max > balance_rel_threshold * min: shortest queue.
    Otherwise the worker with the longest match if matched / request blocks > cache_threshold,
    else the worker whose tree is smallest (ties: fewer in-flight requests). As in SGLang, the
    tree is the policy's own routing history (the blocks routed to each worker, LRU-capped at
    max_tree_blocks), which also predicts blocks still being computed; with
    `use_index_matches=True` matches come from the router's prefix index instead.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_blocks: int = 1 << 17,
                 use_index_matches: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.use_index_matches = use_index_matches
        self.tree = ApproxPrefixIndex(ttl_s=None, max_blocks_per_worker=max_tree_blocks,
                                      clock=lambda: 0.0)

    def choose_prefill(self, req, workers, matches):
        ws = _available(workers)
        if not self.use_index_matches:
            matches = self.tree.match(req.block_hashes, now=0.0)
        loads = [w.num_requests for w in ws]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            w = ws[loads.index(lo)]
            reason = "balance"
        else:
            w = max(ws, key=lambda w: matches.get(w.worker_id, 0))
            best = matches.get(w.worker_id, 0)
            if req.num_blocks and best / req.num_blocks > self.cache_threshold:
                reason = "cache_hit"
            else:
                w = min(ws, key=lambda w: (self.tree.num_blocks(w.worker_id), w.num_requests))
                reason = "smallest_tree"
        self.tree.record(w.worker_id, req.block_hashes, now=0.0)
        return RoutingDecision(w.worker_id, reason, None, matches.get(w.worker_id, 0))


class KVCost(BasePolicy):
    """Dynamo's KV router cost: logit = overlap_score_weight x potential prefill blocks
    + potential active blocks, where potential prefill blocks = (the worker's queued + running
    prefill tokens + this request's uncached tokens) / block_size and potential active blocks =
    the worker's active blocks + the request's new blocks. Temperature 0: argmin, ties broken at
    random as Dynamo does (seeded); > 0: softmax sampling of -logit / temperature over logits
    normalised by their max."""

    name = "kv_cost"

    def __init__(self, overlap_score_weight: float = 1.0, temperature: float = 0.0,
                 seed: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)

    def logits(self, req: RoutingRequest, ws: Sequence[WorkerState],
               matches: Mapping[str, int]) -> list[float]:
        bs = req.block_size
        out = []
        for w in ws:
            hit = matches.get(w.worker_id, 0)
            prefill_tokens = w.load_tokens + req.num_tokens - cached_tokens(req, hit)
            decode_blocks = w.active_blocks + req.num_blocks - hit
            out.append(self.overlap_score_weight * prefill_tokens / bs + decode_blocks)
        return out

    def choose_prefill(self, req, workers, matches):
        ws = _available(workers)
        logits = self.logits(req, ws, matches)
        if self.temperature <= 0:
            lo = min(logits)
            i = self._rng.choice([i for i, x in enumerate(logits) if x <= lo + 1e-9])
        else:
            top = max(logits) or 1.0
            weights = [math.exp(-(x / top) / self.temperature) for x in logits]
            i = self._rng.choices(range(len(ws)), weights=weights)[0]
        w = ws[i]
        return RoutingDecision(w.worker_id, "min_cost", None, matches.get(w.worker_id, 0))


class Locality(BasePolicy):
    """Ours: estimated TTFT per worker, Mooncake-Conductor style, from measured signals only.

      ttft(w)    = wait(w)                       the worker's reported queued + running prefill
                                                 seconds plus what the router sent it since,
                                                 aged by the report's age (WorkerState.wait_s)
                 + compute(w)                    the worker's measured prefill fit on the part of
                                                 the prompt w does not hold
                                                 + loading the request's LoRA adapter when w
                                                 does not hold it (w's measured load time; the
                                                 `lora_load_s` prior until some worker measured),
                                                 twice when its slots are full (the adapter it
                                                 evicts is loaded again by its next request)
                 + transfer(w)                   bytes of the KV the decode worker lacks (the
                                                 reported kv_bytes_per_token) / the GB/s the
                                                 router measured from w to that decode worker
      cost(w)    = ttft(w) + beta * compute(w) + gamma * excess(w) * spread
      overload   = max(1, shortest wait / overload_wait_s)
      beta       = work_weight * overload,   gamma = balance_weight / overload
      spread     = max over workers of compute(w) - min over workers of compute(w): the most
                   compute this request's placement can add (its recompute and adapter load)
      excess(w)  = max(0, sent(w) - balance_ratio * mean)
                   / max(mean, balance_min_requests * spread), where sent(w) is the prefill
                   compute this router sent w, decayed over balance_tau_s (its own decisions)

    A worker with no fit yet is estimated with the median fit of the workers that have one;
    when no worker has measured anything, with the `unmeasured_tok_s` prior: the decision is
    then made (the ranking needs a common unit) but returns est_ttft_s=None and never rejects
    on the SLO. A pair whose bandwidth is unmeasured takes the mean of measured pairs; with no
    measured pair the transfer term is left out (it is the same for every prefill worker).

    The worker of least cost wins; workers within min(`tie_s`, `tie_frac` x the request's
    smallest compute) of it count as tied (a short request's tie is short) and the one
    holding the most leading blocks, then the fewest cached blocks (most room), then the
    least recently chosen wins.

    Why the extra `beta * compute`: recomputing a prefix that another worker holds is work that
    every request queued behind it waits for; pure earliest-TTFT routing spreads a popular
    prefix over every worker that is momentarily free, duplicating it in every cache and
    evicting others' prefixes. Charging the compute again (beta = work_weight, 1 by
    default) keeps a prefix on its holder unless the holder's queue is longer than the
    recompute (a hot prefix then spills to other workers, which pure cache affinity never
    does). When every worker has a queue
    (overload), each recomputed second delays all of them, so beta grows with the shortest
    wait.

    Why the balance term: affinity (a hot prefix, a hot adapter) can keep sending one worker
    more work than the others while its queue is still short enough to win on TTFT; the
    term charges a worker that got more than its share lately in proportion to the excess, so
    the hot work spills before the queue says so (SGLang's router switches to shortest-queue
    on an imbalance threshold; this is the soft form of it). It is charged in the unit of
    what a spill costs, the spread: a holder whose queue is as short as an idle peer's then
    spills once its excess passes (1 + beta) / gamma (0.2 at the defaults), the same relative
    imbalance for a cheap cache hit as for a long prompt (charged in the hit's own compute instead, a hot hit of a few tokens
    outweighed its recompute elsewhere only at several times the mean, and hot prefixes
    hardly ever spilled on the balance term).
    The mean of a handful of requests per worker is noise, not an imbalance: until the mean
    covers `balance_min_requests` spreads, the excess is measured against that many (a cold
    cluster's first seconds place every new prefix once instead of spreading hot prefixes
    over the workers that happened to be idle). In overload every queue says so and each
    recomputed second delays everyone, so the term fades as beta grows. Tuned with the other
    weights on all five bench workloads together, several seeds each (work_weight 1,
    balance_ratio 1, balance_weight 10, balance_tau_s 300, balance_min_requests 32).

    The prefix index only knows blocks whose KV events have arrived, i.e. prefills that have
    finished. Locality also remembers its own decisions until `inflight_margin_s` after their
    estimated TTFT, so a request sharing a prefix that is still being computed can queue
    behind it on the same worker instead of recomputing it elsewhere.

    If even the best estimated TTFT exceeds the request's `ttft_slo_s` (else the policy's),
    raises SLOUnmeetable (429 upstream).
    """

    name = "locality"

    def __init__(self, ttft_slo_s: float | None = None, work_weight: float = 1.0,
                 overload_wait_s: float = 5.0, tie_s: float = 0.05,
                 inflight_margin_s: float = 5.0, lora_load_s: float = 0.05,
                 unmeasured_tok_s: float = 10_000.0, tie_frac: float = 0.1,
                 lora_evict_weight: float = 1.0, balance_ratio: float | None = 1.0,
                 balance_tau_s: float = 300.0, balance_weight: float = 10.0,
                 balance_min_requests: float = 32.0,
                 clock: Callable[[], float] = time.monotonic, **kw) -> None:
        super().__init__(**kw)
        self.balance_ratio = balance_ratio
        self.balance_tau_s = balance_tau_s
        self.balance_weight = balance_weight
        self.balance_min_requests = balance_min_requests
        self._sent: dict[str, tuple[float, float]] = {}   # worker -> (decayed compute s, at)
        self.lora_load_s = lora_load_s
        self.ttft_slo_s = ttft_slo_s
        self.work_weight = work_weight
        self.overload_wait_s = overload_wait_s
        self.tie_s = tie_s
        self.tie_frac = tie_frac
        self.lora_evict_weight = lora_evict_weight
        self.inflight_margin_s = inflight_margin_s
        self.unmeasured_fit = PrefillFit(unmeasured_tok_s, 0.0, 0.0, 0)
        self.clock = clock
        self.inflight = ApproxPrefixIndex(ttl_s=inflight_margin_s, clock=clock)
        self._decisions = 0
        self._last_chosen: dict[str, int] = {}

    @staticmethod
    def pooled_fit(workers: Sequence[WorkerState]) -> PrefillFit | None:
        """The median (by rate) of the workers' measured prefill fits; None if none has one."""
        fits = sorted((w.prefill_fit for w in workers if w.prefill_fit is not None),
                      key=lambda f: f.tok_s)
        return fits[len(fits) // 2] if fits else None

    def estimate(self, req: RoutingRequest, w: WorkerState, matched_blocks: int,
                 fallback: PrefillFit | None = None, lora_load_s: float | None = None,
                 pooled_gbps: float | None = None, now: float | None = None
                 ) -> tuple[float, float]:
        """(estimated TTFT on w, of which prefill compute seconds), from w's reported fit (else
        `fallback`, else the unmeasured prior)."""
        fit = w.prefill_fit or fallback or self.unmeasured_fit
        hit_tokens = cached_tokens(req, matched_blocks)
        if hit_tokens >= req.num_tokens:  # one token is always computed (its logits)
            hit_tokens = req.num_tokens - 1
        compute = fit.seconds(req.num_tokens, hit_tokens)
        if req.lora and req.lora not in w.loras_resident:
            load = w.lora_load_s or lora_load_s or self.lora_load_s
            # a full set of slots evicts an adapter that its next request loads again
            full = w.lora_slots and len(w.loras_resident) >= w.lora_slots
            compute += load * (1 + self.lora_evict_weight if full else 1)
        wait = w.wait_s(fit, now)
        t = (wait or 0.0) + compute
        gbps = w.transfer_gbps_to.get(req.decode_worker) or pooled_gbps
        if w.kv_bytes_per_token and gbps:
            lacking = max(req.num_tokens - req.decode_cached_blocks * req.block_size, 0)
            t += lacking * w.kv_bytes_per_token / (gbps * 1e9)
        return t, compute

    def _sent_s(self, worker_id: str, now: float) -> float:
        v, at = self._sent.get(worker_id, (0.0, now))
        return v * math.exp(-max(0.0, now - at) / self.balance_tau_s)

    def _excess(self, ws: Sequence[WorkerState], now: float, unit: float) -> list[float]:
        """Per worker: how far the prefill compute this router sent it lately (decayed over
        `balance_tau_s`) is above `balance_ratio` x the mean, as a fraction of the mean, or of
        `balance_min_requests` x `unit` (seconds) while the mean is below that (a handful of
        requests is no imbalance: a quiet cluster's first requests follow their prefixes)."""
        if self.balance_ratio is None or len(ws) < 2:
            return [0.0] * len(ws)
        sent = [self._sent_s(w.worker_id, now) for w in ws]
        mean = sum(sent) / len(sent)
        scale = max(mean, self.balance_min_requests * unit)
        if scale <= 0:
            return [0.0] * len(ws)
        return [max(0.0, s - self.balance_ratio * mean) / scale for s in sent]

    def choose_prefill(self, req, workers, matches):
        ws = _available(workers)
        now = self.clock() if req.arrival_s is None else req.arrival_s
        pending = self.inflight.match(req.block_hashes, now=now)
        hits = [max(matches.get(w.worker_id, 0), pending.get(w.worker_id, 0)) for w in ws]
        pooled = self.pooled_fit(ws)
        measured = pooled is not None
        lora_s = [w.lora_load_s for w in ws if w.lora_load_s > 0]
        lora_load_s = sum(lora_s) / len(lora_s) if lora_s else None
        gbps_all = [g for w in ws for g in w.transfer_gbps_to.values() if g > 0]
        pooled_gbps = sum(gbps_all) / len(gbps_all) if gbps_all else None
        overload = 1.0
        if self.overload_wait_s > 0:
            waits = [w.wait_s(w.prefill_fit or pooled or self.unmeasured_fit, now) or 0.0
                     for w in ws]
            overload = max(1.0, min(waits) / self.overload_wait_s)
        beta = self.work_weight * overload
        est, cost, computes = [], [], []
        for w, h in zip(ws, hits, strict=True):
            t, compute = self.estimate(req, w, h, pooled, lora_load_s, pooled_gbps, now)
            est.append(t)
            cost.append(t + beta * compute)
            computes.append(compute)
        slo = req.ttft_slo_s if req.ttft_slo_s is not None else self.ttft_slo_s
        if measured and slo is not None and min(est) > slo:
            raise SLOUnmeetable(min(est), slo)
        spread = max(computes) - min(computes)
        for i, excess in enumerate(self._excess(ws, now, spread)):
            cost[i] += self.balance_weight / overload * excess * spread
        bound = min(cost) + min(self.tie_s, self.tie_frac * min(computes))
        last = self._last_chosen
        i = min((i for i in range(len(ws)) if cost[i] <= bound),
                key=lambda i: (-hits[i], ws[i].cached_blocks, last.get(ws[i].worker_id, -1),
                               cost[i]))
        w = ws[i]
        self._decisions += 1
        last[w.worker_id] = self._decisions
        self.inflight.record(w.worker_id, req.block_hashes, now=now,
                             ttl_s=est[i] + self.inflight_margin_s)
        self._sent[w.worker_id] = (self._sent_s(w.worker_id, now) + computes[i], now)
        return RoutingDecision(w.worker_id, "cache_hit" if hits[i] else "min_ttft",
                               est[i] if measured else None, hits[i])


POLICIES: dict[str, type[BasePolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, CacheAware, KVCost, Locality)
}
DEFAULT_POLICY = Locality.name


def make_policy(name: str = DEFAULT_POLICY, **cfg) -> BasePolicy:
    """A fresh policy by name; unknown names raise ValueError listing the valid ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: "
                         f"{', '.join(sorted(POLICIES))}") from None
    return cls(**cfg)
