"""The engine loop's per-step host work around the model: the worker's rate fits refit on a
clock, not at every step that reads them, and the load report is built once a step (again
before a step only when something besides the step changed the engine)."""

from __future__ import annotations

import threading

import pytest
from conftest import random_prompt, wait_until

from protocol import step_rates
from protocol.step_rates import REFIT_INTERVAL_S, StepRates
from workers.host import EngineHost
from workers.request import SamplingParams


@pytest.fixture()
def nnls_calls(monkeypatch) -> list[int]:
    """Each least-squares fit made (protocol.step_rates.nnls), counted."""
    calls: list[int] = []
    real = step_rates.nnls

    def counted(rows, ys):
        calls.append(len(rows))
        return real(rows, ys)
    monkeypatch.setattr(step_rates, "nnls", counted)
    return calls


def test_a_decode_fit_is_not_refit_within_the_clock_interval(nnls_calls):
    now = [100.0]
    rates = StepRates(refit_interval_s=0.25, clock=lambda: now[0])
    for b in (1, 2, 4, 8):
        rates.observe_decode(0.010 + 0.001 * b, b, 100 * b)
    first = rates.decode_fit()              # the first fit: as soon as min_steps exist
    assert first is not None and first.num_steps == 4 and nnls_calls == [4]
    rates.observe_decode(0.5, 16, 1600)
    now[0] += 0.2
    assert rates.decode_fit() is first and nnls_calls == [4]        # within 0.25 s: cached
    now[0] += 0.06
    second = rates.decode_fit()
    assert second is not first and second.num_steps == 5 and nnls_calls == [4, 5]
    now[0] += 1.0
    assert rates.decode_fit() is second and nnls_calls == [4, 5]    # no new step: no refit


def test_a_prefill_fit_is_not_refit_within_the_clock_interval(nnls_calls):
    now = [5.0]
    rates = StepRates(refit_interval_s=0.25, clock=lambda: now[0])
    for n in (64, 128, 256, 512):
        rates.observe_prefill(0.001 * n, [(n, 0)])
    first = rates.prefill_fit()
    assert first is not None and nnls_calls == [4]
    rates.observe_prefill(2.0, [(512, 512)])
    now[0] += 0.1
    assert rates.prefill_fit() is first and nnls_calls == [4]
    now[0] += 0.2
    assert rates.prefill_fit().num_steps == 5 and nnls_calls == [4, 5]


def test_without_an_interval_every_read_after_a_step_refits(nnls_calls):
    """The simulators' StepRates() (no clock): the fit follows every step, as before."""
    rates = StepRates()
    for b in (1, 2, 4, 8, 16):
        rates.observe_decode(0.01 * b, b, 10 * b)
        rates.decode_fit()
    assert nnls_calls == [4, 5]


class _CountingHost(EngineHost):
    """A worker host that counts its load reports and notes, at each step, how many were made
    before it and what the last one said."""

    def __init__(self, *args, **kw) -> None:
        self.reports = 0
        self.at_step: list[tuple[int, int, int]] = []   # (reports, num_requests, queued)
        self.on_step = None                              # called in the loop before a step
        super().__init__(*args, **kw)

    def _publish(self) -> None:
        self.reports += 1
        super()._publish()

    def _run_step(self):
        if self.on_step is not None:
            self.on_step(len(self.at_step))
        snap = self._snapshot
        self.at_step.append((self.reports, snap.num_requests, snap.queued_tokens))
        return super()._run_step()


def _host(**cfg) -> _CountingHost:
    return _CountingHost("host-work", dict(model="tiny", num_blocks=128, block_size=16, **cfg))


def _run(host: _CountingHost, prompts: list[list[int]], max_tokens: int) -> None:
    for p in prompts:
        host.engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    host._work.set()
    host._start_loop()
    try:
        wait_until(lambda: not host.engine.has_unfinished() and host.at_step, timeout=60)
    finally:
        host.shutdown()
        host._thread.join(timeout=10)


def test_steady_decoding_builds_the_load_report_once_a_step():
    host = _host()
    assert host.rates.refit_interval_s == REFIT_INTERVAL_S > 0   # its fits refit on a clock
    _run(host, [random_prompt(20, seed=i) for i in range(4)], max_tokens=12)
    reports = [r for r, _, _ in host.at_step]
    assert len(reports) >= 12
    # between two steps, one report: the one made right after the first of them
    assert [b - a for a, b in zip(reports[:-1], reports[1:], strict=True)] == [1] * (len(reports) - 1)


def test_a_change_between_steps_is_reported_before_the_next_step():
    """A caller's new prompt (an actor call under the lock) and housekeeping's abort both
    reach the report before the next step starts: the router never waits a step for them."""
    host = _host()
    late = random_prompt(30, seed=9)
    took_lock = threading.Event()

    def on_step(step: int) -> None:
        if step == 3:      # a caller arrives during this step and waits for the lock
            def caller():
                with host._call_lock():
                    host.engine.add_request(late, SamplingParams(max_tokens=2))
                took_lock.set()
            threading.Thread(target=caller, daemon=True).start()
            wait_until(lambda: host._callers > 0, timeout=10)

    aborted = []

    def housekeeping() -> None:     # ends the first request once step 6 is done
        if len(host.at_step) == 7 and not aborted:
            rid = next(iter(host.engine.requests))
            aborted.append(host.engine.abort(rid))
    host.on_step = on_step
    host._housekeeping = housekeeping
    _run(host, [random_prompt(20, seed=i) for i in range(3)], max_tokens=16)
    assert took_lock.is_set() and aborted == [True]
    (_, n3, q3), (_, n4, q4) = host.at_step[3:5]
    assert (n4, q4) == (n3 + 1, q3 + len(late))       # the new prompt, queued
    _, n7, _ = host.at_step[7]
    assert n7 == host.at_step[6][1] - 1               # the aborted request, gone
