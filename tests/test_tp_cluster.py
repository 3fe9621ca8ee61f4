"""TP workers in a live cluster: each a gang of Ray actors in one STRICT_PACK placement group;
P at TP 4 (KV heads replicated) and D at TP 2 serve colocated's greedy tokens over the
configured transport; a D rank killed mid-decode takes its worker down, the requests are
retried elsewhere with the same tokens, and no block leaks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.pd import PDCluster, PDConfig
from router.orchestrator import FlowConfig
from workers.engine import LLMEngine
from workers.engine_config import EngineConfig
from workers.request import SamplingParams

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.integration]

ENGINE = dict(model="random:llama-test", dtype="float32", num_blocks=64, block_size=16)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 20, 45)]


@pytest.fixture(scope="module")
def colocated():
    e = LLMEngine(EngineConfig(**ENGINE))
    out = [r.output_token_ids for r in e.generate(PROMPTS, GREEDY)]
    e.close()
    return out


def test_tp_gangs_serve_colocated_tokens_and_survive_a_killed_rank(colocated):
    cluster = PDCluster(PDConfig(engine=ENGINE, num_prefill=1, num_decode=2, prefill_tp=4,
                                 decode_tp=2, flow=FlowConfig(transport="shm")))
    try:
        import ray
        pids = ray.get([w.tp_rank_pids.remote() for w in cluster.workers])
        assert sorted(len(p) for p in pids) == [1, 1, 3]   # P: ranks 1-3; each D: rank 1
        from ray.util.placement_group import placement_group_table
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert sorted(len(g["bundles"]) for g in groups)[-3:] == [2, 2, 4]
        assert all(g["strategy"] == "STRICT_PACK" for g in groups)
        results = cluster.generate(PROMPTS, GREEDY)
        assert [r.error for r in results] == [None] * len(PROMPTS)
        assert [r.token_ids for r in results] == colocated
        assert any(r.lifecycle.transferred_blocks for r in results)
        # a decode rank killed while requests decode: they complete elsewhere, same tokens
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        ref_long = [r.output_token_ids for r in
                    LLMEngine(EngineConfig(**ENGINE)).generate(PROMPTS, long)]
        import threading
        out: list = []
        t = threading.Thread(target=lambda: out.extend(cluster.generate(PROMPTS, long)))
        t.start()
        busy, deadline = [], time.monotonic() + 60
        while not busy and time.monotonic() < deadline:   # requests decoding on a D
            time.sleep(0.2)
            busy = [w for w in cluster.decode if ray.get(w.load_report.remote()).num_requests]
        victim = ray.get(busy[0].tp_rank_pids.remote())[0]
        os.kill(victim, signal.SIGKILL)                  # a busy decode worker's rank 1
        t.join(180)
        assert not t.is_alive()
        assert [r.error for r in out] == [None] * len(PROMPTS)
        assert [r.token_ids for r in out] == ref_long
        deadline = time.monotonic() + 180   # the worker restarts (a new gang) first
        while (leaks := cluster.leak_count()).unknown and time.monotonic() < deadline:
            time.sleep(2)
        assert leaks.leaked == 0 and not leaks.unknown, leaks
        assert sorted(len(p) for p in ray.get([w.tp_rank_pids.remote()
                                               for w in cluster.workers])) == [1, 1, 3]
    finally:
        cluster.shutdown()
