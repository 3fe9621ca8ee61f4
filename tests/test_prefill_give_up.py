"""A prefill worker that gives up on a request (its deadline passed, or the step failed) frees
its blocks even when the request had just finished: a `hold_kv` request keeps its blocks past
the end of its prefill, so ending it by abort alone would leak them."""

from __future__ import annotations

import queue
import time

import pytest
from conftest import random_prompt

from kvcache.handoff import RequestInput
from kvcache.sampling import RequestError, StepFailed
from workers.actors import _DONE, DecodeHost, PrefillHost
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
        if item is _DONE:       # the request has finished (and holds its blocks) ...
            finished.append(p.engine.kv.pool.counts()["referenced"])
            raise give_up("the deadline passed" if give_up is queue.Empty else "step failed")
        return item             # ... just as the worker gives up on it
    p._next = next_then_give_up
    with pytest.raises((RequestError, StepFailed)):
        p.prefill(adm.request, adm.plan)
    assert finished and finished[0] > 0       # it did hold blocks when given up
    assert p.engine.kv.pool.counts()["referenced"] == 0
    p.check_invariants()
