"""The live autoscaler (cluster/autoscale_loop.py): the controller's decisions applied to a running
cluster; a scale-down drains a worker whose running decodes move away with their KV."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from conftest import hf_greedy, random_prompt, start_streaming

from cluster.autoscale_loop import LiveAutoscaler
from cluster.pd import PDCluster, PDConfig
from raypd.cli.ops import format_status
from router.autoscale_decision import AutoscaleConfig
from router.orchestrator import FlowConfig
from router.policies import WorkerState
from workers.request import SamplingParams

ENGINE = dict(model="tiny", num_blocks=128, block_size=16)
FAST = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=1, min_decode=1, max_decode=2,
                       interval_s=0.2, cooldown_s=0.0, up_cooldown_s=0.0, window_s=5.0)


class _Fleet:
    """A fleet as the autoscaler reads it: states, live workers, draining ones, a lock."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.lock = threading.Lock()
        self.draining: set[str] = set()
        self._states = {"prefill": [WorkerState(f"prefill-{i}") for i in range(prefill)],
                        "decode": [WorkerState(f"decode-{i}") for i in range(decode)]}

    def states(self, role: str) -> list[WorkerState]:
        return self._states[role]

    def workers(self, role: str) -> list[str]:
        return [s.worker_id for s in self._states[role]]

    def live(self, role: str) -> list[str]:
        return [w for w in self.workers(role) if w not in self.draining]

    def worker_id(self, w: str) -> str:
        return w


class _Cluster:
    """scale() blocks until released, recording what the autoscaler saw meanwhile."""

    def __init__(self, fleet: _Fleet) -> None:
        self.orchestrator = type("O", (), {"fleet": fleet,
                                           "rebalance_decodes": lambda self: 0})()
        self.calls: list[tuple[int, int]] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def scale(self, prefill: int, decode: int) -> dict:
        self.calls.append((prefill, decode))
        self.entered.set()
        assert self.release.wait(30)
        return {}


def test_a_decision_is_applied_once_and_its_new_workers_count_as_starting():
    """Below min_decode: the controller asks for 2 decode workers; scale() runs on the
    applier thread, and while it launches, the next evaluation sees the worker as starting
    (so it does not ask for it again)."""
    cluster = _Cluster(_Fleet(prefill=1, decode=1))
    auto = LiveAutoscaler(cluster, replace(FAST, min_decode=2), clock=lambda: 0.0)
    auto.start()
    try:
        first = auto.evaluate(now=0.0)
        assert first.changed and first.decode == 2
        assert cluster.entered.wait(10)
        second = auto.evaluate(now=1.0)
        assert second.observation.decode_starting == 1 and not second.changed
        assert cluster.calls == [(1, 2)]
    finally:
        cluster.release.set()
        auto.stop(wait_s=5)
    assert auto.starting == {"prefill": 0, "decode": 0}
    d = json.loads(json.dumps(auto.to_dict()))          # what /api/stats carries
    assert d["scale_ups"]["decode"] == 1 and d["last"]["roles"]["decode"]["target"] == 2
    text = format_status({"actors": [], "router": {"autoscale": d,
                                                   "migrations": {"moved": 3}}})
    assert "autoscale: on (prefill 1..1, decode 2..2" in text
    assert "last decision, decode: 2 -> 2" in text and "live migrations: moved 3" in text
    assert "autoscale: off" in format_status({"actors": [], "router": {}})


@pytest.mark.usefixtures("ray_session")
def test_autoscaled_scale_down_migrates_running_decodes_and_loses_nothing(tiny_reference):
    """Above max_decode under load: the autoscaler drains a decode worker; its running
    requests move to the other with their KV, all finish with generate()'s tokens, the pool
    ends at the max, and the router's view carries the decision. (64 blocks: the remaining
    worker holds two requests to the end, not all four: with both moved it preempts.)"""
    cluster = PDCluster(PDConfig(engine=dict(ENGINE, num_blocks=64), num_prefill=1,
                                 num_decode=2, flow=FlowConfig(report_interval_s=0.05)))
    auto = None
    try:
        # decoding at the drain (the first move comes ~0.1 s after the autoscaler starts)
        sampling = SamplingParams(max_tokens=250, ignore_eos=True)
        prompts = [random_prompt(24 + 5 * i, seed=300 + i) for i in range(4)]
        want = [hf_greedy(tiny_reference, p, sampling.max_tokens) for p in prompts]
        threads, results = start_streaming(cluster, prompts, sampling)   # both decode busy
        on_d1 = [f for f in cluster.orchestrator.in_flight_flights()
                 if cluster.orchestrator.fleet.worker_id(f.decode) == "decode-1"]
        assert on_d1, "the test needs a request decoding on the worker that drains"
        auto = LiveAutoscaler(cluster, replace(FAST, max_decode=1))
        cluster.autoscaler = auto
        auto.start()
        for t in threads:
            t.join(120)
        assert [r.token_ids for r in results] == want
        assert sum(r.lifecycle.migrations for r in results) >= 1
        for t in list(cluster._reapers):
            t.join(60)
        assert [cluster.orchestrator.fleet.worker_id(w) for w in cluster.decode] == ["decode-0"]
        view = cluster.router_view()
        assert view.migrations["moved"] >= 1
        assert view.autoscale["scale_downs"]["decode"] == 1
        assert cluster.orchestrator.ledger.open_holds() == []
        assert cluster.leaked_blocks() == 0
    finally:
        cluster.shutdown()


def test_serve_autoscale_flag_turns_the_autoscaler_on():
    """`raypd serve --autoscale` = router.autoscale.enabled: the cluster gets the config's
    AutoscaleConfig; without it, none."""
    import argparse

    from cluster.config import load_config
    from raypd.cli.serve import add_serve_parser, overrides_from_args
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    on = parser.parse_args(["serve", "--autoscale", "--model", "tiny"])
    off = parser.parse_args(["serve", "--model", "tiny"])
    cfg_on = load_config(None, overrides_from_args(on)).to_pd_config()
    assert cfg_on.autoscale is not None and cfg_on.autoscale.enabled
    assert load_config(None, overrides_from_args(off)).to_pd_config().autoscale is None
