"""Worker actors on one machine lend each other idle threads (workers/thread_share.py): a busy
worker takes its own threads plus its share of the idle workers', never more than the CPUs;
a dead worker's slot is ignored; the engine loop runs its steps on that many threads."""

from __future__ import annotations

import subprocess
import sys
import time

from protocol.messages import RequestInput
from workers.decode_host import DecodeHost
from workers.request import SamplingParams
from workers.thread_share import SLOT, ThreadShare, start_time


def _share(tmp_path, name: str, own: int, busy: bool, cpus: int = 64) -> ThreadShare:
    s = ThreadShare(name, own, folder=tmp_path, cpus=cpus, rescan_s=0.0)
    s.set_busy(busy)
    return s


def test_alone_a_worker_keeps_its_own_threads(tmp_path):
    assert _share(tmp_path, "decode-0", 2, True).threads() == 2


def test_an_idle_peers_threads_go_to_the_busy_worker(tmp_path):
    me = _share(tmp_path, "decode-0", 1, True)
    peer = _share(tmp_path, "prefill-0", 1, False)
    assert me.threads() == 2
    peer.set_busy(True)
    assert me.threads() == 1 and peer.threads() == 1
    peer.set_busy(False)
    assert me.threads() == 2


def test_idle_threads_are_split_over_the_busy_workers_rounded_down(tmp_path):
    a = _share(tmp_path, "decode-0", 1, True)
    b = _share(tmp_path, "decode-1", 1, True)
    idle = _share(tmp_path, "prefill-0", 1, False)
    assert a.threads() == b.threads() == 1       # half a thread each: none
    idle.close()
    _share(tmp_path, "prefill-1", 2, False)
    assert a.threads() == b.threads() == 2


def test_never_more_than_the_cpus(tmp_path):
    me = _share(tmp_path, "decode-0", 1, True, cpus=2)
    _share(tmp_path, "prefill-0", 4, False)
    assert me.threads() == 2
    assert _share(tmp_path, "decode-1", 3, True, cpus=2).threads() == 3   # its own, always


def test_a_dead_workers_slot_is_ignored_and_removed(tmp_path):
    me = _share(tmp_path, "decode-0", 1, True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    slot = tmp_path / f"prefill-0.{pid}"
    slot.write_bytes(SLOT.pack(pid, 1, 0, 12345))   # idle, but its process has exited
    assert me.threads() == 1
    assert not slot.exists()


def test_a_reused_pid_does_not_revive_a_slot(tmp_path):
    me = _share(tmp_path, "decode-0", 1, True)
    mine = start_time(me.pid)
    slot = tmp_path / "prefill-0.old"
    slot.write_bytes(SLOT.pack(me.pid, 1, 0, mine - 1))   # this pid, an earlier process's
    assert me.threads() == 1
    assert not slot.exists()


def test_close_removes_the_slot(tmp_path):
    me = _share(tmp_path, "decode-0", 1, True)
    me.close()
    assert list(tmp_path.iterdir()) == []


def test_the_engine_loop_steps_on_the_shared_threads(tmp_path):
    host = DecodeHost("decode-share", dict(model="tiny", num_blocks=32, block_size=16,
                                           device="cpu"))
    peer = _share(tmp_path, "prefill-share", 1, False)
    host._threads = ThreadShare("decode-share", 1, folder=tmp_path, cpus=2, rescan_s=0.0)
    try:
        for i, (busy, want) in enumerate(((False, 2), (True, 1))):
            peer.set_busy(busy)
            adm = host.admit(RequestInput(f"r{i}", [5, 6, 7, 8], SamplingParams(
                max_tokens=4, ignore_eos=True), time.time() + 60),
                local_prefill_max_tokens=10**6)
            assert adm.admitted
            deadline = time.monotonic() + 60
            while not any(d.done is not None for d in host.take_deltas(1.0).deltas):
                assert time.monotonic() < deadline
            assert host.step_threads == want
    finally:
        host.shutdown()


def test_config_key_reaches_the_cluster_config():
    from cluster.config import ConfigError, load_config
    assert load_config(None).to_pd_config().share_idle_threads is True
    assert load_config(None, {"engine.share_idle_threads": False}).to_pd_config() \
        .share_idle_threads is False
    try:
        load_config(None, {"engine.share_idle_threads": "sometimes"})
    except ConfigError as e:
        assert "share_idle_threads" in str(e)
    else:
        raise AssertionError("a non-boolean was accepted")
