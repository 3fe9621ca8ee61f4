"""raypd/bench/proc_stats.py on planted /proc trees (no Ray, no server): a served system's
processes, their CPU-seconds over a run and their thread peaks under load, named by what they
are; the per-run thread files scripts/bench-vs-vllm.sh leaves, summarized into its JSON; and the
detokenizer cost figure of `raypd bench disagg` (chars decoded, last 100 tokens over first 100)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading

import pytest

from raypd.bench import proc_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = "/v/bin/python /v/bin/raypd bench disagg"
RAYLET = "/v/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s"
GCS = "/v/ray/core/src/ray/gcs/gcs_server --gcs_server_port=0"


def plant(root, procs):
    """procs: pid -> (comm, ppid, session, utime, stime, threads, start, cmdline)."""
    for pid, (comm, ppid, sid, ut, st, nth, start, cmd) in procs.items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        for tid in range(nth):
            (d / "task" / str(pid + tid)).mkdir(exist_ok=True)
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {sid} 0 -1 4194304 0 0 0 0 "
                                f"{ut} {st} 7 7 20 0 {nth} 0 {start} 123456 789\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")


def test_stat_fields_are_counted_after_the_last_parenthesis_of_the_command_name():
    stat = "42 (ray::Decode (x) y) S 7 42 9 0 -1 0 0 0 0 0 100 25 0 0 20 0 37 0 5555 1 2\n"
    p = proc_stats.parse_stat(42, stat, "ray::DecodeHost")
    assert (p.ppid, p.session, p.ticks, p.threads, p.start) == (7, 9, 125, 37, 5555)


def test_thread_count_reads_the_task_folder(tmp_path):
    plant(tmp_path, {10: ("x", 1, 1, 0, 0, 5, 1, "/bin/x")})
    assert proc_stats.thread_count(10, str(tmp_path)) == 5


def test_thread_count_of_this_process_follows_a_thread_that_starts_and_ends():
    started, release = threading.Event(), threading.Event()
    before = proc_stats.thread_count()
    t = threading.Thread(target=lambda: (started.set(), release.wait()))
    t.start()
    started.wait()
    try:
        assert proc_stats.thread_count() == before + 1
    finally:
        release.set()
        t.join()
    assert proc_stats.thread_count() == before


def test_a_snapshot_takes_the_leader_its_session_and_its_descendants_only(tmp_path):
    plant(tmp_path, {
        100: ("raypd", 1, 90, 10, 5, 40, 1000, DRIVER),          # not a session leader
        101: ("gcs_server", 100, 90, 3, 1, 9, 1001, GCS),
        102: ("raylet", 100, 102, 2, 2, 12, 1002, RAYLET),        # a session of its own
        103: ("ray::DecodeHost", 102, 102, 50, 10, 30, 1003, "ray::DecodeHost"),
        200: ("bash", 1, 90, 99, 99, 1, 500, "/bin/bash other"),  # same session, not ours
    })
    snap = proc_stats.snapshot(100, str(tmp_path))
    assert [p["pid"] for p in snap["procs"]] == [100, 101, 102, 103]
    assert [p["threads"] for p in snap["procs"]] == [40, 9, 12, 30]


def test_cpu_seconds_per_process_name_the_leader_by_the_callers_label(tmp_path):
    base = {100: ("raypd", 1, 90, 100, 20, 40, 1000, DRIVER),
            101: ("gcs_server", 100, 90, 30, 10, 9, 1001, GCS),
            102: ("raylet", 100, 102, 20, 20, 12, 1002, RAYLET),
            103: ("ray::PrefillHost", 102, 102, 500, 100, 30, 1003, "ray::PrefillHost"),
            104: ("ray::DecodeHost", 102, 102, 500, 100, 30, 1004, "ray::DecodeHost"),
            105: ("ray::IDLE", 102, 102, 5, 5, 3, 1005, "ray::IDLE")}
    plant(tmp_path / "b", base)
    plant(tmp_path / "a", {
        100: ("raypd", 1, 90, 150, 30, 40, 1000, DRIVER),                            # +60
        101: ("gcs_server", 100, 90, 31, 10, 9, 1001, GCS),                          # +1
        102: ("raylet", 100, 102, 22, 21, 12, 1002, RAYLET),                         # +3
        103: ("ray::PrefillHost", 102, 102, 900, 150, 30, 1003,
              "ray::PrefillHost.step()"),                                            # +450
        104: ("ray::DecodeHost", 102, 102, 800, 200, 30, 1004, "ray::DecodeHost"),  # +400
        106: ("ray::DecodeHost", 102, 102, 40, 10, 30, 2000, "ray::DecodeHost")})   # born: +50
    hz = os.sysconf("SC_CLK_TCK")
    cpu, exited = proc_stats.cpu_seconds(proc_stats.snapshot(100, str(tmp_path / "b")),
                                         proc_stats.snapshot(100, str(tmp_path / "a")),
                                         "driver")
    assert cpu == pytest.approx({"driver": 60 / hz, "gcs_server": 1 / hz, "raylet": 3 / hz,
                                 "actor:PrefillHost": 450 / hz, "actor:DecodeHost": 400 / hz,
                                 "actor:DecodeHost#2": 50 / hz})
    assert exited == ["ray_idle_worker"]


def test_per_output_token_divides_each_process_and_their_total():
    got = proc_stats.per_output_token({"driver": 2.0, "raylet": 1.0, "actor:DecodeHost": 5.0},
                                      4)
    assert got == {"actor:DecodeHost": 1.25, "driver": 0.5, "raylet": 0.25,
                   "server_total": 2.0}


@pytest.mark.parametrize(("cmd", "label"), [
    ("VLLM::EngineCore", "engine_core"),
    ("ray::DecodeHost.step()", "actor:DecodeHost"),
    ("ray::IDLE", "ray_idle_worker"),
    (RAYLET, "raylet"),
    ("/v/bin/python3 -u -m ray.util.x --y", "ray.util.x"),
    ("/v/bin/python3 -B -c from multiprocessing.resource_tracker import main", "python -c"),
    ("/v/bin/python3 /v/ray/dashboard/agent.py --x", "agent.py"),
    ("", "unnamed"),
])
def test_processes_are_named_by_what_they_are(cmd, label):
    assert proc_stats.process_label(cmd) == label


def test_thread_peaks_keep_each_processes_most_and_see_a_newcomer_at_the_next_rescan(tmp_path):
    proc = tmp_path / "proc"
    plant(proc, {100: ("raypd", 1, 100, 0, 0, 20, 1000, "/v/bin/raypd serve")})
    peaks = proc_stats.ThreadPeaks(100, str(proc), rescan_every=2)
    peaks.sample()                                         # a rescan
    plant(proc, {100: ("raypd", 1, 100, 0, 0, 280, 1000, "/v/bin/raypd serve"),
                 101: ("raylet", 100, 100, 0, 0, 12, 1001, RAYLET)})
    peaks.sample()                                         # known processes only
    assert {k[0] for k in peaks.peaks} == {100}
    plant(proc, {100: ("raypd", 1, 100, 0, 0, 21, 1000, "/v/bin/raypd serve")})
    peaks.sample()                                         # a rescan: the raylet joins
    got = {name: p["threads"]
           for name, p in proc_stats.labelled(peaks.to_json(), "serve").values()}
    assert got == {"serve": 280, "raylet": 12}
    assert peaks.samples == 3


def test_thread_peaks_do_not_take_a_reused_pid_for_the_process_they_knew(tmp_path):
    proc = tmp_path / "proc"
    plant(proc, {100: ("raypd", 1, 100, 0, 0, 20, 1000, "/v/bin/raypd serve"),
                 101: ("w", 100, 100, 0, 0, 3, 1001, "ray::DecodeHost")})
    peaks = proc_stats.ThreadPeaks(100, str(proc), rescan_every=10)
    peaks.sample()
    plant(proc, {101: ("w", 100, 100, 0, 0, 99, 5000, "ray::DecodeHost")})   # pid reused
    peaks.sample()
    assert peaks.peaks[(101, 1001)] == ("ray::DecodeHost", 3)
    assert (101, 5000) not in peaks.peaks


# ---- scripts/bench_vs_vllm_cpu.py: the thread peaks of bench-vs-vllm.sh's runs ---------------

@pytest.fixture(scope="module")
def cpu_script():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    return importlib.import_module("bench_vs_vllm_cpu")


def _peaks_file(path, leader, procs):
    """procs: pid -> (start, cmd, peak threads)."""
    json.dump({"leader": leader, "samples": 4,
               "procs": [{"pid": pid, "start": s, "cmd": c, "threads": t}
                         for pid, (s, c, t) in procs.items()]}, open(path, "w"))


def test_threads_summary_gives_each_servers_front_process_peak_under_load(tmp_path, cpu_script):
    serve = "/v/bin/python /v/bin/raypd serve --config x.yaml"
    _peaks_file(tmp_path / "default.random_x.0.threads", 600,
                {600: (1, serve, 300), 601: (2, RAYLET, 12), 602: (3, "ray::DecodeHost", 40)})
    _peaks_file(tmp_path / "default.chat_y.0.threads", 600,
                {600: (1, serve, 120), 601: (2, RAYLET, 14)})
    json.dump({"leader": 600, "clk_tck": 100,
               "procs": [{"pid": 600, "start": 1, "cmd": serve, "ticks": 0, "threads": 45}]},
              open(tmp_path / "default.random_x.0.procs.before", "w"))
    for block, peak in (("vllm1", 7), ("vllm2", 9)):
        _peaks_file(tmp_path / f"{block}.random_x.0.threads", 500,
                    {500: (1, "/v/bin/vllm serve m", peak), 501: (2, "VLLM::EngineCore", 30)})
    _peaks_file(tmp_path / "vllm_mbt512.random_x.tune.threads", 700,    # not a scored run
                {700: (1, "/v/bin/vllm serve m", 999)})
    got = cpu_script.threads_summary(str(tmp_path))
    s = got["serve_threads_under_load"]
    assert s["default"] == {"process": "serve", "peak": 300, "at_rest": 45,
                            "per_workload": {"random_x": 300, "chat_y": 120}, "samples": 8}
    assert s["vllm"]["process"] == "api_server" and s["vllm"]["peak"] == 9
    assert s["vllm"]["at_rest"] is None                     # no snapshot before: unknown
    assert got["threads_under_load"]["default"] == {"actor:DecodeHost": 40, "raylet": 14,
                                                    "serve": 300}
    assert got["threads_under_load"]["vllm"] == {"api_server": 9, "engine_core": 30}


def test_the_scripts_snapshot_and_cpu_seconds_are_proc_stats_own(cpu_script):
    """One concept, one place: the script names the leader by the server's kind and leaves
    the rest to proc_stats."""
    assert cpu_script.snapshot is proc_stats.snapshot
    assert cpu_script.process_label("/v/bin/vllm serve /m", True, "vllm") == "api_server"
    assert cpu_script.process_label("VLLM::EngineCore", False, "vllm") == "engine_core"


# ---- raypd bench disagg: the detokenizer's cost per token at the end of a long output --------

class _WholeOutputDecoder:
    """A stand-in detokenizer that decodes the whole output for every token (O(n) a token)."""

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer, self.ids, self.text, self.chars_decoded = tokenizer, [], "", 0

    def add(self, token_ids):
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.chars_decoded += len(text)
        new, self.text = text[len(self.text):], text
        return new


@pytest.fixture(scope="module")
def tiny_tok():
    from workers.model_loader import _tiny_tokenizer
    return _tiny_tokenizer()


def test_detok_figure_grows_with_the_output_for_a_whole_output_decoder(tiny_tok):
    from raypd.bench.disagg import detok_cost_growth, real_text_token_ids
    ids = real_text_token_ids(tiny_tok, 1000)
    got = detok_cost_growth(tiny_tok, ids, window=100, stream_cls=_WholeOutputDecoder)
    assert got["chars_decoded_first"] == sum(range(1, 101))       # byte tokens: 1 char each
    assert got["last_over_first"] > 10


def test_detok_figure_stays_flat_for_the_routers_incremental_detokenizer(tiny_tok):
    from raypd.bench.disagg import detok_cost_growth, real_text_token_ids
    ids = real_text_token_ids(tiny_tok, 1000)
    got = detok_cost_growth(tiny_tok, ids, window=100)
    assert got["output_tokens"] == 1000
    assert 0.5 < got["last_over_first"] < 1.5


def test_real_text_tokens_are_the_python_references_text_without_special_tokens(tiny_tok):
    from pydoc_data.topics import topics

    from raypd.bench.disagg import real_text_token_ids
    ids = real_text_token_ids(tiny_tok, 400)
    assert len(ids) == 400 and not set(ids) & set(tiny_tok.all_special_ids)
    assert topics[min(topics)].startswith(tiny_tok.decode(ids))


def test_an_open_stream_reads_its_status_data_and_end_across_split_reads():
    from raypd.bench.disagg import _Stream
    s = _Stream(sock=None)
    for part in (b"HTTP/1.1 2", b"00 OK\r\ncontent-type: text/event-stream\r\n\r\nda",
                 b"ta: {\"x\": 1}\n\n"):
        s.feed(part)
    assert (s.status, s.streaming, s.ended) == (200, True, False)
    s.feed(b"data: [DO")
    s.feed(b"NE]\n\n")
    assert s.ended
    refused = _Stream(sock=None)
    refused.feed(b"HTTP/1.1 429 Too Many Requests\r\n\r\n")
    refused.feed(b"")
    assert (refused.status, refused.streaming, refused.ended) == (429, False, True)
