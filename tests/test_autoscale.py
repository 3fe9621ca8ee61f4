"""The autoscaler (router/autoscale_decision.py): its inputs are a function of the load reports and the
router's request window only; its decisions respect min/max, cooldowns and one-at-a-time
scale-down, hold without fits, follow the load; and the simulator's autoscaled run
(raypd/sim/autoscale_sim.py, `raypd simulate --autoscale`) uses fewer worker-seconds than the
smallest static fleet that serves a quiet-burst-quiet trace as well (every split of every size
up to its peak tried). No Ray, no sleeps: time is an argument."""

from __future__ import annotations

import json

import pytest

from protocol.step_rates import DecodeFit, PrefillFit
from raypd.sim.cluster_sim import ClusterConfig, DecodeSim, _Seq
from raypd.sim.cost_model import gpu_cost_model
from raypd.sim.routing_sim import SimRequest
from router.autoscale_decision import (
    AutoscaleConfig,
    AutoscaleConfigError,
    Controller,
    RequestWindow,
    observe,
)
from router.policies import WorkerState
from router.worker_view import apply_load_report

PFIT = PrefillFit(tok_s=10_000.0, ctx_tokens=0.0, overhead_s=0.0, num_steps=8)  # 1k tokens: 0.1 s
DFIT = DecodeFit(base_s=0.01, per_seq_s=0.0001, per_ctx_token_s=0.0, num_steps=8)
CFG = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=6, min_decode=1, max_decode=6,
                      ttft_s=2.0, tpot_s=0.1, interval_s=5.0, cooldown_s=30.0,
                      up_cooldown_s=10.0, window_s=60.0)


def states(role: str, n: int, fit: bool = True, **fields) -> list[WorkerState]:
    out = []
    for i in range(n):
        s = WorkerState(f"{role}-{i}", total_blocks=1000, free_blocks=1000, **fields)
        if fit:
            if role == "prefill":
                s.prefill_fit, s.queued_s = PFIT, 0.0
            else:
                s.decode_fit = DFIT
        out.append(s)
    return out


def window(rate: float, now: float = 60.0, prompt: int = 1000, output: int = 50,
           ttft: float = 0.2, tpot: float = 0.02) -> RequestWindow:
    """Arrivals at `rate`/s over the last minute, each finished within the SLOs."""
    w = RequestWindow.for_config(CFG)
    n = int(rate * 60)
    for k in range(n):
        t = now - 60 + 60 * (k + 1) / (n + 1)
        w.arrive(t, prompt, 256)
        w.record(t, prompt, 0, output, ttft, tpot, True)
    return w


def decide(ctrl: Controller, p: int, d: int, rate: float, now: float, fit: bool = True):
    obs = observe(states("prefill", p, fit), states("decode", d, fit), window(rate, now), now)
    return ctrl.decide(obs, now)


# ---- the inputs are the reports ---------------------------------------------------------------
def _decode_worker(true_outputs: list[int]) -> DecodeSim:
    """A decode worker running sequences whose true output lengths (the router never sees
    them: clients send max_tokens) are `true_outputs`; same contexts and reservations."""
    d = DecodeSim("decode-0", gpu_cost_model("h100"), 400, 64)
    for i, left in enumerate(true_outputs):
        d.join(0.0, _Seq(i, left, 2048 + 100 * i, 0.0, d.pool.allocate(8)))
    d.advance(0.0)
    return d


def test_observations_and_decisions_are_a_function_of_the_reports_only():
    """Two decode workers whose hidden truths differ (how long each sequence will still run)
    but whose reports are equal give equal Observations and equal decisions; a report that
    differs (more KV held) changes the Observation: the test is not vacuous."""
    a, b = _decode_worker([10, 500, 40]), _decode_worker([900, 3, 70])
    assert [s.left for s in a.running] != [s.left for s in b.running]
    ra, rb = a.report(), b.report()
    assert ra == rb
    views = []
    for rep in (ra, rb):
        st = WorkerState("decode-0")
        apply_load_report(st, rep, 30.0)
        views.append(st)
    w = window(4.0)
    obs = [observe(states("prefill", 2), [v], w, 60.0) for v in views]
    assert obs[0] == obs[1]
    dec = [Controller(CFG).decide(o, 60.0) for o in obs]
    assert (dec[0].prefill, dec[0].decode, dec[0].roles) == (dec[1].prefill, dec[1].decode,
                                                             dec[1].roles)
    c = _decode_worker([10, 500, 40, 7])
    st = WorkerState("decode-0")
    apply_load_report(st, c.report(), 30.0)
    assert observe(states("prefill", 2), [st], w, 60.0) != obs[0]


