"""The persistent decode batch (workers/model_runner.py DecodeRows): a step's host metadata built
from rows kept across steps equals the same metadata rebuilt from scratch, from plain lists,
through joins, leaves, preemptions and chunked prefills. The scheduler drives the steps and a
fixed token stands in for the model (no forward runs)."""

from __future__ import annotations

import pytest
from conftest import make_engine, random_prompt

from kvcache.manager import cdiv
from workers.request import Request, SamplingParams
from workers.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput


def rebuilt(runner, sched: SchedulerOutput) -> tuple[list[int], list, int, list, list, list]:
    """The step's metadata from scratch: (flat, shapes, num_decodes, groups, segs, sampled
    chunks), as `StepInputs` lays it out: decodes by context length, each one's block table cut
    to its context and padded with block 0, split where the block count doubles (one group
    where the runner reads each row's own context); then the prefill chunks."""
    bs = runner.block_size
    chunks = sched.chunks
    decodes, prefills = sched.step_order()
    tokens, positions, slots, sample_rows, sampled = [], [], [], [], []
    for row, i in enumerate(decodes):
        req, table = chunks[i].request, chunks[i].block_table
        p = req.num_computed_tokens
        tokens.append(req.all_token_ids[p])
        positions.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        if p + 1 == req.num_tokens:
            sample_rows.append(row)
            sampled.append(i)
    parts: list[list] = [tokens, positions, slots, sample_rows]
    groups, start = [], 0
    nblocks = [p // bs + 1 for p in positions]
    while start < len(decodes):
        end = start + 1
        while end < len(decodes) and (runner.one_decode_group
                                      or nblocks[end] <= 2 * nblocks[start]):
            end += 1
        w = nblocks[end - 1]
        tables = [chunks[i].block_table[:nb] + [0] * (w - nb)
                  for i, nb in zip(decodes[start:end], nblocks[start:end], strict=True)]
        parts += [tables, [p + 1 for p in positions[start:end]]]
        groups.append((len(parts) - 2, len(parts) - 1, start, end - start,
                       positions[end - 1] + 1, positions[start] != positions[end - 1]))
        start = end
    segs = []
    for i in prefills:
        ch = chunks[i]
        req, n, start = ch.request, ch.num_new_tokens, ch.request.num_computed_tokens
        q_start = len(tokens)
        tokens += req.all_token_ids[start:start + n]
        table = ch.block_table[:cdiv(start + n, bs)]
        positions += range(start, start + n)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        if start + n == req.num_tokens:
            sample_rows.append(q_start + n - 1)
            sampled.append(i)
        table_part = -1
        if start > 0 or runner.kv_quant:
            parts.append(table)
            table_part = len(parts) - 1
        segs.append((q_start, n, start + n, table_part))
    flat = [x for part in parts for x in _flatten(part)]
    shapes = [(len(p), len(p[0])) if p and isinstance(p[0], list) else (len(p),)
              for p in parts]
    return flat, shapes, len(decodes), groups, segs, sampled


def _flatten(part: list) -> list[int]:
    return [x for row in part for x in row] if part and isinstance(part[0], list) else part


def _step(engine, sched: SchedulerOutput, step: int) -> None:
    """What the engine does after the model, with token `3 + step % 97` for every sample."""
    rows = [i for i, ch in enumerate(sched.chunks) if ch.ends_known_tokens]
    reqs = engine.scheduler.update_from_output(
        sched, ModelRunnerOutput(rows, [3 + step % 97] * len(rows)), 0.0)
    for req in reqs:
        if len(req.output_token_ids) >= req.sampling.max_tokens:
            req.finish("length", 0.0)
            engine.scheduler.finish(req)


SCENARIOS = {
    # a pool of 14 four-token blocks and a 12-token budget: chunked prefills beside decodes,
    # preemptions (a preempted decode comes back with new blocks), requests joining and leaving
    "preempting": dict(num_blocks=14, block_size=4, max_num_batched_tokens=12, max_num_seqs=8,
                       lengths=[5, 13, 22, 9, 30, 3, 17], max_tokens=[9, 4, 14, 20, 6, 11, 8],
                       join_every=3),
    # more decodes than the batch's first rows and contexts wider than its first blocks
    "growing": dict(num_blocks=512, block_size=4, max_num_batched_tokens=256,
                    max_num_seqs=24, lengths=[6 + 3 * i for i in range(22)],
                    max_tokens=[20 + i % 5 for i in range(22)], join_every=1),
}


@pytest.mark.parametrize("one_group", [True, False], ids=["one-group", "length-groups"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_persistent_batch_equals_a_rebuild_across_joins_leaves_preemption_and_chunks(
        tiny_loaded, scenario, one_group):
    sc = SCENARIOS[scenario]
    engine = make_engine(tiny_loaded, num_blocks=sc["num_blocks"], block_size=sc["block_size"],
                         max_num_batched_tokens=sc["max_num_batched_tokens"],
                         max_num_seqs=sc["max_num_seqs"])
    runner = engine.runner
    runner.one_decode_group = one_group
    pending = [engine.inputs.make_request(random_prompt(n, seed=n), SamplingParams(
        max_tokens=m, ignore_eos=True)) for n, m in zip(sc["lengths"], sc["max_tokens"],
                                                        strict=True)]
    seen = dict(mixed=0, kept=0, left=0, rejoined_after_preemption=0)
    last_decodes: set[Request] = set()
    ever_decoded: set[Request] = set()
    step = 0
    while pending or engine.scheduler.has_unfinished():
        if pending and step % sc["join_every"] == 0:
            engine.add_request(None, request=pending.pop(0))
        sched = engine.scheduler.schedule()
        assert not sched.out_of_blocks
        if sched.is_empty:
            step += 1
            continue
        inputs, sampled = runner.host_inputs(sched)
        flat, shapes, num_decodes, groups, segs, want_sampled = rebuilt(runner, sched)
        assert inputs.flat.tolist() == flat and [tuple(s) for s in inputs.shapes] == shapes
        assert (inputs.num_decodes, inputs.groups, inputs.segs) == (num_decodes, groups, segs)
        assert sampled == want_sampled
        decodes = {sched.chunks[i].request for i in sched.step_order()[0]}
        assert set(runner.decode_rows.row_of) == decodes     # the rows: this step's decodes
        seen["mixed"] += bool(decodes) and len(decodes) < len(sched.chunks)
        seen["kept"] += bool(decodes & last_decodes)
        seen["left"] += bool(last_decodes - decodes) and bool(decodes & last_decodes)
        seen["rejoined_after_preemption"] += sum(   # decoded, was preempted, decodes again
            r.lifecycle.preemptions > 0 and r in ever_decoded and r not in last_decodes
            for r in decodes)
        last_decodes = decodes
        ever_decoded |= decodes
        _step(engine, sched, step)
        step += 1
    assert seen["mixed"] and seen["kept"] and seen["left"], seen
    if scenario == "preempting":
        assert engine.stats.preemptions > 0 and seen["rejoined_after_preemption"], seen
    else:
        assert runner.decode_rows.tables.shape[0] > 16 and runner.decode_rows.tables.shape[1] > 8
    engine.check_invariants()


def test_a_row_takes_a_block_id_only_when_its_context_crosses_into_a_new_block(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4)
    rows = engine.runner.decode_rows
    req = engine.inputs.make_request(random_prompt(6, seed=1), SamplingParams(max_tokens=9))
    table = [7, 3, 11]
    writes = []
    real_tables = rows.tables

    class Watch:   # records every write into the rows' array
        def __setitem__(self, key, value):
            writes.append(key)
            real_tables[key] = value

        def __getitem__(self, key):
            return real_tables[key]

        @property
        def shape(self):
            return real_tables.shape

    rows.tables = Watch()
    for pos in range(5, 11):          # positions 5..10: blocks 2 (5-7) then 3 (8-10)
        req.num_computed_tokens = pos
        (row,), positions = rows.update([ScheduledChunk(req, 1, table)])
        assert positions == [pos]
        assert real_tables[row, :pos // 4 + 1].tolist() == table[:pos // 4 + 1]
        assert not real_tables[row, pos // 4 + 1:].any()
    assert len(writes) == 2            # the first two blocks at the join, the third at 8
    # preempted and back at the same position (its prefix hit in the cache) before the rows
    # saw a step without it: a new table (a new list), the row takes its ids
    new_table = [20, 21, 22]
    (row,), _ = rows.update([ScheduledChunk(req, 1, new_table)])
    assert real_tables[row, :3].tolist() == new_table and not real_tables[row, 3:].any()
    rows.update([])                    # it did not decode: it leaves, its row zeroed
    assert not rows.row_of and not real_tables.any()
