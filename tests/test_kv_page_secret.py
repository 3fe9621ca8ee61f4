"""The gRPC KV page server answers only holders of its cluster's secret (PDCluster makes one per
cluster and hands it to its actors only): a fetch without it, or with another, is refused and
the server goes on serving the cluster's own consumers."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.base import TransferError
from kvtransfer.grpc_pages import GrpcTransport

SECRET = "cluster-secret-1"


def _pages() -> torch.Tensor:
    return torch.randn(2, 2, 3, 16, 2, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("secret", [None, "another-cluster"])
def test_a_fetch_without_the_cluster_secret_is_refused(secret):
    producer = GrpcTransport(host="127.0.0.1", secret=SECRET)
    stranger = GrpcTransport(timeout_s=10, secret=secret)
    member = GrpcTransport(timeout_s=10, secret=SECRET)
    try:
        data = _pages()
        handle = producer.stage("req", data, list(range(data.shape[2])))
        with pytest.raises(TransferError, match="PERMISSION_DENIED.*cluster secret"):
            stranger.fetch(handle)
        assert torch.equal(member.fetch(handle), data)
    finally:
        for t in (producer, stranger, member):
            t.close()