def test_observe_reads_worker_states_only():
    """WorkerState has slots: nothing but reported fields (and the router's own) can reach
    observe(); a cost model or true queue is no field of it."""
    st = WorkerState("decode-0")
    with pytest.raises(AttributeError):
        st.true_queue = [1, 2, 3]


# ---- the controller's rules ---------------------------------------------------------------------
def test_scale_up_when_arrivals_pass_capacity_and_down_when_they_fall():
    ctrl = Controller(CFG)
    low = decide(ctrl, 2, 2, rate=5.0, now=100.0)          # 0.5 prefill workers of load
    assert low.prefill <= 2 and low.decode <= 2                  # no scale-up
    ctrl = Controller(CFG)
    high = decide(ctrl, 2, 2, rate=30.0, now=100.0)        # 3 workers of prefill load
    assert high.prefill == 5 and high.changed            # ceil(3 / 0.7)
    assert high.roles[0].inputs["flow_load"] == pytest.approx(3.0, rel=0.01)
    later = decide(ctrl, 5, 2, rate=2.0, now=200.0)        # load fell: one down
    assert later.prefill == 4 and "load" in later.prefill_reason


def test_min_and_max_are_respected():
    ctrl = Controller(CFG)
    d = decide(ctrl, 2, 2, rate=500.0, now=100.0)          # 50 workers of load: max 6
    assert d.prefill == CFG.max_prefill
    d = decide(Controller(CFG), 0, 0, rate=0.0, now=100.0, fit=False)   # below min: raised
    assert (d.prefill, d.decode) == (CFG.min_prefill, CFG.min_decode)
    d = decide(Controller(CFG), 1, 1, rate=0.0, now=100.0)               # idle at the min
    assert (d.prefill, d.decode) == (1, 1) and not d.changed
    capped = Controller(AutoscaleConfig(**{**CFG.__dict__, "max_total": 5}))
    d = decide(capped, 2, 2, rate=500.0, now=100.0)
    assert d.prefill + d.decode <= 5


def test_cooldown_holds_a_second_change():
    ctrl = Controller(CFG)
    assert decide(ctrl, 2, 2, rate=30.0, now=100.0).prefill == 5
    held = decide(ctrl, 2, 2, rate=60.0, now=105.0)        # within up_cooldown_s (10 s)
    assert held.prefill == 2 and "cooldown" in held.prefill_reason and not held.roles[0].changed
    assert decide(ctrl, 2, 2, rate=60.0, now=111.0).prefill == 6
    down = decide(ctrl, 6, 2, rate=1.0, now=120.0)         # within cooldown_s (30 s)
    assert down.prefill == 6 and "cooldown" in down.prefill_reason
    assert decide(ctrl, 6, 2, rate=1.0, now=142.0).prefill == 5


def test_scale_down_is_one_worker_at_a_time():
    ctrl = Controller(AutoscaleConfig(**{**CFG.__dict__, "cooldown_s": 0.0}))
    sizes = [6]
    for k in range(4):
        sizes.append(decide(ctrl, sizes[-1], 6, rate=0.0, now=100.0 + 5 * k).prefill)
    assert sizes == [6, 5, 4, 3, 2]


def test_missing_fits_hold_the_size_and_say_why():
    d = decide(Controller(CFG), 3, 3, rate=100.0, now=100.0, fit=False)
    assert (d.prefill, d.decode) == (3, 3) and not d.changed
    assert "no prefill fit" in d.prefill_reason and "no decode fit" in d.decode_reason


def test_decisions_are_kept_and_exported():
    ctrl = Controller(CFG)
    decide(ctrl, 2, 2, rate=30.0, now=100.0)
    out = json.loads(json.dumps(ctrl.to_dict(), default=str))
    assert out["scale_ups"]["prefill"] == 1 and out["last"]["prefill"] == 5
    assert out["last"]["roles"]["prefill"]["inputs"]["arrival_rate"] == pytest.approx(30.0,
                                                                                    rel=0.05)
    assert ctrl.due(104.0) is False and ctrl.due(105.0) is True


def test_request_window_attainment_counts_failures_as_misses():
    w = RequestWindow(window_s=60, ttft_s=1.0, tpot_s=0.1, percentile=90, recent_s=10)
    w.record(1.0, 1000, 400, 10, 0.5, 0.05, True)      # met
    w.record(2.0, 1000, 0, 10, 1.5, 0.05, True)        # TTFT missed
    w.record(3.0, 1000, 0, 0, None, None, False)       # failed
    f = w.figures(10.0)
    assert f.finished == 3 and f.failed == 1
    assert f.slo_attainment == pytest.approx(1 / 3) and f.tpot_attainment == pytest.approx(2 / 3)
    assert f.recent_tpot_attainment == 1.0             # a failed request decoded nothing
    assert w.figures(100.0).finished == 0               # out of the window


