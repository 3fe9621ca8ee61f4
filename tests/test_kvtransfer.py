"""KV transfer: every transport moves pages bit-exactly between two Ray actors; leases release
each transfer exactly once; the producer/consumer ends keep their books."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import ray
import torch
from ray import cloudpickle

from kvtransfer import rdt
from kvtransfer.base import TRANSPORT_NAMES, TransferError, make_transport
from kvtransfer.endpoint import KVConsumer, KVProducer
from kvtransfer.lease import LeaseTable

SHAPE = (3, 2, 12, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
SRC_BLOCKS = [7, 2, 5]
DEST_BLOCKS = [0, 1, 9]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Ray workers cannot import this test module: ship its actor classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_kv_cache(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=generator).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@ray.remote(enable_tensor_transport=True)
class Prefill:
    def __init__(self):
        self.producers = {name: KVProducer(name, lease_s=60) for name in TRANSPORT_NAMES}
        self.released: list[tuple[str, str]] = []

    def offer(self, transport: str, dtype: str, seed: int):
        kv_cache = make_kv_cache(DTYPES[dtype], seed)
        return self.producers[transport].offer_blocks(
            f"req-{seed}",
            kv_cache,
            SRC_BLOCKS,
            [101, 102, 103],
            on_release=lambda tid, reason: self.released.append((tid, reason)),
        )

    def ack(self, transport: str, transfer_id: str):
        return self.producers[transport].ack(transfer_id)

    def kv_send(self, transfer_id: str):
        return rdt.send_pages(self.producers["rdt"], transfer_id)

    def close(self):
        for producer in self.producers.values():
            producer.close()

    def state(self, transport: str):
        producer = self.producers[transport]
        return producer.stats(), producer.transport.staged_ids(), list(self.released)


@ray.remote(enable_tensor_transport=True)
class Decode:
    def __init__(self):
        self.consumer = KVConsumer()

    def pull_into(self, handle):
        kv_cache = torch.zeros(SHAPE, dtype=getattr(torch, handle.dtype))
        result = self.consumer.pull_into(handle, kv_cache, DEST_BLOCKS)
        return kv_cache[:, :, DEST_BLOCKS].clone(), result

    def pull(self, handle):
        pages, result = self.consumer.pull(handle)
        return pages.clone(), result

    def kv_recv(self, handle, pages, dest_block_ids, sent_at=None):
        kv_cache = torch.zeros(SHAPE, dtype=pages.dtype)
        result = rdt.receive_pages(
            self.consumer, handle, pages, kv_cache, dest_block_ids, sent_at=sent_at
        )
        return kv_cache[:, :, dest_block_ids].clone(), result


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    yield


@pytest.fixture(scope="module")
def actors(ray_cluster):
    prefill, decode = Prefill.remote(), Decode.remote()
    group = rdt.ensure_group([prefill, decode], backend="gloo")
    yield prefill, decode
    from ray.experimental.collective import destroy_collective_group

    destroy_collective_group(group)
    ray.get(prefill.close.remote())
    ray.kill(prefill)
    ray.kill(decode)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("transport", ["object_store", "shm", "grpc", "cuda_ipc"])
def test_pull_transport_moves_pages_bit_exactly_between_actors(actors, transport, dtype):
    prefill, decode = actors
    # one pull a staging (cuda_ipc refuses a second: one receive per CUDA IPC send)
    handle, again = (ray.get(prefill.offer.remote(transport, dtype, 1)) for _ in range(2))
    expected = make_kv_cache(DTYPES[dtype], 1)[:, :, SRC_BLOCKS]

    scattered, result = ray.get(decode.pull_into.remote(handle))
    pulled, _ = ray.get(decode.pull.remote(again))
    assert same_bits(scattered, expected)
    assert same_bits(pulled, expected)
    assert result.nbytes == handle.nbytes == expected.numel() * expected.element_size()
    assert result.seconds > 0

    for h in (handle, again):
        assert ray.get(prefill.ack.remote(transport, h.transfer_id))
    stats, staged, released = ray.get(prefill.state.remote(transport))
    assert stats.active == 0 and staged == []
    assert {(handle.transfer_id, "acked"), (again.transfer_id, "acked")} <= set(released)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rdt_moves_pages_bit_exactly_between_actors(actors, dtype):
    prefill, decode = actors
    handle = ray.get(prefill.offer.remote("rdt", dtype, 2))
    expected = make_kv_cache(DTYPES[dtype], 2)[:, :, SRC_BLOCKS]

    scattered, result = ray.get(rdt.route(prefill, decode, handle, DEST_BLOCKS), timeout=60)
    assert same_bits(scattered, expected)
    assert result.transport == "rdt" and result.nbytes == handle.nbytes

    assert ray.get(prefill.ack.remote("rdt", handle.transfer_id))
    stats, staged, _ = ray.get(prefill.state.remote("rdt"))
    assert stats.active == 0 and staged == []


def test_unknown_transport_name_lists_valid_names():
    with pytest.raises(ValueError, match="grpc, object_store, rdt, shm"):
        make_transport("carrier_pigeon")


def test_shm_fetch_on_another_node_says_to_use_another_transport():
    producer = KVProducer("shm")
    handle = producer.offer("r", make_kv_cache(torch.float32)[:, :, :2], [1, 2])
    try:
        elsewhere = dataclasses.replace(handle, node_id="some-other-node")
        with pytest.raises(TransferError, match="'grpc' or 'object_store'"):
            KVConsumer("shm").pull(elsewhere)
    finally:
        producer.close()


def test_released_shm_transfer_is_a_transfer_error():
    producer = KVProducer("shm")
    handle = producer.offer("r", make_kv_cache(torch.float32)[:, :, :2], [1, 2])
    producer.abort(handle.transfer_id)
    with pytest.raises(TransferError, match="released, expired or never staged"):
        KVConsumer("shm").pull(handle)
    producer.close()


def test_rdt_take_after_ack_is_a_transfer_error():
    producer = KVProducer("rdt")
    handle = producer.offer("r", make_kv_cache(torch.float32)[:, :, :2], [1, 2])
    assert same_bits(producer.take(handle.transfer_id), make_kv_cache(torch.float32)[:, :, :2])
    producer.ack(handle.transfer_id)
    with pytest.raises(TransferError, match="no lease"):
        producer.take(handle.transfer_id)


def test_stage_rejects_hash_count_mismatch_and_oversize():
    transport = make_transport("shm", max_total_bytes=1024)
    pages = make_kv_cache(torch.float32)[:, :, :2]
    with pytest.raises(TransferError, match="block hashes"):
        transport.stage("r", pages, [1])
    with pytest.raises(TransferError, match="max_total_bytes=1024"):
        transport.stage("r", pages, [1, 2])
    assert transport.staged_ids() == []


# -- leases -----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def recorder():
    calls: list[tuple[str, str]] = []
    return calls, lambda tid, reason: calls.append((tid, reason))


def test_ack_releases_once_and_double_ack_is_harmless():
    calls, on_release = recorder()
    table = LeaseTable(30, on_release=on_release)
    table.pin("t1")
    assert table.ack("t1") is True
    assert table.ack("t1") is False
    assert calls == [("t1", "acked")] and table.acked_total == 1 and len(table) == 0


def test_lease_expires_after_lease_time_on_injected_clock():
    clock = FakeClock()
    calls, on_release = recorder()
    table = LeaseTable(30, clock=clock)
    table.pin("t1", on_release)
    table.pin("t2", on_release, lease_s=60)
    clock.now += 29.9
    assert table.expire() == [] and calls == []
    clock.now += 0.1
    assert table.expire() == ["t1"]
    assert calls == [("t1", "expired")] and table.expired_total == 1
    assert table.ack("t1") is False  # a late ack after expiry changes nothing
    assert table.expire(now=clock.now + 30) == ["t2"] and table.expired_total == 2


def test_abort_releases_with_reason_aborted():
    calls, on_release = recorder()
    table = LeaseTable(30)
    table.pin("t1", on_release)
    assert table.abort("t1") is True and table.abort("t1") is False
    assert calls == [("t1", "aborted")] and table.aborted_total == 1


def test_failing_callback_does_not_stop_other_releases():
    clock = FakeClock()
    calls, on_release = recorder()

    def broken(tid, reason):
        raise OSError("unpin failed")

    table = LeaseTable(1, clock=clock)
    table.pin("a", broken)
    table.pin("b", on_release)
    clock.now += 5
    with pytest.raises(OSError):
        table.expire()
    assert calls == [("b", "expired")] and len(table) == 0 and table.expired_total == 2


def test_producer_expiry_releases_staging_and_calls_back():
    clock = FakeClock()
    calls, on_release = recorder()
    producer = KVProducer("shm", lease_s=10, clock=clock)
    handle = producer.offer("r", make_kv_cache(torch.float32)[:, :, :2], [1, 2], on_release)
    assert handle.lease_s == 10 and producer.transport.staged_ids() == [handle.transfer_id]
    clock.now += 11
    assert producer.expire() == [handle.transfer_id]
    assert calls == [(handle.transfer_id, "expired")]
    assert producer.transport.staged_ids() == []
    stats = producer.stats()
    assert (stats.offered, stats.expired, stats.active) == (1, 1, 0)
    assert stats.bytes_staged == handle.nbytes
    with pytest.raises(TransferError):
        KVConsumer("shm").pull(handle)
    producer.close()


# -- shm segment reuse --------------------------------------------------------------------------


def test_shm_reuses_a_released_segment_and_refuses_the_late_reader():
    producer, consumer = make_transport("shm"), make_transport("shm")
    try:
        kv_cache = make_kv_cache(torch.bfloat16, seed=3)
        first = producer.stage_blocks("r1", kv_cache, [0, 1, 2], [1, 2, 3])
        producer.release(first.transfer_id)
        second = producer.stage_blocks("r2", kv_cache, [9, 4, 6], [4, 5, 6])
        with pytest.raises(TransferError, match="released, expired or never staged"):
            consumer.fetch(first)
        dest = torch.zeros_like(kv_cache)
        consumer.fetch_into(second, dest, [3, 4, 8])
        assert same_bits(dest[:, :, [3, 4, 8]], kv_cache[:, :, [9, 4, 6]])
        assert same_bits(consumer.fetch(second), kv_cache[:, :, [9, 4, 6]])
    finally:
        producer.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_shm_contiguous_blocks_round_trip(checksum):
    producer, consumer = make_transport("shm", checksum=checksum), make_transport("shm")
    try:
        kv_cache = make_kv_cache(torch.float32, seed=4)
        handle = producer.stage_blocks("r", kv_cache, [4, 5, 6, 7], [1, 2, 3, 4])
        assert (handle.checksum is not None) == checksum
        dest = torch.zeros_like(kv_cache)
        consumer.fetch_into(handle, dest, [8, 9, 10, 11])
        assert same_bits(dest[:, :, 8:12], kv_cache[:, :, 4:8])
        assert dest[:, :, :8].abs().sum() == 0
    finally:
        producer.close()
