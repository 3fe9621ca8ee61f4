"""The cuda_ipc release path: a staged buffer's one CUDA IPC send gets exactly one receive in
every outcome (never pulled: expiry, abort, close, a lease that could not start; pulled once;
released mid-pull; a pull that could not map), the producer keeps no reference to the buffer
once its lease ended, and a second pull of one handle is refused. torch's IPC calls are faked
(kvtransfer.cuda_ipc.IPC, conftest's `ipc`) so the bookkeeping runs on CPU; the last test measures the real
thing on a GPU: P's reserved memory stays flat across staged-then-expired transfers."""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import replace

import pytest
import torch

from kvtransfer import cuda_ipc
from kvtransfer.base import TransferError
from kvtransfer.cuda_ipc import CudaIpcTransport
from kvtransfer.endpoint import KVProducer

SHAPE = (2, 2, 3, 4, 2, 8)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def producer(tmp_path) -> KVProducer:
    # a private buffer per transfer (tests/test_cuda_ipc_pool.py covers the staging pool)
    p = KVProducer(CudaIpcTransport(directory=str(tmp_path), staging_pool_mib=0), lease_s=5.0,
                   clock=Clock())
    yield p
    p.close()


def _pages(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _offer(producer: KVProducer):
    handle = producer.offer("r", _pages(), [1, 2, 3])
    buffer = weakref.ref(producer.transport._staged[handle.transfer_id].buffer)
    return handle, buffer


def _foreign(handle):
    """The handle as a decode worker in another process sees it (CUDA IPC, not _LOCAL)."""
    return replace(handle, export=replace(handle.export, pid=-1))


def _assert_dropped(producer: KVProducer, handle, buffer: weakref.ref) -> None:
    """Nothing refers to the staged buffer any more, and no file of it is left."""
    gc.collect()
    assert buffer() is None
    assert producer.transport.staged_ids() == [] and len(producer.leases) == 0
    assert handle.transfer_id not in cuda_ipc._LOCAL
    assert os.listdir(os.path.dirname(handle.export.ticket)) == []


@pytest.mark.parametrize("end", ["expire", "abort", "close"])
def test_a_staging_never_pulled_is_received_by_the_producer_and_dropped(ipc, producer, end):
    handle, buffer = _offer(producer)
    assert ipc.receives == {0: 0}
    if end == "expire":
        producer.leases._clock.now += 10
        assert producer.expire() == [handle.transfer_id]
    elif end == "abort":
        assert producer.abort(handle.transfer_id)
    else:
        producer.close()
    assert ipc.receives == {0: 1}
    _assert_dropped(producer, handle, buffer)


def test_a_lease_that_cannot_start_releases_the_staging(ipc, producer, monkeypatch):
    def refuse(*args, **kw):
        raise ValueError("lease table refused")
    monkeypatch.setattr(producer.leases, "pin", refuse)
    with pytest.raises(ValueError, match="refused"):
        producer.offer("r", _pages(), [1, 2, 3])
    gc.collect()
    assert producer.transport.staged_ids() == [] and ipc.receives == {0: 1}
    assert cuda_ipc._LOCAL == {}


@pytest.mark.parametrize("reader", ["same process", "other process"])
def test_a_staging_pulled_once_is_received_by_the_pull_and_dropped_at_ack(ipc, producer,
                                                                         tmp_path, reader):
    handle, buffer = _offer(producer)
    pull = handle if reader == "same process" else _foreign(handle)
    pages = CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False).fetch(pull)
    assert torch.equal(pages, _pages())
    assert ipc.receives == {0: 1}
    assert producer.ack(handle.transfer_id)
    assert ipc.receives == {0: 1}                    # P does not receive it a second time
    _assert_dropped(producer, handle, buffer)


@pytest.mark.parametrize("reader", ["same process", "other process"])
def test_a_second_pull_of_one_handle_is_refused(ipc, producer, tmp_path, reader):
    handle, _ = _offer(producer)
    pull = handle if reader == "same process" else _foreign(handle)
    consumer = CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False)
    consumer.fetch(pull)
    with pytest.raises(TransferError, match="pulled already.*one receive per send"):
        consumer.fetch(pull)
    with pytest.raises(TransferError, match="pulled already"):
        consumer.fetch_into(pull, torch.zeros(2, 2, 8, 4, 2, 8), [0, 1, 2])
    assert ipc.receives == {0: 1}
    producer.abort(handle.transfer_id)
    assert ipc.receives == {0: 1}


