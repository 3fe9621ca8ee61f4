"""The router's KV timeline: what every worker's KV pool held over time, from the load reports
the router already polls (no extra calls). Per worker: blocks referenced by requests, cached but
free (reusable, evictable), free, and the pool size (the capacity boundary); requests and
context tokens held; and the cumulative KV-lifecycle counters (protocol.messages.KVCounters),
whose increases between samples become rates (hit rate over a sliding window) and markers
(evictions, preemptions, tier-2 demotions and reloads, transfers, rejected transfers, restarts).

Samples are kept at most every `interval_s` per worker (reports come every 0.1 s); what happens
between two kept samples is not lost: counters are cumulative, and `blocks_used_peak` is the
largest `blocks_used` any report showed since the previous kept sample. At most `max_samples`
per worker are kept (the oldest go). Times are the router's wall clock (unix seconds) at which
the worker took its snapshot, so a client can place its own requests on the same axis.

Torch- and Ray-free; thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from protocol.messages import KVCounters, LoadReport

TIMELINE_INTERVAL_S = 0.5
TIMELINE_MAX_SAMPLES = 7200        # per worker: an hour at the default interval
HIT_WINDOW_S = 10.0                # the sliding window of the hit rate and reused tokens
MARKERS = ("evictions", "preemptions", "tier2_demotions", "tier2_reloads", "transfers",
           "transfers_rejected")
COUNTER_NAMES = tuple(f.name for f in fields(KVCounters))
COUNTER_INDEX = {n: k for k, n in enumerate(COUNTER_NAMES)}
REUSED, PROMPT = COUNTER_INDEX["reused_tokens"], COUNTER_INDEX["prompt_tokens"]


@dataclass(frozen=True)
class KVSample:
    """One worker's pool as of one report (blocks_used + blocks_cached + blocks_free ==
    total_blocks when the worker reports a pool)."""

    t: float                     # unix seconds (router clock) of the worker's snapshot
    blocks_used: int             # referenced by requests
    blocks_used_peak: int        # the most referenced since the previous kept sample
    blocks_cached: int           # cached but free: reusable prefixes, evictable
    blocks_free: int
    total_blocks: int
    requests: int                # waiting + running (+ reserved, decode)
    tokens_held: int             # context tokens of the running requests (decode) or their
    #                              uncomputed prompt tokens (prefill)
    counters: KVCounters
    incarnation: str
    cum: tuple[int, ...]         # per COUNTER_NAMES, its increases since the track began
    restarts: int                # restarts since the track began


def sample_of(rep: LoadReport, t: float, peak: int, prev: KVSample | None) -> KVSample:
    """The sample of `rep`, its cumulative increases continued from `prev` (the last kept
    sample; None: the first). A restarted worker's counters start again from zero: its whole
    new value is the increase. Kept at record time, so reading a series never re-derives them."""
    new = prev is not None and prev.incarnation != rep.incarnation
    if prev is None:
        cum, restarts = (0,) * len(COUNTER_NAMES), 0
    else:
        cum = tuple(c + (getattr(rep.kv, n) if new else
                         max(0, getattr(rep.kv, n) - getattr(prev.counters, n)))
                    for c, n in zip(prev.cum, COUNTER_NAMES, strict=True))
        restarts = prev.restarts + new
    return KVSample(t=t, blocks_used=rep.active_blocks, blocks_used_peak=max(peak, rep.active_blocks),
                    blocks_cached=rep.evictable_blocks,
                    blocks_free=rep.free_blocks - rep.evictable_blocks,
                    total_blocks=rep.total_blocks, requests=rep.num_requests,
                    tokens_held=rep.running_tokens, counters=rep.kv, incarnation=rep.incarnation,
                    cum=cum, restarts=restarts)


class _Track:
    """One worker's kept samples, plus the newest report not kept yet."""

    def __init__(self, role: str, max_samples: int) -> None:
        self.role = role
        self.kv_bytes_per_token = 0
        self.block_size = 0
        self.samples: deque[KVSample] = deque(maxlen=max_samples)
        self.pending: KVSample | None = None     # newer than samples[-1], within the interval
        self.peak = 0                            # max blocks_used since samples[-1]

    def all(self) -> list[KVSample]:
        return [*self.samples, *([self.pending] if self.pending is not None else [])]


