"""First-contact step (b): the engine's greedy tokens equal transformers' `generate()` on the same
device, without Ray, for `tiny` and `random:smollm2-135m` (SmolLM2's shape, tied embeddings),
both in float32; on cuda with CUDA graphs on and off.

    python scripts/gpu/greedy.py OUT.json     (RAYPD_GPU_DEVICE=cpu: the dry run's stand-in)

The reference is an independent copy of the same weights (tiny: the same seed; random: the same
name, seed and device), so a difference can only come from the engine's own computation."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from step_io import device, dry_run, run_step  # noqa: E402

MODELS = ("tiny", "random:smollm2-135m")   # RAYPD_GPU_GREEDY_MODELS=a,b: others (the tests: tiny)
EOS = 2   # tiny's and the random models' eos id: generate() stops after it


def prompts() -> list[list[int]]:
    """Token ids in [3, 256): valid in every model's vocabulary."""
    lengths = (5, 40, 90) if dry_run() else (3, 17, 64, 128, 200)
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def reference_model(model: str, dev: torch.device):
    from workers.model_loader import load_model
    from workers.random_model import build_random, is_random
    if is_random(model):
        return build_random(model, "float32", dev)[0]
    return load_model(model, "float32")[0].to(dev)


def hf_greedy(reference, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=reference.device)
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def agrees(engine_ids: list[int], hf_ids: list[int]) -> bool:
    """generate() stops after EOS where the engine (ignore_eos) goes on: compare its length."""
    if len(hf_ids) < len(engine_ids) and (not hf_ids or hf_ids[-1] != EOS):
        return False
    return engine_ids[:len(hf_ids)] == hf_ids


def one_case(model: str, graphs: bool, reference, n: int) -> dict:
    from workers.engine import EngineConfig, LLMEngine
    from workers.request import SamplingParams
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device=device(),
                                    num_blocks=256, block_size=16, cuda_graphs=graphs))
    reqs = engine.generate(prompts(), SamplingParams(max_tokens=n, ignore_eos=True))
    engine.check_invariants()
    mismatches = []
    for r in reqs:
        ref = hf_greedy(reference, r.prompt_token_ids, n)
        if not agrees(r.output_token_ids, ref):
            first = next((i for i, (a, b) in enumerate(zip(r.output_token_ids, ref,
                                                           strict=False)) if a != b), None)
            mismatches.append({"prompt_len": len(r.prompt_token_ids), "first_diff": first,
                               "engine": r.output_token_ids, "generate": ref})
    stats = engine.get_stats()
    return {"model": model, "cuda_graphs": graphs, "ok": not mismatches,
            "requests": len(reqs), "mismatches": mismatches,
            "model_impl": stats.get("model_impl"), "engine_device": stats.get("device"),
            "fused_ops": stats.get("fused_ops"),
            "cuda_graph_replays": stats.get("cuda_graph_replays"),
            "seconds": round(time.perf_counter() - t, 2)}


def main() -> dict:
    dev = torch.device(device())
    n = 12 if dry_run() else 24
    cases = []
    models = os.environ.get("RAYPD_GPU_GREEDY_MODELS", ",".join(MODELS)).split(",")
    for model in models:
        reference = reference_model(model, dev)
        for graphs in ((False,) if dry_run() else (True, False)):
            cases.append(one_case(model, graphs, reference, n))
        del reference
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


if __name__ == "__main__":
    sys.exit(run_step(main))
