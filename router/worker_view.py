"""The router's view of its workers: WorkerStates built from the workers' LoadReports plus the
work the router routed since, shared by the live orchestrator and the simulator (so a policy
sees the same thing in both)."""

from __future__ import annotations

from protocol.messages import LoadReport
from router.policies import RoutingDecision, RoutingRequest, WorkerState, cached_tokens

REPORT_INTERVAL_S = 0.1     # the router reads every worker's load report this often (fleet.py)


def apply_load_report(st: WorkerState, rep: LoadReport, now: float | None = None) -> None:
    """A fresh report replaces everything the worker reports. What the router routed there
    before the report's snapshot (router clock `now` - the report's age) is in the report;
    what it routed after is not yet, and stays counted on top."""
    assert st.worker_id == rep.worker_id, (st.worker_id, rep.worker_id)
    st.take_report(rep)
    if now is None:
        st.routed, st.reported_at = [], None
    else:
        taken_at = now - rep.age_s
        st.routed = [r for r in st.routed if r[0] > taken_at + 1e-9]   # (float noise: a
        # request that woke an idle worker is in its snapshot, taken at its arrival)
        st.reported_at = taken_at
    st.queued_tokens += sum(r[1] for r in st.routed)
    st.num_requests += len(st.routed)
    st.routed_s = sum(r[2] for r in st.routed)
    for r in st.routed:          # their adapters will be resident there too
        if r[3]:
            _make_resident(st, r[3])


def _make_resident(st: WorkerState, lora: str) -> None:
    """`lora` resident on st, most recently used (LRU order, st.lora_slots at most)."""
    rest = tuple(x for x in st.loras_resident if x != lora)
    if st.lora_slots and len(rest) >= st.lora_slots:
        rest = rest[len(rest) - st.lora_slots + 1:]
    st.loras_resident = (*rest, lora)


def note_prefill(st: WorkerState, req: RoutingRequest, decision: RoutingDecision,
                 fallback_fit=None, now: float = 0.0) -> None:
    """Count a prefill routed to `st` at router time `now` until a report includes it: its
    uncached tokens, and their seconds by the worker's own fit (else `fallback_fit`)."""
    hit = cached_tokens(req, decision.matched_blocks)
    tokens = max(req.num_tokens - hit, 0)
    seconds = 0.0
    fit = st.prefill_fit or fallback_fit
    if fit is not None:
        seconds = fit.seconds(req.num_tokens, min(hit, req.num_tokens - 1))
        if req.lora and req.lora not in st.loras_resident:
            seconds += st.lora_load_s
    st.routed.append((now, tokens, seconds, req.lora))
    st.queued_tokens += tokens
    st.num_requests += 1
    st.routed_s += seconds
    if req.lora:              # it will be resident there, most recently used (LRU order)
        _make_resident(st, req.lora)


def note_decode(st: WorkerState, req: RoutingRequest, decision: RoutingDecision) -> None:
    """Count a request admitted to decode worker `st` until its next report."""
    st.running_tokens += req.num_tokens
    st.num_requests += 1
    st.free_blocks -= max(0, req.num_blocks - decision.matched_blocks)
