"""The router's KV timeline (router/kv_timeline.py) from load reports: kept samples at the
interval with the peak between them, markers from counter increases (restarts included),
the sliding-window hit rate, thinning that loses no event, and the time window."""

from __future__ import annotations

from protocol.messages import KVCounters, LoadReport
from router.kv_timeline import KVTimeline


def report(used: int, *, cached: int = 0, total: int = 100, inc: str = "a",
           **counters: int) -> LoadReport:
    return LoadReport("decode-0", active_blocks=used, cached_blocks=cached,
                      evictable_blocks=cached, free_blocks=total - used, total_blocks=total,
                      block_size=16,
                      kv_bytes_per_token=10, incarnation=inc, kv=KVCounters(**counters))


def test_samples_are_kept_at_the_interval_and_the_peak_between_them_survives():
    tl = KVTimeline(interval_s=1.0)
    for t, used in [(0.0, 5), (0.3, 40), (0.6, 10), (1.0, 12), (1.2, 3)]:
        tl.record("decode", report(used), now=100 + t)
    w = tl.to_dict()["workers"][0]
    assert w["t"] == [0.0, 1.0, 1.2]               # 1.2 is the newest report, not yet kept
    assert w["blocks_used"] == [5, 12, 3]
    assert w["blocks_used_peak"] == [5, 40, 3]      # the 40 at 0.3 s is not lost
    assert w["blocks_free"] == [95, 88, 97] and w["total_blocks"] == 100
    assert w["role"] == "decode" and w["block_size"] == 16 and w["kv_bytes_per_token"] == 10


def test_markers_count_counter_increases_and_a_restart_starts_from_zero():
    tl = KVTimeline(interval_s=0.0)
    seq = [dict(evictions=0), dict(evictions=3, preemptions=1), dict(evictions=3, preemptions=1),
           dict(evictions=7, transfers_rejected=2)]
    for i, c in enumerate(seq):
        tl.record("decode", report(1, **c), now=float(i))
    tl.record("decode", report(1, inc="b", evictions=2), now=4.0)    # restarted worker
    ev = tl.to_dict()["workers"][0]["events"]
    assert ev["evictions"] == [[1.0, 3], [3.0, 4], [4.0, 2]]
    assert ev["preemptions"] == [[1.0, 1]]
    assert ev["transfers_rejected"] == [[3.0, 2]]
    assert ev["restarts"] == [[4.0, 1]]


def test_hit_rate_is_over_the_sliding_window_only():
    tl = KVTimeline(interval_s=0.0)
    # 0-10 s: 100 prompt tokens a second, all reused; 10-20 s: none reused
    for s in range(21):
        p = 100 * s
        r = 100 * min(s, 10)
        tl.record("prefill", report(0, prompt_tokens=p, reused_tokens=r), now=float(s))
    w = tl.to_dict(window_s=5.0)["workers"][0]
    hit = dict(zip(w["t"], w["hit_rate"], strict=True))
    assert hit[0.0] is None                  # nothing admitted yet
    assert hit[8.0] == 1.0
    assert hit[12.0] == 0.6                  # 300 of the 500 tokens in (7, 12] were reused
    assert hit[20.0] == 0.0
    assert w["prompt_tokens"][-1] == 500 and w["reused_tokens"][-1] == 0


def test_thinning_keeps_every_event_and_the_peak():
    tl = KVTimeline(interval_s=0.0)
    for i in range(101):
        tl.record("decode", report(90 if i == 37 else 10, evictions=i), now=float(i))
    full = tl.to_dict()["workers"][0]
    thin = tl.to_dict(max_points=11)["workers"][0]
    assert len(thin["t"]) == 11 and thin["t"][0] == 0.0 and thin["t"][-1] == 100.0
    assert sum(n for _, n in thin["events"]["evictions"]) == \
        sum(n for _, n in full["events"]["evictions"]) == 100
    assert max(thin["blocks_used_peak"]) == 90


def test_since_and_t0_cut_and_shift_the_series():
    tl = KVTimeline(interval_s=0.0)
    for i in range(10):
        tl.record("decode", report(i, evictions=i), now=1000.0 + i)
    w = tl.to_dict(since=1005.0, t0=1004.0)["workers"][0]
    assert w["t"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert w["blocks_used"] == [5, 6, 7, 8, 9]
    # events before `since` are not in the cut; the first point starts the count
    assert w["events"]["evictions"] == [[2.0, 1], [3.0, 1], [4.0, 1], [5.0, 1]]


def test_a_late_older_snapshot_is_ignored_and_workers_are_ordered_prefill_first():
    tl = KVTimeline(interval_s=0.0)
    tl.record("decode", report(5), now=10.0)
    tl.record("decode", LoadReport("decode-0", active_blocks=99, total_blocks=100,
                                   age_s=5.0), now=11.0)      # taken at 6.0 < 10.0
    tl.record("prefill", LoadReport("prefill-0", total_blocks=50), now=10.0)
    d = tl.to_dict()
    assert [w["worker_id"] for w in d["workers"]] == ["prefill-0", "decode-0"]
    assert d["workers"][1]["blocks_used"] == [5]
