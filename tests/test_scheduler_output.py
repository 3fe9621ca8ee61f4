"""The engine's step as plain data: the scheduler returns a SchedulerOutput and applies a
ModelRunnerOutput, with no model and no torch (a hand-written step stands in for the runner)."""

from __future__ import annotations

from kvcache.manager import KVCacheManager
from protocol.lifecycle import EngineStats
from protocol.sampling import SamplingParams
from workers.request import Request, RequestStatus
from workers.scheduler import Scheduler, SchedulerConfig
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput

BS = 4


def _scheduler(num_blocks: int = 32, budget: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv,
                     EngineStats(num_blocks=num_blocks, block_size=BS))


def _request(rid: str, n: int) -> Request:
    req = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), 0, BS)
    req.update_block_hashes()
    return req


def _run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Request]:
    """What the runner would give back: one token for each chunk that ends its known tokens."""
    rows = [i for i, ch in enumerate(out.chunks) if ch.ends_known_tokens]
    return sched.update_from_output(out, ModelRunnerOutput(rows, [token] * len(rows)), 0.0)


def test_a_prompt_is_chunked_under_the_budget_and_sampled_only_at_its_end():
    sched = _scheduler(budget=8)
    req = _request("a", 14)
    sched.add(req)
    first = sched.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in first.chunks] == [("a", 8)]
    assert not first.chunks[0].ends_known_tokens and _run(sched, first) == []
    assert req.num_computed_tokens == 8 and req.output_token_ids == []
    second = sched.schedule()
    assert second.num_scheduled_tokens == 6 and second.chunks[0].ends_known_tokens
    assert _run(sched, second) == [req]
    assert req.num_computed_tokens == 14 and req.output_token_ids == [7]
    decode = sched.schedule()
    assert decode.chunks[0].is_decode and decode.num_scheduled_tokens == 1


def test_update_from_output_caches_the_blocks_the_step_filled():
    sched = _scheduler(budget=16)
    a = _request("a", 9)
    sched.add(a)
    _run(sched, sched.schedule())            # 9 prompt tokens + 1 sampled: 2 full blocks
    b = _request("b", 9)                     # the same prompt: both full blocks hit
    sched.add(b)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert b.lifecycle.cached_tokens == 2 * BS and b.num_computed_tokens == 2 * BS


def test_step_order_puts_decodes_first_shortest_context_first():
    sched = _scheduler(budget=64)
    long, short = _request("long", 12), _request("short", 5)
    for r in (long, short):
        sched.add(r)
    _run(sched, sched.schedule())            # both prefilled, each with a token
    fresh = _request("fresh", 6)
    sched.add(fresh)
    out = sched.schedule()
    decodes, prefills = out.step_order()
    assert [out.chunks[i].request.request_id for i in decodes] == ["short", "long"]
    assert [out.chunks[i].request.request_id for i in prefills] == ["fresh"]


def test_pause_and_add_running_move_a_decode_out_of_the_batch_and_back():
    sched = _scheduler()
    req = _request("a", 5)
    sched.add(req)
    assert not sched.pause(req)              # queued, not a running decode
    _run(sched, sched.schedule())
    assert sched.pause(req) and req.status is RequestStatus.WAITING
    assert sched.schedule().is_empty         # its blocks stay held; nothing runs
    assert sched.kv.block_table("a")
    sched.add_running(req)
    assert [c.request for c in sched.schedule().chunks] == [req]
