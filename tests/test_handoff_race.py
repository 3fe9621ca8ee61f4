"""The abort-during-pull race, made deterministic with a transport that blocks mid-pull.

Before the fix, DecodeHost picked the destination blocks under the engine lock and pulled into
them outside it: an abort meanwhile freed the blocks, the next request got them, and the stale
pull still wrote into them. Now a pull goes into a private buffer and lands only while its
reservation still owns the blocks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import random_prompt

from kvtransfer.base import KVTransport, TransferHandle, dtype_name
from protocol.errors import TransferRejected
from protocol.messages import PrefillResult, RequestInput
from workers.decode_host import DecodeHost
from workers.kv_handoff import page_checksums
from workers.request import SamplingParams


class BlockingTransport(KVTransport):
    """Hands out pages of 7s, but only once `go` is set; `started` says a pull is under way."""

    name = "blocking"

    def __init__(self) -> None:
        super().__init__(worker_id="test", node_id="test")
        self.started, self.go = threading.Event(), threading.Event()

    def _stage(self, handle, pages):
        raise NotImplementedError

    def fetch(self, handle: TransferHandle) -> torch.Tensor:
        self.started.set()
        assert self.go.wait(30)
        return _pages(handle.shape, handle.dtype)

    def fetch_into(self, handle, kv_cache, dest_block_ids) -> None:   # the old code's path
        from kvtransfer.base import scatter_blocks
        scatter_blocks(kv_cache, dest_block_ids, self.fetch(handle))


def _pages(shape, dtype: str) -> torch.Tensor:
    return torch.full(tuple(shape), 7.0, dtype=getattr(torch, dtype))


@pytest.fixture()
def host():
    # three blocks: exactly one 40-token request, so the next request gets the same blocks
    h = DecodeHost("decode-race", dict(model="tiny", num_blocks=3, block_size=16))
    h.consumer._transports["blocking"] = h.transport = BlockingTransport()
    yield h
    h.shutdown()


def _request(rid: str, seed: int) -> RequestInput:
    return RequestInput(rid, tuple(random_prompt(40, seed)), SamplingParams(max_tokens=4),
                        time.time() + 60)


def test_abort_during_pull_never_writes_into_reused_blocks(host):
    kv = host.engine.runner.kv_cache
    adm = host.admit(_request("a", 1))
    plan = adm.plan
    shape = (kv.shape[0], 2, plan.num_blocks, *kv.shape[3:])
    handle = TransferHandle("t-a", "a", "blocking", "p", "n", plan.block_hashes, shape,
                            dtype_name(kv.dtype), kv.element_size() * kv[:, :, :3].numel())
    result = PrefillResult("a", 0, plan.digest, 5, handle,
                           page_checksums(_pages(shape, dtype_name(kv.dtype))),
                           time.time(), 60.0, "prefill-x")
    outcome: list = []

    def pull() -> None:
        try:
            host.land("a", 0, result)
            outcome.append("landed")
        except Exception as e:
            outcome.append(e)

    t = threading.Thread(target=pull)
    t.start()
    assert host.transport.started.wait(30)          # the pull is in flight ...
    assert host.abort("a")                          # ... when the client aborts
    b = host.admit(_request("b", 2))                # b takes the freed blocks at once
    assert b.admitted
    blocks_b = host.engine.kv.block_table("b")
    assert set(blocks_b) & set(plan.dest_block_ids)
    before = kv[:, :, blocks_b].clone()
    host.transport.go.set()                         # the stale pull completes now
    t.join(30)
    assert torch.equal(kv[:, :, blocks_b], before), "a's stale pages landed in b's blocks"
    [err] = outcome
    assert isinstance(err, TransferRejected) and err.reason == "late"
    assert host.stats()["rejected_late"] == 1
    assert [h.request_id for h in host.ledger.open_holds()] == ["b"]
    assert host.ledger.released["aborted"] == 1
    host.check_invariants()
