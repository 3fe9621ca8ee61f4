"""First-contact step (c): one prefill and one decode worker on the one GPU, KV over cuda_ipc,
with Ray: greedy tokens equal to transformers' `generate()` for `tiny`; then P's
`torch.cuda.memory_reserved()` across 20 transfers staged, handed out (the handle pickled, as a
real transfer does) and left to expire unpulled. Flat means: after the 20th no more than one
staging above the first (one freed staging may stay cached by torch's allocator); a staging
kept in torch's IPC limbo grows it by 20.

    python scripts/gpu/disagg_ipc.py OUT.json
    RAYPD_GPU_DEVICE=cpu: the dry run's stand-in: CPU workers over shm; the check is then that
    every lease expired and none is active (host memory is not what the target is about)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from step_io import device, dry_run, run_step  # noqa: E402

ROUNDS = 20
STAGED_MIB = 32


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(50)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 70)]


def greedy_1p1d() -> dict:
    from cluster.pd import PDCluster, PDConfig
    from router.orchestrator import FlowConfig
    from workers.model_loader import load_model
    from workers.request import SamplingParams
    transport = "shm" if dry_run() else "cuda_ipc"
    reference = load_model("tiny", "float32")[0].to(device())
    cluster = PDCluster(PDConfig(engine={"model": "tiny", "num_blocks": 256, "device": device()},
                                 num_gpus_per_worker=0 if dry_run() else 0.5,
                                 flow=FlowConfig(transport=transport)))
    cases = []
    try:
        for p in prompts():
            out = cluster.run_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
            with torch.inference_mode():
                ids = torch.tensor([p], device=reference.device)
                ref = reference.generate(ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=16, do_sample=False, pad_token_id=0)
            ref_ids = ref[0, len(p):].tolist()
            cases.append({"prompt_len": len(p), "equal": out.token_ids[:len(ref_ids)] == ref_ids,
                          "transfer_bytes": out.lifecycle.transfer_bytes})
        cluster.check_invariants()
        devices = sorted({i["device"] for i in cluster.info})
    finally:
        cluster.shutdown()
    return {"ok": all(c["equal"] and c["transfer_bytes"] > 0 for c in cases),
            "transport": transport, "worker_devices": devices, "cases": cases}


def staged_then_expired() -> dict:
    import ray

    @ray.remote(num_cpus=0, num_gpus=0 if dry_run() else 0.5)
    class Stager:
        """P's side alone: a KVProducer staging blocks of a KV-shaped tensor under a lease."""

        def __init__(self, dev: str, transport: str):
            from kvtransfer.endpoint import KVProducer
            self.dev = torch.device(dev)
            cfg = {"device": dev} if transport == "cuda_ipc" else {}
            self.producer = KVProducer(transport, lease_s=1.0, **cfg)
            # [layers, k/v, blocks, block_size, heads, head_dim] in bf16: 32 blocks = 32 MiB
            self.kv = torch.zeros(16, 2, 64, 16, 8, 128, dtype=torch.bfloat16, device=self.dev)

        def offer(self, i: int):
            return self.producer.offer_blocks(f"r{i}", self.kv, list(range(32)), list(range(32)))

        def expire_all(self) -> dict:
            self.producer.expire(now=time.monotonic() + 3600)
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
                reserved = torch.cuda.memory_reserved(self.dev)
            else:
                reserved = int(Path("/proc/self/statm").read_text().split()[1]) * 4096
            s = self.producer.stats()
            return {"reserved": reserved, "active": s.active, "expired": s.expired}

    transport = "shm" if dry_run() else "cuda_ipc"
    stager = Stager.remote(device(), transport)
    reserved, last = [], {}
    for i in range(ROUNDS):
        handle = ray.get(stager.offer.remote(i))   # pickled out of P: the IPC export exists
        del handle                                  # never pulled
        last = ray.get(stager.expire_all.remote())
        reserved.append(last["reserved"])
    ray.kill(stager)
    growth = reserved[-1] - reserved[0]
    leases_ok = last["active"] == 0 and last["expired"] == ROUNDS
    flat = growth <= STAGED_MIB * 2**20
    return {"ok": leases_ok and (flat or dry_run()), "transport": transport,
            "measure": "host RSS (stand-in)" if dry_run() else "torch.cuda.memory_reserved",
            "reserved_first": reserved[0], "reserved_last": reserved[-1], "growth": growth,
            "flat": flat, "staged_bytes_each": STAGED_MIB * 2**20, "leases": last}


def main() -> dict:
    import ray
    if not dry_run() and not torch.cuda.is_available():
        return {"ok": False, "error": "torch sees no GPU"}
    ray.init(num_cpus=4, num_gpus=0 if dry_run() else 1, include_dashboard=False,
             log_to_driver=False)
    try:
        greedy = greedy_1p1d()
        memory = staged_then_expired()
    finally:
        ray.shutdown()
    return {"ok": greedy["ok"] and memory["ok"], "greedy_1p1d": greedy,
            "staged_then_expired": memory}


if __name__ == "__main__":
    sys.exit(run_step(main))
