"""scripts/bench_vs_vllm*.py: the JSON scripts/bench-vs-vllm.sh writes, from planted run files
(no server): prefix-cache fractions, vLLM's drift between its two blocks, runs that fail closed
(a missing `failed` key, completed != num_prompts, short outputs), the sweep's choice, and
CPU-seconds per output token from fake /proc readings."""

import importlib
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
bvv = importlib.import_module("bench_vs_vllm")
runs_mod = importlib.import_module("bench_vs_vllm_runs")
cpu_mod = importlib.import_module("bench_vs_vllm_cpu")

VLLM_BEFORE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 0.0
vllm:prompt_tokens_created 1.7e9
"""
VLLM_AFTER = """vllm:prompt_tokens_total{engine="0",model_name="m"} 33768.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 16384.0
"""
RAYPD_BEFORE = "raypd_prompt_tokens_total 2048.0\nraypd_cached_prompt_tokens_total 512.0\n"
RAYPD_AFTER = "raypd_prompt_tokens_total 6144.0\nraypd_cached_prompt_tokens_total 1536.0\n"
RAYPD_AFTER_NO_HITS = RAYPD_BEFORE.replace("2048", "3048")
SWEEP = [512, 1024, 2048]
SERVERS = ("vllm1", "vllm2", "default", "colocated")
LINE = "random_x|vllm,default,colocated|vllm|--dataset-name random --random-output-len 64"
# figures every target of issue 29 meets against vLLM at 100 tok/s, TTFT 100 ms, p99 TPOT 50 ms
PASSING = {"vllm1": (100.0, 100.0, 50.0), "vllm2": (100.0, 100.0, 50.0),
           "default": (95.0, 120.0, 40.0), "colocated": (130.0, 90.0, 45.0)}
MISSING = object()


def write_run(work, label, name, run="0", *, tok_s=100.0, ttft=100.0, tpot=50.0, n=4,
              completed=None, failed=0, out_tokens=None, out_len=64,
              metrics=(RAYPD_BEFORE, RAYPD_AFTER_NO_HITS)):
    d = {"num_prompts": n, "completed": n if completed is None else completed, "failed": failed,
         "total_output_tokens": n * out_len if out_tokens is None else out_tokens,
         "output_throughput": tok_s, "median_ttft_ms": ttft, "p99_tpot_ms": tpot,
         "median_tpot_ms": tpot}
    if failed is MISSING:
        del d["failed"]
    stem = work / f"{label}.{name}.{run}"
    json.dump(d, open(f"{stem}.json", "w"))
    (work / f"{label}.{name}.{run}.metrics.before").write_text(metrics[0])
    (work / f"{label}.{name}.{run}.metrics.after").write_text(metrics[1])


def write_sweep(work, name="random_x", scores=None):
    for v in SWEEP:
        write_run(work, f"vllm_mbt{v}", name, "tune", tok_s=(scores or {}).get(v, 100.0))


def summarize(work, lines=(LINE,), runs=1, unseen=()):
    return bvv.summarize(str(work), str(work / "out.json"), runs,
                         [runs_mod.Workload.parse(x) for x in lines], SWEEP, unseen)


def passing_runs(work, name="random_x", **override):
    """Every server's run 0 of a workload at PASSING figures; override: label -> kwargs."""
    for label, (tok_s, ttft, tpot) in PASSING.items():
        kw = {"tok_s": tok_s, "ttft": ttft, "tpot": tpot, **override.get(label, {})}
        write_run(work, label, name, **kw)


# ---- prefix-cache fractions ------------------------------------------------------------------

def test_counter_sum_adds_every_label_set_and_ignores_other_names():
    text = ('x_total 5\nraypd_prompt_tokens_total{a="1"} 3.0\n'
            'raypd_prompt_tokens_total{a="2"} 4.0\nraypd_prompt_tokens_created 9\n')
    assert runs_mod.counter_sum(text, runs_mod.PROMPT_COUNTERS) == 7.0
    assert runs_mod.counter_sum(text, runs_mod.CACHED_COUNTERS) is None


