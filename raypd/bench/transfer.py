"""`raypd bench transfer`: KV transport GB/s next to memcpy, and what a transfer costs a real
P/D request (its share of TTFT, and the bytes a decode-side prefix hit saves).

Three parts, one run:
  bandwidth  `raypd.bench.transport_bandwidth.run_transfer_bench`: single-thread memcpy and every transport
             between two actors on this node, per payload size (its keys are kept as they are).
  ttft share a 1 prefill + 1 decode PDCluster per transport runs one warm-up prompt, then a
             fresh prompt of `ttft_prompt_tokens` random token ids (max_tokens=1); share =
             lifecycle transfer_s / ttft_s, both measured on the decode worker (ttft_s runs from
             its admission to the first token, so it holds P's prefill, the transfer and the
             actor calls between them).
  delta      on the best transport's cluster: prompt X[:half] first (half block aligned), then
             P's prefix cache is dropped and X itself is sent: P computes all of X, but D already
             holds the first half, so only the rest travels. Saved = 1 - bytes sent / bytes of
             X's whole KV (blocks x block_size x kv_bytes_per_token).

`--device cuda` (`run_gpu_transfer_bench`): the same questions on one node's GPUs, with pages
of `--model`'s shape (default random:llama3-8b, bf16): cuda_ipc between two actors holding half
a GPU each (the same GPU when there is one) against a device-to-device `copy_` of the same
bytes in the consumer, and the transfer's share of TTFT of a `--ttft-prompt-tokens` (4,096)
prompt on a 1 prefill + 1 decode cluster on that GPU over cuda_ipc.
"""

from __future__ import annotations

import math
import os
import random
import statistics
from typing import Any

import ray

from cluster.pd import PDCluster, PDConfig
from kvcache.manager import cdiv
from raypd.bench.transport_bandwidth import run_transfer_bench
from router.orchestrator import FlowConfig
from workers.request import SamplingParams

TTFT_TRANSPORTS = ("shm", "object_store", "grpc", "rdt")   # the first that works is the fallback
FULL_SIZES_MIB = (1, 4, 16, 64, 256)
QUICK_SIZES_MIB = (1, 16, 64)
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """Random token ids in [3, 256): valid in every supported vocabulary (tiny has 259);
    compute and KV size do not depend on which ids they are."""
    return [rng.randrange(3, 256) for _ in range(n)]


def _ttft_share(cluster: PDCluster, prompt: list[int], warmup: list[int]) -> dict[str, Any]:
    """One warm-up request (first-touch costs: staging files, allocator), then the measured one.
    Besides the pull (`transfer_s`), what TTFT holds beyond P's model steps (its `busy_s`) is
    reported: staging on P + pull + actor calls + waits, an upper bound for the transfer."""
    cluster.run_request(warmup, ONE_TOKEN)
    busy_before = ray.get(cluster.prefill[0].stats.remote())["busy_s"]
    lc = cluster.run_request(prompt, ONE_TOKEN).lifecycle.to_dict()
    compute_s = ray.get(cluster.prefill[0].stats.remote())["busy_s"] - busy_before
    ttft, pull = lc["ttft_s"], lc["transfer_s"]
    return {"transfer_s": pull, "ttft_s": ttft, "share": pull / ttft,
            "prefill_compute_s": compute_s, "non_compute_share": (ttft - compute_s) / ttft,
            "transfer_bytes": lc["transfer_bytes"],
            "transfer_gbps": lc["transfer_bytes"] / max(pull, 1e-12) / 1e9}


def _delta_saving(cluster: PDCluster, prompt: list[int]) -> dict[str, Any]:
    """D holds the prompt's first half (block aligned); P holds nothing; send the whole prompt."""
    info = cluster.info[-1]                       # the decode worker
    bs, per_token = info["block_size"], info["kv_bytes_per_token"]
    half = len(prompt) // 2 // bs * bs
    cluster.run_request(prompt[:half], ONE_TOKEN)
    ray.get([p.reset_prefix_cache.remote() for p in cluster.prefill])
    lc = cluster.run_request(prompt, ONE_TOKEN).lifecycle.to_dict()
    blocks = cdiv(len(prompt), bs)
    full_bytes = blocks * bs * per_token
    return {"delta_bytes_saved_ratio": 1 - lc["transfer_bytes"] / full_bytes,
            "delta_prompt_tokens": len(prompt), "delta_held_tokens": half,
            "delta_skipped_blocks": lc["skipped_blocks"],
            "delta_transferred_blocks": lc["transferred_blocks"],
            "delta_transfer_bytes": lc["transfer_bytes"], "delta_full_bytes": full_bytes,
            "delta_prefill_computed_tokens": lc["computed_tokens"]}


