"""cuda_ipc's staging pool (kvtransfer/staging_pool.py): P stages transfers in ranges of
long-lived segments, so D maps each segment once instead of a fresh CUDA IPC handle per pull.

On CPU, torch's IPC is faked (conftest's `ipc`): every export still gets exactly
one receive, transfers reuse one segment, the reader keeps one mapping of it, a range goes back
only after its release, and a pull that raced a release and a reuse of its range is refused.
On a GPU, the last test pulls from another process and checks that the reader mapped the
segment once across several transfers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvtransfer import cuda_ipc
from kvtransfer.base import TransferError
from kvtransfer.cuda_ipc import CudaIpcTransport
from kvtransfer.endpoint import KVProducer
from kvtransfer.staging_pool import ALIGN, StagingPool
from tests.test_cuda_ipc_release import SHAPE, Clock, _foreign, _pages


def test_pool_ranges_tile_their_segments_through_random_takes_and_gives():
    rng = random.Random(0)
    pool = StagingPool("cpu", cap_bytes=1 << 20, segment_bytes=64 << 10)
    held = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            pool.give(held.pop(rng.randrange(len(held))))
        else:
            r = pool.take(rng.randint(1, 40_000))
            if r is not None:
                assert r.start % ALIGN == 0 and r.view.numel() == r.nbytes
                held.append(r)
        pool.check()
    spans = sorted((r.segment, r.start, r.start + r.nbytes) for r in held)
    for a, b in zip(spans, spans[1:], strict=False):
        assert a[0] != b[0] or a[2] <= b[1], (a, b)   # no two live ranges overlap
    for r in held:
        pool.give(r)
    pool.check()
    assert all(len(s.free) == 1 and not s.taken for s in pool._segments.values())


def test_pool_grows_up_to_its_cap_then_refuses():
    pool = StagingPool("cpu", cap_bytes=3 << 20, segment_bytes=1 << 20)
    big = pool.take(2 << 20)                     # larger than a segment: a segment of its own
    assert big is not None and pool.reserved_bytes == 2 << 20
    small = pool.take(1 << 20)
    assert small is not None and pool.reserved_bytes == 3 << 20
    assert pool.take(1) is None                  # full, and the cap allows no new segment
    pool.give(small)
    again = pool.take(1000)
    assert again is not None and again.segment == small.segment
    pool.check()


@pytest.fixture()
def producer(tmp_path):
    p = KVProducer(CudaIpcTransport(directory=str(tmp_path), staging_pool_mib=1), lease_s=5.0,
                   clock=Clock())
    yield p
    p.close()


def _reader(tmp_path) -> CudaIpcTransport:
    return CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False)


def test_transfers_reuse_one_segment_and_the_reader_keeps_one_mapping(ipc, producer, tmp_path):
    reader = _reader(tmp_path)
    segments = set()
    for seed in range(4):
        handle = producer.offer("r", _pages(seed), [1, 2, 3])
        segments.add(handle.export.segment)
        kv = torch.zeros(2, 2, 8, 4, 2, 8)
        reader.fetch_into(_foreign(handle), kv, [5, 6, 7])
        assert torch.equal(kv[:, :, 5:8], _pages(seed))
        assert producer.ack(handle.transfer_id)
    assert len(segments) == 1 and "" not in segments
    assert list(cuda_ipc._MAPPED) == [(-1, segments.pop())]
    assert ipc.receives == {0: 1, 1: 1, 2: 1, 3: 1}       # one receive per send, as before
    pool = producer.transport._pools[torch.device("cpu")]
    pool.check()
    assert pool.reserved_bytes == 1 << 20 and producer.transport.staged_ids() == []
    assert all(not s.taken for s in pool._segments.values())


def test_two_staged_at_once_get_disjoint_ranges(ipc, producer, tmp_path):
    a = producer.offer("a", _pages(1), [1, 2, 3])
    b = producer.offer("b", _pages(2), [1, 2, 3])
    ra = producer.transport._staged[a.transfer_id].range
    rb = producer.transport._staged[b.transfer_id].range
    assert ra.segment == rb.segment and ra.start + ra.nbytes <= rb.start
    reader = _reader(tmp_path)
    assert torch.equal(reader.fetch(_foreign(b)), _pages(2))
    assert torch.equal(reader.fetch(_foreign(a)), _pages(1))


def test_a_transfer_larger_than_the_pool_is_staged_privately(ipc, tmp_path):
    p = KVProducer(CudaIpcTransport(directory=str(tmp_path), staging_pool_mib=1), lease_s=5.0,
                   clock=Clock())
    try:
        pages = torch.randn(2, 2, 40, 64, 8, 8)          # 2.6 MB > 1 MiB
        handle = p.offer("r", pages, list(range(40)))
        assert handle.export.segment == ""
        assert torch.equal(_reader(tmp_path).fetch(_foreign(handle)), pages)
        assert cuda_ipc._MAPPED == {}                     # a private buffer is not kept mapped
    finally:
        p.close()


def test_a_pull_of_a_range_released_and_reused_meanwhile_is_refused(ipc, producer, tmp_path,
                                                                   monkeypatch):
    """P releases the transfer while D reads it and stages another one in the same range:
    D must not take those pages for its own (its final check fails), and the new transfer
    reads correctly."""
    first = producer.offer("r1", _pages(1), [1, 2, 3])
    first_range = producer.transport._staged[first.transfer_id].range
    later = {}
    open_ipc = ipc.open

    def open_then_release_and_reuse(args, index):
        pages = open_ipc(args, index)
        producer.abort(first.transfer_id)
        later["handle"] = producer.offer("r2", _pages(2), [1, 2, 3])
        return pages
    monkeypatch.setattr(ipc, "open", open_then_release_and_reuse)
    reader = _reader(tmp_path)
    with pytest.raises(TransferError, match="released while being read"):
        reader.fetch(_foreign(first))
    second = later["handle"]
    reused = producer.transport._staged[second.transfer_id].range
    assert (reused.segment, reused.start) == (first_range.segment, first_range.start)
    monkeypatch.setattr(ipc, "open", open_ipc)
    assert torch.equal(reader.fetch(_foreign(second)), _pages(2))
    assert all(n == 1 for n in ipc.receives.values())


def test_the_reader_keeps_at_most_max_mapped_segments_and_none_of_exited_producers(ipc,
                                                                                  monkeypatch):
    monkeypatch.setattr(cuda_ipc, "MAX_MAPPED", 3)
    monkeypatch.setattr(cuda_ipc, "_alive", lambda pid: pid != 99)
    view = torch.zeros(1)
    export = cuda_ipc.SharedPages("cuda", "t", 99, segment="s0")
    cuda_ipc._keep_mapping(export, view)
    for i in range(1, 6):
        cuda_ipc._keep_mapping(replace(export, pid=7, segment=f"s{i}"), view)
    assert list(cuda_ipc._MAPPED) == [(7, "s3"), (7, "s4"), (7, "s5")]


def test_a_bad_staging_pool_size_is_refused():
    with pytest.raises(TransferError, match="staging_pool_mib must be an integer >= 0"):
        CudaIpcTransport(staging_pool_mib=-1)


def _pull_in_child(handles, conn) -> None:
    """D in another process: pull each handle, return whether the pages matched and how many
    CUDA IPC storages it opened (torch's receive cache)."""
    import torch.multiprocessing.reductions as reductions
    reader = CudaIpcTransport(device="cuda", cleanup_stale=False)
    opened = 0
    real = torch.UntypedStorage._new_shared_cuda

    def counting(*args, **kw):
        nonlocal opened
        opened += 1
        return real(*args, **kw)
    torch.UntypedStorage._new_shared_cuda = counting
    try:
        sums = [float(reader.fetch(h).float().sum()) for h in handles]
    finally:
        torch.UntypedStorage._new_shared_cuda = real
    conn.send((sums, opened, len(reductions.shared_cache)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("pool_mib", [64, 0])
def test_on_a_gpu_another_process_maps_a_pool_segment_once(tmp_path, pool_mib):
    import torch.multiprocessing as mp
    producer = KVProducer(CudaIpcTransport(device="cuda", directory=str(tmp_path),
                                           staging_pool_mib=pool_mib), lease_s=60.0)
    try:
        pages = [torch.randn(SHAPE, device="cuda").to(torch.bfloat16) for _ in range(3)]
        handles = [producer.offer(f"r{i}", p, [1, 2, 3]) for i, p in enumerate(pages)]
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_pull_in_child, args=(handles, theirs))
        child.start()
        assert ours.poll(120), f"the reader process sent nothing (exit code {child.exitcode})"
        sums, opened, _ = ours.recv()
        child.join(60)
        assert sums == [float(p.float().sum()) for p in pages]
        assert opened == (1 if pool_mib else 3)
    finally:
        producer.close()