def test_config_errors_name_the_field():
    with pytest.raises(AutoscaleConfigError) as e:
        AutoscaleConfig(min_decode=3, max_decode=2).validate()
    assert e.value.field == "max_decode"


def test_config_section_is_validated_naming_the_key(tmp_path):
    from cluster.config import ConfigError, load_config
    p = tmp_path / "x.yaml"
    p.write_text("router: {autoscale: {enabled: true, max_prefill: 2, min_prefill: 3}}")
    with pytest.raises(ConfigError, match="router.autoscale.max_prefill: must be >= min_prefill"):
        load_config(p)
    p.write_text("router: {migrate_on_kv_pressure: true, autoscale: {enabled: true, "
                 "interval_s: 2}}")
    cfg = load_config(p)
    assert cfg.autoscale_config().interval_s == 2.0 and cfg.autoscale_config().enabled
    assert cfg.flow_config().migrate_on_kv_pressure is True


# ---- the simulator's autoscaled run -------------------------------------------------------------
def phased(phases: tuple[tuple[float, float], ...]) -> list[SimRequest]:
    """(seconds, requests/s) phases in turn; 4k-token prompts of distinct blocks, 64 out."""
    out, t, j = [], 0.0, 0
    for dur, rate in phases:
        end = t + dur
        while t < end:
            out.append(SimRequest(t, 8 * 512 - 5, 64, tuple(10_000 * j + i for i in range(8))))
            t += 1.0 / rate
            j += 1
    return out


def quiet_burst_quiet() -> list[SimRequest]:
    """60 s at 1 request/s, 60 s at 12/s, 90 s at 1/s; 4k-token prompts, 64 tokens out."""
    return phased(((60.0, 1.0), (60.0, 12.0), (90.0, 1.0)))


def burst_of_eight() -> list[SimRequest]:
    """120 s at 1 request/s, 120 s at 30/s, 180 s at 1/s (4k-token prompts, 64 out): the burst
    needs ~6 workers where the quiet phases need 2, and lasts 12 start-ups (10 s)."""
    return phased(((120.0, 1.0), (120.0, 30.0), (180.0, 1.0)))


@pytest.fixture(scope="module")
def against_every_static() -> dict:
    """The autoscaled replay of burst_of_eight and every static P:D of every size from 1P:1D
    up to its peak (the simulator is deterministic: one run a side), judged by
    raypd/sim/static_rivals.py."""
    from raypd.sim.autoscale_sim import run_autoscaled, run_static
    from raypd.sim.static_rivals import fleet_splits, judge
    reqs = burst_of_eight()
    cost = gpu_cost_model("h100")
    cluster = ClusterConfig(slo_ttft_s=2.0, slo_tpot_s=0.1)
    cfg = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=7, min_decode=1,
                          max_decode=7, max_total=8, ttft_s=2.0, tpot_s=0.1)
    auto = run_autoscaled(reqs, cost, cluster, cfg, startup_s=10.0)
    statics = {(p, d): [run_static(reqs, cost, ClusterConfig(**{**cluster.__dict__,
                                                                "num_prefill": p,
                                                                "num_decode": d}))]
               for p, d in fleet_splits(range(2, auto["peak_workers"] + 1))}
    return {"auto": auto, "reqs": reqs, "judged": judge([auto], statics)}


def test_autoscaled_run_uses_fewer_worker_seconds_than_the_smallest_static_meeting_its_slo(
        against_every_static):
    """The rival is the smallest static whose attainment is within 5 points of the autoscaled
    run's, found among every split of every size up to the autoscaled peak: smaller than the
    peak (a peak-size static spends peak x span, so beating it alone proves nothing), and the
    autoscaled run spends fewer worker-seconds than it, while serving >= 85% within its SLOs
    (the start-up lag of the burst's first seconds is what it misses)."""
    auto, j = against_every_static["auto"], against_every_static["judged"]
    assert j["static_sizes_tried"] == list(range(2, auto["peak_workers"] + 1))
    assert j["statics_tried"] == sum(n - 1 for n in j["static_sizes_tried"])
    rival = j["smallest_static_row"]
    assert rival is not None and rival["size"] < auto["peak_workers"]
    assert j["targets"]["fewer_worker_seconds_than_smallest_static_meeting_slo"]
    assert auto["worker_seconds"] < rival["worker_seconds"]["median"]
    assert auto["slo_attainment"] >= 0.85
    assert rival["slo_attainment"]["median"] >= auto["slo_attainment"] - 0.05
    every_smaller = [r for r in j["static_rows"] if r["size"] < rival["size"]]
    assert every_smaller and all(r["slo_attainment"]["median"] < auto["slo_attainment"] - 0.05
                                 for r in every_smaller)
    assert auto["scale_ups"] >= 1 and auto["scale_downs"] >= 1 and auto["peak_workers"] <= 8
    assert auto["served"] + auto["shed_total"] == len(against_every_static["reqs"])
    sizes = [p + d for _, p, d in auto["size_timeline"]]
    assert max(sizes) > sizes[0] and sizes[-1] < max(sizes)     # grew for the burst, shrank