def test_cached_fraction_of_a_run_for_both_servers():
    assert runs_mod.cached_fraction(VLLM_BEFORE, VLLM_AFTER) == 16384 / 32768
    assert runs_mod.cached_fraction(RAYPD_BEFORE, RAYPD_AFTER) == 1024 / 4096


def test_cached_fraction_is_none_without_counters_or_prompts():
    assert runs_mod.cached_fraction("", "") is None                  # llama.cpp: no /metrics
    assert runs_mod.cached_fraction(RAYPD_BEFORE, RAYPD_BEFORE) is None   # no prompt between


def test_summary_reports_each_runs_cached_fraction_and_their_median(tmp_path):
    write_sweep(tmp_path)
    for r, m in enumerate([(VLLM_BEFORE, VLLM_AFTER), ("", "")]):
        write_run(tmp_path, "vllm1", "random_x", str(r), metrics=m)
    summarize(tmp_path, ["random_x|vllm|vllm|--dataset-name random"], runs=2)
    s = json.load(open(tmp_path / "out.json"))["workloads"]["random_x"]["servers"]["vllm1"]
    assert [r["prompt_cached_fraction"] for r in s["per_run"]] == [0.5, None]
    assert s["prompt_cached_fraction"] == 0.5


def test_prefix_hits_in_a_workload_not_built_for_reuse_miss_its_targets(tmp_path):
    """Half of a random workload's prompts from cache (once: seeds shared across workloads)
    means the figures are not the workload's: every one of its targets counts as missed."""
    lines = []
    for name in ("random_x", "prefix_repetition_c8"):
        write_sweep(tmp_path, name)
        passing_runs(tmp_path, name, vllm1={"metrics": (VLLM_BEFORE, VLLM_AFTER)})
        lines.append(f"{name}|vllm,default,colocated|vllm|--random-output-len 64")
    out = summarize(tmp_path, lines)
    rnd, rep = out["targets_met"]["random_x"], out["targets_met"]["prefix_repetition_c8"]
    assert out["workloads"]["random_x"]["prompt_cached_fraction_max"] == 0.5
    assert rnd["no_accidental_prefix_hits"] is False and not any(rnd.values())
    assert "no_accidental_prefix_hits" not in rep        # built to reuse: hits are the point
    assert all(rep.values())


def test_a_run_whose_counters_were_not_read_is_not_taken_for_clean(tmp_path):
    """No fraction for a raypd run (its /metrics unreadable, or a counter renamed) is unknown,
    not zero: the guard must not pass a run it could not check."""
    write_sweep(tmp_path)
    passing_runs(tmp_path, colocated={"metrics": ("", "")})
    out = summarize(tmp_path)
    assert out["targets_met"]["random_x"]["no_accidental_prefix_hits"] is False


# ---- the A B C A order: both vLLM blocks, drift, the baseline -------------------------------

def test_clean_runs_meet_the_targets_against_the_mean_of_both_vllm_blocks(tmp_path):
    write_sweep(tmp_path)
    passing_runs(tmp_path, vllm1={"tok_s": 96.0}, vllm2={"tok_s": 104.0})
    out = summarize(tmp_path)
    e = out["workloads"]["random_x"]
    assert e["vllm_baseline"]["output_throughput"] == 100.0
    assert e["default"]["output_tok_s_ratio"] == pytest.approx(0.95)
    assert e["default"]["vllm_output_tok_s_blocks"] == [96.0, 104.0]
    assert out["drift"]["random_x"] == pytest.approx(8 / 96)
    assert [b["label"] for b in out["vllm_blocks"]] == ["vllm1", "vllm2"]
    assert out["vllm_blocks"][1]["workloads"]["random_x"]["output_throughput"] == 104.0
    assert out["vllm_blocks"][0]["max_num_batched_tokens"] == 512     # sweep tie: first best
    assert out["all_targets_met"], out["targets_met"]