class KVTimeline:
    """Per-worker KV samples from load reports; `to_dict` is the JSON the report, /api and the
    dashboard read."""

    def __init__(self, interval_s: float = TIMELINE_INTERVAL_S,
                 max_samples: int = TIMELINE_MAX_SAMPLES) -> None:
        assert interval_s >= 0 and max_samples >= 2
        self.interval_s = interval_s
        self.max_samples = max_samples
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def record(self, role: str, rep: LoadReport, now: float | None = None) -> None:
        """Note one report of a worker of `role` (router wall clock `now`, default time.time())."""
        t = (time.time() if now is None else now) - rep.age_s
        with self._lock:
            tr = self._tracks.get(rep.worker_id)
            if tr is None:
                tr = self._tracks[rep.worker_id] = _Track(role, self.max_samples)
            tr.kv_bytes_per_token = rep.kv_bytes_per_token or tr.kv_bytes_per_token
            tr.block_size = rep.block_size or tr.block_size
            tr.peak = max(tr.peak, rep.active_blocks)
            last = tr.samples[-1] if tr.samples else None
            if last is not None and t < last.t:          # an older snapshot arrived late
                return
            s = sample_of(rep, t, tr.peak, last)
            if last is None or t - last.t >= self.interval_s or s.incarnation != last.incarnation:
                tr.samples.append(s)
                tr.pending, tr.peak = None, 0
            else:
                tr.pending = s

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._tracks)

    def to_dict(self, since: float | None = None, until: float | None = None,
                t0: float | None = None, window_s: float = HIT_WINDOW_S,
                max_points: int | None = None) -> dict[str, Any]:
        """{"t0", "interval_s", "window_s", "markers", "workers": [...]}: per worker its series
        (times in seconds from `t0`, default the first sample's time) over [since, until];
        at most `max_points` points per worker (evenly thinned; peaks and counters still cover
        what was dropped)."""
        with self._lock:
            tracks = {wid: (tr.role, tr.kv_bytes_per_token, tr.block_size, tr.all())
                      for wid, tr in self._tracks.items()}
        rows = []
        first = min((s[0].t for *_, s in tracks.values() if s), default=0.0)
        base = first if t0 is None else t0
        for wid, (role, bpt, bs, samples) in sorted(tracks.items(), key=_order):
            rows.append(series(wid, role, bpt, bs, samples, since, until, base, window_s,
                               max_points))
        return {"t0": base, "interval_s": self.interval_s, "window_s": window_s,
                "markers": list(MARKERS), "counters": list(COUNTER_NAMES), "workers": rows}


def _order(item: tuple[str, Any]) -> tuple[int, str]:
    return (0 if item[1][0] == "prefill" else 1, item[0])


def series(worker_id: str, role: str, kv_bytes_per_token: int, block_size: int,
           samples: list[KVSample], since: float | None, until: float | None, t0: float,
           window_s: float, max_points: int | None) -> dict[str, Any]:
    """One worker's JSON series over the samples in [since, until]. A marker at a point counts
    what happened since the previous point shown; the windowed hit rate at a point is reused /
    prompt tokens admitted in the `window_s` before it (None where none were admitted)."""
    assert max_points is None or max_points >= 2
    lo = 0 if since is None else next((i for i, s in enumerate(samples) if s.t >= since),
                                      len(samples))
    hi = len(samples) if until is None else next(
        (i for i, s in enumerate(samples) if s.t > until), len(samples))
    keep = list(range(lo, hi))
    if max_points is not None and len(keep) > max_points:
        step = (len(keep) - 1) / (max_points - 1)
        keep = sorted({keep[round(i * step)] for i in range(max_points)})
    out: dict[str, Any] = {
        "worker_id": worker_id, "role": role, "kv_bytes_per_token": kv_bytes_per_token,
        "block_size": block_size,
        "total_blocks": max((samples[i].total_blocks for i in keep), default=0),
        "t": [], "blocks_used": [], "blocks_used_peak": [], "blocks_cached": [],
        "blocks_free": [], "total": [], "requests": [], "tokens_held": [],
        "hit_rate": [], "reused_tokens": [], "prompt_tokens": [],
        "events": {m: [] for m in (*MARKERS, "restarts")}}
    prev, w = lo, lo        # the previous point's sample; the sliding window's first sample
    for i in keep:
        s = samples[i]
        t = round(s.t - t0, 3)
        out["t"].append(t)
        out["blocks_used"].append(s.blocks_used)
        out["blocks_used_peak"].append(max(x.blocks_used_peak
                                           for x in samples[min(prev + 1, i):i + 1]))
        out["blocks_cached"].append(s.blocks_cached)
        out["blocks_free"].append(s.blocks_free)
        out["total"].append(s.total_blocks)
        out["requests"].append(s.requests)
        out["tokens_held"].append(s.tokens_held)
        for m in MARKERS:
            if n := s.cum[COUNTER_INDEX[m]] - samples[prev].cum[COUNTER_INDEX[m]]:
                out["events"][m].append([t, n])
        if n := s.restarts - samples[prev].restarts:
            out["events"]["restarts"].append([t, n])
        while samples[w].t < s.t - window_s:
            w += 1
        reused = s.cum[REUSED] - samples[w].cum[REUSED]
        prompt = s.cum[PROMPT] - samples[w].cum[PROMPT]
        out["reused_tokens"].append(reused)
        out["prompt_tokens"].append(prompt)
        out["hit_rate"].append(round(reused / prompt, 4) if prompt else None)
        prev = i
    return out
