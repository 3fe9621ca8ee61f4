"""The router's handoff ledger never loses a release: a load report that takes longer than the
health timeout is waited for on the next refresh (it carries hold releases and KV events the
worker has handed over), and a release that reaches the router before the router opened that
hold closes it as it is opened."""

from __future__ import annotations

import threading

import pytest
import ray

from protocol import ledger as L
from protocol.ledger import HandoffLedger
from protocol.messages import HoldRelease, LoadReport
from router.orchestrator import FlowConfig, Orchestrator

pytestmark = pytest.mark.usefixtures("ray_session")


def test_a_release_before_the_hold_was_opened_closes_it_as_it_opens():
    ledger = HandoffLedger()
    assert ledger.release("prefill-0", L.STAGED, "r-0", L.EXPIRED) is None  # report came first
    ledger.hold("prefill-0", L.STAGED, "r-0", 3, 30.0)                      # router's own thread
    assert not ledger.is_open("prefill-0", L.STAGED, "r-0")
    assert ledger.released[L.EXPIRED] == 1 and ledger.held_blocks("prefill-0") == 0
    ledger.hold("prefill-0", L.STAGED, "r-1", 2, 30.0)     # an ordinary hold stays open
    assert ledger.is_open("prefill-0", L.STAGED, "r-1")
    ledger.check_invariants()


@ray.remote(max_concurrency=4)
class SlowReporter:
    """A worker whose first load report hangs until `answer` is called; that report carries
    the release of a staged hold (its lease ran out)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0

    def ping(self) -> str:
        return "prefill-slow"

    def load_report(self) -> LoadReport:
        self.calls += 1
        if self.calls == 1:
            self.go.wait(60)
            return LoadReport("prefill-slow", released=(
                HoldRelease("prefill-slow", L.STAGED, "r-7", L.EXPIRED),))
        return LoadReport("prefill-slow")

    def answer(self) -> None:
        self.go.set()


def test_a_late_report_is_waited_for_not_dropped():
    w = SlowReporter.remote()
    orch = Orchestrator([w], [], FlowConfig(health_timeout_s=0.3, report_interval_s=3600))
    try:
        orch.ledger.hold("prefill-slow", L.STAGED, "r-7", 4, 30.0)
        assert "prefill-slow" in orch.fleet.unhealthy          # its first report did not come in time
        ray.get(w.answer.remote())                       # ... now it has
        orch.fleet.refresh()
        assert not orch.ledger.is_open("prefill-slow", L.STAGED, "r-7")
        assert orch.ledger.released[L.EXPIRED] == 1
        assert "prefill-slow" not in orch.fleet.unhealthy
    finally:
        orch.close()
        ray.kill(w)
