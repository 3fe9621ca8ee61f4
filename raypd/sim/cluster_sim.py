"""Cluster simulator: prefill pools, decode pools with continuous batching and KV capacity, the
P -> D transfer on a link model, decode-first admission and 429 on an unmeetable SLO, driven by
the production policies through load reports (raypd/sim/routing_sim.py's workers and report cadence).

One request: decode-first admission (the policy's choose_decode on decode workers' reports;
blocks for prompt + `max_tokens` reserved in D's real BlockPool, as the live router reserves,
never the true output it cannot know; or the request waits; it is shed when it has waited past
the TTFT SLO) -> the policy's choose_prefill on prefill reports (locality with the TTFT SLO
sheds early: SLOUnmeetable = 429) -> P's chunked prefill (raypd/sim/routing_sim.py SimWorker:
prefix cache in a real BlockPool; each step batches the waiting prefills first come, first
served up to the token budget, as the engine does) -> transfer of the KV D lacks over D's link
(FIFO per D: the bytes hold the link, the link's latency is paid by each transfer without
holding it) -> D's running batch (at most `max_decode_batch` sequences; the others wait for a
slot), one token a step (step time by the decode cost model of the batch and its context) until
its output is done (the trace's output, cut at `max_tokens` as the engine stops there); D frees
the blocks.

Policies get only what the live router has: load reports, their own decisions since, and the
request as a client sends it (prompt, `max_tokens`); the true output length and the cost
model's queues stay inside the simulated workers.

TTFT = first token at the client = P's prefill done + transfer (D streams from there); TPOT =
(finish - first token) / (output - 1). A request attains the SLO when TTFT <= slo_ttft and
TPOT <= slo_tpot; goodput = attained requests / s of the trace span (shed ones fail).

Shared host (`shared_host=True`, cpu-here's 1P+1D validation): prefill i and decode i share
cores and memory, and each factor of cost.shared_host is taken at decode i's batch: a decode
step overlapping a prefill step runs decode_x times slower over the overlap, a prefill step
prefill_x times slower while decode i's batch (as estimated when the step starts, the decodes
prefill i has just finished included) lasts, a transfer to decode i's bytes handoff_x times
longer and its latency handoff_s longer (the batch when its prefill ends), prefill i's staging stage_x
times longer, its next step send_s_per_token longer per token of the pages it sends
meanwhile, and decode i's running batch land_s_per_token later per token of each prompt that
lands on it (raypd/sim/cost_model.py HostSlowdown).

Colocated mode (`colocated=True`): `num_prefill` GPUs that each prefill and decode as a
chunked-prefill engine does (raypd/sim/colocated_sim.py): each step decodes one token of every
running sequence and fills the rest of `colocated_budget` tokens with prompt chunks; one KV
pool for the prefix cache and the requests.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvcache.block_pool import BlockPool
from kvcache.hashing import BlockHash
from protocol.errors import RoutingRejected
from protocol.messages import LoadReport
from protocol.step_rates import StepRates
from raypd.sim.colocated_sim import ColocatedGPU, decode_steps
from raypd.sim.cost_model import NO_SLOWDOWN, CostModel, SharedHost
from raypd.sim.routing_sim import (
    SimRequest,
    SimWorker,
    as_sim_requests,
    namespace_root,
    trace_hashes,
)
from router.percentiles import percentile
from router.policies import BasePolicy, Locality, RoutingRequest, WorkerState, make_policy
from router.prefix_index import PrefixIndex
from router.transfer_rates import TransferRates
from router.worker_view import REPORT_INTERVAL_S, apply_load_report, note_decode, note_prefill

DECODE_FIT_SAMPLE_S = 1.0   # a decode worker feeds its step fit one step a second at most


@dataclass
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False          # num_prefill GPUs doing both; num_decode ignored
    policy: str = "locality"
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    block_tokens: int = 512          # KV block = one trace block (hash id) on P and D alike
    report_interval_s: float = REPORT_INTERVAL_S
    report_rpc_s: float = 0.002
    max_decode_batch: int = 256      # sequences one decode step holds at most
    max_tokens: int = 1024           # what clients ask for: decode KV reserved for it
    colocated_budget: int = 2048     # colocated: tokens a step holds (decode + prefill chunks)
    shed_on_slo: bool = True         # locality rejects (429) a request it cannot serve in SLO
    shared_host: bool = False        # prefill i and decode i share a host (cost.shared_host)

    def validate(self) -> None:
        for name in ("max_decode_batch", "max_tokens", "colocated_budget", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prefill < 1 or (not self.colocated and self.num_decode < 1):
            raise ValueError("--prefill and --decode must be >= 1")
        if self.shared_host and (self.colocated or self.num_prefill != self.num_decode):
            raise ValueError("shared_host pairs prefill i with decode i: equal pool sizes, "
                             "not colocated")
        if self.slo_ttft_s <= 0 or self.slo_tpot_s <= 0:
            raise ValueError("--slo-ttft and --slo-tpot must be > 0")


class _Seq:
    """A decoding sequence; `stall_s`: seconds of decode its landing costs the running batch
    (a shared host's decode worker receives and lands the pages on the cores it decodes on)."""
    __slots__ = ("rid", "left", "ctx", "first_s", "blocks", "stall_s")

    def __init__(self, rid: int, left: int, ctx: int, first_s: float, blocks: list,
                 stall_s: float = 0.0) -> None:
        self.rid, self.left, self.ctx, self.first_s, self.blocks = rid, left, ctx, first_s, blocks
        self.stall_s = stall_s


class DecodeSim:
    """One decode worker: continuous batching of at most `max_batch` sequences (the others
    wait for a slot), advanced in jumps between batch changes. `prefill`: a shared host's
    prefill worker, whose steps slow it down: decode runs at `busy_rate` of its speed while
    one runs (1 / `shared`'s decode_x at the jump's batch)."""

    def __init__(self, worker_id: str, cost: CostModel, capacity_blocks: int,
                 max_batch: int, prefill: SimWorker | None = None,
                 shared: SharedHost | None = None) -> None:
        assert (prefill is None) == (shared is None), "a shared host has both"
        self.shared = shared
        self.worker_id = worker_id
        self.cost = cost
        self.pool = BlockPool(capacity_blocks, enable_prefix_caching=False)
        self.max_batch = max_batch
        self.running: list[_Seq] = []
        self.queued: deque[_Seq] = deque()   # arrived, waiting for a slot in the batch
        self.max_batch_seen = 0
        self.last_step_s = 0.0   # the last decode step's seconds (what the worker measured)
        self.joins: list[tuple[float, int, _Seq]] = []     # heap of (time, seq no, seq)
        self.now = 0.0
        self.carry = 0.0
        self.link_free_at = 0.0
        self.finished: list[tuple[int, float, float]] = []  # (rid, first token, finish)
        self.prefill = prefill          # colocated: the same GPU's prefill; shared host: its neighbour
        self.busy_rate = 1.0   # set per jump on a shared host
        self._busy_i = 0
        self._n = 0
        # its decode fit (LoadReport.decode_fit), from the steps it ran: one step of each jump,
        # one a DECODE_FIT_SAMPLE_S at most (refitting on every jump costs more than the replay;
        # the steps' form is the cost model's, so the fit is the same); not on a shared host,
        # whose slowed steps the jump does not time one by one
        self.rates = StepRates()
        self._fit_fed_at = -math.inf

    def _busy_steps(self):
        if self.prefill is None:
            return []
        return self.prefill.step_log

    def _free_time(self, a: float, b: float) -> float:
        """Seconds of decode progress in [a, b): full speed outside prefill steps, busy_rate
        inside them."""
        if b <= a:
            return 0.0
        steps = self._busy_steps()
        free = b - a
        i = self._busy_i
        while i < len(steps) and steps[i][1] <= a:
            i += 1
        self._busy_i = i
        while i < len(steps) and steps[i][0] < b:
            s, e = steps[i]
            free -= (1.0 - self.busy_rate) * max(0.0, min(e, b) - max(s, a))
            i += 1
        return max(free, 0.0)

    def _time_after(self, a: float, need: float) -> float:
        """Wall time at which `need` seconds of decode progress have passed since a."""
        steps = self._busy_steps()
        if not steps:
            return a + need
        t, i = a, self._busy_i
        while i < len(steps) and steps[i][1] <= t:
            i += 1
        while True:
            if i >= len(steps) or steps[i][0] >= t + need:
                return t + need
            s, e = steps[i]
            if s > t:
                need -= s - t
                t = s
            # inside the step [t, e): progress at busy_rate
            if self.busy_rate > 0 and (e - t) * self.busy_rate >= need:
                return t + need / self.busy_rate
            need -= (e - t) * self.busy_rate
            t = e
            i += 1

    def busy_until(self, t: float, extra: Sequence[tuple[float, int, int]] = ()) -> float:
        """When the decode work this worker has by t ends (t: none), estimated from where it
        has been advanced to: each running sequence from now, each joined one from its join,
        plus `extra` (start, tokens, context) sequences about to join, their tokens at the
        step time of all of them together, no slowdown counted (the prefill step asking is
        what would slow it)."""
        seqs = [(self.now, s.left, s.ctx) for s in (*self.running, *self.queued)]
        seqs += [(max(at, self.now), s.left, s.ctx) for at, _, s in self.joins if at <= t]
        seqs += [x for x in extra if x[0] <= t]
        if not seqs:
            return t
        dt = self.cost.decode.step_s(len(seqs), sum(c for _, _, c in seqs))
        return max(t, max(start + left * dt for start, left, _ in seqs))

    def batch_at(self, t: float, extra: Sequence[tuple[float, int, int]] = ()) -> int:
        """Sequences this worker holds at t as far as it has been advanced (running, waiting
        for a slot, landed by t), plus `extra` (start, tokens, context) started by t."""
        return (len(self.running) + len(self.queued)
                + sum(1 for at, _, _ in self.joins if at <= t)
                + sum(1 for x in extra if x[0] <= t))

    def join(self, at: float, seq: _Seq) -> None:
        self._n += 1
        heapq.heappush(self.joins, (at, self._n, seq))

    def _take_joins(self) -> None:
        """Sequences whose KV has landed by now join the batch while it has a slot (at most
        `max_batch` running; the rest wait, first come first served)."""
        while self.joins and self.joins[0][0] <= self.now:
            _, _, seq = heapq.heappop(self.joins)
            if self.running:            # its landing held up the running batch
                self.carry -= seq.stall_s
            if seq.left <= 0:
                self.finished.append((seq.rid, seq.first_s, seq.first_s))
                self.pool.free(seq.blocks)
            else:
                self.queued.append(seq)
        while self.queued and len(self.running) < self.max_batch:
            self.running.append(self.queued.popleft())
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))

    def advance(self, t: float) -> None:
        """Run decode steps until time t."""
        while True:
            self._take_joins()
            if self.now >= t:
                return
            nxt = self.joins[0][0] if self.joins else math.inf
            horizon = min(t, nxt)
            if not self.running:
                self.now, self.carry = horizon, 0.0
                continue
            batch = len(self.running)
            ctx = sum(s.ctx for s in self.running)
            dt = self.cost.decode.step_s(batch, ctx)
            if self.shared is not None:
                self.busy_rate = 1.0 / self.shared.at(batch).decode_x
            kmin = min(s.left for s in self.running)
            end = self._time_after(self.now, kmin * dt - self.carry)
            if end <= horizon:
                k, self.now, self.carry = kmin, end, 0.0
            else:
                avail = self._free_time(self.now, horizon) + self.carry
                k = max(0, int(avail // dt))
                self.carry = avail - k * dt
                self.now = horizon
            if k:
                self.last_step_s = dt
                if self.prefill is None and self.now - self._fit_fed_at >= DECODE_FIT_SAMPLE_S:
                    self.rates.observe_decode(dt, batch, ctx)
                    self._fit_fed_at = self.now
                self.running, done = decode_steps(self.running, k)
                for s in done:
                    self.finished.append((s.rid, s.first_s, self.now))
                    self.pool.free(s.blocks)

    def report(self) -> LoadReport:
        """What a live decode worker reports now: its admitted sequences (running, waiting for
        a slot, or whose KV is on its way), blocks, and the step time it last measured (not
        the cost model's figure for a batch)."""
        ctx = sum(s.ctx for s in self.running)
        waiting = sum(s.ctx for _, _, s in self.joins) + sum(s.ctx for s in self.queued)
        return LoadReport(self.worker_id, running_tokens=ctx + waiting,
                          num_requests=len(self.running) + len(self.joins) + len(self.queued),
                          active_blocks=self.pool.num_used_blocks,
                          free_blocks=self.pool.num_free_blocks,
                          total_blocks=self.pool.num_blocks, decode_batch=len(self.running),
                          decode_step_s=self.last_step_s, decode_fit=self.rates.decode_fit(),
                          kv_bytes_per_token=self.cost.kv_bytes_per_token)

    def evict(self, seq: _Seq) -> None:
        """Take a running or slot-waiting sequence off this worker (it migrates); its blocks
        stay the caller's to free."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.queued.remove(seq)

    @property
    def idle(self) -> bool:
        """Nothing running, waiting, landing, or reserved for a prefill still on its way."""
        return not (self.running or self.queued or self.joins) and \
            self.pool.num_used_blocks == 0


def _slowed(start: float, step_s: float, busy_until: float, x: float) -> float:
    """Duration of a prefill step of `step_s` alone that starts at `start` on a host whose
    decode worker is busy until `busy_until`: 1/x of its speed while the decode runs."""
    overlap = busy_until - start
    if overlap <= 0 or x <= 1.0:
        return step_s
    if step_s * x <= overlap:
        return step_s * x
    return overlap + step_s - overlap / x


class RunHooks:
    """What an instrumented replay is told (raypd/sim/autoscale_sim.py); no-ops here. `tick`
    is called every `interval_s` of simulated time, after every worker was advanced to it
    and the reports due by then were delivered; while `busy()` after the last arrival the
    replay keeps ticking (a static replay jumps to the end)."""

    interval_s: float = math.inf

    def arrive(self, j: int, now: float) -> None:
        """Request j arrived (before its admission is tried)."""

    def shed(self, j: int, now: float, reason: str) -> None:
        """Request j was refused (429) or gave up waiting for decode KV."""

    def tick(self, now: float) -> None:
        """The interval's turn."""


class ClusterSim:
    """One replay of a cluster (module doc). Colocated: `gpus` (each both halves); else
    `prefill` and `decode` pools. Disaggregated pools may change during a run
    (`add_prefill`, `add_decode`, `retire_prefill`, `retire_decode`: the autoscaler's), and
    a `hooks` object hears arrivals, sheds and its ticks."""

    def __init__(self, cost: CostModel, cfg: ClusterConfig,
                 policy: BasePolicy | None = None, hooks: RunHooks | None = None) -> None:
        cfg.validate()
        self.cost, self.cfg = cost, cfg
        self.hooks = hooks
        self.policy = policy or make_policy(
            cfg.policy, **({"ttft_slo_s": cfg.slo_ttft_s}
                           if cfg.policy == "locality" and cfg.shed_on_slo else {}))
        bt = cfg.block_tokens
        total_blocks = max(1, cost.kv_capacity_tokens // bt)
        self.gpus: list[ColocatedGPU] = []
        self.prefill: list[SimWorker] = []
        self.decode: list[DecodeSim] = []
        if cfg.colocated:
            self.gpus = [ColocatedGPU(f"gpu-{i}", cost, total_blocks, cfg.colocated_budget,
                                      cfg.max_decode_batch, bt)
                         for i in range(cfg.num_prefill)]
        elif cfg.shared_host:   # P i and D i on one host: each slows the other (measured;
            sh = cost.shared_host  # the prefill side is set in `run`, which knows the requests)
            self.prefill = [SimWorker(f"prefill-{i}", total_blocks, cost, 4, log_steps=True,
                                      block_tokens=bt) for i in range(cfg.num_prefill)]
            self.decode = [DecodeSim(f"decode-{i}", cost, total_blocks, cfg.max_decode_batch,
                                     p, sh)
                           for i, p in enumerate(self.prefill)]
        else:
            self.prefill = [SimWorker(f"prefill-{i}", total_blocks, cost, 4, block_tokens=bt)
                            for i in range(cfg.num_prefill)]
            self.decode = [DecodeSim(f"decode-{i}", cost, total_blocks, cfg.max_decode_batch)
                           for i in range(cfg.num_decode)]
        p_ids = [w.worker_id for w in (self.gpus or self.prefill)]
        d_ids = [w.worker_id for w in (self.gpus or self.decode)]
        self.p_states = {w: WorkerState(w) for w in p_ids}
        self.d_states = {w: WorkerState(w) for w in d_ids}
        self.index = PrefixIndex()
        for w in p_ids:
            self.index.add_worker(w)
        self.rates = TransferRates()
        self._transfers_done: list[tuple[float, str, str, int, float]] = []
        self._tick = -1
        self._capacity_blocks = total_blocks
        self.p_by_id = {w.worker_id: w for w in self.prefill}
        self.d_by_id = {d.worker_id: d for d in self.decode}   # retired ones stay (late joins)
        self.retired_prefill: list[SimWorker] = []
        self.retired_decode: list[DecodeSim] = []
        # of the run in progress (for hooks): per request its TTFT and output length
        self.ttft: dict[int, float] = {}
        self.out_len: list[int] = []

    # ---- membership (disaggregated pools only) --------------------------------------------
    def add_prefill(self, worker_id: str) -> SimWorker:
        """A prefill worker joins: empty cache, no fit, in the index; its first report comes
        on the next report tick (until then its state is empty)."""
        assert not (self.cfg.colocated or self.cfg.shared_host)
        w = SimWorker(worker_id, self._capacity_blocks, self.cost, 4,
                      block_tokens=self.cfg.block_tokens)
        self.prefill.append(w)
        self.p_by_id[worker_id] = w
        self.p_states[worker_id] = WorkerState(worker_id)
        self.index.add_worker(worker_id)
        return w

    def add_decode(self, worker_id: str) -> DecodeSim:
        assert not (self.cfg.colocated or self.cfg.shared_host)
        d = DecodeSim(worker_id, self.cost, self._capacity_blocks, self.cfg.max_decode_batch)
        self.decode.append(d)
        self.d_by_id[worker_id] = d
        self.d_states[worker_id] = WorkerState(worker_id)
        return d

    def prefill_idle(self, w: SimWorker) -> bool:
        """Every prefill routed to w has been computed and handed on to its transfer."""
        return not w.waiting and not w.finished_by(math.inf)

    def retire_prefill(self, w: SimWorker) -> None:
        """An idle prefill worker leaves: out of the pools, the router's view and index."""
        assert self.prefill_idle(w), w.worker_id
        self.prefill.remove(w)
        del self.p_states[w.worker_id]
        self.index.remove_worker(w.worker_id)
        self.retired_prefill.append(w)

    def retire_decode(self, d: DecodeSim) -> None:
        assert d.idle, d.worker_id
        self.decode.remove(d)
        del self.d_states[d.worker_id]
        self.retired_decode.append(d)

    def work_left(self) -> bool:
        """A prefill not yet handed on, or a sequence still decoding or on its way."""
        return any(not self.prefill_idle(w) for w in self.prefill) or \
            any(d.running or d.queued or d.joins for d in self.decode)

    @property
    def num_gpus(self) -> int:
        return self.cfg.num_prefill if self.cfg.colocated else \
            self.cfg.num_prefill + self.cfg.num_decode

    @property
    def max_batch_seen(self) -> int:
        """The largest decode batch any step of the replay held."""
        return max((w.max_batch_seen for w in (*self.gpus, *self.decode)), default=0)

    def _reports(self, now: float) -> None:
        tick = int(now / self.cfg.report_interval_s)
        if tick <= self._tick:
            return
        self._tick = tick
        at = tick * self.cfg.report_interval_s - self.cfg.report_rpc_s
        done = self._transfers_done
        while done and done[0][0] <= at:
            _, p, d, nbytes, seconds = heapq.heappop(done)
            self.rates.observe(p, d, nbytes, seconds)
        for g in self.gpus:
            rep = g.prefill_report(at)
            self.index.apply(g.worker_id, rep.events)
            apply_load_report(self.p_states[g.worker_id], rep, at)
            apply_load_report(self.d_states[g.worker_id], g.decode_report(), at)
        for w in self.prefill:
            rep = w.report(at)
            self.index.apply(w.worker_id, rep.events)
            apply_load_report(self.p_states[w.worker_id], rep, at)
        for d in self.decode:
            apply_load_report(self.d_states[d.worker_id], d.report(), at)

    def run(self, requests: Sequence[SimRequest], hashes=None) -> dict:
        cfg, cost, bt = self.cfg, self.cost, self.cfg.block_tokens
        reqs = list(requests)
        if cfg.colocated and any(r.lora for r in reqs):
            raise ValueError("colocated GPUs do not model adapter loads: requests with a LoRA "
                             "adapter need disaggregated pools")
        hashes = trace_hashes(reqs) if hashes is None else hashes
        roots: dict[tuple[str, str], BlockHash] = {}
        p_by_id, d_by_id = self.p_by_id, self.d_by_id
        g_by_id = {g.worker_id: g for g in self.gpus}
        hooks = self.hooks
        ttft: dict[int, float] = {}
        arrival: dict[int, float] = {}
        # what the engine generates: the trace's output, cut where the client's max_tokens stops it
        out_len = [max(1, min(r.output_tokens, cfg.max_tokens)) for r in reqs]
        self.ttft, self.out_len = ttft, out_len
        route: dict[int, tuple[str, str, list]] = {}   # j -> (P, D, D's reserved blocks)
        shed = {"slo_reject": 0, "admission_timeout": 0, "too_large": 0}
        pending: deque[int] = deque()
        transferred_bytes = 0

        def drop(j: int, now: float, reason: str) -> None:
            shed[reason] += 1
            if hooks is not None:
                hooks.shed(j, now, reason)
        if cfg.shared_host:   # P i's step beside D i's batch, and the decodes P i just finished
            sh = cost.shared_host
            for p, d in zip(self.prefill, self.decode, strict=True):
                def soon(t: float, p=p, d=d) -> list[tuple[float, int, int]]:
                    return [(f, out_len[j] - 1, reqs[j].num_tokens)
                            for f, j in p.finished_by(t) if route[j][1] == d.worker_id]

                def slowed(t: float, step_s: float, d=d, soon=soon) -> float:
                    s = soon(t)
                    return _slowed(t, step_s, d.busy_until(t, s),
                                   sh.at(d.batch_at(t, s)).prefill_x)
                p.slowed = slowed
                p.host_at = lambda t, d=d, soon=soon: sh.at(d.batch_at(t, soon(t)))

        def reserve_blocks(r: SimRequest) -> int:
            """What the router reserves on D: the prompt and the client's max_tokens."""
            return math.ceil((r.num_tokens + cfg.max_tokens) / bt)

        def try_admit(j: int, now: float) -> bool:
            """Decode-first: reserve on D, route to P, schedule prefill, transfer and decode.
            False: no decode worker has room now (the request keeps waiting)."""
            r, hs = reqs[j], hashes[j]
            need = reserve_blocks(r)
            req = RoutingRequest(str(j), hs, r.num_tokens, bt, r.tenant, cfg.max_tokens,
                                 arrival_s=now, lora=r.lora)
            d_states = [self.d_states[w] for w in self.d_states]
            if cfg.colocated:
                d_states = [s for s in d_states if s.free_blocks >= need]
                if not d_states:
                    return False
            try:
                dd = self.policy.choose_decode(req, d_states, {})
            except RoutingRejected:
                return False
            did = dd.worker_id
            if cfg.colocated:
                if need > g_by_id[did].room():   # the report was stale: the GPU refuses
                    return False
                blocks: list = []
            else:
                dsim = d_by_id[did]
                if need > dsim.pool.num_free_blocks:   # the report was stale: D refuses
                    return False
                blocks = dsim.pool.allocate(need)
            note_decode(self.d_states[did], req, dd)
            p_states = [self.p_states[did]] if cfg.colocated else \
                [self.p_states[w.worker_id] for w in self.prefill]   # colocated: its own GPU
            for st in p_states:
                st.transfer_gbps_to = self.rates.from_worker(st.worker_id)
            req = RoutingRequest(str(j), hs, r.num_tokens, bt, r.tenant, cfg.max_tokens,
                                 arrival_s=now, lora=r.lora, decode_worker=did)
            try:
                pd = self.policy.choose_prefill(req, p_states, self.index.match(hs))
            except RoutingRejected:
                if blocks:
                    d_by_id[did].pool.free(blocks)
                drop(j, now, "slo_reject")
                return True
            note_prefill(self.p_states[pd.worker_id], req, pd, Locality.pooled_fit(p_states),
                         now)
            key = (r.tenant, r.lora)
            root = roots.get(key) or roots.setdefault(key, namespace_root(*key))
            route[j] = (pd.worker_id, did, blocks)
            if cfg.colocated:
                g_by_id[did].serve(j, hs, root, r.hash_ids, r.num_tokens, out_len[j], now,
                                   need)
            else:
                p_by_id[pd.worker_id].serve(hs, root, r.hash_ids, r.num_tokens, now, bt,
                                            r.lora, tag=j)
            return True

        def prefills_done(t: float) -> None:
            """Form the steps that start by t; every prefill that ended by t (in finish
            order) goes on to its transfer and its decode worker (colocated: its GPU)."""
            nonlocal transferred_bytes
            for g in self.gpus:
                for first, j in g.advance(t):
                    ttft[j] = first - arrival[j]
            done = sorted((x for w in self.prefill for x in w.advance(t)), key=lambda x: x[0])
            for finish, j in done:
                r, (pid, did, blocks) = reqs[j], route[j]
                dsim = d_by_id[did]
                nbytes = r.num_tokens * cost.kv_bytes_per_token
                host = cost.shared_host.at(dsim.batch_at(finish)) if cfg.shared_host \
                    else NO_SLOWDOWN
                # the bytes hold D's link (FIFO); the latency (round trips) does not
                start = max(finish, dsim.link_free_at)
                dsim.link_free_at = start + host.handoff_x * (cost.link.seconds(nbytes)
                                                              - cost.link.latency_s)
                first = dsim.link_free_at + cost.link.latency_s + host.handoff_s
                # the router measures a transfer when it ends, not before
                heapq.heappush(self._transfers_done, (first, pid, did, nbytes, first - start))
                transferred_bytes += nbytes
                ttft[j] = first - arrival[j]
                dsim.join(first, _Seq(j, out_len[j] - 1, r.num_tokens, first, blocks,
                                      host.land_s_per_token * r.num_tokens))

        def advance_to(t: float) -> None:
            prefills_done(t)
            for d in self.decode:
                d.advance(t)
            self._reports(t)

        next_tick = reqs[0].timestamp_s if reqs else 0.0

        def step_to(t: float) -> None:
            nonlocal next_tick
            if hooks is not None:       # the hooks' ticks up to t, each on workers advanced to it
                while next_tick <= t:
                    advance_to(next_tick)
                    hooks.tick(next_tick)
                    next_tick += hooks.interval_s
            advance_to(t)

        last = 0.0
        for j, r in enumerate(reqs):
            now = r.timestamp_s
            arrival[j] = now
            last = now
            step_to(now)
            if hooks is not None:
                hooks.arrive(j, now)
            while pending:               # waiting admissions first (FIFO)
                k = pending[0]
                if now - arrival[k] > cfg.slo_ttft_s:
                    pending.popleft()
                    drop(k, now, "admission_timeout")
                    continue
                if not try_admit(k, now):
                    break
                pending.popleft()
            if reserve_blocks(r) > self._capacity_blocks:
                drop(j, now, "too_large")
                continue
            if pending or not try_admit(j, now):
                pending.append(j)
        t = last
        while pending:                   # drain the admission queue on report ticks
            t += cfg.report_interval_s
            step_to(t)
            k = pending[0]
            if t - arrival[k] > cfg.slo_ttft_s:
                pending.popleft()
                drop(k, t, "admission_timeout")
            elif try_admit(k, t):
                pending.popleft()
        if hooks is not None:            # keep ticking while work is left (pools may change)
            while self.work_left():
                step_to(next_tick)
        prefills_done(math.inf)
        for d in self.decode:
            d.advance(math.inf)
        return self._result(reqs, arrival, out_len, ttft, shed, transferred_bytes)

    def _result(self, reqs, arrival, out_len, ttft, shed, transferred_bytes) -> dict:
        cfg = self.cfg
        tpot: dict[int, float] = {}
        for d in (*self.decode, *self.retired_decode, *self.gpus):
            for rid, first, fin in d.finished:
                n = out_len[rid]
                tpot[rid] = (fin - first) / (n - 1) if n > 1 else 0.0
        self.ttft_s, self.tpot_s = dict(ttft), dict(tpot)   # per request, for validation
        served = [j for j in ttft if j in tpot]
        good = [j for j in served if ttft[j] <= cfg.slo_ttft_s and tpot[j] <= cfg.slo_tpot_s]
        span = max(arrival.values()) - min(arrival.values()) if arrival else 0.0
        n = len(reqs)
        tt = [ttft[j] for j in served]
        tp = [tpot[j] for j in served if out_len[j] > 1]
        return {
            "num_requests": n, "served": len(served), "shed": dict(shed),
            "shed_total": sum(shed.values()),
            "ttft_p50_s": percentile(tt, 50, 0.0), "ttft_p99_s": percentile(tt, 99, 0.0),
            "tpot_p50_s": percentile(tp, 50, 0.0), "tpot_p99_s": percentile(tp, 99, 0.0),
            "slo_attainment": len(good) / n if n else 0.0,
            "goodput_rps": len(good) / span if span > 0 else float(len(good)),
            "goodput_rps_per_gpu": (len(good) / span if span > 0 else float(len(good)))
            / self.num_gpus,
            "num_gpus": self.num_gpus, "transfer_gb": transferred_bytes / 1e9,
            "max_decode_batch_seen": self.max_batch_seen,
            "truncated_at_max_tokens": sum(r.output_tokens > cfg.max_tokens for r in reqs),
            "transfer_gbps_measured": self.rates.to_dict() if len(self.rates.pairs) <= 8
            else {"pairs": len(self.rates.pairs)},
            "config": asdict(cfg),
        }


def cluster_requests(requests, cfg: ClusterConfig, rate_scale: float = 1.0) -> list[SimRequest]:
    """Trace rows as SimRequests (prompt lengths as recorded), arrivals divided by
    `rate_scale` (2.0 = twice the request rate)."""
    out = as_sim_requests(requests, cfg.block_tokens)
    t0 = out[0].timestamp_s if out else 0.0
    return [r._replace(timestamp_s=(r.timestamp_s - t0) / rate_scale,
                       output_tokens=max(1, r.output_tokens)) for r in out]


def simulate_cluster(requests, cost: CostModel, cfg: ClusterConfig,
                     rate_scale: float = 1.0) -> dict:
    reqs = cluster_requests(requests, cfg, rate_scale)
    res = ClusterSim(cost, cfg).run(reqs)
    res["cost_model"] = cost.to_dict()
    res["rate_scale"] = rate_scale
    return res
