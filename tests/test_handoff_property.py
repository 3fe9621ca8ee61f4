"""Property: random interleavings of admit, stage, pull, land, ack, abort, lease expiry and
worker death keep both ledgers and both block pools consistent, and no block is ever written
while it does not belong to the request whose pages land in it.

Both ends run in this process on real engines (tiny model) and the real handoff state
machine (workers/kv_handoff.py); the transport keeps staged pages in memory; time is a fake clock.
"""

from __future__ import annotations

import threading

from conftest import random_prompt
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtransfer.base import KVTransport, TransferError
from kvtransfer.endpoint import KVProducer
from protocol import ledger as L
from protocol.errors import TransferRejected
from protocol.ledger import HandoffLedger
from protocol.messages import AdmittedRequest
from workers.engine import EngineConfig, LLMEngine
from workers.kv_handoff import DecodeHandoff, stage_plan, verify_pages
from workers.request import SamplingParams

LEASE_S = 5.0
SHARED = random_prompt(32, seed=9)
_loaded: list = []


class MemoryTransport(KVTransport):
    name = "memory"

    def __init__(self) -> None:
        super().__init__(worker_id="p", node_id="n")

    def _stage(self, handle, pages):
        self._keep(handle.transfer_id, pages.clone())
        return handle

    def fetch(self, handle):
        return self._kept(handle.transfer_id).clone()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(num_blocks: int) -> LLMEngine:
    if not _loaded:
        from workers.model_loader import load_model
        _loaded.append(load_model("tiny"))
    return LLMEngine(EngineConfig(model="tiny", num_blocks=num_blocks, block_size=16),
                     loaded=_loaded[0])


