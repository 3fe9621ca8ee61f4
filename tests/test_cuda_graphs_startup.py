"""CUDA graphs of decode steps are captured when the runner starts, for the configured buckets,
and never while serving: a shape without a graph runs eagerly. Checked on the CPU with a
stand-in for the capture (the step a graph would replay, run eagerly into the graph's static
logits), so the bucket list, the capture order and the replay bookkeeping are tested without a
GPU; tests/test_gpu.py runs the real graphs."""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import hf_greedy, random_prompt

from workers import cuda_graphs
from workers.cuda_graphs import DecodeGraphs, StaticDecode, batch_buckets, width_buckets
from workers.request import SamplingParams


def make_engine(loaded, **overrides):
    """The engine on the CPU, on any machine (a GPU machine's default device is cuda, where
    the stand-in below does not apply)."""
    return conftest.make_engine(loaded, device="cpu", **overrides)


class _Replay:
    """A CUDA graph's stand-in: replay() runs the captured step again into the same logits."""

    def __init__(self, forward, logits: torch.Tensor) -> None:
        self.forward, self.logits = forward, logits

    def replay(self) -> None:
        self.logits.copy_(self.forward())


class RecordingGraphs(DecodeGraphs):
    """DecodeGraphs on the CPU: records every capture instead of making a CUDA graph."""

    recorded: list[tuple[int, int]]

    @staticmethod
    def _check_device(runner) -> None:
        pass

    def _capture(self, b: int, w: int):
        self.__dict__.setdefault("recorded", []).append((b, w))
        return super()._capture(b, w)

    def _record(self, forward):
        logits = forward()
        return _Replay(forward, logits), logits


def test_width_buckets_are_the_powers_of_two_below_the_context_and_the_context():
    assert width_buckets(1) == (1,)
    assert width_buckets(8) == (1, 2, 4, 8)
    assert width_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert all(cuda_graphs.width_bucket(w, 100) in width_buckets(100) for w in range(1, 101))


def test_startup_shapes_are_every_bucket_narrowest_widths_first_up_to_the_cap(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_seqs=80)
    runner = engine.runner
    static = StaticDecode(runner, 80, 255, 2048)            # 128 blocks of 16 tokens
    buckets = batch_buckets(80)                             # 9 buckets x 8 widths > 64
    assert static.widths == (1, 2, 4, 8, 16, 32, 64, 128) and not static.in_place
    shapes = static.startup_shapes()
    assert len(shapes) == cuda_graphs.MAX_GRAPHS == 64 and len(set(shapes)) == 64
    assert shapes[:len(buckets)] == [(b, 1) for b in buckets]
    assert shapes[-1] == (buckets[0], 128)                  # the widest width: some buckets
    assert [w for _, w in shapes] == sorted(w for _, w in shapes)   # narrowest first
    # an in-place decode kernel reads each row's own blocks: one graph per batch bucket
    runner.attention_kernel = "triton-cuda"
    in_place = StaticDecode(runner, 80, 255, 2048)
    assert in_place.in_place and in_place.startup_shapes() == [(b, 128) for b in buckets]


def test_graphs_are_captured_at_start_up_and_replayed_never_captured_while_serving(
        tiny_loaded, tiny_reference, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 8)   # widths 1 and 2 (32 tokens) of 4 buckets
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_seqs=8)
    graphs = RecordingGraphs(engine.runner, 8, 255, engine.max_model_len)
    assert graphs.recorded == graphs.startup_shapes() == [
        (b, w) for w in (1, 2) for b in (1, 2, 4, 8)]
    assert engine.runner.kv_cache[:, :, 255].abs().sum() > 0   # captures wrote scratch only
    engine.runner.graphs = graphs
    prompts = [random_prompt(n, seed=300 + n) for n in (3, 9, 14)]     # 3 rows -> bucket 4
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert graphs.recorded == graphs.startup_shapes()   # nothing captured while serving
    assert graphs.replays >= 8                           # contexts up to 32 tokens: replayed
    replays = graphs.replays
    long = engine.generate([random_prompt(40, seed=340)],   # width 3..4: no graph, eager
                           SamplingParams(max_tokens=4, ignore_eos=True))
    assert graphs.replays == replays and graphs.recorded == graphs.startup_shapes()
    for r, p in zip([*reqs, *long], [*prompts, random_prompt(40, seed=340)], strict=True):
        assert r.output_token_ids == hf_greedy(tiny_reference, p, len(r.output_token_ids))


def test_the_graphs_step_table_holds_each_group_at_its_own_width(tiny_loaded):
    """Padding rows point at the scratch block; each decode group's rows carry its own blocks
    and only those (the rest of the row is scratch), whatever the graph's width."""
    from workers.scheduler_output import ScheduledChunk, SchedulerOutput
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_seqs=8)
    runner = engine.runner
    runner.one_decode_group = False                   # the gather path's length groups
    static = StaticDecode(runner, 8, 255, engine.max_model_len)
    a = engine.add_request(random_prompt(3, seed=1), SamplingParams(max_tokens=2))
    b = engine.add_request(random_prompt(70, seed=2), SamplingParams(max_tokens=2))
    engine.step()
    chunks = [ScheduledChunk(r, 1, engine.kv.block_table(r.request_id)) for r in (a, b)]
    ids, pos, meta, _, _ = runner.prepare(SchedulerOutput(chunks))
    assert [g.block_tables.shape[1] for g in meta.decode_groups] == [1, 5]
    b_, w = static._shape(meta)
    assert (b_, w) == (2, 8)
    tables = static._fill(b_, w, ids, pos, meta)
    assert tables[0, 0] == engine.kv.block_table(a.request_id)[0]
    assert (tables[0, 1:] == 255).all()
    assert tables[1, :5].tolist() == engine.kv.block_table(b.request_id)[:5]
    assert (tables[1, 5:] == 255).all()


@pytest.mark.parametrize("kernel, width", [("torch", 8), ("triton-cuda", 128)])
def test_a_steps_graph_width_follows_the_decode_kernel(tiny_loaded, kernel, width):
    from workers.scheduler_output import ScheduledChunk, SchedulerOutput
    engine = make_engine(tiny_loaded, num_blocks=256, max_num_seqs=8)
    engine.runner.attention_kernel = kernel
    static = StaticDecode(engine.runner, 8, 255, 2048)
    r = engine.add_request(random_prompt(70, seed=3), SamplingParams(max_tokens=2))
    engine.step()
    meta = engine.runner.prepare(SchedulerOutput([ScheduledChunk(
        r, 1, engine.kv.block_table(r.request_id))]))[2]
    assert static._shape(meta) == (1, width)
