"""What the report tells of the KV cache (raypd/replay/kv_story.py): the boundary's headroom in
blocks and in requests of the run's mean length, growth points, reuse against the trace's
repeats, event totals, and times rebased to the replay's start."""

from __future__ import annotations

from protocol.messages import KVCounters, LoadReport
from raypd.replay.kv_story import kv_story, rebase
from raypd.replay.submit import RequestRecord
from router.kv_timeline import KVTimeline


def timeline(peaks: dict[str, list[int]]) -> dict:
    tl = KVTimeline(interval_s=0.0)
    for wid, used in peaks.items():
        for i, u in enumerate(used):
            tl.record("decode", LoadReport(wid, active_blocks=u, free_blocks=100 - u,
                                           total_blocks=100, block_size=16,
                                           kv_bytes_per_token=1000, num_requests=u // 10,
                                           running_tokens=u * 16,
                                           kv=KVCounters(evictions=i)), now=50.0 + i)
    return tl.to_dict()


def record(i: int, prompt: int, out: int, cached: int, repeated: float) -> RequestRecord:
    return RequestRecord(f"r{i}", ok=True, status=200, sent_s=float(i), first_token_s=i + 0.1,
                         end_s=i + 1.0, prompt_tokens=prompt, output_tokens=out,
                         cached_tokens=cached, repeated_prefix=repeated)


def test_boundary_is_the_fullest_pool_with_headroom_in_mean_length_requests():
    recs = [record(0, 100, 28, 0, 0.0), record(1, 100, 28, 50, 0.5)]   # 128 tokens = 8 blocks
    st = kv_story(timeline({"decode-0": [10, 60, 20], "decode-1": [30, 90, 40]}), recs)
    assert st["closest_to_edge"] == "decode-1" and st["peak_kv_share"] == 0.9
    edge = next(b for b in st["boundary"] if b["worker_id"] == "decode-1")
    assert edge["headroom_blocks"] == 10 and edge["blocks_per_mean_request"] == 8
    assert edge["headroom_requests"] == 1                  # 10 blocks hold one more such request
    assert edge["peak_kv_bytes"] == 90 * 16 * 1000 and edge["peak_at_s"] == 1.0
    assert st["events"]["evictions"] == 4                  # 2 per worker
    g = next(x for x in st["growth"] if x["worker_id"] == "decode-0")
    assert g["requests"] == [1, 6, 2] and g["kv_bytes"] == [10 * 16000, 60 * 16000, 20 * 16000]


def test_reuse_is_cumulative_and_measured_against_what_the_trace_repeats():
    recs = [record(0, 100, 8, 0, 0.0), record(1, 300, 8, 150, 0.8),
            RequestRecord("failed", ok=False, status=500, prompt_tokens=1000)]
    ru = kv_story(None, recs)["reuse"]
    assert ru["served_from_cache"] == [0.0, 0.375]         # 150 of 400
    assert ru["repeat_ceiling"] == [0.0, 0.6]              # 240 of 400
    assert ru["share_of_ceiling"] == 0.625


def test_rebase_moves_every_time_to_the_replay_start():
    tl = timeline({"decode-0": [1, 2, 3]})
    assert tl["t0"] == 50.0
    moved = rebase(tl, 51.0)["workers"][0]
    assert moved["t"] == [-1.0, 0.0, 1.0]
    assert moved["events"]["evictions"] == [[0.0, 1], [1.0, 1]]


def test_bench_capacity_curves_are_recorded_per_model_and_kv_dtype_for_reports(
        tmp_path, monkeypatch):
    from raypd.bench.capacity import CURVE_KEYS, record_curves, recorded_curves
    from raypd.replay.report import build_report
    from raypd.replay.report_html import render_html
    monkeypatch.setenv("RAYPD_CACHE_DIR", str(tmp_path))
    r = {k: None for k in CURVE_KEYS} | {
        "model": "tiny", "kv_dtype": "float32", "concurrencies": [1, 4],
        "peak_bytes_vs_concurrency": {"paged": [1 << 20, 4 << 20],
                                      "paged_prefix": [1 << 20, 2 << 20]},
        "fixed_context": 1024, "evidence": "cpu-measured", "headline": {}}
    assert recorded_curves("tiny", "float32") is None
    record_curves(r)
    got = recorded_curves("tiny", "float32")
    assert got["peak_bytes_vs_concurrency"]["paged"] == [1 << 20, 4 << 20]
    assert recorded_curves("tiny", "int8") is None          # another KV dtype: not these
    recs = [record(0, 100, 28, 0, 0.0), record(1, 100, 28, 50, 0.5)]
    rep = build_report(recs, params={"model": "tiny"}, wall_s=2.0,
                       kv_timeline=timeline({"decode-0": [10, 60, 20]}), capacity_curves=got)
    assert rep["kv_story"]["capacity_curves"]["fixed_context"] == 1024
    assert "bench capacity</code>'s paged curves for this model" in render_html(rep, recs)
