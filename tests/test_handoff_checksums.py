"""Page checksums of the handoff: crc32 for CPU pages (as before); GPU pages get wsum64, computed
on the device and tagged, and the decode worker verifies with whichever algorithm the prefill
worker used, so pages checked on a GPU land on any device and a corrupt one is still refused."""

from __future__ import annotations

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