def test_a_second_pull_is_refused_on_the_cpu_stand_in(tmp_path):
    producer = CudaIpcTransport(directory=str(tmp_path))
    consumer = CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False)
    handle = producer.stage("r", _pages(), [1, 2, 3])
    assert torch.equal(consumer.fetch(handle), _pages())
    with pytest.raises(TransferError, match="pulled already"):
        consumer.fetch(handle)
    producer.release(handle.transfer_id)
    assert os.listdir(tmp_path) == []
    with pytest.raises(TransferError, match="is not staged"):   # after release: gone
        consumer.fetch(handle)


def test_a_pull_that_cannot_map_gives_its_receive_up(ipc, producer, tmp_path):
    handle, buffer = _offer(producer)
    ipc.fail_open = True
    with pytest.raises(TransferError, match="cannot map"):
        CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False).fetch(_foreign(handle))
    assert ipc.receives == {0: 1}
    producer.leases._clock.now += 10
    producer.expire()
    assert ipc.receives == {0: 1}
    _assert_dropped(producer, handle, buffer)


def test_a_release_during_a_pull_leaves_the_receive_to_the_pull(ipc, producer, tmp_path,
                                                              monkeypatch):
    handle, buffer = _offer(producer)
    real_open = ipc.open

    def open_then_expire(args, index):
        pages = real_open(args, index)
        producer.leases._clock.now += 10
        producer.expire()                   # the lease ends while D maps the buffer
        return pages
    monkeypatch.setattr(ipc, "open", open_then_expire)
    with pytest.raises(TransferError, match="released while being read"):
        CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False).fetch(_foreign(handle))
    assert ipc.receives == {0: 1}
    _assert_dropped(producer, handle, buffer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_p_reserved_gpu_memory_stays_flat_across_expired_stagings(tmp_path):
    clock = Clock()
    producer = KVProducer(CudaIpcTransport(device="cuda", directory=str(tmp_path),
                                           staging_pool_mib=0), lease_s=1.0, clock=clock)
    pages = torch.randn(4, 2, 64, 16, 8, 64, device="cuda").to(torch.bfloat16)  # 8 MiB
    reserved = []
    try:
        for _ in range(20):
            producer.offer("r", pages, list(range(64)))
            clock.now += 2
            assert len(producer.expire()) == 1
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    finally:
        producer.close()
    assert reserved[-1] == reserved[0], reserved


def test_a_pull_reports_its_seconds_by_phase(ipc, producer, tmp_path, monkeypatch):
    """`raypd bench transfer` splits a pull into map, copy, release and checks
    (CudaIpcTransport.last_phases): each phase's seconds are its own, on a clock that moves
    only inside the map (3 s) and the copy (5 s)."""
    clock = Clock()
    monkeypatch.setattr(cuda_ipc, "time", type("T", (), {"perf_counter": staticmethod(clock)}))
    open_ipc, scatter = ipc.open, cuda_ipc.scatter_blocks

    def slow_open(*args):
        clock.now += 3.0
        return open_ipc(*args)

    def slow_scatter(*args):
        clock.now += 5.0
        return scatter(*args)
    monkeypatch.setattr(ipc, "open", slow_open)
    monkeypatch.setattr(cuda_ipc, "scatter_blocks", slow_scatter)
    handle, _ = _offer(producer)
    consumer = CudaIpcTransport(directory=str(tmp_path), cleanup_stale=False)
    kv = torch.zeros(2, 2, 8, 4, 2, 8)
    consumer.fetch_into(_foreign(handle), kv, [4, 5, 6])
    assert torch.equal(kv[:, :, 4:7], _pages())
    assert consumer.last_phases == {"map": 3.0, "copy": 5.0, "release": 0.0, "checks": 0.0}
    producer.ack(handle.transfer_id)
