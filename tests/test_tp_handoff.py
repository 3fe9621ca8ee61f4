"""The KV handoff between workers of different TP sizes, rank to rank (workers/tp_handoff.py):
the same tokens as colocated for P above, below and equal to D's TP, KV heads replicated on P
(the case vLLM's connector refuses); bytes moved equal what D's ranks lack; a corrupt or missing
shard writes nothing on any D rank."""

from __future__ import annotations

import os

import pytest

from kvtransfer.base import TransferError
from workers.engine import LLMEngine
from workers.engine_config import EngineConfig
from workers.request import SamplingParams
from workers.tp_handoff import (
    disagg_generate,
    plan_for,
    pull_tp_shards,
    release_tp_shards,
    shard_path,
    stage_tp_shards,
)

MODEL = "random:llama-test"        # 4 query heads over 2 KV heads
PROMPT = list(range(3, 3 + 45))    # 3 blocks of 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    made = {tp: LLMEngine(EngineConfig(model=MODEL, dtype="float32", tp=tp, num_blocks=32,
                                       num_threads=1)) for tp in (1, 2, 4)}
    made["d1"] = LLMEngine(EngineConfig(model=MODEL, dtype="float32", num_blocks=32,
                                        num_threads=1))
    yield made
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def colocated(engines):
    [req] = engines["d1"].generate([PROMPT], GREEDY)
    engines["d1"].reset_prefix_cache()
    return req.output_token_ids


@pytest.mark.parametrize("t_p,t_d", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_handoff_between_tp_sizes_gives_colocated_tokens_and_moves_what_d_lacks(
        engines, colocated, t_p, t_d):
    p, d = engines[t_p], engines["d1" if t_d == 1 and t_p == 1 else t_d]
    d.reset_prefix_cache()
    out = disagg_generate(p, d, PROMPT, GREEDY, f"test{t_p}{t_d}")
    assert out.output_token_ids == colocated
    assert out.handoff.shards == len(plan_for(p, d).moves) > 0
    assert out.handoff.nbytes == out.bytes_lacked     # no shard twice
    for e in (p, d):
        assert e.kv.pool.num_used_blocks == 0
        e.check_invariants()


def test_a_second_request_moves_only_the_blocks_d_lacks(engines, colocated):
    p, d = engines[2], engines[1]
    d.reset_prefix_cache()
    disagg_generate(p, d, PROMPT, GREEDY, "first")
    again = disagg_generate(p, d, PROMPT + [7] * 20, GREEDY, "again")   # D holds 2 blocks
    assert again.blocks_moved == 3 and again.handoff.nbytes == again.bytes_lacked


@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_a_bad_shard_writes_nothing_on_any_d_rank(engines, fault):
    p, d = engines[4], engines[2]
    plan = plan_for(p, d)
    p.generate([PROMPT], SamplingParams(max_tokens=1))
    src = [0, 1, 2]
    staged = stage_tp_shards(p, plan, src, f"bad-{fault}")
    before = d.runner.read_pages([20, 21, 22])
    victim = shard_path(staged.transfer_id, plan.moves[-1])
    try:
        if fault == "corrupt":
            with open(victim, "r+b") as f:
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.unlink(victim)
        with pytest.raises(TransferError, match="nothing written"):
            pull_tp_shards(d, staged, [20, 21, 22])
        assert d.runner.read_pages([20, 21, 22]).equal(before)
    finally:
        release_tp_shards(staged)
    assert not any(os.path.exists(shard_path(staged.transfer_id, m)) for m in plan.moves)
