"""A quantized pool's pages (elements and scales) cross every transport in their stored form:
disaggregated int8 greedy output equals the single int8 engine's, token for token."""

from __future__ import annotations

import pytest
from conftest import make_engine, random_prompt

from cluster.pd import PDCluster, PDConfig
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
ENGINE = dict(model="tiny", num_blocks=64, block_size=16, kv_dtype="int8")
PROMPTS = [random_prompt(16, seed=21), random_prompt(45, seed=22)]

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("transport", ["object_store", "shm", "grpc", "rdt"])
def test_int8_pages_cross_every_transport(transport, tiny_loaded):
    expected = [r.output_token_ids for r in
                make_engine(tiny_loaded, num_blocks=64, kv_dtype="int8").generate(PROMPTS, GREEDY)]
    cluster = PDCluster(PDConfig(engine=ENGINE, flow=FlowConfig(transport=transport)))
    try:
        results = cluster.generate(PROMPTS, GREEDY)
        assert [r.error for r in results] == [None, None]
        assert [r.token_ids for r in results] == expected
        # the pages that crossed are the packed int8 blocks: elements + scales, ~1/4 of float32
        layers, heads, dim, bs = 2, 2, 16, 16
        per_block = 2 * layers * (bs * heads * dim + 4 * heads)
        for r in results:
            lc = r.lifecycle
            assert lc.transfer_bytes == lc.transferred_blocks * per_block
        for counts in cluster.check_invariants():
            assert counts["referenced"] == 0, counts
    finally:
        cluster.shutdown()
