"""Transfer benchmark: single-thread memcpy GB/s and each transport's GB/s per payload size,
between a producer and a consumer actor on this node, in one run.

What is timed (GB = 1e9 bytes of page payload, median over repeats, one warm-up dropped):
  transports   fetch start to data in the consumer's destination kv_cache (``pull_into``,
               measured inside the consumer). rdt has no separate fetch: it is timed in the
               driver from ``route`` to the consumer's scatter being done, so it also pays two
               actor calls (~1 ms, visible at small sizes).
  end_to_end   what the decode waits for after prefill: the producer's ``offer_blocks``
               (gather out of its kv_cache + stage) plus the above.
  memcpy_gbps  torch ``copy_`` of a float32 tensor, one thread, in the consumer actor.
Both actors run torch with one thread, like the memcpy baseline.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import ray
import torch

from kvtransfer import rdt
from kvtransfer.base import TRANSPORT_NAMES
from kvtransfer.endpoint import KVConsumer, KVProducer

MIB = 1 << 20
BLOCK_SHAPE = (8, 2, 16, 8, 64)  # num_layers, 2, block_size, num_kv_heads, head_dim
BLOCK_BYTES = 8 * 2 * 16 * 8 * 64 * 4  # float32: 512 KiB per block over all layers
ORDER = ("shm", "object_store", "grpc", "rdt")  # rdt last: an RDT timeout kills both actors


def _cache(num_blocks: int, fill: bool) -> torch.Tensor:
    layers, two, block_size, heads, head_dim = BLOCK_SHAPE
    shape = (layers, two, num_blocks, block_size, heads, head_dim)
    if fill:
        return torch.randn(shape, generator=torch.Generator().manual_seed(num_blocks))
    return torch.zeros(shape)  # zeros touches every page, so no first-touch faults when timed


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class _BenchProducer:
    def __init__(self):
        torch.set_num_threads(1)
        self.producers = {name: KVProducer(name, lease_s=300) for name in TRANSPORT_NAMES}
        self.caches: dict[int, torch.Tensor] = {}

    def prepare(self, num_blocks: int) -> None:
        self.caches[num_blocks] = _cache(num_blocks, fill=True)

    def offer(self, name: str, num_blocks: int):
        start = time.perf_counter()
        handle = self.producers[name].offer_blocks(
            "bench", self.caches[num_blocks], range(num_blocks), range(num_blocks)
        )
        return handle, time.perf_counter() - start

    def ack(self, name: str, transfer_id: str) -> None:
        self.producers[name].ack(transfer_id)

    def kv_send(self, transfer_id: str) -> torch.Tensor:
        return rdt.send_pages(self.producers["rdt"], transfer_id)

    def close(self) -> None:
        for producer in self.producers.values():
            producer.close()


@ray.remote(enable_tensor_transport=True, num_cpus=0)
class _BenchConsumer:
    def __init__(self):
        torch.set_num_threads(1)
        self.consumer = KVConsumer()
        self.caches: dict[int, torch.Tensor] = {}

    def prepare(self, num_blocks: int) -> None:
        self.caches[num_blocks] = _cache(num_blocks, fill=False)

    def pull(self, handle) -> float:
        kv_cache = self.caches[handle.num_blocks]
        return self.consumer.pull_into(handle, kv_cache, range(handle.num_blocks)).seconds

    def kv_recv(self, handle, pages, dest_block_ids, sent_at=None):
        kv_cache = self.caches[handle.num_blocks]
        return rdt.receive_pages(self.consumer, handle, pages, kv_cache, dest_block_ids)

    def memcpy_gbps(self, mib: int, repeats: int) -> float:
        src = torch.randn(mib * MIB // 4)
        dst = torch.zeros_like(src)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return src.numel() * 4 / statistics.median(times[1:]) / 1e9

    def close(self) -> None:
        self.consumer.close()


def _measure(producer, consumer, name: str, num_blocks: int, repeats: int):
    """Median (fetch seconds, end-to-end seconds) over ``repeats`` after one warm-up."""
    fetch_times, total_times = [], []
    for _ in range(repeats + 1):
        handle, stage_s = ray.get(producer.offer.remote(name, num_blocks))
        if name == "rdt":
            start = time.perf_counter()
            ray.get(rdt.route(producer, consumer, handle, range(num_blocks)), timeout=120)
            fetch_s = time.perf_counter() - start
        else:
            fetch_s = ray.get(consumer.pull.remote(handle), timeout=120)
        ray.get(producer.ack.remote(name, handle.transfer_id))
        fetch_times.append(fetch_s)
        total_times.append(stage_s + fetch_s)
    return statistics.median(fetch_times[1:]), statistics.median(total_times[1:])


def run_transfer_bench(
    sizes_mib: tuple[int, ...] = (1, 4, 16, 64, 256),
    quick: bool = False,
    transports: tuple[str, ...] = ORDER,
) -> dict[str, Any]:
    """Measure memcpy and every transport between two actors on this node; see module doc.

    Returns ``{"memcpy_gbps", "transports": {name: {str(mib): gbps}}, "end_to_end": {...},
    "best_same_node_ratio", "best_transport", "errors", ...}``; the ratio is the best
    ``transports`` GB/s at 64 MiB (or the largest size) over memcpy GB/s.
    """
    if quick:
        sizes_mib, repeats = (1, 16, 64), 3
    else:
        repeats = 5
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False)
    producer, consumer = _BenchProducer.remote(), _BenchConsumer.remote()
    group = None
    result: dict[str, Any] = {
        "memcpy_gbps": 0.0,
        "transports": {},
        "end_to_end": {},
        "errors": {},
        "sizes_mib": list(sizes_mib),
        "repeats": repeats,
        "dtype": "float32",
        "timing": "transports: fetch start -> data in destination kv_cache (rdt: route -> "
        "scattered, from the driver); end_to_end: + producer gather and stage",
    }
    try:
        blocks = {mib: max(1, mib * MIB // BLOCK_BYTES) for mib in sizes_mib}
        ray.get([a.prepare.remote(n) for n in blocks.values() for a in (producer, consumer)])
        result["memcpy_gbps"] = ray.get(consumer.memcpy_gbps.remote(64, repeats))
        if "rdt" in transports:
            group = rdt.ensure_group([producer, consumer], backend="gloo")
        for name in transports:
            try:
                for mib, num_blocks in blocks.items():
                    fetch_s, total_s = _measure(producer, consumer, name, num_blocks, repeats)
                    nbytes = num_blocks * BLOCK_BYTES
                    result["transports"].setdefault(name, {})[str(mib)] = nbytes / fetch_s / 1e9
                    result["end_to_end"].setdefault(name, {})[str(mib)] = nbytes / total_s / 1e9
            except Exception as exc:  # one broken transport must not hide the others
                result["errors"][name] = f"{type(exc).__name__}: {exc}"
        ref_size = "64" if 64 in sizes_mib else str(max(sizes_mib))
        for key, ratio_key in (("transports", ""), ("end_to_end", "_end_to_end")):
            best = max(result[key].items(), key=lambda kv: kv[1].get(ref_size, 0.0), default=None)
            gbps = best[1].get(ref_size, 0.0) if best else 0.0
            result[f"best_same_node_ratio{ratio_key}"] = gbps / result["memcpy_gbps"]
            result[f"best_transport{ratio_key}"] = best[0] if best else None
    finally:
        try:
            if group is not None:
                from ray.experimental.collective import destroy_collective_group

                destroy_collective_group(group)
            ray.get([producer.close.remote(), consumer.close.remote()], timeout=30)
        except Exception:
            pass
        ray.kill(producer)
        ray.kill(consumer)
        if started:
            ray.shutdown()
    return result


if __name__ == "__main__":  # a quick look without the CLI: python -m raypd.bench.transport_bandwidth
    import json

    print(json.dumps(run_transfer_bench(quick=True), indent=2))
