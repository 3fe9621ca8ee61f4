"""Where one request's time went across router, prefill worker, transfer and decode worker:
the typed per-request handoff trace (plain data, torch-free; router and workers both use it).

Timestamps are the router's wall clock (`time.time()`): a stage is a span [start, end] on one
actor; the router stamps what it sees (arrival, routing decision, admission, the transfer call,
tokens, finish) and the prefill worker reports durations only it can measure (compute, staging,
its engine's queue wait) as `PrefillTiming`; the router lays them back from the moment P's
answer arrived, so no span depends on another node's clock. `prefill_queue` is everything
between admission on D and P starting to compute (P's routing decision, the call reaching P,
P's lock and engine queue); `staging` includes P's answer travelling back.

Invariants: spans have end >= start; `stage_seconds()` has one entry per stage that happened;
on the disaggregated path the stages tile the request (each starts where the one before it
ended), so they sum to arrival -> last token: route, admit, prefill_queue, prefill_compute,
staging, transfer, first_decode (D has the pages -> its first decode step's token reached the
router), decode (-> the last token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The stages of one request, in the order they happen on the disaggregated path.
STAGES = ("route", "admit", "prefill_queue", "prefill_compute", "staging", "transfer",
          "first_decode", "decode")
ROUTER = "router"


@dataclass(frozen=True)
class PrefillTiming:
    """What the prefill worker measured for one request (seconds, its own perf_counter)."""

    engine_queue_s: float        # arrival in P's engine -> first scheduled
    compute_s: float             # first scheduled -> first token sampled
    staging_s: float             # first token -> P answers (exposing pages under a lease)

    @staticmethod
    def measure(arrival: float, first_scheduled: float | None, first_token: float | None,
                now: float) -> PrefillTiming:
        """From the engine's perf_counter stamps of one request, `now` when P answers."""
        first_token = first_token if first_token is not None else now
        first_scheduled = first_scheduled if first_scheduled is not None else arrival
        return PrefillTiming(engine_queue_s=max(0.0, first_scheduled - arrival),
                             compute_s=max(0.0, first_token - first_scheduled),
                             staging_s=max(0.0, now - first_token))


@dataclass
class StageSpan:
    stage: str
    actor: str                   # "router" or a worker id (prefill-0, decode-1, ...)
    start: float
    end: float

    def __post_init__(self) -> None:
        assert self.stage in STAGES, self.stage
        self.end = max(self.end, self.start)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class RequestTrace:
    """One request's handoff trace. `token_times` are the router's receipt times of each
    streamed token (the first one is the token P sampled)."""

    request_id: str
    arrival: float
    routed_at: float | None = None
    admitted_at: float | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    local_prefill: bool = False  # D prefilled it itself (no handoff)
    prefill_engine_queue_s: float = 0.0   # of prefill_queue, the part in P's engine queue
    attempts: int = 1
    spans: list[StageSpan] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    status: int | None = None    # HTTP-style: 200, 400, 429, 499, 502, ...
    transfer_bytes: int = 0

    # ---- built by the router as the request goes --------------------------------------------
    def span(self, stage: str, actor: str, start: float, end: float) -> None:
        self.spans.append(StageSpan(stage, actor, start, end))

    def add_prefill(self, worker: str, t: PrefillTiming, sent: float, answered: float) -> None:
        """P's stages between `sent` (D admitted it) and `answered` (the router has P's
        answer): compute and staging as P measured them, laid back from `answered`; the rest
        of the round trip before them is the queue."""
        self.prefill_worker = worker
        self.prefill_engine_queue_s += t.engine_queue_s
        staging_start = max(sent, answered - t.staging_s)
        compute_start = max(sent, staging_start - t.compute_s)
        self.span("prefill_queue", worker, sent, compute_start)
        self.span("prefill_compute", worker, compute_start, staging_start)
        self.span("staging", worker, staging_start, answered)

    def add_tokens(self, n: int, at: float) -> None:
        self.token_times.extend([at] * n)

    def finish(self, status: int, at: float) -> None:
        self.status, self.finished_at = status, at
        actor = self.decode_worker or ROUTER
        ts = self.token_times
        if len(ts) >= 2:             # ts[0]: P's token (or D's first, when local)
            pages_in = max((s.end for s in self.spans if s.stage == "transfer"), default=None)
            start = pages_in if pages_in is not None and pages_in <= ts[1] else ts[0]
            self.span("first_decode", actor, start, ts[1])
            self.span("decode", actor, ts[1], ts[-1])

    # ---- read ---------------------------------------------------------------------------------
    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage (summed when a stage ran more than once, e.g. retries)."""
        out: dict[str, float] = {}
        for s in self.spans:
            out[s.stage] = out.get(s.stage, 0.0) + s.seconds
        return out

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.finished_at - self.arrival if self.finished_at is not None else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, e2e_s=self.e2e_s, stage_seconds=self.stage_seconds(),
                 output_tokens=len(self.token_times))
        return d

    @staticmethod
    def from_dict(d: dict) -> RequestTrace:
        fields = {k: v for k, v in d.items() if k in RequestTrace.__dataclass_fields__}
        fields["spans"] = [StageSpan(**s) for s in d.get("spans") or ()]
        return RequestTrace(**fields)