@pytest.mark.parametrize("second", [111.0, 89.0])
def test_vllm_blocks_more_than_ten_percent_apart_say_so_and_miss_every_target(tmp_path, second):
    write_sweep(tmp_path)
    passing_runs(tmp_path, vllm2={"tok_s": second})
    out = summarize(tmp_path)
    e = out["workloads"]["random_x"]
    assert out["drift"]["random_x"] == pytest.approx((second - 100) / 100)
    assert out["drift_exceeded"] == ["random_x"]
    assert "drift_note" in e
    t = out["targets_met"]["random_x"]
    assert t["vllm_drift<=0.1"] is False and not any(t.values())
    assert out["all_targets_met"] is False


def test_a_missing_vllm_block_fails_closed(tmp_path):
    """Without the second block there is no drift figure: unknown, and the targets fail."""
    write_sweep(tmp_path)
    passing_runs(tmp_path)
    os.remove(tmp_path / "vllm2.random_x.0.json")
    out = summarize(tmp_path)
    assert out["drift"]["random_x"] is None and "random_x" in out["drift_exceeded"]
    assert out["workloads"]["random_x"]["default"]["output_tok_s_ratio"] is None
    assert not any(out["targets_met"]["random_x"].values())


# ---- runs that fail closed ---------------------------------------------------------------------

def test_a_missing_failed_key_is_unknown_not_zero(tmp_path):
    write_sweep(tmp_path)
    passing_runs(tmp_path, vllm2={"failed": MISSING})
    out = summarize(tmp_path)
    e = out["workloads"]["random_x"]
    assert e["servers"]["vllm2"]["failed_requests"] is None
    assert e["default"]["vllm_failed_requests"] is None        # beside each ratio: unknown
    assert "no 'failed' count" in e["servers"]["vllm2"]["per_run"][0]["problems"][0]
    t = out["targets_met"]["random_x"]
    assert t["no_failed_requests"] is False and not any(t.values())


def test_vllm_failures_stand_beside_each_ratio(tmp_path):
    write_sweep(tmp_path)
    passing_runs(tmp_path, vllm1={"failed": 1, "completed": 3})
    out = summarize(tmp_path)
    assert out["workloads"]["random_x"]["colocated"]["vllm_failed_requests"] == 1
    assert out["workloads"]["random_x"]["colocated"]["failed_requests"] == 0
    assert not any(out["targets_met"]["random_x"].values())


def test_completed_short_of_num_prompts_fails_the_run(tmp_path):
    """3 of 4 completed and none counted failed (a client that drops a request silently)."""
    write_sweep(tmp_path)
    passing_runs(tmp_path, colocated={"completed": 3, "out_tokens": 3 * 64})
    out = summarize(tmp_path)
    s = out["workloads"]["random_x"]["servers"]["colocated"]
    assert s["runs_with_problems"] == 1
    assert "completed 3 != num_prompts 4" in s["per_run"][0]["problems"]
    t = out["targets_met"]["random_x"]
    assert t["runs_complete"] is False and not any(t.values())


def test_short_outputs_fail_the_run_and_the_equal_output_check(tmp_path):
    """A server that stopped early served fewer tokens than the others: its tok/s is not the
    same work's."""
    write_sweep(tmp_path)
    passing_runs(tmp_path, default={"out_tokens": 4 * 64 - 10})
    out = summarize(tmp_path)
    e = out["workloads"]["random_x"]
    assert "output tokens 246 != 4 x 64" in e["servers"]["default"]["per_run"][0]["problems"]
    assert e["checks"]["equal_output_tokens"] is False
    assert not any(out["targets_met"]["random_x"].values())


def test_outputs_unequal_across_servers_fail_even_without_a_known_length(tmp_path):
    line = "random_x|vllm,default,colocated|vllm|--dataset-name random"   # no output length
    write_sweep(tmp_path)
    passing_runs(tmp_path, colocated={"out_tokens": 200})
    out = summarize(tmp_path, [line])
    assert out["workloads"]["random_x"]["checks"]["equal_output_tokens"] is False
    assert not any(out["targets_met"]["random_x"].values())


