"""`raypd bench chaos`: replay requests on 2 prefill + 2 decode workers while killing random
workers; count what completed, what failed explicitly, what was lost, and leaked blocks.

Greedy outputs of completed requests are checked against a single in-process engine.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import ray

from cluster.pd import PDCluster, PDConfig
from workers.request import SamplingParams


def _workload(n: int, seed: int, vocab: int) -> list[list[int]]:
    """Requests in a few shared-prefix groups (so prefix caches and transfers both matter)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.choice((32, 48, 64)))]
                for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))]
            for _ in range(n)]


def run_chaos_bench(kills: int = 5, model: str = "tiny", requests: int = 60,
                    max_tokens: int = 48, seed: int = 0, timeout_s: float = 600.0,
                    transport: str = "object_store") -> dict:
    from workers.engine import EngineConfig, LLMEngine
    from workers.model_loader import load_model

    loaded = load_model(model)
    vocab = min(loaded[2].vocab_size, 30000)
    prompts = _workload(requests, seed, vocab)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=model, num_blocks=2048), loaded=loaded)
    reference = [r.output_token_ids for r in engine.generate(prompts, sampling)]

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    cluster = PDCluster(PDConfig(engine=dict(model=model, num_blocks=512), num_prefill=2,
                                 num_decode=2, transport=transport, lease_s=2.0,
                                 max_restarts=kills + 2, max_retries=3))
    rng = random.Random(seed + 1)
    killed: list[str] = []
    done = threading.Event()
    finished = [0]
    progress = threading.Condition()

    def killer() -> None:
        """Kill a random worker each time another 1/(kills+1) of the requests has finished,
        so every kill lands while requests are in flight, however fast the machine is."""
        for k in range(1, kills + 1):
            with progress:
                progress.wait_for(lambda k=k: done.is_set()
                                  or finished[0] >= k * len(prompts) // (kills + 1))
            if done.is_set():
                return
            victim = rng.choice(cluster.workers)
            killed.append(cluster.orchestrator._id.get(victim, "?"))
            ray.kill(victim, no_restart=False)

    results: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = cluster.run_request(prompts[i], sampling)
        except Exception as e:   # an explicit error is an outcome, not a loss
            results[i] = {"error": f"{type(e).__name__}: {e}"}
        with progress:
            finished[0] += 1
            progress.notify_all()

    t0 = time.perf_counter()
    k = threading.Thread(target=killer, daemon=True)
    k.start()
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        wait(futures, timeout=timeout_s)
        with progress:
            done.set()
            progress.notify_all()
        for i in range(len(prompts)):   # still running past the deadline: lost
            if results[i] is None:
                cluster.abort(str(i))
    k.join()
    wall = time.perf_counter() - t0

    ok = [i for i, r in enumerate(results) if r is not None and "error" not in r]
    failed = [i for i, r in enumerate(results) if r is not None and "error" in r]
    mismatches = sum(results[i]["token_ids"] != reference[i] for i in ok)

    # drain: leases expire, restarted workers come back; then count referenced blocks
    leaked = None
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            cluster.expire_leases()
            leaked = sum(c["referenced"] for c in cluster.check_invariants())
            if leaked == 0:
                break
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.5)
    out = {"model": model, "kills": kills, "killed": killed,
           "requests_total": len(prompts), "requests_ok": len(ok),
           "requests_failed_explicit": len(failed),
           "requests_lost": len(prompts) - len(ok) - len(failed),
           "leaked_blocks": leaked, "greedy_mismatches": mismatches,
           "retries": cluster.orchestrator.retries, "wall_s": wall,
           "errors": sorted({results[i]["error"].split(":")[0] for i in failed})}
    cluster.shutdown()
    if started_ray:
        ray.shutdown()
    return out
