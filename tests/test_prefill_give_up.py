"""A prefill worker that gives up on a request (its deadline passed, or the step failed) frees
its blocks, and ends the staged copy, even when the request had just finished: a `hold_kv`
request keeps its blocks past the end of its prefill and the loop stages it right away, so
ending it by abort alone would leak the blocks or leave the staging to its lease."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from conftest import random_prompt

from protocol.errors import RequestError, StepFailed
from protocol.messages import PrefillResult, RequestInput
from workers.decode_host import DecodeHost
from workers.prefill_host import PrefillHost
from workers.request import SamplingParams


@pytest.fixture()
def hosts():
    cfg = dict(model="tiny", num_blocks=16, block_size=16)
    p, d = PrefillHost("prefill-t", cfg, transport="shm"), DecodeHost("decode-t", cfg,
                                                                      transport="shm")
    yield p, d
    p.shutdown()
    d.shutdown()


@pytest.mark.parametrize("give_up", [queue.Empty, StepFailed])
def test_a_prefill_given_up_as_it_finishes_frees_its_blocks(hosts, give_up):
    p, d = hosts
    adm = d.admit(RequestInput("r", tuple(random_prompt(40, 3)), SamplingParams(max_tokens=4),
                               time.time() + 60))
    assert adm.admitted and adm.plan is not None
    real_next = p._next
    finished = []

    def next_then_give_up(q, timeout):
        item = real_next(q, timeout)
        if isinstance(item, PrefillResult):   # the loop has staged it (a copy under lease) ...
            finished.append(p.producer.stats().active)
            q.put(item)                       # ... still unread when the worker gives up
            raise give_up("the deadline passed" if give_up is queue.Empty else "step failed")
        return item
    p._next = next_then_give_up
    with pytest.raises((RequestError, StepFailed)):
        p.prefill(adm.request, adm.plan)
    assert finished == [1]                    # it did hold a staged copy when given up
    assert p.engine.kv.pool.counts()["referenced"] == 0
    assert p.producer.stats().active == 0
    assert p.ledger.counters()["open_holds"] == 0
    p.check_invariants()


def test_a_short_prefill_is_staged_before_the_next_prefill_step(hosts):
    """Staging runs in the loop right after the step that finished the prefill: the step that
    starts next (here: held on an event, as a long prefill would run) does not delay the first
    request's answer."""
    p, d = hosts
    adm = d.admit(RequestInput("a", tuple(random_prompt(40, 4)), SamplingParams(max_tokens=2),
                               time.time() + 60))
    gate, state = threading.Event(), {"hold_next": False, "holding": False}
    held = threading.Event()                  # the next step started, and waits on `gate`
    real_step = p.engine.step

    def held_step():
        if state.pop("hold_next", False):
            state["holding"] = True
            held.set()
            gate.wait(60)
            state["holding"] = False
        outputs = real_step()
        if any(o.finished and o.request.hold_kv for o in outputs):   # "a" has its token
            state["hold_next"] = True
        return outputs
    p.engine.step = held_step
    with p._lock:                             # a second request keeps the loop stepping
        p.engine.add_request(random_prompt(40, 5), SamplingParams(max_tokens=3))
    try:
        result = p.prefill(adm.request, adm.plan)
        # answered, though the next step is held (the gate opens only below); that step does
        # run (it may start a moment after the answer reached this thread)
        assert held.wait(10) and state["holding"]
    finally:
        gate.set()
    assert result.handle is not None
    p.abort_transfer(result.handle.transfer_id)


def test_a_prompt_that_waited_through_a_step_is_in_the_next_one(hosts):
    """The engine lock is not fair: a prefill call that waited through a step can lose the
    lock to the loop again and miss the next step too (in a replay here a later 128-token
    prompt overtook an earlier 768-token one that way). The loop lets callers that are waiting
    in first: here the caller only tries for the lock once the loop waits for it (as if it
    lost the race), and its prompt is still in the very next step."""
    p, d = hosts
    adm = d.admit(RequestInput("a", tuple(random_prompt(24, 6)), SamplingParams(max_tokens=2),
                               time.time() + 60))
    rid = adm.request.worker_request_id
    p._doorway_s = 30.0                       # no timing in this test: events only
    gate, holding, at_door = threading.Event(), threading.Event(), threading.Event()
    state = {"hold": False, "held_at": None, "a_at": None, "n": 0}
    real_step, real_lock, cv = p.engine.step, p._lock, p._callers_cv

    def step():
        if state["hold"]:
            state["hold"], state["held_at"] = False, state["n"]
            holding.set()
            gate.wait(60)
        outputs = real_step()
        if state["a_at"] is None and any(o.request.request_id == rid for o in outputs):
            state["a_at"] = state["n"]
        state["n"] += 1
        return outputs

    class Door(threading.Condition):          # tells the test the loop waits for a caller
        def wait_for(self, predicate, timeout=None):
            if not predicate():
                at_door.set()
            return super().wait_for(predicate, timeout)

    class LateLock:                           # the prefill call's thread tries only later
        def __enter__(self):
            if threading.current_thread() is caller:
                assert at_door.wait(30), "the loop never waited for the waiting caller"
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)
    p.engine.step = step
    with real_lock:                           # a long decode keeps the loop stepping
        b = p.engine.add_request(random_prompt(20, 9), SamplingParams(max_tokens=60,
                                                                      ignore_eos=True))
        state["hold"] = True
    box = {}
    caller = threading.Thread(target=lambda: box.setdefault("r", p.prefill(adm.request,
                                                                           adm.plan)))
    try:
        assert holding.wait(30)               # the loop is inside the held step
        p._callers_cv = Door(cv._lock)        # (the same lock: a drop-in for the loop's next wait)
        p._lock = LateLock()
        caller.start()
        with p._callers_cv:                   # the call is counted as waiting
            assert p._callers_cv.wait_for(lambda: p._callers == 1, 30)
    finally:
        gate.set()
    caller.join(60)
    p._lock = real_lock
    assert state["a_at"] == state["held_at"] + 1
    p.abort_transfer(box["r"].handle.transfer_id)
    with p._lock:
        p.engine.abort(b.request_id)