def test_llamacpp_may_stop_early_but_must_complete(tmp_path):
    line = "random_x|vllm,default,colocated,llamacpp|openai|--custom-output-len 64"
    write_sweep(tmp_path)
    passing_runs(tmp_path)
    write_run(tmp_path, "llamacpp", "random_x", tpot=60.0, out_tokens=200, metrics=("", ""))
    out = summarize(tmp_path, [line])
    assert out["workloads"]["random_x"]["servers"]["llamacpp"]["runs_with_problems"] == 0
    assert out["targets_met"]["random_x"]["colocated_median_tpot<llamacpp_bf16"]
    write_run(tmp_path, "llamacpp", "random_x", tpot=60.0, completed=3, metrics=("", ""))
    out = summarize(tmp_path, [line])
    assert not any(out["targets_met"]["random_x"].values())


# ---- vLLM's sweep ----------------------------------------------------------------------------

def test_sweep_picks_the_best_geometric_mean_of_its_tuning_pass(tmp_path):
    """2048 wins one workload by far but loses the other; 512 is best but a tuning run of it
    failed; the scored runs (vllm1/vllm2 files) never enter the choice."""
    lines = [LINE, LINE.replace("random_x", "random_y")]
    tune = {512: (200.0, 200.0), 1024: (110.0, 100.0), 2048: (300.0, 30.0)}
    for v, (x, y) in tune.items():
        write_run(tmp_path, f"vllm_mbt{v}", "random_x", "tune", tok_s=x, failed=int(v == 512),
                  completed=3 if v == 512 else None)
        write_run(tmp_path, f"vllm_mbt{v}", "random_y", "tune", tok_s=y)
    for name in ("random_x", "random_y"):
        passing_runs(tmp_path, name)
    table = bvv.sweep_table(str(tmp_path), SWEEP,
                            [runs_mod.Workload.parse(x) for x in lines])
    assert table["best"] == 1024 and table["served_with"] == 1024
    assert table["figures"]["512"]["complete"] is False and table["figures"]["512"]["score"] is None
    assert table["figures"]["2048"]["score"] == pytest.approx((300 * 30) ** 0.5)
    out = summarize(tmp_path, lines)
    assert out["vllm_sweep"]["best"] == 1024
    assert out["vllm_blocks"][0]["max_num_batched_tokens"] == 1024


def test_a_sweep_with_no_clean_value_serves_vllms_default_and_fails_the_targets(tmp_path):
    for v in SWEEP:
        write_run(tmp_path, f"vllm_mbt{v}", "random_x", "tune", failed=MISSING)
    passing_runs(tmp_path)
    out = summarize(tmp_path)
    assert out["vllm_sweep"]["best"] is None
    assert out["vllm_sweep"]["served_with"] == bvv.VLLM_CPU_DEFAULT_MBT
    assert not any(out["targets_met"]["random_x"].values())


def test_sweep_best_cli_prints_the_value_the_scored_runs_use(tmp_path, capsys):
    write_sweep(tmp_path, scores={1024: 150.0})
    bvv.main(["sweep-best", str(tmp_path), "--sweep", "512,1024,2048", LINE])
    assert capsys.readouterr().out.strip() == "1024"


# ---- the unseen workload ---------------------------------------------------------------------

def test_the_unseen_workload_is_reported_apart_and_not_tuned_or_targeted(tmp_path):
    lines = [LINE, LINE.replace("random_x", "random_new")]
    write_sweep(tmp_path)                 # tuning runs of random_x only
    passing_runs(tmp_path)
    passing_runs(tmp_path, "random_new", default={"tok_s": 10.0})     # raypd loses badly
    out = summarize(tmp_path, lines, unseen=("random_new",))
    assert list(out["workloads"]) == ["random_x"]
    assert out["unseen_workloads"]["random_new"]["default"]["output_tok_s_ratio"] == 0.1
    assert "random_new" not in out["targets_met"] and out["all_targets_met"]
    assert out["vllm_sweep"]["best"] is not None           # not missing its tuning runs
    assert "random_new" in out["drift"]


# ---- the CPU model ---------------------------------------------------------------------------

def test_cpu_model_names_family_and_model_numbers():
    lscpu = ("Architecture:  x86_64\nModel name:   AMD EPYC\nCPU family:   26\nModel:        2\n"
             "Stepping:     1\nFlags:        avx512f\n")
    assert bvv.cpu_model(lscpu) == "AMD EPYC (family 26, model 2, stepping 1)"
    cpuinfo = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R)\n"
    assert bvv.cpu_model(cpuinfo) == "Intel(R) Xeon(R) (family 6, model 143)"


