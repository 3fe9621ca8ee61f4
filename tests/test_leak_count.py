"""The leak count fails closed: a worker whose pool invariant check raises (a lost block) or
that does not answer is `unknown` with its error, never 0, and the chaos and autoscale verdicts
that read the count fail on it."""

from __future__ import annotations

import threading

import pytest
import ray
from conftest import wait_until

from cluster.pd import PDCluster, PDConfig
from raypd.bench import autoscale, chaos
from workers.request import SamplingParams

pytestmark = pytest.mark.usefixtures("ray_session")
ENGINE = dict(model="tiny", num_blocks=64, block_size=16)


def test_a_worker_that_cannot_be_counted_is_unknown_and_fails_chaos_and_autoscale():
    """A live decode worker that does not answer (a stalled step holds its lock), then one
    whose pool lost a block (refcount 0, no hash): both read unknown, never 0 leaked."""
    cluster = PDCluster(PDConfig(engine=ENGINE, fault_injection=True))
    try:
        prompt, sp = [5, 6, 7, 8] * 10, SamplingParams(max_tokens=4, ignore_eos=True)
        cluster.generate([prompt], sp)
        cluster.expire_leases()
        clean = cluster.leak_count()
        assert clean.blocks == 0 and clean.unknown == {} and cluster.leaked_blocks() == 0

        decode = cluster.decode[0]
        ray.get(decode.stall_next_step.remote(4.0))     # its next step hangs, holding its lock
        t = threading.Thread(target=cluster.generate, args=([prompt], sp), daemon=True)
        t.start()
        wait_until(lambda: ray.get(decode.load_report.remote()).busy_for_s > 0.2, 30)
        silent = cluster.leak_count(timeout_s=1.0)
        assert "TimeoutError" in silent.unknown["decode-0"] and silent.leaked is None
        t.join(60)

        lost = ray.get(decode.lose_block.remote())
        count = cluster.leak_count()
        assert list(count.unknown) == ["decode-0"]
        assert f"block {lost} lost" in count.unknown["decode-0"]
        assert count.leaked is None and cluster.leaked_blocks() is None
        failures = chaos.verdict((), 1, 1, 0, count.leaked, 0, 0, 0, [], None)
        assert any("leaked blocks: unknown" in f for f in failures), failures
        run = {"requests_lost": 0, "leaked_blocks": count.leaked, "greedy_mismatches": 0,
               "scale_downs": 1, "moved_by_cause": {"drain": 1}}
        clean_static = {**run, "leaked_blocks": 0, "scale_downs": 0, "moved_by_cause": {}}
        targets = autoscale.verdict([run], [clean_static])
        assert [k for k, ok in targets.items() if not ok] == ["no_leaked"]
    finally:
        cluster.shutdown()
