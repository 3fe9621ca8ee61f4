"""Page checksums of the handoff: crc32 for CPU pages (as before); GPU pages get wsum64, computed
on the device and tagged, and the decode worker verifies with whichever algorithm the prefill
worker used, so pages checked on a GPU land on any device and a corrupt one is still refused."""

from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch
from conftest import random_prompt

from kvtransfer.base import TransferHandle, dtype_name
from protocol.errors import TransferRejected
from protocol.messages import PrefillResult, RequestInput
from workers.decode_host import DecodeHost
from workers.kv_handoff import WSUM_TAG, checksum_algo, page_checksums
from workers.request import SamplingParams


def test_wsum64_changes_with_any_flipped_byte_and_crc32_stays_the_default():
    pages = torch.randn(2, 2, 3, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    sums = page_checksums(pages, "wsum64")
    assert checksum_algo(sums) == "wsum64" and all(s & WSUM_TAG for s in sums)
    assert sums[1] == page_checksums(pages[:, :, 1:2].contiguous(), "wsum64")[0]
    flat = pages.view(torch.uint8).view(-1)
    for pos in (0, 777, flat.numel() - 1):
        bad = pages.clone()
        bad.view(torch.uint8).view(-1)[pos] ^= 0x10
        assert page_checksums(bad, "wsum64") != sums
    crc = page_checksums(pages)                       # CPU pages: crc32, as before
    assert checksum_algo(crc) == "crc32"
    assert crc[0] == zlib.crc32(pages[:, :, 0].contiguous().view(torch.uint8).numpy())


@pytest.fixture()
def host():
    h = DecodeHost("decode-sums", dict(model="tiny", num_blocks=16, block_size=16))
    yield h
    h.shutdown()


@pytest.mark.parametrize("corrupt", [False, True])
def test_decode_verifies_with_the_prefill_workers_algorithm(host, corrupt):
    kv = host.engine.runner.kv_cache
    rid = f"r{int(corrupt)}"
    adm = host.admit(RequestInput(rid, tuple(random_prompt(40, 3)),
                                  SamplingParams(max_tokens=2), time.time() + 60))
    plan = adm.plan
    shape = (kv.shape[0], 2, plan.num_blocks, *kv.shape[3:])
    pages = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(kv.dtype)
    sums = page_checksums(pages, "wsum64")           # as a prefill worker on a GPU makes them
    if corrupt:
        pages.view(torch.uint8).view(-1)[5] ^= 0xFF
    handle = TransferHandle("t", rid, "rdt", "p", "n", plan.block_hashes, shape,
                            dtype_name(kv.dtype), pages.nbytes)
    result = PrefillResult(rid, 0, plan.digest, 5, handle, sums, time.time(), 60.0, "p0")
    if corrupt:
        with pytest.raises(TransferRejected) as err:
            host.land(rid, 0, result, pages=pages)
        assert err.value.reason == "corrupt"
    else:
        host.land(rid, 0, result, pages=pages)
        full = list(plan.dest_block_ids)[:40 // 16]    # decoding may write the partial block
        assert torch.equal(kv[:, :, full], pages[:, :, :len(full)])


# ---- one checksum pass a side, D's outside its engine lock -----------------------------------

def _count_page_checksums(monkeypatch) -> list[str]:
    """Wrap workers.kv_handoff.page_checksums: the returned list gets one entry a call."""
    import workers.kv_handoff as kv_handoff
    calls: list[str] = []
    real = kv_handoff.page_checksums

    def counted(pages, algo=None):
        calls.append(algo or "default")
        return real(pages, algo)
    monkeypatch.setattr(kv_handoff, "page_checksums", counted)
    return calls


def test_a_grpc_handoff_checksums_the_pages_once_on_each_side(monkeypatch):
    """P checksums each page once when staging and D verifies each once when landing; the
    transport adds no checksum pass of its own (grpc's default is on: the handoff turns it
    off, its page checksums being end to end)."""
    import kvtransfer.base as base
    import kvtransfer.grpc_pages as grpc_pages
    from workers.prefill_host import PrefillHost

    sums = _count_page_checksums(monkeypatch)
    transport_crcs: list[int] = []

    def counted_crc(buf, value=0):
        transport_crcs.append(1)
        return zlib.crc32(buf, value)
    monkeypatch.setattr(base, "crc32", counted_crc)
    monkeypatch.setattr(grpc_pages, "crc32", counted_crc)
    cfg = dict(model="tiny", num_blocks=16, block_size=16)
    p = PrefillHost("prefill-once", cfg, transport="grpc")
    d = DecodeHost("decode-once", cfg, transport="grpc")
    try:
        adm = d.admit(RequestInput("r", tuple(random_prompt(40, 5)),
                                   SamplingParams(max_tokens=2), time.time() + 60))
        result = p.prefill(adm.request, adm.plan)
        assert len(sums) == 1                       # P, staging
        d.land("r", adm.request.epoch, result)
        assert len(sums) == 2                       # D, verifying
        assert result.handle.checksum is None and transport_crcs == []
        assert d.handoff.rejected == {}
    finally:
        p.shutdown()
        d.shutdown()


def _rdt_result(host, rid: str, corrupt: bool) -> tuple[PrefillResult, torch.Tensor]:
    """Admit `rid` on `host`; the PrefillResult and pages a prefill worker would send it."""
    kv = host.engine.runner.kv_cache
    adm = host.admit(RequestInput(rid, tuple(random_prompt(40, 3)),
                                  SamplingParams(max_tokens=2), time.time() + 60))
    plan = adm.plan
    shape = (kv.shape[0], 2, plan.num_blocks, *kv.shape[3:])
    pages = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(kv.dtype)
    sums = page_checksums(pages)
    if corrupt:
        pages.view(torch.uint8).view(-1)[5] ^= 0xFF
    handle = TransferHandle("t", rid, "rdt", "p", "n", plan.block_hashes, shape,
                            dtype_name(kv.dtype), pages.nbytes)
    return PrefillResult(rid, 0, plan.digest, 5, handle, sums, time.time(), 60.0, "p0"), pages


@pytest.mark.parametrize("corrupt", [False, True])
def test_decode_verifies_pages_without_holding_its_engine_lock(host, monkeypatch, corrupt):
    """While D computes the page checksums, another thread can take D's engine lock (the
    loop keeps stepping other requests); corrupt pages are still refused and nothing lands."""
    import workers.kv_handoff as kv_handoff
    result, pages = _rdt_result(host, f"v{int(corrupt)}", corrupt)
    real = kv_handoff.page_checksums
    want, got = threading.Event(), threading.Event()
    lock_free_while_verifying: list[bool] = []

    def take_the_lock() -> None:
        want.wait(30)
        with host._lock:
            got.set()
    taker = threading.Thread(target=take_the_lock, daemon=True)
    taker.start()

    def verifying(p, algo=None):
        want.set()
        lock_free_while_verifying.append(got.wait(10))   # fails only on a lock held here
        return real(p, algo)
    monkeypatch.setattr(kv_handoff, "page_checksums", verifying)
    kv = host.engine.runner.kv_cache
    before = kv.clone()
    if corrupt:
        with pytest.raises(TransferRejected) as err:
            host.land(result.request_id, 0, result, pages=pages)
        assert err.value.reason == "corrupt"
        assert torch.equal(kv, before)                       # nothing was written
        assert host.handoff.reservations[result.request_id].state.value == "reserved"
    else:
        host.land(result.request_id, 0, result, pages=pages)
    taker.join(30)
    assert lock_free_while_verifying == [True]               # verified once, lock free