# ---- CPU-seconds per output token from /proc -------------------------------------------------

def fake_proc(root, procs):
    """procs: pid -> (comm, ppid, session, utime, stime, start, cmdline)."""
    for pid, (comm, ppid, sid, ut, st, start, cmd) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {sid} 0 -1 4194304 0 0 0 0 "
                                f"{ut} {st} 7 7 20 0 4 0 {start} 123456 789\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")


SERVE = "/v/bin/python /v/bin/raypd serve --config x.yaml"
RAYLET = "/v/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s"
GCS = "/v/ray/core/src/ray/gcs/gcs_server --gcs_server_port=0"


def test_cpu_snapshot_takes_the_servers_session_and_descendants_only(tmp_path):
    fake_proc(tmp_path / "proc", {
        100: ("raypd", 1, 100, 10, 5, 1000, SERVE),
        101: ("gcs_server", 100, 100, 3, 1, 1001, GCS),
        102: ("raylet", 100, 100, 2, 2, 1002, RAYLET),
        103: ("ray::Decode) x", 102, 100, 50, 10, 1003, "ray::DecodeHost"),
        104: ("setsid child", 100, 104, 1, 1, 1004, "/usr/bin/python3 -m some.helper"),
        105: ("grandchild", 104, 104, 1, 0, 1005, "/bin/sleep 9"),
        200: ("bash", 1, 200, 99, 99, 500, "/bin/bash other"),
    })
    snap = cpu_mod.snapshot(100, str(tmp_path / "proc"))
    assert [p["pid"] for p in snap["procs"]] == [100, 101, 102, 103, 104, 105]
    assert snap["procs"][3]["ticks"] == 60 and snap["procs"][3]["session"] == 100


def test_cpu_seconds_per_process_over_a_run(tmp_path):
    before = {100: ("raypd", 1, 100, 100, 20, 1000, SERVE),
              101: ("gcs_server", 100, 100, 30, 10, 1001, GCS),
              102: ("raylet", 100, 100, 20, 20, 1002, RAYLET),
              103: ("ray::PrefillHost", 102, 100, 500, 100, 1003, "ray::PrefillHost"),
              104: ("ray::DecodeHost", 102, 100, 500, 100, 1004, "ray::DecodeHost"),
              105: ("ray::IDLE", 102, 100, 5, 5, 1005, "ray::IDLE")}
    after = {100: ("raypd", 1, 100, 150, 30, 1000, SERVE),                  # +60 ticks
             101: ("gcs_server", 100, 100, 31, 10, 1001, GCS),               # +1
             102: ("raylet", 100, 100, 22, 21, 1002, RAYLET),                # +3
             103: ("ray::PrefillHost", 102, 100, 900, 150, 1003,
                   "ray::PrefillHost.step()"),                               # +450, renamed
             104: ("ray::DecodeHost", 102, 100, 800, 200, 1004, "ray::DecodeHost"),   # +400
             # 105 exited during the run; 106 reused no pid but was born during it
             106: ("ray::DecodeHost", 102, 100, 40, 10, 2000, "ray::DecodeHost")}     # +50
    fake_proc(tmp_path / "b", before)
    fake_proc(tmp_path / "a", after)
    b = cpu_mod.snapshot(100, str(tmp_path / "b"))
    a = cpu_mod.snapshot(100, str(tmp_path / "a"))
    hz = a["clk_tck"]
    cpu, exited = cpu_mod.run_cpu_seconds(b, a, "raypd")
    assert cpu == pytest.approx({"serve": 60 / hz, "gcs_server": 1 / hz, "raylet": 3 / hz,
                                 "actor:PrefillHost": 450 / hz, "actor:DecodeHost": 400 / hz,
                                 "actor:DecodeHost#2": 50 / hz})
    assert exited == ["ray_idle_worker"]
    # a pid reused by another process is a new process: counted from zero
    fake_proc(tmp_path / "a", {104: ("x", 102, 100, 3, 0, 3000, "ray::DecodeHost")})
    cpu2, _ = cpu_mod.run_cpu_seconds(b, cpu_mod.snapshot(100, str(tmp_path / "a")), "raypd")
    assert cpu2["actor:DecodeHost#2"] == pytest.approx(3 / hz)   # after 106 (born earlier)


