"""gRPC page service failure modes: each bad transfer is a clear TransferError, and the same
server keeps serving good transfers afterwards. Producer and consumer run in this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer.base import TransferError
from kvtransfer.grpc_pages import GrpcTransport

MIB = 1 << 20


@pytest.fixture
def producer():
    transport = GrpcTransport(host="127.0.0.1", chunk_bytes=2 * MIB)
    yield transport
    transport.close()


@pytest.fixture
def consumer():
    transport = GrpcTransport(timeout_s=10)
    yield transport
    transport.close()


def pages(nbytes: int = 3 * MIB, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n = nbytes // (4 * 2 * 16 * 4 * 32 * torch.finfo(dtype).bits // 8)
    return torch.randn(4, 2, n, 16, 4, 32, generator=torch.Generator().manual_seed(n)).to(dtype)


def stage(transport: GrpcTransport, data: torch.Tensor):
    return transport.stage("req", data, list(range(data.shape[2])))


def assert_good_transfer_works(producer: GrpcTransport, consumer: GrpcTransport):
    data = pages()
    got = consumer.fetch(stage(producer, data))
    assert got.dtype == data.dtype and torch.equal(got.view(-1), data.view(-1))


def test_corrupt_pages_fail_the_checksum_and_the_server_keeps_serving(producer, consumer):
    handle = stage(producer, pages())
    producer.take(handle.transfer_id).view(-1).view(torch.uint8)[12345] ^= 0xFF  # flip bits
    with pytest.raises(TransferError, match="checksum mismatch"):
        consumer.fetch(handle)
    assert_good_transfer_works(producer, consumer)


def test_frame_over_max_frame_bytes_is_refused_and_the_server_keeps_serving(producer):
    strict = GrpcTransport(max_frame_bytes=1 * MIB, timeout_s=10)
    try:
        with pytest.raises(TransferError, match="max_frame_bytes=1048576"):
            strict.fetch(stage(producer, pages()))
    finally:
        strict.close()
    consumer = GrpcTransport(timeout_s=10)
    try:
        assert_good_transfer_works(producer, consumer)
    finally:
        consumer.close()


def test_transfer_over_max_total_bytes_is_refused(producer):
    small = GrpcTransport(max_total_bytes=1 * MIB)
    with pytest.raises(TransferError, match="exceeds max_total_bytes=1048576"):
        small.fetch(stage(producer, pages()))


def test_header_that_disagrees_with_the_handle_is_refused(producer, consumer):
    handle = stage(producer, pages())
    with pytest.raises(TransferError, match="nbytes"):
        consumer.fetch(dataclasses.replace(handle, nbytes=handle.nbytes - 2))


def test_unknown_transfer_id_is_a_transfer_error(producer, consumer):
    handle = stage(producer, pages(MIB // 4))
    with pytest.raises(TransferError, match="not found"):
        consumer.fetch(dataclasses.replace(handle, transfer_id="no-such-transfer"))
    producer.release(handle.transfer_id)
    with pytest.raises(TransferError, match="released, expired or never staged"):
        consumer.fetch(handle)


def test_unreachable_producer_is_a_transfer_error(consumer):
    gone = GrpcTransport(host="127.0.0.1")
    handle = stage(gone, pages(MIB // 4))
    gone.close()
    quick = GrpcTransport(timeout_s=3)
    try:
        with pytest.raises(TransferError, match=handle.address):
            quick.fetch(handle)
    finally:
        quick.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_frame_transfer_is_bit_exact(producer, consumer, dtype):
    data = pages(5 * MIB, dtype)  # 2 + 2 + 1 MiB frames
    handle = stage(producer, data)
    assert handle.checksum is not None and handle.address == producer.address
    got = consumer.fetch(handle)
    assert torch.equal(got.view(-1), data.view(-1))
