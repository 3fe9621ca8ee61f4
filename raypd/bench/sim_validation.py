"""`raypd simulate --validate`: the cluster simulator with the cpu-here cost model against a real
1P+1D cluster here, out of sample, at two loads.

The workers' settings come from the one config chain (`worker_settings`: the engine dict's
`max_num_batched_tokens`, else the engine's CPU default, protocol/step_rates.py; PDConfig's
`threads_per_actor` and `share_idle_threads`), and the calibration, the probe and the replay all
run at them. Calibration and replay are kept apart:
- the cost model comes from `raypd bench engine --calibration` figures (a JSON given with
  `--engine-json`, or measured by this command first in a Ray task placed like the workers:
  num_cpus=0, at the workers' step budget and at the torch threads a busy worker takes while
  the other is idle, workers/thread_share.py) and from a probe on a cluster started for it
  alone and shut down before the replay's cluster starts (`run_probe`): how much the prefill
  and decode workers slow each other on this host, beside a decode batch of 1 and of
  PROBE_BATCHES (prefill compute, decode steps, handoff), the workers' speed alone (to which
  the calibration's level is re-anchored: the machine drifts over minutes; the shapes stay the
  calibration's), P's own handoff work (staging on its loop before the next step; what a step
  loses while P sends pages) and what a request spends besides before its first token (the
  per-request handoff latency, which the simulator's link carries). The probe uses
  PROBE_CONTEXT / PROBE_PREFILL tokens;
- the replay (`replay_requests`) uses prompt lengths REPLAY_LENS, none of the calibration's or
  the probe's, random token ids (no shared prefixes), Poisson arrivals placed for each load of
  LOADS (the prefill worker's utilization by the calibrated model, shared-host slowdown and
  staging included: light, and near saturation), `max_tokens` each (ignore_eos), after one
  warm-up request of each length; TTFT at the client (first streamed token), TPOT from the
  first to the last streamed token. Every run draws a fresh replay seed (`replay_seed` in the
  JSON); REPLAY_SEED (7), the replay the simulator's structure was developed on, runs only when
  asked for and is labelled in-sample. The real side runs each load `rounds` times (new
  prompts, same arrivals and lengths) and pools them; the simulator replays every round too, so
  both sides have the same number of samples. `real_prefill_utilization` is the share of the
  replay's window in which the real prefill worker computed or staged (the union of its spans):
  a "light" load above LIGHT_MAX_UTILIZATION was not light here, and its verdict fails.

Per load and metric (TTFT p50/p99, TPOT p50/p99, goodput: the share of requests within both
SLOs) `sim_vs_real_error` is |sim - real| / real (goodput: the absolute difference when the
real share is 0). Goodput is judged at SLOs the load can miss: SLO_P50_MULTIPLE x that load's
real p50 TTFT and TPOT (the near-saturation load at the given SLOs instead, when given). A load
passes when its worst error is within TOLERANCE and no real request failed; the run's `passed`
is the near-saturation load's (the judged one), the light load's verdict stands beside it
(`light_passed`). An error that cannot be computed is reported, never dropped by a max.
`real_round_spread` is how far the real rounds differ (the noise floor)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass

from kvcache.manager import cdiv
from protocol.step_rates import default_batched_tokens
from raypd.sim.cluster_sim import ClusterConfig, ClusterSim
from raypd.sim.cost_model import CostModel, HostSlowdown, SharedHost, cpu_cost_model
from raypd.sim.routing_sim import SimRequest
from router.percentiles import percentile


def replay_requests(num_requests: int, prompt_lens: tuple[int, ...], gap_s: float,
                    seed: int = 0, vocab: int = 49152, low: int = 100
                    ) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt) pairs: Poisson arrivals at a mean gap of `gap_s`, the first at 0,
    prompt lengths cycling over `prompt_lens`, random token ids in [low, vocab) (no shared
    prefixes)."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for j in range(num_requests):
        out.append((at, [rng.randrange(low, vocab) for _ in range(prompt_lens[j % len(
            prompt_lens)])]))
        at += rng.expovariate(1.0 / gap_s)
    return out


def _timed_request(cluster, prompt: list[int], max_tokens: int, request_id: str | None = None,
                   first: threading.Event | None = None, first_at: int = 1
                   ) -> tuple[float, list[float], int]:
    """(start, arrival time of each delta that carries tokens, tokens) of one request through
    the cluster; `first` is set once `first_at` such deltas arrived."""
    from workers.request import SamplingParams
    start, token_times = time.perf_counter(), []

    def on_delta(delta) -> None:
        if delta.token_ids:
            token_times.append(time.perf_counter())
            if first is not None and len(token_times) >= first_at:
                first.set()
    res = cluster.run_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              request_id=request_id, on_delta=on_delta)
    return start, token_times, len(res.token_ids)


def probe_shared_host(cluster, rng: random.Random, context: int, prefill_tokens: int,
                      decode_tokens: dict[int, int], tokens: tuple[int, int] = (100, 30000)
                      ) -> dict:
    """How much the real prefill and decode workers slow each other on this host (they share
    its cores, its memory and the serving processes' CPU), with probe requests of its own (none
    of the replay's), after the warm-up and before the replay, from the router's request
    traces. For each decode batch B of `decode_tokens` (B -> tokens each decodes), B
    `context`-token sequences decode while, once each streamed ten tokens:
    - a `prefill_tokens` prompt prefills ("beside"); decode_x = their mean gap between streamed
      tokens inside that prefill's compute over their mean gap outside it (before it, and
      after its KV landed);
    - then BEHIND_RUNS times two such prompts, the second sent while the first computes, so
      that its step starts while the first one's pages move to D ("lead", "behind");
      prefill_x = the median compute of the beside and lead prompts over the median of the
      same prompt alone (ALONE_RUNS times right before and right after: the machine's speed
      drifts over minutes); send_s_per_token = how much longer the behind prompts computed
      than those (medians), per token sent;
    - land_s_per_token = how much longer the decodes took over each landing of the beside and
      the behind prompts (their transfer stage, from a gap before to two after; nothing
      computes then) than their gap outside, mean over landings and decodes, per token landed.
    The top-level figures are batch 1's (which must be probed), `at_batch` the others'; prompt
    token ids are drawn from [tokens[0], tokens[1]).
    a handoff is what a request spends besides P's queue, its compute and its staging before
    its first token (at the router: route, admission, the transfer, the first token's way
    back): handoff_s_alone and handoff_s_alone_short are the prefills alone's
    (`prefill_tokens`, and `context` tokens ALONE_RUNS times more; means: the transfer's
    time is bimodal here); at batch B the beside, lead and behind prompts' mean and ALONE_RUNS
    more `context`-token prompts' (sent one after the other once the pairs are done) give a
    second line: handoff_x = its slope over the alone line's, handoff_s = what is left of the
    long prompts' handoff over the alone latency (lines that do not rise: handoff_x = the long
    prompts' ratio, handoff_s = 0); and
    stage_s_per_token = the prefills alone's median staging (P's loop's copy of the KV before
    its next step) per prompt token, and stage_x = the beside and lead prompts' median
    staging over that."""
    traces = cluster.orchestrator.traces
    assert 1 in decode_tokens, "the probe's batch-1 figures anchor the cost model"

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*tokens) for _ in range(n)]

    def span_of(rid: str, stage: str):
        span = next((x for x in traces.get(rid).spans if x.stage == stage), None)
        if span is None:
            raise RuntimeError(f"probe request {rid} has no {stage} stage (was it "
                               f"prefilled by the prefill worker?)")
        return span

    def compute_span(rid: str):
        return span_of(rid, "prefill_compute")

    def staging_of(rid: str) -> float:
        return traces.get(rid).stage_seconds().get("staging", 0.0)

    def handoff_of(rid: str) -> float:
        """What the simulator's link carries: TTFT less P's queue, compute and staging."""
        trace = traces.get(rid)
        st = trace.stage_seconds()
        return trace.ttft_s - st.get("prefill_queue", 0.0) - st["prefill_compute"] \
            - st.get("staging", 0.0)

    def mean_gap(ts: list[float]) -> float | None:
        return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) >= 4 else None

    def mean(xs) -> float | None:
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def wait_tokens(rids: list[str], after: float, n: int, limit_s: float = 60.0) -> None:
        """Until each of `rids` streamed `n` tokens after `after` (router clock)."""
        deadline = time.perf_counter() + limit_s
        while any(sum(1 for t in traces.get(r).token_times if t > after) < n for r in rids):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"probe decodes {rids} stopped streaming")
            time.sleep(0.01)

    def pair(tag: str, lead_s: float) -> tuple[str, str, float, float]:
        """(lead's id, behind's id, lead's compute, behind's compute): the second prompt
        sent `lead_s` after the first, while it computes. It must start after the first
        one's compute ended, else the two shared a step: then the pair is sent again (new
        ids), the second prompt half a compute later each time, up to PAIR_TRIES times."""
        for attempt in range(PAIR_TRIES):
            suffix = tag if attempt == 0 else f"{tag}-again{attempt}"
            lead_id, behind_id = f"probe-prefill-lead-{suffix}", f"probe-prefill-behind-{suffix}"
            first = threading.Thread(target=_timed_request, args=(
                cluster, prompt(prefill_tokens), 2, lead_id))
            first.start()
            try:
                time.sleep(lead_s)
                _timed_request(cluster, prompt(prefill_tokens), 2, behind_id)
            finally:
                first.join()
            lead, span = compute_span(lead_id), compute_span(behind_id)
            if span.start >= lead.end:
                return lead_id, behind_id, lead.seconds, span.seconds
            lead_s += 0.5 * lead.seconds
        raise RuntimeError(f"probe-prefill-behind-{tag} shared a step with the prompt ahead "
                           f"of it {PAIR_TRIES} times (last sent {lead_s:.3f} s after it)")

    def landing_stall(rids: list[str], landings: list[str], gap: float) -> float | None:
        """Mean excess of the decodes `rids` over the transfer stage of each of `landings`
        (from a gap before it to two after) over their gap `gap`."""
        xs = []
        for lid in landings:
            span = span_of(lid, "transfer")
            for r in rids:
                ts = [t for t in traces.get(r).token_times
                      if span.start - gap <= t <= span.end + 2 * gap]
                if len(ts) >= 2:
                    xs.append(ts[-1] - ts[0] - (len(ts) - 1) * gap)
        return sum(xs) / len(xs) if xs else None

    def beside(batch: int, tokens: int, lead_s: float) -> dict:
        """`batch` decodes, the beside prompt and the pairs once they all stream (above)."""
        tenths = [threading.Event() for _ in range(batch)]
        box: dict[int, tuple] = {}
        rids = [f"probe-decode-b{batch}-{i}" for i in range(batch)]

        def decode(i: int) -> None:
            try:
                box[i] = _timed_request(cluster, prompt(context), tokens, rids[i],
                                        first=tenths[i], first_at=10)
            finally:
                tenths[i].set()
        ths = [threading.Thread(target=decode, args=(i,)) for i in range(batch)]
        for th in ths:
            th.start()
        rid = f"probe-prefill-beside-b{batch}"
        try:
            for ev in tenths:
                ev.wait()
            ready = time.time()                       # (the traces' clock)
            _timed_request(cluster, prompt(prefill_tokens), 2, rid)
            landed = traces.get(rid).token_times[1]   # D's first step after it
            wait_tokens(rids, landed, 10)             # the window after it
            pairs_from = time.time()
            pairs = [pair(f"b{batch}-{k}", lead_s) for k in range(BEHIND_RUNS)]
            leads, behinds = [p[0] for p in pairs], [p[1] for p in pairs]
            shorts = [f"probe-prefill-short-b{batch}-{k}" for k in range(ALONE_RUNS)]
            for x in shorts:
                _timed_request(cluster, prompt(context), 2, x)
        finally:
            for th in ths:
                th.join()
        assert len(box) == batch, f"a probe decode request at batch {batch} failed"
        if min(traces.get(r).token_times[-1] for r in rids) < traces.get(shorts[-1]).ttft_s \
                + traces.get(shorts[-1]).arrival:
            raise RuntimeError(f"the probe's decodes at batch {batch} ended before its "
                               f"prefills did ({tokens} tokens each are too few)")
        span = compute_span(rid)
        inside, outside = [], []
        for r in rids:
            ts = [t for t in traces.get(r).token_times[1:] if t >= ready]   # all B run
            inside.append(mean_gap([t for t in ts if span.start <= t <= span.end]))
            outside.append(mean([mean_gap([t for t in ts if t < span.start]),
                                 mean_gap([t for t in ts if landed < t < pairs_from])]))
        gap = mean(outside)
        stall = landing_stall(rids, [rid, *behinds], gap) if gap else None
        return {"batch": batch, "decode_tokens": tokens, "decode_gap_s_outside": gap,
                "decode_stall_s_per_landing": stall,
                "decode_gap_s_inside_prefill": mean(inside),
                "prefill_compute_s_beside_decode": [span.seconds] + [p[2] for p in pairs],
                "staging_s_beside_decode": [staging_of(x) for x in (rid, *leads)],
                "prefill_compute_s_behind": [p[3] for p in pairs],
                "handoff_s_beside_decode": statistics.fmean(
                    handoff_of(x) for x in (rid, *leads, *behinds)),
                "handoff_s_beside_decode_short": statistics.fmean(map(handoff_of, shorts))}
    alone_ids = [f"probe-prefill-before-{i}" for i in range(ALONE_RUNS)]
    for rid in alone_ids:
        _timed_request(cluster, prompt(prefill_tokens), 2, rid)
    # the second of a pair goes out half a compute into the first's, counted from when the
    # first's compute starts (the dispatch before it, measured on the same requests)
    lead_s = statistics.median(compute_span(rid).start - traces.get(rid).arrival
                               + 0.5 * compute_span(rid).seconds for rid in alone_ids)
    rows = [beside(b, n, lead_s) for b, n in sorted(decode_tokens.items())]
    after_ids = [f"probe-prefill-after-{i}" for i in range(ALONE_RUNS)]
    for rid in after_ids:
        _timed_request(cluster, prompt(prefill_tokens), 2, rid)
    alone_ids += after_ids
    short_ids = [f"probe-prefill-short-{i}" for i in range(ALONE_RUNS)]   # the link's 2nd size
    for rid in short_ids:
        _timed_request(cluster, prompt(context), 2, rid)
    computes = [compute_span(rid).seconds for rid in alone_ids]
    alone = statistics.median(computes)
    # what a request spends around its prefill on the idle cluster (route, admit, the
    # transfer, the first token's way to the client): TTFT at the client less compute, staging
    staging = statistics.median(staging_of(rid) for rid in alone_ids)
    handoff = statistics.fmean(handoff_of(rid) for rid in alone_ids)
    handoff_short = statistics.fmean(handoff_of(rid) for rid in short_ids)
    alone_line = link_line(context, handoff_short, prefill_tokens, handoff)
    for row in rows:
        inside, outside = row["decode_gap_s_inside_prefill"], row["decode_gap_s_outside"]
        beside_s = statistics.median(row["prefill_compute_s_beside_decode"])
        row["decode_x"] = max(1.0, inside / outside) if inside and outside else 1.0
        row["prefill_x"] = max(1.0, beside_s / alone) if alone > 0 else 1.0
        h_long = row["handoff_s_beside_decode"]
        line = link_line(context, row["handoff_s_beside_decode_short"], prefill_tokens, h_long)
        if alone_line and line:   # the bytes' slope x, and the rest on the latency
            row["handoff_x"] = max(1.0, line[1] / alone_line[1])
            row["handoff_s"] = max(0.0, h_long - alone_line[0]
                                   - row["handoff_x"] * alone_line[1] * prefill_tokens)
        else:                     # no line: the whole handoff longer
            row["handoff_x"] = max(1.0, h_long / handoff) if handoff > 0 else 1.0
            row["handoff_s"] = 0.0
        row["send_s_per_token"] = max(0.0, statistics.median(row["prefill_compute_s_behind"])
                                      - beside_s) / prefill_tokens
        row["stage_x"] = max(1.0, statistics.median(row["staging_s_beside_decode"]) / staging) \
            if staging > 0 else 1.0
        row["land_s_per_token"] = max(0.0, row["decode_stall_s_per_landing"] or 0.0) \
            / prefill_tokens
    one = rows[0]
    return {"context": context, "prefill_tokens": prefill_tokens,
            "prefill_compute_s_alone": alone, "handoff_s_alone": handoff,
            "handoff_s_alone_short": handoff_short,
            "staging_s_alone": staging, "stage_s_per_token": staging / prefill_tokens,
            **{k: one[k] for k in ("decode_tokens", "decode_gap_s_outside",
                                   "decode_gap_s_inside_prefill",
                                   "prefill_compute_s_beside_decode",
                                   "prefill_compute_s_behind", "handoff_s_beside_decode",
                                   "handoff_s_beside_decode_short",
                                   "staging_s_beside_decode",
                                   "decode_stall_s_per_landing", *FIGURES)},
            "at_batch": rows[1:]}


FIGURES = ("prefill_x", "decode_x", "handoff_x", "handoff_s", "stage_x", "send_s_per_token",
           "land_s_per_token")


def link_line(n_short: int, h_short: float, n_long: int, h_long: float
              ) -> tuple[float, float] | None:
    """(latency s, s per token) of the line through two handoffs; None if it does not rise."""
    if h_long <= h_short or n_long <= n_short:
        return None
    per = (h_long - h_short) / (n_long - n_short)
    return max(0.0, h_long - per * n_long), per


def shared_host_of(probe: dict) -> SharedHost:
    """The probe's slowdowns as the simulator's SharedHost (batch 1's at the top level)."""
    return SharedHost(tuple(HostSlowdown(row.get("batch", 1), **{k: row[k] for k in FIGURES})
                            for row in (probe, *probe["at_batch"])))


PROBE_CONTEXT, PROBE_PREFILL = 512, 2048   # the probe's lengths (the calibration's too): 512, one
# step of the workers' CPU step budget; 2048, four of them (the longest prompt the probe sends,
# where sharing the host costs most; the replay's lengths lie between the two)
PROBE_BATCHES = (1, 8)     # the decode batches the probe measures the slowdowns at
ALONE_RUNS = 4      # the probe's prefills alone, before and after (medians: one slow is noise)
PAIR_TRIES = 3      # a pair that shared a step is sent again, up to this many times
BEHIND_RUNS = 3     # the probe's pairs of prefills (one right behind the other) per batch
REPLAY_LENS = (200, 450, 900)              # the replay's: none of the above
REPLAY_SEED = 7     # the development replay: the simulator's structure was built against it
LOADS = (("light", 0.3), ("near_saturation", 0.85))
# Policy, stated: a load passes when every metric's error is within TOLERANCE; goodput is judged
# at SLO_P50_MULTIPLE x the load's own real p50 TTFT and TPOT (SLOs a simulator that misplaces
# the p50 by more than the tolerance misses); a "light" load whose real prefill worker was
# busy more than LIGHT_MAX_UTILIZATION of its window was not light here (its verdict fails)
TOLERANCE = 0.25
SLO_P50_MULTIPLE = 1.25
LIGHT_MAX_UTILIZATION = 0.5
TOKEN_IDS = (100, 30000)   # prompt token ids drawn from [low, high) (a smaller vocab: its own)


@dataclass(frozen=True)
class WorkerSettings:
    """How the validation's workers run, from the one config chain (module doc); the
    calibration runs at `step_budget` and `calibration_threads`."""
    step_budget: int           # tokens per engine step (engine.max_num_batched_tokens resolved)
    threads_per_worker: int    # torch threads each worker reserves (PDConfig.threads_per_actor)
    share_idle_threads: bool   # a busy worker also takes the idle workers' (thread_share.py)
    calibration_threads: int   # what a busy worker takes while the other one is idle


def _pd_config(engine: dict):
    """The probe's and the replay's cluster: 1P+1D at the config chain's defaults otherwise."""
    from cluster.pd import PDConfig
    return PDConfig(engine=engine, num_prefill=1, num_decode=1, flow=_flow())


def worker_settings(engine: dict, cpus: int | None = None) -> WorkerSettings:
    """The 1P+1D workers' step budget and threads: the engine dict's max_num_batched_tokens,
    else the engine's default for its device (protocol/step_rates.py; cpu here); PDConfig's
    threads. With share_idle_threads a busy worker runs on its own threads plus the idle
    one's, up to the CPUs it may use (workers/thread_share.py ThreadShare.threads): the
    calibration, one engine busy alone, runs at that count (the probe's anchors, prefills and
    decodes with the other worker idle, at the same; the shared host's slowdowns on top)."""
    import os
    cfg = _pd_config(engine)
    device = "cuda" if engine.get("device") == "cuda" else "cpu"
    budget = engine.get("max_num_batched_tokens") or default_batched_tokens(device)
    own = cfg.threads_per_actor
    cpus = cpus or len(os.sched_getaffinity(0))
    workers = cfg.num_prefill + cfg.num_decode
    alone = max(own, min(own * workers, cpus)) if cfg.share_idle_threads else own
    return WorkerSettings(budget, own, cfg.share_idle_threads, alone)


def _model_limits(engine: dict) -> tuple[tuple[int, int], int]:
    """(token id range for prompts, the longest sequence) of the engine's model."""
    from workers.model_loader import base_config
    config = base_config(engine.get("model", "smollm2"))
    high = min(TOKEN_IDS[1], config.vocab_size)
    low = min(TOKEN_IDS[0], high // 2)
    return (low, high), engine.get("max_model_len") or config.max_position_embeddings


def _warm_up(cluster, lens, rng: random.Random, tokens: tuple[int, int] = TOKEN_IDS) -> None:
    """One request of each prompt length through both workers (not measured)."""
    from workers.request import SamplingParams
    for n in sorted(set(lens)):
        cluster.run_request([rng.randrange(*tokens) for _ in range(n)],
                            SamplingParams(max_tokens=4, ignore_eos=True))


def _flow():
    """The real cluster's flow, as the simulator models it and as recorded: object_store, every
    prefill on the prefill worker (the simulator has no backlog rule)."""
    from router.flow_config import FlowConfig
    return FlowConfig(transport="object_store", local_prefill_when_backlogged=False)


def run_probe(engine: dict, cost: CostModel, lens: tuple[int, int] = (PROBE_CONTEXT,
                                                                     PROBE_PREFILL),
              batches: tuple[int, ...] = PROBE_BATCHES) -> dict:
    """The shared-host and handoff probe on a 1P+1D cluster of its own (started, warmed up at
    the probe's lengths `lens` (context, prefill), probed at decode `batches`, shut down):
    calibration figures the replay never sees."""
    from cluster.pd import PDCluster
    context, prefill = lens
    tokens_range, max_len = _model_limits(engine)
    cluster = PDCluster(_pd_config(engine))
    try:
        rng = random.Random(1)
        _warm_up(cluster, lens, rng, tokens_range)
        # enough tokens per sequence to decode through the batch's own prefills and the
        # probe's (one beside, BEHIND_RUNS pairs, each sent half a prefill apart, ALONE_RUNS
        # short ones): 10 before, 2x their time, 10 between, 10 after (within the model's
        # length: a shorter run fails the probe's own check, never passes unseen)
        solo = cost.prefill.prefill_s(prefill)
        short = cost.prefill.prefill_s(context)
        tokens = {b: min(max_len - context - 2, 30 + math.ceil(
            2.0 * (solo * (1 + 2.5 * BEHIND_RUNS) + (b + ALONE_RUNS) * (short + 0.1))
            / max(cost.decode.step_s(b, b * context), 1e-3))) for b in batches}
        return probe_shared_host(cluster, rng, context, prefill, tokens, tokens_range)
    finally:
        cluster.shutdown()


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_real(replays: dict[str, list], max_tokens: int, engine: dict, rounds: int = 2,
             seed: int = 0, tokens: tuple[int, int] = TOKEN_IDS) -> dict[str, dict]:
    """Each load's replay on one real 1P+1D cluster (Ray already started: `validate`), after a
    warm-up, `rounds` times one after the other (new prompts each round, drawn from `seed`):
    per load the figures pool every round's requests, `rounds` gives each round's and
    `round_spread` how far they differ; `failed` counts requests that ended with an error;
    `prefill_busy_s` is the union of the prefill worker's compute and staging spans over the
    load's requests (every round)."""
    from cluster.pd import PDCluster
    cluster = PDCluster(_pd_config(engine))
    out = {}
    try:
        _warm_up(cluster, [len(p) for r in replays.values() for _, p in r], random.Random(2),
                 tokens)
        for name, replay in replays.items():
            per: dict[int, tuple[float, float | None]] = {}
            errors: list[str] = []
            stages: dict[int, dict[str, float]] = {}
            busy: list[tuple[float, float]] = []
            rounds_out: list[dict] = []
            for k in range(rounds):   # same arrivals and lengths, new prompts (no prefix hits,
                rng_k = random.Random(f"{seed}:{name}:{k}")   # across loads and rounds too)
                this = replay if k == 0 else [
                    (at, [rng_k.randrange(*tokens) for _ in p]) for at, p in replay]
                per_k: dict[int, tuple[float, float | None]] = {}
                _replay_once(cluster, this, max_tokens, f"validate-{name}-r{k}", per_k, errors)
                rounds_out.append(_summary(per_k))
                for idx in range(len(replay)):
                    trace = cluster.orchestrator.traces.get(f"validate-{name}-r{k}-{idx}")
                    if trace is not None:
                        busy += [(x.start, x.end) for x in trace.spans
                                 if x.stage in ("prefill_compute", "staging")]
                    if idx in per_k:
                        per[k * len(replay) + idx] = per_k[idx]
                        stages[k * len(replay) + idx] = trace.stage_seconds() if trace else {}
            res = _summary(per, errors)
            for idx, st in stages.items():
                res["per_request"][idx]["stage_s"] = st
            res["failed"] = len(errors)
            res["prefill_busy_s"] = busy_seconds(busy)
            res["rounds"] = [{k: r[k] for k in METRICS} for r in rounds_out]
            res["round_spread"] = _spread(rounds_out, res)
            out[name] = res
    finally:
        cluster.shutdown()
    return out


METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def _spread(rounds: list[dict], pooled: dict) -> float | None:
    """The largest (max - min over rounds) / pooled figure of the three metrics: how far the
    real cluster disagrees with itself on the same replay (the noise floor of
    sim_vs_real_error)."""
    if len(rounds) < 2:
        return None
    out = [(max(r[k] for r in rounds) - min(r[k] for r in rounds)) / pooled[k]
           for k in METRICS if pooled[k] and not any(math.isnan(r[k]) for r in rounds)]
    return max(out) if out else None


def _replay_once(cluster, replay, max_tokens: int, prefix: str,
                 per: dict[int, tuple[float, float | None]], errors: list[str]) -> None:
    """One pass of the replay: each request on its own thread at its arrival time; TTFT at
    the first streamed token, TPOT from the first to the last."""
    t0 = time.perf_counter()

    def one(idx, at, prompt):
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        try:
            start, token_times, n = _timed_request(cluster, prompt, max_tokens,
                                                   f"{prefix}-{idx}")
        except Exception as e:   # noqa: BLE001 - counted, reported
            errors.append(str(e))
            return
        per[idx] = (token_times[0] - start,
                    (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None)
    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(replay)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _summary(per: dict[int, tuple[float, float | None]], errors: list[str] | None = None
             ) -> dict:
    ttft = [t for t, _ in per.values()]
    tpot = [t for _, t in per.values() if t is not None]
    out = {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
           "served": len(per),
           "per_request": {i: {"ttft_s": a, "tpot_s": b} for i, (a, b) in sorted(per.items())}}
    if errors is not None:
        out["errors"] = errors
    return out


def run_sim(replay, max_tokens: int, cost: CostModel, block_tokens: int) -> dict:
    reqs = [SimRequest(at, len(p), max_tokens,
                       tuple(10_000 * j + i for i in range(cdiv(len(p), block_tokens))))
            for j, (at, p) in enumerate(replay)]
    sim = ClusterSim(cost, ClusterConfig(num_prefill=1, num_decode=1, policy="locality",
                                         max_tokens=max_tokens,
                                         block_tokens=block_tokens, slo_ttft_s=1e9,
                                         slo_tpot_s=1e9, shed_on_slo=False,
                                         shared_host=True))
    sim.run(reqs)
    return _summary({j: (t, sim.tpot_s.get(j) if max_tokens > 1 else None)
                     for j, t in sim.ttft_s.items() if j in sim.tpot_s})


def _calibration(engine: dict, threads: int, repeats: int, step_budget: int,
                 max_len: int) -> dict:
    from raypd.bench.engine import CALIBRATION_PREFILL, calibration_batches, run_calibration
    return run_calibration(model=engine.get("model", "smollm2"), threads=threads,
                           dtype=engine.get("dtype", "auto"), repeats=repeats, device="cpu",
                           max_num_batched_tokens=step_budget,
                           prefill_lens=tuple(n for n in CALIBRATION_PREFILL if n < max_len),
                           prefill_batches=calibration_batches(step_budget))


def calibrate(engine: dict, threads: int | None = None, repeats: int = 3) -> dict:
    """`raypd bench engine --calibration` figures for the workers' engine, measured here now,
    at the workers' step budget (prompts past it chunked as the workers chunk them), in a Ray
    task placed like the workers (num_cpus=0: Ray's worker environment, OMP_NUM_THREADS=1 among
    others, made the same prefill ~15% slower than in a plain process on one machine, so a
    calibration outside it predicts the workers wrong), at `threads` torch threads (None: what a
    busy worker of the 1P+1D cluster takes while the other is idle, `worker_settings`), at the
    calibration's prompt lengths that fit the model. The result carries the settings it ran
    at (`worker_settings`)."""
    import ray
    settings = worker_settings(engine)
    threads = threads or settings.calibration_threads
    out = ray.get(ray.remote(num_cpus=0)(_calibration).remote(
        engine, threads, repeats, settings.step_budget, _model_limits(engine)[1]))
    out["worker_settings"] = asdict(settings)
    return out


def goodput(summary: dict, slo_ttft_s: float, slo_tpot_s: float, sent: int) -> float:
    """The share of the `sent` requests that ended within both SLOs (failed ones do not)."""
    ok = sum(1 for r in summary["per_request"].values() if r["ttft_s"] <= slo_ttft_s
             and (r["tpot_s"] is None or r["tpot_s"] <= slo_tpot_s))
    return ok / sent if sent else 0.0


def errors_of(sim: dict, real: dict) -> dict[str, float | None]:
    """Per metric |sim - real| / real (goodput: absolute when real is 0); None where either
    side has no figure (a metric nobody can judge is reported, not dropped)."""
    out: dict[str, float | None] = {}
    for k in (*METRICS, "goodput"):
        a, b = sim.get(k), real.get(k)
        if a is None or b is None or math.isnan(a) or math.isnan(b):
            out[k] = None
        elif b:
            out[k] = abs(a - b) / abs(b)
        else:
            out[k] = abs(a - b) if k == "goodput" else (0.0 if a == b else None)
    return out


def worst(errors: dict[str, float | None]) -> float | None:
    """The largest error; None if any metric could not be judged."""
    vals = list(errors.values())
    return None if any(v is None for v in vals) else max(vals)


def draw_replay_seed() -> int:
    """A fresh replay seed whose loads' seeds (seed + i) miss the development replay's."""
    rng = random.SystemRandom()
    while True:
        seed = rng.randrange(1, 2**31)
        if abs(seed - REPLAY_SEED) > 16:
            return seed


def slos_of(real: dict, given_ttft_s: float | None = None,
            given_tpot_s: float | None = None) -> dict:
    """The SLOs a load's goodput is judged at: SLO_P50_MULTIPLE x its real p50 TTFT and TPOT,
    or the given ones (each metric on its own)."""
    def near_p50(x: float | None) -> float:
        return SLO_P50_MULTIPLE * x if x is not None and not math.isnan(x) else math.inf
    return {"ttft_s": given_ttft_s if given_ttft_s is not None else
            near_p50(real["ttft_p50_s"]),
            "tpot_s": given_tpot_s if given_tpot_s is not None else
            near_p50(real["tpot_p50_s"]),
            "source": {k: "given" if g is not None else f"{SLO_P50_MULTIPLE} x the real p50"
                       for k, g in (("ttft_s", given_ttft_s), ("tpot_s", given_tpot_s))}}


def prefill_service_s(cost: CostModel, num_tokens: int) -> float:
    """The prefill worker's seconds for one cold prompt beside a decode batch of 1 in `cost`:
    its chunks at the shared host's prefill_x, its staging at stage_x, and what the next step
    loses while its pages go to D (send_s_per_token)."""
    h = cost.shared_host.at(1)
    return (cost.prefill.prefill_s(num_tokens) * h.prefill_x
            + cost.prefill.stage_s_per_token * num_tokens * h.stage_x
            + h.send_s_per_token * num_tokens)


def validate(cost: CostModel | None = None, num_requests: int = 16, max_tokens: int = 16,
             engine: dict | None = None, rounds: int = 2, slo_ttft_s: float | None = None,
             slo_tpot_s: float | None = None, loads=LOADS, replay_seed: int | None = None,
             replay_lens: tuple[int, ...] = REPLAY_LENS,
             probe_lens: tuple[int, int] = (PROBE_CONTEXT, PROBE_PREFILL),
             probe_batches: tuple[int, ...] = PROBE_BATCHES, calibration_repeats: int = 3
             ) -> dict:
    """`cost` None: calibrate here first (see the module doc); `loads`: (name, utilization of
    the prefill worker by the calibrated model) pairs, the busiest one judged; `slo_ttft_s`,
    `slo_tpot_s`: the judged load's SLOs (None: SLO_P50_MULTIPLE x its real p50);
    `replay_seed` None: a fresh one (`draw_replay_seed`); `replay_lens`: the replay's lengths
    (none of the calibration's or the probe's, within the probe's longest)."""
    import ray

    from raypd.bench.engine import CALIBRATION_PREFILL
    engine = engine or {"block_size": 16}
    used = set(CALIBRATION_PREFILL) | set(probe_lens)
    if not replay_lens or set(replay_lens) & used or \
            not all(1 <= n <= probe_lens[1] for n in replay_lens):
        raise ValueError(f"replay lengths {list(replay_lens)}: each within 1..{probe_lens[1]} "
                         f"and none the calibration or the probe measured ({sorted(used)})")
    drawn = replay_seed is None
    seed = draw_replay_seed() if drawn else replay_seed
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        out = _validate(cost, num_requests, max_tokens, engine, rounds, slo_ttft_s,
                        slo_tpot_s, tuple(loads), seed, tuple(replay_lens), tuple(probe_lens),
                        tuple(probe_batches), calibration_repeats)
    finally:
        if started:
            ray.shutdown()
    in_sample = seed == REPLAY_SEED
    out.update({"replay_seed": seed, "replay_seed_drawn": drawn,
                "development_seed": REPLAY_SEED, "out_of_sample": not in_sample})
    if in_sample:    # the development replay: reported apart, never as the verdict
        out["label"] = ("cpu-measured (real) vs simulated cpu-here, on the development replay "
                        f"(seed {REPLAY_SEED}): in sample")
        out["passed_in_sample"], out["passed"] = out["passed"], None
        out["within_25pct"] = None
    return out


def _anchor(cost: CostModel, probe: dict) -> dict:
    """The calibration's level re-anchored to the real workers' speed in the probe (the
    machine drifts 10-25% in the minutes the calibration takes): prefill seconds scaled so
    that the probe's prefill alone takes what it took, decode seconds so that a step of the
    probe's sequence (at its mean context) takes its mean gap outside the prefill. The shapes
    (vs length, batch, context) stay the calibration's. The link (the simulator's only cost
    between a staged prefill and its first token): the line through what the probe's two
    sizes of prefills alone spent around their compute and their staging before their first
    token, against their KV's bytes (latency + bytes / gbps); a line that does not rise keeps
    the stated bandwidth and takes the latency from the longer prompt."""
    kp = probe["prefill_compute_s_alone"] / cost.prefill.prefill_s(probe["prefill_tokens"])
    gap, ctx = probe["decode_gap_s_outside"], probe["context"] + probe["decode_tokens"] // 2
    kd = gap / cost.decode.step_s(1, ctx) if gap else 1.0
    n_long, n_short = probe["prefill_tokens"], probe["context"]
    line = link_line(n_short, probe["handoff_s_alone_short"], n_long, probe["handoff_s_alone"])
    if line:
        gbps = cost.kv_bytes_per_token / line[1] / 1e9
        fit = "line through the two sizes"
    else:
        gbps, fit = cost.link.gbps, "stated bandwidth (the two sizes did not rise)"
    latency = max(0.0, probe["handoff_s_alone"] - n_long * cost.kv_bytes_per_token
                  / (gbps * 1e9))
    return {"prefill_k": kp, "decode_k": kd, "link_latency_s": latency, "link_gbps": gbps,
            "link_fit": fit, "from": "run_probe: a cluster of its own, before the replay's"}


def _validate(cost: CostModel | None, num_requests: int, max_tokens: int, engine: dict,
              rounds: int, slo_ttft_s: float | None, slo_tpot_s: float | None, loads,
              replay_seed: int, replay_lens: tuple[int, ...], probe_lens: tuple[int, int],
              probe_batches: tuple[int, ...], calibration_repeats: int) -> dict:
    from workers.device import cpu_model_name
    settings = worker_settings(engine)
    calibration = None
    if cost is None:
        calibration = calibrate(engine, repeats=calibration_repeats)
        cost = cpu_cost_model(calibration, chunk_tokens=settings.step_budget)
    # the simulated workers chunk prompts at the real workers' step budget
    cost = dataclasses.replace(cost, prefill=dataclasses.replace(
        cost.prefill, chunk_tokens=settings.step_budget))
    tokens_range, _ = _model_limits(engine)
    probe = run_probe(engine, cost, probe_lens, probe_batches)
    anchor = _anchor(cost, probe)
    scaled = cost.scaled(anchor["prefill_k"], anchor["decode_k"])
    calibrated = dataclasses.replace(
        scaled, shared_host=shared_host_of(probe),
        prefill=dataclasses.replace(scaled.prefill,
                                    stage_s_per_token=probe["stage_s_per_token"]),
        link=dataclasses.replace(cost.link, latency_s=anchor["link_latency_s"],
                                 gbps=anchor["link_gbps"]))
    service = sum(prefill_service_s(calibrated, n) for n in replay_lens) / len(replay_lens)
    replays = {name: replay_requests(num_requests, replay_lens, service / u,
                                     seed=replay_seed + i, low=tokens_range[0],
                                     vocab=tokens_range[1])
               for i, (name, u) in enumerate(loads)}
    real = run_real(replays, max_tokens, engine, rounds, replay_seed, tokens_range)
    block = engine.get("block_size", 16)
    judged = max(loads, key=lambda x: x[1])[0]
    out_loads = []
    for name, u in loads:
        replay, r = replays[name], real[name]
        sent = rounds * len(replay)
        sim = run_sim(replay, max_tokens, calibrated, block)
        pooled = _summary({k * len(replay) + i: (x["ttft_s"], x["tpot_s"])
                           for k in range(rounds) for i, x in sim["per_request"].items()})
        slo = slos_of(r, *((slo_ttft_s, slo_tpot_s) if name == judged else ()))
        pooled["goodput"] = goodput(pooled, slo["ttft_s"], slo["tpot_s"], sent)
        r["goodput"] = goodput(r, slo["ttft_s"], slo["tpot_s"], sent)
        err = errors_of(pooled, r)
        top = worst(err)
        utilization = r["prefill_busy_s"] / (sent * service / u)
        row = {"load": name, "utilization": u, "mean_gap_s": service / u,
               "judged": name == judged, "slo": slo,
               "real_prefill_utilization": utilization,
               "sim_vs_real_error": err, "sim_vs_real_error_worst": top,
               "real_failed": r["failed"], "samples_real": r["served"],
               "samples_sim": pooled["served"], "real_round_spread": r["round_spread"],
               "real": r, "sim": pooled}
        ok = top is not None and top <= TOLERANCE and r["failed"] == 0
        if name != judged:
            row["light_is_light"] = utilization <= LIGHT_MAX_UTILIZATION
            ok = ok and row["light_is_light"]
        row["passed"] = ok
        out_loads.append(row)
    by_load = {x["load"]: x["sim_vs_real_error_worst"] for x in out_loads}
    failed = sum(x["real_failed"] for x in out_loads)
    passed = failed == 0 and all(x["passed"] for x in out_loads if x["judged"])
    return {"label": "cpu-measured (real) vs simulated cpu-here, out of sample",
            "cpu_model": cpu_model_name(),
            "worker_settings": asdict(settings),
            "cost_model": calibrated.label,
            "calibration": calibration or "given (--engine-json)",
            "probe": probe, "anchor": anchor,
            "cost_model_fit": {"prefill": asdict(calibrated.prefill),
                               "decode": asdict(calibrated.decode),
                               "link": asdict(calibrated.link),
                               "shared_host": asdict(calibrated.shared_host)},
            "replay": {"requests_per_round": num_requests, "rounds": rounds,
                       "prompt_lens": list(replay_lens), "seed": replay_seed,
                       "probe_lens": list(probe_lens), "probe_batches": list(probe_batches),
                       "max_tokens": max_tokens, "engine": engine},
            "policy": {"tolerance": TOLERANCE, "slo_p50_multiple": SLO_P50_MULTIPLE,
                       "light_max_utilization": LIGHT_MAX_UTILIZATION},
            "loads": out_loads,
            "judged_load": judged,
            "sim_vs_real_error": by_load[judged],
            "sim_vs_real_error_by_load": by_load,
            "real_failed": failed,
            "light_passed": failed == 0 and all(x["passed"] for x in out_loads
                                                if not x["judged"]),
            "within_25pct": passed,
            "passed": passed}