def test_vllm_processes_are_named_api_server_and_engine_core():
    label = cpu_mod.process_label
    assert label("/v/bin/python /v/bin/vllm serve /m", True, "vllm") == "api_server"
    assert label("VLLM::EngineCore", False, "vllm") == "engine_core"
    assert label("VLLM::Worker", False, "vllm") == "worker"          # runs the model on a CPU
    assert label("VLLM::APIServer", False, "vllm") == "api_server"
    assert label("/v/bin/python3 -B -c from multiprocessing.resource_tracker import main;main(33)",
                 False, "vllm") == "python -c"
    assert label("/v/bin/python3 -u -m ray.util.x --y", False, "raypd") == "ray.util.x"
    assert label("/v/bin/python3 /v/ray/dashboard/agent.py --x", False, "raypd") == "agent.py"


def test_cpu_per_output_token_in_the_summary_per_server_and_process(tmp_path):
    """Each run's /proc snapshots and client time become CPU-seconds per output token for each
    process, summed over the runs (vLLM's two blocks together) and divided by their tokens."""
    write_sweep(tmp_path)
    passing_runs(tmp_path)
    hz = os.sysconf("SC_CLK_TCK")
    procs = {"vllm": {500: ("vllm", 1, 500, 0, 0, 1, "/v/bin/vllm serve m"),
                      501: ("VLLM::EngineCore", 500, 500, 0, 0, 2, "VLLM::EngineCore")},
             "default": {600: ("raypd", 1, 600, 0, 0, 1, SERVE),
                         601: ("raylet", 600, 600, 0, 0, 2, RAYLET),
                         602: ("ray::DecodeHost", 601, 600, 0, 0, 3, "ray::DecodeHost")}}
    spend = {"vllm1": {500: 2 * hz, 501: 8 * hz}, "vllm2": {500: 4 * hz, 501: 10 * hz},
             "default": {600: 1 * hz, 601: 2 * hz, 602: 20 * hz}}
    for label, add in spend.items():
        base = procs["vllm" if label.startswith("vllm") else label]
        after = {pid: (c, pp, s, ut + add[pid], st, start, cmd)
                 for pid, (c, pp, s, ut, st, start, cmd) in base.items()}
        leader = min(base)
        for when, table in (("before", base), ("after", after)):
            fake_proc(tmp_path / f"p.{label}.{when}", table)
            json.dump(cpu_mod.snapshot(leader, str(tmp_path / f"p.{label}.{when}")),
                      open(tmp_path / f"{label}.random_x.0.procs.{when}", "w"))
        (tmp_path / f"{label}.random_x.0.client_cpu").write_text("1.500 0.500\n")
    out = summarize(tmp_path)
    c = out["cpu_s_per_output_token"]
    tokens = 4 * 64
    assert c["vllm"]["api_server"] == pytest.approx(6 / (2 * tokens))
    assert c["vllm"]["engine_core"] == pytest.approx(18 / (2 * tokens))
    assert c["vllm"]["client"] == pytest.approx(4 / (2 * tokens))
    assert c["vllm"]["runs_read"] == 2
    assert c["default"]["actor:DecodeHost"] == pytest.approx(20 / tokens)
    assert c["default"]["server_total"] == pytest.approx(23 / tokens)
    assert c["colocated"] is None          # no readings: unknown, never zero
    per_block = out["vllm_blocks"][1]["workloads"]["random_x"]["cpu_s_per_output_token"]
    assert per_block["engine_core"] == pytest.approx(10 / tokens)


def test_client_time_that_is_not_readable_is_unknown():
    assert cpu_mod.read_client_seconds("") is None
    assert cpu_mod.read_client_seconds("real 1\n") is None
    assert cpu_mod.read_client_seconds("2.250 0.750\n") == 3.0
