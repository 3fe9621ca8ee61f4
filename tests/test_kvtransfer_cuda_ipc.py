"""The cuda_ipc transport's protocol, on its CPU stand-in (the staged pages are a shared-memory
file instead of a CUDA IPC handle; stage, ticket, map, copy and release are the same code):
bit-exact pages, late and mid-read releases refused, a GPU asked for where there is none
refused at once; RDT's backend follows the pools' device. (Two actors: test_kvtransfer.py;
the whole handoff: test_disagg.py; the CUDA path itself: tests/test_gpu.py, on a GPU.)"""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer import rdt
from kvtransfer.base import TransferError, make_transport
from kvtransfer.cuda_ipc import CudaIpcTransport, SharedPages

SHAPE = (2, 2, 6, 4, 2, 8)


def _cache(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pair(**kw):
    return make_transport("cuda_ipc", **kw), make_transport("cuda_ipc")


def test_stand_in_moves_pages_bit_exactly_and_release_unpublishes():
    producer, consumer = _pair(checksum=True)
    kv = _cache(1)
    handle = producer.stage_blocks("r1", kv, [4, 1, 2], [11, 12, 13])
    assert isinstance(handle.export, SharedPages) and handle.export.kind == "cpu"
    assert handle.checksum is not None and os.path.exists(handle.export.ticket)
    pages = consumer.fetch(handle)
    assert torch.equal(pages.view(torch.uint8), kv[:, :, [4, 1, 2]].contiguous().view(torch.uint8))
    again = producer.stage_blocks("r1", kv, [4, 1, 2], [11, 12, 13])   # one pull a staging
    dest = torch.zeros(SHAPE, dtype=torch.bfloat16)
    consumer.fetch_into(again, dest, [0, 5, 3])
    assert torch.equal(dest[:, :, [0, 5, 3]], kv[:, :, [4, 1, 2]])
    assert producer.release(handle.transfer_id) and not producer.release(handle.transfer_id)
    assert not os.path.exists(handle.export.ticket)
    assert not any(n.endswith(os.path.basename(handle.export.ticket) + ".pulled")
                   for n in os.listdir(os.path.dirname(handle.export.ticket)))
    with pytest.raises(TransferError, match="is not staged"):
        consumer.fetch(handle)
    producer.close()


def test_release_while_reading_is_refused(monkeypatch):
    producer, consumer = _pair()
    handle = producer.stage("r2", _cache(2)[:, :, :2], [1, 2])
    real_map = CudaIpcTransport._map_cpu

    def map_then_release(h, export):
        mapped = real_map(h, export)
        producer.release(h.transfer_id)     # the lease ends while D copies
        return mapped
    monkeypatch.setattr(CudaIpcTransport, "_map_cpu", staticmethod(map_then_release))
    with pytest.raises(TransferError, match="released while being read"):
        consumer.fetch(handle)


def test_corrupted_staging_fails_the_transport_checksum():
    producer, consumer = _pair(checksum=True)
    handle = producer.stage("r3", _cache(3)[:, :, :2], [1, 2])
    with open(handle.export.ticket, "r+b") as f:   # flip a byte of the staged copy
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(TransferError, match="checksum mismatch"):
        consumer.fetch(handle)
    producer.close()


def test_other_node_is_refused():
    producer = make_transport("cuda_ipc", node_id="node-a")
    consumer = make_transport("cuda_ipc", node_id="node-b")
    handle = producer.stage("r4", _cache(4)[:, :, :1], [1])
    with pytest.raises(TransferError, match="within one node only"):
        consumer.fetch(handle)
    producer.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_clearly():
    with pytest.raises(TransferError, match="sees no GPU"):
        make_transport("cuda_ipc", device="cuda")
    producer, consumer = _pair()
    handle = producer.stage("r5", _cache(5)[:, :, :1], [1])
    fake = SharedPages("cuda", handle.export.ticket, handle.export.pid,
                       gpu_uuid="GPU-00000000")
    from dataclasses import replace
    with pytest.raises(TransferError, match="cannot see"):
        consumer.fetch(replace(handle, export=fake))
    producer.close()


def test_rdt_backend_follows_the_pools_device():
    assert rdt.backend_for_devices(["cuda", "cuda"]) == "nccl"
    assert rdt.backend_for_devices(["cpu", "cpu"]) == "gloo"
    assert rdt.backend_for_devices([]) == "gloo"
    with pytest.raises(ValueError, match="one kind of device"):
        rdt.backend_for_devices(["cpu", "cuda"])


def test_rdt_refuses_nccl_for_two_workers_on_one_gpu_naming_cuda_ipc():
    shared = [rdt.PoolDevice.from_info({"worker_id": "prefill-0", "device": "cuda",
                                        "gpu": "GPU-aaaa"}),
              rdt.PoolDevice.from_info({"worker_id": "decode-0", "device": "cuda",
                                        "gpu": "GPU-aaaa"})]
    with pytest.raises(ValueError, match=r"prefill-0, decode-0.*GPU-aaaa.*'cuda_ipc'"):
        rdt.backend_for_devices(shared)
    own = [shared[0], rdt.PoolDevice("cuda", "GPU-bbbb", "decode-0")]
    assert rdt.backend_for_devices(own) == "nccl"
    assert rdt.backend_for_devices([rdt.PoolDevice("cpu", worker=w) for w in "ab"]) == "gloo"


def test_one_physical_gpu_is_one_gpu_whatever_each_worker_calls_it(monkeypatch):
    """Without a UUID, a GPU is named by its physical index: index 0 under
    CUDA_VISIBLE_DEVICES=5 and index 1 under CUDA_VISIBLE_DEVICES=3,5 are the same GPU."""
    def no_uuid(index):
        raise RuntimeError("no device properties")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_uuid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    p = rdt.pool_device(torch.device("cuda", 0), "prefill-0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    d = rdt.pool_device(torch.device("cuda", 1), "decode-0")
    other = rdt.pool_device(torch.device("cuda", 0), "decode-1")
    assert p.gpu == d.gpu != other.gpu
    with pytest.raises(ValueError, match="cuda_ipc"):
        rdt.backend_for_devices([p, d])
    assert rdt.backend_for_devices([p, other]) == "nccl"
