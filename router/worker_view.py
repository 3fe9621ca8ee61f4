"""The router's view of its workers: WorkerStates built from the workers' LoadReports plus the
work the router routed since, shared by the live orchestrator and the simulator (so a policy
sees the same thing in both)."""

from __future__ import annotations

from kvcache.handoff import LoadReport
from router.policies import RoutingDecision, RoutingRequest, WorkerState, cached_tokens

REPORT_INTERVAL_S = 0.1     # the router polls every worker's load report this often


def apply_load_report(st: WorkerState, rep: LoadReport) -> None:
    """A fresh report replaces everything the worker reports; what the router routed there
    since the previous report is now counted in the report itself."""
    assert st.worker_id == rep.worker_id, (st.worker_id, rep.worker_id)
    for k, v in rep.load().items():
        setattr(st, k, v)
    st.routed_s = 0.0


def note_prefill(st: WorkerState, req: RoutingRequest, decision: RoutingDecision,
                 fallback_fit=None) -> None:
    """Count a prefill routed to `st` until its next report: its uncached tokens, and their
    seconds by the worker's own fit (else `fallback_fit`, e.g. the pooled one)."""
    hit = cached_tokens(req, decision.matched_blocks)
    st.queued_tokens += max(req.num_tokens - hit, 0)
    st.num_requests += 1
    fit = st.prefill_fit or fallback_fit
    if fit is not None:
        st.routed_s += fit.seconds(req.num_tokens, min(hit, req.num_tokens - 1))


def note_decode(st: WorkerState, req: RoutingRequest, decision: RoutingDecision) -> None:
    """Count a request admitted to decode worker `st` until its next report."""
    st.running_tokens += req.num_tokens
    st.num_requests += 1
    st.free_blocks -= max(0, req.num_blocks - decision.matched_blocks)
