"""A decode worker's load report travels on its delta stream: at most one per interval while it
steps, none owed past an interval once it stops, each with a higher seq. The fleet takes a
pushed report instead of polling that worker (until its stream breaks or the push grows old),
and an older report that arrives after a newer one (a poll crossing a push) gives its KV events
but does not roll its load back."""

from __future__ import annotations

import time

import ray
from conftest import make_engine

import router.fleet as fleet_mod
from kvcache.events import BlockStored
from protocol.messages import LoadReport, RequestInput
from router.fleet import Fleet
from workers.decode_host import DecodeHost
from workers.request import SamplingParams


def test_the_delta_stream_pushes_one_report_an_interval_and_owes_none(tiny_loaded):
    engine = make_engine(tiny_loaded)
    host = DecodeHost("decode-push", dict(model="tiny", num_blocks=64, block_size=16,
                                          device="cpu"))
    every = 0.05
    try:
        prompt = engine.tokenizer.encode("push the load with the tokens", add_special_tokens=False)
        adm = host.admit(RequestInput("r0", prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                      time.time() + 60), local_prefill_max_tokens=10**6)
        assert adm.admitted and adm.local
        # wait_s far above the interval: a report after the last token can only come from
        # the one owed, not from the idle heartbeat
        stream = host.deltas(wait_s=30.0, report_every_s=every)
        pushed, done_at, idle_report_at = [], None, None
        deadline = time.monotonic() + 60
        while idle_report_at is None and time.monotonic() < deadline:
            batch = next(stream)
            now = time.monotonic()
            if any(d.done is not None for d in batch.deltas):
                done_at = now
            if batch.report is not None:
                pushed.append((now, batch.report))
                if done_at is not None and batch.report.num_requests == 0:
                    idle_report_at = now
        assert done_at is not None and idle_report_at is not None, pushed
        assert idle_report_at - done_at < every + 2.0     # not the 30 s heartbeat
        seqs = [r.seq for _, r in pushed]
        assert seqs == sorted(set(seqs)) and seqs[0] >= 1, seqs
        gaps = [b[0] - a[0] for a, b in zip(pushed, pushed[1:], strict=False)]
        assert all(g >= every * 0.9 for g in gaps), gaps   # at most one an interval
        stored = [e for _, r in pushed for e in r.events if isinstance(e, BlockStored)]
        assert stored, "the prefill's KV events came with the pushed reports"
        after = host.load_report()                 # polled after: nothing twice
        assert after.seq == seqs[-1] + 1 and after.events == ()
    finally:
        host.shutdown()


def test_a_long_prefill_without_tokens_still_pushes_reports(tiny_loaded):
    """Chunked prefill: steps that bring no token still move the worker's state (queued
    tokens, KV events), and its reports keep coming at the interval, not with the heartbeat."""
    host = DecodeHost("decode-chunks", dict(model="tiny", num_blocks=96, block_size=16,
                                            max_num_batched_tokens=16, device="cpu"))
    every = 0.02
    try:
        prompt = [5 + (7 * i) % 200 for i in range(1200)]      # 75 chunks of 16
        stream = host.deltas(wait_s=30.0, report_every_s=every)
        first = next(stream)               # idle: its report, at once (none pushed before)
        assert first.report is not None and first.report.num_requests == 0
        adm = host.admit(RequestInput("long", prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                                      time.time() + 60), local_prefill_max_tokens=10**6)
        assert adm.admitted and adm.local
        before_token, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            batch = next(stream)
            if batch.deltas:
                break
            if batch.report is not None:
                before_token.append(batch.report)
        queued = [r.queued_tokens + r.running_tokens for r in before_token]
        assert len(before_token) >= 2, queued             # not one heartbeat 30 s later
        assert any(r.events for r in before_token)        # the chunks' blocks, as they land
    finally:
        host.shutdown()


@ray.remote(num_cpus=0)
class _Polled:
    """A decode worker's report surface: counts the polls."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.polls = worker_id, 0

    def ping(self) -> str:
        return self.worker_id

    def load_report(self) -> LoadReport:
        self.polls += 1
        return LoadReport(self.worker_id, seq=100 + self.polls, num_requests=1)

    def count(self) -> int:
        return self.polls


def test_a_pushing_worker_is_not_polled_and_an_older_report_keeps_only_its_events(
        ray_session, monkeypatch):
    w = _Polled.remote("decode-p")
    fleet = Fleet([], [w], worker_ids={w: "decode-p"})
    fleet.refresh()
    assert ray.get(w.count.remote()) == 1
    assert fleet.state["decode-p"].num_requests == 1
    fleet.apply_pushed(LoadReport("decode-p", seq=200, num_requests=3))
    fleet.refresh()                                   # pushed just now: no poll
    assert ray.get(w.count.remote()) == 1
    assert fleet.state["decode-p"].num_requests == 3
    # a report made before the one applied (seq 150 < 200) arrives late
    late = LoadReport("decode-p", seq=150, num_requests=9,
                      events=(BlockStored((77,), None, 16),))
    fleet.apply_pushed(late)
    assert fleet.state["decode-p"].num_requests == 3          # its load is older
    assert fleet.index.match([77]) == {"decode-p": 1}         # its events still count
    fleet.stream_lost("decode-p")                             # its stream broke: polled
    fleet.refresh()
    assert ray.get(w.count.remote()) == 2
    fleet.apply_pushed(LoadReport("decode-p", seq=300, num_requests=0))
    fleet.refresh()
    assert ray.get(w.count.remote()) == 2
    monkeypatch.setattr(fleet_mod, "PUSHED_FRESH_S", 0.0)     # the push has gone stale
    fleet.refresh()
    assert ray.get(w.count.remote()) == 3
    fleet.close()