class World:
    """One prefill and one decode worker; `die_*` replaces a worker by a fresh one."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.lock = threading.RLock()
        self.p_ledger = HandoffLedger(clock=self.clock)
        self.new_prefill()
        self.new_decode()
        self.results: dict[str, object] = {}     # rid -> PrefillResult
        self.pulls: dict[str, tuple] = {}        # rid -> (reservation, result, pages)
        self.admitted: dict[str, AdmittedRequest] = {}
        self.next_id = 0

    def new_prefill(self) -> None:
        self.p = _engine(24)
        self.p_ledger = HandoffLedger(clock=self.clock)
        self.producer = KVProducer(MemoryTransport(), LEASE_S, clock=self.clock)

    def new_decode(self) -> None:
        self.d = _engine(12)
        self.d_ledger = HandoffLedger(clock=self.clock)
        self.handoff = DecodeHandoff(self.d, "decode", self.d_ledger, clock=self.clock)
        self.writes_ok = True
        fill = self.d.handoff.fill

        def checked_fill(req, dest_block_ids, pages, *args, engine=self.d):
            own = {b.block_id for b in engine.kv.blocks_of(req.request_id)}
            self.writes_ok &= set(dest_block_ids) <= own and all(
                engine.kv.pool.blocks[b].ref_cnt > 0 for b in dest_block_ids)
            return fill(req, dest_block_ids, pages, *args)
        self.d.handoff.fill = checked_fill

    # ---- the operations --------------------------------------------------------------------
    def admit(self, seed: int, shared: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = (SHARED if shared else []) + random_prompt(5 + 7 * seed, seed=seed)
        req = self.d.inputs.make_request(tokens, SamplingParams(max_tokens=3, ignore_eos=True),
                                  request_id=rid)
        adm = AdmittedRequest(rid, 0, tuple(req.prompt_token_ids), tuple(req.block_hashes), 16,
                              req.namespace_root, req.sampling, self.clock.now + 30)
        if self.handoff.reserve(req, adm) is not None:
            self.admitted[rid] = adm

    def stage(self, rid: str, corrupt: bool) -> None:
        res = self.handoff.reservations.get(rid)
        if res is None or rid in self.results:
            return
        req = self.p.handoff.admitted_request(self.admitted[rid], max_tokens=1)
        req.hold_kv = True
        self.p.add_request(request=req, prompt=None)
        while self.p.has_unfinished():
            self.p.step()
        self.results[rid] = stage_plan(self.p, self.producer, self.p_ledger, "prefill", req,
                                       res.plan, req.output_token_ids[0], corrupt=corrupt,
                                       clock=self.clock)

    def begin_pull(self, rid: str) -> None:
        result = self.results.get(rid)
        if result is None or rid in self.pulls:
            return
        try:
            res = self.handoff.begin_pull(result)
        except TransferRejected as e:
            event(f"pull rejected: {e.reason}")
            return
        try:
            pages = self.producer.transport.fetch(result.handle)
        except TransferError:   # released (abort, expiry, P died): the reservation waits on
            self.handoff.pull_failed(res)
            return
        self.pulls[rid] = (res, result, pages)   # in flight: an abort now must void it

    def land(self, rid: str) -> None:
        if rid not in self.pulls:
            return
        res, result, pages = self.pulls.pop(rid)
        self.results.pop(rid, None)
        try:
            self.handoff.land(res, result, verify_pages(result, pages))
        except TransferRejected as e:
            event(f"land rejected: {e.reason}")
            self.producer.abort(result.handle.transfer_id)
            return
        event("landed")
        self.producer.ack(result.handle.transfer_id)
        self.d.abort(rid)   # decoding is not this test's subject: end it, keep the cache

    def abort(self, rid: str) -> None:
        self.handoff.cancel(rid, L.ABORTED)
        result = self.results.pop(rid, None)
        if result is not None:
            self.producer.abort(result.handle.transfer_id)

    def expire(self) -> None:
        self.clock.now += LEASE_S + 31
        self.producer.expire()
        self.handoff.expire()

    def die_prefill(self) -> None:
        self.new_prefill()       # its staged pages, leases and ledger die with it

    def die_decode(self) -> None:
        self.new_decode()
        self.pulls.clear()       # pulls in flight died with it; late results stay around

    # ---- the invariants --------------------------------------------------------------------
    def check(self) -> None:
        for eng in (self.p, self.d):
            eng.check_invariants()
        self.p_ledger.check_invariants()
        self.d_ledger.check_invariants()
        assert self.writes_ok, "a page landed in a block its request does not own"
        assert {h.request_id for h in self.d_ledger.open_holds()} == set(self.handoff.reservations)
        assert len(self.p_ledger.open_holds()) == len(self.producer.leases)
        # P keeps no block referenced for a staged transfer (the staged copy is private)
        assert self.p.kv.pool.counts()["referenced"] == 0
        held = {b.block_id for r in self.handoff.reservations.values()
                for b in self.d.kv.blocks_of(r.request.request_id)}
        assert all(self.d.kv.pool.blocks[b].ref_cnt > 0 for b in held)

    def drain(self) -> None:
        for rid in list(self.handoff.reservations):
            self.abort(rid)
        self.expire()
        self.check()
        assert self.d.kv.pool.counts()["referenced"] == 0
        assert self.d_ledger.open_holds() == [] == self.p_ledger.open_holds()


class HandoffMachine(RuleBasedStateMachine):
    """Hypothesis picks the next step among the rules; every step is followed by `check`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = World()

    def _rid(self, k: int) -> str | None:
        w = self.w
        live = sorted(set(w.handoff.reservations) | set(w.results) | set(w.pulls))
        rids = live or sorted(w.admitted)
        return rids[k % len(rids)] if rids else None

    @rule(k=st.integers(0, 4), shared=st.booleans())
    def admit(self, k, shared):
        self.w.admit(k, shared)

    @rule(k=st.integers(0, 2), corrupt=st.booleans())
    def stage(self, k, corrupt):
        if (rid := self._rid(k)) is not None:
            self.w.stage(rid, corrupt)

    @rule(k=st.integers(0, 2), corrupt=st.booleans())
    def stage_and_pull(self, k, corrupt):
        if (rid := self._rid(k)) is not None:
            self.w.stage(rid, corrupt)
            self.w.begin_pull(rid)

    @rule(k=st.integers(0, 2), corrupt=st.booleans())
    def whole_handoff(self, k, corrupt):
        if (rid := self._rid(k)) is not None:
            self.w.stage(rid, corrupt)
            self.w.begin_pull(rid)
            self.w.land(rid)

    @rule(k=st.integers(0, 2))
    def begin_pull(self, k):
        if (rid := self._rid(k)) is not None:
            self.w.begin_pull(rid)

    @rule(k=st.integers(0, 2))
    def land(self, k):
        if (rid := self._rid(k)) is not None:
            self.w.land(rid)

    @rule(k=st.integers(0, 2))
    def abort(self, k):
        if (rid := self._rid(k)) is not None:
            self.w.abort(rid)

    @rule(k=st.integers(0, 2), reuse=st.booleans(), then_land=st.booleans())
    def abort_while_pulling(self, k, reuse, then_land):
        """The race of old: the client aborts while a pull into the blocks is in flight,
        maybe another request takes the freed blocks, maybe the pull completes then."""
        w = self.w
        if not w.pulls and (rid := self._rid(k)) is not None:
            w.stage(rid, False)
            w.begin_pull(rid)
        pulling = sorted(w.pulls)
        event(f"pulls in flight: {min(len(pulling), 1)}")
        if pulling:
            rid = pulling[k % len(pulling)]
            w.abort(rid)
            if reuse:
                w.admit(k, False)
            if then_land:
                w.land(rid)

    @rule()
    def expire(self):
        self.w.expire()

    @rule()
    def die_prefill(self):
        self.w.die_prefill()

    @rule()
    def die_decode(self):
        self.w.die_decode()

    @invariant()
    def consistent(self):
        self.w.check()

    def teardown(self):
        self.w.drain()


HandoffMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_random_handoff_interleavings_keep_ledgers_and_pools_consistent = HandoffMachine.TestCase