def run_bench_transfer(quick: bool = False, model: str = "smollm2",
                       sizes_mib: tuple[int, ...] | None = None,
                       ttft_prompt_tokens: int = 2048,
                       ttft_transports: tuple[str, ...] | None = None,
                       engine: dict | None = None, seed: int = 0,
                       transports: tuple[str, ...] | None = None) -> dict[str, Any]:
    """See the module doc. quick: sizes (1, 16, 64) MiB, TTFT on shm only (same prompt length).
    `engine` overrides EngineConfig fields of the TTFT clusters; `transports` limits the
    bandwidth part (default: all)."""
    sizes = tuple(sizes_mib or (QUICK_SIZES_MIB if quick else FULL_SIZES_MIB))
    ttft_transports = tuple(ttft_transports or (("shm",) if quick else TTFT_TRANSPORTS))
    load_before = os.getloadavg()[0]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        # its quick=True fixes the sizes (1, 16, 64) and 3 repeats; explicit sizes get 5
        kw = {"transports": transports} if transports else {}
        out: dict[str, Any] = run_transfer_bench(quick=True, **kw) \
            if quick and sizes_mib is None else run_transfer_bench(sizes, **kw)
        out["quick"], out["model"] = quick, model
        best = out.get("best_transport") or "shm"
        order = sorted(ttft_transports, key=lambda t: t != best)   # best first
        rng = random.Random(seed)
        per_transport: dict[str, dict] = {}
        errors: dict[str, str] = {}
        devices: set[str] = set()
        for i, transport in enumerate(order):
            cluster = PDCluster(PDConfig(
                engine={**(engine or {}), "model": model}, num_prefill=1, num_decode=1,
                flow=FlowConfig(transport=transport, policy="round_robin",
                                local_prefill_when_backlogged=False)))   # every prefill on P
            try:
                devices.update(i.get("device", "cpu") for i in cluster.info)
                warmup, prompt = (random_prompt(rng, ttft_prompt_tokens) for _ in range(2))
                per_transport[transport] = _ttft_share(cluster, prompt, warmup)
                if i == 0:
                    out.update(_delta_saving(cluster, random_prompt(rng, ttft_prompt_tokens)))
                    out["delta_transport"] = transport
                cluster.check_invariants()
            except Exception as exc:   # one broken transport must not hide the others
                errors[transport] = f"{type(exc).__name__}: {exc}"
            finally:
                cluster.shutdown()
        measured = best if best in per_transport else next(iter(per_transport), None)
        share = per_transport[measured]["share"] if measured else math.nan
        out.update({
            # named by the prompt length measured (2048 by default), as on the GPU path
            f"transfer_share_of_ttft_{ttft_prompt_tokens}": share,
            "ttft_transport": measured,
            "ttft_prompt_tokens": ttft_prompt_tokens,
            f"ttft_{ttft_prompt_tokens}": per_transport.get(measured, {}),
            "ttft_share_by_transport": {t: r["share"] for t, r in per_transport.items()},
            "ttft_by_transport": per_transport,
            "ttft_errors": errors,
            "ttft_timing": "lifecycle on the decode worker: transfer_s = pull into its kv_cache; "
                           "ttft_s = its admission -> first token (prefill + transfer + calls); "
                           "non_compute_share = (ttft_s - P's model-step seconds) / ttft_s",
        })
        out.setdefault("delta_bytes_saved_ratio", math.nan)
        # the bandwidth part moves CPU tensors; the TTFT clusters' pools are where they report
        out["ttft_worker_devices"] = sorted(devices)
        out["evidence"] = "gpu-measured" if devices == {"cuda"} else "cpu-measured"
        out["loadavg_1m"] = [load_before, os.getloadavg()[0]]   # others share this machine
    finally:
        if started:
            ray.shutdown()
    return out


GPU_SIZES_MIB = (64, 256, 512)


@ray.remote(num_cpus=0)
class _GpuPeer:
    """One end of the GPU bandwidth bench: KV caches of the model's block shape on its GPU."""

    def __init__(self, block_shape: tuple[int, ...], dtype: str) -> None:
        import torch

        from kvtransfer.endpoint import KVConsumer, KVProducer
        self.torch = torch
        self.block_shape, self.dtype = block_shape, getattr(torch, dtype)
        self.producer = KVProducer("cuda_ipc", lease_s=300, device="cuda")
        self.consumer = KVConsumer("cuda_ipc")
        self.caches: dict[int, object] = {}

    def prepare(self, num_blocks: int, fill: bool) -> int:
        t = self.torch
        layers, two, *rest = self.block_shape
        shape = (layers, two, num_blocks, *rest)
        self.caches[num_blocks] = (t.randn(shape, device="cuda").to(self.dtype) if fill
                                   else t.zeros(shape, dtype=self.dtype, device="cuda"))
        return self.caches[num_blocks].nbytes

    def offer(self, num_blocks: int):
        return self.producer.offer_blocks("bench", self.caches[num_blocks], range(num_blocks),
                                          range(num_blocks))

    def ack(self, transfer_id: str) -> bool:
        return self.producer.ack(transfer_id)

    def pull(self, handle) -> tuple[float, dict[str, float]]:
        """(seconds of the pull, its seconds by phase: CudaIpcTransport.last_phases)."""
        kv = self.caches[handle.num_blocks]
        seconds = self.consumer.pull_into(handle, kv, range(handle.num_blocks)).seconds
        return seconds, dict(self.consumer.transport_for(handle).last_phases)

    def device_copy_s(self, num_blocks: int, repeats: int) -> float:
        """Median seconds of a device-to-device copy_ of the same bytes (one warm-up)."""
        import statistics
        import time
        t = self.torch
        src = self.caches[num_blocks]
        dst = t.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            t.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            t.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def device_name(self) -> str:
        return self.torch.cuda.get_device_name(0)