@pytest.mark.xfail(strict=True, reason="measured: the autoscaled run serves ~89% against 100% "
                   "for the best static (the burst's first ~10-20 s wait for start-ups); the "
                   "issue-60 target, reported as missed, not loosened")
def test_autoscaled_attainment_is_within_5_points_of_the_best_static(against_every_static):
    j = against_every_static["judged"]
    assert j["targets"]["slo_within_5_points_of_best_static"]
    assert j["slo_attainment_autoscaled"] >= j["slo_attainment_best_static"] - 0.05


def _cli(argv: list[str]) -> int:
    import argparse

    from raypd.cli.simulate import add_simulate_parser
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_simulate_autoscale_refuses_what_it_does_not_use(capsys, tmp_path):
    assert _cli(["t.jsonl", "--autoscale", "--prefill", "2", "--plan"]) == 2
    assert "--prefill, --plan: not used by --autoscale" in capsys.readouterr().err
    assert _cli(["t.jsonl", "--startup-s", "5"]) == 2
    assert "--startup-s: only with --autoscale" in capsys.readouterr().err
    assert _cli(["t.jsonl", "--repeats", "3"]) == 2
    assert "--repeats: only with --autoscale" in capsys.readouterr().err


def test_simulate_autoscale_prints_the_table_and_writes_json(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(r.timestamp_s * 1000),
                                         "input_length": r.num_tokens,
                                         "output_length": r.output_tokens,
                                         "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in quiet_burst_quiet()[:300]))
    out = tmp_path / "a.json"
    assert _cli([str(trace), "--autoscale", "--gpus", "4", "--startup-s", "10",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "autoscaled" in text and "best static" in text and "smallest static" in text
    res = json.loads(out.read_text())["sizes"][0]
    assert res["gpus"] == 4 and res["repeats"] == 2 and len(res["autoscaled_runs"]) == 2
    assert res["best_static"].removeprefix("static ") in res["static"]
    assert res["static_sizes_tried"] == list(range(2, res["peak_workers"] + 1))
    assert all(len(runs) == 2 for runs in res["static"].values())
    assert "worker_seconds_smallest_static_meeting_slo" in res
    assert set(res["targets"]) == {"fewer_worker_seconds_than_smallest_static_meeting_slo",
                                   "slo_within_5_points_of_best_static"}
    assert {"worker_seconds", "slo_attainment", "goodput_rps"} <= set(res["autoscaled_runs"][0])


def test_a_drained_decode_worker_migrates_its_running_sequences_and_nothing_is_lost():
    """Long outputs: a decode worker drained after the burst still runs sequences; they move
    to another decode worker (KV over its link) and finish there; every request ends."""
    from raypd.sim.autoscale_sim import run_autoscaled
    reqs = [r._replace(output_tokens=2000) for r in quiet_burst_quiet()]
    cfg = AutoscaleConfig(enabled=True, min_prefill=1, max_prefill=7, min_decode=1,
                          max_decode=7, max_total=8, ttft_s=2.0, tpot_s=0.1)
    auto = run_autoscaled(reqs, gpu_cost_model("h100"),
                          ClusterConfig(slo_ttft_s=2.0, slo_tpot_s=0.1, max_tokens=2048), cfg,
                          startup_s=10.0)
    assert auto["migrations"] >= 1 and auto["migrated_gb"] > 0
    assert auto["scale_downs_by_role"]["decode"] >= 1
    assert auto["served"] + auto["shed_total"] == len(reqs)


def test_one_low_reading_inside_a_burst_does_not_shrink_the_pool():
    """Plans at 110 and 120 still want the burst's size; the one at 131 reads low (past the
    cooldown since the change at 100): held, since a plan of the last cooldown_s wanted more.
    Once every plan of the window is low, the pool shrinks by one."""
    ctrl = Controller(CFG)
    assert decide(ctrl, 2, 2, rate=30.0, now=100.0).prefill == 5
    for now in (110.0, 120.0):
        assert not decide(ctrl, 5, 2, rate=30.0, now=now).roles[0].changed
    held = decide(ctrl, 5, 2, rate=1.0, now=131.0)
    assert held.prefill == 5 and "asked for 5" in held.prefill_reason
    assert decide(ctrl, 5, 2, rate=1.0, now=141.0).prefill == 5   # 120's plan: in the window
    assert decide(ctrl, 5, 2, rate=1.0, now=151.0).prefill == 4   # every plan since 121: low
