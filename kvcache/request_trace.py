"""Where one request's time went across router, prefill worker, transfer and decode worker:
the typed per-request handoff trace (plain data, torch-free; router and workers both use it).

Timestamps are wall-clock seconds (`time.time()`), the one clock every actor shares on a node
(across nodes they are as good as the nodes' clock sync). A stage is a span [start, end] on
one actor; the router stamps what it sees (arrival, routing decision, admission, the transfer
call, tokens, finish) and the prefill worker reports what only it sees (queue wait, compute,
staging) as `PrefillTiming`, durations anchored at the moment it returned.

Invariants: spans have end >= start; `stage_seconds()` has one entry per stage that happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The stages of one request, in the order they happen on the disaggregated path.
STAGES = ("route", "admit", "prefill_queue", "prefill_compute", "staging", "transfer",
          "first_decode", "decode")
ROUTER = "router"


@dataclass(frozen=True)
class PrefillTiming:
    """What the prefill worker measured for one request (seconds; `returned_at` wall clock)."""

    queue_wait_s: float          # arrival in P's engine -> first scheduled
    compute_s: float             # first scheduled -> first token sampled
    staging_s: float             # exposing the pages D lacks under a lease
    returned_at: float           # time.time() when P answered

    @staticmethod
    def measure(arrival: float, first_scheduled: float | None, first_token: float | None,
                staging_s: float, now_perf: float, now_wall: float) -> PrefillTiming:
        """From the engine's perf_counter stamps of one request (`now_*`: one instant on both
        clocks, taken when P answers)."""
        first_token = first_token if first_token is not None else now_perf
        first_scheduled = first_scheduled if first_scheduled is not None else arrival
        return PrefillTiming(queue_wait_s=max(0.0, first_scheduled - arrival),
                             compute_s=max(0.0, first_token - first_scheduled),
                             staging_s=max(0.0, staging_s), returned_at=now_wall)


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
    attempts: int = 1
    spans: list[StageSpan] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    status: int | None = None    # HTTP-style: 200, 400, 429, 499, 502, ...
    transfer_bytes: int = 0

    # ---- built by the router as the request goes --------------------------------------------
    def span(self, stage: str, actor: str, start: float, end: float) -> None:
        self.spans.append(StageSpan(stage, actor, start, end))

    def add_prefill(self, worker: str, t: PrefillTiming) -> None:
        """P's own three stages, laid back from the moment it answered."""
        self.prefill_worker = worker
        staging_start = t.returned_at - t.staging_s
        compute_start = staging_start - t.compute_s
        self.span("prefill_queue", worker, compute_start - t.queue_wait_s, compute_start)
        self.span("prefill_compute", worker, compute_start, staging_start)
        self.span("staging", worker, staging_start, t.returned_at)

    def add_tokens(self, n: int, at: float) -> None:
        self.token_times.extend([at] * n)

    def finish(self, status: int, at: float) -> None:
        self.status, self.finished_at = status, at
        actor = self.decode_worker or ROUTER
        ts = self.token_times
        if len(ts) >= 2:             # ts[0]: P's token (or D's first, when local)
            self.span("first_decode", actor, ts[0], ts[1])
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