def block_shape_of(model: str, block_size: int = 16) -> tuple[tuple[int, ...], str]:
    """([num_layers, 2, block_size, kv_heads, head_dim], dtype) of `model`'s KV pages in bf16."""
    from workers.random_model import PREFIX, SHAPES
    if model.startswith(PREFIX):
        cfg = SHAPES[model.removeprefix(PREFIX)]
        layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        from workers.model_loader import base_config
        c = base_config(model)
        layers, heads = c.num_hidden_layers, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (layers, 2, block_size, heads, head_dim), "bfloat16"


def run_gpu_transfer_bench(model: str = "random:llama3-8b", ttft_prompt_tokens: int = 4096,
                           sizes_mib: tuple[int, ...] = GPU_SIZES_MIB, repeats: int = 5,
                           seed: int = 0) -> dict[str, Any]:
    """See the module doc; a clear `error` (and nothing measured) without a GPU."""
    import torch
    out: dict[str, Any] = {"model": model, "device": "cuda", "transport": "cuda_ipc",
                           "repeats": repeats}
    if not torch.cuda.is_available():   # before starting anything
        out["error"] = "no GPU: torch sees no GPU in this process; run without --device cuda"
        return out
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus < 1:
            out["error"] = "no GPU: Ray sees no GPU on this machine; run without --device cuda"
            return out
        shape, dtype = block_shape_of(model)
        block_bytes = 2 * math.prod(shape)   # bf16
        producer = _GpuPeer.options(num_gpus=0.5).remote(shape, dtype)
        consumer = _GpuPeer.options(num_gpus=0.5).remote(shape, dtype)
        try:
            out["device_name"] = ray.get(consumer.device_name.remote())
            ipc, copy, nbytes, phases_ms = {}, {}, {}, {}
            for mib in sizes_mib:
                n = max(1, mib * (1 << 20) // block_bytes)
                ray.get([producer.prepare.remote(n, True), consumer.prepare.remote(n, False)])
                times, phases = [], []
                for _ in range(repeats + 1):
                    handle = ray.get(producer.offer.remote(n))
                    seconds, split = ray.get(consumer.pull.remote(handle), timeout=120)
                    times.append(seconds)
                    phases.append(split)
                    ray.get(producer.ack.remote(handle.transfer_id))
                phases_ms[str(mib)] = {k: 1e3 * statistics.median(p[k] for p in phases[1:])
                                       for k in phases[1]}
                copy_s = ray.get(consumer.device_copy_s.remote(n, repeats))
                nbytes[str(mib)] = n * block_bytes
                ipc[str(mib)] = n * block_bytes / statistics.median(times[1:]) / 1e9
                copy[str(mib)] = n * block_bytes / copy_s / 1e9
        finally:
            for a in (producer, consumer):
                ray.kill(a)
        ref = str(max(sizes_mib))
        out.update(block_shape=list(shape), dtype=dtype, transfer_bytes=nbytes,
                   transfer_gbps=ipc, device_copy_gbps=copy,
                   transfer_vs_device_copy=ipc[ref] / copy[ref], reference_size_mib=int(ref),
                   pull_phases_ms=phases_ms,
                   timing="cuda_ipc: D's pull_into (map + device-to-device copy into its "
                          "kv_cache + stream sync; pull_phases_ms splits it: map, copy, "
                          "release, checks); device copy: copy_ of the same bytes")
        bs = 16
        num_blocks = 3 * cdiv(ttft_prompt_tokens + 2, bs) + 16
        cluster = PDCluster(PDConfig(engine={"model": model, "device": "cuda", "num_blocks": num_blocks,
                    "max_num_batched_tokens": ttft_prompt_tokens, "max_num_seqs": 8}, num_prefill=1, num_decode=1, num_gpus_per_worker=0.5, flow=FlowConfig(transport="cuda_ipc", policy="round_robin",
                                    local_prefill_when_backlogged=False)))
        try:
            rng = random.Random(seed)
            warmup, prompt = (random_prompt(rng, ttft_prompt_tokens) for _ in range(2))
            share = _ttft_share(cluster, prompt, warmup)
            stats = ray.get([w.stats.remote() for w in cluster.workers])
            cluster.check_invariants()
        finally:
            cluster.shutdown()
        out.update({f"transfer_share_of_ttft_{ttft_prompt_tokens}": share["share"],
                    "ttft_prompt_tokens": ttft_prompt_tokens, "ttft": share,
                    "worker_devices": sorted({s["device"] for s in stats}),
                    "evidence": "gpu-measured" if all(s["device"] == "cuda" for s in stats)
                    else "cpu-measured"})
    finally:
        if started:
            ray.shutdown()
    return out


